"""ALFWorld env benchmark: generation rate and expert yield, oracle vs random success per task type through
the env, reset latency with and without the engine pool, steps/s, memory per session and its growth.

    python bench/bench_env_alfworld.py --per-type 200 --episodes 200 --out bench/results/alfworld.json
    python bench/bench_env_alfworld.py --stages expert --expert-n 10 --workers 2   # expert win rate per type/scene

Stages run in order and share one data dir (``--data-dir``, default: a fresh temporary one, so the
generation figures are cold). Every figure is a median unless it says otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from services.envs.alfworld_env import AlfworldEnv, gen
from services.envs.alfworld_env.config import AlfworldTaskConfig
from services.envs.alfworld_env.pool import EnginePool, EngineProc
from services.envs.base import ToolCall
from shared.config import EnvConfig
from shared.progress import track


def cpu_seconds() -> float:
    """CPU time of the whole machine (the box is shared: wall time alone says little)."""
    fields = Path("/proc/stat").read_text().split("\n")[0].split()[1:]
    user, nice, system = (int(x) for x in fields[:3])
    return (user + nice + system) / os.sysconf("SC_CLK_TCK")


def loadavg() -> float:
    return float(Path("/proc/loadavg").read_text().split()[0])


def stage_generation(a: argparse.Namespace) -> dict[str, Any]:
    """Build the train catalogue (games written, translated, expert-checked)."""
    t0, c0 = time.perf_counter(), cpu_seconds()
    cat = gen.build_catalogue("train", a.per_type, a.data_dir, 20, a.workers)
    wall = time.perf_counter() - t0
    tried = sum(s["tried"] for k, s in cat["stats"].items() if k != "build_s")
    accepted = sum(s["accepted"] for k, s in cat["stats"].items() if k != "build_s")
    # writing a game alone (no engine): the generator itself
    ids = [gen.candidate_id(gen.candidates("test", tt), j) for tt in gen.TASK_TYPES for j in range(20)]
    t1 = time.perf_counter()
    for task_id in ids:
        gen.build_game(task_id)
    build_only = len(ids) / (time.perf_counter() - t1)
    return {"per_type": a.per_type, "workers": a.workers, "wall_s": wall, "cpu_s_machine": cpu_seconds() - c0,
            "candidates": tried, "accepted": accepted, "accepted_per_s": accepted / wall,
            "candidates_per_s": tried / wall, "games_written_per_s_one_core": build_only,
            "yield_within_20_rounds": {k: s["expert_won"] / max(1, s["accepted"]) for k, s in cat["stats"].items()
                                       if k != "build_s"},
            "mean_expert_steps": {k: s["mean_expert_steps"] for k, s in cat["stats"].items() if k != "build_s"}}


def stage_expert(a: argparse.Namespace) -> dict[str, Any]:
    """The handcoded expert's win rate within 20 rounds on generated games, per task type and per scene:
    ``--expert-n`` games per task type and split (the first of the catalogue's seeded order, trial 0 of
    each tuple), none left out. Prints two markdown tables."""
    from services.envs.alfworld_env.pool import engine_context

    if a.agentbench:  # AgentBench's own (type, object, receptacle, scene) tuples, the first --expert-n of each type
        from services.envs.alfworld_env import agentbench_task_ids

        jobs = []
        for ids in agentbench_task_ids(Path(a.agentbench)).values():
            valid = [t for t in ids if gen.parse_task_id(t)[0] in set(gen.valid_tuples(gen.parse_task_id(t)[0][3]))]
            jobs += [(str(gen.data_root(a.data_dir)), t, 20) for t in valid[:a.expert_n]]
    else:
        jobs = [(str(gen.data_root(a.data_dir)), gen.candidate_id(gen.candidates(split, tt), j), 20)
                for split in ("train", "test") for tt in gen.TASK_TYPES for j in range(a.expert_n)]
    t0 = time.perf_counter()
    with engine_context().Pool(a.workers, maxtasksperchild=20) as pool:
        results = list(pool.imap(gen.verify, jobs))
    by_type: dict[tuple[str, str], list[tuple[bool, bool]]] = {}
    by_scene: dict[tuple[str, int], list[tuple[bool, bool]]] = {}
    for (_, task_id, _), res in zip(jobs, results, strict=True):
        (task_type, _, _, scene), _ = gen.parse_task_id(task_id)
        split = gen.split_of(scene)
        by_type.setdefault((split, task_type), []).append((res["won"], res["planner_won"]))
        by_scene.setdefault((split, scene), []).append((res["won"], res["planner_won"]))

    def cell(w: list[tuple[bool, bool]], k: int) -> str:
        n = sum(x[k] for x in w)
        return f"{n} ({n / len(w):.0%})"

    print("\n| split | task type | games | expert wins within 20 rounds | planner wins within 20 rounds |")
    print("|---|---|---|---|---|")
    for (split, tt), w in sorted(by_type.items()):
        print(f"| {split} | {tt} | {len(w)} | {cell(w, 0)} | {cell(w, 1)} |")
    total = [x for ws in by_type.values() for x in ws]
    print(f"| all | | {len(total)} | {cell(total, 0)} | {cell(total, 1)} |")
    print("\n| split | scene | games | expert wins | planner wins |\n|---|---|---|---|---|")
    for (split, scene), w in sorted(by_scene.items()):
        print(f"| {split} | {scene} | {len(w)} | {sum(x[0] for x in w)} | {sum(x[1] for x in w)} |")
    return {"games": len(jobs), "won": sum(x[0] for x in total), "planner_won": sum(x[1] for x in total),
            "wall_s": time.perf_counter() - t0,
            "by_type": {f"{sp}/{tt}": [sum(x[0] for x in w), sum(x[1] for x in w), len(w)]
                        for (sp, tt), w in by_type.items()},
            "by_scene": {f"{sp}/{sc}": [sum(x[0] for x in w), sum(x[1] for x in w), len(w)]
                         for (sp, sc), w in by_scene.items()}}


def play(env: AlfworldEnv, task_id: str, policy: str, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    t0 = time.perf_counter()
    episode = env.open(task_id, "train", seed)
    opened = time.perf_counter() - t0
    steps, reward, status, t1 = 0, 0.0, "task_limit_reached", time.perf_counter()
    try:
        for _ in range(episode.max_turns):
            call = env.oracle(episode) if policy == "oracle" else \
                ToolCall("take_action", {"action": rng.choice(episode.last.admissible)})
            result = episode.call(call)
            steps += 1
            if result.finish:
                reward, status = result.reward, result.status
                break
    finally:
        episode.close()
    return {"task_id": task_id, "policy": policy, "reward": reward, "status": status, "steps": steps,
            "open_s": opened, "step_s": (time.perf_counter() - t1) / max(steps, 1)}


def stage_episodes(a: argparse.Namespace) -> dict[str, Any]:
    """Oracle and random admissible-action policy on the first ``episodes`` catalogue games per type."""
    cfg = EnvConfig(task="alfworld", num_train_tasks=a.per_type, num_test_tasks=0, data_dir=a.data_dir,
                    max_sessions=a.sessions, sections={"alfworld": AlfworldTaskConfig(pool_size=a.sessions, prefetch=0)})
    env = AlfworldEnv(cfg)
    out: dict[str, Any] = {"sessions": a.sessions}
    try:
        ids = {tt: env.catalogue["train"]["tasks"][tt][: a.episodes] for tt in gen.TASK_TYPES}
        policies = a.policies.split(",")
        jobs = [(t, pol, i) for tt in gen.TASK_TYPES for i, t in enumerate(ids[tt])
                for pol in policies]  # random right after oracle: the game is ready in the pool
        t0, c0 = time.perf_counter(), cpu_seconds()
        with ThreadPoolExecutor(a.sessions) as ex:
            results = list(ex.map(lambda j: play(env, *j), jobs))
        wall = time.perf_counter() - t0
        steps = sum(r["steps"] for r in results)
        out.update(wall_s=wall, cpu_s_machine=cpu_seconds() - c0, episodes=len(results), steps=steps,
                   steps_per_s=steps / wall, pool=env.pool.health())
        for pol in policies:
            rs = [r for r in results if r["policy"] == pol]
            out[pol] = {tt: {"games": len([r for r in rs if r["task_id"].startswith(tt)]),
                             "success": statistics.mean(r["reward"] for r in rs if r["task_id"].startswith(tt)),
                             "mean_steps": statistics.mean(r["steps"] for r in rs if r["task_id"].startswith(tt))}
                        for tt in gen.TASK_TYPES}
            out[pol]["all"] = statistics.mean(r["reward"] for r in rs)
        out["step_latency_ms_median"] = 1000 * statistics.median(r["step_s"] for r in results)
    finally:
        env.close()
    return out


def stage_latency(a: argparse.Namespace) -> dict[str, Any]:
    """Start latency of a session: ALFWorld's way (new engine, translate), with the translation cache,
    and from the pool (a ready game); and one game's reset in a warm engine."""
    root = gen.data_root(a.data_dir)
    ids = [gen.candidate_id(gen.candidates("train", tt), j) for tt in gen.TASK_TYPES for j in range(a.latency_n)]
    paths = {t: str(gen.write_game(root, t)) for t in ids}
    res: dict[str, list[float]] = {"no_pool_no_cache_new_process": [], "translation_cache_warm_process": [],
                                   "pool_hit": [], "reset_same_game": []}
    cold = EnginePool(max_procs=2, sas_cache="", recycle_after=1)  # every start: a new process, no cache
    for t in ids:
        t0 = time.perf_counter()
        proc, _ = cold.acquire(t, paths[t])
        res["no_pool_no_cache_new_process"].append(time.perf_counter() - t0)
        cold.release(proc)
    cold.close()
    warm = EnginePool(max_procs=4, sas_cache=str(root / "sas"), recycle_after=10**6)
    proc, _ = warm.acquire(ids[0], paths[ids[0]])
    warm.release(proc)
    for t in ids:
        t0 = time.perf_counter()
        proc, _ = warm.acquire(t, paths[t])
        res["translation_cache_warm_process"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        proc.call("reset", timeout_s=60)
        res["reset_same_game"].append(time.perf_counter() - t0)
        warm.release(proc)
        proc.done.wait(60)
        t0 = time.perf_counter()
        proc2, _ = warm.acquire(t, paths[t])
        res["pool_hit"].append(time.perf_counter() - t0)
        warm.release(proc2)
        proc2.done.wait(60)
    warm.close()
    return {"games": len(ids), **{k: {"median_s": statistics.median(v), "max_s": max(v)} for k, v in res.items()}}


def stage_memory(a: argparse.Namespace) -> dict[str, Any]:
    """RSS of one engine process as it loads game after game (the leak recycling bounds)."""
    root = gen.data_root(a.data_dir)
    ids = [gen.candidate_id(gen.candidates("train", tt), j) for j in range(a.memory_n // 6 + 1)
           for tt in gen.TASK_TYPES][: a.memory_n]
    proc = EngineProc(str(root / "sas"))
    proc.start()
    rss = [proc.call("rss", timeout_s=60)]
    for t in ids:
        proc.call("load", str(gen.write_game(root, t)), t, timeout_s=120)
        for _ in range(5):
            proc.call("step", "look", timeout_s=60)
        rss.append(proc.call("rss", timeout_s=60))
    proc.stop()
    return {"games": len(ids), "rss_mb_empty": rss[0], "rss_mb_after_1": rss[1], "rss_mb_after_10": rss[min(10, len(ids))],
            "rss_mb_after_all": rss[-1], "growth_mb_per_game": (rss[-1] - rss[1]) / max(len(ids) - 1, 1)}


CPU_PROBE = """
import json, statistics, sys, time
from services.envs.alfworld_env import engine
games, sas = json.loads(sys.argv[1]), sys.argv[2]
def cpu(fn):
    t = time.process_time(); out = fn(); return time.process_time() - t, out
res = {k: [] for k in ("load", "reset", "step")}
for mode in ("stock", "fast"):
    if mode == "fast":
        engine.memoize_text_parsing(); engine.cache_translations(sas)
    for path, task_id, cmds in games:
        g = engine.Game()
        dt, _ = cpu(lambda: g.load(path, task_id)); res["load"].append((mode, dt))
        if mode == "fast":  # the same game in a new engine: the translation comes from the cache
            g = engine.Game(); dt, _ = cpu(lambda: g.load(path, task_id)); res["load"].append(("fast_cached", dt))
        dt, _ = cpu(g.reset); res["reset"].append((mode, dt))
        for c in cmds[:6]:
            dt, _ = cpu(lambda: g.step(c)); res["step"].append((mode, dt))
print(json.dumps({k: {m: statistics.median(d for mm, d in v if mm == m) for m in {mm for mm, _ in v}}
                  for k, v in res.items()}))
"""


def stage_cpu(a: argparse.Namespace) -> dict[str, Any]:
    """CPU seconds (not wall: the machine is shared) of a load, a reset and a step, on the stock engine
    and with this env's text and translation caches, one game per task type, in a fresh process."""
    import subprocess
    import sys

    from services.envs.alfworld_env import engine

    root = gen.data_root(a.data_dir)
    engine.memoize_text_parsing()
    engine.cache_translations(str(root / "sas"))
    games = []
    for tt in gen.TASK_TYPES:
        task_id = gen.candidate_id(gen.candidates("train", tt), 0)
        path = gen.write_game(root, task_id)
        games.append((str(path), task_id, engine.play_expert(str(path), task_id, 20)[1]))
    sas = tempfile.mkdtemp(prefix="jetrl-alfworld-sas-")  # cold translation cache for the probe
    out = subprocess.run([sys.executable, "-c", CPU_PROBE, json.dumps(games), sas], capture_output=True, text=True,
                         check=True, cwd=Path(__file__).resolve().parent.parent)
    return {"games": len(games), "cpu_s_median": json.loads(out.stdout.strip().splitlines()[-1])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--per-type", type=int, default=200, help="catalogue games per task type (train split)")
    ap.add_argument("--episodes", type=int, default=200, help="oracle and random episodes per task type")
    ap.add_argument("--sessions", type=int, default=4, help="concurrent sessions in the episode stage")
    ap.add_argument("--workers", type=int, default=4, help="processes building the catalogue")
    ap.add_argument("--latency-n", type=int, default=3, help="games per task type in the latency stage")
    ap.add_argument("--memory-n", type=int, default=60, help="games loaded into one process in the memory stage")
    ap.add_argument("--data-dir", default="", help="cache root; empty = a fresh temporary directory")
    ap.add_argument("--policies", default="oracle,random", help="policies played in the episode stage")
    ap.add_argument("--stages", default="generation,episodes,latency,memory,cpu",
                    help="also: expert (the expert's win rate per task type and scene, --expert-n games each)")
    ap.add_argument("--expert-n", type=int, default=10, help="games per task type and split in the expert stage")
    ap.add_argument("--agentbench", default="", help="expert stage: sample AgentBench's train_valid.json tuples")
    ap.add_argument("--out", default="bench/results/alfworld.json")
    a = ap.parse_args()
    a.data_dir = a.data_dir or tempfile.mkdtemp(prefix="jetrl-alfworld-bench-")
    out: dict[str, Any] = {"args": vars(a), "cpus": os.cpu_count(), "loadavg_start": loadavg()}
    stop = threading.Event()
    loads: list[float] = []

    def sample_load() -> None:
        while not stop.wait(5):
            loads.append(loadavg())

    threading.Thread(target=sample_load, daemon=True).start()
    path = Path(a.out)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stage in track(a.stages.split(","), "alfworld bench stages", unit="stages"):
        t0 = time.perf_counter()
        out[stage] = globals()[f"stage_{stage}"](a)
        out[stage]["stage_wall_s"] = time.perf_counter() - t0
        out["loadavg_median"] = statistics.median(loads) if loads else loadavg()
        path.write_text(json.dumps(out, indent=1))
        print(json.dumps({stage: out[stage]}, indent=1), flush=True)
    stop.set()


if __name__ == "__main__":
    main()
