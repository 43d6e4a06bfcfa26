"""The controller: turns the run plan into episode jobs, with backpressure, and keeps the books.

* Plan: a task mix (``run.tasks``), groups of ``group_size`` episodes of the same task instance,
  published as jobs on ``jobs.<task>`` until the trainer has done ``trainer.steps`` steps.
* Backpressure: at most ``max_inflight`` episodes published and not yet finished, and none published
  while ``max_backlog`` finished trajectories wait for the trainer (read off the trainer's consumer on
  TRAJ): rollouts never wait for a training step, but they do not run far ahead of the trainer either,
  which would only burn CPU on data that is stale by the time it is trained on. Because rollout
  replicas pull jobs, more replicas simply drain the queue faster.
* Synchronous mode (``controller.sync``, the on-policy baseline): one training batch at a time, its jobs
  naming the newest policy version (a rollout loads it before the first turn); the next batch waits for
  the trainer's step on this one. Staleness 0, and no overlap of generation and training.
* Lanes (``controller.task_max_inflight``): a task with its bound of episodes in flight is skipped, so a
  slow or stuck task (a sandbox per episode, a game engine) cannot hold every in-flight slot while a fast one waits; with
  ``lane_lead`` the others run at most that many groups ahead of their share, which keeps the mix.
* Lifecycle: an episode is *published*, then *finished* when its trajectory lands in TRAJ (each
  episode id counted once, whatever the redeliveries).
* Metrics: the latest report of every role, plus per-task success of finished episodes.

What the controller hears back (trajectories, the trainer's word, metrics, replicas) and the books it keeps
of it are ``RunBooks`` (services/controller/books.py); the task-mix schedule is ``Planner``
(services/controller/planner.py). This module plans and publishes, and reports the run's status.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from services.controller.books import RunBooks
from services.controller.planner import Planner
from services.controller.report import eval_report
from shared.config import JetRLConfig
from shared.delivery import TRANSIENT, publish_retrying
from shared.envapi import EnvClient, EnvError
from shared.lifecycle import supervise
from shared.messages import EpisodeJob, RunControl, encode
from shared.signing import signer_for
from shared.subjects import Subjects

log = structlog.get_logger()


@dataclass
class SyncBatch:
    """One batch of the synchronous mode: how long its episodes took, then how long the trainer's step."""

    policy_version: int
    episodes: int
    gen_s: float
    train_wait_s: float


