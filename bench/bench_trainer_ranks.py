"""Trainer seconds per RL step at 1 and 2 data-parallel ranks, one thread each, the same batch, one run.

    DS_BUILD_OPS=0 .venv/bin/python bench/bench_trainer_ranks.py [--model smollm2] [--groups 2] [--ranks 1,2]
        [--zero-stage 1,2]

Needs DeepSpeed (``make venv-deepspeed``). The batch is ``--groups`` x ``--group-size`` real db episodes
(``bench/bench_trainer.py``'s, token for token as the rollout renders them). Each configuration runs in
its own processes, one after the other: the plain torch trainer (one process), then the DeepSpeed
backend under torchrun at each ``--ranks`` (gloo on the CPU, NCCL where there are GPUs), every rank with
one torch thread. Each times ``--repeats`` steps (``Trainer.optimise``: plan, scatter, forward, backward,
all-reduce, optimizer step) after one warm-up step, on rank 0; the medians are printed side by side.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.bench_trainer import db_trajectories  # noqa: E402
from services.trainer.trainer import Trainer  # noqa: E402
from shared.config import DeepSpeedConfig, JetRLConfig, ModelConfig, TrainerConfig  # noqa: E402
from shared.model import load_model, load_tokenizer, quiet_transformers, resolve_model  # noqa: E402
from shared.subjects import Subjects  # noqa: E402


def worker(args: argparse.Namespace) -> None:
    """One configuration (every rank runs this): time the steps, rank 0 writes them to ``--out``."""
    quiet_transformers()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = JetRLConfig()
    cfg.model = ModelConfig(name=args.model)
    cfg.trainer = TrainerConfig(lr=1e-6, micro_batch_tokens=args.micro_batch_tokens, backend=args.backend,
                                deepspeed=DeepSpeedConfig(zero_stage=args.zero_stage), torch_threads=1)
    path = resolve_model(cfg.model)
    trajs = db_trajectories(load_tokenizer(path), args.groups, args.group_size)
    model = load_model(path)
    run_dir = Path(args.out).parent
    make: Callable[..., Trainer] = Trainer
    if args.backend == "deepspeed":
        from services.trainer.deepspeed_backend import start_ranks

        make = start_ranks(cfg, model, run_dir)  # ranks > 0 follow rank 0 in here and exit
    trainer = make(None, None, Subjects("bench"), cfg.trainer, model, run_dir, "bench")  # type: ignore[arg-type]
    times, cpu, stats = [], [], {}
    for _ in range(1 + args.repeats):
        wall, used = time.perf_counter(), time.process_time()
        stats, _ = trainer.optimise(trajs)
        times.append(time.perf_counter() - wall)
        cpu.append(time.process_time() - used)
    trainer.backend.close()  # the other ranks stop
    Path(args.out).write_text(json.dumps({
        "step_s": times[1:], "rank0_cpu_s": cpu[1:], "tokens": sum(len(t.tokens) for t in trajs),
        "trained": stats.get("train/tokens"), "rank_tokens_min": stats.get("train/rank_tokens_min"),
        "rank_tokens_max": stats.get("train/rank_tokens_max"), "loss": stats.get("train/loss")}))


@dataclass
class Config:
    backend: str
    zero_stage: int
    ranks: int

    @property
    def name(self) -> str:
        return "torch" if self.backend == "torch" else f"deepspeed ZeRO-{self.zero_stage}"


def run(args: argparse.Namespace, config: Config, tmp: Path) -> dict[str, Any]:
    out = tmp / f"{config.backend}-{config.zero_stage}-{config.ranks}" / "result.json"
    out.parent.mkdir(parents=True)
    own = [str(Path(__file__)), "--worker", "--backend", config.backend, "--out", str(out), "--model", args.model,
           "--groups", str(args.groups), "--group-size", str(args.group_size), "--repeats", str(args.repeats),
           "--micro-batch-tokens", str(args.micro_batch_tokens), "--zero-stage", str(config.zero_stage)]
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={config.ranks}"] \
        if config.backend == "deepspeed" else []
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_BUILD_OPS="0", PYTHONPATH=str(REPO))
    started = time.perf_counter()
    proc = subprocess.run([sys.executable, *launcher, *own], env=env, capture_output=True, text=True, cwd=REPO)
    if proc.returncode != 0:
        raise SystemExit(f"{config} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    result = json.loads(out.read_text())
    result["process_s"] = time.perf_counter() - started
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--ranks", default="1,2")
    parser.add_argument("--zero-stage", default="2", help="one stage, or several: 1,2")
    parser.add_argument("--micro-batch-tokens", type=int, default=2048)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--backend", default="deepspeed", help=argparse.SUPPRESS)
    parser.add_argument("--out", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        args.zero_stage = int(args.zero_stage)
        worker(args)
        return
    print(f"# {args.groups} groups x {args.group_size} db episodes, model {args.model}, 1 thread per rank, medians "
          f"of {args.repeats} steps after a warm-up; load average at start {os.getloadavg()[0]:.1f}", flush=True)
    configs = [Config("torch", 0, 1)] + [Config("deepspeed", int(z), int(n)) for z in args.zero_stage.split(",")
                                         for n in args.ranks.split(",")]
    rows: list[tuple[Config, dict[str, Any]]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for config in configs:
            result = run(args, config, Path(tmp))
            rows.append((config, result))
            print(f"{config.name} x{config.ranks}: {statistics.median(result['step_s']):.2f} s/step (steps "
                  f"{[round(s, 2) for s in result['step_s']]}, process {result['process_s']:.0f} s)", flush=True)
    print(f"# load average at end {os.getloadavg()[0]:.1f}; {rows[0][1]['tokens']} tokens, "
          f"{rows[0][1]['trained']:.0f} trained")
    single = {c.name: statistics.median(r["step_s"]) for c, r in rows if c.ranks == 1}
    print("\n| trainer | ranks x threads | s per step | rank 0 CPU s per step | tokens per rank (min-max) "
          "| speed-up vs 1 rank of the same |")
    print("|---|---|---|---|---|---|")
    for config, r in rows:
        s = statistics.median(r["step_s"])
        split = f"{r['rank_tokens_min']:.0f}-{r['rank_tokens_max']:.0f}" if r["rank_tokens_min"] is not None else "all"
        print(f"| {config.name} | {config.ranks} x 1 | {s:.2f} | {statistics.median(r['rank0_cpu_s']):.2f} | {split} | "
              f"{single[config.name] / s:.2f}x |")


if __name__ == "__main__":
    main()
