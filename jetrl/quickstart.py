"""``jetrl quickstart``: a pretrained model that gets better at agent tasks on a laptop, in minutes.

1. **Warm start**, built once and cached (``[warmstart]``): ``jetrl sft`` plays each env's scripted expert
   through the services and trains SmolLM2 on its demonstrations for a few steps. Short on purpose: the
   model learns the tool-call format and the tasks' shape, but sampling at T = 1 still breaks calls
   and gets answers wrong, which is where RL has something to learn.
2. **Probe of the warm start** (cached with it): ``jetrl probe`` on the training tasks RL will draw from
   (the first ``controller.train_limit`` of each task type), ``warmstart.probe_samples`` attempts each at T = 1.
3. **RL**: ``jetrl up`` from the warm start, asynchronous, LoRA updates; one line per step with each
   task's success on the episodes it trained on (2 groups a step: noisy, the probes are the measure).
4. **Probe of the result**, the same tasks and samples, and a summary per task: success before -> after,
   with 95 % bootstrap intervals over the tasks, and the well-formed tool-call rate. Everything is also
   written to ``<run>/quickstart.json`` (``tests/system/test_learning.py`` asserts on it).

The cache key is everything that shapes the warm start (model, tasks, env settings, tool format,
warm-start settings, seed), so changing any of them builds a new one; ``--fresh`` rebuilds it anyway.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from jetrl.launch import launch
from jetrl.rundir import keep_earlier_run
from shared.config import JetRLConfig, load_config

WARM_START_KEYS = ("model", "env", "warmstart")
DEFAULT_PROBE_TASKS = 16  # when RL draws from every training task, the probe takes the first 16


def warm_start_dir(cfg: JetRLConfig) -> Path:
    shaping: dict[str, Any] = {section: dataclasses.asdict(getattr(cfg, section)) for section in WARM_START_KEYS}
    # the mix's task settings as their tasks read them (typed, defaults filled in), however they were given
    shaping["env"]["sections"] = {task: _plain(cfg.env.section(task)) for task in sorted(cfg.run.tasks)}
    shaping.update(tasks=cfg.run.tasks, tool_format=cfg.rollout.tool_format, seed=cfg.run.seed,
                   max_new_tokens=cfg.rollout.max_new_tokens, max_context=cfg.rollout.max_context_tokens)
    for key in ("cache_dir", "probe_samples"):  # where it is kept, and how it is probed, do not change it
        shaping["warmstart"].pop(key)
    key = hashlib.sha256(json.dumps(shaping, sort_keys=True).encode()).hexdigest()[:12]
    root = cfg.warmstart.cache_dir or os.environ.get("JETRL_CACHE", str(Path.home() / ".cache" / "jetrl"))
    return Path(root).expanduser() / "warmstart" / f"{cfg.model.name.replace('/', '_')}-{key}"


def _plain(settings: Any) -> Any:
    return dataclasses.asdict(settings) if dataclasses.is_dataclass(settings) else settings


def sft_overrides(cfg: JetRLConfig, run_dir: Path) -> list[str]:
    ws = cfg.warmstart
    return [f"run.dir={run_dir}", f"trainer.steps={ws.steps}", f"trainer.lr={ws.lr}", "trainer.lora_rank=0",
            "trainer.warmup_steps=0", f"trainer.min_groups={ws.demonstrations}",
            f"trainer.max_groups={ws.demonstrations}", "trainer.checkpoint_every=0",
            # the oracle engine generates nothing, so training may have both cores
            "trainer.torch_threads=2",
            # demonstrations from the whole training split, not only the tasks RL will draw from
            "controller.train_limit=0"]


def probe_overrides(cfg: JetRLConfig, run_dir: Path, model: Path) -> list[str]:
    """The sampled probe on the training tasks RL draws from; generation alone, so it may have both cores."""
    tasks = cfg.controller.train_limit or DEFAULT_PROBE_TASKS
    return [f"run.dir={run_dir}", f"model.name={model}", "controller.eval_split=train",
            f"controller.eval_limit={tasks}", f"controller.eval_samples={cfg.warmstart.probe_samples}",
            'controller.eval_passes=["sampled"]', "rollout.torch_threads=2"]


def run_probe(args: argparse.Namespace, overrides: list[str], cfg: JetRLConfig, run_dir: Path,
              model: Path, reuse: bool) -> dict[str, Any] | None:
    """``jetrl probe`` of ``model``; its sampled report per task (kept in ``run_dir``, and taken from there
    when ``reuse``), or None if it failed."""
    report_file = run_dir / "eval.json"
    if not (reuse and report_file.is_file()):
        if run_dir.exists():
            shutil.rmtree(run_dir)  # an interrupted probe, or one of an earlier model
        if launch(args, overrides + probe_overrides(cfg, run_dir, model), mode="probe"):
            return None
    return json.loads(report_file.read_text()).get("sampled")


def summary(before: dict[str, Any], after: dict[str, Any], rl_steps: int, samples: int) -> list[str]:
    lines = []
    for task in sorted(before):
        b, a = before[task], after.get(task)
        if a is None:
            continue
        (blo, bhi), (alo, ahi) = b["success_ci95"], a["success_ci95"]
        lines.append(f"{task}: success on {b['tasks']} training tasks ({samples} samples each, T = 1): warm start "
                     f"{b['success']:.2f} [{blo:.2f}, {bhi:.2f}] -> after {rl_steps} RL steps {a['success']:.2f} "
                     f"[{alo:.2f}, {ahi:.2f}]; well-formed tool calls {b['well_formed_rate']:.2f} -> "
                     f"{a['well_formed_rate']:.2f}")
    return lines


def cmd_quickstart(args: argparse.Namespace, overrides: list[str]) -> int:
    cfg = load_config(args.config, overrides)
    run_dir = Path(cfg.run.dir).resolve()
    warm = warm_start_dir(cfg)
    if args.fresh and warm.exists():
        shutil.rmtree(warm)
    model = warm / "model"
    if (model / "READY").is_file():
        print(f"jetrl quickstart: warm start cached in {model}", flush=True)
    else:
        print(f"jetrl quickstart: building the warm start ({cfg.warmstart.steps} steps x "
              f"{cfg.warmstart.demonstrations} oracle demonstrations, cached in {warm})", flush=True)
        rc = launch(args, overrides + sft_overrides(cfg, warm), mode="sft")
        if rc:
            return rc
        (model / "READY").write_text("ok\n")
    probing = cfg.warmstart.probe_samples > 0
    probe_name = f"probe-train{cfg.controller.train_limit or DEFAULT_PROBE_TASKS}x{cfg.warmstart.probe_samples}"
    before = None
    if probing:
        print("jetrl quickstart: probing the warm start on the training tasks", flush=True)
        before = run_probe(args, overrides, cfg, warm / probe_name, model, reuse=True)
    keep_earlier_run(run_dir, "quickstart", resumable=False)  # RL starts from the warm start, not an earlier run
    print("jetrl quickstart: RL from the warm start", flush=True)
    rc = launch(args, overrides + [f"model.name={model}"], mode="up")
    if rc or not probing:
        return rc
    print("jetrl quickstart: probing the RL result on the same tasks", flush=True)
    after = run_probe(args, overrides, cfg, run_dir / probe_name, run_dir / "model", reuse=False)
    if before is None or after is None:
        print("jetrl quickstart: a probe failed; see its logs", flush=True)
        return 1
    lines = summary(before, after, cfg.trainer.steps, cfg.warmstart.probe_samples)
    (run_dir / "quickstart.json").write_text(json.dumps({"warm_start": before, "rl": after,
                                                         "rl_steps": cfg.trainer.steps}, indent=2) + "\n")
    for line in lines:
        print(f"jetrl quickstart: {line}", flush=True)
    return 0
