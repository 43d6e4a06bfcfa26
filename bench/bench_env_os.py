"""OS env benchmark: fidelity on AgentBench's tasks, oracle vs random on generated tasks, sandbox latency
and sessions per replica. Prints a markdown section per mode (paste into docs/benchmarks/os.md).

    python bench/bench_env_os.py agentbench [--workers 8]    # all 1,000 training tasks (+ dev)
    python bench/bench_env_os.py agentbench --test '/ab/data/os_interaction/data/*/*.json'   # AgentBench's layout
    python bench/bench_env_os.py generated  [--per-family 30]
    python bench/bench_env_os.py latency    [--n 50] [--backends bwrap,docker]
    python bench/bench_env_os.py sessions   [--levels 8,16,32,64]
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.envs.base import ToolCall  # noqa: E402
from services.envs.os_task import OSEnv, OSEpisode  # noqa: E402
from services.envs.os_task.config import OSTaskConfig
from shared.config import EnvConfig  # noqa: E402
from shared.log import setup_logging  # noqa: E402
from shared.progress import track  # noqa: E402

AGENTBENCH = Path(__file__).resolve().parent.parent.parent / "shared" / "agentbench" / "os_interaction"
RANDOM_SCRIPTS = ["ls", "pwd", "ls -la ~", "cat /etc/os-release", "find / -maxdepth 2 -type d | head", "whoami",
                  "ps aux", "df -h", "echo hello", "wc -l /etc/passwd", "ls /var/log", "id"]


def play_oracle(env: OSEnv, episode: OSEpisode) -> float:
    for _ in range(episode.max_turns):
        result = episode.call(env.oracle(episode))
        if result.finish:
            return result.reward
    return 0.0


def play_random(env: OSEnv, episode: OSEpisode, rng: random.Random) -> float:
    """Random commands, then a random short answer (or finish): the floor an untrained policy sees."""
    for turn in range(episode.max_turns):
        if turn < rng.randint(1, 6):
            episode.call(ToolCall("bash_action", {"script": rng.choice(RANDOM_SCRIPTS)}))
            continue
        if rng.random() < 0.5:
            return episode.call(ToolCall("finish_action", {"thought": "done"})).reward
        return episode.call(ToolCall("answer_action", {"answer": str(rng.randint(0, 10))})).reward
    return 0.0


def med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def bench_agentbench(args: argparse.Namespace) -> None:
    if args.train or args.test:  # entries as in env.os.agentbench_train / _test (FILE or GLOB[=SCRIPTS_DIR])
        train_entries, test_entries = args.train or [], args.test or []
    else:
        if not AGENTBENCH.is_dir():
            raise SystemExit(f"{AGENTBENCH} is not present: the AgentBench sweep needs ../shared/agentbench")
        train_entries = [str(AGENTBENCH / "train_0317" / "training.json")]
        test_entries = [str(AGENTBENCH / "data" / "dev.json")]
    if args.backends not in ("bwrap", "docker"):
        raise SystemExit(f"agentbench: --backends is one backend, bwrap or docker, got {args.backends!r}")
    env = OSEnv(EnvConfig(task="os", num_train_tasks=0, num_test_tasks=0, action_timeout_s=args.action_timeout,
                          sections={"os": OSTaskConfig(agentbench_train=train_entries, agentbench_test=test_entries,
                                                       backend=args.backends, docker_prefix=args.docker_prefix)}))
    if args.backends == "bwrap":
        env.rootfs("default")
    for task_id, reason in sorted(env.skipped.items()):
        print(f"  skipped {task_id}: {reason}", flush=True)

    def run(item: tuple[str, str]) -> tuple[str, float, float, float]:
        task_id, split = item
        t0 = time.monotonic()
        try:
            episode = env.open(task_id, split, 0)
        except Exception as exc:  # init failed: counts as a failure of the sandbox
            print(f"  {task_id}: open failed: {exc!r}"[:300], flush=True)
            return task_id, 0.0, 0.0, time.monotonic() - t0
        try:
            reward = play_oracle(env, episode)
            wrong = 0.0
            task = episode.task
            if task.wants_answer:  # gold +- 1 / gold + "1" / empty must fail
                gold = (episode.last_output or "").strip() if task.example is not None \
                    else str((task.match or {}).get("answer", ""))
                bad = [gold + "1", ""] + ([str(int(gold) + 1), str(int(gold) - 1)] if gold.lstrip("-").isdigit() else [])
                bad = [a for a in bad if a != gold]  # an empty gold (a few tasks print nothing) is no wrong answer
                accepted = [a for a in bad if episode.judge(a)[0]]
                wrong = float(bool(accepted))
                if accepted:
                    print(f"  {task_id}: wrong answer(s) {accepted!r} accepted; gold {gold!r}"[:300], flush=True)
            else:  # a task graded on the final state: finishing at once (nothing done) must fail
                fresh = env.open(task_id, split, 0)
                try:
                    wrong = float(fresh.call(ToolCall("finish_action", {"thought": "done"})).reward > 0)
                finally:
                    fresh.close()
                if wrong:
                    print(f"  {task_id}: finishing without doing anything is graded right", flush=True)
            if reward < 1.0:
                print(f"  {task_id}: reward {reward}, gold output {episode.last_output!r}"[:300], flush=True)
            if time.monotonic() - t0 > 60:
                print(f"  {task_id}: slow episode, {time.monotonic() - t0:.0f} s (open {episode.metrics.get('open_s', 0):.1f} s)",
                      flush=True)
            return task_id, reward, wrong, time.monotonic() - t0
        finally:
            episode.close()

    rows = []
    for split in ("train", "test"):
        ids = env.task_ids(split)
        t0 = time.monotonic()
        with ThreadPoolExecutor(args.workers) as pool:
            results = list(track(pool.map(run, [(t, split) for t in ids]), f"os agentbench {split}", len(ids), "tasks"))
        wall = time.monotonic() - t0
        by_file: dict[str, list[tuple[str, float, float, float]]] = {}
        for r in results:
            by_file.setdefault(r[0].rsplit("-", 1)[0], []).append(r)
        for prefix in sorted(set(by_file) | {k.rsplit("-", 1)[0] for k in env.skipped}):
            rs = by_file.get(prefix, [])
            skipped = sum(1 for k in env.skipped if k.rsplit("-", 1)[0] == prefix)
            rows.append((split, prefix, len(rs), skipped, sum(r[1] for r in rs), sum(r[2] for r in rs),
                         med([r[3] for r in rs])))
        failed = [r[0] for r in results if r[1] < 1.0]
        print(f"\n{split}: {len(ids)} tasks, wall {wall:.0f} s ({args.workers} workers)"
              + (f"; failed: {', '.join(failed)}" if failed else ""))
    print(f"\n### AgentBench OS files: init -> gold -> check in the {args.backends} sandbox\n")
    print("| split | file (id prefix) | tasks | skipped | oracle pass | pass rate | wrong graded right "
          "| median episode s |")
    print("|---|---|---|---|---|---|---|---|")
    for split, prefix, n, skipped, passed, wrong, median in rows:
        print(f"| {split} | {prefix} | {n} | {skipped} | {passed:.0f} | {passed / max(1, n):.1%} | {wrong:.0f} "
              f"| {median:.2f} |")
    n, passed, wrong = sum(r[2] for r in rows), sum(r[4] for r in rows), sum(r[5] for r in rows)
    print(f"| all | | {n} | {sum(r[3] for r in rows)} | {passed:.0f} | {passed / max(1, n):.1%} | {wrong:.0f} | |")
    env.close()


def bench_generated(args: argparse.Namespace) -> None:
    env = OSEnv(EnvConfig(task="os", num_train_tasks=0, num_test_tasks=args.per_family))
    env.rootfs("default")
    ids = env.task_ids("test")

    def run(task_id: str) -> tuple[str, float, float]:
        rng = random.Random(task_id)
        rewards = []
        for policy in ("oracle", "random"):
            episode = env.open(task_id, "test", 0)
            try:
                rewards.append(play_oracle(env, episode) if policy == "oracle" else play_random(env, episode, rng))
            finally:
                episode.close()
        return task_id, rewards[0], rewards[1]

    with ThreadPoolExecutor(args.workers) as pool:
        results = list(track(pool.map(run, ids), "os generated", len(ids), "tasks"))
    print(f"\n### Generated test split ({args.per_family} per family, levels 1-3)\n")
    print("| family | level | tasks | oracle success | random-policy success |")
    print("|---|---|---|---|---|")
    groups: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for task_id, oracle, rnd in results:
        task = env.tasks["test"][task_id]
        groups.setdefault((task.family, task.level), []).append((oracle, rnd))
    for (family, level), rs in sorted(groups.items()):
        print(f"| {family} | {level} | {len(rs)} | {sum(r[0] for r in rs) / len(rs):.0%} "
              f"| {sum(r[1] for r in rs) / len(rs):.0%} |")
    n = len(results)
    print(f"| **all** | | {n} | {sum(r[1] for r in results) / n:.1%} | {sum(r[2] for r in results) / n:.1%} |")
    env.close()


def bench_latency(args: argparse.Namespace) -> None:
    """Sequential sandbox and command latency; with several backends, iterations alternate between
    them so that they share the machine's load (a side-by-side ratio)."""
    backends = args.backends.split(",")
    envs = {b: OSEnv(EnvConfig(task="os", num_train_tasks=6, num_test_tasks=6,
                               sections={"os": OSTaskConfig(backend=b, docker_prefix=args.docker_prefix)})) for b in backends}
    if "bwrap" in envs:
        envs["bwrap"].rootfs("default")
    scripts = ["echo", "ls -la /etc | wc -l", "python3 -c 'print(1)'"]
    rows = ["sandbox start", "open a generated task (start + init + gold)", *[f"bash_action `{s}`" for s in scripts],
            "independent exec `true` (check scripts)", "sandbox close"]
    times: dict[tuple[str, str], list[float]] = {(b, r): [] for b in backends for r in rows}
    task_ids = envs[backends[0]].task_ids("train")
    for i in range(args.n):
        for b, env in envs.items():
            t0 = time.perf_counter()
            box = env.sandbox()
            times[b, rows[0]].append(time.perf_counter() - t0)
            for script, row in zip(scripts, rows[2:5], strict=True):
                t0 = time.perf_counter()
                box.shell(script, 5)
                times[b, row].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            box.exec(["true"], 5)
            times[b, rows[5]].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            box.close()
            times[b, rows[6]].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            env.open(task_ids[i % len(task_ids)], "train", 0).close()
            times[b, rows[1]].append(time.perf_counter() - t0)
    print(f"\n### Sandbox latency (median of {args.n}, sequential, backends alternating)\n")
    print("| what | " + " | ".join(f"{b} median ms | {b} p90 ms" for b in backends)
          + (f" | {backends[1]} / {backends[0]} (medians)" if len(backends) == 2 else "") + " |")
    print("|---|" + "---|---|" * len(backends) + ("---|" if len(backends) == 2 else ""))
    for row in rows:
        cells = []
        for b in backends:
            xs = sorted(times[b, row])
            cells.append(f"{med(xs) * 1e3:.1f} | {xs[int(0.9 * (len(xs) - 1))] * 1e3:.1f}")
        ratio = (f" | {med(times[backends[1], row]) / med(times[backends[0], row]):.1f}x"
                 if len(backends) == 2 else "")
        print(f"| {row.replace('|', chr(92) + '|')} | " + " | ".join(cells) + ratio + " |")
    for env in envs.values():
        env.close()


