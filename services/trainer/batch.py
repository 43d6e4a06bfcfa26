"""A step's batch: which trajectories train and how (rank 0's plan: staleness weights, group advantages,
minibatches, each rank's share), and a share as micro-batches of per-token tensors (every rank).

See services/trainer/data_parallel.py for why the plan is split this way across ranks.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from services.trainer import rl
from services.trainer.data_parallel import RankShare, ShareItem, split_contiguous
from services.trainer.packing import PackedBatch, pack, plan_micro_batches, prefix_order, shareable_length
from services.trainer.records import ADV_HIST_RANGE, batch_stats
from shared.config import TrainerConfig
from shared.messages import EpisodeStatus, Trajectory

AllReduce = Callable[..., torch.Tensor]  # (tensor, op="sum" | "max") -> the tensor reduced over the ranks


def trainable(traj: Trajectory) -> bool:
    """A trajectory a step can learn from: no env error, and trained tokens."""
    return traj.status != EpisodeStatus.ENV_ERROR and sum(traj.loss_mask) > 0


def rl_trainable(traj: Trajectory) -> bool:
    """An RL step trains on a trainable trajectory whose turns all come from a policy: oracle turns
    (version -1) have no behaviour logprobs to correct with."""
    return trainable(traj) and all(turn.policy_version >= 0 for turn in traj.turns)


@dataclass
class MicroBatch:
    """One forward/backward pass: a packed micro-batch and, per trained token in its layout, the
    advantage, behaviour logprob, sampling temperature and loss weight (0 in a padding pass)."""

    packed: PackedBatch
    advantages: torch.Tensor
    behaviour: torch.Tensor
    temperature: torch.Tensor
    weight: torch.Tensor


@dataclass
class TrainBatch:
    """What one rank trains on in one RL step: its share of the batch (all of it on one rank) as
    micro-batches, grouped into minibatches (one optimizer step each). ``minibatch_tokens`` counts the
    trained tokens of each minibatch over every rank: the loss normaliser."""

    trajs: list[Trajectory]
    minibatches: list[list[MicroBatch]]  # one list per optimizer step
    minibatch_tokens: list[int]
    num_tokens: int  # trained tokens of the whole batch, every rank

    @property
    def micro_batches(self) -> list[MicroBatch]:
        return [mb for part in self.minibatches for mb in part]


def plan_step(cfg: TrainerConfig, trajs: list[Trajectory], step: int, policy_version: int, world: int,
              lr: float) -> tuple[list[RankShare], dict[str, Any]]:
    """Rank 0's part of a step (services/trainer/data_parallel.py): what needs whole groups (the
    staleness filter, group advantages, the minibatch of each trajectory), then each minibatch's
    trajectories cut, in prefix order, into one run per rank of about equal packed rows. Also the
    batch's own statistics."""
    stats: dict[str, Any] = batch_stats(trajs, policy_version)
    shares = [RankShare("idle", step, policy_version) for _ in range(world)]
    if cfg.mode == "sft":  # demonstrations, split like an RL minibatch (one optimizer step)
        demos = [ShareItem(t) for t in trajs if trainable(t) and t.reward >= cfg.sft_min_reward]
        if not demos:
            return shares, stats | {"train/sft_trajectories": 0.0}
        shares = [RankShare("sft", step, policy_version, items=dealt) for dealt in deal(cfg, demos, world)]
        return shares, stats | _balance(shares)
    usable = [t for t in trajs if rl_trainable(t)]
    lag = [policy_version - t.min_policy_version for t in usable]
    weights = rl.staleness_weights(lag, [t.task for t in usable], cfg.max_staleness, cfg.staleness_mode,
                                   cfg.staleness_downweight)
    stats["train/stale_dropped"] = float(sum(w == 0.0 for w in weights))
    stats["train/stale_downweighted"] = float(sum(0.0 < w < 1.0 for w in weights))
    # Group statistics use every usable trajectory; dropped ones then contribute no tokens.
    advantages = rl.group_advantages(torch.tensor([t.reward for t in usable]), [t.group_id for t in usable]).tolist()
    kept = [ShareItem(t, a, w) for t, a, w in zip(usable, advantages, weights, strict=True) if w > 0]
    if not kept:
        return shares, stats
    if cfg.kl_coef == 0 and not any(item.advantage != 0 for item in kept):
        # Every group all-success or all-failure: the policy gradient is exactly zero. An AdamW step
        # would still move every weight along its old momentum, so there is no step at all.
        stats.update({"train/skipped_update": 1.0, "train/grad_norm": 0.0, "train/loss": 0.0,
                      "train/tokens": float(sum(len(trained_positions(item.traj)) for item in kept)),
                      "train/lr": lr})
        return shares, stats
    # The minibatches (optimizer steps) are those of one rank on the whole batch: every
    # ``minibatches``-th micro-batch of its plan.
    plan = micro_batch_plan(cfg, [item.traj for item in kept])
    num_minibatches = min(cfg.minibatches, len(plan))
    for k, order in enumerate(plan):
        for i in order:
            kept[i].minibatch = k % num_minibatches
    tasks = sorted({item.traj.task for item in kept})
    shares = [RankShare("rl", step, policy_version, num_minibatches=num_minibatches, tasks=tasks)
              for _ in range(world)]
    for m in range(num_minibatches):
        for share, dealt in zip(shares, deal(cfg, [it for it in kept if it.minibatch == m], world), strict=True):
            share.items.extend(dealt)
    return shares, stats | _balance(shares)


