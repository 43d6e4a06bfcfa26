"""Reliability pieces, each against real processes or a real nats-server, in seconds:
the supervisor's crash-loop verdict, an env request that survives a nats-server kill -9 and restart
and runs its tool once, the env's action timeout and multiple-tool-call refusal, the trainer's
boundary checks and its non-finite-step skip. The whole-run faults are in tests/system/test_faults.py."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import pytest

from jetrl.supervisor import CrashLoop, Supervisor
from services.envs.base import Episode, TaskEnv, ToolCall, ToolResult
from services.envs.host import EnvHost
from services.trainer.trainer import Trainer
from shared.bus import connect, declare_topology
from shared.chat import parse_assistant
from shared.config import EnvConfig, JetRLConfig, ModelConfig
from shared.envapi import EnvClient, EnvError
from shared.messages import EnvInteract, EnvStart, EnvStep, Trajectory, TurnInfo, decode, encode
from shared.model import load_model, quiet_transformers, resolve_model
from shared.natsd import EmbeddedNats
from shared.subjects import Subjects


class SlowEpisode(Episode):
    """Each call sleeps ``delay_s`` in its thread and is counted: what a slow SQL query looks like."""

    def __init__(self, env: SlowEnv) -> None:
        self.env = env
        self.closed_at: float | None = None

    @property
    def tools(self) -> list[dict[str, Any]]:
        return [{"type": "function", "function": {"name": "work", "parameters": {
            "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}]

    def opening(self) -> list[dict[str, Any]]:
        return [{"role": "user", "content": "work"}]

    def call(self, tool: ToolCall) -> ToolResult:
        with self.env.lock:
            self.env.calls += 1
        time.sleep(self.env.delay_s)
        self.env.finished_calls += 1
        return ToolResult(content=f"done {tool.arguments['n']}")

    def close(self) -> None:
        self.closed_at = time.monotonic()


class SlowEnv(TaskEnv):
    name = "db"

    def __init__(self, delay_s: float) -> None:
        self.delay_s, self.calls, self.finished_calls = delay_s, 0, 0
        self.lock = threading.Lock()
        self.episodes: list[SlowEpisode] = []

    def task_ids(self, split: str) -> list[str]:
        return ["t0"]

    def open(self, task_id: str, split: str, seed: int) -> Episode:
        episode = SlowEpisode(self)
        self.episodes.append(episode)
        return episode


def work(n: int, calls: int = 1) -> dict[str, Any]:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"c{k}", "type": "function", "function": {"name": "work", "arguments": json.dumps({"n": n})}}
        for k in range(calls)]}


def test_a_crash_loop_ends_the_run_naming_the_service_and_its_last_log_lines(tmp_path: Path) -> None:
    """A real child that dies at once (``python -m json.tool --config ...``: a usage error) is restarted
    with a backoff and counted, then given up on with its log lines."""
    cfg = JetRLConfig()
    cfg.supervisor.restart_backoff_s, cfg.supervisor.crash_loop_restarts = 0.05, 2
    sup = Supervisor(cfg, tmp_path / "config.toml", tmp_path)
    sup.spawn("env-db-0", ["json.tool"])
    deadline = time.monotonic() + 60
    with pytest.raises(CrashLoop) as failed:
        while time.monotonic() < deadline:
            sup.supervise()
            time.sleep(0.05)
    message = str(failed.value)
    assert "env-db-0 died 3 times in a row" in message and "usage:" in message and "env-db-0.log" in message
    assert sup.restarts == {"env-db-0": 2}
    assert json.loads((tmp_path / "restarts.json").read_text()) == {"env-db-0": 2}
    assert "=== jetrl up: restart 2 of env-db-0" in (tmp_path / "logs" / "env-db-0.log").read_text()
    assert sup.report().values == {"restarts/env-db-0": 2.0, "restarts/total": 2.0}


async def start_when_served(client: EnvClient, session_id: str, task_id: str, within_s: float = 10.0) -> Any:
    """``client.start`` once the env's endpoints are subscribed on the server: under load the micro
    service's subscriptions can reach it after a flush of the other connection ("503: no responders")."""
    deadline = time.monotonic() + within_s
    while True:
        try:
            return await client.start(session_id, task_id)
        except EnvError as exc:
            if exc.code != "503" or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def test_an_env_request_survives_a_nats_kill_and_restart_and_runs_its_tool_once(tmp_path: Path) -> None:
    server = EmbeddedNats(tmp_path / "nats")
    url = server.start()
    cfg = JetRLConfig()
    subjects = Subjects("t" + uuid.uuid4().hex[:8])
    env = SlowEnv(delay_s=1.5)
    env_nc = await connect(cfg.nats, "env", url=url)
    rollout_nc = await connect(cfg.nats, "rollout", url=url)
    try:
        await declare_topology(env_nc.jetstream(), subjects, cfg.nats)
        host = EnvHost(env, EnvConfig(action_timeout_s=10.0), subjects, "r1")
        service = await host.serve(env_nc, env_nc.jetstream())
        await env_nc.flush()  # the endpoints are subscribed on the server before the other client asks
        client = EnvClient(rollout_nc, subjects, "db", timeout_s=10.0)
        started = await start_when_served(client, "s1", "t0")
        pending = asyncio.create_task(client.interact("r1", "s1", work(7), turn=0))
        while env.calls == 0:  # the tool is running: now the broker dies under both clients
            await asyncio.sleep(0.05)
        server.proc.kill()
        server.proc.wait()
        await asyncio.sleep(1.0)
        server.port = int(url.rsplit(":", 1)[1])
        server.start()
        step = await asyncio.wait_for(pending, 60)
        assert step.messages[0]["content"] == "done 7" and not step.finish
        assert env.calls == 1  # the resent request was answered from the reply cache, not run again
        # and the session goes on after the restart
        step = await client.interact(started.replica_id, "s1", work(8), turn=1)
        assert step.messages[0]["content"] == "done 8" and env.calls == 2
        await service.stop()
        await host.shutdown()
    finally:
        await env_nc.close()
        await rollout_nc.close()
        server.stop()


