"""Env host at scale and the cost of the broker path.

``scale``: an embedded nats-server, ``--replicas`` db env replicas as their own processes
(``python -m services.envs db``) and one driver process per replica. Each driver keeps its share of
``--live`` episodes open at once and plays them with the env's oracle over the env API, as the rollout
does (start, then oracle + interact per turn); a finished episode is replaced by a new one at once.
After ``--warmup-s`` it measures for ``--measure-s``: episodes finished per second, start and interact
round trips (p50 / p99), and the CPU the env replicas and nats-server used (cores, from /proc).
Each replica's shutdown is checked too: SIGTERM with its sessions still open, exit code 0.

``per-call``: one db session's interact (``SELECT 1``) timed three ways, in alternating blocks of one
run: in process (``EnvHost.interact`` on the encoded request, decoded as the client would), over NATS
to an env replica in its own process (``EnvClient.interact``), and a bare NATS echo to a responder in
that process (the floor that any request over the broker pays). Added latency = NATS - in process.

    flock /work/bench.lock nice -n 15 .venv/bin/python bench/bench_env_host.py scale --live 256,1024,4096 --replicas 1,2
    flock /work/bench.lock nice -n 15 .venv/bin/python bench/bench_env_host.py per-call --calls 3000

Prints markdown tables (docs/benchmarks/env_host.md).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared.bus import connect, declare_topology  # noqa: E402
from shared.config import JetRLConfig, save_config  # noqa: E402
from shared.envapi import EnvClient  # noqa: E402
from shared.messages import EnvCancel, EnvHealth, EnvInteract, EnvStart, EnvStep, decode, encode  # noqa: E402
from shared.natsd import EmbeddedNats  # noqa: E402
from shared.subjects import Subjects  # noqa: E402

try:  # the services' event loop (uvloop); a checkout from before it had asyncio's, for a before/after run
    from shared.lifecycle import run
except ImportError:
    from asyncio import run

ROOT = Path(__file__).resolve().parent.parent
TICKS = os.sysconf("SC_CLK_TCK")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def ms(x: float) -> str:
    return f"{1000 * x:.2f}" if x < 0.01 else f"{1000 * x:.1f}" if x < 1 else f"{x:.1f} s"


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process (and its waited-for children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return sum(int(f) for f in fields[11:15]) / TICKS


def bench_config(url: str, prefix: str, max_sessions: int) -> JetRLConfig:
    cfg = JetRLConfig()
    cfg.nats.url, cfg.nats.prefix = url, prefix
    cfg.env.task, cfg.env.max_sessions = "db", max_sessions
    cfg.env.session_timeout_s = 600.0
    cfg.run.log_level = "warning"  # a line per session would measure the logger
    return cfg


async def wait_for_replicas(nc: Any, subjects: Subjects, count: int, timeout_s: float = 120.0) -> list[EnvHealth]:
    """Until ``count`` env replicas answer a health request (every replica answers one): their answers."""
    deadline = time.monotonic() + timeout_s
    inbox = nc.new_inbox()
    replies: dict[str, EnvHealth] = {}

    async def on_reply(msg: Any) -> None:
        if not msg.data:  # "no responders" while no replica is up yet
            return
        health = decode(msg.data, EnvHealth)
        replies[health.replica_id] = health

    sub = await nc.subscribe(inbox, cb=on_reply)
    try:
        while len(replies) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(replies)} of {count} env replicas answered within {timeout_s} s")
            await nc.publish(subjects.env_health("db"), b"", reply=inbox)
            await asyncio.sleep(0.5)
    finally:
        await sub.unsubscribe()
    return list(replies.values())


# ---------------------------------------------------------------------------------------------- scale
async def drive(url: str, prefix: str, live: int, start_at: float, measure_s: float, seed: int,
                think_s: float = 0.0) -> dict[str, Any]:
    """Keep ``live`` oracle episodes open until the window ends; the figures of the window only. With
    ``think_s`` each turn first waits that long on average (a policy generating its turn)."""
    cfg = bench_config(url, prefix, live)
    nc = await connect(cfg.nats, f"driver-{seed}")
    client = EnvClient(nc, Subjects(prefix), "db", timeout_s=120.0)
    task_ids = await client.task_ids("train")
    rng = random.Random(seed)
    end_at = start_at + measure_s
    starts: list[float] = []
    interacts: list[float] = []
    done = [0]
    turns_in_window = [0]
    episode_turns: list[int] = []
    errors: dict[str, int] = {}

    async def player(i: int) -> None:
        n = 0
        while time.time() < end_at:
            n += 1
            sid = f"d{seed}-{i}-{n}"
            try:
                t0 = time.perf_counter()
                opened = await client.start(sid, rng.choice(task_ids), "train", timeout_s=120.0)
                if time.time() >= start_at:
                    starts.append(time.perf_counter() - t0)
                for turn in range(opened.max_turns):
                    if think_s:
                        await asyncio.sleep(think_s * rng.uniform(0.5, 1.5))
                    action = await client.oracle(opened.replica_id, sid)
                    t0 = time.perf_counter()
                    step = await client.interact(opened.replica_id, sid, action, turn=turn)
                    if start_at <= time.time() < end_at:
                        interacts.append(time.perf_counter() - t0)
                        turns_in_window[0] += 1
                    if step.finish:
                        episode_turns.append(turn + 1)
                        break
            except Exception as exc:  # counted and reported: a healthy host has none
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
                await asyncio.sleep(0.1)
                continue
            if start_at <= time.time() < end_at:
                done[0] += 1

    # ramp up over most of the warm-up: thousands of starts in one instant measure the burst, and episodes
    # started together finish together, in waves, long after
    ramp_s = 0.8 * max(0.0, start_at - time.time())

    async def staggered(i: int) -> None:
        await asyncio.sleep(ramp_s * i / live)
        await player(i)

    await asyncio.gather(*(staggered(i) for i in range(live)))
    await nc.close()
    return {"done": done[0], "turns": turns_in_window[0], "episode_turns": episode_turns, "starts": starts,
            "interacts": interacts, "errors": errors}


def checkout_env(root: Path) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(root)}


def save_for(cfg: JetRLConfig, path: Path, root: Path) -> None:
    """The config as ``root``'s checkout reads it: keys it does not know yet are left out."""
    save_config(cfg, path)
    known = (root / "shared" / "config.py").read_text()
    path.write_text("".join(line for line in path.read_text().splitlines(keepends=True)
                            if "=" not in line or line.split("=")[0].strip() + ":" in known))


