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
   stale pool engine of its own), ``no_task_norm``, ``no_cross_policy`` (one engine, the current version
   only), ``expert-<task>`` (the full recipe on one task only), and ``sampler`` (``full`` with the
   learnability task sampler, to set beside ``full``: flat groups and gains).
   ``--seeds 0,1`` runs every variant once per ``run.seed`` (seed 0 as ``<variant>``, seed s as
   ``<variant>-s<s>``); ``--expert-steps`` gives the experts their own number of steps.
4. **Report** (``bench/learning_report.py``): ``<out>/results.json``, a markdown table per pass (printed,
   and written into ``docs/benchmarks/learning.md`` between the ``<!-- results:begin/end -->`` markers with
   ``--write-doc``):
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
warm start, each probe, each RL run) and runs only the rest. ``--record FILE`` carries a benchmark longer
than one sitting (one ``--out`` directory, which need not survive): each sitting (its warm start, named by the
digest of the model, with the probes and runs made from it, their metrics included) goes into the file; with
``--resume`` the runs another sitting holds are skipped, and the report covers every sitting, each run
against the probe of its own warm start.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `python bench/learning.py` from anywhere
from bench.learning_report import flatten, plots, read_metrics, table, trimmed, write_doc  # noqa: E402

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


def finished(run: dict[str, Any] | None) -> bool:
    """Whether a run's record says it finished: it ended well, or at its time limit (its trainer then
    finished its step and saved the model: a finished run with fewer steps)."""
    return bool(run and (run.get("rc") == 0 or run.get("timeout")))


def run_name(variant: str, seed: int) -> str:
    """The run of ``variant`` with ``run.seed = seed``: seed 0 keeps the variant's name."""
    return variant if seed == 0 else f"{variant}-s{seed}"


def model_digest(model: Path) -> str:
    """The first 10 hex digits of the SHA-256 of a model directory's weight files: names a warm start."""
    h = hashlib.sha256()
    for f in sorted(model.glob("*.safetensors")) or sorted(p for p in model.iterdir() if p.is_file()):
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                h.update(chunk)
    return h.hexdigest()[:10]