async def test_action_timeout_ends_the_episode_and_frees_it_only_after_its_tool_returns() -> None:
    env = SlowEnv(delay_s=1.0)
    host = EnvHost(env, EnvConfig(action_timeout_s=0.2), Subjects("t"), "r1")
    await host.start(encode(EnvStart(session_id="s", task_id="t0")))
    step = decode(await host.interact(encode(EnvInteract(session_id="s", message=work(1), turn=0))), EnvStep)
    assert step.finish and step.status == "env_timeout" and "longer than 0.2s" in step.messages[0]["content"]
    assert "s" not in host.sessions and env.episodes[0].closed_at is None  # its tool still runs
    await asyncio.sleep(1.3)
    assert env.finished_calls == 1 and env.episodes[0].closed_at is not None


async def test_a_call_the_episode_bounds_itself_waits_past_the_action_timeout() -> None:
    """``Episode.call_timeout_s``: a call the episode gives its own longer bound (OS grading) is waited for,
    the others still end at env.action_timeout_s."""
    env = SlowEnv(delay_s=0.6)
    host = EnvHost(env, EnvConfig(action_timeout_s=0.2), Subjects("t"), "r1")
    await host.start(encode(EnvStart(session_id="s", task_id="t0")))
    env.episodes[0].call_timeout_s = lambda tool: 5.0 if tool.arguments["n"] == 1 else None  # type: ignore[method-assign]
    step = decode(await host.interact(encode(EnvInteract(session_id="s", message=work(1), turn=0))), EnvStep)
    assert not step.finish and step.messages[0]["content"] == "done 1"
    step = decode(await host.interact(encode(EnvInteract(session_id="s", message=work(2), turn=1))), EnvStep)
    assert step.finish and step.status == "env_timeout" and "longer than 0.2s" in step.messages[0]["content"]
    await asyncio.sleep(0.7)


