"""Per-task lanes on a mixed run: each task's share of trained episodes against its configured weight.

    python bench/lanes.py [--tasks '{"db": 0.5, "os": 0.5}'] [--steps 8] [--out runs/lanes]
                          [-- --section.key=value ...]   # overrides for both runs

Two ``jetrl sft`` runs (the envs' oracles through every service, the tiny model: generation costs nothing,
so the envs' own speeds set the pace; os runs bash in a bwrap sandbox per episode, db SQLite), one after
the other: **one lane** (every task through one consumer and ``rollout.concurrency`` slots) and **lanes**
(``rollout.task_concurrency``: a consumer and slots per task; ``controller.task_max_inflight``: a bound per
task on episodes in flight). Figures from each run's ``metrics.jsonl``: episodes trained per task, its share
against its weight (goal: within 10 %), and trained episodes/s.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import Any

from bench.async_vs_sync import JETRL, log, run


def played(run_dir: Path, weights: dict[str, float]) -> dict[str, float]:
    """Episodes the run played per task (finished, trained or not): the controller's last status line."""
    text = (run_dir / "logs" / "controller.log").read_text()
    return {t: float(m[1]) for t in weights if (m := re.search(rf"'{t}': {{'published': \d+, 'finished': (\d+)", text))}


def shares(rows: list[dict[str, Any]], weights: dict[str, float], played: dict[str, float]) -> dict[str, Any]:
    episodes = {t: sum(r.get(f"task/{t}/episodes", 0.0) for r in rows) for t in weights}
    total, weight_sum = sum(episodes.values()), sum(weights.values())
    wall = rows[-1]["ts"] - rows[0]["ts"]
    return {"steps": len(rows), "episodes": episodes,
            "share": {t: round(n / total, 3) for t, n in episodes.items()},
            "weight": {t: round(w / weight_sum, 3) for t, w in weights.items()},
            "off_by": {t: round(abs(episodes[t] / total - w / weight_sum) / (w / weight_sum), 3)
                       for t, w in weights.items()},
            "episodes_per_s": round(sum(r["train/trajectories"] for r in rows[1:]) / wall, 3) if wall else 0.0,
            "played": played,
            "played_share": {t: round(n / sum(played.values()), 3) for t, n in played.items()} if played else {}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default='{"db": 0.5, "os": 0.5}', help="run.tasks (JSON)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=16, help="episodes per step (trainer.min/max_groups)")
    parser.add_argument("--lanes", default='{"*": 4}', help="rollout.task_concurrency of the lanes run (JSON)")
    parser.add_argument("--max-inflight", default='{"*": 12}', help="controller.task_max_inflight of the lanes run")
    parser.add_argument("--out", default="runs/lanes")
    parser.add_argument("--time-limit-min", type=float, default=6.0, help="per run")
    args, overrides = parser.parse_known_args()
    overrides = [o for o in overrides if o != "--"]
    weights = json.loads(args.tasks)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    common = ["--model.name=tiny", f"--run.tasks={args.tasks}", f"--trainer.steps={args.steps}",
              f"--trainer.min_groups={args.batch}", f"--trainer.max_groups={args.batch}",
              "--controller.max_inflight=16", "--rollout.concurrency=8", "--rollouts=1", *overrides]
    plans = {"one lane": [], "lanes": [f"--rollout.task_concurrency={args.lanes}",
                                       f"--controller.task_max_inflight={args.max_inflight}"]}
    results: dict[str, Any] = {"tasks": weights, "overrides": overrides}
    for name, extra in plans.items():
        run_dir = out / name.replace(" ", "_")
        rc = run([*JETRL, "sft", *common, *extra, f"--run.dir={run_dir}"], out / f"{run_dir.name}.log",
                 args.time_limit_min * 60)
        metrics = run_dir / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
        if len(rows) < 2:
            raise SystemExit(f"{name}: rc {rc}, {len(rows)} steps; see {out / (run_dir.name + '.log')}")
        results[name] = shares(rows, weights, played(run_dir, weights)) | {"rc": rc, "extra": extra}
        log(f"{name}: {results[name]}")
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print("| run | " + " | ".join(f"{t}: weight, share played, share trained" for t in weights)
          + " | trained episodes/s |")
    print("|---|" + "---|" * len(weights) + "---|")
    for name in plans:
        r = results[name]
        cells = " | ".join(f"{r['weight'][t]:.2f}, {r['played_share'].get(t, 0):.3f} ({r['played'].get(t, 0):.0f}), "
                           f"{r['share'][t]:.3f} ({r['episodes'][t]:.0f})" for t in weights)
        print(f"| {name} | {cells} | {r['episodes_per_s']:.2f} |")


if __name__ == "__main__":
    main()
