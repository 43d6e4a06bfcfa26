"""Learning benchmark: a SmolLM2 warm start, then RL variants, each probed before/after (greedy and sampled).

    python bench/learning.py [--config configs/smollm2.toml] [--out runs/learning] [options]
                             [-- --section.key=value ...]   # overrides for every run

1. **Warm start** ``jetrl sft`` (each env's oracle through the services; cross-entropy, every weight) ->
   ``<out>/sft/model``; timed on its own.
2. **Probe of the warm start** ``jetrl probe`` on each split of ``--eval-splits``: a greedy pass and a
   sampled pass (``--eval-samples`` attempts per task at T = 1), per task, level and kind.
3. **RL variants**, each ``jetrl up`` from the warm-start model (same steps, same time limit), then the same
   probe of its final model: ``full`` (task normalisation + cross-policy sampling: by default older LoRA
   versions held in the one replica's engine, ``rollout.adapter_versions``; ``--adapter-versions 0``: a
   stale pool engine of its own), ``no_task_norm``, ``no_cross_policy`` (one engine, the current version only), ``expert-<task>`` (the full recipe on one task only), and
   ``sampler`` (``full`` with the learnability task sampler, to set beside ``full``: flat groups and gains).
   ``--seeds 0,1`` runs every variant once per ``run.seed`` (seed 0 as ``<variant>``, seed s as
   ``<variant>-s<s>``); ``--expert-steps`` gives the experts their own number of steps.
4. **Report**: ``<out>/results.json``, a markdown table per pass (printed, and written into
   ``docs/benchmarks/learning.md`` between the ``<!-- results:begin/end -->`` markers with ``--write-doc``):
   success with a 95 % bootstrap interval over the evaluated tasks, and each variant's change against the
   warm start with a *paired* bootstrap interval (the same tasks before and after, resampled together);
   PNG plots in ``docs/benchmarks/``: per-task training success over steps for each variant (with the
   greedy probe before/after as points) and the warm-start loss curve. With several seeds, each variant's
   change as the mean over its seeds with the lowest and highest seed; pass@k of the sampled pass for
   k = 1, 2, 4, 8 (as far as ``--eval-samples`` goes) before and after, with intervals; with a ``sampler``
   run, flat groups and the steps to a 10-point gain beside ``full``.

Every command is printed, timed and logged under ``<out>/``; a run that exceeds ``--time-limit-min``
is interrupted (SIGINT: `jetrl` stops its services) and marked ``timeout`` in the table.
``--sft-model DIR`` skips the warm start; ``--resume`` reuses every finished stage under ``<out>`` (the
warm start, each probe, each RL run) and runs only the rest, so a long benchmark can be carried over several
sittings with the same command.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
JETRL = [sys.executable, "-m", "jetrl.cli"]
VARIANTS = ("full", "no_task_norm", "no_cross_policy", "experts", "sampler")


# ---------------------------------------------------------------------------------------------- helpers
def log(msg: str) -> None:
    print(f"[learning {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def working_tasks(candidates: list[str], config: str, timeout_s: float = 180.0) -> list[str]:
    """Tasks whose env module imports and builds its env (train and test task ids, with the settings of
    ``config``) in a subprocess."""
    ok = []
    for task in candidates:
        code = ("from shared.config import load_config; from shared.tasks import find_task, load_factory;"
                f"env = load_config({config!r}).env; env.task = {task!r};"
                f"e = load_factory(find_task({task!r}, env))(env);"
                "assert e.task_ids('train') and e.task_ids('test')")
        try:
            r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, timeout=timeout_s)
            good = r.returncode == 0
            why = r.stderr.decode(errors="replace").strip().splitlines()[-1:] if not good else []
        except subprocess.TimeoutExpired:
            good, why = False, ["timeout"]
        log(f"task {task}: {'ok' if good else 'not usable: ' + ' '.join(why)}")
        if good:
            ok.append(task)
    return ok


def run_cmd(cmd: list[str], log_file: Path, time_limit_s: float) -> dict[str, Any]:
    """Run one `jetrl` command; SIGINT past the time limit (it stops its services), then SIGKILL."""
    log("$ " + " ".join(cmd[2:] if cmd[:2] == JETRL[:2] else cmd).replace("jetrl.cli", "jetrl"))
    started = time.monotonic()
    with open(log_file, "wb") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        timed_out = False
        try:
            rc = proc.wait(timeout=time_limit_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            proc.send_signal(signal.SIGINT)
            try:  # jetrl gives the trainer up to 300 s to finish its step and save the model
                rc = proc.wait(timeout=360)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                rc = proc.wait()
    wall = time.monotonic() - started
    log(f"  -> rc {rc}{' (time limit)' if timed_out else ''} in {wall:.0f}s; log {log_file}")
    return {"cmd": " ".join(["jetrl", *cmd[3:]]), "rc": rc, "wall_s": round(wall, 1), "timeout": timed_out}


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_name(variant: str, seed: int) -> str:
    """The run of ``variant`` with ``run.seed = seed``: seed 0 keeps the variant's name."""
    return variant if seed == 0 else f"{variant}-s{seed}"


