"""What the dashboard and the trajectory viewer show, kept by the controller from the NATS streams.

The controller already sees every finished trajectory (its durable consumer on TRAJ) and every
metrics report (``metrics.>``); ``RunBoard`` keeps histories of both, and itself follows:

* ``act.*.*`` (core NATS, not a consumer): which episodes are running now and at which turn;
* the DLQ stream's per-subject message counts (``stream_info`` with a subject filter): dead letters
  by service, the last token of ``dlq.<service>``;
* on request, one episode's events from the EPISODES stream (an ephemeral consumer filtered to it).

Everything here is bounded (recent episodes, recent samples), so a long run does not grow the
controller without limit. The HTTP handlers only read these structures, except the episode reads.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, defaultdict, deque
from collections.abc import AsyncIterator
from dataclasses import asdict, dataclass, field
from typing import Any

import structlog
from nats.aio.client import Client
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from shared.messages import ActionEvent, BadMessage, MetricsReport, ObservationEvent, Trajectory, decode
from shared.subjects import Subjects

log = structlog.get_logger()

SERIES_KEYS = ("train/step_s", "train/loss", "train/trajectories", "train/tokens", "train/staleness_mean")
SERIES_TASK_SUFFIXES = ("/success", "/reward", "/turns")
"""The trainer metrics the dashboard draws over steps (the rest stay in metrics.jsonl and TensorBoard)."""
MAX_POINTS = 400
"""A series longer than this is thinned (every k-th point, the last kept): a poll stays small in long runs."""
STALENESS_BINS = 11
"""Staleness histogram bins: 0, 1, ..., 9 versions behind, and 10 or more."""
RATE_WINDOW_S = 20.0
"""Episodes/s and tokens/s are measured over this trailing window."""


@dataclass
class EpisodeSummary:
    """One finished episode as the viewer lists it (from its Trajectory)."""

    episode_id: str
    group_id: str
    task: str
    task_id: str
    split: str
    status: str
    reward: float
    turns: int
    tokens: int
    generated_tokens: int
    min_version: int
    max_version: int
    engines: list[str]
    replica_id: str
    invalid_actions: float
    level: int
    task_kind: str
    finished_at: float

    @classmethod
    def of(cls, traj: Trajectory, finished_at: float) -> EpisodeSummary:
        versions = [t.policy_version for t in traj.turns] or [-1]
        return cls(episode_id=traj.episode_id, group_id=traj.group_id, task=traj.task, task_id=traj.task_id,
                   split=traj.split, status=traj.status, reward=traj.reward, turns=len(traj.turns),
                   tokens=len(traj.tokens), generated_tokens=sum(traj.loss_mask), min_version=min(versions),
                   max_version=max(versions), engines=sorted({t.engine_id for t in traj.turns}),
                   replica_id=traj.replica_id, invalid_actions=float(traj.metrics.get("invalid_actions", 0.0)),
                   level=traj.level, task_kind=traj.task_kind, finished_at=finished_at)


@dataclass
class LiveEpisode:
    """An episode seen on ``act.*.*`` whose trajectory has not arrived yet."""

    episode_id: str
    task: str
    turn: int
    engine_id: str
    policy_version: int
    replica_id: str
    started_at: float
    last_at: float


@dataclass
class TaskQuality:
    """Per task, from finished trajectories: tool-call validity (all and recent)."""

    turns: int = 0
    invalid: float = 0.0
    recent: deque[tuple[int, float]] = field(default_factory=lambda: deque(maxlen=200))  # (turns, invalid)


@dataclass
class EpisodeFilter:
    """The viewer's list filter; None = any."""

    task: str | None = None
    split: str | None = None
    status: str | None = None
    min_reward: float | None = None
    max_reward: float | None = None
    min_version: int | None = None
    max_version: int | None = None
    limit: int = 100


