"""DeepSpeed trainer backend (ZeRO 1/2/3): the same ``Trainer``, run by several ranks.

Launch it with either launcher; every rank runs the same entry point (without one, as under
``jetrl up``, it is a single rank)::

    torchrun --nproc_per_node N -m services.trainer --trainer.backend=deepspeed [--trainer.zero_stage=3]
    deepspeed --num_gpus N --module services.trainer --trainer.backend=deepspeed

Rank 0 is the trainer service: NATS intake, dynamic batches, weight broadcast, checkpoints, metrics.
The other ranks never touch NATS; they follow rank 0 over torch.distributed, one step at a time:

1. rank 0 broadcasts the step's trajectories (and its step counters, which the staleness bound reads);
2. every rank runs ``Trainer._optimise`` on them under its DeepSpeed engine: the RL math is the plain
   trainer's, only ``backward`` and ``optimizer_step`` are DeepSpeed's (ZeRO owns gradients and step);
3. under ZeRO-3 every rank takes part in gathering the full parameters, and rank 0 copies them into a
   full CPU model, which is what it publishes and checkpoints (ZeRO 1/2 keep full parameters anyway).

What ZeRO buys here is memory: optimizer state (1), gradients (2) and parameters (3) are split across
ranks, so a model too big for one device trains on several. Every rank runs the whole batch (the
trainer's micro-batch loop is not split by rank yet), so throughput does not grow with ranks.

On the CPU it runs over gloo (``DS_BUILD_OPS=0``; DeepSpeed JIT-compiles its shared-memory comm op on
the first start, about a minute, then it is cached); on GPUs over NCCL.
"""

from __future__ import annotations

import copy
import os
import socket
from pathlib import Path
from typing import Any

import structlog
import torch

from services.trainer.trainer import Trainer
from shared.config import JetRLConfig, TrainerConfig
from shared.messages import Trajectory
from shared.subjects import Subjects

log = structlog.get_logger()