def variant_of(name: str) -> str:
    """``full-s1`` -> ``full``: the variant a run (or eval label) belongs to."""
    head, sep, tail = name.rpartition("-s")
    return head if sep and tail.isdigit() else name


def tasks_arg(tasks: list[str]) -> str:
    return "--run.tasks=" + json.dumps({t: 1.0 for t in tasks}, separators=(",", ":"))


# ---------------------------------------------------------------------------------------------- stages
class Bench:
    def __init__(self, args: argparse.Namespace, overrides: list[str]) -> None:
        self.args, self.overrides = args, overrides
        self.out = (ROOT / args.out).resolve() if not Path(args.out).is_absolute() else Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.limit_s = args.time_limit_min * 60
        self.results: dict[str, Any] = {"config": args.config, "overrides": overrides, "runs": {}, "evals": {}}
        self.results_file = self.out / "results.json"
        if args.skip_done and self.results_file.exists():
            old = json.loads(self.results_file.read_text())
            self.results["runs"].update(old.get("runs", {}))
            self.results["evals"].update(old.get("evals", {}))

    def base(self, command: str) -> list[str]:
        return [*JETRL, command, "--config", self.args.config, *self.overrides]

    def save(self) -> None:
        """Merge into results.json, so several invocations (one variant each, in parallel) share one --out."""
        merged = json.loads(self.results_file.read_text()) if self.results_file.exists() else {}
        for key in ("runs", "evals"):
            self.results[key] = merged.get(key, {}) | self.results[key]
        tmp = self.results_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(merged | self.results, indent=2))
        tmp.replace(self.results_file)

    def done(self, name: str) -> bool:
        r = self.results["runs"].get(name)
        # a run stopped at the time limit saved its model too: it is finished, with fewer steps
        finished = bool(r and (r["rc"] == 0 or r.get("timeout")))
        return bool(self.args.skip_done and finished and (self.out / name / "model").exists())

    def warm_start(self, tasks: list[str]) -> Path:
        if self.args.sft_model:
            return Path(self.args.sft_model).resolve()
        name = "sft"
        if not self.done(name):
            cmd = [*self.base("sft"), f"--run.dir={self.out / name}", tasks_arg(tasks),
                   f"--trainer.steps={self.args.sft_steps}", f"--trainer.lr={self.args.sft_lr}",
                   f"--trainer.min_groups={self.args.sft_batch}", f"--trainer.max_groups={self.args.sft_batch}",
                   "--rollouts=1", *self.args.sft_extra]
            if self.args.sft_task_weights:
                weights = json.loads(self.args.sft_task_weights)
                if set(weights) != set(tasks):
                    raise SystemExit(f"--sft-task-weights names {sorted(weights)}, the tasks are {sorted(tasks)}")
                cmd.append(f"--run.tasks={json.dumps(weights)}")
            limit_s = (self.args.sft_time_limit_min * 60) or self.limit_s
            self.results["runs"][name] = run_cmd(cmd, self.out / f"{name}.log", limit_s) | {"tasks": tasks}
            self.save()
        model = self.out / name / "model"
        if not model.exists():
            raise SystemExit(f"warm start produced no model ({self.out / name}); see {self.out / 'sft.log'}")
        return model

    def evaluate(self, label: str, model: Path, tasks: list[str]) -> None:
        for split in self.args.eval_splits:
            key = f"{label}@{split}"
            if self.args.skip_done and key in self.results["evals"] and self.results["evals"][key].get("report"):
                continue
            run_dir = self.out / f"eval-{label}-{split}"
            cmd = [*self.base("probe"), f"--run.dir={run_dir}", f"--model.name={model}", tasks_arg(tasks),
                   f"--controller.eval_split={split}", f"--controller.eval_limit={self.args.eval_limit}",
                   f"--controller.eval_samples={self.args.eval_samples}", f"--rollouts={self.args.rollouts}",
                   "--rollout.torch_threads=2"]  # generation alone: both cores
            res = run_cmd(cmd, self.out / f"eval-{label}-{split}.log", self.limit_s)
            report_file = run_dir / "eval.json"
            res["report"] = json.loads(report_file.read_text()) if report_file.exists() and res["rc"] == 0 else None
            self.results["evals"][key] = res
            self.save()

    def rl(self, name: str, model: Path, tasks: list[str], extra: list[str], stale_engines: int) -> Path | None:
        if not self.done(name):
            cmd = [*self.base("up"), f"--run.dir={self.out / name}", f"--model.name={model}", tasks_arg(tasks),
                   f"--trainer.steps={self.args.rl_steps}", f"--rollouts={self.args.rollouts}",
                   f"--stale-engines={stale_engines}", f"--controller.train_limit={self.args.rl_train_limit}", *extra]
            self.results["runs"][name] = run_cmd(cmd, self.out / f"{name}.log", self.limit_s) | {"tasks": tasks}
            self.save()
        final = self.out / name / "model"
        return final if final.exists() else None

    def variants(self, warm: Path, tasks: list[str]) -> None:
        from shared.progress import track

        cross = [f"--rollout.cross_policy_prob={self.args.cross_policy_prob}",
                 f"--rollout.stale_every={self.args.stale_every}"]
        stale = self.args.stale_engines
        if self.args.adapter_versions > 0:  # older LoRA versions in the replica's own engine: no second model
            cross += [f"--rollout.adapter_versions={self.args.adapter_versions}",
                      f"--rollout.cross_policy_base={str(self.args.cross_policy_base).lower()}"]
            stale = 0
        plan: list[tuple[str, list[str], list[str], int]] = []
        for v in self.args.variants:
            if v == "experts" and self.args.expert_steps:
                expert_steps = [f"--trainer.steps={self.args.expert_steps}"]
            else:
                expert_steps = []
            if v == "full":
                plan.append(("full", tasks, ["--trainer.task_norm=scale", *cross], stale))
            elif v == "no_task_norm":
                plan.append(("no_task_norm", tasks, ["--trainer.task_norm=off", *cross], stale))
            elif v == "no_cross_policy":
                plan.append(("no_cross_policy", tasks, ["--trainer.task_norm=scale",
                                                        "--rollout.cross_policy_prob=0", "--rollout.adapter_versions=0"], 0))
            elif v == "sampler":
                plan.append(("sampler", tasks, ["--trainer.task_norm=scale", "--controller.task_sampler=learnability",
                                                *cross], stale))
            elif v == "experts":
                for t in tasks:
                    plan.append((f"expert-{t}", [t], ["--trainer.task_norm=scale", *cross, *expert_steps], stale))
        # every variant once per seed: seed 0 keeps the variant's name, seed s runs as <name>-s<s>
        plan = [(run_name(name, seed), run_tasks, [*extra, f"--run.seed={seed}"], stale)
                for seed in self.args.seeds for name, run_tasks, extra, stale in plan]
        for name, run_tasks, extra, stale in track(plan, "learning benchmark variants", unit="variants"):
            final = self.rl(name, warm, run_tasks, extra, stale)
            if final is not None:
                self.evaluate(name, final, run_tasks)
            else:
                log(f"{name}: no final model (see {self.out / (name + '.log')}); not evaluated")


