"""The eval report's statistics against numbers worked out by hand."""

from __future__ import annotations

import pytest

from services.controller.report import bootstrap_interval, eval_report, pass_at_k, pass_at_k_report
from shared.messages import Trajectory, TurnInfo


def traj(task_id: str, reward: float, level: int = 1, kind: str = "select", turns: int = 2,
         invalid: float = 0.0) -> Trajectory:
    spans = [TurnInfo(start=i, end=i + 1, engine_id="e", policy_version=0) for i in range(turns)]
    return Trajectory(episode_id=f"{task_id}-{reward}-{level}", group_id="g", task="db", task_id=task_id, split="test",
                      group_size=1, tokens=[1] * turns, logprobs=[0.0] * turns, loss_mask=[1] * turns, prompt_len=0,
                      turns=spans, reward=reward, status="completed", replica_id="r",
                      metrics={"invalid_actions": invalid}, level=level, task_kind=kind)


def test_pass_at_k_by_hand() -> None:
    # n=4, c=1, k=2: 1 - C(3,2)/C(4,2) = 1 - 3/6 = 0.5 ; c=0 -> 0 ; n-c < k -> 1
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 0, 2) == 0.0
    assert pass_at_k(4, 3, 2) == 1.0
    assert pass_at_k(4, 2, 4) == 1.0
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_bootstrap_interval_brackets_the_mean_and_collapses_without_spread() -> None:
    assert bootstrap_interval([[1.0], [1.0], [1.0]]) == (1.0, 1.0)
    lo, hi = bootstrap_interval([[1.0], [0.0]] * 20)
    assert lo < 0.5 < hi and 0.2 < lo and hi < 0.8
    assert bootstrap_interval([[1.0], [0.0]] * 20) == (lo, hi)  # seeded: reproducible


def test_report_per_level_kind_and_well_formed_rate_by_hand() -> None:
    # greedy: 4 tasks, 2 turns each; successes 1,1,0,0 -> 0.5; invalid actions 1 of 8 turns -> well-formed 7/8
    # level 1 holds a (1) and b (1) -> 1.0; level 2 holds c (0) and d (0) -> 0.0
    greedy = [traj("a", 1.0), traj("b", 1.0, kind="update"), traj("c", 0.0, level=2),
              traj("d", 0.0, level=2, invalid=1.0)]
    # sampled, 2 samples per task: a 1,1 ; b 1,0 ; c 0,0 -> success 3/6 ; pass@2 = (1 + 1 + 0) / 3
    sampled = [traj("a", 1.0), traj("a", 1.0), traj("b", 1.0), traj("b", 0.0), traj("c", 0.0), traj("c", 0.0)]
    report = eval_report({"greedy": {"db": greedy}, "sampled": {"db": sampled}}, {"greedy": 1, "sampled": 2})
    g = report["greedy"]["db"]
    assert g["success"] == 0.5 and g["tasks"] == 4 and g["episodes"] == 4
    assert g["well_formed_rate"] == pytest.approx(7 / 8)
    assert g["by_level"]["1"]["success"] == 1.0 and g["by_level"]["2"]["success"] == 0.0
    assert g["by_level"]["2"]["well_formed_rate"] == pytest.approx(3 / 4)
    assert g["by_kind"]["update"] == {"episodes": 1, "success": 1.0, "success_ci95": [1.0, 1.0],
                                      "well_formed_rate": 1.0}
    assert g["by_level"]["2"]["success_ci95"] == [0.0, 0.0]  # no spread: the interval collapses
    lo, hi = g["success_ci95"]
    assert 0.0 <= lo <= 0.5 <= hi <= 1.0
    assert "pass@1" not in g
    assert g["per_task_success"] == {"a": 1.0, "b": 1.0, "c": 0.0, "d": 0.0}
    s = report["sampled"]["db"]
    assert s["success"] == 0.5 and s["pass@2"] == pytest.approx(2 / 3)
    # pass@1 is the unbiased per-task success: (1 + 1/2 + 0) / 3; pass@2 per task: 1, 1, 0
    assert s["pass_at"] == {"1": pytest.approx(0.5), "2": pytest.approx(2 / 3)}
    lo, hi = s["pass@2_ci95"]
    assert 0.0 <= lo < 2 / 3 < hi <= 1.0
    assert s["per_task_success"] == {"a": 1.0, "b": 0.5, "c": 0.0}
    assert "complete" not in s  # without the plan, no completeness
    # stopped before the end: each task says what was planned and whether all of it came back
    stopped = eval_report({"greedy": {"db": greedy}, "sampled": {"db": sampled}}, {"greedy": 1, "sampled": 2},
                          planned={"greedy": {"db": 4}, "sampled": {"db": 8}})
    assert (stopped["greedy"]["db"]["planned"], stopped["greedy"]["db"]["complete"]) == (4, True)
    assert (stopped["sampled"]["db"]["planned"], stopped["sampled"]["db"]["complete"]) == (8, False)


def test_pass_at_k_with_its_interval_by_hand() -> None:
    # n=5 samples per task. Task a: c=2 -> pass@3 = 1 - C(3,3)/C(5,3) = 1 - 1/10 = 0.9, pass@2 = 1 - 3/10 = 0.7,
    # pass@1 = 2/5. Task b: c=0 -> 0 everywhere. Task c: c=5 -> 1 everywhere. Task d has 2 samples < k: left out.
    per_task = [[1, 1, 0, 0, 0], [0] * 5, [1] * 5, [1, 0]]
    r = pass_at_k_report([[float(x) for x in ts] for ts in per_task], 3)
    assert r["pass@3"] == pytest.approx((0.9 + 0 + 1) / 3)
    assert r["pass_at"] == {"1": pytest.approx((0.4 + 0 + 1) / 3), "2": pytest.approx((0.7 + 0 + 1) / 3),
                            "3": pytest.approx((0.9 + 0 + 1) / 3)}
    # the interval resamples the three per-task values: it brackets their mean and stays in [0, 1]
    lo, hi = r["pass@3_ci95"]
    assert 0.0 <= lo < r["pass@3"] < hi <= 1.0
    assert pass_at_k_report([[1.0, 0.0]], 3) == {} and pass_at_k_report([[1.0, 0.0]], 1) == {}
