"""DeepSpeed trainer backend (ZeRO 1/2/3): the same ``Trainer`` and update, data-parallel over several ranks.

Launch it with either launcher; every rank runs the same entry point (without one, as under
``jetrl up``, it is a single rank; ``jetrl up --trainer-ranks N`` starts it under torchrun)::

    torchrun --nproc_per_node N -m services.trainer --trainer.backend=deepspeed [--trainer.deepspeed.zero_stage=3]
    deepspeed --num_gpus N --module services.trainer --trainer.backend=deepspeed

Rank 0 is the trainer service: NATS intake, dynamic batches, weight broadcast, checkpoints, metrics.
The other ranks never touch NATS; they follow rank 0 over torch.distributed, one step at a time:

1. rank 0 plans the step (``batch.plan_step``: group advantages, minibatches) and scatters each rank
   its share of the batch: whole trajectories, a contiguous run of the prefix order balanced by packed
   tokens (services/trainer/data_parallel.py);
2. every rank trains on its share (``Trainer.train_share``) under its DeepSpeed engine, with the task
   normalisation sums and each minibatch's token count all-reduced, so the ranks' averaged gradients
   are the gradient of one rank on the whole batch; ``backward`` and ``step`` are DeepSpeed's;
3. on a checkpoint step every rank writes its ZeRO shards (optimizer state) into the checkpoint
   directory beside rank 0's full weights; a restarted trainer resumes from both on every rank;
4. under ZeRO-3 every rank takes part in gathering the full parameters, and rank 0 copies them into a
   full CPU model, which is what it publishes and checkpoints (ZeRO 1/2 keep full parameters anyway).

ZeRO splits optimizer state (1), gradients (2) and parameters (3) across ranks, so a model too big
for one device trains on several; data parallelism makes N ranks train a batch about N times faster
where the ranks have their own cores or devices (docs/benchmarks/trainer_ranks.md).

On the CPU it runs over gloo (``DS_BUILD_OPS=0``; DeepSpeed JIT-compiles its shared-memory comm op on
the first start, about a minute, then it is cached); on GPUs over NCCL. Checkpoint shards are written
by every rank into rank 0's run directory: ranks on several hosts need it on a shared filesystem.
"""

from __future__ import annotations

import copy
import math
import os
import socket
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import structlog
import torch

from services.trainer.backend import StepResult, TrainShare
from services.trainer.data_parallel import RankShare
from services.trainer.trainer import Trainer
from services.trainer.update import StepLedger
from shared.config import JetRLConfig, TrainerConfig
from shared.subjects import Subjects

log = structlog.get_logger()