# ---------------------------------------------------------------------------------------------- report
PASSES = ("greedy", "sampled")
RESAMPLES = 2000


def task_report(report: dict[str, Any] | None, pass_name: str, task: str) -> dict[str, Any] | None:
    """One task's figures in a probe report (``report[pass][task]``), or None."""
    return ((report or {}).get(pass_name) or {}).get(task)


def success(report: dict[str, Any] | None, task: str, pass_name: str = "greedy") -> float | None:
    r = task_report(report, pass_name, task)
    return None if r is None else float(r["success"])


def paired_delta(before: dict[str, float], after: dict[str, float], seed: int = 0) -> tuple[float, float, float]:
    """Mean change of per-task success over the tasks both probes ran, with a 95 % percentile interval
    from resampling those tasks (paired: a task's before and after stay together); the eval report's own
    bootstrap, over one difference per task."""
    from services.controller.report import bootstrap_interval

    common = sorted(set(before) & set(after))
    if not common:
        return (float("nan"), float("nan"), float("nan"))
    diffs = [[after[t] - before[t]] for t in common]
    lo, hi = bootstrap_interval(diffs, resamples=RESAMPLES, seed=seed)
    return (sum(d[0] for d in diffs) / len(diffs), lo, hi)


def mean_delta(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]],
               seed: int = 0) -> tuple[float, float, float]:
    """Change of the task-type mean (each task type weighs the same), tasks resampled within each type."""
    types = [t for t in before if t in after and set(before[t]) & set(after[t])]
    if not types:
        return (float("nan"), float("nan"), float("nan"))
    rng = random.Random(seed)
    diffs = {t: [after[t][k] - before[t][k] for k in sorted(set(before[t]) & set(after[t]))] for t in types}
    point = sum(sum(d) / len(d) for d in diffs.values()) / len(types)
    draws = sorted(sum(sum(d[rng.randrange(len(d))] for _ in d) / len(d) for d in diffs.values()) / len(types)
                   for _ in range(RESAMPLES))
    return (point, draws[int(0.025 * RESAMPLES)], draws[int(0.975 * RESAMPLES) - 1])


