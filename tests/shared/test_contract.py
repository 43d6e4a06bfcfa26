"""The message contract: codec round trips, validation at the boundary, subject map, config layers."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
import typing
from pathlib import Path

import msgpack
import msgspec
import pytest

from shared.config import ConfigError, load_config, save_config
from shared.messages import (
    MAX_MESSAGE_BYTES,
    MESSAGES,
    BadMessage,
    DeadLetter,
    EnvStep,
    EpisodeJob,
    GenerateReply,
    Trajectory,
    TurnInfo,
    decode,
    encode,
)
from shared.subjects import Subjects

REPO = Path(__file__).resolve().parents[2]


def make_traj(**kw) -> Trajectory:
    base = dict(episode_id="e1", group_id="g1", task="db", task_id="t1", split="train", group_size=2,
                tokens=[1, 2, 3, 4], logprobs=[0.0, 0.0, -0.5, -1.25], loss_mask=[0, 0, 1, 1], prompt_len=2,
                turns=[TurnInfo(start=2, end=4, engine_id="hf-a", policy_version=3)], reward=1.0,
                status="completed", replica_id="r1", metrics={"turns": 1.0})
    base.update(kw)
    return Trajectory(**base)


def test_trajectory_round_trip_keeps_every_field() -> None:
    traj = make_traj()
    back = decode(encode(traj), Trajectory)
    assert back == traj
    assert back.turns[0].policy_version == 3 and back.min_policy_version == 3


def test_wrong_kind_version_and_types_are_refused_with_reasons() -> None:
    job = EpisodeJob(episode_id="e", group_id="g", task="db", task_id="t")
    with pytest.raises(BadMessage, match="expected kind 'trajectory'"):
        decode(encode(job), Trajectory)
    body = msgpack.unpackb(encode(job))
    body["v"] = 99
    with pytest.raises(BadMessage, match="unsupported schema version 99"):
        decode(msgpack.packb(body), EpisodeJob)
    body["v"] = 1
    body["group_size"] = "four"
    with pytest.raises(BadMessage, match=r"episode_job.group_size: expected an integer, got str"):
        decode(msgpack.packb(body), EpisodeJob)
    del body["task"]
    body["group_size"] = 4
    with pytest.raises(BadMessage, match="missing field 'task'"):
        decode(msgpack.packb(body), EpisodeJob)
    with pytest.raises(BadMessage, match="not msgpack"):
        decode(b"\xc1\xc1", EpisodeJob)
    with pytest.raises(BadMessage, match="not msgpack"):  # a list with trailing bytes: malformed first
        decode(b"\x93garbage", EpisodeJob)
    with pytest.raises(BadMessage, match="expected a msgpack map"):
        decode(msgpack.packb([1, 2]), EpisodeJob)


def test_nested_and_list_validation() -> None:
    body = msgpack.unpackb(encode(make_traj()))
    body["tokens"] = [1, 2, "x", 4]
    with pytest.raises(BadMessage, match=r"trajectory.tokens\[2\]: expected an integer, got str"):
        decode(msgpack.packb(body), Trajectory)
    body = msgpack.unpackb(encode(make_traj()))
    body["turns"][0]["policy_version"] = 1.5
    with pytest.raises(BadMessage, match=r"turns\[0\].policy_version"):
        decode(msgpack.packb(body), Trajectory)
    body = msgpack.unpackb(encode(make_traj()))
    body["loss_mask"] = [0, 1]
    with pytest.raises(BadMessage, match="lengths differ"):
        decode(msgpack.packb(body), Trajectory)


def test_decode_errors_name_the_field_path() -> None:
    body = msgpack.unpackb(encode(make_traj()))
    body["metrics"] = {"turns": "one"}
    with pytest.raises(BadMessage, match=r"^trajectory\.metrics\[\.\.\.\]: expected a number, got str"):
        decode(msgpack.packb(body), Trajectory)
    body["metrics"] = {1: 1.0}
    with pytest.raises(BadMessage, match=r"^trajectory\.metrics key: expected str, got int"):
        decode(msgpack.packb(body), Trajectory)
    body = msgpack.unpackb(encode(make_traj()))
    del body["turns"][0]["engine_id"]
    with pytest.raises(BadMessage, match=r"^trajectory\.turns\[0\]: missing field 'engine_id'"):
        decode(msgpack.packb(body), Trajectory)
    del body["kind"]
    with pytest.raises(BadMessage, match="expected kind 'trajectory', got None"):  # never guessed
        decode(msgpack.packb(body), Trajectory)


@pytest.mark.parametrize(("field", "value", "reason"), [
    ("tokens", [1, -2, 3, 4], r"trajectory\.tokens\[1\]: expected an integer >= 0"),
    ("tokens", [1, 2.0, 3, 4], r"trajectory\.tokens\[1\]: expected an integer, got float"),
    ("loss_mask", [0, 0, 2, 1], r"trajectory\.loss_mask\[2\]: expected an integer <= 1"),
    ("loss_mask", [0, -1, 1, 1], r"trajectory\.loss_mask\[1\]: expected an integer >= 0"),
    ("logprobs", [0.0, 0.0, float("nan"), -1.0], r"trajectory\.logprobs\[2\]: expected a finite number"),
    ("logprobs", [0.0, 0.0, float("-inf"), -1.0], r"trajectory\.logprobs\[2\]: expected a finite number"),
    ("logprobs", [0.0, 0.0, 0.25, -1.0], r"trajectory\.logprobs\[2\]: expected a number <= 0\.0"),
    ("logprobs", [0.0, 0.0, float("inf"), -1.0], r"trajectory\.logprobs\[2\]: expected a number <= 0\.0"),
    ("logprobs", [0.0, -0.5, -1.25], r"tokens/logprobs/loss_mask lengths differ \(4/3/4\)"),
    ("turns", [{"start": 2, "end": 5, "engine_id": "e", "policy_version": 0}], r"turns\[0\] spans \[2, 5\)"),
    ("turns", [{"start": 3, "end": 2, "engine_id": "e", "policy_version": 0}], r"turns\[0\] spans \[3, 2\)"),
    ("turns", [{"start": 0, "end": 1, "engine_id": "e", "policy_version": 0},
               {"start": -1, "end": 2, "engine_id": "e", "policy_version": 0}], r"turns\[1\] spans \[-1, 2\)"),
])
def test_each_constraint_refuses_a_bad_value(field: str, value: object, reason: str) -> None:
    body = msgpack.unpackb(encode(make_traj()))
    body[field] = value
    with pytest.raises(BadMessage, match=reason) as err:
        decode(msgpack.packb(body), Trajectory)
    assert err.value.code == 400


def test_constraints_admit_the_edges() -> None:
    traj = make_traj(tokens=[0, 2, 3, 4], logprobs=[0.0, -0.0, -1e300, -1], loss_mask=[0, 0, 1, 1],
                     turns=[TurnInfo(start=4, end=4, engine_id="oracle", policy_version=-1)])
    back = decode(encode(traj), Trajectory)
    assert back == traj and back.logprobs == [0.0, 0.0, -1e300, -1.0] and back.min_policy_version == -1
    body = msgpack.unpackb(encode(GenerateReply(tokens=[5], logprobs=[0.0], finish_reason="stop", engine_id="e",
                                                policy_version=0)))
    body["logprobs"].append(-1.0)
    with pytest.raises(BadMessage, match="generate_reply: tokens/logprobs lengths differ"):
        decode(msgpack.packb(body), GenerateReply)


def test_versions_unknown_fields_and_every_message_type() -> None:
    traj = make_traj()
    body = msgpack.unpackb(encode(traj))
    body["added_by_a_newer_writer"] = {"x": [1, 2]}
    body["turns"][0]["also_new"] = 1
    assert decode(msgpack.packb(body), Trajectory) == traj  # forward compatible
    for cls in MESSAGES:
        field_v = next(f for f in msgspec.structs.fields(cls) if f.name == "v")
        assert field_v.default == cls.VERSION, f"{cls.__name__}: v's default must be its VERSION"
        assert list(msgpack.unpackb(encode(decode(msgpack.packb({"kind": cls.KIND, "v": 1, **REQUIRED[cls]}),
                                                  cls))))[:2] == ["kind", "v"]


SMALLEST = {str: "x", int: 1, float: 0.0, bool: False, bytes: b"", list: [], dict: {}}


def _plain(hint: object) -> object:
    """The type under constraints: ``Annotated[str, Meta(...)]`` -> str."""
    if typing.get_origin(hint) is typing.Annotated:
        hint = typing.get_args(hint)[0]
    return typing.get_origin(hint) or hint


REQUIRED = {cls: {f.name: SMALLEST[_plain(f.type)] for f in msgspec.structs.fields(cls) if f.required}
            for cls in MESSAGES}
"""The smallest valid body of each message type."""


def test_wire_compatible_with_the_legacy_codec() -> None:
    """Bytes from the codec in an earlier version decode with this one and the other way round; both write
    the same bytes (bench/bench_codec.py holds the legacy codec verbatim), except the fields added since
    (a trajectory's ``level``, ``task_kind``, ``messages`` and ``tools``, its turns' ``weights_digest``, a job's
    ``policy_version``), which old readers skip as unknown."""
    legacy = importlib.import_module("bench.bench_codec")
    turns = [dict(start=2, end=4, engine_id="hf-a", policy_version=3)]
    fields = dict(episode_id="e1", group_id="g1", task="db", task_id="t1", split="train", group_size=2,
                  tokens=[1, 2, 3, 4], logprobs=[0.0, 0.0, -0.5, -1.25], loss_mask=[0, 0, 1, 1], prompt_len=2,
                  reward=1.0, status="completed", replica_id="r1", metrics={"turns": 1.0}, created_at=12.5)
    pairs = [
        (Trajectory(**fields, turns=[TurnInfo(**t) for t in turns]),
         legacy.LegacyTrajectory(**fields, turns=[legacy.LegacyTurnInfo(**t) for t in turns])),
        (EpisodeJob(episode_id="e", group_id="g", task="db", task_id="t", created_at=1.0),
         legacy.LegacyEpisodeJob(episode_id="e", group_id="g", task="db", task_id="t", created_at=1.0)),
        (DeadLetter(origin_subject="s", reason="r", payload=b"\x00\xff", service="x", ts=2.0),
         legacy.LegacyDeadLetter(origin_subject="s", reason="r", payload=b"\x00\xff", service="x", ts=2.0)),
        (EnvStep(finish=False, reward=1, status="running", messages=[{"role": "tool", "content": "ok"}]),
         legacy.LegacyEnvStep(finish=False, reward=1, status="running", messages=[{"role": "tool", "content": "ok"}])),
    ]
    added = {"trajectory": {"level": 0, "task_kind": "", "messages": [], "tools": [],
                            "turns": [dict(t, weights_digest="") for t in turns]},
             "episode_job": {"policy_version": -1}}
    for new, old in pairs:
        new_body, old_body = msgpack.unpackb(encode(new)), msgpack.unpackb(legacy.legacy_encode(old))
        assert new_body == {**old_body, **added.get(old_body["kind"], {})}
        assert list(new_body)[: len(old_body)] == list(old_body)  # same keys in the same order, new ones after
        if old_body["kind"] not in added:
            assert encode(new) == legacy.legacy_encode(old)
        assert decode(legacy.legacy_encode(old), type(new)) == new
        assert legacy.legacy_decode(encode(new), type(old)) == old


def test_oversize_is_refused_both_ways() -> None:
    big = make_traj(tokens=list(range(MAX_MESSAGE_BYTES // 2)), logprobs=[0.0] * (MAX_MESSAGE_BYTES // 2),
                    loss_mask=[0] * (MAX_MESSAGE_BYTES // 2))
    with pytest.raises(BadMessage) as err:
        encode(big)
    assert err.value.code == 413
    with pytest.raises(BadMessage, match="limit"):
        decode(b"\x00" * (MAX_MESSAGE_BYTES + 1), Trajectory)


def test_decode_raises_only_bad_message_however_deep_or_many_the_containers() -> None:
    """msgpack nested 1,000 deep (1,001 bytes) made msgspec raise RecursionError; every message type now
    refuses it, as the top-level value, inside a field it decodes without a schema, and in a field it does
    not know, with a BadMessage; so do millions of empty containers and every truncation of them."""
    nested = b"\x91" * 1000 + b"\x00"
    for cls in MESSAGES:
        field = msgspec.msgpack.encode({"kind": cls.KIND, "v": 1})
        unknown = b"\x83" + field[1:] + msgspec.msgpack.encode("not_a_field") + nested
        for data in (nested, unknown, nested[:500], b"\xdd\xff\xff\xff\xff" + b"\x90" * 3):
            with pytest.raises(BadMessage):
                decode(data, cls)
    step = msgspec.msgpack.encode({"kind": "env_step", "v": 1, "finish": False, "reward": 0.0, "status": "s",
                                   "messages": [{"content": 1}]})
    deep_field = step.replace(b"\x81\xa7content\x01", b"\x81\xa7content" + b"\x91" * 64 + b"\x01")
    with pytest.raises(BadMessage, match="env_step.messages: nested more than 64 arrays or maps deep"):
        decode(deep_field, EnvStep)
    shallow = step.replace(b"\x81\xa7content\x01", b"\x81\xa7content" + b"\x91" * 60 + b"\x01")
    assert decode(shallow, EnvStep).messages[0]["content"] == nest_lists(60, [1])  # 63 deep in all: accepted
    many = step.replace(b"\x81\xa7content\x01", b"\x81\xa7content\xdd" + (200_000).to_bytes(4, "big")
                        + b"\x90" * 200_000)
    with pytest.raises(BadMessage, match="more than 100000 arrays and maps"):
        decode(many, EnvStep)


def test_shape_walk_counts_scalar_runs_across_container_ends() -> None:
    """The walk matches runs of scalars in one go; a run that ends a container and goes on in the one
    around it must still close each at the right place (a wrong count would misjudge the depth)."""
    from shared.msgshape import shape_error
    value = {"a": [[1, 2.5, None, True, -3, 70000], 4, [[[5]]]], "b": [b"x" * 300, "y" * 40, [6, 7] * 30]}
    assert shape_error(msgspec.msgpack.encode(value)) is None
    for depth in (1, 10, 64):
        assert shape_error(msgspec.msgpack.encode(nest_lists(depth, [1, 2, 3]) + [4])) is None
    assert "nested more than 64" in shape_error(msgspec.msgpack.encode(nest_lists(65, [1]) + [2]))
    assert shape_error(msgspec.msgpack.encode([nest_lists(63, [1]), *range(100)])) is None
    assert shape_error(msgspec.msgpack.encode([1, 2, 3] * 5 + [nest_lists(63, [1])])) is None  # 64 deep
    assert shape_error(msgspec.msgpack.encode([1, 2, 3] * 5 + [nest_lists(64, [1])])) is not None  # 65
    assert shape_error(b"\xc1") is None and shape_error(b"") is None  # not msgpack: the decoder says so


def nest_lists(depth: int, inner: list) -> list:
    value = inner
    for _ in range(depth - 1):
        value = [value]
    return value


def test_subjects_are_namespaced_and_tokens_checked() -> None:
    s = Subjects("run1")
    assert s.traj("db") == "run1.traj.db"
    assert s.action("os", "ep-1") == "run1.act.os.ep-1"
    assert s.jobs_stream == "RUN1_JOBS"
    assert s.env_interact("db", "env-db-h-1") == "run1.env.db.env-db-h-1.interact"
    with pytest.raises(ValueError):
        Subjects("bad.prefix")


def test_object_store_internals_match_the_client() -> None:
    """read_object bypasses nats-py's ObjectStore; its names must be the ones the client writes."""
    from nats.js import object_store

    bucket = Subjects("run1").weights_bucket
    assert Subjects.object_stream(bucket) == object_store.OBJ_STREAM_TEMPLATE.format(bucket=bucket)
    assert Subjects.object_chunks(bucket, "N1") == object_store.OBJ_CHUNKS_PRE_TEMPLATE.format(bucket=bucket, obj="N1")