async def run_scale(live: int, replicas: int, args: argparse.Namespace, workdir: Path, root: Path) -> dict[str, Any]:
    server = EmbeddedNats(workdir / f"nats-{live}-{replicas}")
    url = server.start()
    prefix = f"bh{uuid.uuid4().hex[:6]}"
    cfg = bench_config(url, prefix, live + 64)  # a replica may get more than its even share of starts
    if args.worker_threads:
        cfg.env.worker_threads = args.worker_threads
    cfg_path = workdir / f"env-{live}-{replicas}.toml"
    save_for(cfg, cfg_path, root)
    subjects = Subjects(prefix)
    envs: list[subprocess.Popen[bytes]] = []
    drivers: list[subprocess.Popen[bytes]] = []
    try:
        nc = await connect(cfg.nats, "bench-env-host")
        await declare_topology(nc.jetstream(), subjects, cfg.nats)
        for r in range(replicas):
            log = open(workdir / f"env-{live}-{replicas}-{r}.log", "wb")
            envs.append(subprocess.Popen([sys.executable, "-m", "services.envs", "db", "--config", str(cfg_path)],
                                         cwd=root, env=checkout_env(root), stdout=log, stderr=subprocess.STDOUT))
        await wait_for_replicas(nc, subjects, replicas)
        start_at = time.time() + args.warmup_s
        for d in range(replicas):
            share = live // replicas + (d < live % replicas)
            drivers.append(subprocess.Popen(
                [sys.executable, str(root / "bench" / "bench_env_host.py"), "drive", "--url", url, "--prefix", prefix,
                 "--live", str(share), "--start-at", str(start_at), "--measure-s", str(args.measure_s), "--seed", str(d),
                 "--out", str(workdir / f"driver-{live}-{replicas}-{d}.json"),
                 *(["--think-s", str(args.think_s)] if args.think_s else [])],
                cwd=root, env=checkout_env(root)))
        await asyncio.sleep(max(0.0, start_at - time.time()))
        pids = [p.pid for p in envs] + [server.proc.pid]
        cpu0 = [cpu_s(pid) for pid in pids]
        await asyncio.sleep(args.measure_s)
        cpu1 = [cpu_s(pid) for pid in pids]
        healths = await wait_for_replicas(nc, subjects, replicas)  # each replica's own interact times
        results = []
        for d, p in enumerate(drivers):
            await asyncio.to_thread(p.wait, 300)
            results.append(json.loads((workdir / f"driver-{live}-{replicas}-{d}.json").read_text()))
        # shutdown with sessions open: the drivers stopped mid-episode, so every replica still holds some
        t0 = time.monotonic()
        for p in envs:
            p.send_signal(signal.SIGTERM)
        exits = [await asyncio.to_thread(p.wait, 30) for p in envs]
        shutdown_s = time.monotonic() - t0
        await nc.close()
    finally:
        for p in drivers + envs:
            if p.poll() is None:
                p.kill()
                p.wait()
        server.stop()
    starts = [x for r in results for x in r["starts"]]
    interacts = [x for r in results for x in r["interacts"]]
    errors: dict[str, int] = {}
    for r in results:
        for k, v in r["errors"].items():
            errors[k] = errors.get(k, 0) + v
    # episodes/s from the turns played in the window (an episode of the db oracle is 2 turns): counting only
    # the episodes that end inside it would quantise to whole waves when an episode lasts about the window
    turns_per_episode = statistics.mean(t for r in results for t in r["episode_turns"])
    env_cpu = sum(b - a for a, b in zip(cpu0[:-1], cpu1[:-1], strict=True)) / args.measure_s
    return {"checkout": str(root), "live": live, "replicas": replicas, "episodes_per_s": sum(r["turns"] for r in results) / turns_per_episode / args.measure_s,
            "episodes_ended_per_s": sum(r["done"] for r in results) / args.measure_s,
            "start_p50": pct(starts, 0.5), "start_p99": pct(starts, 0.99),
            "interact_p50": pct(interacts, 0.5), "interact_p99": pct(interacts, 0.99),
            "host_interact_p50": statistics.mean(h.interact_ms_p50 for h in healths) / 1000,
            "host_interact_p99": max(h.interact_ms_p99 for h in healths) / 1000,
            "env_cpu": env_cpu, "nats_cpu": (cpu1[-1] - cpu0[-1]) / args.measure_s,
            "errors": errors, "exit_codes": exits, "shutdown_s": shutdown_s}