def _cell(r: dict[str, Any] | None) -> str:
    if r is None:
        return "–"
    lo, hi = r.get("success_ci95", [float("nan")] * 2)
    return f"{r['success']:.2f} [{lo:.2f}, {hi:.2f}]"


def _delta_cell(d: tuple[float, float, float]) -> str:
    point, lo, hi = d
    if point != point:
        return "–"
    mark = " **↑**" if lo > 0 else (" ↓" if hi < 0 else "")
    return f"{100 * point:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]{mark}"


def table(results: dict[str, Any], tasks: list[str], splits: list[str]) -> str:
    """Per split and pass: success per task with its bootstrap interval, then each variant's paired change
    against the warm start in points (↑: the interval lies above 0)."""
    evals, runs = results["evals"], results["runs"]
    lines = []
    for split in splits:
        base = evals.get(f"warm_start@{split}", {}).get("report")
        labels = labels_of(results, split)
        for pass_name in PASSES:
            if not any(task_report(base, pass_name, t) for t in tasks):
                continue
            n_tasks = {t: task_report(base, pass_name, t)["tasks"] for t in tasks if task_report(base, pass_name, t)}
            head = " | ".join(f"{t} (n={n_tasks.get(t, '?')})" for t in tasks)
            lines += [f"**{split} split, {pass_name}**: success per task [95 % bootstrap interval over tasks]", "",
                      f"| policy | {head} | mean of tasks | wall time (SFT / RL) |", "|---|" + "---|" * len(tasks) + "---|---|"]
            for label in ["warm_start", *labels]:
                rep = evals.get(f"{label}@{split}", {}).get("report")
                vals = [success(rep, t, pass_name) for t in tasks]
                vals = [v for v in vals if v is not None]
                mean = f"{sum(vals) / len(vals):.3f}" if vals else "–"
                run = runs.get(label if label != "warm_start" else "sft", {})
                wall = (f"{run.get('wall_s', 0) / 60:.1f} min" + (" (time limit)" if run.get("timeout") else "")
                        if run else "")
                cells = " | ".join(_cell(task_report(rep, pass_name, t)) for t in tasks)
                lines.append(f"| {label} | {cells} | {mean} | {wall} |")
            lines += ["", f"Change against the warm start ({split}, {pass_name}), points [95 % paired bootstrap]:", "",
                      f"| policy | {' | '.join(tasks)} | mean of tasks |", "|---|" + "---|" * len(tasks) + "---|"]
            for label in labels:
                rep = evals.get(f"{label}@{split}", {}).get("report")
                before = {t: (task_report(base, pass_name, t) or {}).get("per_task_success", {}) for t in tasks}
                after = {t: (task_report(rep, pass_name, t) or {}).get("per_task_success", {}) for t in tasks}
                cells = " | ".join(_delta_cell(paired_delta(before[t], after[t])) for t in tasks)
                lines.append(f"| {label} | {cells} | {_delta_cell(mean_delta(before, after))} |")
            lines.append("")
    for split in splits:
        lines += seeds_table(results, tasks, split) + pass_at_k_table(results, tasks, split)
        lines += sampler_table(results, tasks, split)
    return "\n".join(lines + training_table(results))


def labels_of(results: dict[str, Any], split: str) -> list[str]:
    """The RL runs probed on ``split``, in the order they ran."""
    return [k.split("@")[0] for k in results["evals"] if k.endswith(f"@{split}") and not k.startswith("warm_start")]


