"""Asynchronous against synchronous RL: the same config in both modes, one after the other in one run.

    python bench/async_vs_sync.py [--config configs/quickstart.toml] [--steps 6] [--out runs/async_vs_sync]
                                  [--model DIR] [-- --section.key=value ...]   # overrides for both runs

* **Model**: the config's warm start (``jetrl quickstart``'s cache, ``~/.cache/jetrl/warmstart``; built
  with ``jetrl sft`` when missing), so rewards are not all 0 and every step is a real gradient step.
* **sync** (``controller.sync = true``): one batch of ``trainer.min_groups`` groups, played with the newest
  weights, then the trainer's step on it, then the next batch: staleness 0, no overlap.
* **async** (``controller.sync = false``): rollouts run ahead of the trainer (bounded by ``max_backlog``).

Each run is ``jetrl up`` with ``--steps`` steps; the figures come from its ``metrics.jsonl`` over the steady
window from the end of step ``--skip-steps`` (S) to the end of the last step (start-up, and the backlog
async rollouts build before the window, left out):

* trained episodes/s = trajectories trained in steps S+1..N / (ts_N - ts_S), and the async / sync ratio;
* from the sync run: T_train = mean step time (``train/step_s``: optimise, publish weights, checkpoint),
  T_gen = mean (step interval - T_train): publish, load weights, play the batch, deliver it;
  the ideal overlap (T_gen + T_train) / max(T_gen, T_train); goal: ratio >= 0.9 x ideal;
* trainer busy fraction = sum of step times / window; staleness (mean and max over trained turns) and
  the mean reward of the trained episodes.

Results go to ``<out>/results.json`` and a markdown table is printed (docs/benchmarks/async_vs_sync.md).
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
JETRL = [sys.executable, "-m", "jetrl.cli"]
MODES = ("sync", "async")


def log(msg: str) -> None:
    print(f"[{Path(sys.argv[0]).stem} {time.strftime('%H:%M:%S')}] {msg}", flush=True)  # bench/lanes.py too


def run(cmd: list[str], log_file: Path, limit_s: float) -> int:
    log("$ jetrl " + " ".join(cmd[len(JETRL):]))
    started = time.monotonic()
    with open(log_file, "wb") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)  # jetrl stops its services
            rc = proc.wait()
            log(f"  time limit ({limit_s:.0f} s)")
    log(f"  -> rc {rc} in {time.monotonic() - started:.0f} s; log {log_file}")
    return rc


def warm_start(args: argparse.Namespace, overrides: list[str]) -> Path:
    """The quickstart's cached warm start for this config (built here when missing)."""
    from jetrl.quickstart import sft_overrides, warm_start_dir
    from shared.config import load_config

    if args.model:
        return Path(args.model).resolve()
    cfg = load_config(args.config, overrides)
    warm = warm_start_dir(cfg)
    model = warm / "model"
    if not (model / "READY").is_file():
        cmd = [*JETRL, "sft", "--config", args.config, *overrides, *(f"--{o}" for o in sft_overrides(cfg, warm))]
        if run(cmd, Path(args.out) / "sft.log", 3600) or not (model / "config.json").is_file():
            raise SystemExit(f"warm start failed: see {Path(args.out) / 'sft.log'}")
        (model / "READY").write_text("ok\n")
    return model


def figures(all_rows: list[dict[str, Any]], skip: int) -> dict[str, float]:
    """Steady-window figures of one run's metrics rows: steps skip+1..N against the end of step ``skip``
    (start-up, and in async mode the backlog the rollouts built before the window, left out)."""
    rows = all_rows[skip - 1:]
    if len(rows) < 2:
        raise SystemExit(f"need at least {skip + 1} steps, got {len(all_rows)}")
    window = rows[1:]
    wall = rows[-1]["ts"] - rows[0]["ts"]
    episodes = sum(r["train/trajectories"] for r in window)
    step_s = [r["train/step_s"] for r in window]
    gaps = [b["ts"] - a["ts"] for a, b in zip(rows, rows[1:], strict=False)]
    rewards = [v for r in rows for k, v in r.items() if k.startswith("task/") and k.endswith("/reward")]
    return {
        "steps": len(all_rows), "window_s": round(wall, 2), "episodes": episodes,
        "episodes_per_s": round(episodes / wall, 4),
        "t_train_s": round(sum(step_s) / len(step_s), 3),
        "t_gen_s": round(sum(g - s for g, s in zip(gaps, step_s, strict=True)) / len(gaps), 3),
        "trainer_busy": round(sum(step_s) / wall, 3),
        "staleness_mean": round(sum(r.get("train/staleness_mean", 0.0) for r in rows) / len(rows), 3),
        "staleness_max": max(r.get("train/staleness_max", 0.0) for r in rows),
        "reward_mean": round(sum(rewards) / len(rewards), 3) if rewards else 0.0,
        "policy_versions": rows[-1]["policy_version"], "window_steps": len(window),
    }


