"""The learnability task sampler (services/controller/sampler.py, ``controller.task_sampler``).

* The weight rule on hand-computed numbers: Laplace-smoothed success over a window, p(1-p) with its
  floor, the configured mix as prior and as a share of draws; task ids weighted by their level.
* Over a real nats-server, through the real controller, rollout worker (oracle engine) and env hosts: a
  task the oracle always solves (every group flat) is drawn less than one it solves half the time, and
  the weights are in ``/status``.
"""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import msgspec
import pytest

from services.controller.api import create_app
from services.controller.controller import Controller
from services.controller.planner import Planner
from services.controller.sampler import LearnabilitySampler, Window
from services.envs.host import EnvHost
from services.rollout.worker import RolloutWorker
from shared.config import ConfigError, EnvConfig, JetRLConfig, ModelConfig, validate
from shared.model import load_tokenizer, quiet_transformers, resolve_model
from shared.subjects import Subjects
from tests.controller.test_dashboard import served, traj
from tests.sums_env import SumEnv


def observe(sampler: LearnabilitySampler, task: str, outcomes: list[int], task_id: str = "t-0", level: int = 0) -> None:
    for success in outcomes:
        sampler.observe(task, task_id, level, bool(success))


def test_window_keeps_the_last_episodes_and_smooths_towards_a_half() -> None:
    window = Window(4)
    assert window.success == 0.5  # (0 + 1) / (0 + 2): no episode yet
    for success in (1, 1, 1, 1, 0, 0):
        window.add(bool(success))
    assert list(window.outcomes) == [1, 1, 0, 0]
    assert window.success == 3 / 6


def test_task_weights_follow_p_times_one_minus_p_mixed_with_the_shares() -> None:
    sampler = LearnabilitySampler({"a": 1.0, "b": 1.0}, window=8, floor=0.02, mix_share=0.2)
    observe(sampler, "a", [1] * 8)  # p = 9/10, p(1-p) = 0.09
    observe(sampler, "b", [1, 0] * 4)  # p = 5/10, p(1-p) = 0.25
    # signal: 0.5 * 0.09 = 0.045 and 0.5 * 0.25 = 0.125 of 0.17; share = 0.8 * signal + 0.2 * 0.5
    weights = sampler.task_weights()
    assert weights["a"] == pytest.approx(0.8 * 0.045 / 0.17 + 0.1)  # 0.31176
    assert weights["b"] == pytest.approx(0.8 * 0.125 / 0.17 + 0.1)  # 0.68824
    assert weights["a"] == pytest.approx(0.3117647, abs=1e-6)
    assert sum(weights.values()) == pytest.approx(1.0)


def test_the_floor_and_the_configured_mix_keep_a_hopeless_task_drawn() -> None:
    sampler = LearnabilitySampler({"a": 3.0, "b": 1.0}, window=30, floor=0.05, mix_share=0.2)
    observe(sampler, "a", [0] * 40)  # the last 30: p = 1/32, p(1-p) = 0.0303 < floor 0.05
    assert sampler.task_learnability("a") == 0.05
    assert sampler.task_learnability("b") == 0.25  # no episode yet: p = 1/2
    # signal: 0.75 * 0.05 = 0.0375 and 0.25 * 0.25 = 0.0625 of 0.1
    weights = sampler.task_weights()
    assert weights["a"] == pytest.approx(0.8 * 0.375 + 0.2 * 0.75)  # 0.45
    assert weights["b"] == pytest.approx(0.8 * 0.625 + 0.2 * 0.25)  # 0.55
    status = sampler.snapshot()["tasks"]
    assert status["a"]["episodes"] == 30 and status["a"]["weight"] == 0.45 and status["a"]["configured"] == 0.75


def test_task_ids_are_drawn_by_their_levels_learnability() -> None:
    sampler = LearnabilitySampler({"a": 1.0}, window=8, floor=0.02, mix_share=0.2)
    observe(sampler, "a", [1, 1], task_id="x1", level=1)  # level 1: p = 3/4, p(1-p) = 3/16
    observe(sampler, "a", [1, 0], task_id="y1", level=2)  # level 2: p = 2/4, p(1-p) = 1/4
    # the task: [1, 1, 1, 0], p = 4/6, p(1-p) = 2/9, for ids whose level is not known yet
    ids = ["x1", "x2", "y1", "z"]
    raw = [3 / 16, 2 / 9, 1 / 4, 2 / 9]
    expected = [0.8 * r / sum(raw) + 0.2 / 4 for r in raw]
    assert sampler.id_weights("a", ids) == pytest.approx(expected)
    levels = sampler.snapshot()["tasks"]["a"]["levels"]
    assert levels["1"] == {"episodes": 2, "success": 0.75, "learnability": 0.1875, "task_ids": 1}
    assert levels["2"]["learnability"] == 0.25


def test_without_levels_task_ids_are_drawn_uniformly_as_without_the_sampler() -> None:
    sampler = LearnabilitySampler({"a": 1.0}, window=8, floor=0.02, mix_share=0.2)
    observe(sampler, "a", [1, 0, 1])  # level 0: the env grades no levels
    ids = [f"t-{i}" for i in range(10)]
    assert sampler.id_weights("a", ids) is None
    assert sampler.choose_task_id("a", ids, random.Random(7)) == random.Random(7).choice(ids)