def machine() -> str:
    """The CPU a figure was measured on: model name, cores, and the AVX-512 / AMX it has."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return ""
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    flags = next((line.split(":", 1)[1].split() for line in info.splitlines() if line.startswith("flags")), [])
    wide = sorted({f for f in flags if f.startswith(("avx512", "amx"))})
    return f"{name}, {os.cpu_count()} cores, {' '.join(wide) or 'AVX2 only (no AVX-512, no AMX)'}"


def finished_types(partial: dict[str, Any]) -> dict[str, Any]:
    """The task types of a stopped probe's report (``eval.partial.json``) whose every planned episode came
    back, per pass; the others are left out, not reported on fewer attempts."""
    return {name: {task: r for task, r in by_task.items() if r.get("complete")} for name, by_task in partial.items()}


def merge_probes(kept: dict[str, Any], new: dict[str, Any], tasks: list[str]) -> tuple[dict[str, Any], list[str]]:
    """A probe report of what ``kept`` and ``new`` finished (``new`` wins for a type both hold), and the types
    of ``tasks`` that some pass of it lacks: what a resumed probe still plays."""
    merged = {name: {**kept.get(name, {}), **new.get(name, {})} for name in sorted({*kept, *new})}
    missing = [t for t in tasks if not merged or any(t not in by_task for by_task in merged.values())]
    return merged, missing


def whole(evaluation: dict[str, Any] | None) -> bool:
    """A probe with a report for every task type it was asked for."""
    return bool(evaluation and evaluation.get("report") and not evaluation.get("missing"))


def tasks_arg(tasks: list[str]) -> str:
    return "--run.tasks=" + json.dumps({t: 1.0 for t in tasks}, separators=(",", ":"))


# ---------------------------------------------------------------------------------------------- stages
class Bench:
    def __init__(self, args: argparse.Namespace, overrides: list[str]) -> None:
        self.args, self.overrides = args, overrides
        self.out = (ROOT / args.out).resolve() if not Path(args.out).is_absolute() else Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.limit_s = args.time_limit_min * 60
        self.results: dict[str, Any] = {"config": args.config, "overrides": overrides, "machine": machine(),
                                        "runs": {}, "evals": {}}
        self.results_file = self.out / "results.json"
        if args.skip_done and self.results_file.exists():
            old = json.loads(self.results_file.read_text())
            self.results["runs"].update(old.get("runs", {}))
            self.results["evals"].update(old.get("evals", {}))
        # the record: sittings (one warm start each, with the runs made from it) kept across --out directories
        self.record_file = (ROOT / args.record) if args.record else None
        self.record: dict[str, Any] = {"sittings": {}}
        if self.record_file and self.record_file.exists():
            self.record = json.loads(self.record_file.read_text())
        self.digest = ""  # the warm start's, once it exists

    def base(self, command: str) -> list[str]:
        return [*JETRL, command, "--config", self.args.config, *self.overrides]

    def save(self) -> None:
        """Merge into results.json, so several invocations (one variant each, in parallel) share one --out;
        each run's metrics go in with it, and with ``--record`` this sitting goes into the record."""
        merged = json.loads(self.results_file.read_text()) if self.results_file.exists() else {}
        for key in ("runs", "evals"):
            self.results[key] = merged.get(key, {}) | self.results[key]
        self.results["metrics"] = {name: rows for name in self.results["runs"]
                                   if (rows := trimmed(read_metrics(self.out / name)))}
        tmp = self.results_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(merged | self.results, indent=2))
        tmp.replace(self.results_file)
        if self.record_file and self.digest:
            self.record["sittings"][self.digest] = json.loads(self.results_file.read_text())
            self.record_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.record_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.record, indent=1, sort_keys=True) + "\n")
            tmp.replace(self.record_file)

    def recorded_elsewhere(self, name: str) -> str:
        """The digest of another sitting of the record that ran and probed ``name`` ("" if none)."""
        for digest, sitting in self.record["sittings"].items():
            if digest == self.digest or name not in sitting.get("runs", {}):
                continue
            if not self.args.eval_splits and finished(sitting["runs"][name]):  # no probe asked: the run is all
                return digest
            if any(k.startswith(f"{name}@") and whole(v) for k, v in sitting.get("evals", {}).items()):
                return digest
        return ""

    def probed(self, name: str) -> bool:
        """Whether ``name`` ran and its final model was probed on every split (its model is then no longer
        needed); with no split to probe, whether it ran."""
        return finished(self.results["runs"].get(name)) and \
            all(whole(self.results["evals"].get(f"{name}@{split}")) for split in self.args.eval_splits)

    def adopt_warm_start(self, model: Path) -> None:
        """Name this sitting by its warm start's digest; with --resume, a sitting of the record with the same
        warm start (this directory's, or the same model made again) lends its finished probes and runs."""
        self.digest = model_digest(model)
        self.results["warm_start"] = {"digest": self.digest, "model": str(model)}
        earlier = self.record["sittings"].get(self.digest)
        if earlier and self.args.skip_done:
            for key in ("runs", "evals"):
                self.results[key] = earlier.get(key, {}) | self.results[key]
        log(f"warm start {model}: digest {self.digest}")
        self.save()

    def done(self, name: str) -> bool:
        return bool(self.args.skip_done and finished(self.results["runs"].get(name))
                    and (self.out / name / "model").exists())

    def warm_start(self, tasks: list[str]) -> Path:
        if self.args.sft_model:
            model = Path(self.args.sft_model).resolve()
            self.adopt_warm_start(model)
            return model
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
        self.adopt_warm_start(model)
        return model

    def evaluate(self, label: str, model: Path, tasks: list[str]) -> None:
        for split in self.args.eval_splits:
            key = f"{label}@{split}"
            run_dir = self.out / f"eval-{label}-{split}"
            report_file, partial_file = run_dir / "eval.json", run_dir / "eval.partial.json"
            prior = self.results["evals"].get(key) or {}
            if self.args.skip_done and whole(prior):
                continue
            # resumed after a probe stopped at its limit: the types it finished are kept, the rest played now
            kept = (prior.get("report") or {}) if self.args.skip_done else {}
            todo = prior["missing"] if kept and prior.get("missing") else tasks
            cmd = [*self.base("probe"), f"--run.dir={run_dir}", f"--model.name={model}", tasks_arg(todo),
                   f"--controller.eval_split={split}", f"--controller.eval_limit={self.args.eval_limit}",
                   f"--controller.eval_samples={self.args.eval_samples}", f"--rollouts={self.args.rollouts}",
                   "--rollout.torch_threads=2"]  # generation alone: both cores
            report_file.unlink(missing_ok=True)  # an earlier probe's report is not this one's
            eval_limit_s = (self.args.eval_time_limit_min * 60) or self.limit_s
            res = run_cmd(cmd, self.out / f"eval-{label}-{split}.log", eval_limit_s)
            if report_file.exists() and res["rc"] == 0:
                new = json.loads(report_file.read_text())
            else:  # stopped at its limit: what it finished (the controller writes it on the way out)
                new = finished_types(json.loads(partial_file.read_text())) if partial_file.exists() else {}
            report, missing = merge_probes(kept, new, tasks)
            res |= {"report": report if any(report.values()) else None, "missing": missing}
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
            if where := self.recorded_elsewhere(name):
                log(f"{name}: ran and probed in the record's sitting {where}; skipped")
                continue
            if self.args.skip_done and self.probed(name):
                log(f"{name}: ran and probed in this sitting; skipped")
                continue
            final = self.rl(name, warm, run_tasks, extra, stale)
            if final is not None:
                self.evaluate(name, final, run_tasks)
            else:
                log(f"{name}: no final model (see {self.out / (name + '.log')}); not evaluated")


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
    p.add_argument("--eval-time-limit-min", type=float, default=0.0,
                   help="each probe's own time limit (0 = --time-limit-min); a probe stopped there has no report")
    p.add_argument("--no-warm-eval", action="store_true", help="do not evaluate the warm start (another invocation does)")
    p.add_argument("--seeds", default="0", help="comma list of run.seed values: every RL variant runs once per "
                                                 "seed (seed 0 as <variant>, seed s as <variant>-s<s>)")
    p.add_argument("--expert-steps", type=int, default=0,
                   help="RL steps of each expert-<task> run (0 = --rl-steps); --rl-steps / number of tasks gives "
                        "each expert the episodes of its task the multi-task run trains on")
    p.add_argument("--resume", "--skip-done", dest="skip_done", action="store_true",
                   help="reuse the finished stages in --out (warm start, probes, RL runs) and their results; "
                        "run only what is missing or failed")
    p.add_argument("--record", default="",
                   help="a JSON file (kept in the repository) holding every sitting: this --out's warm start, probes "
                        "and runs go in under the warm start's digest; with --resume, runs another sitting of it "
                        "holds are skipped; the report covers them all, each run against its own warm start")
    p.add_argument("--report-only", action="store_true",
                   help="only rebuild table and plots from results.json (or from --record)")
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
        if not bench.record_file:
            bench.results = json.loads(bench.results_file.read_text())
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
    # the report: every sitting of the record, or this directory's alone
    flat = flatten(bench.record["sittings"] if bench.record_file else {"current": bench.results})
    if not flat["runs"] and not flat["evals"]:
        raise SystemExit(f"nothing to report: {args.record or bench.results_file} holds no run")
    tasks = flat["tasks"]
    text = table(flat, tasks, args.eval_splits)
    print(text)
    docs = ROOT / args.docs
    docs.mkdir(parents=True, exist_ok=True)
    for path in plots(flat, docs, tasks, args.prefix):
        log(f"plot {path}")
    if args.write_doc:
        write_doc(ROOT / args.write_doc, text, args.doc_section)
        log(f"table written into {args.write_doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
