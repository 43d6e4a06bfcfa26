"""Trainer seconds per group of 8 db episodes, today's path and the new ones side by side in one run.

    .venv/bin/python bench/bench_trainer.py [--model smollm2] [--groups 2] [--repeats 3]

Trajectories are real db episodes as the rollout renders them (the env's opening in the compact tool
format, the oracle's tool calls and the env's answers, token for token), ``--group-size`` per task
instance; each member's assistant turns are cut or extended by up to 30 % so that lengths differ as
sampled episodes do. Variants, each one RL step (advantages from rewards 0/1 within each group):

* ``padded+proximal, full`` — the path in an earlier version (copied below as the baseline): padded
  micro-batches, every trajectory runs its whole opening, a second forward pass for the proximal
  logprobs, every parameter trained;
* ``shared prefix, full`` — ``Trainer.optimise`` with ``trainer.shared_prefix`` and no redundant pass;
* ``shared prefix, LoRA r`` — the same with ``trainer.lora_rank`` (only the adapter trains).

Medians of ``--repeats`` steps after one warm-up step.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from services.envs.db import make_env  # noqa: E402
from services.trainer import rl  # noqa: E402
from services.trainer.trainer import Trainer  # noqa: E402
from shared.chat import render_observation, render_opening, render_tool_call  # noqa: E402
from shared.config import EnvConfig, ModelConfig, TrainerConfig  # noqa: E402
from shared.messages import EpisodeStatus, Trajectory, TurnInfo  # noqa: E402
from shared.model import load_model, load_tokenizer, quiet_transformers, resolve_model  # noqa: E402
from shared.subjects import Subjects  # noqa: E402


def db_trajectories(tokenizer: Any, groups: int, group_size: int, seed: int = 0) -> list[Trajectory]:
    env_cfg = EnvConfig()
    env_cfg.db.levels = [1]
    env = make_env(env_cfg)
    rng = random.Random(seed)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    enc = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    out = []
    for g, task_id in enumerate(env.task_ids("train")[:groups]):
        for i in range(group_size):
            ep = env.open(task_id, "train", 0)
            tokens = enc(render_opening(ep.opening(), ep.tools, "compact"))
            mask, turns = [0] * len(tokens), []
            for _ in range(ep.max_turns):
                call = env.oracle(ep)
                message = {"content": call.content, "tool_calls": [
                    {"function": {"name": call.name, "arguments": json.dumps(call.arguments)}}]}
                own = enc(render_tool_call(message))
                keep = max(4, int(len(own) * rng.uniform(0.7, 1.3)))
                own = (own * 2)[:keep] + [end]
                turns.append(TurnInfo(start=len(tokens), end=len(tokens) + len(own), engine_id="bench", policy_version=0))
                tokens += own
                mask += [1] * len(own)
                result = ep.call(call)
                if result.finish:
                    break
                obs = enc(render_observation([{"role": "tool", "content": result.content}]))
                tokens += obs
                mask += [0] * len(obs)
            ep.close()
            out.append(Trajectory(episode_id=f"g{g}-{i}", group_id=f"g{g}", task="db", task_id=task_id, split="train",
                                  group_size=group_size, tokens=tokens, logprobs=[-1.0 if m else 0.0 for m in mask],
                                  loss_mask=mask, prompt_len=turns[0].start, turns=turns, reward=float(i % 2),
                                  status=EpisodeStatus.COMPLETED, replica_id="bench"))
    return out


# ---------------------------------------------------------------------------------- the baseline path
def padded_logprobs(model: Any, ids: torch.Tensor, attn: torch.Tensor, trained: torch.Tensor,
                    temps: torch.Tensor) -> torch.Tensor:
    """The trainer's scoring in an earlier version: padded rows, LM head on the trained positions."""
    hidden = model.get_decoder()(input_ids=ids, attention_mask=attn).last_hidden_state[:, :-1]
    logits = model.get_output_embeddings()(hidden[trained]).float()
    temp = temps[:, None].expand_as(trained)[trained]
    return torch.log_softmax(logits / temp[:, None], dim=-1).gather(-1, ids[:, 1:][trained].unsqueeze(-1)).squeeze(-1)


