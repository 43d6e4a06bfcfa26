"""Decode speed of the continuous engine on long multi-turn episodes (alfworld's shape), engine settings
side by side in one run.

Every episode opens with the same system prompt (a task's opening, shared by reference) and then grows
turn by turn: the engine writes ``--gen`` tokens greedily, the "env" appends an observation of
``--obs`` tokens (fixed per episode and turn, seeded), until the context reaches ``--context`` tokens.
``--episodes`` run at once, as a rollout replica runs them. The workload is the same for every setting;
what differs is how the engine lays out the keys/values. Reported per setting: wall time, sampled
tokens/s, prompt tokens encoded (``prefilled``) and sealed into shared segments (``sealed``).

    .venv/bin/python bench/bench_long_context.py --settings slot1024,slot4096 [--repeats 2]

A setting is ``slot<N>`` (``rollout.continuous.kv_slot_tokens`` = N), ``slot<N>-bf16`` with bf16 matmuls
(``rollout.continuous.matmul_dtype``); the resident KV budget is sized so
that no running or waiting episode is evicted in either (``--episodes`` x the context, plus the opening).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from services.rollout.continuous import ContinuousEngine  # noqa: E402
from shared.config import ModelConfig  # noqa: E402
from shared.model import load_tokenizer, resolve_model  # noqa: E402

OPENING = ("Interact with a household to solve a task. Imagine you are an intelligent agent in a household "
           "environment and your target is to perform actions to complete the task goal. ")


async def episode(engine: ContinuousEngine, opening: list[int], vocab: list[int], index: int,
                  args: argparse.Namespace) -> int:
    rng = random.Random(index)
    prompt = list(opening) + [rng.choice(vocab) for _ in range(args.obs)]
    sampled = 0
    while len(prompt) + args.gen + args.obs <= args.context:
        gen = await engine.generate(prompt, args.gen, 0.0)
        sampled += len(gen.tokens)
        prompt += list(gen.tokens) + [rng.choice(vocab) for _ in range(args.obs)]
    return sampled


async def run_setting(setting: str, model_path: Path, opening: list[int], vocab: list[int],
                      args: argparse.Namespace) -> dict[str, float]:
    slots, _, dtype = setting.partition("-")
    slot_tokens = int(slots.removeprefix("slot"))
    cache_tokens = (args.episodes + 1) * max(args.context, slot_tokens) + len(opening)
    engine = ContinuousEngine(model_path, f"bench-{setting}", stop_token_ids=[], threads=args.threads,
                              max_batch=max(64, args.episodes), slot_tokens=slot_tokens, cache_tokens=cache_tokens,
                              max_context=args.context + args.gen,
                              matmul_dtype="bfloat16" if dtype == "bf16" else "float32")
    try:
        started = time.perf_counter()
        sampled = await asyncio.gather(*(episode(engine, opening, vocab, i, args) for i in range(args.episodes)))
        wall = time.perf_counter() - started
    finally:
        engine.close()
    stats = engine.stats
    return {"wall_s": wall, "sampled": sum(sampled), "tok_s": sum(sampled) / wall,
            "prefilled": stats.prefilled_tokens, "sealed": stats.sealed_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--settings", default="slot1024,slot4096")
    parser.add_argument("--episodes", type=int, default=16)
    parser.add_argument("--context", type=int, default=3000, help="an episode ends when its context reaches this")
    parser.add_argument("--gen", type=int, default=16, help="tokens generated each turn (greedy, no stop token)")
    parser.add_argument("--obs", type=int, default=150, help="tokens of each observation")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=1, help="rounds over the settings; the table shows medians")
    args = parser.parse_args()
    torch.manual_seed(0)
    model_path = resolve_model(ModelConfig(name=args.model))
    tok = load_tokenizer(model_path)
    opening = tok.encode(OPENING * 6, add_special_tokens=False)  # ~200 tokens, as long as alfworld's instruction
    vocab = [i for i in tok.encode(OPENING * 2 + "a shelf, a cabinet 1, a countertop 2, a drawer 3, the fridge",
                                   add_special_tokens=False)]
    settings = args.settings.split(",")
    runs: dict[str, list[dict[str, float]]] = {s: [] for s in settings}
    for _ in range(args.repeats):
        for s in settings:  # interleaved: a slow spell of the machine falls on every setting
            runs[s].append(asyncio.run(run_setting(s, model_path, opening, vocab, args)))
            r = runs[s][-1]
            print(f"  {s}: {r['wall_s']:.1f} s, {r['tok_s']:.1f} sampled tok/s", flush=True)
    print(f"\n{args.episodes} episodes to {args.context} tokens, {args.gen} generated + {args.obs} observed a turn, "
          f"{args.threads} threads; medians of {args.repeats}")
    print("| setting | wall s | sampled tok/s | sampled | prefilled | sealed |\n|---|---|---|---|---|---|")
    base = None
    for s in settings:
        med = {k: statistics.median(r[k] for r in runs[s]) for k in runs[s][0]}
        base = base or med["tok_s"]
        print(f"| {s} | {med['wall_s']:.1f} | {med['tok_s']:.1f} ({med['tok_s'] / base:.2f}x) | {med['sampled']:.0f} "
              f"| {med['prefilled']:.0f} | {med['sealed']:.0f} |")


if __name__ == "__main__":
    main()