def test_config_layers_and_errors(tmp_path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[trainer]\nlr = 0.001\nsteps = 5\n[run]\ntasks = { db = 0.5, os = 0.5 }\n')
    cfg = load_config(path, ["trainer.steps=7", "--controller.group_size=8"],
                      environ={"JETRL__TRAINER__SHARED_PREFIX": "false", "JETRL__RUN__SEED": "3"})
    assert cfg.trainer.lr == 0.001 and cfg.trainer.steps == 7 and cfg.controller.group_size == 8
    assert cfg.trainer.shared_prefix is False and cfg.run.seed == 3
    assert cfg.run.tasks == {"db": 0.5, "os": 0.5}
    with pytest.raises(ConfigError, match="unknown config key trainer.learning_rate"):
        load_config(None, ["trainer.learning_rate=1"], environ={})
    with pytest.raises(ConfigError, match="cannot read 'abc'"):
        load_config(None, ["trainer.steps=abc"], environ={})
    path.write_text('[trainer]\nsteps = "many"\n')
    with pytest.raises(ConfigError, match="trainer.steps: expected int"):
        load_config(path, environ={})


@pytest.mark.parametrize("path", sorted((Path(__file__).resolve().parents[2] / "configs").glob("*.toml")),
                         ids=lambda p: p.name)
def test_every_shipped_config_loads_and_its_task_settings_hold(path: Path) -> None:
    """The configs the README and the benchmarks name: every key known, every value in range, every task's
    settings valid (what `jetrl up` checks before it starts anything)."""
    from shared.tasks import check_sections

    cfg = load_config(path, environ={})
    assert cfg.run.tasks
    check_sections(cfg.env, list(cfg.run.tasks))


def test_config_task_sections_in_every_form(tmp_path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[env]\nmax_sessions = 8\n[env.db]\nlevels = [1, 2]\n[env.os]\nbackend = "docker"\n'
                    '[env.webshop]\nmax_observation_chars = 3000\n')
    cfg = load_config(path, ["--env.kg.seed=5", "env.alfworld.snap-actions=false"],
                      environ={"JETRL__ENV__DB__MAX_ROWS": "10", "JETRL__ENV__OS__CPUS": "2"})
    assert cfg.env.max_sessions == 8 and cfg.env.db.levels == [1, 2] and cfg.env.db.max_rows == 10
    assert cfg.env.os.backend == "docker" and cfg.env.os.cpus == 2.0
    assert cfg.env.kg.seed == 5 and cfg.env.alfworld.snap_actions is False
    # flags over env vars over the file, within a section as anywhere
    cfg = load_config(path, ["env.db.levels=3"], environ={"JETRL__ENV__DB__LEVELS": "[2]"})
    assert cfg.env.db.levels == [3]
    # a task section overrides a generic key only where EnvConfig.TASK_OVERRIDES allows it
    assert cfg.env.task_value("webshop", "max_observation_chars") == 3000
    assert cfg.env.task_value("alfworld", "max_observation_chars") == 4000
    assert cfg.env.task_value("db", "max_observation_chars") == cfg.env.max_observation_chars == 800
    assert cfg.env.task_value("webshop", "max_sessions") == 8
    # a task's keys are checked by its own settings class (shared/tasks.py), where the task is served
    with pytest.raises(ConfigError, match=r"unknown config key env\.db\.level \(did you mean env\.db\.levels\?\)"):
        load_config(None, ["env.db.level=1"], environ={}).env.section("db")
    with pytest.raises(ConfigError, match=r"unknown config key env\.db\.zzz \(known: agentbench_file, levels, "):
        load_config(None, ["env.db.zzz=1"], environ={}).env.section("db")
    with pytest.raises(ConfigError, match=r"unknown config key env\.db \(known: .*a task's own keys go in its section"):
        load_config(None, ["env.db=1"], environ={})
    with pytest.raises(ConfigError, match=r"env\.db\.levels\[\]: expected int, got .one."):
        load_config(None, environ={"JETRL__ENV__DB__LEVELS": '["one"]'}).env.section("db")
    with pytest.raises(ConfigError, match=r"unknown config key env\.max_sesions"):
        load_config(None, ["env.max_sesions=3"], environ={})


def test_config_round_trips_through_save_config(tmp_path) -> None:
    overrides = ["env.db.levels=2,3", 'env.os.agentbench_train=["a.json"]', "env.webshop.num_products=99",
                 "env.max_sessions=3", 'trainer.max_staleness={"db": 2}', "run.tasks=db=0.5,os=0.5",
                 "rollout.vllm.dtype=bfloat16", "trainer.deepspeed.zero_stage=3"]
    cfg = load_config(None, overrides, environ={})
    path = tmp_path / "saved.toml"
    save_config(cfg, path)
    assert "[env.db]\n" in path.read_text() and "db_levels" not in path.read_text()
    assert '[rollout.vllm]\ndtype = "bfloat16"\n' in path.read_text()
    assert "[trainer.deepspeed]\nzero_stage = 3\n" in path.read_text()
    assert load_config(path, environ={}) == cfg


def test_engine_and_backend_keys_are_sub_sections_in_every_form(tmp_path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[rollout]\nengine = "openai"\n[rollout.openai]\nbase_url = "http://h/v1"\nmodel = "m"\n'
                    '[rollout.continuous]\nmatmul_dtype = "bfloat16"\n[trainer.deepspeed]\nzero_stage = 1\n')
    cfg = load_config(path, ["--rollout.vllm.enforce-eager=true"],
                      environ={"JETRL__TRAINER__DEEPSPEED__DTYPE": "bfloat16", "JETRL__NATS__HEARTBEAT_TTL_S": "4"})
    assert (cfg.rollout.openai.base_url, cfg.rollout.openai.model) == ("http://h/v1", "m")
    assert cfg.rollout.continuous.matmul_dtype == "bfloat16" and cfg.rollout.vllm.enforce_eager is True
    assert (cfg.trainer.deepspeed.zero_stage, cfg.trainer.deepspeed.dtype) == (1, "bfloat16")
    assert cfg.nats.heartbeat_ttl_s == 4.0
    with pytest.raises(ConfigError, match=r"config rollout\.vllm is a section: set its keys"):
        load_config(None, ["rollout.vllm=1"], environ={})
    with pytest.raises(ConfigError, match=r"rollout\.engine=openai needs rollout\.openai\.base_url"):
        load_config(None, ["rollout.engine=openai"], environ={})


@pytest.mark.parametrize(("key", "suggestion"), [
    ("rollout.vllm_dtype", "rollout.vllm.dtype"), ("rollout.openai_base_url", "rollout.openai.base_url"),
    ("rollout.matmul_dtype", "rollout.continuous.matmul_dtype"), ("rollout.kv_cache_tokens",
                                                                   "rollout.continuous.kv_cache_tokens"),
    ("trainer.zero_stage", "trainer.deepspeed.zero_stage"), ("trainer.ds_dtype", "trainer.deepspeed.dtype"),
    ("controller.heartbeat_ttl_s", "nats.heartbeat_ttl_s"), ("controller.tasks", "run.tasks"),
    ("rollout.vllm.dtyp", "rollout.vllm.dtype")])
def test_a_key_not_where_it_is_written_is_unknown_naming_where_it_is(key: str, suggestion: str) -> None:
    with pytest.raises(ConfigError, match=rf"unknown config key {re.escape(key)} \(did you mean "
                                          rf"{re.escape(suggestion)}\?\)"):
        load_config(None, [f"{key}=1"], environ={})


def test_choices_and_ranges_are_checked_from_their_declarations() -> None:
    from shared.config import JetRLConfig, describe, validate

    with pytest.raises(ConfigError, match=r'config key rollout\.engine: expected one of "continuous" \| "hf" \| '
                                          r'"vllm" \| "oracle" \| "openai", got .tpu.'):
        load_config(None, ["rollout.engine=tpu"], environ={})
    with pytest.raises(ConfigError, match=r"config key trainer\.deepspeed\.zero_stage: expected one of 1 \| 2 \| 3"):
        load_config(None, environ={"JETRL__TRAINER__DEEPSPEED__ZERO_STAGE": "4"})
    with pytest.raises(ConfigError, match=r'controller\.eval_passes\[\]: expected one of "greedy" \| "sampled"'):
        load_config(None, ["controller.eval_passes=greedy,best"], environ={})
    with pytest.raises(ConfigError, match=r"config key rollout\.cross_policy_prob must be in \[0, 1\], got 1\.5"):
        load_config(None, ["rollout.cross_policy_prob=1.5"], environ={})
    with pytest.raises(ConfigError, match=r"config key run\.tasks\.os must be >= 0, got -1\.0"):
        load_config(None, ["run.tasks=db=1,os=-1"], environ={})
    # a value set in code is checked too, when the config is validated
    cfg = JetRLConfig()
    cfg.rollout.vllm.gpu_memory_utilization = 0.0
    with pytest.raises(ConfigError, match=r"rollout\.vllm\.gpu_memory_utilization must be in \(0, 1\], got 0\.0"):
        validate(cfg)
    # and the help says what the declarations say
    text = describe()
    assert "  engine (\"continuous\" | \"hf\" | \"vllm\" | \"oracle\" | \"openai\") = 'continuous'" in text
    assert "[rollout.vllm]\n" in text and "[trainer.deepspeed]\n" in text
    assert "sampler_floor (float) = 0.02  # " in text and "must be in [0, 0.25]\n" in text


def test_task_overrides_are_declared_not_accidental(monkeypatch) -> None:
    from shared import config

    monkeypatch.setattr(config.EnvConfig, "TASK_OVERRIDES", frozenset())
    with pytest.raises(ConfigError, match=r"env\.alfworld\.max_observation_chars shadows env\.max_observation_chars"):
        config.EnvConfig().section("alfworld")


def test_jetrl_config_for_one_task() -> None:
    def jetrl_config(*args: str) -> str:
        return subprocess.run([sys.executable, "-m", "jetrl.cli", "config", *args], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout

    text = jetrl_config("--task", "webshop")
    assert "[env]\n" in text and "[env.webshop]\n" in text and "num_products (int) = 52000" in text
    assert "[env.db]" not in text and "[trainer]" not in text and "agentbench_file" not in text
    assert "[webshop uses env.webshop.max_observation_chars instead]" in text
    everything = jetrl_config()
    assert all(f"[env.{task}]\n" in everything for task in ("db", "os", "kg", "alfworld", "webshop"))
    assert "[trainer]\n" in everything


def test_map_and_list_values_keep_their_types_from_flags_and_env_vars() -> None:
    cfg = load_config(overrides=["--run.tasks=os=1", "--rollout.task_concurrency=os=2,*=3"],
                      environ={"JETRL__CONTROLLER__TASK_MAX_INFLIGHT": "os=4"})
    assert cfg.rollout.task_concurrency == {"os": 2, "*": 3}
    assert all(type(v) is int for v in cfg.rollout.task_concurrency.values())
    assert cfg.controller.task_max_inflight == {"os": 4} and type(cfg.controller.task_max_inflight["os"]) is int
    assert cfg.run.tasks == {"os": 1.0}
    with pytest.raises(ConfigError, match="rollout.task_concurrency"):
        load_config(overrides=["--run.tasks=os=1", "--rollout.task_concurrency=os=2.5"], environ={})
