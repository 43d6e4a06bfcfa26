"""The updates of one step, as functions over a backend (services/trainer/backend.py): the policy
update (decoupled PPO or PPO, optional KL to the reference) and the SFT update (cross-entropy on
demonstrations). Every rank runs the same code on its own share; what is a statistic of the whole
batch is all-reduced."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from services.trainer import rl
from services.trainer.backend import Backend
from services.trainer.batch import TrainBatch, context_mask, micro_batches, padding_pass, positions
from services.trainer.packing import packed_logprobs
from shared.config import TrainerConfig
from shared.lm import PackedLM
from shared.messages import Trajectory

log = structlog.get_logger()

Reference = Callable[[], AbstractContextManager[PackedLM]]  # the frozen policy the KL term is measured against


@contextmanager
def reference_policy(model: Any, ref_model: Any | None) -> Iterator[PackedLM]:
    """The frozen policy the run started from: a copy of it, or with LoRA the model with its adapter off."""
    if ref_model is not None:
        yield PackedLM(ref_model)
    else:
        with model.disable_adapter():
            yield PackedLM(model)


def learning_rate(cfg: TrainerConfig, step: int) -> float:
    """Linear warm-up to ``lr`` over ``warmup_steps`` optimizer steps of this run (``step`` taken so
    far), then constant."""
    if cfg.warmup_steps <= 0:
        return cfg.lr
    return cfg.lr * min(1.0, (step + 1) / cfg.warmup_steps)


@dataclass
class StepLedger:
    """What one training step did to the weights: whether an optimizer step really happened, and whether
    a non-finite loss or gradient made it skip (then the weights stay as they were, and it is counted in
    ``train/nonfinite_skipped``)."""

    step: int  # the number the step will have (for the log)
    counters: dict[str, float]
    stepped: bool = False
    nonfinite: bool = False

    @property
    def updated(self) -> bool:
        return self.stepped and not self.nonfinite

    def skip_nonfinite(self, what: str, backend: Backend) -> None:
        if not backend.collective_passes:  # else mid-pass gradients are ZeRO's, and DeepSpeed skips the step
            backend.zero_grad()
        if not self.nonfinite:
            self.counters["train/nonfinite_skipped"] += 1
            log.warning("nonfinite_step_skipped", step=self.step, what=what)
        self.nonfinite = True


def optimizer_step(backend: Backend, ledger: StepLedger) -> float:
    """Clip, step; the gradient norm before clipping (0 for a skipped step)."""
    result = backend.step(skip=ledger.nonfinite)
    if not result.applied:
        ledger.skip_nonfinite(f"gradient norm {result.grad_norm}", backend)
        return 0.0
    ledger.stepped = True
    return result.grad_norm


def policy_update(backend: Backend, cfg: TrainerConfig, batch: TrainBatch, ledger: StepLedger,
                  reference: Reference | None, lr: float) -> dict[str, Any]:
    lm = PackedLM(backend.model)
    chunks = batch.micro_batches
    # The proximal policy is the one before this batch's first update. With one optimizer step per
    # batch it is the current policy itself (detached), so no separate pass is needed.
    proximal: list[torch.Tensor | None] = [None] * len(chunks)
    ref_logp: list[torch.Tensor | None] = [None] * len(chunks)
    with torch.no_grad():
        if cfg.loss == "decoupled" and len(batch.minibatches) > 1:
            proximal = [packed_logprobs(lm, mb.packed, mb.temperature) for mb in chunks]
        if reference is not None:
            with reference() as ref:
                ref_logp = [packed_logprobs(ref, mb.packed, mb.temperature) for mb in chunks]

    backend.model.train()
    totals = torch.zeros(4, dtype=torch.float64)  # loss, clipped tokens, approx_kl, kl_ref: summed over ranks
    grad_norm = 0.0
    parts = len(batch.minibatches)
    k = 0  # micro-batch index over the whole batch
    for part, part_tokens in zip(batch.minibatches, batch.minibatch_tokens, strict=True):
        backend.zero_grad()
        for mb in part:
            logp = packed_logprobs(lm, mb.packed, mb.temperature)
            prox = proximal[k] if proximal[k] is not None else (logp.detach() if cfg.loss == "decoupled" else None)
            loss, st = rl.policy_loss(logp, mb.behaviour, mb.advantages, mb.weight, part_tokens,
                                      clip_eps=cfg.clip_eps, proximal_logp=prox, is_cap=cfg.is_cap,
                                      dual_clip=cfg.dual_clip or None)
            kl = torch.zeros(())
            if ref_logp[k] is not None:
                kl = (rl.kl_k3(logp, ref_logp[k]) * mb.weight).sum() / part_tokens
                loss = loss + cfg.kl_coef * kl
            k += 1
            if not math.isfinite(float(loss.detach())):
                ledger.skip_nonfinite(f"loss {float(loss.detach())}", backend)
                if not backend.collective_passes:
                    continue
                # the other ranks' passes wait for this one's collectives: run it; the step is skipped
            backend.backward(loss)
            totals += torch.tensor([float(loss.detach()) / parts, st["clipped"], st["approx_kl"],
                                    float(kl.detach()) / parts], dtype=torch.float64)
        grad_norm += optimizer_step(backend, ledger) / parts
    backend.model.eval()
    live = [mb for mb in chunks if bool(mb.weight.any())]
    counts = torch.tensor([sum(mb.packed.num_rows for mb in live), float(len(live)),
                           sum(len(t.tokens) for t in batch.trajs)], dtype=torch.float64)
    loss_sum, clipped, approx_kl, kl_ref = backend.all_reduce(totals).tolist()
    rows, num_micro_batches, unshared = backend.all_reduce(counts).tolist()
    return {"train/loss": loss_sum, "train/clipfrac": clipped / batch.num_tokens,
            "train/approx_kl": approx_kl / batch.num_tokens, "train/kl_ref": kl_ref, "train/grad_norm": grad_norm,
            "train/tokens": float(batch.num_tokens), "train/packed_rows": rows, "train/unshared_rows": unshared,
            "train/micro_batches": num_micro_batches, "train/lr": lr}


def sft_update(backend: Backend, cfg: TrainerConfig, demos: list[Trajectory], ledger: StepLedger,
               lr: float) -> dict[str, float]:
    """Cross-entropy on the assistant tokens of successful trajectories (oracle warm start); with
    ``sft_context_weight`` > 0 also on the context after the system message (task, tool results).
    ``demos`` is this rank's share (maybe none); the normaliser is the whole batch's token count."""
    lm = PackedLM(backend.model)
    backend.model.train()
    backend.zero_grad()
    own = [[int(m) for m in t.loss_mask] for t in demos]
    context_weight = cfg.sft_context_weight
    scored = [[int(x or y) for x, y in zip(o, context_mask(t), strict=True)] for o, t in zip(own, demos, strict=True)] \
        if context_weight > 0 else own
    num_tokens = int(backend.all_reduce(torch.tensor([float(sum(sum(o[1:]) for o in own))], dtype=torch.float64)))
    chunks = micro_batches(cfg, demos, scored) if demos else []
    passes = int(backend.all_reduce(torch.tensor([float(len(chunks))], dtype=torch.float64), op="max"))
    totals = torch.zeros(4, dtype=torch.float64)  # loss, context loss sum, context tokens, demos: over ranks
    for mb in chunks:
        logp = packed_logprobs(lm, mb, torch.ones(mb.targets.numel()))
        is_own = torch.cat([torch.tensor(own[i], dtype=torch.bool)[positions(scored[i])] for i in mb.order])
        # normalised by the assistant tokens alone: the context term adds to, never dilutes, the SFT loss
        loss = -(logp[is_own].sum() + context_weight * logp[~is_own].sum()) / num_tokens
        if not math.isfinite(float(loss.detach())):
            ledger.skip_nonfinite(f"loss {float(loss.detach())}", backend)
            if not backend.collective_passes:
                continue
        backend.backward(loss)
        totals += torch.tensor([float(-logp[is_own].detach().sum()) / num_tokens,
                                float(-logp[~is_own].detach().sum()), float((~is_own).sum()), 0.0],
                               dtype=torch.float64)
    for _ in range(passes - len(chunks)):  # a rank with fewer micro-batches keeps ZeRO's collectives in step
        pad = padding_pass()
        backend.backward(packed_logprobs(lm, pad.packed, pad.temperature).sum() * 0.0)
    totals[3] = float(len(demos))
    grad_norm = optimizer_step(backend, ledger)
    backend.model.eval()
    total, context_total, context_tokens, num_demos = backend.all_reduce(totals).tolist()
    stats = {"train/loss": total, "train/grad_norm": grad_norm, "train/tokens": float(num_tokens),
             "train/sft_trajectories": num_demos, "train/lr": lr}
    if context_tokens:
        stats["train/context_loss"] = context_total / context_tokens
    return stats
