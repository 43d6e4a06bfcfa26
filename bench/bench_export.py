"""`jetrl export` of many small trajectories: wall time and peak memory (VmHWM) of the export process.

    .venv/bin/python bench/bench_export.py --count 100000        # figures in docs/data.md

Publishes ``--count`` trajectories of ``--tokens`` tokens with a three-turn conversation (a db-like episode)
to an embedded nats-server, then runs `jetrl export` to Parquet and to JSONL (with and without --tokens),
each in a process of its own, and prints one line per export.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.bus import connect, declare_topology  # noqa: E402
from shared.config import JetRLConfig  # noqa: E402
from shared.messages import Trajectory, TurnInfo, encode  # noqa: E402
from shared.natsd import EmbeddedNats  # noqa: E402
from shared.subjects import Subjects  # noqa: E402

PEAK = ("import sys\nfrom jetrl.cli import main\nrc = main(sys.argv[1:])\n"
        "print(next(x for x in open('/proc/self/status') if x.startswith('VmHWM')).split()[1])\nsys.exit(rc)")


def episode(i: int, tokens: int) -> Trajectory:
    call = {"id": "call_0", "type": "function", "function": {"name": "execute_sql", "arguments": '{"sql": "SELECT 1"}'}}
    messages = [{"role": "system", "content": "You are a database agent. " * 8}, {"role": "user", "content": f"q {i}"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0", "content": "[(1,)]"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0", "content": "Correct"}]
    half = tokens // 2
    return Trajectory(episode_id=f"e{i}", group_id=f"g{i // 8}", task="db", task_id=f"t{i % 256}", split="train",
                      group_size=8, tokens=[(7 * k) % 49152 for k in range(tokens)], logprobs=[-0.25] * tokens,
                      loss_mask=[0] * half + [1] * half, prompt_len=half, reward=float(i % 2), status="completed",
                      replica_id="r", turns=[TurnInfo(start=half, end=tokens, engine_id="e", policy_version=i // 64)],
                      messages=messages, tools=[{"type": "function", "function": {"name": "execute_sql"}}])


async def publish(cfg: JetRLConfig, count: int, tokens: int) -> None:
    nc = await connect(cfg.nats, "bench-publisher")
    js = nc.jetstream()
    subjects = Subjects(cfg.nats.prefix)
    await declare_topology(js, subjects, cfg.nats)
    for start in range(0, count, 500):
        await asyncio.gather(*(js.publish(subjects.traj("db"), encode(episode(i, tokens)))
                               for i in range(start, min(start + 500, count))))
    await nc.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=100_000)
    ap.add_argument("--tokens", type=int, default=600)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedNats(Path(tmp) / "nats")
        cfg = JetRLConfig()
        cfg.nats.url, cfg.nats.prefix = server.start(), "bench"
        try:
            started = time.monotonic()
            asyncio.run(publish(cfg, args.count, args.tokens))
            print(f"published {args.count} trajectories of {args.tokens} tokens in {time.monotonic() - started:.0f}s")
            for out, flags in (("x.parquet", []), ("x.jsonl", []), ("t.parquet", ["--tokens"])):
                started = time.monotonic()
                proc = subprocess.run([sys.executable, "-c", PEAK, "export", "--url", cfg.nats.url, "--prefix", "bench",
                                       "-o", str(Path(tmp) / out), "--no-progress", *flags], capture_output=True,
                                      text=True, check=True)
                size = (Path(tmp) / out).stat().st_size / 1e6
                print(f"export {out} {' '.join(flags)}: {time.monotonic() - started:.0f}s, peak memory "
                      f"{int(proc.stdout.split()[-1]) / 1024:.0f} MB, file {size:.1f} MB; {proc.stderr.strip()}")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
