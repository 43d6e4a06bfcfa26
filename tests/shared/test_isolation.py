"""One bad message never stops a run: every background task is supervised, and every fetched message is
judged alone (tests against a real nats-server; the whole-run versions are in tests/system/test_faults.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pytest
from nats.js.errors import KeyNotFoundError
from structlog.testing import capture_logs

from services.controller.controller import Controller
from shared import lifecycle
from shared.lifecycle import supervise
from shared.messages import DeadLetter, Heartbeat, Trajectory, TurnInfo, decode, encode
from shared.service import Service
from shared.subjects import Subjects

NESTED = b"\x91" * 1000 + b"\x00"  # 1,001 bytes that made msgspec raise RecursionError


def trajectory(episode_id: str, group_id: str = "g", group_size: int = 2, tokens: int = 4) -> Trajectory:
    return Trajectory(episode_id=episode_id, group_id=group_id, task="db", task_id="t", split="train",
                      group_size=group_size, tokens=[1] * tokens, logprobs=[0.0, 0.0] + [-0.5] * (tokens - 2),
                      loss_mask=[0, 0] + [1] * (tokens - 2), prompt_len=2,
                      turns=[TurnInfo(start=2, end=tokens, engine_id="x", policy_version=0)], reward=1.0,
                      status="completed", replica_id="r")


async def until(condition: Any, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_a_background_task_that_raises_is_logged_and_restarted_or_ends_the_service(monkeypatch) -> None:
    monkeypatch.setattr(lifecycle, "_failures", [])
    stop = asyncio.Event()
    runs: list[int] = []

    async def flaky() -> None:
        runs.append(1)
        if len(runs) < 3:
            raise RuntimeError("flaky")
        await asyncio.sleep(3600)

    async def broken() -> None:
        raise ValueError("broken")

    with capture_logs() as logs:
        restarted = supervise(flaky, "flaky", stop, restart_s=0.01)
        await until(lambda: len(runs) == 3)
        assert not stop.is_set() and lifecycle.exit_code() == 0
        restarted.cancel()
        unit = supervise(broken(), "one_message", None)  # a unit of work: logged, nothing stops
        await asyncio.wait({unit})
        assert not stop.is_set()
        supervise(broken(), "loop", stop)  # no restart: the service ends with the failure exit code
        await asyncio.wait_for(stop.wait(), 5.0)
    assert lifecycle.exit_code() == 1
    failed = [(e["task"], e.get("then", "")) for e in logs if e["event"] == "task_failed"]
    assert failed[:2] == [("flaky", "restarting in 0.01 s")] * 2
    assert ("one_message", "") in failed and ("loop", "stopping the service to be restarted") in failed
    assert all("exc_info" in e for e in logs if e["event"] == "task_failed")  # with the traceback


async def test_a_service_holds_its_connection_and_jobs_until_it_exits(nc, config, subjects) -> None:
    """The skeleton of every entry point: connected, heartbeating under its name, jobs supervised; on
    the way out every job is cancelled and the connection closed, and nothing stops it before."""
    svc = Service(config, "env-db", "env-db-skeleton", role="env")
    async with svc:
        await svc.connect()
        job = svc.background("job", lambda: asyncio.sleep(3600))
        svc.heartbeat({"task": "db"})
        registry = await svc.js.key_value(subjects.registry_kv)
        key = Subjects.registry_key("env-db", "env-db-skeleton")
        beat = None
        for _ in range(100):  # the first beat goes out once the job has started
            try:
                beat = decode((await registry.get(key)).value, Heartbeat)
                break
            except KeyNotFoundError:
                await asyncio.sleep(0.05)
        assert beat is not None and (beat.role, beat.replica_id, beat.info) == ("env-db", "env-db-skeleton", {"task": "db"})
        assert not job.done() and svc.nc.is_connected
    await asyncio.sleep(0)
    assert job.cancelled() and svc.nc.is_closed and not svc.stop.is_set()


async def letters(js: Any, subjects: Any, want: int) -> list[DeadLetter]:
    sub = await js.subscribe(subjects.dead_letter(">"), ordered_consumer=True)
    out = [decode((await sub.next_msg(timeout=10.0)).data, DeadLetter) for _ in range(want)]
    await sub.unsubscribe()
    return out


async def test_the_controller_judges_each_trajectory_alone(nc, config, subjects) -> None:
    """A nested message between valid trajectories in one fetch: the valid ones are counted and acked,
    the bad one is dead-lettered and terminated, and the tracking task lives on."""
    js = nc.jetstream()
    controller = Controller(nc, js, subjects, config, "controller-test")
    for data in (encode(trajectory("a")), NESTED, encode(trajectory("b")), b"\x93\x01"):
        await js.publish(subjects.traj("db"), data)
    tracking = asyncio.create_task(controller.track_trajectories())
    try:
        await until(lambda: controller.finished == {"a", "b"})
        dead = await letters(js, subjects, 2)
        assert {d.service for d in dead} == {"controller"} and dead[0].payload == NESTED
        assert "expected a msgpack map" in dead[0].reason and "not msgpack" in dead[1].reason
        await js.publish(subjects.traj("db"), encode(trajectory("c")))
        await until(lambda: "c" in controller.finished)
        info = await js.consumer_info(subjects.traj_stream, subjects.controller_consumer)
        assert info.num_ack_pending == 0 and info.num_pending == 0
        assert not tracking.done()
    finally:
        tracking.cancel()


@pytest.fixture(scope="module")
def tiny_model() -> Any:
    from shared.config import ModelConfig
    from shared.model import load_model, quiet_transformers, resolve_model
    quiet_transformers()
    return load_model(resolve_model(ModelConfig()))


async def test_the_trainer_judges_each_trajectory_alone(nc, config, subjects, tiny_model: Any, tmp_path) -> None:
    """The trainer's fetch batch around bad messages: every valid trajectory is held for training (none
    waits for its last delivery), the bad ones are dead-lettered with a reason: nested too deep, in a field
    the trainer does not know, and longer than the task's bound (``trainer.max_tokens``)."""
    from services.trainer.trainer import Trainer

    config.trainer.min_groups = 100  # hold, never train: what is held is what the test looks at
    config.trainer.max_tokens = {"db": 6}
    js = nc.jetstream()
    trainer = Trainer(nc, js, subjects, config.trainer, tiny_model, tmp_path, "trainer-test")
    unknown_deep = msgspec.msgpack.encode(msgspec.to_builtins(trajectory("x")) | {"extra": 1})
    unknown_deep = unknown_deep.replace(b"\xa5extra\x01", b"\xa5extra" + NESTED)
    for data in (encode(trajectory("a")), NESTED, unknown_deep, encode(trajectory("long", tokens=7)),
                 encode(trajectory("b", tokens=6))):
        await js.publish(subjects.traj("db"), data)
    stop = asyncio.Event()
    running = asyncio.create_task(trainer.run(stop))
    try:
        await until(lambda: set(trainer.intake.groups.get("g").items if "g" in trainer.intake.groups else ()) == {"a", "b"})
        dead = await letters(js, subjects, 3)
        assert [d.service for d in dead] == ["trainer"] * 3 and trainer.counters["train/dead_lettered"] == 3
        assert "expected a msgpack map" in dead[0].reason and "nested too deep" in dead[1].reason
        assert dead[2].reason.startswith("trajectory: 7 tokens, more than the 6 the trainer takes for task 'db'")
        trainer.cfg.max_tokens = {}  # unset: the rollout's context limit
        assert trainer.intake.token_limit("db") == config.rollout.max_context_tokens == trainer.intake.context_tokens
    finally:
        stop.set()
        await asyncio.wait_for(running, 10.0)


