"""``jetrl quickstart``: a pretrained model that gets better at agent tasks on a laptop, in minutes.

1. **Warm start**, built once and cached (``[warmstart]``): ``jetrl sft`` plays each env's scripted expert
   through the services and trains SmolLM2 on its demonstrations for a few steps. Short on purpose: the
   model learns the tool-call format and the tasks' shape, but sampling at T = 1 still breaks calls
   and gets answers wrong, which is where RL has something to learn.
2. **RL**: ``jetrl up`` from the warm start, asynchronous, LoRA updates; one line per step with each
   task's success on the episodes it trained on.
3. **Summary**: each task's training success over the first and the last third of the steps.

The cache key is everything that shapes the warm start (model, tasks, env settings, tool format,
warm-start settings, seed), so changing any of them builds a new one; ``--fresh`` rebuilds it anyway.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

from shared.config import JetRLConfig, load_config

WARM_START_KEYS = ("model", "env", "warmstart")


def warm_start_dir(cfg: JetRLConfig) -> Path:
    shaping = {section: getattr(cfg, section) for section in WARM_START_KEYS}
    shaping.update(tasks=cfg.controller.tasks, tool_format=cfg.rollout.tool_format, seed=cfg.run.seed,
                   max_new_tokens=cfg.rollout.max_new_tokens, max_context=cfg.rollout.max_context_tokens)
    text = json.dumps({k: v if isinstance(v, (dict, str, int, float)) else _plain(v) for k, v in shaping.items()},
                      sort_keys=True)
    key = hashlib.sha256(text.encode()).hexdigest()[:12]
    root = cfg.warmstart.cache_dir or os.environ.get("JETRL_CACHE", str(Path.home() / ".cache" / "jetrl"))
    return Path(root).expanduser() / "warmstart" / f"{cfg.model.name.replace('/', '_')}-{key}"


def _plain(value: Any) -> Any:
    import dataclasses

    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def sft_overrides(cfg: JetRLConfig, run_dir: Path) -> list[str]:
    ws = cfg.warmstart
    return [f"run.dir={run_dir}", f"trainer.steps={ws.steps}", f"trainer.lr={ws.lr}", "trainer.lora_rank=0",
            "trainer.warmup_steps=0", f"trainer.min_groups={ws.demonstrations}",
            f"trainer.max_groups={ws.demonstrations}", "trainer.checkpoint_every=0"]


def training_summary(run_dir: Path) -> list[str]:
    """Per task: mean training success over the first and the last third of the steps."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    tasks = sorted({k.split("/")[1] for r in rows for k in r if k.startswith("task/") and k.endswith("/success")})
    third = max(1, len(rows) // 3)
    lines = []
    for task in tasks:
        (first, n1), (last, n2) = task_success(rows[:third], task), task_success(rows[-third:], task)
        lines.append(f"{task}: training success {first:.2f} over steps 1-{third} ({n1} episodes) -> {last:.2f} over "
                     f"steps {len(rows) - third + 1}-{len(rows)} ({n2} episodes)")
    return lines


def task_success(rows: list[dict[str, Any]], task: str) -> tuple[float, int]:
    """Success over the training episodes of ``rows`` (metrics.jsonl lines), and how many there were."""
    episodes = sum(r.get(f"task/{task}/episodes", 0.0) for r in rows)
    wins = sum(r.get(f"task/{task}/success", 0.0) * r.get(f"task/{task}/episodes", 0.0) for r in rows)
    return (wins / episodes if episodes else float("nan")), int(episodes)


def cmd_quickstart(args: argparse.Namespace, overrides: list[str]) -> int:
    from jetrl.cli import cmd_up

    cfg = load_config(args.config, overrides)
    warm = warm_start_dir(cfg)
    if args.fresh and warm.exists():
        shutil.rmtree(warm)
    model = warm / "model"
    if (model / "READY").is_file():
        print(f"jetrl quickstart: warm start cached in {model}", flush=True)
    else:
        print(f"jetrl quickstart: building the warm start ({cfg.warmstart.steps} steps x "
              f"{cfg.warmstart.demonstrations} oracle demonstrations, cached in {warm})", flush=True)
        rc = cmd_up(args, overrides + sft_overrides(cfg, warm), mode="sft")
        if rc:
            return rc
        (model / "READY").write_text("ok\n")
    print("jetrl quickstart: RL from the warm start", flush=True)
    rc = cmd_up(args, overrides + [f"model.name={model}"], mode="up")
    if rc == 0:
        for line in training_summary(Path(cfg.run.dir).resolve()):
            print(f"jetrl quickstart: {line}", flush=True)
    return rc