def seeds_table(results: dict[str, Any], tasks: list[str], split: str) -> list[str]:
    """Per variant run with several seeds: its change against the warm start, mean over the seeds with the
    lowest and highest seed beside it (the seeds' spread), per task and for the mean of tasks."""
    evals = results["evals"]
    base = evals.get(f"warm_start@{split}", {}).get("report")
    by_variant: dict[str, list[str]] = {}
    for label in labels_of(results, split):
        by_variant.setdefault(variant_of(label), []).append(label)
    if not base or not any(len(v) > 1 for v in by_variant.values()):
        return []
    def spread(values: list[float]) -> str:
        values = [v for v in values if v == v]  # a task a probe did not run: nan
        if not values:
            return "–"
        return f"{100 * sum(values) / len(values):+.1f} ({100 * min(values):+.1f}, {100 * max(values):+.1f})"

    lines = []
    for pass_name in PASSES:
        lines += [f"**Over seeds ({split}, {pass_name})**: change against the warm start in points, mean over "
                  "the seeds (lowest seed, highest seed)", "",
                  f"| variant | seeds | {' | '.join(tasks)} | mean of tasks |", "|---|---|" + "---|" * len(tasks) + "---|"]
        before = {t: (task_report(base, pass_name, t) or {}).get("per_task_success", {}) for t in tasks}
        for variant, labels in by_variant.items():
            per_seed: list[tuple[list[float], float]] = []  # (change per task, change of the mean) per seed
            for label in labels:
                rep = evals[f"{label}@{split}"].get("report")
                after = {t: (task_report(rep, pass_name, t) or {}).get("per_task_success", {}) for t in tasks}
                per_seed.append(([paired_delta(before[t], after[t])[0] for t in tasks], mean_delta(before, after)[0]))
            cells = " | ".join(spread([d[i] for d, _ in per_seed]) for i in range(len(tasks)))
            lines.append(f"| {variant} | {len(labels)} | {cells} | {spread([m for _, m in per_seed])} |")
        lines.append("")
    return lines


def pass_at_per_task(report: dict[str, Any] | None, task: str, k: int) -> dict[str, float]:
    """pass@k of each task id in a sampled pass, from its success rate over the pass's attempts per task
    (the unbiased estimator, as the eval report's own pass@k); empty when the pass has fewer than k."""
    from services.controller.report import pass_at_k

    r = task_report(report, "sampled", task)
    if not r or not r.get("tasks"):
        return {}
    n = round(r["episodes"] / r["tasks"])
    if n < k:
        return {}
    return {tid: pass_at_k(n, round(rate * n), k) for tid, rate in r["per_task_success"].items()}


def pass_at_k_table(results: dict[str, Any], tasks: list[str], split: str, ks: tuple[int, ...] = (1, 2, 4, 8)) -> list[str]:
    """pass@k of the sampled pass for k = 1, 2, 4, 8 (as far as the attempts per task go): the mean of tasks for
    the warm start and each run, and each run's paired change; then each task's pass@k before and after at the
    largest k. A gain at pass@1 only is sharpening; a gain at pass@8 is tasks the policy could not solve before."""
    from services.controller.report import bootstrap_interval

    evals = results["evals"]
    base = evals.get(f"warm_start@{split}", {}).get("report")
    ks = tuple(k for k in ks if any(pass_at_per_task(base, t, k) for t in tasks))
    if len(ks) < 2:
        return []
    labels = ["warm_start", *labels_of(results, split)]

    def per_type(label: str, k: int) -> dict[str, dict[str, float]]:
        rep = evals.get(f"{label}@{split}", {}).get("report")
        return {t: pass_at_per_task(rep, t, k) for t in tasks}

    def mean_cell(label: str, k: int) -> str:
        per_id = [list(v.values()) for v in per_type(label, k).values() if v]
        if not per_id:
            return "–"
        means = [sum(v) / len(v) for v in per_id]
        # the interval of the task-type mean: each type's ids resampled within it, as mean_delta does
        rng, draws = random.Random(0), []
        for _ in range(RESAMPLES):
            draws.append(sum(sum(v[rng.randrange(len(v))] for _ in v) / len(v) for v in per_id) / len(per_id))
        draws.sort()
        return f"{sum(means) / len(means):.3f} [{draws[int(0.025 * RESAMPLES)]:.3f}, {draws[int(0.975 * RESAMPLES) - 1]:.3f}]"

    head = " | ".join(f"pass@{k}" for k in ks)
    lines = [f"**{split} split, pass@k** (sampled pass at T = 1; mean of tasks [95 % bootstrap interval over tasks])", "",
             f"| policy | {head} |", "|---|" + "---|" * len(ks)]
    lines += [f"| {label} | {' | '.join(mean_cell(label, k) for k in ks)} |" for label in labels]
    lines += ["", f"Change of pass@k against the warm start ({split}), points [95 % paired bootstrap]:", "",
              f"| policy | {head} |", "|---|" + "---|" * len(ks)]
    for label in labels[1:]:
        cells = " | ".join(_delta_cell(mean_delta(per_type("warm_start", k), per_type(label, k))) for k in ks)
        lines.append(f"| {label} | {cells} |")
    top = ks[-1]
    lines += ["", f"pass@{top} per task ({split}) [95 % bootstrap interval over tasks]:", "",
              f"| policy | {' | '.join(tasks)} |", "|---|" + "---|" * len(tasks)]
    for label in labels:
        cells = []
        for values in per_type(label, top).values():
            if not values:
                cells.append("–")
                continue
            lo, hi = bootstrap_interval([[v] for v in values.values()], resamples=RESAMPLES)
            cells.append(f"{sum(values.values()) / len(values):.2f} [{lo:.2f}, {hi:.2f}]")
        lines.append(f"| {label} | {' | '.join(cells)} |")
    return lines + [""]


