"""Rollout engine and trainer step on the CPU, measured side by side in one run (medians of repeats).

    .venv/bin/python bench/bench_engine.py [--repeats 5] [--model tiny]

* HF engine: generated tokens/s for 1, 4 and 8 concurrent requests (the engine batches requests that
  arrive together), and the ratio to one request at a time.
* Trainer: one policy-gradient forward+backward over a batch shaped like agent trajectories (long
  prompts, few trained tokens), LM head on every position vs on the trained positions only.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from bench.bench_trainer import padded_logprobs as token_logprobs  # the padded path, in an earlier version
from services.rollout.engine import HFEngine
from shared.config import ModelConfig
from shared.model import load_model, load_tokenizer, quiet_transformers, resolve_model


async def engine_tokens_per_s(engine: HFEngine, prompt: list[int], concurrency: int, new_tokens: int) -> float:
    started = time.perf_counter()
    gens = await asyncio.gather(*[engine.generate(prompt, new_tokens, 1.0) for _ in range(concurrency)])
    return sum(len(g.tokens) for g in gens) / (time.perf_counter() - started)


def train_step_s(model, ids, attn, trained, full_logits: bool) -> float:
    started = time.perf_counter()
    temps = torch.ones(ids.shape[0])
    if full_logits:
        logits = model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)[trained]
    else:
        logp = token_logprobs(model, ids, attn, trained, temps)
    (-logp.mean()).backward()
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--new-tokens", type=int, default=32)
    args = parser.parse_args()
    quiet_transformers()
    torch.manual_seed(0)
    path = resolve_model(ModelConfig(name=args.model))
    tok = load_tokenizer(path)
    prompt = torch.randint(100, len(tok), (args.prompt_tokens,)).tolist()

    engine = HFEngine(path, "bench", [tok.convert_tokens_to_ids("<|im_end|>")], tok.pad_token_id, threads=1)
    print(f"# HF engine, {args.model}, prompt {args.prompt_tokens} tokens, {args.new_tokens} new, 1 thread")
    results: dict[int, list[float]] = {c: [] for c in (1, 4, 8)}

    async def run() -> None:
        await engine_tokens_per_s(engine, prompt, 1, 4)  # warm-up
        for _ in range(args.repeats):
            for c in results:  # interleaved, so load changes hit every setting alike
                results[c].append(await engine_tokens_per_s(engine, prompt, c, args.new_tokens))

    asyncio.run(run())
    engine.close()
    base = statistics.median(results[1])
    print("| concurrent requests | generated tokens/s (median) | ratio to 1 |")
    print("|---|---|---|")
    for c, values in results.items():
        print(f"| {c} | {statistics.median(values):.0f} | {statistics.median(values) / base:.2f} |")

    model = load_model(path)
    torch.set_num_threads(2)
    batch, length, trained_per_seq = 8, 768, 48
    ids = torch.randint(100, len(tok), (batch, length))
    attn = torch.ones_like(ids)
    trained = torch.zeros((batch, length - 1), dtype=torch.bool)
    trained[:, -trained_per_seq:] = True
    timings: dict[bool, list[float]] = {True: [], False: []}
    train_step_s(model, ids, attn, trained, False)  # warm-up
    for _ in range(args.repeats):
        for full in (True, False):
            timings[full].append(train_step_s(model, ids, attn, trained, full))
    full_s, sel_s = statistics.median(timings[True]), statistics.median(timings[False])
    print(f"\n# trainer forward+backward, batch {batch} x {length} tokens, {trained_per_seq} trained per sequence, "
          "2 threads")
    print("| LM head on | seconds (median) | ratio |")
    print("|---|---|---|")
    print(f"| every position | {full_s:.3f} | 1.00 |")
    print(f"| trained positions only | {sel_s:.3f} | {sel_s / full_s:.2f} |")


if __name__ == "__main__":
    main()