class Controller(RunBooks):
    """Publishes the plan's jobs within the bounds its books allow, and reports the run's status."""

    def __init__(self, nc: Client, js: JetStreamContext, subjects: Subjects, cfg: JetRLConfig, replica_id: str) -> None:
        super().__init__(nc, js, subjects, cfg)
        self.replica_id = replica_id
        self.sync_batches: list[SyncBatch] = []
        self.started_at = time.time()
        self.state = "starting"
        self.groups_published = 0
        self.signer = signer_for(cfg.nats)  # signs run.control where the run has keys
        self._backlog = 0  # the last reading of the trainer's backlog (see backlog_full)
        self._backlog_read_at = -1.0
        self._finished_at_read = 0
        self.eval_planned: dict[str, int] = {}  # eval mode: episodes per task the run will publish
        self._failure_announcer: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ plan and publish
    async def fetch_task_ids(self, timeout_s: float = 120.0, split: str = "train",
                             train_limit: bool = True) -> dict[str, list[str]]:
        """Ask each task's env service for its task ids of a split (waits for env replicas to come up: a task whose
        engines load slowly takes longer than a request's timeout); for training, the first ``controller.train_limit`` of them."""
        out: dict[str, list[str]] = {}
        deadline = time.monotonic() + timeout_s
        for task, share in self.cfg.run.tasks.items():
            if share <= 0:
                continue
            client = EnvClient(self.nc, self.subjects, task, timeout_s=10.0)
            while True:
                try:
                    out[task] = await client.task_ids(split)
                    break
                except EnvError as exc:
                    building = self.env_building(task)
                    if building:  # a replica is building its task data: wait for it, however long it takes
                        self.state = f"waiting for env {task}: {building}"
                        deadline = max(deadline, time.monotonic() + timeout_s)
                    elif time.monotonic() > deadline:
                        raise RuntimeError(f"env service for task {task!r} did not answer within {timeout_s:g}s "
                                           f"(controller.env_wait_s) and no replica of it is building: {exc}") from None
                    await asyncio.sleep(0.5)
            if not out[task]:
                raise RuntimeError(f"env service for task {task!r} has no {split} tasks")
            if train_limit:
                out[task] = out[task][: self.cfg.controller.train_limit or None]
        return out

    def fail(self, error: BaseException) -> None:
        """The plan cannot go on: /status says why, and ``run.control`` says so every 5 s until the controller
        stops (``jetrl up`` ends the run on it with the reason; a reader that joins late still hears it)."""
        self.state = f"failed: {error}"
        log.error("plan_failed", error=repr(error))
        self._failure_announcer = supervise(self._announce_failure(str(error)), "failure_announcer", None)

    async def _announce_failure(self, reason: str, every_s: float = 5.0) -> None:
        while not self.nc.is_closed:
            try:
                await self.nc.publish(self.subjects.run_control, self.control(RunControl(event="failed", info={"reason": reason})))
            except Exception as exc:  # NATS restarting: said again at the next tick
                log.warning("failure_announce_failed", error=repr(exc))
            await asyncio.sleep(every_s)

    async def publish_jobs(self, stop: asyncio.Event) -> None:
        task_ids = await self.fetch_task_ids(self.cfg.controller.env_wait_s)
        planner = Planner(self.cfg.run.tasks, task_ids, self.cfg.run.seed, self.cfg.controller.lane_lead,
                          self.sampler)
        self.state = "running"
        await self.nc.publish(self.subjects.run_control, self.control(RunControl(event="started", info={
            "tasks": {t: len(ids) for t, ids in task_ids.items()}, "sync": self.cfg.controller.sync})))
        if self.cfg.controller.sync:
            await self.publish_sync(planner, stop)
        else:
            await self.publish_async(planner, stop)
        self.state = "finished" if self.training_done else "stopped"

    async def publish_async(self, planner: Planner, stop: asyncio.Event) -> None:
        """Groups as fast as the bounds allow: in flight, per-task lanes, the trainer's backlog."""
        size = self.cfg.controller.group_size
        while not stop.is_set() and not self.training_done:
            self.expire_lost()
            if len(self.inflight) + size > max(self.cfg.controller.max_inflight, size) or await self.backlog_full():
                await self._wait_for_news()
                continue
            pick = planner.next_group(self.open_lanes())  # None: every task with room is ahead of its share
            if pick is None:
                await self._wait_for_news()
                continue
            await self.publish_group(*pick)

    async def publish_sync(self, planner: Planner, stop: asyncio.Event) -> None:
        """One batch (the ``trainer.min_groups`` groups of one step) at a time, with the newest policy
        version: publish, wait for every episode, wait for the trainer's step on them, again."""
        while not stop.is_set() and not self.training_done:
            step, version = self.trainer_step, await self.newest_policy_version()
            started = time.monotonic()
            episodes: list[str] = []
            for _ in range(self.cfg.trainer.min_groups):
                pick = planner.next_group()
                assert pick is not None  # every task eligible: the one owed most is never ahead of its share
                episodes += await self.publish_group(*pick, policy_version=version)
            await self._wait_until(lambda batch=episodes: not any(e in self.inflight for e in batch), stop)
            generated = time.monotonic()
            await self._wait_until(lambda before=step: self.trainer_step > before or self.training_done, stop)
            if stop.is_set():
                return
            batch = SyncBatch(policy_version=version, episodes=len(episodes), gen_s=generated - started,
                              train_wait_s=time.monotonic() - generated)
            self.sync_batches.append(batch)
            log.info("sync_batch", policy_version=version, episodes=batch.episodes, gen_s=round(batch.gen_s, 2),
                     train_wait_s=round(batch.train_wait_s, 2))

    async def publish_group(self, task: str, task_id: str, policy_version: int = -1) -> list[str]:
        """The ``group_size`` jobs of one group (same task instance); their episode ids."""
        size = self.cfg.controller.group_size
        group_id = f"g{self.groups_published:06d}-{uuid.uuid4().hex[:8]}"
        ids = []
        for i in range(size):
            job = EpisodeJob(episode_id=f"{group_id}-{i}", group_id=group_id, task=task, task_id=task_id,
                             group_size=size, temperature=self.cfg.controller.temperature,
                             max_new_tokens=self.cfg.rollout.max_new_tokens, policy_version=policy_version)
            # retried while a server restarts or a cluster elects a new JOBS leader (no stream response):
            # the episode id as Nats-Msg-Id keeps a retry whose first try landed from being queued twice
            await publish_retrying(self.js, self.subjects.jobs(task), encode(job),
                                   headers={"Nats-Msg-Id": job.episode_id})
            self.track(job.episode_id, task)
            ids.append(job.episode_id)
        self.groups_published += 1
        return ids

    def open_lanes(self) -> set[str]:
        """Tasks with room for one more group under their ``task_max_inflight`` bound."""
        lanes, size = self.cfg.controller.task_max_inflight, self.cfg.controller.group_size
        bound = {t: lanes.get(t, lanes.get("*", 0)) for t in self.cfg.run.tasks}
        return {t for t, b in bound.items() if not b or self.inflight_by_task[t] + size <= max(b, size)}

    async def _wait_for_news(self) -> None:
        """Until a trajectory, weights or a trainer report arrives (at most 1 s)."""
        self._capacity.clear()
        try:
            await asyncio.wait_for(self._capacity.wait(), timeout=1.0)
        except TimeoutError:
            pass

    async def _wait_until(self, done: Callable[[], bool], stop: asyncio.Event) -> None:
        while not done() and not stop.is_set():
            self.expire_lost()
            await self._wait_for_news()

    async def run_eval(self, stop: asyncio.Event) -> dict[str, Any]:
        """Every task of the eval split, once per pass: ``greedy`` (one attempt at temperature 0) and/or
        ``sampled`` (``eval_samples`` attempts at ``eval_temperature``, for pass@k); waits for every
        trajectory and returns the report (``services/controller/report.py``)."""
        c = self.cfg.controller
        self.state = "evaluating"
        samples = {"greedy": 1, "sampled": max(1, c.eval_samples)}
        temperature = {"greedy": 0.0, "sampled": c.eval_temperature}
        self.eval_results = {name: defaultdict(list) for name in c.eval_passes}
        fetch = asyncio.ensure_future(self.fetch_task_ids(split=c.eval_split, train_limit=False))
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait({fetch, stopped}, return_when=asyncio.FIRST_COMPLETED)
        stopped.cancel()
        if not fetch.done():  # stopped while the envs were still coming up: nothing was played
            fetch.cancel()
            self.state = "stopped"
            return {name: {} for name in c.eval_passes}
        ids = {task: all_ids[: c.eval_limit or None] for task, all_ids in fetch.result().items()}
        # what the run will publish, per task: `jetrl eval` shows progress and an ETA against it
        self.eval_planned = {task: len(task_ids) * sum(samples[name] for name in c.eval_passes)
                             for task, task_ids in ids.items()}
        for name in c.eval_passes:
            for task, task_ids in ids.items():
                for task_id in task_ids:
                    group_id = f"eval-{name}-{task}-{task_id}-{uuid.uuid4().hex[:6]}"
                    for i in range(samples[name]):
                        await self._wait_for_capacity(stop)
                        if stop.is_set():  # stopped: publish no more; what finished is still reported
                            break
                        job = EpisodeJob(episode_id=f"{group_id}-{i}", group_id=group_id, task=task, task_id=task_id,
                                         split=c.eval_split, group_size=samples[name],
                                         temperature=temperature[name], max_new_tokens=self.cfg.rollout.max_new_tokens)
                        await publish_retrying(self.js, self.subjects.jobs(task), encode(job),
                                               headers={"Nats-Msg-Id": job.episode_id})
                        self.track(job.episode_id, task)
        while len(self.inflight) and not stop.is_set():
            await asyncio.sleep(0.5)
        planned = {name: {task: len(task_ids) * samples[name] for task, task_ids in ids.items()} for name in c.eval_passes}
        report = eval_report(self.eval_results, samples, planned)
        if stop.is_set():  # a partial report: the caller keeps it apart; the bus may already be going down
            self.state = "stopped"
            return report
        self.state = "finished"
        await self.nc.publish(self.subjects.run_control, self.control(RunControl(event="eval_finished", info=report)))
        return report

    async def _wait_for_capacity(self, stop: asyncio.Event) -> None:
        await self._wait_until(lambda: len(self.inflight) < max(self.cfg.controller.max_inflight, 1), stop)

    @property
    def backlog_bound(self) -> float:
        """Never below what one training step needs (min_groups whole groups), or the run would stall."""
        c = self.cfg.controller
        if c.max_backlog <= 0 or c.mode != "train":
            return float("inf")
        return max(c.max_backlog, self.cfg.trainer.min_groups * c.group_size)

    async def backlog_full(self) -> bool:
        """Finished trajectories not yet trained on >= the bound. The trainer's consumer is read at most
        every 0.5 s; in between, every trajectory finished since the last reading counts as waiting (an
        upper bound: fast rollouts cannot overshoot the bound between readings)."""
        bound = self.backlog_bound
        if bound == float("inf"):
            return False
        estimate = self._backlog + len(self.finished) - self._finished_at_read
        if estimate >= bound and time.monotonic() - self._backlog_read_at >= 0.5:
            estimate = await self.trainer_backlog()
        return estimate >= bound

    async def trainer_backlog(self) -> int:
        """Trajectories in TRAJ the trainer has not trained on yet: its consumer's pending + delivered and
        unacked. Before the trainer's consumer exists: every finished one."""
        self._backlog_read_at = time.monotonic()
        self._finished_at_read = len(self.finished)
        try:
            info = await self.js.consumer_info(self.subjects.traj_stream, self.subjects.trainer_consumer)
            self._backlog = int(info.num_pending or 0) + int(info.num_ack_pending or 0)
        except NotFoundError:
            self._backlog = len(self.finished)
        except TRANSIENT as exc:  # a restart, or a new leader being elected in a cluster
            log.warning("trainer_backlog_unknown", error=repr(exc))  # keep the last reading
        return self._backlog

    # ------------------------------------------------------------------ control and status
    def control(self, event: RunControl) -> bytes:
        """A ``run.control`` message, signed where the run has keys (shared/signing.py)."""
        return encode(self.signer.sign(event) if self.signer is not None else event)

    def status(self) -> dict[str, Any]:
        tasks = {}
        for task, book in sorted(self.books.items()):
            tasks[task] = {
                "published": book.published, "finished": book.finished, "succeeded": book.successes,
                "turns": book.turns, "generated_tokens": book.generated_tokens, "statuses": dict(book.statuses),
                "success_rate": book.successes / book.finished if book.finished else 0.0,
                "recent_success_rate": sum(book.recent) / len(book.recent) if book.recent else 0.0,
                "mean_reward": book.reward_sum / book.finished if book.finished else 0.0,
            }
        trainer = {k.split("/", 1)[1]: v.values for k, v in self.latest_metrics.items() if k.startswith("trainer/")}
        # `jetrl up` reports the services it restarted (role "supervisor"): service -> restarts
        supervisor = next((v.values for k, v in self.latest_metrics.items() if k.startswith("supervisor/")), {})
        restarts = {k.split("/", 1)[1]: int(v) for k, v in supervisor.items() if k.startswith("restarts/")}
        return {
            "state": self.state, "policy_version": self.policy_version, "target_steps": self.cfg.trainer.steps,
            "episodes_published": sum(b.published for b in self.books.values()),
            "episodes_finished": len(self.finished), "episodes_inflight": len(self.inflight),
            "duplicate_trajectories": self.duplicates, "episodes_lost": self.lost, "groups_published": self.groups_published,
            # metrics or heartbeats whose body named another source than their subject (services/controller/sources.py)
            "refused_reports": self.refused_reports + self.registry.refused,
            "refused_signatures": self.refused_signatures,  # announcements or TrainingFinished not the trainer's
            "uptime_s": round(time.time() - self.started_at, 1), "tasks": tasks,
            "trainer": next(iter(trainer.values()), {}), "replicas": self.replicas,
            "eval_planned": self.eval_planned,
            "service_restarts": restarts,
            "inflight_by_task": {t: n for t, n in sorted(self.inflight_by_task.items()) if n},
            "sampler": self.sampler.snapshot() if self.sampler is not None else None,  # learnability weights
            "sync": {"batches": len(self.sync_batches),
                     "gen_s_mean": _mean([b.gen_s for b in self.sync_batches]),
                     "train_wait_s_mean": _mean([b.train_wait_s for b in self.sync_batches])}
            if self.cfg.controller.sync else None,
        }


def _mean(values: list[float]) -> float:
    return round(sum(values) / len(values), 3) if values else 0.0
