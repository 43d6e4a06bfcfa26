"""KG on a user-supplied N-Triples graph (env.kg.ntriples) at scale: our own generated graph dumped to
N-Triples, loaded back through the loader, and our generated questions served from an AgentBench-format
file (their ``program`` removed, so the oracle replays their recorded ``actions`` as for AgentBench's own
questions). Prints a markdown table.

    .venv/bin/python bench/bench_kg_ntriples.py --questions 64
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import pyoxigraph as ox
import structlog

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.envs.kg import KGEnv, play  # noqa: E402
from services.envs.kg.graph import open_graph  # noqa: E402
from shared.config import EnvConfig  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--questions", type=int, default=64, help="test questions of our generator served as dev")
    args = ap.parse_args()
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    ours = KGEnv(EnvConfig(task="kg", num_train_tasks=0, num_test_tasks=args.questions))
    graph = open_graph()
    with tempfile.TemporaryDirectory() as tmp:
        nt, questions = Path(tmp) / "graph.nt", Path(tmp) / "questions.json"
        t0 = time.perf_counter()
        graph.store.dump(str(nt), format=ox.RdfFormat.N_TRIPLES, from_graph=ox.DefaultGraph())
        dump_s = time.perf_counter() - t0
        tasks = [{k: v for k, v in t.items() if k != "program"} for t in ours.tasks["test"]]
        questions.write_text(json.dumps(tasks))
        cfg = EnvConfig(task="kg", data_dir=str(Path(tmp) / "data"), num_train_tasks=0, num_test_tasks=0)
        cfg.kg.ntriples, cfg.kg.agentbench_file = str(nt), str(questions)
        t0 = time.perf_counter()
        env = KGEnv(cfg)
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        rewards = [play(env.open(q, "dev", 0), env.oracle).reward for q in env.task_ids("dev")]
        play_s = time.perf_counter() - t0
        same_vocab = set(env.graph.ontology["relations"]) == set(graph.ontology["relations"])
        print("| triples | N-Triples size | dump s | load + derive vocabulary s | relations derived = ours "
              "| attributes derived | questions | oracle (replayed actions) EM | s per question |")
        print("|---|---|---|---|---|---|---|---|---|")
        print(f"| {env.graph.meta['triples']:,} | {nt.stat().st_size / 2**20:.0f} MiB | {dump_s:.1f} | {load_s:.1f} "
              f"| {same_vocab} | {len(env.graph.ontology['attributes'])} (ours {len(graph.ontology['attributes'])}) "
              f"| {len(rewards)} | {sum(rewards):.0f}/{len(rewards)} | {play_s / max(1, len(rewards)):.3f} |")


if __name__ == "__main__":
    main()