def test_a_store_serves_one_server_and_the_server_dies_with_its_parent(tmp_path) -> None:
    """A second server on a store in use is refused with the holder's pid; the holder's server goes when
    the holder is SIGKILLed (PDEATHSIG), and then the store is free again."""
    import os
    import signal
    import subprocess
    import sys

    from shared.natsd import EmbeddedNats, StoreInUse, check_store_free

    store = tmp_path / "nats"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from shared.natsd import EmbeddedNats\n"
        f"s = EmbeddedNats({str(store)!r}); s.start(); print(s.proc.pid, flush=True); time.sleep(600)")],
        stdout=subprocess.PIPE, text=True, cwd=os.getcwd())
    try:
        server_pid = int(holder.stdout.readline())
        with pytest.raises(StoreInUse, match=rf"in use by another nats-server or jetrl up \(pid {holder.pid}\)"):
            EmbeddedNats(store).start()
        with pytest.raises(StoreInUse):
            check_store_free(store)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    deadline = time.monotonic() + 15
    while os.path.exists(f"/proc/{server_pid}") and "Z" not in open(f"/proc/{server_pid}/stat").read().split()[2]:
        assert time.monotonic() < deadline, "nats-server outlived its parent"
        time.sleep(0.1)
    # A multi-threaded server's leader thread shows "Z" while its other threads are still exiting with the
    # shared file table, the lock among it: the store is free a moment later, not at the same instant.
    while True:
        try:
            check_store_free(store)
            break
        except StoreInUse:
            assert time.monotonic() < deadline, "the store stayed locked after its server and holder were gone"
            time.sleep(0.1)
    with EmbeddedNats(store) as url:  # the store is free: the next run resumes on it
        assert url.startswith("nats://")


