"""What a step leaves behind: its row in ``<run>/metrics.jsonl``, the same scalars as TensorBoard events
beside it, one ``train_step`` log line, and the metrics message the dashboard reads."""

from __future__ import annotations

import json
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from nats.aio.client import Client

from shared.bus import publish_metrics
from shared.lifecycle import supervise
from shared.messages import EpisodeStatus, Trajectory
from shared.subjects import Subjects

log = structlog.get_logger()

STALENESS_BINS = 11  # train/staleness_hist/<k>: trained turns k versions behind, 0..9, and 10 for 10 or more
ADV_HIST_RANGE = (-3.0, 3.0)
"""The range ``task/<t>/adv_hist`` bins (``torch.histc`` in ``batch.rl_batch``), for TensorBoard's histograms."""


@dataclass(frozen=True)
class EpisodeOutcome:
    """What a step's per-task figures need of an episode, without its tokens."""

    task: str
    success: bool
    reward: float
    turns: int
    env_error: bool

    @classmethod
    def of(cls, traj: Trajectory) -> EpisodeOutcome:
        return cls(traj.task, traj.success, traj.reward, len(traj.turns), traj.status == EpisodeStatus.ENV_ERROR)


def task_stats(outcomes: list[EpisodeOutcome]) -> dict[str, float]:
    """Per task: episodes, success and reward rates, turns per episode, env errors."""
    by_task: dict[str, list[EpisodeOutcome]] = defaultdict(list)
    for o in outcomes:
        by_task[o.task].append(o)
    stats: dict[str, float] = {}
    for task, items in sorted(by_task.items()):
        stats[f"task/{task}/episodes"] = float(len(items))
        stats[f"task/{task}/success"] = sum(o.success for o in items) / len(items)
        stats[f"task/{task}/reward"] = sum(o.reward for o in items) / len(items)
        stats[f"task/{task}/turns"] = sum(o.turns for o in items) / len(items)
        stats[f"task/{task}/env_errors"] = float(sum(o.env_error for o in items))
    return stats


def batch_stats(trajs: list[Trajectory], policy_version: int) -> dict[str, float]:
    """The batch's own figures: its size, per task outcomes, and how far behind ``policy_version`` (the
    policy being trained) each policy turn trained on was played (oracle turns, version -1, have none)."""
    stats: dict[str, float] = {"train/trajectories": float(len(trajs))}
    stats.update(task_stats([EpisodeOutcome.of(t) for t in trajs]))
    staleness = [policy_version - turn.policy_version for t in trajs for turn in t.turns if turn.policy_version >= 0]
    if staleness:
        stats["train/staleness_mean"] = sum(staleness) / len(staleness)
        stats["train/staleness_max"] = float(max(staleness))
        for lag, n in Counter(min(lag, STALENESS_BINS - 1) for lag in staleness).items():
            stats[f"train/staleness_hist/{lag}"] = float(n)  # the dashboard's "staleness of trained turns"
    return stats


class StepRecorder:
    """Writes one row per step: metrics.jsonl (the record), TensorBoard (if installed), a log line, and
    the metrics message (best effort, in the background)."""

    def __init__(self, run_dir: Path, nc: Client | None, subjects: Subjects, replica_id: str, steps: int) -> None:
        self.metrics_file = run_dir / "metrics.jsonl"
        self.tensorboard = tensorboard_writer(run_dir)
        self.nc, self.subjects, self.replica_id, self.steps = nc, subjects, replica_id, steps

    def record(self, step: int, policy_version: int, stats: dict[str, Any]) -> None:
        row = {"step": step, "policy_version": policy_version, "ts": time.time(), **stats}
        with open(self.metrics_file, "a") as fh:
            fh.write(json.dumps(row) + "\n")
        if self.tensorboard is not None:
            write_tensorboard(self.tensorboard, step, row["ts"], stats)
        tasks = sorted({k.split("/")[1] for k in stats if k.startswith("task/") and k.endswith("/success")})
        per_task = " ".join(f"{t}={stats[f'task/{t}/success']:.2f}" for t in tasks)
        log.info("train_step", step=step, of=self.steps, trajectories=int(stats["train/trajectories"]),
                 success=per_task, loss=round(stats.get("train/loss", 0.0), 5),
                 seconds=round(stats["train/step_s"], 2))
        scalars = {k: float(v) for k, v in stats.items() if isinstance(v, (int, float))}
        for key, values in stats.items():  # histograms (task/<t>/adv_hist) travel as one scalar per bin
            if isinstance(values, list):
                scalars.update({f"{key}/{i}": float(x) for i, x in enumerate(values)})
        supervise(publish_metrics(self.nc, self.subjects, "trainer", self.replica_id, step, scalars),
                  "metrics_publish", None)


def tensorboard_writer(run_dir: Path) -> Any:
    """A TensorBoard event writer in the run directory (``tensorboard --logdir runs`` shows every run),
    or None where the ``tensorboard`` package is missing (metrics.jsonl is the record either way)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        log.warning("tensorboard_unavailable", error=str(exc))
        return None
    return SummaryWriter(log_dir=str(run_dir), flush_secs=30)


def write_tensorboard(writer: Any, step: int, ts: float, stats: dict[str, Any]) -> None:
    """Every scalar of a metrics.jsonl row under its own key; histograms (lists of bin counts) as
    TensorBoard histograms. Flushed each step: a step is seconds to minutes, so this costs nothing."""
    for key, value in stats.items():
        if isinstance(value, bool | int | float):
            writer.add_scalar(key, float(value), step, walltime=ts)
        elif isinstance(value, list) and value and key.endswith("_hist"):
            lo, hi = ADV_HIST_RANGE
            width = (hi - lo) / len(value)
            limits = [lo + width * (i + 1) for i in range(len(value))]
            centres = [lo + width * (i + 0.5) for i in range(len(value))]
            count = float(sum(value))
            if count > 0:
                writer.add_histogram_raw(key, min=lo, max=hi, num=count,
                                         sum=sum(c * n for c, n in zip(centres, value, strict=True)),
                                         sum_squares=sum(c * c * n for c, n in zip(centres, value, strict=True)),
                                         bucket_limits=limits, bucket_counts=[float(n) for n in value],
                                         global_step=step, walltime=ts)
    writer.flush()
