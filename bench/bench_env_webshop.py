"""WebShop-like env benchmark: catalogue build (time, size, peak memory), replica memory, search latency,
policies on the frozen test split (oracle, WebShop's rule baseline, a random clicker), reset/step latency
and episodes/s per replica, in process and served over NATS.

    .venv/bin/python bench/bench_env_webshop.py [--env.data_dir=D] [--env.webshop.num_products=N]
    .venv/bin/python bench/bench_env_webshop.py --show=test-medium-00004   # one oracle episode, as text

Prints one JSON object; docs/benchmarks/webshop.md holds a run's figures.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
import weakref
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import structlog  # noqa: E402

from services.envs.base import ToolCall, ToolError  # noqa: E402
from services.envs.webshop import WebShopEnv, make_env  # noqa: E402
from services.envs.webshop.goals import DIFFICULTIES  # noqa: E402
from services.envs.webshop.shop import ShopEpisode  # noqa: E402
from shared.config import JetRLConfig, from_argv  # noqa: E402

PY = sys.executable
structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))  # one JSON on stdout


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def ms(x: float) -> float:
    return round(1000 * x, 2)


# ----------------------------------------------------------------------------------------------- #
# Build and memory, each in a fresh process
# ----------------------------------------------------------------------------------------------- #
def cold_build(num_products: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        out = subprocess.run([PY, "-m", "services.envs.webshop", f"--env.data_dir={tmp}",
                              f"--env.webshop.num_products={num_products}"], capture_output=True, text=True, check=True)
        wall = time.perf_counter() - t0
        info = json.loads(out.stdout.strip().splitlines()[-1])
    peak_mb = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {"products": info["products"], "build_s": round(info["seconds"], 2), "process_wall_s": round(wall, 2),
            "file_mb": round(info["bytes"] / 2**20, 1), "build_peak_rss_mb": round(peak_mb, 1)}


REPLICA_PROBE = """
import json, resource, sys
def rss():
    for line in open('/proc/self/status'):
        if line.startswith('VmRSS'):
            return int(line.split()[1]) / 1024
import services.envs.host, shared.bus, nats  # what a replica imports besides the task
base = rss()
from shared.config import from_argv
from services.envs.webshop import make_env
cfg, _ = from_argv(sys.argv[1:])
env = make_env(cfg.env)
ready = rss()
for tid in env.task_ids('test'):
    ep = env.open(tid, 'test', 0)
    while True:
        r = ep.call(env.oracle(ep))
        if r.finish:
            break
