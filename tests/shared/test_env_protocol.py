"""The env protocol's spec cannot drift from the code: docs/schemas/*.json and the field tables of
docs/env-protocol.md are what `jetrl schema` makes from shared/messages/, the schemas accept the bytes
the codec writes and refuse what the codec refuses, and the spec names every env subject."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import msgspec
import pytest

from jetrl.schema import ENV_MESSAGES, SCHEMA_DIR, SPEC, main, message_schemas, stale_files
from shared.messages import MESSAGES, EnvHealth, EnvStarted, EnvStep, Heartbeat, Trajectory, TurnInfo, encode
from shared.subjects import Subjects

REPO = Path(__file__).resolve().parents[2]


def test_checked_in_schemas_and_spec_tables_are_what_the_code_makes() -> None:
    assert stale_files() == [], "run `jetrl schema` and commit the result"
    assert sorted(p.stem for p in SCHEMA_DIR.glob("*.json")) == sorted(cls.KIND for cls in MESSAGES)


def test_check_names_a_stale_file_and_a_regeneration_fixes_it(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    schemas, spec = tmp_path / "schemas", tmp_path / "env-protocol.md"
    shutil.copytree(SCHEMA_DIR, schemas)
    shutil.copy(SPEC, spec)
    (schemas / "env_step.json").write_text("{}\n")  # a field the code has is gone from the schema
    spec.write_text(spec.read_text().replace("| `finish` | bool |", "| `finish` | int |"))
    (schemas / "env_gone.json").write_text('{"$id": "env_gone.json"}\n')  # a message that no longer exists
    args = ["--out", str(schemas), "--spec", str(spec)]
    assert main([*args, "--check"]) == 1
    out = capsys.readouterr().out
    assert "env_step.json" in out and "env-protocol.md" in out and "env_gone.json (no message of that kind)" in out
    assert main(args) == 0
    assert main([*args, "--check"]) == 0 and not (schemas / "env_gone.json").exists()
    assert (schemas / "env_step.json").read_text() == (SCHEMA_DIR / "env_step.json").read_text()


def test_the_command_line_check_passes_on_the_repository() -> None:
    proc = subprocess.run([sys.executable, "-m", "jetrl.cli", "schema", "--check"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def wire(msg: msgspec.Struct) -> object:
    """What a msgpack reader of another language sees: the encoded bytes decoded without types."""
    return msgspec.msgpack.decode(encode(msg))


def test_the_schemas_accept_what_the_codec_writes_and_refuse_what_it_refuses() -> None:
    schemas = message_schemas()
    samples = [
        EnvStarted(session_id="s1", replica_id="env-x-1", messages=[{"role": "user", "content": "hi"}],
                   tools=[], max_turns=8, level=2, task_kind="basket"),
        EnvStep(finish=True, reward=1.0, status="completed", messages=[], metrics={"turns": 3.0}),
        EnvHealth(replica_id="r", task="ledger", sessions=1, max_sessions=64, sessions_started=4, uptime_s=2.5),
        Heartbeat(role="env-ledger", replica_id="r", pid=7, host="h", started_at=1.0, info={"task": "ledger"}),
        Trajectory(episode_id="e", group_id="g", task="t", task_id="i", split="train", group_size=1, tokens=[1, 2],
                   logprobs=[0.0, -0.5], loss_mask=[0, 1], prompt_len=1, reward=1.0, status="completed",
                   replica_id="r", turns=[TurnInfo(start=1, end=2, engine_id="e", policy_version=0)]),
    ]
    for msg in samples:
        jsonschema.validate(wire(msg), schemas[msg.KIND])  # type: ignore[attr-defined]
    step = schemas["env_step"]
    refused = [
        {"kind": "env_step", "v": 1, "reward": 0.0, "status": "running", "messages": []},  # no finish
        {"kind": "env_started", "v": 1, "finish": True, "reward": 0.0, "status": "running", "messages": []},
        {"kind": "env_step", "v": 2, "finish": True, "reward": 0.0, "status": "running", "messages": []},
        {"kind": "env_step", "v": 1, "finish": True, "reward": 0.0, "status": "running", "messages": [],
         "metrics": {"turns": "three"}},
    ]
    for body in refused:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(body, step)
    started = schemas["env_started"]
    bad_replica = dict(wire(samples[0]), replica_id="env.x")  # a dot would split the replica's subjects
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(bad_replica, started)


def test_the_spec_names_every_env_subject_and_message() -> None:
    text = SPEC.read_text()
    s, t, r = Subjects("PREFIX"), "TASK", "REPLICA"
    for subject in (s.env_start(t), s.env_tasks(t), s.env_health(t), s.env_interact(t, r), s.env_cancel(t, r),
                    s.env_oracle(t, r), s.env_service_name(t), s.registry_kv, s.dead_letter(f"env-{t}")):
        written = subject.replace("PREFIX", "<P>").replace("TASK", "<T>").replace("REPLICA", "<R>")
        assert f"`{written}" in text, written
    for cls in ENV_MESSAGES:
        assert f"### `{cls.KIND}`" in text
        for name in cls.__struct_fields__:
            assert f"| `{name}` |" in text
    assert json.loads((SCHEMA_DIR / "env_start.json").read_text())["properties"]["kind"] == {"enum": ["env_start"]}