def test_a_service_log_rotates_between_lines_and_keeps_its_backups(tmp_path) -> None:
    """A child that writes 2 MB of numbered lines into a log bounded at 256 KB with 2 backups: every file
    within the bound, each starting and ending on a whole line, and the newest lines all kept in order."""
    import subprocess
    import sys

    from jetrl.logfiles import RotatingLog

    log = RotatingLog(tmp_path / "svc.log", max_bytes=256 * 1024, backups=2)
    child = subprocess.Popen([sys.executable, "-c", "import sys\nfor i in range(40000): print(f'line {i:06d} ' + 'x' * 40)"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    log.copy_from(child.stdout).join(timeout=60)
    assert child.wait(timeout=10) == 0
    files = [tmp_path / "svc.log.2", tmp_path / "svc.log.1", tmp_path / "svc.log"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["svc.log", "svc.log.1", "svc.log.2"]
    lines = []
    for path in files:
        data = path.read_bytes()
        assert 0 < len(data) <= 256 * 1024 and data.endswith(b"\n") and data.startswith(b"line "), path
        lines += data.decode().splitlines()
    numbers = [int(line.split()[1]) for line in lines]
    assert numbers == list(range(numbers[0], 40000))  # the newest lines, none lost between the files


async def test_a_flood_of_dead_letters_from_one_service_keeps_the_others_and_consumers_are_bounded(
        nats_url, prefix, tmp_path) -> None:
    """The DLQ's bound is per service: 300 letters from env-db past a bound of 50 leave the trainer's one
    letter in place. Every stream and bucket (the registry's too) refuses consumers past its bound."""
    from nats.js.api import AckPolicy, ConsumerConfig

    from shared.bus import connect, declare_topology
    from shared.config import JetRLConfig
    from shared.delivery import DEAD_LETTER_PAYLOAD_BYTES, dead_letter
    from shared.subjects import Subjects

    cfg = JetRLConfig()
    cfg.nats.url, cfg.nats.prefix = nats_url, prefix
    cfg.nats.dlq_max_per_origin, cfg.nats.max_consumers = 50, 8
    subjects = Subjects(prefix)
    nc = await connect(cfg.nats, "pytest")
    js = nc.jetstream()
    try:
        await declare_topology(js, subjects, cfg.nats)
        await dead_letter(js, subjects, service="trainer", origin_subject="x", reason="poison", payload=b"t" * 10**5)
        for i in range(300):
            await dead_letter(js, subjects, service="env-db", origin_subject="y", reason=f"bad {i}", payload=b"?")
        info = await js.stream_info(subjects.dlq_stream, subjects_filter=subjects.dead_letter(">"))
        assert info.state.subjects == {subjects.dead_letter("trainer"): 1, subjects.dead_letter("env-db"): 50}
        kept = decode((await js.get_last_msg(subjects.dlq_stream, subjects.dead_letter("trainer"))).data, DeadLetter)
        assert len(kept.payload) == DEAD_LETTER_PAYLOAD_BYTES and kept.reason.endswith("of 100000 bytes)")
        for stream in (subjects.traj_stream, f"KV_{subjects.registry_kv}"):
            made = []
            with pytest.raises(Exception, match="maximum consumers limit reached"):
                for _ in range(9):
                    made.append(await js.add_consumer(stream, ConsumerConfig(ack_policy=AckPolicy.NONE,
                                                                             inactive_threshold=5.0)))
            assert len(made) == 8
            for c in made:
                await js.delete_consumer(stream, c.name)
    finally:
        for stream in await js.streams_info():
            if prefix in stream.config.name:
                await js.delete_stream(stream.config.name)
        await nc.close()