def ds_config(cfg: TrainerConfig) -> dict[str, Any]:
    """The DeepSpeed config for a ``TrainerConfig``: the plain trainer's AdamW and clipping, ZeRO on top."""
    if cfg.zero_stage not in (1, 2, 3):
        raise ValueError(f"trainer.zero_stage must be 1, 2 or 3, got {cfg.zero_stage}")
    if cfg.ds_dtype not in ("float32", "bfloat16"):
        raise ValueError(f"trainer.ds_dtype must be float32 or bfloat16, got {cfg.ds_dtype!r}")
    return {
        # Batching is the trainer's (token-budget micro-batches); DeepSpeed only sees one "sample" a pass.
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": cfg.max_grad_norm,
        # torch's own AdamW: the same update as the plain backend, and no fused op to compile.
        "optimizer": {"type": "AdamW", "params": {"lr": cfg.lr, "betas": list(cfg.betas), "eps": 1e-8,
                                                  "weight_decay": cfg.weight_decay, "torch_adam": True}},
        "zero_optimization": {"stage": cfg.zero_stage},
        "bf16": {"enabled": cfg.ds_dtype == "bfloat16"},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


class _DeepSpeedOptimizer:
    """What ``Trainer`` calls on ``self.optimizer``; the engine owns the real one."""

    def __init__(self, engine: Any, stage: int) -> None:
        self.engine, self.stage = engine, stage

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.engine.zero_grad()

    def state_dict(self) -> dict[str, Any]:
        # Checkpoints keep full weights; ZeRO's partitioned optimizer state is not resumable from one rank.
        return {"backend": "deepspeed", "zero_stage": self.stage}


class DeepSpeedTrainer(Trainer):
    """``Trainer`` whose gradients and optimizer step are a DeepSpeed engine's, on every rank."""

    def __init__(self, nc: Any, js: Any, subjects: Subjects, cfg: TrainerConfig, model: Any, run_dir: Path,
                 replica_id: str) -> None:
        import deepspeed
        import torch.distributed as dist
        from deepspeed.accelerator import get_accelerator

        super().__init__(nc, js, subjects, cfg, model, run_dir, replica_id)  # the reference model is copied here
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.device = torch.device(get_accelerator().current_device_name())
        # ZeRO-3 keeps 1/world of each parameter per rank: rank 0 gathers into this full copy for publishing
        # (copied before deepspeed.initialize partitions the model).
        self._full = copy.deepcopy(model).to("cpu", torch.float32).eval() \
            if cfg.zero_stage == 3 and self.rank == 0 else None
        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                    config=ds_config(cfg))
        self.module = self.engine.module  # the HF model itself: Trainer calls its decoder and LM head
        self.model = self.module
        self.optimizer = _DeepSpeedOptimizer(self.engine, cfg.zero_stage)  # type: ignore[assignment]
        if self.ref_model is not None:
            self.ref_model.to(self.device)
        self._pending: torch.Tensor | None = None
        log.info("deepspeed_ready", rank=self.rank, world=self.world, zero_stage=cfg.zero_stage,
                 dtype=cfg.ds_dtype, device=str(self.device))

    # ------------------------------------------------------------------ hooks the Trainer calls
    def backward(self, loss: torch.Tensor) -> None:
        # DeepSpeed must know which backward is the last before the step (that one reduces the gradients);
        # the Trainer does not say, so each backward runs one call late, as a non-final pass.
        if self._pending is not None:
            self.engine.set_gradient_accumulation_boundary(False)
            self._engine_backward(self._pending)
        self._pending = loss

    def optimizer_step(self) -> float:
        if self._pending is not None:
            self.engine.set_gradient_accumulation_boundary(True)
            self._engine_backward(self._pending)
            self._pending = None
        self.engine.step()
        self._stepped = True
        norm = self.engine.get_global_grad_norm()
        return float(norm) if norm is not None else 0.0

    def _apply_lr_schedule(self) -> None:
        """The warm-up ``train/lr`` reports, on the optimizer DeepSpeed steps (``self.optimizer`` is only
        a facade without param_groups; ZeRO's optimizer exposes its inner one's)."""
        lr = self.current_lr()
        for group in getattr(self.engine.optimizer, "param_groups", []):
            group["lr"] = lr

    def _engine_backward(self, loss: torch.Tensor) -> None:
        self.engine.backward(loss)
        # The Trainer calls the HF model's decoder and LM head, not engine.forward, which is where ZeRO
        # counts micro-steps; without this ZeRO-3 overwrites, not accumulates, each pass's gradients.
        clear = getattr(self.engine.optimizer, "clear_backward_seen_flag", None)
        if clear is not None:
            clear()

    # ------------------------------------------------------------------ one step on every rank
    def _optimise(self, trajs: list[Trajectory]) -> dict[str, Any]:
        """Rank 0 (the service): hand the batch to every rank, then step with them."""
        self._broadcast(("step", trajs, self.step, self.policy_version))
        return self._step_all_ranks(trajs)

    def _step_all_ranks(self, trajs: list[Trajectory]) -> dict[str, Any]:
        self.model = self.module
        with torch.device(self.device):  # tensors the Trainer makes land beside the model
            stats = Trainer._optimise(self, trajs)
        if self.cfg.zero_stage == 3:
            self._gather_full()
        if self._full is not None:
            self.model = self._full  # what publish_weights and save_checkpoint read until the next step
        return stats

    def _gather_full(self) -> None:
        """ZeRO-3: every rank lends its shards; rank 0 keeps a full fp32 copy on the CPU."""
        import deepspeed

        params = list(self.module.parameters())
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            if self._full is not None:
                state = {k: v.detach().to("cpu", torch.float32) for k, v in self.module.state_dict().items()}
                self._full.load_state_dict(state)

    def _broadcast(self, item: Any) -> Any:
        import torch.distributed as dist

        box = [item]
        dist.broadcast_object_list(box, src=0, device=self.device if self.device.type != "cpu" else None)
        return box[0]

    async def run(self, stop: Any) -> None:
        try:
            await super().run(stop)
        finally:
            self._broadcast(("stop",))

    def follow(self) -> None:
        """Ranks > 0: do what rank 0 says until it stops."""
        while True:
            item = self._broadcast(None)
            if item[0] == "stop":
                return
            _, trajs, self.step, self.policy_version = item
            self._step_all_ranks(trajs)


def start_ranks(cfg: JetRLConfig, model: Any, run_dir: Path) -> type[Trainer]:
    """Join the process group. Rank 0 gets the trainer class to serve with; other ranks follow rank 0
    here, and exit when it is done."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.accelerator import get_accelerator

    if "RANK" not in os.environ:  # no launcher (jetrl up starts `python -m services.trainer`): one rank
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    accel = get_accelerator()
    backend = cfg.trainer.ds_dist_backend or ("gloo" if accel.device_name() == "cpu" else accel.communication_backend_name())
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if accel.device_name() != "cpu":
        accel.set_device(local_rank)
    deepspeed.init_distributed(dist_backend=backend)
    rank = dist.get_rank()
    log.info("deepspeed_rank", rank=rank, world=dist.get_world_size(), dist_backend=backend, local_rank=local_rank)
    if rank == 0:
        return DeepSpeedTrainer
    follower = DeepSpeedTrainer(None, None, Subjects(cfg.nats.prefix), cfg.trainer, model,
                                run_dir / f"rank{rank}", f"trainer-rank{rank}")
    follower.follow()
    dist.destroy_process_group()
    raise SystemExit(0)