def bench_sessions(args: argparse.Namespace) -> None:
    """Open K sandboxes at once, each running a command every 0.5 s: per-command latency and memory
    as K grows. The replica's limit is the largest K whose p90 command latency stays under 1 s."""
    env = OSEnv(EnvConfig(task="os", num_train_tasks=6, num_test_tasks=6))
    env.rootfs("default")
    print("\n### Concurrent sessions on one replica (each runs `ls -la /etc | wc -l` every 0.5 s for 10 s)\n")
    print("| sessions | open all s | commands | median ms | p90 ms | sandbox RSS MiB (total) |")
    print("|---|---|---|---|---|---|")
    for k in [int(x) for x in args.levels.split(",")]:
        t0 = time.monotonic()
        with ThreadPoolExecutor(16) as pool:
            boxes = list(pool.map(lambda _: env.sandbox(), range(k)))
        opened = time.monotonic() - t0
        times: list[float] = []
        lock = threading.Lock()
        stop = time.monotonic() + 10

        def worker(box, stop: float = stop, lock: threading.Lock = lock, times: list[float] = times) -> None:  # noqa: ANN001
            while time.monotonic() < stop:
                t = time.perf_counter()
                box.shell("ls -la /etc | wc -l", 5)
                with lock:
                    times.append(time.perf_counter() - t)
                time.sleep(0.5)

        threads = [threading.Thread(target=worker, args=(b,)) for b in boxes]
        for t in threads:
            t.start()
        time.sleep(5)
        rss = sandbox_rss_mib(boxes)
        for t in threads:
            t.join()
        for b in boxes:
            b.close()
        times.sort()
        print(f"| {k} | {opened:.1f} | {len(times)} | {med(times) * 1e3:.0f} | {times[int(0.9 * (len(times) - 1))] * 1e3:.0f} "
              f"| {rss:.0f} |", flush=True)
    print(f"\nhost max RSS of this process: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    env.close()


def sandbox_rss_mib(boxes: list) -> float:
    total = 0
    for box in boxes:
        for pid in box.cgroup.pids():
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
            except OSError:
                pass
    return total / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=["agentbench", "generated", "latency", "sessions"])
    parser.add_argument("--workers", type=int, default=8)
    parser.add_argument("--action-timeout", type=float, default=10.0,
                        help="agentbench: env.action_timeout_s (commands get this less 2 s; checks their own bound)")
    parser.add_argument("--train", action="append", help="agentbench: a task file entry (FILE or GLOB[=SCRIPTS]) "
                                                         "for the train split; repeat; default ../shared's training.json")
    parser.add_argument("--test", action="append", help="agentbench: the same for the test split (default dev.json)")
    parser.add_argument("--per-family", type=int, default=30)
    parser.add_argument("--n", type=int, default=50)
    parser.add_argument("--levels", default="8,16,32,64")
    parser.add_argument("--backends", default="bwrap", help="latency: bwrap, docker, or bwrap,docker side by side; "
                                                              "agentbench: the one backend to run on")
    parser.add_argument("--docker-prefix", default="jetrl-os", help="docker images <prefix>/default, /packages")
    args = parser.parse_args()
    setup_logging("bench-os", "bench", "warning", "console")
    {"agentbench": bench_agentbench, "generated": bench_generated, "latency": bench_latency,
     "sessions": bench_sessions}[args.mode](args)


if __name__ == "__main__":
    main()
