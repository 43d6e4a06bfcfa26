"""MCP episode start latency, one session per episode vs a pool of shared sessions, against the stdio SQL tool
server the tests use (tests/servers/sql_tools.py): the time of ``env.open`` (the session, ``tools/list``,
the episode's tools) and of its ``close``, one episode after another.

    nice -n 10 .venv/bin/python bench/bench_env_mcp_pool.py --episodes 40   # docs/adapters/mcp.md

Prints a markdown table (medians and 90th percentiles, in milliseconds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.envs.base import ToolCall  # noqa: E402
from services.envs.mcp_tools import McpToolsConfig, McpToolsEnv  # noqa: E402

SERVER = [sys.executable, "-m", "tests.servers.sql_tools"]


def quantile(xs: list[float], q: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def measure(sessions: str, episodes: int, tasks_file: str) -> dict[str, list[float]]:
    env = McpToolsEnv(McpToolsConfig(server_command=SERVER, tasks_file=tasks_file, sessions=sessions), name="mcp")
    times: dict[str, list[float]] = {"start": [], "first call": [], "close": []}
    try:
        for _ in range(episodes):
            started = time.perf_counter()
            ep = env.open("add", "train", 0)
            opened = time.perf_counter()
            assert ep.call(ToolCall("execute_sql", {"query": "SELECT 1 + 1"})).content == "[(2,)]"
            called = time.perf_counter()
            ep.close()
            closed = time.perf_counter()
            times["start"].append((opened - started) * 1000)
            times["first call"].append((called - opened) * 1000)
            times["close"].append((closed - called) * 1000)
    finally:
        env.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=40)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tasks_file = Path(tmp) / "tasks.jsonl"
        tasks_file.write_text(json.dumps({"id": "add", "prompt": "What is 1 + 1?", "answer": "2"}) + "\n")
        results = {mode: measure(mode, args.episodes, str(tasks_file)) for mode in ("per_episode", "pooled")}
    print(f"{args.episodes} episodes, one after another (ms: median / p90)\n")
    print("| sessions | episode start | first call | close |")
    print("|---|---|---|---|")
    for mode, times in results.items():
        cells = [f"{statistics.median(times[k]):.1f} / {quantile(times[k], 0.9):.1f}" for k in times]
        print(f"| {mode} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