print(json.dumps({'imports_rss_mb': base, 'ready_rss_mb': ready, 'after_200_episodes_rss_mb': rss(),
                  'peak_rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def replica_memory(argv: list[str]) -> dict:
    out = subprocess.run([PY, "-c", REPLICA_PROBE, *argv], capture_output=True, text=True, check=True)
    return {k: round(v, 1) for k, v in json.loads(out.stdout.strip().splitlines()[-1]).items()}


# ----------------------------------------------------------------------------------------------- #
# Policies
# ----------------------------------------------------------------------------------------------- #
def rule_policy(ep: ShopEpisode) -> ToolCall:
    """WebShop's rule baseline: search the instruction, open the first result, buy."""
    if ep.page == "search":
        return ToolCall("search_action", {"keywords": ep.goal["instruction_text"]})
    if ep.page == "results" and ep.page_asins():
        return ToolCall("click_action", {"value": ep.page_asins()[0].lower()})
    if ep.page == "item":
        return ToolCall("click_action", {"value": "buy now"})
    return ToolCall("click_action", {"value": "back to search"})


def shopper_policy():
    """A careful scripted shopper that sees only pages (no target ASIN or title): search the goal's
    terms, open results in order, skip items whose price or options cannot meet the goal, read
    Features for the attributes, pick the options, buy; buy the last candidate when rounds run out."""
    state: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # per episode (ids get reused)

    def policy(ep: ShopEpisode) -> ToolCall:
        g = ep.goal
        s = state.setdefault(ep, {"tried": set(), "turn": 0, "checked": None})
        s["turn"] += 1
        last_chance = s["turn"] >= ep.max_turns - len(g["goal_options"]) - 1
        if ep.page == "search":
            return ToolCall("search_action", {"keywords": " ".join([*g["attributes"], g["type"]])})
        if ep.page == "results":
            for asin in ep.page_asins():
                if asin not in s["tried"]:
                    s["tried"].add(asin)
                    s["checked"] = None
                    return ToolCall("click_action", {"value": asin.lower()})
            return ToolCall("click_action", {"value": "next >" if "next >" in ep.clickables() else "back to search"})
        if ep.page == "sub":
            text = ep.observation().lower()
            s["checked"] = all(a in text or a in ep.product["title"].lower() for a in g["attributes"])
            return ToolCall("click_action", {"value": "< prev"})
        # item page: what a reader sees there (price tag, option buttons, title)
        low = float(ep.product["price_tag"].split()[0].lstrip("$"))
        fits = low <= g["price_upper"] and all(v in ep.clickables() for v in g["goal_options"].values())
        if fits and s["checked"] is None and not last_chance:
            return ToolCall("click_action", {"value": "features"})
        if (fits and s["checked"]) or last_chance:
            for name, value in g["goal_options"].items():
                if ep.options.get(name) != value and value in ep.clickables():
                    return ToolCall("click_action", {"value": value})
            return ToolCall("click_action", {"value": "buy now"})
        return ToolCall("click_action", {"value": "< prev"})
    return policy


def random_policy(rng: random.Random):
    def policy(ep: ShopEpisode) -> ToolCall:
        if ep.page == "search":
            words = ep.goal["instruction_text"].split()
            return ToolCall("search_action", {"keywords": " ".join(rng.sample(words, min(3, len(words))))})
        return ToolCall("click_action", {"value": rng.choice(ep.clickables())})
    return policy


def run_policy(env: WebShopEnv, policy, task_ids: list[str], split: str, timings: dict | None = None) -> dict:
    rewards: dict[str, list[float]] = {d: [] for d in DIFFICULTIES}
    turns: list[int] = []
    for tid in task_ids:
        t0 = time.perf_counter()
        ep = env.open(tid, split, 0)
        if timings is not None:
            timings["open"].append(time.perf_counter() - t0)
        reward, n = 0.0, 0
        for n in range(1, ep.max_turns + 1):  # noqa: B007 (n is the episode's turn count after the loop)
            call = policy(ep)
            t0 = time.perf_counter()
            try:
                result = ep.call(call)
            except ToolError:
                continue
            finally:
                if timings is not None:
                    timings[call.name].append(time.perf_counter() - t0)
            if result.finish:
                reward = result.reward
                break
        rewards[env.goal(tid, split)["difficulty"]].append(reward)
        turns.append(n)
    every = [r for rs in rewards.values() for r in rs]
    out = {"episodes": len(every), "mean_reward": round(statistics.mean(every), 3),
           "success_rate": round(sum(r >= 1.0 for r in every) / len(every), 3), "mean_turns": round(statistics.mean(turns), 2)}
    for d, rs in rewards.items():
        out[f"{d}_reward"] = round(statistics.mean(rs), 3)
        out[f"{d}_success"] = round(sum(r >= 1.0 for r in rs) / len(rs), 3)
    return out


# ----------------------------------------------------------------------------------------------- #
# Served over NATS
# ----------------------------------------------------------------------------------------------- #
async def over_nats(env: WebShopEnv, cfg: JetRLConfig, concurrency: int, episodes: int) -> dict:
    from services.envs.host import EnvHost
    from shared.bus import connect, declare_topology
    from shared.envapi import EnvClient
    from shared.natsd import EmbeddedNats
    from shared.subjects import Subjects

    with tempfile.TemporaryDirectory() as tmp:
        server = EmbeddedNats(tmp)
        cfg.nats.url = server.start()
        try:
            nc = await connect(cfg.nats, "bench")
            subjects = Subjects("bench" + uuid.uuid4().hex[:6])
            await declare_topology(nc.jetstream(), subjects, cfg.nats)
            host = EnvHost(env, cfg.env, subjects, "webshop-bench")
            service = await host.serve(nc, nc.jetstream())
            client = EnvClient(nc, subjects, "webshop", timeout_s=60)
            ids = env.task_ids("test")
            queue = list(range(episodes))
            rewards: list[float] = []

            async def worker() -> None:
                while queue:
                    i = queue.pop()
                    sid = uuid.uuid4().hex
                    started = await client.start(sid, ids[i % len(ids)], "test")
                    while True:
                        msg = await client.oracle(started.replica_id, sid)
                        step = await client.interact(started.replica_id, sid, msg)
                        if step.finish:
                            rewards.append(step.reward)
                            break

            t0, c0 = time.perf_counter(), time.process_time()
            await asyncio.gather(*(worker() for _ in range(concurrency)))
            wall, cpu = time.perf_counter() - t0, time.process_time() - c0
            await host.shutdown()
            await service.stop()
            await nc.close()
        finally:
            server.stop()
    # cpu: this process only (env + client); nats-server runs apart
    return {"concurrency": concurrency, "episodes": len(rewards), "episodes_per_s": round(len(rewards) / wall, 1),
            "episodes_per_cpu_s": round(len(rewards) / cpu, 1), "mean_reward": round(statistics.mean(rewards), 3)}


def show(env: WebShopEnv, task_id: str) -> None:
    """Print what the agent sees in one oracle episode of a test goal."""
    ep = env.open(task_id, "test", 0)
    print(ep.opening()[1]["content"])
    while True:
        call = env.oracle(ep)
        result = ep.call(call)
        print(f"\n-> {call.name}({json.dumps(call.arguments)})\n{result.content}")
        if result.finish:
            break


def main() -> None:
    shows = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--show=")]
    argv = [a for a in sys.argv[1:] if not a.startswith("--show=")]
    cfg, _ = from_argv(argv)
    if shows:
        show(make_env(cfg.env), shows[0])
        return
    results: dict = {"load_average_at_start": [round(x, 1) for x in os.getloadavg()], "cpus": os.cpu_count(),
                     "cold_build": cold_build(cfg.env.webshop.num_products)}
    t0 = time.perf_counter()
    env = make_env(cfg.env)  # warm: the cached file
    results["warm_start_s"] = round(time.perf_counter() - t0, 3)
    results["replica_memory"] = replica_memory(argv)

    # search latency: oracle-style key terms and instruction-style queries (what an LLM tends to type)
    train = env.task_ids("train")
    for name, queries in (("key_terms", [" ".join([*env.goal(t, "train")["attributes"], env.goal(t, "train")["type"]])
                                         for t in train]),
                          ("instruction", [env.goal(t, "train")["instruction_text"] for t in train])):
        for cache in ("cold", "cached"):
            lat, cpu = [], []
            for q in queries:
                t0, c0 = time.perf_counter(), time.thread_time()
                env.catalog.search(q)
                lat.append(time.perf_counter() - t0)
                cpu.append(time.thread_time() - c0)
            results[f"search_{name}_{cache}"] = {"queries": len(lat), "p50_ms": ms(pct(lat, 0.5)),
                                                 "p99_ms": ms(pct(lat, 0.99)), "cpu_p50_ms": ms(pct(cpu, 0.5)),
                                                 "cpu_p99_ms": ms(pct(cpu, 0.99))}
    # how findable the test targets are: in the top 50 (5 pages) / top 10 (page 1), by query style
    for name, make_query in (("key_terms", lambda g: " ".join([*g["attributes"], g["type"]])),
                             ("instruction", lambda g: g["instruction_text"])):
        ranks = []
        for t in env.task_ids("test"):
            g = env.goal(t, "test")
            hits = env.catalog.search(make_query(g))
            ranks.append(hits.index(g["asin"]) if g["asin"] in hits else None)
        results[f"target_recall_{name}"] = {"top10": round(sum(r is not None and r < 10 for r in ranks) / len(ranks), 3),
                                            "top50": round(sum(r is not None for r in ranks) / len(ranks), 3)}
    env.catalog._ranked.cache_clear()  # the policies below start with an empty query cache

    test = env.task_ids("test")
    timings: dict[str, list[float]] = {"open": [], "search_action": [], "click_action": []}
    t0, c0 = time.perf_counter(), time.process_time()
    results["oracle"] = run_policy(env, env.oracle, test, "test", timings)
    oracle_wall, oracle_cpu = time.perf_counter() - t0, time.process_time() - c0
    results["oracle"]["episodes_per_s_in_process"] = round(len(test) / oracle_wall, 1)
    results["oracle"]["episodes_per_cpu_s_in_process"] = round(len(test) / oracle_cpu, 1)
    results["rule"] = run_policy(env, rule_policy, test, "test")
    results["shopper"] = run_policy(env, shopper_policy(), test, "test")
    results["random"] = run_policy(env, random_policy(random.Random(0)), test, "test")
    results["latency_ms"] = {k: {"p50": ms(pct(v, 0.5)), "p99": ms(pct(v, 0.99))} for k, v in timings.items()}
    results["train_oracle_sample"] = run_policy(env, env.oracle, random.Random(1).sample(train, 150), "train")
    for conc in (1, 16):
        env.catalog._ranked.cache_clear()  # no head start from the in-process runs on the same goals
        results[f"nats_c{conc}"] = asyncio.run(over_nats(env, cfg, conc, 200))
    env.close()
    results["load_average_at_end"] = [round(x, 1) for x in os.getloadavg()]
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