def ds_config(cfg: TrainerConfig) -> dict[str, Any]:
    """The DeepSpeed config for a ``TrainerConfig``: the plain trainer's AdamW and clipping, ZeRO on top
    (``[trainer.deepspeed]``, its stage and dtype checked where the config is loaded)."""
    return {
        # Batching is the trainer's (token-budget micro-batches); DeepSpeed only sees one "sample" a pass.
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": cfg.max_grad_norm,
        # torch's own AdamW: the same update as the plain backend, and no fused op to compile.
        "optimizer": {"type": "AdamW", "params": {"lr": cfg.lr, "betas": list(cfg.betas), "eps": 1e-8,
                                                  "weight_decay": cfg.weight_decay, "torch_adam": True}},
        "zero_optimization": {"stage": cfg.deepspeed.zero_stage},
        "bf16": {"enabled": cfg.deepspeed.dtype == "bfloat16"},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


class _ShardedOptimizer:
    """What a checkpoint asks of ``backend.optimizer``; the engine owns the real one."""

    def __init__(self, stage: int) -> None:
        self.stage = stage

    def state_dict(self) -> dict[str, Any]:
        # The optimizer state is in the ZeRO shards beside trainer_state.pt (CHECKPOINT_TAG); this marks it.
        return {"backend": "deepspeed", "zero_stage": self.stage}


CHECKPOINT_TAG = "deepspeed"
"""ZeRO shards of a checkpoint: ``<run>/checkpoints/step_N/deepspeed/`` (DeepSpeed's own layout)."""


def torch_optimizer(engine: Any) -> torch.optim.Optimizer:
    """The torch optimizer that takes the step under DeepSpeed's wrappers (ZeRO's keep it as ``.optimizer``)."""
    opt = engine.optimizer
    while not isinstance(opt, torch.optim.Optimizer) and getattr(opt, "optimizer", None) is not None:
        opt = opt.optimizer
    return opt


class DeepSpeedBackend:
    """The backend protocol (services/trainer/backend.py) over a DeepSpeed engine, on every rank: its
    gradients and optimizer step are the engine's, its statistics all-reduced over torch.distributed."""

    checkpoint_part = CHECKPOINT_TAG

    def __init__(self, model: Any, cfg: TrainerConfig) -> None:
        import deepspeed
        import torch.distributed as dist
        from deepspeed.accelerator import get_accelerator

        self.cfg = cfg
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.collective_passes = self.world > 1
        self.device = torch.device(get_accelerator().current_device_name())
        # ZeRO-3 keeps 1/world of each parameter per rank: rank 0 gathers into this full copy for publishing
        # (copied before deepspeed.initialize partitions the model).
        self._full = copy.deepcopy(model).to("cpu", torch.float32).eval() \
            if cfg.deepspeed.zero_stage == 3 and self.rank == 0 else None
        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                    config=ds_config(cfg))
        self.model = self.engine.module  # the HF model itself: the update calls its decoder and LM head
        self.optimizer = _ShardedOptimizer(cfg.deepspeed.zero_stage)
        self._pending: torch.Tensor | None = None
        log.info("deepspeed_ready", rank=self.rank, world=self.world, zero_stage=cfg.deepspeed.zero_stage,
                 dtype=cfg.deepspeed.dtype, device=str(self.device))

    # ------------------------------------------------------------------ what the update calls
    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def backward(self, loss: torch.Tensor) -> None:
        # The ranks' gradients are averaged (ZeRO): each rank's share of the sum, times the ranks.
        if self.world > 1:
            loss = loss * self.world
        # DeepSpeed must know which backward is the last before the step (that one reduces the gradients);
        # the update does not say, so each backward runs one call late, as a non-final pass.
        if self._pending is not None:
            self.engine.set_gradient_accumulation_boundary(False)
            self._engine_backward(self._pending)
        self._pending = loss

    def step(self, skip: bool) -> StepResult:
        if self._pending is not None:
            self.engine.set_gradient_accumulation_boundary(True)
            self._engine_backward(self._pending)
            self._pending = None
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else 0.0
        # The norm is global, so every rank sees a non-finite one (DeepSpeed then skipped the step); a rank
        # whose own loss was not finite has said so: all agree, so all count the step as skipped.
        failed = self.all_reduce(torch.tensor([float(skip or not math.isfinite(norm))]), op="max")
        return StepResult(norm, failed.item() <= 0)

    def set_lr(self, lr: float) -> None:
        """On the torch optimizer that DeepSpeed steps (a ZeRO wrapper may keep its own list of the same
        groups)."""
        for opt in {id(o): o for o in (self.engine.optimizer, torch_optimizer(self.engine))}.values():
            for group in getattr(opt, "param_groups", []):
                group["lr"] = lr

    def applied_lr(self) -> float:
        return float(torch_optimizer(self.engine).param_groups[0]["lr"])

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        import torch.distributed as dist

        if self.world == 1:
            return tensor
        on_device = tensor.to(self.device) if self.device.type != "cpu" else tensor  # NCCL reduces device tensors
        dist.all_reduce(on_device, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        if on_device is not tensor:
            tensor.copy_(on_device.cpu())
        return tensor

    def _engine_backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)
        # The update calls the HF model's decoder and LM head, not engine.forward, which is where ZeRO
        # counts micro-steps; without this ZeRO-3 overwrites, not accumulates, each pass's gradients.
        clear = getattr(self.engine.optimizer, "clear_backward_seen_flag", None)
        if clear is not None:
            clear()

    # ------------------------------------------------------------------ one step on every rank
    def run_share(self, shares: list[RankShare], checkpoint: Path | None, train: TrainShare) -> dict[str, Any]:
        """Rank 0 (the service): scatter every rank its share, then step with them."""
        if checkpoint is not None:  # every rank writes its shards into rank 0's checkpoint directory
            for share in shares:
                share.checkpoint = str(checkpoint.resolve())
        _, share = self._scatter([("step", s) for s in shares])
        return self._step(share, train)

    def _step(self, share: RankShare, train: TrainShare) -> dict[str, Any]:
        with torch.device(self.device):  # tensors the update makes land beside the model
            stats = train(share)
        if self.cfg.deepspeed.zero_stage == 3:
            self._gather_full()
        if share.checkpoint:
            self._save_shards(Path(share.checkpoint))
        return stats

    def published_model(self) -> Any:
        return self._full if self._full is not None else self.model

    def _save_shards(self, path: Path) -> None:
        import torch.distributed as dist

        self.engine.save_checkpoint(str(path), tag=CHECKPOINT_TAG, save_latest=False)
        dist.barrier()  # every shard is on disk before rank 0 writes trainer_state.pt, which finishes it

    def restore(self, checkpoint: Path) -> None:
        """Rank 0: every rank loads its shards (weights and optimizer state) of ``checkpoint``."""
        self._scatter([("resume", str(checkpoint.resolve()))] * self.world)
        self._load_shards(checkpoint)

    def _load_shards(self, path: Path) -> None:
        self.engine.load_checkpoint(str(path), tag=CHECKPOINT_TAG, load_optimizer_states=True,
                                    load_lr_scheduler_states=False)
        if self.cfg.deepspeed.zero_stage == 3:
            self._gather_full()

    def _gather_full(self) -> None:
        """ZeRO-3: every rank lends its shards; rank 0 keeps a full fp32 copy on the CPU."""
        import deepspeed

        params = list(self.model.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            if self._full is not None:
                state = {k: v.detach().to("cpu", torch.float32) for k, v in self.model.state_dict().items()}
                self._full.load_state_dict(state)

    def _scatter(self, items: list[Any] | None) -> Any:
        """Rank 0 sends ``items[r]`` to rank r (followers pass None); returns this rank's item."""
        import torch.distributed as dist

        box: list[Any] = [None]
        dist.scatter_object_list(box, items, src=0)
        return box[0]

    def close(self) -> None:
        """Rank 0 is done: the followers return from ``follow``."""
        self._scatter([("stop", None)] * self.world)

    def follow(self, train: TrainShare) -> None:
        """Ranks > 0: do what rank 0 says until it stops."""
        while True:
            kind, item = self._scatter(None)
            if kind == "stop":
                return
            if kind == "resume":
                self._load_shards(Path(item))
            else:
                self._step(item, train)


def start_ranks(cfg: JetRLConfig, model: Any, run_dir: Path) -> Callable[..., Trainer]:
    """Join the process group. Rank 0 gets what makes its trainer (``Trainer``'s arguments, on this
    backend); other ranks follow rank 0 here, and exit when it is done."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    if "RANK" not in os.environ:  # no launcher (jetrl up starts `python -m services.trainer`): one rank
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    accel = get_accelerator()
    backend = cfg.trainer.deepspeed.dist_backend or ("gloo" if accel.device_name() == "cpu"
                                                     else accel.communication_backend_name())
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if accel.device_name() != "cpu":
        accel.set_device(local_rank)
    deepspeed.init_distributed(dist_backend=backend)
    rank = dist.get_rank()
    log.info("deepspeed_rank", rank=rank, world=dist.get_world_size(), dist_backend=backend, local_rank=local_rank)
    if rank == 0:
        return partial(Trainer, make_backend=DeepSpeedBackend)
    follower = Trainer(None, None, Subjects(cfg.nats.prefix), cfg.trainer, model,  # type: ignore[arg-type]
                       run_dir / f"rank{rank}", f"trainer-rank{rank}", make_backend=DeepSpeedBackend)
    backend: DeepSpeedBackend = follower.backend  # type: ignore[assignment]
    backend.follow(lambda share: follower.train_share(share, StepLedger(share.step + 1, follower.counters)))
    dist.destroy_process_group()
    raise SystemExit(0)
