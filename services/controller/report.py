"""The eval report: per task, and per level and kind within a task, from finished trajectories.

Figures for one pass (greedy, or ``k`` samples per task at a temperature):

* ``success``: mean over episodes, with a 95 % bootstrap interval over *tasks* (episodes of one task
  are not independent, so tasks are the resampling unit; seeded, so a report is reproducible);
* ``pass@k`` (sampled passes): the unbiased estimator of Chen et al. 2021, ``1 - C(n-c, k) / C(n, k)``
  per task with ``n`` samples of which ``c`` succeeded, averaged over tasks, with ``pass@k_ci95`` (the
  same bootstrap over tasks) and ``pass_at`` (every ``j`` from 1 to ``k``: pass@1 is the success rate);
* ``well_formed_rate``: share of turns whose tool call the env accepted (1 - invalid actions / turns);
* ``per_task_success``: each task id's mean success (a benchmark pairs two reports on these);
* ``mean_reward``, ``mean_turns``, ``statuses``, and the same success (with its interval) / well-formed
  figures ``by_level`` and ``by_kind`` (as the env reports them for each task: a benchmark's categories are kinds).
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from typing import Any

from shared.messages import Trajectory

BOOTSTRAP_RESAMPLES = 1000


def pass_at_k(n: int, c: int, k: int) -> float:
    """Probability that at least one of ``k`` samples drawn from ``n`` (``c`` correct) is correct."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def bootstrap_interval(per_task: list[list[float]], resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0,
                       level: float = 0.95) -> tuple[float, float]:
    """Percentile interval of the episode-mean when tasks (with all their episodes) are resampled."""
    if not per_task:
        return (float("nan"), float("nan"))
    rng = random.Random(seed)
    means = []
    for _ in range(resamples):
        draw = [per_task[rng.randrange(len(per_task))] for _ in per_task]
        total = sum(len(x) for x in draw)
        means.append(sum(sum(x) for x in draw) / total)
    means.sort()
    lo = means[int((1 - level) / 2 * resamples)]
    hi = means[min(resamples - 1, int((1 + level) / 2 * resamples))]
    return (lo, hi)


def _well_formed(trajs: list[Trajectory]) -> float:
    turns = sum(len(t.turns) for t in trajs)
    invalid = sum(t.metrics.get("invalid_actions", 0.0) for t in trajs)
    return 1.0 - invalid / turns if turns else float("nan")


def _per_task(trajs: list[Trajectory]) -> list[list[float]]:
    """Success of each episode, grouped by task id (the bootstrap's resampling unit)."""
    by_task_id: dict[str, list[float]] = defaultdict(list)
    for t in trajs:
        by_task_id[t.task_id].append(float(t.success))
    return [v for _, v in sorted(by_task_id.items())]


def _breakdown(trajs: list[Trajectory], key: str) -> dict[str, dict[str, Any]]:
    groups: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        groups[str(getattr(t, key))].append(t)
    return {name: {"episodes": len(ts), "success": sum(t.success for t in ts) / len(ts),
                   "success_ci95": list(bootstrap_interval(_per_task(ts))),
                   "well_formed_rate": _well_formed(ts)} for name, ts in sorted(groups.items())}


def pass_at_k_report(per_task: list[list[float]], k: int) -> dict[str, Any]:
    """``pass@k``, its 95 % bootstrap interval over tasks and ``pass_at`` {j: pass@j} for j = 1..k, over the
    tasks with at least ``k`` samples (empty when none has)."""
    usable = [ts for ts in per_task if len(ts) >= k]
    if k < 2 or not usable:
        return {}
    scores = {j: [pass_at_k(len(ts), int(sum(ts)), j) for ts in usable] for j in range(1, k + 1)}
    return {f"pass@{k}": sum(scores[k]) / len(usable),
            # every task contributes one number, so resampling tasks is resampling these
            f"pass@{k}_ci95": list(bootstrap_interval([[v] for v in scores[k]])),
            "pass_at": {str(j): sum(v) / len(usable) for j, v in scores.items()}}


def task_report(trajs: list[Trajectory], samples: int) -> dict[str, Any]:
    by_task_id: dict[str, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        by_task_id[t.task_id].append(t)
    per_task = _per_task(trajs)
    turns = sum(len(t.turns) for t in trajs)
    report: dict[str, Any] = {
        "episodes": len(trajs), "tasks": len(by_task_id),
        "success": sum(t.success for t in trajs) / len(trajs),
        "success_ci95": list(bootstrap_interval(per_task)),
        "mean_reward": sum(t.reward for t in trajs) / len(trajs),
        "mean_turns": turns / len(trajs),
        "well_formed_rate": _well_formed(trajs),
        "invalid_action_rate": sum(t.metrics.get("invalid_actions", 0.0) for t in trajs) / max(turns, 1),
        "statuses": {s: sum(t.status == s for t in trajs) for s in sorted({t.status for t in trajs})},
        "by_level": _breakdown(trajs, "level"),
        "by_kind": _breakdown(trajs, "task_kind"),
        # per task id: mean success over its episodes (two reports on the same tasks pair up on these)
        "per_task_success": {tid: sum(t.success for t in ts) / len(ts) for tid, ts in sorted(by_task_id.items())},
    }
    report.update(pass_at_k_report(per_task, samples))
    return report


def eval_report(results: dict[str, dict[str, list[Trajectory]]], samples: dict[str, int],
                planned: dict[str, dict[str, int]] | None = None) -> dict[str, Any]:
    """``results[pass][task]`` -> ``report[pass][task]``; ``samples[pass]`` attempts per task. With
    ``planned[pass][task]`` (the episodes the eval published for it), each task's report says how many were
    planned and whether every one came back (``complete``): a stopped eval's report tells which tasks it finished."""
    report: dict[str, Any] = {}
    for name, by_task in results.items():
        report[name] = {}
        for task, trajs in sorted(by_task.items()):
            if not trajs:
                continue
            report[name][task] = task_report(trajs, samples[name])
            if planned is not None:
                want = planned.get(name, {}).get(task, 0)
                report[name][task] |= {"planned": want, "complete": len(trajs) >= want}
    return report