def steps_to_gain(rows: list[dict[str, Any]], tasks: list[str], gain: float = 0.10, window: int = 3) -> int | None:
    """The first RL step at which the training episodes' success (mean over the tasks, a moving mean over
    ``window`` steps) stands ``gain`` above its first ``window`` steps; None if it never does."""
    series = []
    for r in rows:
        values = [r[f"task/{t}/success"] for t in tasks if f"task/{t}/success" in r]
        if values:
            series.append((int(r["step"]), sum(values) / len(values)))
    if len(series) < 2 * window:
        return None
    start = sum(v for _, v in series[:window]) / window
    for i in range(window, len(series)):
        if sum(v for _, v in series[i - window + 1: i + 1]) / window >= start + gain:
            return series[i][0]
    return None


def sampler_table(results: dict[str, Any], tasks: list[str], split: str) -> list[str]:
    """The task sampler on and off: flat groups (no signal: left out by ``trainer.filter_flat_groups``) among
    the groups the rollout made, steps until the training success rose 10 points, and the probe's change."""
    out, evals = Path(results.get("out", "")), results["evals"]
    names = [n for n in results["runs"] if variant_of(n) in ("full", "sampler")]
    if not any(variant_of(n) == "sampler" for n in names):
        return []
    base = evals.get(f"warm_start@{split}", {}).get("report")
    lines = ["The learnability task sampler (`sampler`) beside the configured mix (`full`), the same seeds:", "",
             "| run | steps | flat groups / groups made | steps until training success +10 points "
             f"| sampled change ({split}, mean of tasks) |", "|---|---|---|---|---|"]
    for name in names:
        rows = read_metrics(out / name)
        if not rows:
            continue
        flat = int(max(r.get("train/flat_groups", 0) for r in rows))
        trained = int(sum(r.get("train/groups", 0) for r in rows))
        rep = evals.get(f"{name}@{split}", {}).get("report")
        before = {t: (task_report(base, "sampled", t) or {}).get("per_task_success", {}) for t in tasks}
        after = {t: (task_report(rep, "sampled", t) or {}).get("per_task_success", {}) for t in tasks}
        reached = steps_to_gain(rows, results["runs"][name].get("tasks", tasks))
        share = f"{flat}/{flat + trained} ({flat / (flat + trained):.0%})" if flat + trained else "–"
        lines.append(f"| {name} | {len(rows)} | {share} | {reached if reached is not None else 'not reached'} "
                     f"| {_delta_cell(mean_delta(before, after)) if rep else '–'} |")
    return lines + [""]


