"""The controller's books: what it hears back, and what it counts of it.

* Episodes: each published one is *in flight* until its trajectory lands in TRAJ (each episode id counted
  once, whatever the redeliveries), or until ``controller.episode_timeout_s`` passes (its job ran out of
  deliveries: *lost*). Per task: published, finished, successes, rewards, turns, tokens and statuses.
* The trainer's word: its metrics reports (its step), the weights it announces (the policy version) and its
  ``TrainingFinished``, which alone ends the plan; an announcement without its signature is refused.
* Metrics: the latest report of every role (its role read off the subject, never the body).
* Replicas: the registry's live replicas (an env replica building its task data says so).

``Controller`` (services/controller/controller.py) plans and publishes on top of these books.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext

from services.controller.board import RunBoard
from services.controller.sampler import LearnabilitySampler
from services.controller.sources import Replicas, checked_report
from shared.config import JetRLConfig
from shared.consumers import bind_durable, controller_consumer
from shared.delivery import dead_letter, decode_or_dead_letter, judge_each
from shared.messages import (
    BadMessage,
    EpisodeStatus,
    MetricsReport,
    TrainingFinished,
    Trajectory,
    WeightsAnnouncement,
    decode,
)
from shared.readiness import describe_build, is_building
from shared.signing import SignatureError, verifier_for
from shared.subjects import Subjects

log = structlog.get_logger()


@dataclass
class TaskBook:
    published: int = 0
    finished: int = 0
    successes: int = 0
    reward_sum: float = 0.0
    recent: deque[float] = field(default_factory=lambda: deque(maxlen=64))
    turns: int = 0  # env interactions of finished episodes (each turn is one interact call)
    generated_tokens: int = 0  # tokens the policy sampled in them (the loss mask)
    statuses: Counter[str] = field(default_factory=Counter)  # finished episodes by status


class RunBooks:
    """The state the controller keeps of the run and the handlers that keep it: what is in flight, what
    finished, what the trainer said, who is alive. ``Controller`` adds the plan on top."""

    def __init__(self, nc: Client, js: JetStreamContext, subjects: Subjects, cfg: JetRLConfig) -> None:
        self.nc, self.js, self.subjects, self.cfg = nc, js, subjects, cfg
        self.books: dict[str, TaskBook] = defaultdict(TaskBook)
        self.inflight: dict[str, float] = {}  # episode id -> published at
        self.inflight_task: dict[str, str] = {}  # episode id -> task, for the per-task lanes
        self.inflight_by_task: Counter[str] = Counter()
        self.finished: set[str] = set()
        self.duplicates = 0
        self.lost = 0
        self.policy_version = 0
        self.trainer_step = 0
        self.trainer_finished: TrainingFinished | None = None  # the trainer's own "done": ends the plan
        self.eval_results: dict[str, dict[str, list[Trajectory]]] = {}
        self.latest_metrics: dict[str, MetricsReport] = {}
        self._capacity = asyncio.Event()  # set on news: a trajectory, weights, a trainer report
        self.replicas: list[dict[str, Any]] = []
        self.registry = Replicas(subjects, cfg.nats.heartbeat_ttl_s)
        self.refused_reports = 0  # metrics whose body names another role than their subject
        self.trainer_verifier = verifier_for(cfg.nats, "trainer")
        self.refused_signatures = 0
        self.creates_durables = True  # an open server; with per-role users the admin makes them (shared/consumers.py)
        self.board = RunBoard(subjects)  # what the dashboard and the trajectory viewer show
        c, tasks = cfg.controller, cfg.run.tasks
        self.sampler = (LearnabilitySampler(tasks, c.sampler_window, c.sampler_floor, c.sampler_mix)
                        if c.task_sampler == "learnability" and c.mode == "train" and any(w > 0 for w in tasks.values())
                        else None)

    # ------------------------------------------------------------------ episodes in flight
    def track(self, episode_id: str, task: str) -> None:
        self.inflight[episode_id] = time.time()
        self.inflight_task[episode_id] = task
        self.inflight_by_task[task] += 1
        self.books[task].published += 1

    def untrack(self, episode_id: str) -> None:
        self.inflight.pop(episode_id, None)
        task = self.inflight_task.pop(episode_id, None)
        if task is not None:
            self.inflight_by_task[task] -= 1

    def expire_lost(self) -> None:
        """Episodes whose jobs ran out of deliveries never report back: free their in-flight slots."""
        cutoff = time.time() - self.cfg.controller.episode_timeout_s
        for episode_id in [e for e, t in self.inflight.items() if t < cutoff]:
            self.untrack(episode_id)
            self.lost += 1
            log.warning("episode_lost", episode_id=episode_id)

    # ------------------------------------------------------------------ finished trajectories
    async def track_trajectories(self) -> None:
        sub = await bind_durable(self.js, self.subjects.traj_stream, controller_consumer(self.subjects),
                                 may_create=self.creates_durables)
        while True:
            try:
                msgs = await sub.fetch(128, timeout=1.0)
            except (TimeoutError, NatsTimeout):
                continue
            except Exception as exc:  # broker restarting: wait and read on (a closed connection ends the service)
                if self.nc.is_closed:
                    return
                log.warning("trajectory_fetch_failed", error=repr(exc))
                await asyncio.sleep(0.5)
                continue
            await judge_each(self.js, self.subjects, "controller", msgs, self._take_trajectory)

    async def _take_trajectory(self, msg: Msg) -> None:
        traj = await decode_or_dead_letter(self.js, self.subjects, "controller", msg, Trajectory)
        if traj is not None:
            self.on_trajectory(traj)
            await msg.ack()

    def on_trajectory(self, traj: Trajectory) -> None:
        if traj.episode_id in self.finished:
            self.duplicates += 1
            return
        self.finished.add(traj.episode_id)
        self.untrack(traj.episode_id)
        self.board.on_trajectory(traj, self.policy_version)
        book = self.books[traj.task]
        book.finished += 1
        book.successes += int(traj.success)
        book.reward_sum += traj.reward
        book.recent.append(1.0 if traj.success else 0.0)
        book.turns += len(traj.turns)
        book.generated_tokens += sum(traj.loss_mask)
        book.statuses[traj.status] += 1
        if (self.sampler is not None and traj.split == "train" and not traj.group_id.startswith("eval-")
                and traj.status != EpisodeStatus.ENV_ERROR):  # an env failure says nothing of the policy
            self.sampler.observe(traj.task, traj.task_id, traj.level, traj.success)
        if traj.group_id.startswith("eval-"):
            name = traj.group_id.split("-")[1]  # eval-<pass>-<task>-...
            if name in self.eval_results:
                self.eval_results[name][traj.task].append(traj)
        self._capacity.set()

    # ------------------------------------------------------------------ the trainer's word and the metrics
    @property
    def training_done(self) -> bool:
        """Only the trainer's ``TrainingFinished`` ends the plan: a weights announcement or a metrics report
        with a version or step beyond ``trainer.steps`` (forged, or another run's) is only a figure."""
        return self.trainer_finished is not None

    async def newest_policy_version(self) -> int:
        """The policy KV's version (the trainer writes it before it announces or reports the step)."""
        try:
            kv = await self.js.key_value(self.subjects.policy_kv)
            note = decode((await kv.get(self.subjects.policy_version_key)).value or b"", WeightsAnnouncement)
            self.trainer_verifier.check(note)  # an entry the trainer did not sign is no version of ours
            self.policy_version = max(self.policy_version, note.version)
        except Exception as exc:  # no version yet: the initial weights (version 0)
            log.debug("policy_version_unread", error=type(exc).__name__)
        return self.policy_version

    async def follow_metrics_and_weights(self) -> None:
        async def on_metrics(msg: Any) -> None:
            report, why = checked_report(self.subjects, msg)  # the role is the subject's, never the body's
            if report is None:
                self.refused_reports += 1
                log.warning("metrics_refused", subject=msg.subject, reason=why)
                return
            self.latest_metrics[f"{report.role}/{report.replica_id}"] = report
            self.board.on_metrics(report)
            if report.role == "trainer":  # an SFT trainer publishes no weights; its steps still count
                self.trainer_step = max(self.trainer_step, report.step)
                self._capacity.set()

        async def on_weights(msg: Any) -> None:
            try:
                note = self.trainer_verifier.check(decode(msg.data, WeightsAnnouncement))
                self.policy_version = max(self.policy_version, note.version)
            except BadMessage as exc:
                log.warning("bad_weights_announcement", reason=exc.reason)
            except SignatureError as exc:
                await self.refuse_unsigned(msg, exc)
            self._capacity.set()

        async def on_finished(msg: Any) -> None:
            try:
                finished = self.trainer_verifier.check(decode(msg.data, TrainingFinished))
            except BadMessage as exc:
                log.warning("bad_training_finished", reason=exc.reason)
                return
            except SignatureError as exc:
                await self.refuse_unsigned(msg, exc)
                return
            self.trainer_finished = finished
            log.info("training_finished", step=self.trainer_finished.step,
                     policy_version=self.trainer_finished.policy_version, trainer=self.trainer_finished.replica_id)
            self._capacity.set()

        await self.nc.subscribe(self.subjects.metrics(">"), cb=on_metrics)
        await self.nc.subscribe(self.subjects.weights_published, cb=on_weights)
        await self.nc.subscribe(self.subjects.training_finished, cb=on_finished)

    async def refuse_unsigned(self, msg: Any, exc: SignatureError) -> None:
        """A control message without the trainer's signature: counted, dead-lettered, otherwise ignored."""
        self.refused_signatures += 1
        log.warning("unsigned_control_refused", subject=msg.subject, reason=str(exc))
        await dead_letter(self.js, self.subjects, service="controller", origin_subject=msg.subject, reason=str(exc),
                          payload=msg.data)

    # ------------------------------------------------------------------ replicas
    async def watch_replicas(self, every_s: float = 2.0) -> None:
        """Keep ``self.replicas`` fresh from the registry's writes (the HTTP handlers never touch NATS)."""
        sub = await self.registry.follow(self.nc)
        try:
            while True:
                self.replicas = await self.read_replicas()
                await asyncio.sleep(every_s)
        finally:
            try:
                await sub.unsubscribe()
            except Exception as exc:  # the connection is closing
                log.debug("registry_unsubscribe", error=repr(exc))

    async def read_replicas(self) -> list[dict[str, Any]]:
        return self.registry.rows()

    def env_building(self, task: str) -> str:
        """``building, questions 43 %`` while a live replica of ``task``'s env builds its data, else ''."""
        ttl = self.cfg.nats.heartbeat_ttl_s
        for r in self.replicas:
            if r["role"] == f"env-{task}" and r["age_s"] < ttl and is_building(r["info"]):
                return describe_build(r["info"])
        return ""