async def test_several_tool_calls_in_one_message_get_a_clear_error_and_none_runs() -> None:
    env = SlowEnv(delay_s=0.0)
    host = EnvHost(env, EnvConfig(), Subjects("t"), "r1")
    await host.start(encode(EnvStart(session_id="s", task_id="t0")))
    step = decode(await host.interact(encode(EnvInteract(session_id="s", message=work(1, calls=3), turn=0))), EnvStep)
    assert not step.finish and "3 tool calls in one message; none was run" in step.messages[0]["content"]
    assert env.calls == 0
    message = parse_assistant('<tool_call>{"name": "a", "arguments": {}}</tool_call>'
                              '<tool_call>{"name": "b", "arguments": {}}</tool_call>', turn=2)
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["a", "b"]
    broken = parse_assistant('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"na</tool_call>', 0)
    assert broken["invalid_tool_call"].startswith("tool call 2 of 2: ")


@pytest.fixture(scope="module")
def tiny_model() -> Any:
    quiet_transformers()
    return load_model(resolve_model(ModelConfig()))


def traj(tokens: list[int], mask: list[int], turns: list[tuple[int, int]], **over: Any) -> Trajectory:
    fields: dict[str, Any] = dict(episode_id="e", group_id="g", task="db", task_id="t", split="train", group_size=2,
                                  tokens=tokens, logprobs=[-0.5 if m else 0.0 for m in mask], loss_mask=mask,
                                  prompt_len=2, turns=[TurnInfo(start=a, end=b, engine_id="x", policy_version=0)
                                                       for a, b in turns], reward=1.0, status="completed",
                                  replica_id="r")
    return Trajectory(**(fields | over))


def test_the_trainer_refuses_what_the_schema_cannot_see(tiny_model: Any, tmp_path: Path) -> None:
    trainer = Trainer(None, None, Subjects("t"), JetRLConfig().trainer, tiny_model, tmp_path, "t")
    vocab = trainer.intake.vocab_size
    assert vocab and vocab > 1000
    assert trainer.intake.check(traj([1, 2, 3, 4], [0, 0, 1, 1], [(2, 4)])) is None
    assert "outside the vocabulary" in trainer.intake.check(traj([1, 2, vocab, 4], [0, 0, 1, 1], [(2, 4)]))
    assert "outside every turn span" in trainer.intake.check(traj([1, 2, 3, 4], [0, 1, 1, 1], [(2, 4)]))
    assert "overlaps" in trainer.intake.check(traj([1, 2, 3, 4, 5], [0, 0, 1, 1, 1], [(2, 4), (3, 5)]))


def test_a_non_finite_loss_skips_the_step_and_is_counted(tiny_model: Any, tmp_path: Path) -> None:
    import copy

    import torch

    model = copy.deepcopy(tiny_model)
    cfg = JetRLConfig().trainer
    trainer = Trainer(None, None, Subjects("t"), cfg, model, tmp_path, "t")
    with torch.no_grad():
        model.get_input_embeddings().weight[5].fill_(float("nan"))  # a poisoned row: NaN logits for token 5
    before = {k: v.clone() for k, v in model.named_parameters()}
    group = [traj([1, 5, 3, 4], [0, 0, 1, 1], [(2, 4)], episode_id=f"e{i}", reward=float(i)) for i in range(2)]
    stats, ledger = trainer.optimise(group)
    assert ledger.nonfinite and not ledger.updated and stats["train/grad_norm"] == 0.0
    assert trainer.counters["train/nonfinite_skipped"] == 1
    for name, value in model.named_parameters():
        assert torch.equal(value.nan_to_num(), before[name].nan_to_num()), name  # no optimizer step


