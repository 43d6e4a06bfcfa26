"""DB env fidelity and throughput on both backends, side by side: AgentBench dev fidelity (gold graded
correct, perturbed graded wrong), oracle vs random success on generated tasks, reset / step / close
latency, queries/s per replica (one session and many sessions at once), and episodes over NATS.

    .venv/bin/python bench/bench_env_db.py --server mysql://root@127.0.0.1:3306   # docs/benchmarks/db.md
    .venv/bin/python bench/bench_env_db.py --backends sqlite                       # no server

Prints a markdown report (medians unless stated; both backends measured in the same run).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.envs.base import ToolCall  # noqa: E402
from services.envs.db import DBEnv, make_env  # noqa: E402
from services.envs.db.config import DBTaskConfig
from services.envs.db.env import DBEpisode  # noqa: E402
from services.envs.db.grading import answers_from_rows  # noqa: E402
from shared.config import EnvConfig  # noqa: E402
from shared.log import setup_logging  # noqa: E402
from shared.progress import track  # noqa: E402

AGENTBENCH = Path(__file__).resolve().parent.parent.parent / "shared" / "agentbench" / "dbbench" / "dev.jsonl"


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def ms(x: float) -> str:
    return f"{1000 * x:.2f}" if x < 0.01 else f"{1000 * x:.1f}"


def random_call(ep: DBEpisode, rng: random.Random, seen: list[str]) -> ToolCall:
    """A random policy: look at a random column a few times, then commit values it saw (or nothing)."""
    if rng.random() < 0.3 or len(ep.calls) >= 6:
        return ToolCall("commit_final_answer", {"answers": rng.sample(seen, min(len(seen), rng.randint(1, 2)))})
    t = rng.choice(ep.task.tables)
    col = rng.choice(t.column_names)
    return ToolCall("execute_sql", {"query": f"SELECT `{col}` FROM `{t.name}` LIMIT {rng.randint(1, 5)}"})


def play(env: DBEnv, ep: DBEpisode, policy: str, rng: random.Random, steps: list[float]) -> float:
    seen: list[str] = []
    for _ in range(ep.max_turns):
        call = env.oracle(ep) if policy == "oracle" else random_call(ep, rng, seen)
        t0 = time.perf_counter()
        r = ep.call(call)
        if call.name == "execute_sql":
            steps.append(time.perf_counter() - t0)
            rows = ep.db.execute(call.arguments["query"]).rows if policy == "random" else None
            seen += answers_from_rows(rows or [])
        if r.finish:
            return r.reward
    return 0.0


def bench_backend(name: str, cfg: EnvConfig, n_tasks: int, threads: int) -> dict[str, Any]:
    out: dict[str, Any] = {"backend": name}
    env = make_env(cfg)
    train, test = env.task_ids("train"), env.task_ids("test")
    ids = [("train", t) for t in train[:len(train) - len(test) // 2]]
    ids = [x for pair in zip(ids, [("test", t) for t in test], strict=False) for x in pair] + ids[len(test):]
    for split, tid in ids:
        env.task(tid, split)  # generation is per replica and cached: keep it out of reset latency
    rng = random.Random(0)
    reset: dict[int, list[float]] = {1: [], 2: [], 3: []}
    close: list[float] = []
    steps: list[float] = []
    oracle = {"train": [], "test": []}
    rand: list[float] = []
    for split, tid in track(ids[:n_tasks], "db tasks (oracle + random)", unit="tasks"):
        for policy in ("oracle", "random"):
            t0 = time.perf_counter()
            ep = env.open(tid, split, 0)
            reset[ep.task.level].append(time.perf_counter() - t0)
            reward = play(env, ep, policy, rng, steps)
            (oracle[split] if policy == "oracle" else rand).append(reward)
            t0 = time.perf_counter()
            ep.close()
            close.append(time.perf_counter() - t0)
    out.update(reset=reset, close=close, steps=steps, oracle=oracle, random=rand)

    # queries/s: one session alone, then `threads` sessions at once (the host runs each call in a thread)
    tid = env.task_ids("train")[0]
    queries = [f"SELECT COUNT(*) FROM `{t.name}`" for t in env.task(tid, "train").tables] + \
              [env.task(tid, "train").ref_sql if not env.task(tid, "train").modifies else "SELECT 1"]

    def hammer(seconds: float) -> int:
        ep = env.open(tid, "train", 0)
        n, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            ep.db.execute(queries[n % len(queries)])
            n += 1
        ep.close()
        return n

    out["qps_1"] = hammer(3.0) / 3.0
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        out[f"qps_{threads}"] = sum(pool.map(hammer, [3.0] * threads)) / 3.0
    # sessions held at once by one replica (max_sessions), opened concurrently
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        eps = list(pool.map(lambda i: env.open(ids[i % len(ids)][1], ids[i % len(ids)][0], 0),
                            range(cfg.max_sessions)))
    out["open_all_s"] = time.perf_counter() - t0
    for ep in eps:
        ep.close()
    env.close()

    if AGENTBENCH.exists():
        env = make_env(EnvConfig(sections={"db": DBTaskConfig(server=cfg.db.server, agentbench_file=str(AGENTBENCH))}))
        gold = wrong = sql_select = 0
        for tid in env.task_ids("dev"):
            task = env.task(tid, "dev")
            ep = env.open(tid, "dev", 0)
            res = ep.call(ToolCall("execute_sql", {"query": task.ref_sql}))
            answers = task.label or ["done"]
            gold += ep.call(ToolCall("commit_final_answer", {"answers": answers})).reward == 1.0
            ep.close()
            if not task.modifies:  # the dataset's sql.query, its result committed as the answer
                ep = env.open(tid, "dev", 0)
                rows = ep.db.execute(task.ref_sql).rows
                sql_select += ep.call(ToolCall("commit_final_answer", {
                    "answers": answers_from_rows(rows or [])})).reward == 1.0
                ep.close()
            ep = env.open(tid, "dev", 0)
            if task.modifies:
                ep.call(ToolCall("execute_sql", {"query": task.ref_sql}))
                t = task.tables[0]
                ep.call(ToolCall("execute_sql", {
                    "query": f"INSERT INTO `{t.name}` (`{t.column_names[0]}`) VALUES ('perturbed')"}))
                wrong += ep.call(ToolCall("commit_final_answer", {"answers": ["done"]})).reward == 0.0
            else:
                wrong += ep.call(ToolCall("commit_final_answer", {
                    "answers": [f"{a} perturbed" for a in task.label or []]})).reward == 0.0
            ep.close()
            del res
        n_mod = sum(env.task(t, "dev").modifies for t in env.task_ids("dev"))
        out["dev"] = dict(n=len(env.task_ids("dev")), gold=gold, wrong=wrong, select_sql=sql_select,
                          n_select=len(env.task_ids("dev")) - n_mod)
        env.close()
    return out


async def over_nats(cfg: EnvConfig, episodes: int, concurrency: int) -> dict[str, float]:
    """Oracle episodes through EnvHost + EnvClient on an embedded nats-server: start and step round trips."""
    from services.envs.host import EnvHost
    from shared.bus import connect, declare_topology
    from shared.config import JetRLConfig
    from shared.envapi import EnvClient
    from shared.natsd import EmbeddedNats
    from shared.subjects import Subjects

    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedNats(Path(tmp))
        full = JetRLConfig()
        full.nats.url, full.env = server.start(), cfg
        subjects = Subjects("benchdb" + uuid.uuid4().hex[:6])
        nc = await connect(full.nats, "bench")
        await declare_topology(nc.jetstream(), subjects, full.nats)
        env = make_env(cfg)
        ids = env.task_ids("train")
        for t in ids[:episodes]:
            env.task(t, "train")
        host = EnvHost(env, cfg, subjects, "bench-r1")
        service = await host.serve(nc, nc.jetstream())
        client = EnvClient(nc, subjects, "db")
        starts: list[float] = []
        steps: list[float] = []
        rewards: list[float] = []
        sem = asyncio.Semaphore(concurrency)

        async def one(tid: str) -> None:
            async with sem:
                sid = uuid.uuid4().hex
                t0 = time.perf_counter()
                started = await client.start(sid, tid, "train")
                starts.append(time.perf_counter() - t0)
                for _ in range(started.max_turns):
                    msg = await client.oracle(started.replica_id, sid)
                    t0 = time.perf_counter()
                    step = await client.interact(started.replica_id, sid, msg)
                    steps.append(time.perf_counter() - t0)
                    if step.finish:
                        rewards.append(step.reward)
                        return

        t0 = time.perf_counter()
        await asyncio.gather(*(one(ids[i % len(ids)]) for i in range(episodes)))
        wall = time.perf_counter() - t0
        await host.shutdown()
        await service.stop()
        await nc.close()
        server.stop()
    return {"start": med(starts), "start_p90": pct(starts, 0.9), "step": med(steps), "step_p90": pct(steps, 0.9),
            "episodes_per_s": episodes / wall, "success": sum(rewards) / max(1, len(rewards))}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--server", default="mysql://root@127.0.0.1:3306", help="MariaDB admin URL")
    ap.add_argument("--backends", default="sqlite,mariadb")
    ap.add_argument("--tasks", type=int, default=150, help="generated tasks played per policy")
    ap.add_argument("--threads", type=int, default=8, help="concurrent sessions for the throughput runs")
    ap.add_argument("--nats-episodes", type=int, default=64)
    args = ap.parse_args()
    setup_logging("bench-db", level="warning")  # the host's per-session lines would drown the report
    results, nats = [], {}
    for backend in args.backends.split(","):
        cfg = EnvConfig(num_train_tasks=max(args.tasks, 64), num_test_tasks=64, max_sessions=64,
                        sections={"db": DBTaskConfig(server=args.server if backend == "mariadb" else "")})
        results.append(bench_backend(backend, cfg, args.tasks, args.threads))
        nats[backend] = {c: asyncio.run(over_nats(cfg, args.nats_episodes, c)) for c in (1, args.threads)}

    print("| | " + " | ".join(r["backend"] for r in results) + " |")
    print("|---|" + "---|" * len(results))

    def row(label: str, fn: Any) -> None:
        print(f"| {label} | " + " | ".join(fn(r) for r in results) + " |")

    for lvl in (1, 2, 3):
        row(f"reset, level {lvl} (ms, median / p90)", lambda r, lvl=lvl: f"{ms(med(r['reset'][lvl]))} / "
                                                                         f"{ms(pct(r['reset'][lvl], 0.9))}")
    row("close (ms, median)", lambda r: ms(med(r["close"])))
    row("execute_sql step (ms, median / p90)", lambda r: f"{ms(med(r['steps']))} / {ms(pct(r['steps'], 0.9))}")
    row("queries/s, 1 session", lambda r: f"{r['qps_1']:.0f}")
    row(f"queries/s, {args.threads} sessions at once (one replica)", lambda r: f"{r[f'qps_{args.threads}']:.0f}")
    row("open 64 sessions at once (s)", lambda r: f"{r['open_all_s']:.2f}")
    row("oracle success, train / test", lambda r: f"{sum(r['oracle']['train']):.0f}/{len(r['oracle']['train'])} / "
                                                  f"{sum(r['oracle']['test']):.0f}/{len(r['oracle']['test'])}")
    row("random-policy success", lambda r: f"{sum(r['random']):.0f}/{len(r['random'])}")
    row("AgentBench dev: gold graded correct", lambda r: f"{r['dev']['gold']}/{r['dev']['n']}" if "dev" in r else "-")
    row("AgentBench dev: perturbed graded wrong", lambda r: f"{r['dev']['wrong']}/{r['dev']['n']}" if "dev" in r else "-")
    row("AgentBench dev: dataset `sql.query` result graded correct (SELECT)",
        lambda r: f"{r['dev']['select_sql']}/{r['dev']['n_select']}" if "dev" in r else "-")
    for c in (1, args.threads):
        row(f"over NATS, {c} at once: start round trip (ms, median / p90)",
            lambda r, c=c: f"{ms(nats[r['backend']][c]['start'])} / {ms(nats[r['backend']][c]['start_p90'])}")
        row(f"over NATS, {c} at once: interact round trip (ms, median / p90)",
            lambda r, c=c: f"{ms(nats[r['backend']][c]['step'])} / {ms(nats[r['backend']][c]['step_p90'])}")
        row(f"over NATS, {c} at once: oracle episodes/s (success)",
            lambda r, c=c: f"{nats[r['backend']][c]['episodes_per_s']:.1f} ({nats[r['backend']][c]['success']:.2f})")
    if len(results) == 2:
        a, b = results
        print(f"\nreset ratio {b['backend']}/{a['backend']} (all levels, medians): "
              f"{med(sum(b['reset'].values(), [])) / med(sum(a['reset'].values(), [])):.1f}x; "
              f"queries/s ratio {a['backend']}/{b['backend']}: {a['qps_1'] / b['qps_1']:.1f}x (1 session), "
              f"{a[f'qps_{args.threads}'] / b[f'qps_{args.threads}']:.1f}x ({args.threads} sessions)")


if __name__ == "__main__":
    main()
