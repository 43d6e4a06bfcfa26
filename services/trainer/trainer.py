"""The trainer: a durable pull consumer on TRAJ, a dynamic batch of whatever complete groups are
ready, one optimiser step, then the new weights are published for the rollout replicas.

Never waits for rollout: when at least ``min_groups`` groups are complete it takes all complete
groups (up to ``max_groups``) and trains on them (AgentRL's asynchronous pipeline, dynamic batch).
Trajectories are acked only after the step that used them has published its weights.

One step: fetch -> ready groups (services/trainer/intake.py) -> plan (batch.py) -> update on every rank
(update.py over backend.py) -> publish (weights.py) -> checkpoint (checkpoints.py) -> ack -> record
(records.py).
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import structlog
from nats.aio.client import Client
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext

from services.trainer import update
from services.trainer.backend import Backend, TorchBackend
from services.trainer.batch import plan_step, rl_batch
from services.trainer.checkpoints import RunState
from services.trainer.data_parallel import RankShare
from services.trainer.intake import Group, Intake, vocab_size
from services.trainer.records import EpisodeOutcome, StepRecorder, task_stats
from services.trainer.weights import Publisher, export, trained_weights
from shared.config import TrainerConfig
from shared.consumers import bind_durable, trainer_consumer
from shared.delivery import judge_each
from shared.lifecycle import supervise
from shared.messages import Trajectory
from shared.model import add_lora
from shared.signing import Verifier
from shared.subjects import Subjects

log = structlog.get_logger()

MakeBackend = Callable[[Any, TrainerConfig], Backend]


class Trainer:
    def __init__(self, nc: Client, js: JetStreamContext, subjects: Subjects, cfg: TrainerConfig, model: Any,
                 run_dir: Path, replica_id: str, make_backend: MakeBackend = TorchBackend) -> None:
        self.nc, self.js, self.subjects, self.cfg = nc, js, subjects, cfg
        self.policy_verifier: Verifier | None = None  # checks the policy KV's entry read back on a restart
        self.creates_durables = True  # an open server; with per-role users the admin makes them (shared/consumers.py)
        self.lora = cfg.lora_rank > 0
        trained = add_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets) if self.lora else model
        # KL needs the policy we started from, frozen: with LoRA that is the model with its adapter off.
        self.ref_model = copy.deepcopy(model).eval().requires_grad_(False) if cfg.kl_coef > 0 and not self.lora \
            else None
        self.backend = make_backend(trained, cfg)
        if self.ref_model is not None:
            self.ref_model.to(self.backend.device)
        self.step = 0
        self.policy_version = 0
        self.counters: dict[str, float] = {"train/dead_lettered": 0.0, "train/nonfinite_skipped": 0.0,
                                           "train/flat_groups": 0.0, "train/digest_mismatch": 0.0}
        self.publisher = Publisher(nc, js, subjects, cfg)
        self.intake = Intake(js, subjects, cfg, self.counters, self.publisher.digests, vocab_size(model))
        self.run_state = RunState(run_dir, cfg)
        self.recorder = StepRecorder(run_dir, nc, subjects, replica_id, cfg.steps)

    @property
    def model(self) -> Any:
        """The full model as trained so far (what is published, checkpointed and exported)."""
        return self.backend.published_model()

    def export(self, path: Path) -> None:
        """The final policy as a plain Hugging Face directory (LoRA merged in): ``--model.name=<path>``."""
        export(self.model, self.lora, path)

    def resume(self) -> bool:
        """Continue from the newest checkpoint of the run directory, if any: same weights, optimizer,
        step and policy version (rollout replicas ignore versions they already have, so a trainer
        restarted from scratch would be ignored)."""
        latest = self.run_state.latest(also_has=self.backend.checkpoint_part)
        if latest is None:
            if self.backend.checkpoint_part and self.run_state.latest() is not None:
                log.warning("trainer_resume_skipped", reason=f"no checkpoint with {self.backend.checkpoint_part} shards")
            return False
        resumed = self.run_state.resumed(latest)
        self.backend.restore(latest)
        self.step, self.policy_version = resumed.step, resumed.policy_version
        log.info("trainer_resumed", checkpoint=str(latest), step=self.step, policy_version=self.policy_version,
                 ranks=self.backend.world)
        return True

    async def adopt_announced_version(self) -> None:
        """Resume above the highest version ever announced: the policy KV's (another trainer's, or ours
        announced after our last checkpoint) and our own record, whichever is higher."""
        announced = await self.publisher.announced_version(self.policy_verifier)
        highest = max(self.policy_version, self.run_state.recorded_version(), announced)
        if highest != self.policy_version:
            log.info("policy_version_raised", checkpoint_version=self.policy_version, to=highest)
            if self.step == 0:  # no checkpoint resumed: the steps since the run began are lost
                log.warning("trainer_restarted_without_a_checkpoint", policy_version=highest,
                            checkpoint_every=self.cfg.checkpoint_every,
                            reason="the run's starting weights are trained on, under versions above those "
                                   "announced; a lower trainer.checkpoint_every loses fewer steps")
            self.policy_version = highest

    async def subscribe(self) -> JetStreamContext.PullSubscription:
        """Bind to the trainer's durable on TRAJ; on an open server create (or update) it first, so a resumed
        run's consumer gets today's ack_wait and max_deliver (with per-role users the admin does that)."""
        return await bind_durable(self.js, self.subjects.traj_stream, trainer_consumer(self.subjects, self.cfg),
                                  may_create=self.creates_durables)

    async def run(self, stop: asyncio.Event) -> None:
        sub = await self.subscribe()
        keeper = supervise(lambda: self.intake.keep_held(stop), "held_trajectories_keeper", stop, restart_s=1.0)
        try:
            while not stop.is_set() and self.step < self.cfg.steps:
                try:
                    msgs = await sub.fetch(64, timeout=0.5)
                except (TimeoutError, NatsTimeout):
                    msgs = []
                except Exception as exc:  # broker restarting: wait and retry
                    log.warning("trajectory_fetch_failed", error=repr(exc))
                    await asyncio.sleep(0.5)
                    continue
                await judge_each(self.js, self.subjects, "trainer", msgs, self.intake.take)  # each message alone
                batch = await self.intake.next_batch()
                if batch is not None:
                    await self.train_step(batch)
        finally:
            keeper.cancel()
            self.backend.close()

    async def train_step(self, groups: list[Group]) -> dict[str, Any]:
        started = time.monotonic()
        trajs = [t for g in groups for t in g.trajectories()]
        self.intake.begin_step(groups)
        stats, ledger = await asyncio.to_thread(self.optimise, trajs)
        flat = self.intake.take_flat()
        if flat:  # per-task figures cover every episode the step consumed, left-out flat groups too
            stats.update(task_stats([EpisodeOutcome.of(t) for t in trajs] + flat))
        self.step += 1
        # A version names one set of weights forever: a new one only after a real optimizer step (a batch
        # without signal or with a non-finite loss changed nothing), and recorded before it is announced,
        # so a trainer restarted from an older checkpoint never announces the same number again.
        publish_s = 0.0
        if ledger.updated:
            self.policy_version += 1
            self.run_state.record_version(self.policy_version)
            if self.cfg.mode == "rl":  # SFT plays the envs' oracles: no engine reads weights until the export
                publish_started = time.monotonic()
                await self.publisher.publish(self.model, self.policy_version)
                publish_s = time.monotonic() - publish_started
        if self.run_state.checkpoint_due(self.step):
            await asyncio.to_thread(self.write_checkpoint)
        await self.intake.finish_step(groups)
        stats.update(self.counters)
        stats.update({"train/step_s": time.monotonic() - started, "train/publish_s": publish_s,
                      "train/groups": float(len(groups)), "train/waiting_groups": float(len(self.intake.groups))})
        self.recorder.record(self.step, self.policy_version, stats)
        return stats

    def write_checkpoint(self) -> None:
        self.run_state.write(trained_weights(self.model, self.lora), self.backend.optimizer,
                             self.step, self.policy_version)

    def optimise(self, trajs: list[Trajectory]) -> tuple[dict[str, Any], update.StepLedger]:
        """Staleness filter -> GRPO advantages -> task normalisation -> (decoupled) PPO -> AdamW, on every
        rank; the step's figures and what it did to the weights."""
        lr = update.learning_rate(self.cfg, self.step)
        shares, stats = plan_step(self.cfg, trajs, self.step, self.policy_version, self.backend.world, lr)
        after = self.step + 1
        checkpoint = self.run_state.checkpoint_dir(after) if self.run_state.checkpoint_due(after) else None
        ledger = update.StepLedger(after, self.counters)
        return stats | self.backend.run_share(shares, checkpoint, lambda s: self.train_share(s, ledger)), ledger

    def train_share(self, share: RankShare, ledger: update.StepLedger) -> dict[str, Any]:
        """Every rank's part of a step: its share, with the whole batch's statistics (all-reduced)."""
        self.step, self.policy_version = share.step, share.policy_version
        lr = update.learning_rate(self.cfg, self.step)
        self.backend.set_lr(lr)
        if share.mode == "sft":
            return update.sft_update(self.backend, self.cfg, share.trajs, ledger, lr)
        if share.mode != "rl":
            return {}
        stats: dict[str, Any] = {}
        batch = rl_batch(self.cfg, share, self.backend.all_reduce, stats)
        reference = partial(update.reference_policy, self.backend.model, self.ref_model) if self.cfg.kl_coef > 0 else None
        return stats | update.policy_update(self.backend, self.cfg, batch, ledger, reference, lr)