def training_table(results: dict[str, Any]) -> list[str]:
    """Per RL run, from its metrics.jsonl: steps, wall time per step, trained episodes, and how many trained
    tokens had their advantage's sign changed by task normalisation (0 by construction with ``scale``)."""
    out = Path(results.get("out", ""))
    lines = ["Training runs (from each run's metrics.jsonl):", "",
             "| run | steps | median s/step | episodes trained | `train/tokens` | advantage signs flipped by task norm |",
             "|---|---|---|---|---|---|"]
    for name in results["runs"]:
        rows = read_metrics(out / name)
        if name == "sft" or not rows:
            continue
        gaps = sorted(b["ts"] - a["ts"] for a, b in zip(rows, rows[1:], strict=False))
        median = f"{gaps[len(gaps) // 2]:.1f}" if gaps else "–"
        episodes = int(sum(r.get("train/trajectories", 0) for r in rows))
        tokens = int(sum(r.get("train/tokens", 0) for r in rows))
        flipped = int(sum(r.get("train/adv_sign_flipped", 0) for r in rows))
        lines.append(f"| {name} | {len(rows)} | {median} | {episodes} | {tokens} | {flipped} |")
    return lines + [""]


def plots(results: dict[str, Any], out: Path, docs: Path, tasks: list[str], prefix: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    sft = read_metrics(out / "sft")
    if sft:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        ax.plot([r["step"] for r in sft], [r.get("train/loss", float("nan")) for r in sft])
        ax.set(xlabel="SFT step", ylabel="cross-entropy per token", title="warm start on oracle demonstrations")
        ax.grid(alpha=0.3)
        path = docs / f"{prefix}-sft-loss.png"
        fig.tight_layout(), fig.savefig(path, dpi=110), plt.close(fig)
        written.append(path)
    for name in [n for n in results["runs"] if n != "sft"]:
        rows = read_metrics(out / name)
        if not rows:
            continue
        fig, ax = plt.subplots(figsize=(6, 3.5))
        run_tasks = results["runs"][name].get("tasks", tasks)
        for i, t in enumerate(run_tasks):
            pts = [(r["step"], r[f"task/{t}/success"]) for r in rows if f"task/{t}/success" in r]
            if not pts:
                continue
            xs, ys = zip(*pts, strict=True)
            window = max(1, len(ys) // 10)
            smooth = [sum(ys[max(0, j - window + 1): j + 1]) / len(ys[max(0, j - window + 1): j + 1])
                      for j in range(len(ys))]
            color = f"C{i}"
            ax.plot(xs, ys, color=color, alpha=0.25, lw=0.8)
            ax.plot(xs, smooth, color=color, label=f"{t} (training episodes, sampled)")
            for split, marker in (("test", "o"), ("train", "s")):
                before = success(results["evals"].get(f"warm_start@{split}", {}).get("report"), t)
                after = success(results["evals"].get(f"{name}@{split}", {}).get("report"), t)
                if before is not None and after is not None:
                    ax.plot([0, xs[-1]], [before, after], marker=marker, ls=":", color=color,
                            label=f"{t} eval {split} (greedy) before/after")
        ax.set(xlabel="RL step", ylabel="success", ylim=(-0.02, 1.02), title=f"RL variant: {name}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
        path = docs / f"{prefix}-{name}.png"
        fig.tight_layout(), fig.savefig(path, dpi=110), plt.close(fig)
        written.append(path)
    return written


def write_doc(doc: Path, text: str, section: str = "results") -> None:
    begin, end = f"<!-- {section}:begin -->", f"<!-- {section}:end -->"
    body = doc.read_text() if doc.exists() else f"# Learning benchmark\n\n{begin}\n{end}\n"
    if begin not in body:
        body += f"\n{begin}\n{end}\n"
    head, _, rest = body.partition(begin)
    _, _, tail = rest.partition(end)
    doc.write_text(f"{head}{begin}\n{text}\n{end}{tail}")


# ---------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    overrides: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, overrides = argv[:i], argv[i + 1:]
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/smollm2.toml")
    p.add_argument("--out", default="runs/learning", help="directory for every run, log and results.json")
    p.add_argument("--docs", default="docs/benchmarks", help="where the PNG plots go")
    p.add_argument("--prefix", default="learning", help="file name prefix of the plots")
    p.add_argument("--tasks", default="db,os,kg", help="comma list, or auto = every env that builds here")
    p.add_argument("--variants", default="full,no_task_norm,no_cross_policy",
                   help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--sft-model", default="", help="use this warm-start model instead of running `jetrl sft`")
    p.add_argument("--sft-steps", type=int, default=8)
    p.add_argument("--sft-lr", type=float, default=5e-5)
    p.add_argument("--sft-batch", type=int, default=16, help="demonstrations per SFT step")
    p.add_argument("--sft-extra", nargs="*",
                   default=["--trainer.warmup_steps=0", "--trainer.lora_rank=0", "--trainer.torch_threads=2"],
                   help="extra overrides for the warm start only (every weight trains; the oracle needs no cores)")
    p.add_argument("--sft-task-weights", default="",
                   help='the warm start\'s demonstration mix, e.g. \'{"db": 1, "os": 1, "kg": 2}\' (default: RL\'s tasks, even)')
    p.add_argument("--rl-steps", type=int, default=40)
    p.add_argument("--rl-train-limit", type=int, default=0,
                   help="RL draws from the first N training tasks of each task type (0 = all); probes still use "
                        "the eval split. Few tasks, each seen several times, is how the quickstart learns in minutes")
    p.add_argument("--rollouts", type=int, default=1, help="rollout replicas (RL and eval)")
    p.add_argument("--adapter-versions", type=int, default=2,
                   help="cross-policy variants: LoRA versions the rollout engine holds (rollout.adapter_versions: "
                        "the current one and older ones, one engine, no extra cores); 0 = stale pool engines instead")
    p.add_argument("--cross-policy-base", action="store_true",
                   help="with --adapter-versions: cross-policy turns may also play the base model (version 0)")
    p.add_argument("--stale-engines", type=int, default=1,
                   help="stale pool engines (variants with cross-policy, --adapter-versions 0 only)")
    p.add_argument("--cross-policy-prob", type=float, default=0.25)
    p.add_argument("--stale-every", type=int, default=10)
    p.add_argument("--eval-splits", default="test", help="comma list of splits to evaluate (test, train)")
    p.add_argument("--eval-limit", type=int, default=24, help="tasks per task type in each probe (0 = all)")
    p.add_argument("--eval-samples", type=int, default=4, help="attempts per task in the sampled pass")
    p.add_argument("--time-limit-min", type=float, default=30.0, help="per command (AgentRL budget: 30 min)")
    p.add_argument("--sft-time-limit-min", type=float, default=0.0,
                   help="the warm start's own time limit (0 = --time-limit-min); stopped there, it keeps the "
                        "steps it made")
    p.add_argument("--no-warm-eval", action="store_true", help="do not evaluate the warm start (another invocation does)")
    p.add_argument("--seeds", default="0", help="comma list of run.seed values: every RL variant runs once per "
                                                 "seed (seed 0 as <variant>, seed s as <variant>-s<s>)")
    p.add_argument("--expert-steps", type=int, default=0,
                   help="RL steps of each expert-<task> run (0 = --rl-steps); --rl-steps / number of tasks gives "
                        "each expert the episodes of its task the multi-task run trains on")
    p.add_argument("--resume", "--skip-done", dest="skip_done", action="store_true",
                   help="reuse the finished stages in --out (warm start, probes, RL runs) and their results; "
                        "run only what is missing or failed")
    p.add_argument("--report-only", action="store_true", help="only rebuild table and plots from results.json")
    p.add_argument("--write-doc", default="", help="markdown file whose results markers receive the table")
    p.add_argument("--doc-section", default="results", help="name of the markers in --write-doc")
    args = p.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    args.eval_splits = [s for s in args.eval_splits.split(",") if s]
    args.seeds = [int(s) for s in args.seeds.split(",") if s]
    for v in args.variants:
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r}")

    bench = Bench(args, overrides)
    if args.report_only:
        bench.results = json.loads(bench.results_file.read_text())
        tasks = bench.results.get("tasks", [])
    else:
        if args.tasks == "auto":
            from shared.tasks import registered_tasks

            tasks = working_tasks(sorted(registered_tasks()), args.config)
        else:
            tasks = [t for t in args.tasks.split(",") if t]
        if not tasks:
            raise SystemExit("no usable task")
        bench.results["tasks"] = tasks
        bench.results["out"] = str(bench.out)
        bench.save()
        started = time.monotonic()
        warm = bench.warm_start(tasks)
        if not args.no_warm_eval:
            bench.evaluate("warm_start", warm, tasks)
        bench.variants(warm, tasks)
        bench.results["total_wall_s"] = round(time.monotonic() - started, 1)
        bench.save()
    text = table(bench.results, tasks, args.eval_splits)
    print(text)
    docs = ROOT / args.docs
    docs.mkdir(parents=True, exist_ok=True)
    for path in plots(bench.results, bench.out, docs, tasks, args.prefix):
        log(f"plot {path.relative_to(ROOT)}")
    if args.write_doc:
        write_doc(ROOT / args.write_doc, text, args.doc_section)
        log(f"table written into {args.write_doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
