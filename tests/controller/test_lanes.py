"""Per-task lanes (``rollout.task_concurrency``, ``controller.task_max_inflight``) over a real nats-server,
through the real controller, rollout worker (oracle engine) and db env host: a slow task whose env is
saturated (it never answers a start) cannot take every slot, and the fast task keeps finishing episodes.
Without lanes the same run ends with every in-flight slot held by the stuck task and none by the fast one."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from services.controller.controller import Controller
from services.envs.host import EnvHost
from services.rollout.worker import RolloutWorker
from shared.config import EnvConfig, JetRLConfig, ModelConfig, validate
from shared.messages import EnvTaskList, decode, encode
from shared.model import load_tokenizer, quiet_transformers, resolve_model
from shared.subjects import Subjects

SLOW = "os"  # stands for any slow task: here its env lists tasks but never answers a start (saturated)


@pytest.fixture
async def db_host(nc: Any, subjects: Subjects) -> AsyncIterator[EnvHost]:
    from services.envs.db import make_env

    cfg = EnvConfig(num_train_tasks=8, num_test_tasks=2, max_sessions=16)
    host = EnvHost(make_env(cfg), cfg, subjects, "env-db-lanes")
    service = await host.serve(nc, nc.jetstream())
    yield host
    await service.stop()
    await host.shutdown()


async def serve_saturated_env(nc: Any, subjects: Subjects) -> list[Any]:
    async def tasks(msg: Any) -> None:
        request = decode(msg.data, EnvTaskList)
        await msg.respond(encode(EnvTaskList(split=request.split, task_ids=["slow-0", "slow-1"])))

    async def start(msg: Any) -> None:  # every session slot of this env is taken: the start waits
        pass

    return [await nc.subscribe(subjects.env_tasks(SLOW), cb=tasks),
            await nc.subscribe(subjects.env_start(SLOW), cb=start)]


async def run_mixed(nc: Any, config: JetRLConfig, subjects: Subjects, lanes: bool,
                    until: Any, deadline_s: float = 120.0) -> tuple[Controller, RolloutWorker, int]:
    """Controller + rollout on db and the saturated task until ``until(controller, worker)``; the most episodes of
    the slow task the controller ever had in flight."""
    quiet_transformers()
    config.run.tasks = {"db": 1.0, SLOW: 1.0}
    config.controller.group_size = 2
    config.controller.max_inflight = 8
    config.controller.max_backlog = 0  # no trainer here
    config.controller.env_wait_s = 20.0
    config.rollout.engine = "oracle"
    config.rollout.concurrency = 4
    config.rollout.env_start_timeout_s = 300.0
    if lanes:
        config.controller.task_max_inflight = {SLOW: 4}
        config.rollout.task_concurrency = {"db": 2, SLOW: 2}
    validate(config)
    js = nc.jetstream()
    tokenizer = load_tokenizer(resolve_model(ModelConfig()))
    controller = Controller(nc, js, subjects, config, "controller-lanes")
    worker = RolloutWorker(nc, js, subjects, config.rollout, None, tokenizer, "rollout-lanes",
                           tasks=list(config.run.tasks))
    stop = asyncio.Event()
    jobs = [asyncio.create_task(controller.track_trajectories()), asyncio.create_task(controller.publish_jobs(stop)),
            asyncio.create_task(worker.run(stop))]
    most_slow = 0
    started = time.monotonic()
    try:
        while not until(controller, worker) and time.monotonic() - started < deadline_s:
            most_slow = max(most_slow, controller.inflight_by_task[SLOW])
            await asyncio.sleep(0.1)
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*jobs[1:], return_exceptions=True), 30)
        jobs[0].cancel()
    return controller, worker, most_slow


async def test_lanes_keep_the_fast_task_going_while_a_slow_one_is_saturated(nc, config, subjects, db_host) -> None:
    await serve_saturated_env(nc, subjects)
    controller, worker, most_slow = await run_mixed(nc, config, subjects, lanes=True,
                                                    until=lambda c, w: c.books["db"].finished >= 24)
    assert controller.books["db"].finished >= 24  # the fast lane kept going
    assert controller.books[SLOW].finished == 0  # the slow env answered nothing
    assert 0 < most_slow <= 4  # task_max_inflight: the stuck task never held more than its lane
    assert set(worker.lanes()) == {"db", SLOW}


async def test_without_lanes_the_saturated_task_takes_every_slot(nc, config, subjects, db_host) -> None:
    await serve_saturated_env(nc, subjects)

    seen: list[tuple[dict[str, int], int]] = []

    def starved(c: Controller, w: RolloutWorker) -> bool:
        """Every rollout slot plays the stuck task, the controller is at its bound, and its db jobs wait
        in the queue behind them with no db session open."""
        seen.append((dict(c.inflight_by_task), w.active))
        return (len(c.inflight) == 8 and c.inflight_by_task["db"] > 0 and w.active == 4
                and not db_host.sessions)

    controller, _, _ = await run_mixed(nc, config, subjects, lanes=False, until=starved)
    assert seen and seen[-1][1] == 4 and sum(seen[-1][0].values()) == 8, seen[-3:]
    assert controller.books[SLOW].finished == 0


def test_planner_lead_bounds_how_far_a_task_runs_ahead_of_its_share() -> None:
    from services.controller.planner import Planner

    ids = {"db": ["d"], SLOW: ["s"]}
    free = Planner({"db": 1.0, SLOW: 1.0}, ids, seed=0)  # lead 0: the stuck task's turns go to db, always
    assert all(free.next_group({"db"}) == ("db", "d") for _ in range(50))
    held = Planner({"db": 1.0, SLOW: 1.0}, ids, seed=0, lead=2)
    picks = [held.next_group({"db"}) for _ in range(6)]
    assert picks[:4] == [("db", "d")] * 4 and picks[4:] == [None] * 2  # 4 of 4: 2 groups past its half
    caught_up = [held.next_group() for _ in range(4)]
    assert [pick[0] for pick in caught_up if pick] == [SLOW] * 4  # the slow task's owed turns come first


async def test_lanes_beside_the_shared_consumer_are_refused_with_the_reason(nc, config, subjects) -> None:
    config.rollout.engine = "oracle"
    tokenizer = load_tokenizer(resolve_model(ModelConfig()))
    worker = RolloutWorker(nc, nc.jetstream(), subjects, config.rollout, None, tokenizer, "rollout-one-lane",
                           tasks=["db"])
    await worker.subscribe_jobs()  # an earlier run on this prefix: one consumer for every task
    config.rollout.task_concurrency = {"*": 2}
    with pytest.raises(RuntimeError, match="per-task lanes .* or one consumer for every task, never both"):
        await worker.run(asyncio.Event())