async def test_versions_only_go_up_across_a_restart_and_are_recorded_before_they_are_announced(
        nc, config, subjects, tiny_model: Any, tmp_path: Path) -> None:
    import copy

    from shared.messages import WeightsAnnouncement

    config.trainer.kl_coef, config.trainer.steps = 0.01, 100  # every step a real optimizer step
    config.trainer.checkpoint_every = 0  # the crash case: announced, no checkpoint written yet
    trainer = Trainer(nc, nc.jetstream(), subjects, config.trainer, copy.deepcopy(tiny_model), tmp_path, "t")
    # another trainer (or ours, after its last checkpoint) announced version 12
    kv = await nc.jetstream().key_value(subjects.policy_kv)
    await kv.put(subjects.policy_version_key, encode(WeightsAnnouncement(version=12, object_name="o", digest="d",
                                                                         size=1, dtype="float32")))
    await trainer.adopt_announced_version()
    assert trainer.policy_version == 12
    announced: list[int] = []

    async def on_weights(msg: Any) -> None:
        announced.append(decode(msg.data, WeightsAnnouncement).version)
        assert trainer.run_state.recorded_version() >= announced[-1]  # recorded before it went out

    await nc.subscribe(subjects.weights_published, cb=on_weights)
    from services.trainer.intake import Group

    group = Group("g", 2)
    for i in range(2):
        group.add(traj([1, 2, 3, 4], [0, 0, 1, 1], [(2, 4)], episode_id=f"e{i}", reward=float(i)), _NoAck())
    await trainer.train_step([group])
    await nc.flush()
    await asyncio.sleep(0.2)
    assert trainer.policy_version == 13 and announced == [13] and trainer.run_state.recorded_version() == 13
    # a trainer restarted without (or from an older) checkpoint continues above what was announced, even
    # with the KV gone: its own record holds
    from structlog.testing import capture_logs

    fresh = Trainer(nc, nc.jetstream(), subjects, config.trainer, copy.deepcopy(tiny_model), tmp_path, "t2")
    assert not fresh.resume() and fresh.policy_version == 0
    await kv.delete(subjects.policy_version_key)
    with capture_logs() as logs:
        await fresh.adopt_announced_version()
    assert fresh.policy_version == 13
    # it says that it starts over from the run's first weights (its steps since are lost)
    assert [e["policy_version"] for e in logs if e["event"] == "trainer_restarted_without_a_checkpoint"] == [13]