class RunBoard:
    def __init__(self, subjects: Subjects, max_episodes: int = 20000, max_steps: int = 5000) -> None:
        self.subjects = subjects
        self.episodes: OrderedDict[str, EpisodeSummary] = OrderedDict()
        self.max_episodes = max_episodes
        self.live: OrderedDict[str, LiveEpisode] = OrderedDict()
        self.trainer_rows: deque[dict[str, Any]] = deque(maxlen=max_steps)  # one per trainer step
        self.replica_versions: dict[str, dict[str, Any]] = {}  # replica id -> {role, version, ts}
        self.quality: dict[str, TaskQuality] = defaultdict(TaskQuality)
        self.staleness = [0] * STALENESS_BINS  # policy turns on arrival: versions behind the newest policy
        self.trained_staleness = [0] * STALENESS_BINS  # turns the trainer trained on, behind the policy it trained
        self.finished_log: deque[tuple[float, int]] = deque(maxlen=100000)  # (ts, generated tokens)
        self.rates: deque[dict[str, float]] = deque(maxlen=1800)  # sampled every few seconds
        self.dlq: dict[str, int] = {}
        self.started_at = time.time()

    # ------------------------------------------------------------------ feeds
    def on_trajectory(self, traj: Trajectory, current_version: int) -> None:
        """A first-seen trajectory (the controller deduplicates before calling)."""
        now = time.time()
        self.live.pop(traj.episode_id, None)
        self.episodes[traj.episode_id] = EpisodeSummary.of(traj, now)
        while len(self.episodes) > self.max_episodes:
            self.episodes.popitem(last=False)
        q = self.quality[traj.task]
        invalid = float(traj.metrics.get("invalid_actions", 0.0))
        q.turns += len(traj.turns)
        q.invalid += invalid
        q.recent.append((len(traj.turns), invalid))
        for turn in traj.turns:
            if turn.policy_version >= 0:  # oracle turns (-1) come from no policy
                lag = max(0, current_version - turn.policy_version)
                self.staleness[min(lag, STALENESS_BINS - 1)] += 1
        self.finished_log.append((now, sum(traj.loss_mask)))

    def on_metrics(self, report: MetricsReport) -> None:
        self.replica_versions[report.replica_id] = {"role": report.role, "version": report.step, "ts": report.ts}
        if report.role == "trainer":
            row = {"step": report.step, "ts": report.ts, **report.values}
            if self.trainer_rows and self.trainer_rows[-1]["step"] >= report.step:
                return  # a restarted trainer repeating a step, or a late duplicate
            self.trainer_rows.append(row)
            for key, n in report.values.items():
                if key.startswith("train/staleness_hist/") and key.rsplit("/", 1)[1].isdigit():
                    self.trained_staleness[min(int(key.rsplit("/", 1)[1]), STALENESS_BINS - 1)] += int(n)

    def on_action(self, event: ActionEvent) -> None:
        if event.episode_id in self.episodes:
            return  # a late redelivery of a finished one
        now = time.time()
        live = self.live.get(event.episode_id)
        if live is None:
            live = self.live[event.episode_id] = LiveEpisode(
                episode_id=event.episode_id, task=event.task, turn=event.turn, engine_id=event.engine_id,
                policy_version=event.policy_version, replica_id=event.replica_id, started_at=now, last_at=now)
        live.turn, live.engine_id, live.policy_version, live.last_at = (event.turn, event.engine_id,
                                                                       event.policy_version, now)
        while len(self.live) > 1000:
            self.live.popitem(last=False)

    def sample_rates(self, finished: int) -> None:
        now = time.time()
        cutoff = now - RATE_WINDOW_S
        recent = [tokens for ts, tokens in self.finished_log if ts >= cutoff]
        window = min(RATE_WINDOW_S, max(now - self.started_at, 1e-6))
        self.rates.append({"ts": now, "episodes_per_s": len(recent) / window,
                           "tokens_per_s": sum(recent) / window, "finished": float(finished)})

    # ------------------------------------------------------------------ background
    async def follow(self, nc: Client, js: JetStreamContext, finished: Any, every_s: float = 2.0) -> None:
        """Track live episodes from ``act.*.*``; every ``every_s``: drop stale live entries, sample the
        rates (``finished()`` = the controller's finished count) and read the DLQ counts."""

        async def on_act(msg: Any) -> None:
            try:
                self.on_action(decode(msg.data, ActionEvent))
            except BadMessage:
                pass  # the rollout that wrote it is the one to fix; the EPISODES stream keeps it

        sub = await nc.subscribe(self.subjects.action("*", "*"), cb=on_act)
        try:
            while True:
                cutoff = time.time() - 600.0  # a replica that died mid-episode: forget it after 10 min
                for episode_id in [e for e, live in self.live.items() if live.last_at < cutoff]:
                    del self.live[episode_id]
                self.sample_rates(finished())
                try:
                    self.dlq = await self.dlq_counts(js)
                except Exception as exc:
                    log.warning("dlq_count_failed", error=repr(exc))
                await asyncio.sleep(every_s)
        finally:
            await sub.unsubscribe()

    async def dlq_counts(self, js: JetStreamContext) -> dict[str, int]:
        info = await js.stream_info(self.subjects.dlq_stream, subjects_filter=self.subjects.dead_letter(">"))
        counts: dict[str, int] = {}
        for subject, n in (info.state.subjects or {}).items():
            service = subject.rsplit(".", 1)[-1]
            counts[service] = counts.get(service, 0) + int(n)
        return dict(sorted(counts.items()))

    # ------------------------------------------------------------------ episodes
    def list_episodes(self, f: EpisodeFilter) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if f.status in (None, "", "running"):
            for live in reversed(self.live.values()):
                if f.task and live.task != f.task:
                    continue
                if f.min_version is not None and live.policy_version < f.min_version:
                    continue
                if f.max_version is not None and live.policy_version > f.max_version:
                    continue
                if f.min_reward is not None or f.max_reward is not None or f.split:
                    continue  # a running episode has neither reward nor (known) split yet
                out.append({"episode_id": live.episode_id, "task": live.task, "status": "running",
                            "turns": live.turn + 1, "min_version": live.policy_version,
                            "max_version": live.policy_version, "engines": [live.engine_id],
                            "replica_id": live.replica_id, "reward": None, "split": "", "task_id": ""})
        if f.status != "running":
            for e in reversed(self.episodes.values()):
                if len(out) >= f.limit:
                    break
                if ((f.task and e.task != f.task) or (f.split and e.split != f.split)
                        or (f.status and e.status != f.status)
                        or (f.min_reward is not None and e.reward < f.min_reward)
                        or (f.max_reward is not None and e.reward > f.max_reward)
                        or (f.min_version is not None and e.min_version < f.min_version)
                        or (f.max_version is not None and e.max_version > f.max_version)):
                    continue
                out.append(asdict(e))
        return out[: f.limit]

    def episode_subject(self, episode_id: str) -> str:
        """Both event kinds of one episode: ``<prefix>.<act|obs>.<task>.<episode id>``."""
        known = self.episodes.get(episode_id) or self.live.get(episode_id)
        task = known.task if known is not None else "*"
        return self.subjects.action(task, episode_id).replace(".act.", ".*.", 1)

    async def read_episode(self, js: JetStreamContext, episode_id: str, timeout_s: float = 1.0) -> dict[str, Any]:
        """The episode's events so far from the EPISODES stream, merged turn by turn; events that cannot be
        read are listed with the reason (``unreadable_events``)."""
        unreadable: list[dict[str, str]] = []
        events = [e async for e in self.episode_events(js, episode_id, follow=False, timeout_s=timeout_s,
                                                         unreadable=unreadable)]
        return self.assemble(episode_id, events) | {"unreadable_events": unreadable}

    async def episode_events(self, js: JetStreamContext, episode_id: str, follow: bool, timeout_s: float = 1.0,
                             unreadable: list[dict[str, str]] | None = None,
                             ) -> AsyncIterator[ActionEvent | ObservationEvent]:
        """Every event of one episode in stream order; with ``follow``, then the new ones as they land,
        until the episode finishes (an observation with ``finish``) or the caller stops iterating. One that
        cannot be decoded is skipped, and noted in ``unreadable`` (subject and reason) when given."""
        config = ConsumerConfig(deliver_policy=DeliverPolicy.ALL, ack_policy=AckPolicy.NONE,
                                filter_subject=self.episode_subject(episode_id), inactive_threshold=30.0,
                                mem_storage=True)
        sub = await js.pull_subscribe(config.filter_subject, stream=self.subjects.episodes_stream, config=config)
        try:
            while True:
                try:
                    msgs = await sub.fetch(256, timeout=timeout_s)
                except (TimeoutError, NatsTimeout):
                    if follow:
                        continue
                    return
                for msg in msgs:
                    event: ActionEvent | ObservationEvent
                    try:
                        event = decode(msg.data, ActionEvent if ".act." in msg.subject else ObservationEvent)
                    except BadMessage as exc:
                        log.warning("bad_episode_event", subject=msg.subject, reason=exc.reason)
                        if unreadable is not None:
                            unreadable.append({"subject": msg.subject, "reason": exc.reason})
                        continue
                    yield event
                    if isinstance(event, ObservationEvent) and event.finish:
                        return
                if not follow and msgs and msgs[-1].metadata.num_pending == 0:
                    return
        finally:
            try:
                await sub.unsubscribe()
            except Exception:  # the connection may be draining at shutdown
                pass

    def assemble(self, episode_id: str, events: list[ActionEvent | ObservationEvent]) -> dict[str, Any]:
        turns: dict[int, dict[str, Any]] = {}
        for event in events:
            turn = turns.setdefault(event.turn, {"turn": event.turn})
            turn.update({k: v for k, v in event_json(event).items() if k != "opening"})  # kept once, below
        summary = self.episodes.get(episode_id)
        live = self.live.get(episode_id)
        opening = next((e.opening for e in events if isinstance(e, ActionEvent) and e.opening), [])
        return {"episode_id": episode_id, "summary": asdict(summary) if summary else None, "opening": opening,
                "running": summary is None and live is not None,
                "task": summary.task if summary else (live.task if live else (events[0].task if events else "")),
                "turns": [turns[k] for k in sorted(turns)]}

    # ------------------------------------------------------------------ the dashboard's numbers
    def snapshot(self, status: dict[str, Any]) -> dict[str, Any]:
        rows = list(self.trainer_rows)
        tasks = sorted({k.split("/")[1] for r in rows for k in r if k.startswith("task/")} | set(self.quality)
                       | set(status["tasks"]))
        series: dict[str, list[list[float]]] = defaultdict(list)  # name -> [[step, value], ...]
        for r in rows:
            for key, value in r.items():
                if key in SERIES_KEYS or key.endswith(SERIES_TASK_SUFFIXES) and key.startswith("task/"):
                    series[key].append([r["step"], float(value)])
        series = {k: thin(v) for k, v in series.items()}
        busy = []  # a step's share of the wall time since the previous report
        for prev, cur in zip(rows, rows[1:], strict=False):
            wall = cur["ts"] - prev["ts"]
            if wall > 0 and "train/step_s" in cur:
                busy.append([cur["step"], min(1.0, cur["train/step_s"] / wall)])
        busy = thin(busy)
        span = rows[-1]["ts"] - rows[0]["ts"] + rows[0].get("train/step_s", 0.0) if rows else 0.0
        busy_overall = sum(r.get("train/step_s", 0.0) for r in rows) / span if span > 0 else 0.0
        advantages = {}
        for task in tasks:
            last = next((r for r in reversed(rows) if f"task/{task}/adv_mean_raw" in r), None)
            if last is not None:
                hist = [last.get(f"task/{task}/adv_hist/{i}", 0.0) for i in range(10)]
                advantages[task] = {"step": last["step"], "mean_raw": last[f"task/{task}/adv_mean_raw"],
                                    "std_raw": last.get(f"task/{task}/adv_std_raw", 0.0), "hist": hist,
                                    "hist_range": [-3.0, 3.0]}
        invalid = {}
        for task, q in sorted(self.quality.items()):
            recent_turns = sum(t for t, _ in q.recent)
            invalid[task] = {"turns": q.turns, "invalid": q.invalid,
                             "rate": q.invalid / q.turns if q.turns else 0.0,
                             "recent_rate": sum(i for _, i in q.recent) / recent_turns if recent_turns else 0.0}
        now = time.time()
        replicas = []
        for r in status["replicas"]:
            seen = self.replica_versions.get(r["replica_id"])
            replicas.append(dict(r, policy_version=seen["version"] if seen else None,
                                 metrics_age_s=round(now - seen["ts"], 1) if seen else None))
        return {
            "status": {k: v for k, v in status.items() if k not in ("replicas", "trainer")},
            "tasks": tasks,
            "series": series,
            "busy": busy, "busy_overall": busy_overall,
            "rates": list(self.rates)[-MAX_POINTS:],
            # what the trainer trained on (its step reports), and, for comparison, what arrived
            "staleness": {"bins": [str(i) for i in range(STALENESS_BINS - 1)] + [f"{STALENESS_BINS - 1}+"],
                          "trained": self.trained_staleness, "arrival": self.staleness},
            "advantages": advantages,
            "invalid_tool_calls": invalid,
            "replicas": replicas,
            "dlq": self.dlq,
            "live_episodes": len(self.live),
            "server_time": now,
        }


def thin(points: list[list[float]], limit: int = MAX_POINTS) -> list[list[float]]:
    if len(points) <= limit:
        return points
    every = -(-len(points) // limit)
    return points[::every] if (len(points) - 1) % every == 0 else points[::every] + [points[-1]]


def event_json(event: ActionEvent | ObservationEvent) -> dict[str, Any]:
    """An event's fields under the names the viewer reads (an action and its observation share a turn)."""
    if isinstance(event, ActionEvent):
        out = {"action": event.message, "engine_id": event.engine_id, "policy_version": event.policy_version,
               "replica_id": event.replica_id, "action_ts": event.ts}
        return out | {"opening": event.opening} if event.opening else out
    return {"observation": event.messages, "reward": event.reward, "finish": event.finish, "status": event.status,
            "observation_ts": event.ts}