def scale(args: argparse.Namespace) -> None:
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-env-host-") as tmp:
        for replicas in args.replicas:
            for live in args.live:
                for root in args.checkouts:  # side by side: a neighbour's load hits each checkout alike
                    r = run(run_scale(live, replicas, args, Path(tmp), root))
                    rows.append(r)
                    print(json.dumps(r), file=sys.stderr, flush=True)
    base = {(r["checkout"], r["replicas"]): r["episodes_per_s"] for r in rows if r["live"] == min(args.live)}
    one = {(r["checkout"], r["live"]): r["episodes_per_s"] for r in rows if r["replicas"] == 1}
    print(f"\n# env host, db (SQLite), oracle episodes, {args.warmup_s:g} s warm-up, {args.measure_s:g} s measured, "
          f"think time {args.think_s:g} s per turn\n")
    print("| checkout | env replicas | live episodes | episodes/s | vs fewest live | vs one replica | start p50 / p99 (ms) | "
          "interact round trip p50 / p99 (ms) | interact in the env host p50 / p99 (ms) | env CPU (cores) | "
          "nats-server CPU | errors | exit codes (SIGTERM, sessions open) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        key = (r["checkout"], r["live"])
        vs_one = f"{r['episodes_per_s'] / one[key]:.2f}x" if one.get(key) else "-"
        few = base.get((r["checkout"], r["replicas"]))
        vs_few = f"{r['episodes_per_s'] / few:.0%}" if few else "-"
        host = (f"{ms(r['host_interact_p50'])} / {ms(r['host_interact_p99'])}" if r["host_interact_p99"]
                else "- (not measured by this checkout)")
        print(f"| {Path(r['checkout']).name} | {r['replicas']} | {r['live']:,} | {r['episodes_per_s']:.0f} | "
              f"{vs_few} | {vs_one} | {ms(r['start_p50'])} / {ms(r['start_p99'])} | "
              f"{ms(r['interact_p50'])} / {ms(r['interact_p99'])} | "
              f"{host} | {r['env_cpu']:.2f} | {r['nats_cpu']:.2f} | "
              f"{sum(r['errors'].values()) or 0} | {', '.join(map(str, r['exit_codes']))} ({r['shutdown_s']:.1f} s) |")


# ------------------------------------------------------------------------------------------- per call
async def run_per_call(args: argparse.Namespace, workdir: Path) -> dict[str, list[float]]:
    from services.envs.db import make_env
    from services.envs.host import EnvHost

    server = EmbeddedNats(workdir / "nats-per-call")
    url = server.start()
    prefix = f"bh{uuid.uuid4().hex[:6]}"
    cfg = bench_config(url, prefix, 64)
    cfg_path = workdir / "env-per-call.toml"
    save_config(cfg, cfg_path)
    subjects = Subjects(prefix)
    env_proc = subprocess.Popen([sys.executable, "-m", "services.envs", "db", "--config", str(cfg_path)], cwd=ROOT,
                                stdout=open(workdir / "env-per-call.log", "wb"), stderr=subprocess.STDOUT)
    echo_proc = subprocess.Popen([sys.executable, __file__, "echo", "--url", url, "--subject", f"{prefix}.echo"],
                                 cwd=ROOT, stdout=subprocess.PIPE)
    try:
        nc = await connect(cfg.nats, "bench-per-call")
        await declare_topology(nc.jetstream(), subjects, cfg.nats)
        await wait_for_replicas(nc, subjects, 1)
        assert echo_proc.stdout is not None
        await asyncio.to_thread(echo_proc.stdout.readline)  # "ready"
        client = EnvClient(nc, subjects, "db")
        host = EnvHost(make_env(cfg.env), cfg.env, subjects, "in-process")
        task_id = (await client.task_ids("train"))[0]
        action = {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_0", "type": "function", "function": {"name": "execute_sql", "arguments": '{"query": "SELECT 1"}'}}]}
        times: dict[str, list[float]] = {"in_process": [], "nats": [], "echo": []}
        payload = encode(EnvInteract(session_id="x", message=action))

        async def in_process(n: int) -> None:
            sid = uuid.uuid4().hex
            await host.start(encode(EnvStart(
                session_id=sid, task_id=task_id, split="train", seed=0)))
            for turn in range(n):
                t0 = time.perf_counter()
                decode(await host.interact(encode(EnvInteract(session_id=sid, message=action, turn=turn))), EnvStep)
                times["in_process"].append(time.perf_counter() - t0)
            await host.cancel(encode(EnvCancel(session_id=sid)))

        async def over_nats(n: int) -> None:
            sid = uuid.uuid4().hex
            opened = await client.start(sid, task_id, "train")
            for turn in range(n):
                t0 = time.perf_counter()
                await client.interact(opened.replica_id, sid, action, turn=turn)
                times["nats"].append(time.perf_counter() - t0)
            await client.cancel(opened.replica_id, sid)

        async def echo(n: int) -> None:
            for _ in range(n):
                t0 = time.perf_counter()
                await nc.request(f"{prefix}.echo", payload, timeout=5.0)
                times["echo"].append(time.perf_counter() - t0)

        per_session = 14  # under the task's 15-turn limit: every call is a plain tool call
        for _ in range(3):  # warm-up: task generation, first-connection costs
            await in_process(per_session)
            await over_nats(per_session)
            await echo(per_session)
        for series in times.values():
            series.clear()
        blocks = max(1, args.calls // per_session)
        for _ in range(blocks):  # alternate in small blocks: a neighbour's load hits all three alike
            await in_process(per_session)
            await over_nats(per_session)
            await echo(per_session)
        await host.shutdown()
        await nc.close()
    finally:
        for p in (env_proc, echo_proc):
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        server.stop()
    return times


async def echo_responder(url: str, subject: str) -> None:
    import nats

    nc = await nats.connect(url)

    async def reply(msg: Any) -> None:
        await msg.respond(msg.data)

    await nc.subscribe(subject, cb=reply)
    await nc.flush()
    print("ready", flush=True)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    await stop.wait()
    await nc.close()


def per_call(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-env-host-") as tmp:
        times = run(run_per_call(args, Path(tmp)))
    base = statistics.median(times["in_process"])
    print(f"\n# one env call (db interact, SELECT 1), {len(times['nats'])} calls each, alternating blocks\n")
    print("| path | p50 (ms) | p90 (ms) | p99 (ms) | p50 added over in process (ms) |")
    print("|---|---|---|---|---|")
    for name, label in (("in_process", "in process (EnvHost.interact)"), ("nats", "over NATS (EnvClient.interact)"),
                        ("echo", "bare NATS echo, same payload")):
        xs = times[name]
        added = f"{1000 * (statistics.median(xs) - base):.2f}" if name == "nats" else "-"
        print(f"| {label} | {1000 * pct(xs, 0.5):.3f} | {1000 * pct(xs, 0.9):.3f} | {1000 * pct(xs, 0.99):.3f} | {added} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode", required=True)
    s = sub.add_parser("scale")
    s.add_argument("--live", type=lambda v: [int(x) for x in v.split(",")], default=[256, 1024, 4096])
    s.add_argument("--replicas", type=lambda v: [int(x) for x in v.split(",")], default=[1, 2])
    s.add_argument("--warmup-s", type=float, default=10.0)
    s.add_argument("--measure-s", type=float, default=20.0)
    s.add_argument("--think-s", type=float, default=0.0,
                   help="mean wait before each turn (a policy generating it); 0 = as fast as the env answers")
    s.add_argument("--worker-threads", type=int, default=0, help="env.worker_threads of the replicas (0: the default)")
    s.add_argument("--checkouts", type=lambda v: [Path(x).resolve() for x in v.split(",")], default=[ROOT],
                   help="source trees to run side by side (e.g. a checkout of an older commit, for before/after)")
    p = sub.add_parser("per-call")
    p.add_argument("--calls", type=int, default=3000)
    d = sub.add_parser("drive")  # internal: one driver process of ``scale``
    d.add_argument("--url")
    d.add_argument("--prefix")
    d.add_argument("--live", type=int)
    d.add_argument("--start-at", type=float)
    d.add_argument("--measure-s", type=float)
    d.add_argument("--seed", type=int)
    d.add_argument("--think-s", type=float, default=0.0)
    d.add_argument("--out", type=Path)
    e = sub.add_parser("echo")  # internal: the bare responder of ``per-call``
    e.add_argument("--url")
    e.add_argument("--subject")
    args = ap.parse_args()
    if args.mode == "scale":
        scale(args)
    elif args.mode == "per-call":
        per_call(args)
    elif args.mode == "drive":
        from shared.log import setup_logging

        setup_logging("bench-driver", level="warning")
        result = run(drive(args.url, args.prefix, args.live, args.start_at, args.measure_s, args.seed, args.think_s))
        args.out.write_text(json.dumps(result))
    else:
        run(echo_responder(args.url, args.subject))


if __name__ == "__main__":
    main()