def baseline_step(model: Any, optimizer: torch.optim.Optimizer, trajs: list[Trajectory], max_tokens: int) -> None:
    """One step as the trainer did it in an earlier version (decoupled PPO, one minibatch)."""
    seq_adv = rl.group_advantages(torch.tensor([t.reward for t in trajs]), [t.group_id for t in trajs])
    token_adv = torch.cat([seq_adv[i].repeat(sum(t.loss_mask[1:])) for i, t in enumerate(trajs)])
    chunks: list[list[Trajectory]] = []
    width = 0
    for t in trajs:  # consecutive chunks whose padded size stays under max_tokens
        if chunks and max(width, len(t.tokens)) * (len(chunks[-1]) + 1) <= max_tokens:
            chunks[-1].append(t)
            width = max(width, len(t.tokens))
        else:
            chunks.append([t])
            width = len(t.tokens)
    padded = []
    for chunk in chunks:
        w = max(len(t.tokens) for t in chunk)
        ids = torch.zeros((len(chunk), w), dtype=torch.long)
        attn, mask = torch.zeros_like(ids), torch.zeros_like(ids)
        behaviour = torch.zeros((len(chunk), w))
        for i, t in enumerate(chunk):
            ids[i, : len(t.tokens)] = torch.tensor(t.tokens)
            attn[i, : len(t.tokens)] = 1
            mask[i, : len(t.tokens)] = torch.tensor(t.loss_mask)
            behaviour[i, : len(t.tokens)] = torch.tensor(t.logprobs)
        padded.append((ids, attn, mask, behaviour, torch.ones(len(chunk))))
    with torch.no_grad():
        proximal = [padded_logprobs(model, ids, attn, mask[:, 1:].bool(), temps) for ids, attn, mask, _, temps in padded]
    total = int(token_adv.numel())
    optimizer.zero_grad(set_to_none=True)
    offset = 0
    for (ids, attn, mask, behaviour, temps), prox in zip(padded, proximal, strict=True):
        trained = mask[:, 1:].bool()
        logp = padded_logprobs(model, ids, attn, trained, temps)
        n = logp.numel()
        loss, _ = rl.policy_loss(logp, behaviour[:, 1:][trained], token_adv[offset: offset + n], torch.ones(n), total,
                                 proximal_logp=prox)
        loss.backward()
        offset += n
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()


def timed(fn: Any, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--groups", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--micro-batch-tokens", type=int, default=4096)
    args = parser.parse_args()
    quiet_transformers()
    torch.set_num_threads(args.threads)
    path = resolve_model(ModelConfig(name=args.model))
    trajs = db_trajectories(load_tokenizer(path), args.groups, args.group_size)
    rows = sum(len(t.tokens) for t in trajs)
    trained = sum(sum(t.loss_mask[1:]) for t in trajs)
    print(f"# {args.groups} groups x {args.group_size} db episodes: {rows} tokens, {trained} trained, "
          f"{args.threads} threads, model {args.model}", flush=True)
    results: dict[str, float] = {}

    model = load_model(path)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    results["padded+proximal, full (before)"] = timed(
        lambda: baseline_step(model, optimizer, trajs, args.micro_batch_tokens * 2), args.repeats)
    print(f"baseline: {results['padded+proximal, full (before)']:.1f} s", flush=True)
    model = optimizer = None  # free the full-size optimizer state before the next variant
    with tempfile.TemporaryDirectory() as tmp:
        for name, lora in (("shared prefix, full", 0), (f"shared prefix, LoRA r{args.lora_rank}", args.lora_rank)):
            cfg = TrainerConfig(lr=1e-6, lora_rank=lora, micro_batch_tokens=args.micro_batch_tokens)
            trainer = Trainer(None, None, Subjects("bench"), cfg, load_model(path), Path(tmp), "bench")  # type: ignore[arg-type]
            stats: dict[str, Any] = {}
            results[name] = timed(lambda t=trainer: stats.update(t.optimise(trajs)[0]), args.repeats)  # noqa: B023
            print(f"{name}: {results[name]:.1f} s ({stats.get('train/packed_rows', 0):.0f} packed rows)", flush=True)
    base = results["padded+proximal, full (before)"]
    print("\n| trainer path | s per step | s per group of 8 | speed-up |\n|---|---|---|---|")
    for name, s in results.items():
        print(f"| {name} | {s:.1f} | {s / args.groups:.1f} | {base / s:.2f}x |")


if __name__ == "__main__":
    main()
