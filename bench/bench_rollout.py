"""Rollout throughput on real multi-turn episodes, engines side by side in one run.

Each engine gets the same setup: an embedded nats-server, one db env replica and one rollout replica as
their own processes (``python -m services.envs db``, ``python -m services.rollout``), and the same
jobs: ``--groups`` groups of ``--group-size`` episodes (one task instance per group, GRPO-style),
published at once as the controller would. Reported per engine: sampled tokens/s (tokens the policy
generated, from the trajectories), episodes/s, turns, success, and wall time from the first job to
the last trajectory. With ``--repeats N`` the engines take turns N times (interleaved, so a slow spell of
the machine falls on all of them) and the table reports each engine's median run.

    .venv/bin/python bench/bench_rollout.py --model runs/sft/model --engines hf,continuous [--repeats 3]

The model should make real tool calls (a warm start), or every episode ends after one turn.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.bus import connect, declare_topology  # noqa: E402
from shared.config import JetRLConfig, load_config, save_config  # noqa: E402
from shared.envapi import EnvClient  # noqa: E402
from shared.messages import EpisodeJob, Trajectory, decode, encode  # noqa: E402
from shared.natsd import EmbeddedNats  # noqa: E402
from shared.subjects import Subjects  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


async def wait_for_replica(js, subjects: Subjects, role: str, timeout_s: float = 300.0) -> None:  # noqa: ANN001
    kv = await js.key_value(subjects.registry_kv)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if any(k.startswith(role) for k in await kv.keys()):
                return
        except Exception:  # no keys yet
            pass
        await asyncio.sleep(0.5)
    raise TimeoutError(f"no {role} replica registered within {timeout_s} s")


async def run_engine(cfg: JetRLConfig, engine: str, args: argparse.Namespace, workdir: Path) -> dict[str, float]:
    workdir.mkdir(parents=True, exist_ok=True)
    server = EmbeddedNats(workdir / f"nats-{engine}")
    cfg.nats.url = server.start()
    cfg.nats.prefix = f"bench{uuid.uuid4().hex[:6]}"
    cfg.rollout.engine, _, variant = engine.partition("-")  # continuous-bf16: [rollout.continuous] matmul_dtype
    cfg.rollout.continuous.matmul_dtype = "bfloat16" if variant == "bf16" else "float32"
    path = workdir / f"{engine}.toml"
    save_config(cfg, path)
    procs = []
    try:
        for module in (["services.envs", "db"], ["services.rollout"]):
            log = open(workdir / f"{engine}-{module[-1]}.log", "wb")
            procs.append(subprocess.Popen([sys.executable, "-m", *module, "--config", str(path)], cwd=ROOT,
                                          stdout=log, stderr=subprocess.STDOUT))
        subjects = Subjects(cfg.nats.prefix)
        nc = await connect(cfg.nats, "bench-rollout")
        js = nc.jetstream()
        await declare_topology(js, subjects, cfg.nats)
        await wait_for_replica(js, subjects, "rollout")
        task_ids = await EnvClient(nc, subjects, "db", timeout_s=120.0).task_ids("train")
        done: list[Trajectory] = []
        finished = asyncio.Event()
        expected = args.groups * args.group_size

        async def on_traj(msg) -> None:  # noqa: ANN001
            done.append(decode(msg.data, Trajectory))
            if len(done) >= expected:
                finished.set()

        await nc.subscribe(subjects.traj(">"), cb=on_traj)
        started = time.monotonic()
        for g in range(args.groups):
            group_id = f"g{g}-{uuid.uuid4().hex[:6]}"
            for i in range(args.group_size):
                job = EpisodeJob(episode_id=f"{group_id}-{i}", group_id=group_id, task="db",
                                 task_id=task_ids[g % len(task_ids)], split="train", group_size=args.group_size,
                                 temperature=1.0, max_new_tokens=cfg.rollout.max_new_tokens)
                await js.publish(subjects.jobs("db"), encode(job), headers={"Nats-Msg-Id": job.episode_id})
        await asyncio.wait_for(finished.wait(), timeout=args.timeout_s)
        wall = time.monotonic() - started
        await nc.close()
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        server.stop()
    sampled = sum(sum(t.loss_mask) for t in done)
    return {"wall_s": wall, "episodes": len(done), "sampled_tokens": sampled, "tokens_per_s": sampled / wall,
            "episodes_per_s": len(done) / wall, "turns": statistics.mean(len(t.turns) for t in done),
            "success": statistics.mean(t.success for t in done),
            "tokens_per_episode": statistics.mean(len(t.tokens) for t in done)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs" / "smollm2.toml"))
    parser.add_argument("--model", required=True, help="model.name: a warm-start directory, smollm2, tiny")
    parser.add_argument("--engines", default="hf,continuous",
                        help="hf | continuous | continuous-bf16 (rollout.continuous.matmul_dtype = bfloat16), "
                             "comma-separated")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--concurrency", type=int, default=32, help="rollout.concurrency (episodes at once)")
    parser.add_argument("--threads", type=int, default=2, help="rollout.torch_threads")
    parser.add_argument("--repeats", type=int, default=1, help="rounds over the engines; the table shows medians")
    parser.add_argument("--timeout-s", type=float, default=3600.0)
    parser.add_argument("overrides", nargs="*", help="section.key=value config overrides")
    args = parser.parse_args()
    cfg = load_config(args.config, [f"model.name={args.model}", f"rollout.concurrency={args.concurrency}",
                                    f"rollout.torch_threads={args.threads}", "run.log_level=warning",
                                    *args.overrides])
    engines = args.engines.split(",")
    runs: dict[str, list[dict[str, float]]] = {engine: [] for engine in engines}
    with tempfile.TemporaryDirectory(prefix="bench-rollout-") as tmp:
        for round_ in range(args.repeats):
            for engine in engines:
                r = asyncio.run(run_engine(cfg, engine, args, Path(tmp) / f"{engine}-{round_}"))
                runs[engine].append(r)
                print(f"{engine} (round {round_ + 1}): {r['tokens_per_s']:.1f} sampled tokens/s, "
                      f"{r['episodes_per_s']:.3f} episodes/s, {r['episodes']} episodes in {r['wall_s']:.0f} s", flush=True)
    # each engine's median run by sampled tokens/s (the whole run, so that its columns belong together)
    results = {engine: sorted(rs, key=lambda r: r["tokens_per_s"])[len(rs) // 2] for engine, rs in runs.items()}
    first = results[engines[0]]
    print(f"\n# rollout, {args.groups} groups x {args.group_size} db episodes, concurrency {args.concurrency}, "
          f"{args.threads} threads, model {args.model}, median of {args.repeats} interleaved runs\n")
    print("| engine | sampled tokens/s (median) | all runs | ratio | episodes/s | turns | tokens/episode | success "
          "| wall s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for engine, r in results.items():
        every = ", ".join(f"{x['tokens_per_s']:.1f}" for x in runs[engine])
        print(f"| {engine} | {r['tokens_per_s']:.1f} | {every} | {r['tokens_per_s'] / first['tokens_per_s']:.2f}x | "
              f"{r['episodes_per_s']:.3f} | {r['turns']:.2f} | {r['tokens_per_episode']:.0f} | {r['success']:.2f} | "
              f"{r['wall_s']:.0f} |")


if __name__ == "__main__":
    main()