def test_planner_draws_groups_in_the_samplers_shares() -> None:
    sampler = LearnabilitySampler({"solved": 1.0, "open": 1.0}, window=64, floor=0.02, mix_share=0.2)
    observe(sampler, "solved", [1] * 64)  # p = 65/66, p(1-p) = 0.0149 < floor 0.02
    observe(sampler, "open", [1, 0] * 32)  # p = 1/2, p(1-p) = 0.25
    # signal: 0.5 * 0.02 = 0.01 and 0.5 * 0.25 = 0.125 of 0.135; share = 0.8 * 0.01 / 0.135 + 0.1 = 0.15926
    planner = Planner({"solved": 1.0, "open": 1.0}, {"solved": ["s"], "open": ["o"]}, seed=0, sampler=sampler)
    drawn = [planner.next_group() for _ in range(1000)]
    assert 158 <= sum(1 for pick in drawn if pick and pick[0] == "solved") <= 161


def test_task_sampler_settings_are_checked(config: JetRLConfig) -> None:
    config.controller.task_sampler = "hardest"
    with pytest.raises(ConfigError, match=r'controller\.task_sampler: expected one of "mix" \| "learnability"'):
        validate(config)
    config.controller.task_sampler, config.controller.sampler_floor = "learnability", 0.3
    with pytest.raises(ConfigError, match=r"controller\.sampler_floor must be in \[0, 0\.25\]"):
        validate(config)


# ---------------------------------------------------------------------------------------- a real run
@pytest.fixture
async def sums_hosts(nc: Any, subjects: Subjects) -> Any:
    """Two sums envs: ``flat``, whose oracle is always right, and ``mixed``, whose strict grader fails the
    oracle on the odd task ids (half the tasks)."""
    cfg = EnvConfig(num_train_tasks=8, num_test_tasks=2, max_sessions=16)
    hosts, services = [], []
    for name, numeric in (("flat", True), ("mixed", False)):
        env = SumEnv(numeric=numeric, tasks=8)
        env.name = name
        host = EnvHost(env, cfg, subjects, f"env-{name}-sampler")
        services.append(await host.serve(nc, nc.jetstream()))
        hosts.append(host)
    yield hosts
    for service, host in zip(services, hosts, strict=True):
        await service.stop()
        await host.shutdown()


@pytest.mark.timeout(180)
async def test_an_always_flat_task_is_drawn_less_and_the_weights_are_in_status(nc, config, subjects,
                                                                              sums_hosts) -> None:
    quiet_transformers()
    c = config.controller
    config.run.tasks = {"flat": 1.0, "mixed": 1.0}
    c.group_size, c.max_inflight, c.max_backlog, c.env_wait_s = 2, 4, 0, 20.0
    c.task_sampler, c.sampler_window = "learnability", 32
    config.rollout.engine, config.rollout.concurrency = "oracle", 4
    validate(config)
    js = nc.jetstream()
    controller = Controller(nc, js, subjects, config, "controller-sampler")
    worker = RolloutWorker(nc, js, subjects, config.rollout, None, load_tokenizer(resolve_model(ModelConfig())),
                           "rollout-sampler", tasks=list(config.run.tasks))
    stop = asyncio.Event()
    jobs = [asyncio.create_task(controller.track_trajectories()), asyncio.create_task(controller.publish_jobs(stop)),
            asyncio.create_task(worker.run(stop))]
    started = time.monotonic()
    try:
        while len(controller.finished) < 64 and time.monotonic() - started < 120:
            await asyncio.sleep(0.1)
        async with served(create_app(controller)) as client:
            status = (await client.get("/status")).json()
            board = (await client.get("/api/dashboard")).json()  # what the dashboard's sampler table reads
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(*jobs[1:], return_exceptions=True), 30)
        jobs[0].cancel()
    assert len(controller.finished) >= 64, controller.status()
    weights = status["sampler"]["tasks"]
    # mixed: whole groups of one task id each, half the ids solved: p is near 1/2 but varies with the draws
    assert weights["flat"]["success"] > 0.9 and 0.15 < weights["mixed"]["success"] < 0.85, weights
    assert weights["flat"]["weight"] < 0.35 and weights["mixed"]["weight"] > 0.65, weights
    assert set(board["status"]["sampler"]["tasks"]) == {"flat", "mixed"}
    published = {t: x["published"] for t, x in status["tasks"].items()}
    assert published["flat"] < published["mixed"], published  # the mix alone would publish them equally


async def test_only_training_episodes_the_policy_played_move_the_weights(nc, config, subjects) -> None:
    config.run.tasks, config.controller.task_sampler = {"db": 1.0}, "learnability"
    controller = Controller(nc, nc.jetstream(), subjects, config, "controller-sampler-feed")
    solved = traj("e-1", "db", 1.0, [0])
    controller.on_trajectory(solved)
    controller.on_trajectory(msgspec.structs.replace(traj("e-2", "db", 0.0, [0]), status="env_error"))
    controller.on_trajectory(traj("e-3", "db", 0.0, [0], split="test"))
    controller.on_trajectory(msgspec.structs.replace(traj("e-4", "db", 0.0, [0]), group_id="eval-greedy-db-1"))
    assert controller.sampler is not None and list(controller.sampler.tasks["db"].outcomes) == [1]
    assert controller.status()["sampler"]["tasks"]["db"]["episodes"] == 1


async def test_without_the_sampler_status_says_so_and_the_shares_are_exact(nc, config, subjects) -> None:
    config.run.tasks = {"a": 1.0, "b": 1.0}
    controller = Controller(nc, nc.jetstream(), subjects, config, "controller-mix")
    assert controller.sampler is None and controller.status()["sampler"] is None
    planner = Planner(config.run.tasks, {"a": ["a-0"], "b": ["b-0"]}, seed=0)
    assert [planner.next_group() for _ in range(4)] == [("a", "a-0"), ("b", "b-0"), ("a", "a-0"), ("b", "b-0")]
