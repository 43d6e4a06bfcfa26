"""The controller's schedule of groups: which task, and which of its task ids, comes next."""

from __future__ import annotations

import random

from services.controller.sampler import LearnabilitySampler


class Planner:
    """Smooth weighted round robin over tasks (exact shares, no clumping); seeded task-id draws.

    A task left out of ``eligible`` (its lane is full) loses its turn to the others, but keeps earning
    credit; with ``lead`` > 0 no task runs more than ``lead`` groups ahead of its share (then the planner
    waits for the blocked one: shares stay near the weights); ``lead`` = 0 never waits (a stuck task's
    share goes to the others). With a ``sampler`` the shares and the task-id draws follow its weights,
    recomputed at every group (services/controller/sampler.py)."""

    def __init__(self, mix: dict[str, float], task_ids: dict[str, list[str]], seed: int, lead: int = 0,
                 sampler: LearnabilitySampler | None = None) -> None:
        self.mix = {t: w for t, w in mix.items() if w > 0}
        self.task_ids = task_ids
        self.credit = {t: 0.0 for t in self.mix}
        self.rng = random.Random(seed)
        self.lead = lead
        self.sampler = sampler

    def next_group(self, eligible: set[str] | None = None) -> tuple[str, str] | None:
        mix = self.sampler.task_weights() if self.sampler is not None else self.mix
        total = sum(mix.values())
        tasks = [t for t in mix if (eligible is None or t in eligible)
                 and (not self.lead or self.credit[t] + mix[t] - total >= -self.lead * total)]
        if not tasks:
            return None
        for t in mix:
            self.credit[t] += mix[t]
        task = max(tasks, key=lambda t: self.credit[t])
        self.credit[task] -= total
        if self.sampler is not None:
            return task, self.sampler.choose_task_id(task, self.task_ids[task], self.rng)
        return task, self.rng.choice(self.task_ids[task])
