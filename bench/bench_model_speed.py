"""Training and sampling speed of one model on this machine (the cost rows of docs/benchmarks/learning.md).

    python bench/bench_model_speed.py [--model smollm2|tiny] [--hidden 256 --layers 4] [--dtype float32|bfloat16]

* ``train``: forward + backward + AdamW on one row of ``--tokens`` tokens, full logits (3 repeats);
* ``trainer``: the padded scoring path (bench/bench_trainer.py's baseline) (LM head on the last 100 positions of each row)
  forward and backward on ``--rows`` rows (4 repeats, the first is warm-up);
* ``sample``: 48 new tokens after a 600-token prompt at batch 1 and 8 (HF ``generate``).
Medians are printed; bf16 runs under CPU autocast.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.bench_trainer import padded_logprobs as token_logprobs  # the padded path, in an earlier version
from shared.config import ModelConfig
from shared.model import load_model, quiet_transformers, resolve_model


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="tiny")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--tokens", type=int, default=800)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    quiet_transformers()
    torch.set_num_threads(args.threads)
    cfg = ModelConfig(name=args.model, tiny_hidden_size=args.hidden, tiny_layers=args.layers, tiny_heads=4)
    model = load_model(resolve_model(cfg))
    dtype = getattr(torch, args.dtype)
    autocast = dict(device_type="cpu", dtype=dtype, enabled=dtype != torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    ids = torch.randint(0, 40000, (1, args.tokens))
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        with torch.autocast(**autocast):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
    print(f"train: one {args.tokens}-token row, full logits: median {statistics.median(times):.2f} s")
    rows = torch.randint(0, 40000, (args.rows, 700))
    trained = torch.zeros(args.rows, 699, dtype=torch.bool)
    trained[:, -100:] = True
    times = []
    for _ in range(4):
        t0 = time.perf_counter()
        with torch.autocast(**autocast):
            logp = token_logprobs(model, rows, torch.ones_like(rows), trained, torch.ones(args.rows))
        (-logp.mean()).backward()
        times.append(time.perf_counter() - t0)
    print(f"trainer: {args.rows} x 700 tokens, LM head on 100 a row: median {statistics.median(times[1:]):.2f} s")
    model.eval()
    for batch in (1, 8):
        prompt = torch.randint(0, 40000, (batch, 600))
        t0 = time.perf_counter()
        with torch.no_grad(), torch.autocast(**autocast):
            model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=48,
                           min_new_tokens=48, do_sample=True, pad_token_id=0)
        dt = time.perf_counter() - t0
        print(f"sample: batch {batch}, 48 tokens after 600: {dt:.2f} s, {batch * 48 / dt:.1f} tokens/s")


if __name__ == "__main__":
    main()