async def test_flat_groups_are_acked_and_left_out_and_each_step_trains_on_signal(
        nc, config, subjects, tiny_model: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """trainer.filter_flat_groups: a group whose episodes all got one reward is acked without training and
    does not count towards min_groups; the step waits for two groups with signal, and its per-task success
    counts every episode it consumed. Groups left out in a row are reported (here every 2nd)."""
    import copy

    from structlog.testing import capture_logs

    from services.trainer import intake as intake_module

    monkeypatch.setattr(intake_module, "FLAT_GROUPS_WARNING", 2)
    config.trainer.filter_flat_groups, config.trainer.steps = True, 1
    config.trainer.min_groups = config.trainer.max_groups = 2
    js = nc.jetstream()
    trainer = Trainer(nc, js, subjects, config.trainer, copy.deepcopy(tiny_model), tmp_path, "t")
    groups = {"all-solved": [1.0, 1.0], "mixed-a": [1.0, 0.0], "all-failed": [0.0, 0.0], "mixed-b": [0.0, 1.0]}
    for group_id, rewards in groups.items():  # in this order: the flat ones arrive first and would fill a step
        for i, reward in enumerate(rewards):
            episode = traj([1, 2, 3, 4], [0, 0, 1, 1], [(2, 4)], episode_id=f"{group_id}-{i}", group_id=group_id,
                           reward=reward)
            await js.publish(subjects.traj("db"), encode(episode))
    with capture_logs() as logs:
        await asyncio.wait_for(trainer.run(asyncio.Event()), 120)
    (warning,) = [e for e in logs if e["event"] == "no_signal"]
    assert warning["flat_groups_since_last_step"] == 2 and warning["rewards"] == [0.0]
    (row,) = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert row["train/groups"] == 2 and row["train/trajectories"] == 4 and row["train/flat_groups"] == 2
    assert trainer.intake.flat == [] and trainer.intake.flat_groups_since_step == 0  # the step took them into its figures
    assert not row.get("train/skipped_update") and row["policy_version"] == 1
    assert row["task/db/episodes"] == 8 and row["task/db/success"] == 0.5  # 4 of the 8 consumed solved
    await nc.flush()  # acks are published without a reply
    info = await js.consumer_info(subjects.traj_stream, subjects.trainer_consumer)
    assert info.num_ack_pending == 0 and info.num_pending == 0  # every episode acked, the flat ones too


class _NoAck:
    """A stand-in delivery for train_step's acks (the trajectories here never went through a stream)."""

    metadata = None

    async def ack(self) -> None:
        return None

    async def in_progress(self) -> None:
        return None


def test_a_server_with_a_smaller_max_payload_is_refused_at_connect(tmp_path: Path) -> None:
    import socket
    import subprocess

    from shared.bus import NatsPayloadError
    from shared.natsd import find_nats_server

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    stock = subprocess.Popen([find_nats_server(), "-a", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        async def attempt() -> None:
            for _ in range(50):
                try:
                    await connect(JetRLConfig().nats, "payload", url=f"nats://127.0.0.1:{port}")
                except NatsPayloadError:
                    raise
                except Exception:
                    await asyncio.sleep(0.1)

        with pytest.raises(NatsPayloadError, match="--max_payload"):
            asyncio.run(attempt())
    finally:
        stock.terminate()
        stock.wait()


def test_a_fresh_jetrl_up_keeps_the_earlier_run_and_resume_keeps_it_in_place(tmp_path: Path) -> None:
    from jetrl.rundir import keep_earlier_run

    run = tmp_path / "latest"
    (run / "checkpoints" / "step_000003").mkdir(parents=True)
    (run / "config.toml").write_text("")
    keep_earlier_run(run, "up")
    assert not run.exists()
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("latest-")]
    assert len(kept) == 1 and (kept[0] / "checkpoints" / "step_000003").is_dir()
    run.mkdir()
    keep_earlier_run(run, "up")  # an empty directory (or one without a run) is used as it is
    assert run.is_dir()


async def test_a_job_out_of_deliveries_becomes_a_dead_letter_and_an_env_error_trajectory(
        nc, config, subjects) -> None:
    """Every replica that took the job died (here: fetched it and never answered); after the last
    delivery the server's advisory reaches a live replica, which completes the episode's group."""
    from services.rollout.worker import MAX_DELIVER, RolloutWorker
    from shared.messages import DeadLetter, EpisodeJob
    from shared.model import load_tokenizer

    config.rollout.engine, config.rollout.job_ack_wait_s = "oracle", 0.5
    js = nc.jetstream()
    tokenizer = load_tokenizer(resolve_model(ModelConfig()))
    worker = RolloutWorker(nc, js, subjects, config.rollout, None, tokenizer, "rollout-test")
    jobs = await worker.subscribe_jobs()  # the shared consumer, max_deliver 5
    await worker.handle_exhausted_jobs()
    job = EpisodeJob(episode_id="g-lost-0", group_id="g-lost", task="db", task_id="t", group_size=2)
    await js.publish(subjects.jobs("db"), encode(job))
    for _ in range(MAX_DELIVER):  # a replica takes it and dies, five times
        (msg,) = await jobs.fetch(1, timeout=10.0)
        assert decode(msg.data, EpisodeJob).episode_id == "g-lost-0"
    extra: list[Any] = []

    async def live_replica() -> None:  # the server decides "out of deliveries" when it would deliver again
        while True:
            try:
                extra.extend(await jobs.fetch(1, timeout=1.0))
            except Exception:
                pass

    pulling = asyncio.create_task(live_replica())
    trajectories = await js.subscribe(subjects.traj(">"), ordered_consumer=True)
    try:
        stored = decode((await trajectories.next_msg(timeout=30.0)).data, Trajectory)
    finally:
        pulling.cancel()
    assert extra == []  # never delivered a sixth time
    assert (stored.episode_id, stored.group_id, stored.status, stored.group_size) == ("g-lost-0", "g-lost",
                                                                                        "env_error", 2)
    letters = await js.subscribe(subjects.dead_letter(">"), ordered_consumer=True)
    letter = decode((await letters.next_msg(timeout=5.0)).data, DeadLetter)
    assert "ran out of its 5 deliveries" in letter.reason and decode(letter.payload, EpisodeJob) == job
    for _ in range(20):  # and it is gone from the work queue
        if (await js.stream_info(subjects.jobs_stream)).state.messages == 0:
            break
        await asyncio.sleep(0.1)
    assert (await js.stream_info(subjects.jobs_stream)).state.messages == 0


async def test_restarts_reach_the_controllers_status_and_metrics(nc, config, subjects, tmp_path: Path) -> None:
    """What ``jetrl up`` publishes after restarting services (its ``supervisor`` report, over NATS)."""
    from litestar.testing import AsyncTestClient

    from services.controller.api import create_app
    from services.controller.controller import Controller

    controller = Controller(nc, nc.jetstream(), subjects, config, "controller-test")
    await controller.follow_metrics_and_weights()
    sup = Supervisor(config, tmp_path / "config.toml", tmp_path)
    sup._count("trainer")
    sup._count("nats-server")
    sup._count("trainer")
    await nc.publish(subjects.metrics("supervisor"), encode(sup.report()))
    await nc.flush()
    await asyncio.sleep(0.3)
    async with AsyncTestClient(app=create_app(controller)) as client:
        status = (await client.get("/status")).json()
        metrics = (await client.get("/metrics")).text
    assert status["service_restarts"] == {"trainer": 2, "nats-server": 1, "total": 3}
    assert 'jetrl_service_restarts_total{service="trainer"} 2.0' in metrics
    assert 'jetrl_service_restarts_total{service="nats-server"} 1.0' in metrics  # the sum is PromQL's


async def test_a_replica_loads_only_the_newest_policy_version(nc, config, subjects, tiny_model: Any,
                                                              tmp_path: Path) -> None:
    """Three versions announced before the replica looks: it loads the third, never the first two (a
    replica that was busy, or started late, catches up in one load)."""
    from services.rollout.engine import HFEngine
    from services.rollout.worker import RolloutWorker
    from shared.model import load_tokenizer

    model_path = resolve_model(ModelConfig())
    tokenizer = load_tokenizer(model_path)
    engine = HFEngine(model_path, "hf-test", [tokenizer.convert_tokens_to_ids("<|im_end|>")], tokenizer.pad_token_id)
    loaded: list[int] = []
    update = engine.update_weights

    async def recording(state: Any, version: int, adapter: Any = None) -> None:
        loaded.append(version)
        await update(state, version, adapter)

    engine.update_weights = recording  # type: ignore[method-assign]
    trainer = Trainer(nc, nc.jetstream(), subjects, config.trainer, tiny_model, tmp_path, "t")
    for version in (1, 2, 3):
        trainer.policy_version = version
        await trainer.publisher.publish(trainer.model, trainer.policy_version)
    worker = RolloutWorker(nc, nc.jetstream(), subjects, config.rollout, engine, tokenizer, "rollout-test")
    follower = asyncio.create_task(worker.follow_weights())
    try:
        for _ in range(100):
            if engine.policy_version == 3:
                break
            await asyncio.sleep(0.1)
        trainer.policy_version = 4  # and a version announced while it watches arrives too
        await trainer.publisher.publish(trainer.model, trainer.policy_version)
        for _ in range(100):
            if engine.policy_version == 4:
                break
            await asyncio.sleep(0.1)
    finally:
        follower.cancel()
        engine.close()
    assert loaded == [3, 4]
