"""Trainer entry point: ``python -m services.trainer [--config FILE] [--trainer.key=value ...]``.

Exits after ``trainer.steps`` steps; ``jetrl up`` then stops the other services.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import torch

from services.trainer.trainer import Trainer
from shared.auth import manages_topology
from shared.bus import replica_name
from shared.config import from_argv
from shared.lifecycle import exit_code
from shared.messages import TrainingFinished, encode
from shared.model import load_model, load_tokenizer, quiet_transformers, resolve_model
from shared.service import Service
from shared.signing import signer_for, verifier_for


async def main(argv: list[str]) -> None:
    cfg, _ = from_argv(argv)
    svc = Service(cfg, "trainer", replica_name("trainer"), grace_s=240.0)  # finishes its step, saves <run>/model
    quiet_transformers()
    torch.manual_seed(cfg.run.seed)
    torch.set_num_threads(cfg.trainer.torch_threads)
    model_path = await asyncio.to_thread(resolve_model, cfg.model)
    model = load_model(model_path)
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    trainer_cls: type[Trainer] = Trainer
    if cfg.trainer.backend == "deepspeed":  # scale-out: ranks > 0 follow rank 0 in there and exit
        from services.trainer.deepspeed_backend import start_ranks
        trainer_cls = await asyncio.to_thread(start_ranks, cfg, model, run_dir)
    async with svc:
        await svc.connect()
        trainer = trainer_cls(svc.nc, svc.js, svc.subjects, cfg.trainer, model, run_dir, svc.replica_id)
        trainer.creates_durables = manages_topology(cfg.nats, "trainer")
        trainer.intake.context_tokens = cfg.rollout.max_context_tokens  # what trainer.max_tokens defaults to
        signer = signer_for(cfg.nats)
        trainer.publisher.signer, trainer.policy_verifier = signer, verifier_for(cfg.nats, "trainer")
        trainer.resume()  # a restarted trainer continues from its newest checkpoint
        await trainer.adopt_announced_version()  # versions only go up, across restarts and trainers
        svc.heartbeat({"steps": cfg.trainer.steps})
        svc.log.info("trainer_ready", model=str(model_path), steps=cfg.trainer.steps, min_groups=cfg.trainer.min_groups)
        await trainer.run(svc.stop)
        if trainer.step >= cfg.trainer.steps:  # done, not stopped part-way: say so (the controller ends the plan)
            finished = TrainingFinished(step=trainer.step, policy_version=trainer.policy_version,
                                        replica_id=svc.replica_id)
            await svc.nc.publish(svc.subjects.training_finished,
                                 encode(signer.sign(finished) if signer else finished))
            await svc.nc.flush()
        # The final policy as a Hugging Face directory: `--model.name=<run>/model` starts from it.
        await asyncio.to_thread(trainer.export, run_dir / "model")  # full weights (LoRA merged, ZeRO-3 gathered)
        await asyncio.to_thread(load_tokenizer(model_path).save_pretrained, run_dir / "model")
        svc.log.info("trainer_done", step=trainer.step, policy_version=trainer.policy_version,
                     model=str(run_dir / "model"))


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
    sys.exit(exit_code())