def deal(cfg: TrainerConfig, items: list[ShareItem], world: int) -> list[list[ShareItem]]:
    """``items`` in prefix order, cut into ``world`` contiguous runs of about equal packed rows."""
    trajs = [item.traj for item in items]
    if cfg.shared_prefix:
        ordered = prefix_order([t.tokens for t in trajs], [shareable_length(t.tokens, t.loss_mask) for t in trajs])
    else:  # each adds all of its rows
        ordered = [(i, len(t.tokens)) for i, t in enumerate(trajs)]
    dealt = split_contiguous([rows for _, rows in ordered], world)
    return [[items[ordered[p][0]] for p in picks] for picks in dealt]


def rl_batch(cfg: TrainerConfig, share: RankShare, all_reduce: AllReduce, stats: dict[str, Any]) -> TrainBatch:
    """This rank's trained tokens: advantages normalised per task with the whole batch's sums,
    micro-batches per minibatch, padded to the most passes any rank makes. Adds the advantages'
    per-task figures (over the whole batch) to ``stats``."""
    trajs = share.trajs
    trained = [trained_positions(t) for t in trajs]
    counts = [len(p) for p in trained]
    code = {task: k for k, task in enumerate(share.tasks)}
    token_adv = _cat([torch.full((n,), item.advantage) for item, n in zip(share.items, counts, strict=True)])
    token_code = _cat([torch.full((n,), code[t.task]) for t, n in zip(trajs, counts, strict=True)]).long()
    sums = all_reduce(rl.task_norm_sums(token_adv, token_code, len(share.tasks)))
    normalised = rl.task_normalize_with(token_adv, token_code, sums, cfg.task_norm)
    # Reported by rank 0, over the whole batch: per task a histogram (bins of 0.6 over [-3, 3]) and
    # the tokens whose sign normalisation changed (or that it gave a sign), summed over the ranks.
    flipped = ((normalised * token_adv) < 0) | ((normalised != 0) & (token_adv == 0))
    seen = torch.zeros(len(share.tasks), 11, dtype=torch.float64)
    for k in range(len(share.tasks)):
        sel = token_code == k
        seen[k, :10] = torch.histc(normalised[sel], bins=10, min=ADV_HIST_RANGE[0], max=ADV_HIST_RANGE[1])
        seen[k, 10] = float(flipped[sel].sum())
    seen = all_reduce(seen)
    for k, task in enumerate(share.tasks):
        count, total, squares, _ = sums[k].tolist()
        mean = total / max(count, 1.0)
        stats[f"task/{task}/adv_mean_raw"] = mean
        stats[f"task/{task}/adv_std_raw"] = math.sqrt(max(squares / max(count, 1.0) - mean * mean, 0.0))
        stats[f"task/{task}/adv_hist"] = [int(x) for x in seen[k, :10].tolist()]
    stats["train/adv_sign_flipped"] = float(seen[:, 10].sum())
    token_weight = _cat([torch.full((n,), item.weight) for item, n in zip(share.items, counts, strict=True)])
    advantages = list((normalised * token_weight).split(counts))
    behaviour = [torch.tensor(t.logprobs, dtype=torch.float32)[p] for t, p in zip(trajs, trained, strict=True)]
    temperature = [t.temperature if t.temperature > 0 else 1.0 for t in trajs]

    members = [[i for i, item in enumerate(share.items) if item.minibatch == m] for m in range(share.num_minibatches)]
    plans = [[[group[j] for j in order] for order in micro_batch_plan(cfg, [trajs[i] for i in group])]
             for group in members]
    # ZeRO's collectives run inside each forward/backward pass: every rank makes as many as the busiest
    passes = all_reduce(torch.tensor([len(p) for p in plans], dtype=torch.float64), op="max")
    tokens = all_reduce(torch.tensor([sum(counts[i] for i in g) for g in members], dtype=torch.float64))
    seqs, marks = [t.tokens for t in trajs], [t.loss_mask for t in trajs]
    minibatches: list[list[MicroBatch]] = []
    for plan, need in zip(plans, passes.tolist(), strict=True):
        part = []
        for order in plan:
            packed = pack(seqs, marks, order, share=cfg.shared_prefix)
            part.append(MicroBatch(packed, torch.cat([advantages[i] for i in order]),
                                   torch.cat([behaviour[i] for i in order]), _per_token(temperature, packed),
                                   torch.ones(packed.targets.numel())))
        part.extend(padding_pass() for _ in range(int(need) - len(plan)))
        minibatches.append(part)
    return TrainBatch(trajs=trajs, minibatches=minibatches, minibatch_tokens=[int(n) for n in tokens.tolist()],
                      num_tokens=int(tokens.sum()))


