"""Learnability-weighted task sampling (``controller.task_sampler = "learnability"``).

A group teaches only when its episodes disagree: a task whose episodes succeed with probability p gives
a group with both outcomes about as often as p(1-p) is large (0.25 at p = 1/2, 0 at p = 0 or 1). So
each task, and each level of a task, is weighted by p(1-p) of its recent success:

* p is the success rate of its last ``window`` training episodes, smoothed towards 1/2 (Laplace:
  p = (successes + 1) / (episodes + 2)), so a task with no episodes yet counts as most learnable and is
  tried first, and two lucky episodes do not make a task look solved;
* learnability = max(p(1-p), ``floor``): a task that is always solved or never solved keeps a little
  weight, and is drawn again now and then to see whether the policy has moved;
* task shares = (1 - ``mix``) * signal + ``mix`` * configured, where configured is ``run.tasks``
  normalised and signal ∝ configured * learnability (the configured mix stays the prior: a task given
  twice the share gets twice the weight at equal learnability);
* within a task, a task id is drawn with weight (1 - ``mix``) * L(id) / sum L + ``mix`` / n, L(id) being
  the learnability of the id's level. The controller learns each id's level from its trajectories
  (``Trajectory.level``); an id not played yet counts with its task's learnability. A task whose env
  reports no levels (level 0 everywhere) draws its ids uniformly.

The weights are recomputed at every draw (a few hundred task ids at most: cheap next to a group of
episodes). Only training episodes count; evaluation episodes never move the weights.
"""

from __future__ import annotations

import random
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

MAX_LEARNABILITY = 0.25
"""p(1-p) at p = 1/2."""


@dataclass
class Window:
    """The outcomes (1 success, 0 not) of the last ``size`` episodes of a task or a level."""

    size: int
    outcomes: deque[int] = field(default_factory=deque)

    def add(self, success: bool) -> None:
        self.outcomes.append(int(success))
        while len(self.outcomes) > self.size:
            self.outcomes.popleft()

    @property
    def success(self) -> float:
        """Laplace-smoothed success rate: 1/2 before any episode."""
        return (sum(self.outcomes) + 1) / (len(self.outcomes) + 2)


def learnability(success: float, floor: float) -> float:
    """p(1-p), never below ``floor``."""
    return max(success * (1.0 - success), floor)


class LearnabilitySampler:
    """Task shares and task-id draws by recent success; see the module's docstring for the rule."""

    def __init__(self, mix: dict[str, float], window: int, floor: float, mix_share: float) -> None:
        if window < 1:
            raise ValueError(f"sampler window must be >= 1 episode, got {window}")
        if not 0.0 <= floor <= MAX_LEARNABILITY:
            raise ValueError(f"sampler floor must be in [0, {MAX_LEARNABILITY}], got {floor}")
        if not 0.0 <= mix_share <= 1.0:
            raise ValueError(f"sampler mix must be in [0, 1], got {mix_share}")
        total = sum(w for w in mix.values() if w > 0)
        if total <= 0:
            raise ValueError(f"the task mix needs a task with a positive share, got {mix}")
        self.configured = {t: w / total for t, w in mix.items() if w > 0}
        self.window, self.floor, self.mix_share = window, floor, mix_share
        self.tasks = {t: Window(window) for t in self.configured}
        self.levels: dict[str, dict[int, Window]] = defaultdict(dict)  # task -> level -> window
        self.level_of: dict[str, dict[str, int]] = defaultdict(dict)  # task -> task id -> level

    def observe(self, task: str, task_id: str, level: int, success: bool) -> None:
        """One finished training episode."""
        if task not in self.tasks:
            return  # a task out of the mix (another run's, or a share of 0)
        self.tasks[task].add(success)
        if level > 0:
            self.level_of[task][task_id] = level
            self.levels[task].setdefault(level, Window(self.window)).add(success)

    def task_learnability(self, task: str) -> float:
        return learnability(self.tasks[task].success, self.floor)

    def level_learnability(self, task: str, level: int) -> float:
        return learnability(self.levels[task][level].success, self.floor)

    def task_weights(self) -> dict[str, float]:
        """Each task's share of the next groups (they sum to 1)."""
        signal = {t: c * self.task_learnability(t) for t, c in self.configured.items()}
        total = sum(signal.values())
        if total <= 0:  # floor 0 and every task solved or hopeless: the configured mix
            return dict(self.configured)
        return {t: (1.0 - self.mix_share) * signal[t] / total + self.mix_share * c for t, c in self.configured.items()}

    def id_weights(self, task: str, task_ids: list[str]) -> list[float] | None:
        """Draw weights of ``task_ids`` by their levels' learnability; None = uniform (no levels seen)."""
        known = self.level_of.get(task)
        if not known:
            return None
        default = self.task_learnability(task)
        per_level = {level: self.level_learnability(task, level) for level in self.levels[task]}
        raw = [per_level[known[i]] if i in known else default for i in task_ids]
        total = sum(raw)
        if total <= 0:
            return None
        n = len(task_ids)
        return [(1.0 - self.mix_share) * r / total + self.mix_share / n for r in raw]

    def choose_task_id(self, task: str, task_ids: list[str], rng: random.Random) -> str:
        weights = self.id_weights(task, task_ids)
        if weights is None:
            return rng.choice(task_ids)
        return rng.choices(task_ids, weights=weights, k=1)[0]

    def snapshot(self) -> dict[str, Any]:
        """What ``/status`` shows under ``sampler``."""
        weights = self.task_weights()
        tasks = {}
        for task, window in sorted(self.tasks.items()):
            levels = {str(level): {"episodes": len(w.outcomes), "success": round(w.success, 4),
                                   "learnability": round(self.level_learnability(task, level), 4),
                                   "task_ids": sum(1 for v in self.level_of[task].values() if v == level)}
                      for level, w in sorted(self.levels.get(task, {}).items())}
            tasks[task] = {"weight": round(weights[task], 4), "configured": round(self.configured[task], 4),
                           "episodes": len(window.outcomes), "success": round(window.success, 4),
                           "learnability": round(self.task_learnability(task), 4), "levels": levels}
        return {"rule": "learnability", "window": self.window, "floor": self.floor, "mix": self.mix_share,
                "tasks": tasks}
