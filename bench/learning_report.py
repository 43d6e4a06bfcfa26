"""The learning benchmark's report (bench/learning.py): tables and plots from its results.

A *sitting* is one ``--out`` directory: one warm start, its probe, and the RL runs made from it, each probed
the same way (``<out>/results.json``). A *record* (``--record FILE``, kept in the repository) holds several
sittings keyed by the digest of their warm-start model, so a benchmark too long for one sitting is carried
over several: each RL run is compared with the probe of the warm start it started from.

Every function here reads a *flat* results dict (``flatten``): ``runs`` and ``evals`` of every sitting,
``base`` (each run's warm-start label), ``metrics`` (each run's per-step rows) and ``tasks``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

PASSES = ("greedy", "sampled")
RESAMPLES = 2000
WARM = "warm_start"
METRIC_PREFIXES = ("step", "ts", "train/", "task/")
"""The fields of a run's metrics.jsonl rows the report reads (and a record keeps)."""


# ---------------------------------------------------------------------------------------------- results
def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def trimmed(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Metrics rows with only the fields the report reads: a record stays small."""
    return [{k: v for k, v in r.items() if k.startswith(METRIC_PREFIXES)} for r in rows]


def variant_of(name: str) -> str:
    """``full-s1`` -> ``full``: the variant a run (or eval label) belongs to."""
    head, sep, tail = name.rpartition("-s")
    return head if sep and tail.isdigit() else name


def flatten(sittings: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One results dict from sittings keyed by their warm start's digest. With one sitting its warm start is
    ``warm_start`` (and its SFT run ``sft``); with several, ``warm_start-<digest>`` and ``sft-<digest>``. A
    run's metrics come from the sitting (a record) or from its directory under the sitting's ``out``."""
    flat: dict[str, Any] = {"runs": {}, "evals": {}, "metrics": {}, "base": {}, "tasks": []}
    for digest, s in sittings.items():
        warm = WARM if len(sittings) == 1 else f"{WARM}-{digest}"
        sft = warm.replace(WARM, "sft")
        for key, ev in s.get("evals", {}).items():
            label, _, split = key.partition("@")
            if label == WARM:
                flat["evals"][f"{warm}@{split}"] = ev
            else:
                flat["evals"][key] = ev
                flat["base"][label] = warm
        out = Path(s.get("out", ""))
        for name, run in s.get("runs", {}).items():
            flat_name = sft if name == "sft" else name
            flat["runs"][flat_name] = run
            rows = s.get("metrics", {}).get(name)
            flat["metrics"][flat_name] = rows if rows is not None else read_metrics(out / name)
        flat["tasks"] += [t for t in s.get("tasks", []) if t not in flat["tasks"]]
    return flat


def base_of(results: dict[str, Any], label: str) -> str:
    """The warm-start label a run is compared with."""
    return results.get("base", {}).get(label, WARM)


def warm_labels(results: dict[str, Any], split: str) -> list[str]:
    return [k.split("@")[0] for k in results["evals"] if k.endswith(f"@{split}") and k.startswith(WARM)]


def labels_of(results: dict[str, Any], split: str) -> list[str]:
    """The RL runs probed on ``split``, in the order they ran."""
    return [k.split("@")[0] for k in results["evals"] if k.endswith(f"@{split}") and not k.startswith(WARM)]


def report_of(results: dict[str, Any], label: str, split: str) -> dict[str, Any] | None:
    return results["evals"].get(f"{label}@{split}", {}).get("report")


def metrics_of(results: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return results.get("metrics", {}).get(name) or []


# ---------------------------------------------------------------------------------------------- figures
def task_report(report: dict[str, Any] | None, pass_name: str, task: str) -> dict[str, Any] | None:
    """One task's figures in a probe report (``report[pass][task]``), or None."""
    return ((report or {}).get(pass_name) or {}).get(task)


def success(report: dict[str, Any] | None, task: str, pass_name: str = "greedy") -> float | None:
    r = task_report(report, pass_name, task)
    return None if r is None else float(r["success"])


def per_id(report: dict[str, Any] | None, pass_name: str, tasks: list[str]) -> dict[str, dict[str, float]]:
    """Success of each task id, per task type."""
    return {t: (task_report(report, pass_name, t) or {}).get("per_task_success", {}) for t in tasks}


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


# ---------------------------------------------------------------------------------------------- tables
def table(results: dict[str, Any], tasks: list[str], splits: list[str]) -> str:
    """Per split and pass: success per task with its bootstrap interval, then each run's paired change
    against its warm start in points (↑: the interval lies above 0); then the seeds, pass@k, sampler and
    training tables."""
    runs = results["runs"]
    lines = []
    for split in splits:
        warms, labels = warm_labels(results, split), labels_of(results, split)
        for pass_name in PASSES:
            shown = [t for t in tasks if any(task_report(report_of(results, w, split), pass_name, t) for w in warms)]
            if not shown:
                continue
            n_tasks = {}
            for w in warms:
                n_tasks |= {t: r["tasks"] for t in tasks if (r := task_report(report_of(results, w, split), pass_name, t))}
            head = " | ".join(f"{t} (n={n_tasks.get(t, '?')})" for t in tasks)
            lines += [f"**{split} split, {pass_name}**: success per task [95 % bootstrap interval over tasks]", "",
                      f"| policy | {head} | mean of tasks | wall time |", "|---|" + "---|" * len(tasks) + "---|---|"]
            for label in [*warms, *labels]:
                rep = report_of(results, label, split)
                vals = [v for t in tasks if (v := success(rep, t, pass_name)) is not None]
                mean = f"{sum(vals) / len(vals):.3f}" if vals else "–"
                run = runs.get(label.replace(WARM, "sft") if label.startswith(WARM) else label, {})
                wall = (f"{run.get('wall_s', 0) / 60:.1f} min" + (" (time limit)" if run.get("timeout") else "")
                        if run else "")
                cells = " | ".join(_cell(task_report(rep, pass_name, t)) for t in tasks)
                lines.append(f"| {label} | {cells} | {mean} | {wall} |")
            if not labels:  # no run probed yet: no change to show
                lines.append("")
                continue
            against = "its warm start" if len(warms) > 1 else "the warm start"
            lines += ["", f"Change against {against} ({split}, {pass_name}), points [95 % paired bootstrap]:", "",
                      f"| policy | {' | '.join(tasks)} | mean of tasks |", "|---|" + "---|" * len(tasks) + "---|"]
            for label in labels:
                before = per_id(report_of(results, base_of(results, label), split), pass_name, tasks)
                after = per_id(report_of(results, label, split), pass_name, tasks)
                cells = " | ".join(_delta_cell(paired_delta(before[t], after[t])) for t in tasks)
                lines.append(f"| {label} | {cells} | {_delta_cell(mean_delta(before, after))} |")
            lines.append("")
    for split in splits:
        lines += seeds_table(results, tasks, split) + pass_at_k_table(results, tasks, split)
        lines += sampler_table(results, tasks, split)
    return "\n".join(lines + training_table(results))


def seeds_table(results: dict[str, Any], tasks: list[str], split: str) -> list[str]:
    """Per variant run with several seeds: its change against its warm start, mean over the seeds with the
    lowest and highest seed beside it (the seeds' spread), per task and for the mean of tasks."""
    by_variant: dict[str, list[str]] = {}
    for label in labels_of(results, split):
        by_variant.setdefault(variant_of(label), []).append(label)
    if not warm_labels(results, split) or not any(len(v) > 1 for v in by_variant.values()):
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
        for variant, labels in by_variant.items():
            per_seed: list[tuple[list[float], float]] = []  # (change per task, change of the mean) per seed
            for label in labels:
                before = per_id(report_of(results, base_of(results, label), split), pass_name, tasks)
                after = per_id(report_of(results, label, split), pass_name, tasks)
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
    each warm start and each run, and each run's paired change; then each task's pass@k before and after at the
    largest k. A gain at pass@1 only is sharpening; a gain at pass@8 is tasks the policy could not solve before."""
    from services.controller.report import bootstrap_interval

    warms = warm_labels(results, split)
    ks = tuple(k for k in ks if any(pass_at_per_task(report_of(results, w, split), t, k) for w in warms for t in tasks))
    if len(ks) < 2:
        return []
    labels = [*warms, *labels_of(results, split)]

    def per_type(label: str, k: int) -> dict[str, dict[str, float]]:
        return {t: pass_at_per_task(report_of(results, label, split), t, k) for t in tasks}

    def mean_cell(label: str, k: int) -> str:
        per_task = [list(v.values()) for v in per_type(label, k).values() if v]
        if not per_task:
            return "–"
        means = [sum(v) / len(v) for v in per_task]
        # the interval of the task-type mean: each type's ids resampled within it, as mean_delta does
        rng, draws = random.Random(0), []
        for _ in range(RESAMPLES):
            draws.append(sum(sum(v[rng.randrange(len(v))] for _ in v) / len(v) for v in per_task) / len(per_task))
        draws.sort()
        return f"{sum(means) / len(means):.3f} [{draws[int(0.025 * RESAMPLES)]:.3f}, {draws[int(0.975 * RESAMPLES) - 1]:.3f}]"

    head = " | ".join(f"pass@{k}" for k in ks)
    lines = [f"**{split} split, pass@k** (sampled pass at T = 1; mean of tasks [95 % bootstrap interval over tasks])", "",
             f"| policy | {head} |", "|---|" + "---|" * len(ks)]
    lines += [f"| {label} | {' | '.join(mean_cell(label, k) for k in ks)} |" for label in labels]
    if labels[len(warms):]:
        lines += ["", f"Change of pass@k against the warm start ({split}), points [95 % paired bootstrap]:", "",
                  f"| policy | {head} |", "|---|" + "---|" * len(ks)]
    for label in labels[len(warms):]:
        cells = " | ".join(_delta_cell(mean_delta(per_type(base_of(results, label), k), per_type(label, k)))
                           for k in ks)
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
    names = [n for n in results["runs"] if variant_of(n) in ("full", "sampler")]
    if not any(variant_of(n) == "sampler" for n in names):
        return []
    probed = any(report_of(results, name, split) for name in names)  # training runs alone: no probe column
    probe_head = f" sampled change ({split}, mean of tasks) |" if probed else ""
    lines = ["The learnability task sampler (`sampler`) beside the configured mix (`full`), the same seeds:", "",
             f"| run | steps | flat groups / groups made | steps until training success +10 points |{probe_head}",
             "|---|---|---|---|" + ("---|" if probed else "")]
    for name in names:
        rows = metrics_of(results, name)
        if not rows:
            continue
        flat = int(max(r.get("train/flat_groups", 0) for r in rows))
        trained = int(sum(r.get("train/groups", 0) for r in rows))
        reached = steps_to_gain(rows, results["runs"][name].get("tasks", tasks))
        share = f"{flat}/{flat + trained} ({flat / (flat + trained):.0%})" if flat + trained else "–"
        line = f"| {name} | {len(rows)} | {share} | {reached if reached is not None else 'not reached'} |"
        if probed:
            rep = report_of(results, name, split)
            before = per_id(report_of(results, base_of(results, name), split), "sampled", tasks)
            line += f" {_delta_cell(mean_delta(before, per_id(rep, 'sampled', tasks))) if rep else '–'} |"
        lines.append(line)
    return lines + [""]


def training_table(results: dict[str, Any]) -> list[str]:
    """Per RL run, from its metrics: steps, wall time per step, trained episodes, and how many trained
    tokens had their advantage's sign changed by task normalisation (0 by construction with ``scale``)."""
    lines = ["Training runs (from each run's metrics.jsonl):", "",
             "| run | steps | median s/step | episodes trained | `train/tokens` | advantage signs flipped by task norm |",
             "|---|---|---|---|---|---|"]
    for name in results["runs"]:
        rows = metrics_of(results, name)
        if name.startswith("sft") or not rows:
            continue
        gaps = sorted(b["ts"] - a["ts"] for a, b in zip(rows, rows[1:], strict=False))
        median = f"{gaps[len(gaps) // 2]:.1f}" if gaps else "–"
        episodes = int(sum(r.get("train/trajectories", 0) for r in rows))
        tokens = int(sum(r.get("train/tokens", 0) for r in rows))
        flipped = int(sum(r.get("train/adv_sign_flipped", 0) for r in rows))
        lines.append(f"| {name} | {len(rows)} | {median} | {episodes} | {tokens} | {flipped} |")
    return lines + [""]


# ---------------------------------------------------------------------------------------------- plots
def plots(results: dict[str, Any], docs: Path, tasks: list[str], prefix: str) -> list[Path]:
    """``<prefix>-sft-loss.png`` (every warm start) and ``<prefix>-<run>.png`` per RL run: training success
    per task over steps, with the greedy probe of its warm start and of its final model as end points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    sft_runs = [n for n in results["runs"] if n.startswith("sft") and metrics_of(results, n)]
    if sft_runs:
        fig, ax = plt.subplots(figsize=(6, 3.5))
        for name in sft_runs:
            rows = metrics_of(results, name)
            ax.plot([r["step"] for r in rows], [r.get("train/loss", float("nan")) for r in rows], label=name)
        ax.set(xlabel="SFT step", ylabel="cross-entropy per token", title="warm start on oracle demonstrations")
        ax.grid(alpha=0.3)
        if len(sft_runs) > 1:
            ax.legend(fontsize=7)
        path = docs / f"{prefix}-sft-loss.png"
        fig.tight_layout(), fig.savefig(path, dpi=110), plt.close(fig)
        written.append(path)
    for name in [n for n in results["runs"] if not n.startswith("sft")]:
        rows = metrics_of(results, name)
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
                before = success(report_of(results, base_of(results, name), split), t)
                after = success(report_of(results, name, split), t)
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