def micro_batch_plan(cfg: TrainerConfig, trajs: list[Trajectory],
                     context: list[list[int]] | None = None) -> list[list[int]]:
    """Micro-batches (lists of indices into ``trajs``) of at most ``micro_batch_tokens`` packed rows,
    prefix-sharing neighbours together; ``context`` marks the tokens scored (default: the trained ones)."""
    seqs = [t.tokens for t in trajs]
    marks = context if context is not None else [t.loss_mask for t in trajs]
    shareable = [shareable_length(s, m) for s, m in zip(seqs, marks, strict=True)]
    return plan_micro_batches(seqs, shareable, cfg.micro_batch_tokens)


def micro_batches(cfg: TrainerConfig, trajs: list[Trajectory], scored: list[list[int]]) -> list[PackedBatch]:
    """Prefix-shared micro-batches of at most ``micro_batch_tokens`` packed rows, scoring ``scored``."""
    seqs = [t.tokens for t in trajs]
    return [pack(seqs, scored, order, share=cfg.shared_prefix) for order in micro_batch_plan(cfg, trajs, scored)]


def positions(marks: list[int]) -> list[int]:
    """Trained positions (token ``t`` scored from the hidden state of ``t - 1``, so never 0), in the
    order ``services.trainer.packing.pack`` lays their logprobs out."""
    return [t for t in range(1, len(marks)) if marks[t]]


def trained_positions(traj: Trajectory) -> list[int]:
    return positions(traj.loss_mask)


def context_mask(traj: Trajectory) -> list[int]:
    """Tokens after the system message that the agent did not write: the user's task and every tool
    result. ChatML opens each message with the same token, so the system message ends where the
    first token occurs again; the system prompt itself (the same in every episode) is left out."""
    out = [0] * len(traj.tokens)
    try:
        start = traj.tokens.index(traj.tokens[0], 1)
    except (ValueError, IndexError):
        return out
    for i in range(start, len(traj.tokens)):
        out[i] = int(traj.loss_mask[i] == 0)
    return out


def padding_pass() -> MicroBatch:
    """A pass that changes no gradient (weight 0 on its one token), for a rank with fewer micro-batches
    than the others in a minibatch, or none: its collectives keep in step with theirs."""
    packed = pack([[0, 0]], [[0, 1]], [0])
    zero = torch.zeros(1)
    return MicroBatch(packed, zero, zero, torch.ones(1), zero)


def _balance(shares: list[RankShare]) -> dict[str, float]:
    """How even a split is: the fewest and most tokens a rank runs (several ranks only)."""
    if len(shares) < 2:
        return {}
    loads = [sum(len(t.tokens) for t in share.trajs) for share in shares]
    return {"train/rank_tokens_min": float(min(loads)), "train/rank_tokens_max": float(max(loads))}


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat`` that also takes no parts (a rank whose share is empty)."""
    return torch.cat(parts) if parts else torch.zeros(0)


def _per_token(values: list[float], mb: PackedBatch) -> torch.Tensor:
    """One value per trajectory, repeated over its trained tokens in the micro-batch's layout."""
    return torch.cat([torch.full((n,), float(values[i])) for i, n in zip(mb.order, mb.trained_per_traj, strict=True)])
