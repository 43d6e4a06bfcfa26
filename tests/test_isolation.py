"""One bad message never stops a run: every background task is supervised, and every fetched message is
judged alone (tests against a real nats-server; the whole-run versions are in tests/test_faults.py)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pytest
from structlog.testing import capture_logs

from services.controller.controller import Controller
from shared import lifecycle
from shared.lifecycle import supervise
from shared.messages import DeadLetter, Trajectory, TurnInfo, decode, encode

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
    """The trainer's fetch batch around a bad message: every valid trajectory is held for training (none
    waits for its last delivery), the bad ones are dead-lettered with a reason."""
    from services.trainer.trainer import Trainer

    config.trainer.min_groups = 100  # hold, never train: what is held is what the test looks at
    js = nc.jetstream()
    trainer = Trainer(nc, js, subjects, config.trainer, tiny_model, tmp_path, "trainer-test")
    unknown_deep = msgspec.msgpack.encode(msgspec.to_builtins(trajectory("x")) | {"extra": 1})
    unknown_deep = unknown_deep.replace(b"\xa5extra\x01", b"\xa5extra" + NESTED)
    for data in (encode(trajectory("a")), NESTED, unknown_deep, encode(trajectory("b"))):
        await js.publish(subjects.traj("db"), data)
    stop = asyncio.Event()
    running = asyncio.create_task(trainer.run(stop))
    try:
        await until(lambda: set(trainer.groups.get("g").items if "g" in trainer.groups else ()) == {"a", "b"})
        dead = await letters(js, subjects, 2)
        assert [d.service for d in dead] == ["trainer", "trainer"]
        assert "nested too deep" in dead[1].reason and trainer.counters["train/dead_lettered"] == 2
    finally:
        stop.set()
        await asyncio.wait_for(running, 10.0)