def report(results: dict[str, Any]) -> list[str]:
    s, a = results["sync"], results["async"]
    ideal = (s["t_gen_s"] + s["t_train_s"]) / max(s["t_gen_s"], s["t_train_s"])
    ratio = a["episodes_per_s"] / s["episodes_per_s"]
    results["summary"] = {"ratio": round(ratio, 3), "ideal": round(ideal, 3), "of_ideal": round(ratio / ideal, 3),
                          "goal_met": ratio >= 0.9 * ideal}
    lines = ["| mode | trained episodes/s | T_gen (s; async: trainer idle between steps) | T_train (s) | trainer busy | staleness mean / max | "
             "mean reward | policy versions |", "|---|---|---|---|---|---|---|---|"]
    for mode in MODES:
        r = results[mode]
        lines.append(f"| {mode} | {r['episodes_per_s']:.3f} | {r['t_gen_s']:.1f} | {r['t_train_s']:.1f} | "
                     f"{r['trainer_busy']:.0%} | {r['staleness_mean']:.2f} / {r['staleness_max']:.0f} | "
                     f"{r['reward_mean']:.2f} | {r['policy_versions']} |")
    lines += ["", f"async / sync = **{ratio:.2f}x**; ideal overlap (T_gen + T_train) / max(T_gen, T_train) from the "
                  f"sync run = {ideal:.2f}x; async reaches **{ratio / ideal:.0%}** of the ideal "
                  f"(goal >= 90 %: {'met' if ratio >= 0.9 * ideal else 'not met'})"]
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/quickstart.toml")
    parser.add_argument("--steps", type=int, default=6, help="training steps of each run")
    parser.add_argument("--out", default="runs/async_vs_sync")
    parser.add_argument("--model", default="", help="warm-start model dir; default: the config's cached warm start")
    parser.add_argument("--rollouts", type=int, default=1, help="rollout replicas")
    parser.add_argument("--time-limit-min", type=float, default=8.0, help="per run")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    parser.add_argument("--skip-steps", type=int, default=2, help="the window starts at the end of this step")
    args, overrides = parser.parse_known_args()
    overrides = [o for o in overrides if o != "--"]
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = warm_start(args, overrides)
    log(f"warm start: {model}")
    results: dict[str, Any] = {"config": args.config, "overrides": overrides, "model": str(model),
                               "steps": args.steps}
    for mode in args.modes:
        run_dir = out / mode
        cmd = [*JETRL, "up", "--config", args.config, *overrides, f"--run.dir={run_dir}", f"--model.name={model}",
               f"--trainer.steps={args.steps}", f"--controller.sync={'true' if mode == 'sync' else 'false'}",
               f"--rollouts={args.rollouts}"]
        rc = run(cmd, out / f"{mode}.log", args.time_limit_min * 60)
        metrics = run_dir / "metrics.jsonl"
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
        if len(rows) < args.skip_steps + 2:  # a run stopped by the time limit counts with the steps it finished
            raise SystemExit(f"{mode} run (rc {rc}) finished {len(rows)} steps: see {out / (mode + '.log')}")
        results[mode] = figures(rows, args.skip_steps) | {"rc": rc}
        log(f"{mode}: {results[mode]}")
    if all(m in results for m in MODES):
        lines = report(results)
        print("\n".join(lines), flush=True)
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
