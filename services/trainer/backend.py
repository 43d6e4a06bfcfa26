"""Where a step's gradients and optimizer step happen. The update (services/trainer/update.py) calls
only this protocol; ``TorchBackend`` is one process with torch's AdamW, and
services/trainer/deepspeed_backend.py is ZeRO over several ranks."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import structlog
import torch

from services.trainer.checkpoints import load_trained_weights, optimizer_state
from services.trainer.data_parallel import RankShare
from shared.config import TrainerConfig

log = structlog.get_logger()

TrainShare = Callable[[RankShare], dict[str, Any]]  # one rank's part of a step: its share -> the step's figures


class StepResult(NamedTuple):
    grad_norm: float  # before clipping
    applied: bool  # False: a non-finite gradient (or loss) on some rank, the weights stay as they were


class Backend(Protocol):
    rank: int
    world: int  # data-parallel ranks
    device: torch.device  # where the update's tensors go
    model: Any  # the module the update runs forward and backward
    optimizer: Any  # what a checkpoint keeps the state of (``state_dict()``)
    checkpoint_part: str  # an entry the backend adds to each checkpoint directory ("" = none)
    # every forward/backward pass takes part in collectives (ZeRO over several ranks): a pass with a
    # non-finite loss still runs, where one rank alone just leaves it out
    collective_passes: bool

    def zero_grad(self) -> None: ...

    def backward(self, loss: torch.Tensor) -> None:
        """This rank's part of the batch's loss (each rank divides by the whole batch's token count)."""
        ...

    def step(self, skip: bool) -> StepResult:
        """Clip and step (unless ``skip``: a non-finite loss on this rank)."""
        ...

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """``tensor`` summed (or ``op="max"``) over the ranks, in place."""
        ...

    def set_lr(self, lr: float) -> None: ...

    def applied_lr(self) -> float:
        """The learning rate the next optimizer step uses."""
        ...

    def run_share(self, shares: list[RankShare], checkpoint: Path | None, train: TrainShare) -> dict[str, Any]:
        """Rank 0: every rank trains its share (``shares[r]``) with ``train``; on a checkpoint step every
        rank also writes its own part into ``checkpoint``. This rank's figures."""
        ...

    def published_model(self) -> Any:
        """The full model to publish, checkpoint and export."""
        ...

    def restore(self, checkpoint: Path) -> None:
        """Weights and optimizer state of ``checkpoint``, on every rank."""
        ...

    def close(self) -> None:
        """The service is done: other ranks stop too."""
        ...


class TorchBackend:
    """One process: the model's own backward, torch's AdamW, clipping."""

    rank, world = 0, 1
    device = torch.device("cpu")
    checkpoint_part = ""
    collective_passes = False

    def __init__(self, model: Any, cfg: TrainerConfig) -> None:
        self.model, self.cfg = model, cfg
        self.optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=cfg.lr,
                                           betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, skip: bool) -> StepResult:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm))
        if not math.isfinite(grad_norm) or skip:
            return StepResult(grad_norm, False)
        self.optimizer.step()
        return StepResult(grad_norm, True)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        return tensor  # one rank holds the whole batch

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def applied_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def run_share(self, shares: list[RankShare], checkpoint: Path | None, train: TrainShare) -> dict[str, Any]:
        return train(shares[0])

    def published_model(self) -> Any:
        return self.model

    def restore(self, checkpoint: Path) -> None:
        load_trained_weights(self.model, checkpoint, self.cfg.lora_rank > 0)
        state = optimizer_state(checkpoint)
        if state.get("backend") == "deepspeed":  # ZeRO's state is in its shards: a fresh AdamW
            log.warning("trainer_optimizer_state_not_resumed", checkpoint=str(checkpoint), reason="written by deepspeed")
        else:
            self.optimizer.load_state_dict(state)

    def close(self) -> None:
        pass
