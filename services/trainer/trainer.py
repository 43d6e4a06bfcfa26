"""The trainer: a durable pull consumer on TRAJ, a dynamic batch of whatever complete groups are
ready, one optimiser step, then the new weights are published for the rollout replicas.

Never waits for rollout: when at least ``min_groups`` groups are complete it takes all complete
groups (up to ``max_groups``) and trains on them (AgentRL's asynchronous pipeline, dynamic batch).
Trajectories are acked only after the step that used them has published its weights.
"""

from __future__ import annotations

import asyncio
import copy
import json
import math
import shutil
import time
from collections import Counter, OrderedDict, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
import torch
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import ObjectMeta, ObjectMetaOptions

from services.trainer import rl
from services.trainer.data_parallel import RankShare, split_contiguous
from services.trainer.packing import (
    PackedBatch,
    pack,
    packed_logprobs,
    plan_micro_batches,
    prefix_order,
    shareable_length,
)
from shared.bus import dead_letter, decode_or_dead_letter, judge_each, publish_metrics, retrying, term_quietly
from shared.config import RolloutConfig, TrainerConfig
from shared.consumers import bind_durable, trainer_consumer
from shared.digest import digest
from shared.lifecycle import supervise
from shared.lm import PackedLM
from shared.messages import EpisodeStatus, Trajectory, WeightsAnnouncement, decode, encode
from shared.model import (
    add_lora,
    bytes_to_weights,
    load_weights_into,
    lora_delta_bytes,
    save_checkpoint,
    weights_to_bytes,
    weights_to_bytes_of,
)
from shared.signing import Signer, Verifier
from shared.subjects import Subjects

log = structlog.get_logger()

FLAT_GROUPS_WARNING = 16  # filter_flat_groups: a warning every this many groups left out without a step
STALENESS_BINS = 11  # train/staleness_hist/<k>: trained turns k versions behind, 0..9, and 10 for 10 or more


@dataclass
class Group:
    group_id: str
    size: int
    first_seen: float = field(default_factory=time.monotonic)
    items: dict[str, tuple[Trajectory, Msg]] = field(default_factory=dict)

    def complete(self) -> bool:
        return len(self.items) >= self.size


@dataclass(frozen=True)
class EpisodeOutcome:
    """What a step's per-task figures need of an episode, without its tokens."""

    task: str
    success: bool
    reward: float
    turns: int
    env_error: bool

    @classmethod
    def of(cls, traj: Trajectory) -> EpisodeOutcome:
        return cls(traj.task, traj.success, traj.reward, len(traj.turns), traj.status == EpisodeStatus.ENV_ERROR)


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
    micro_batches: list[MicroBatch]
    minibatches: list[list[int]]  # indices into micro_batches, one list per optimizer step
    minibatch_tokens: list[int]
    num_tokens: int  # trained tokens of the whole batch, every rank


class Trainer:
    def __init__(self, nc: Client, js: JetStreamContext, subjects: Subjects, cfg: TrainerConfig, model: Any,
                 run_dir: Path, replica_id: str) -> None:
        self.nc, self.js, self.subjects, self.cfg = nc, js, subjects, cfg
        self.run_dir, self.replica_id = run_dir, replica_id
        self.published_digests: dict[int, str] = {}  # version -> digest we announced (checked in each turn)
        self.signer: Signer | None = None  # signs announcements where the run has keys (shared/signing.py)
        self.policy_verifier: Verifier | None = None  # checks the policy KV's entry read back on a restart
        self.creates_durables = True  # an open server; with per-role users the admin makes them (shared/consumers.py)
        self.lora = cfg.lora_rank > 0
        self.model = add_lora(model, cfg.lora_rank, cfg.lora_alpha, cfg.lora_targets) if self.lora else model
        self.optimizer = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=cfg.lr,
                                           betas=tuple(cfg.betas), weight_decay=cfg.weight_decay)
        self.step = 0
        self.policy_version = 0
        self.rank, self.world = 0, 1  # data-parallel ranks: the DeepSpeed backend runs several
        self.groups: dict[str, Group] = {}
        # episode id -> its group while held; ids of trained ones are kept (bounded) to drop duplicates
        self.seen_episodes: OrderedDict[str, str] = OrderedDict()
        self.in_step: list[Msg] = []  # the messages of the step being taken (acked after it)
        self.vocab_size = _vocab_size(model)
        self.context_tokens = RolloutConfig().max_context_tokens  # the run's rollout.max_context_tokens (__main__)
        self.counters: dict[str, float] = {"train/dead_lettered": 0.0, "train/nonfinite_skipped": 0.0,
                                           "train/flat_groups": 0.0, "train/digest_mismatch": 0.0}
        self.flat: list[EpisodeOutcome] = []  # episodes of groups left out since the last step
        self.flat_groups_since_step = 0
        self._step_nonfinite = False
        self._stepped = False  # the optimizer really stepped in this training step
        self.metrics_file = run_dir / "metrics.jsonl"
        self.tensorboard = _tensorboard_writer(run_dir)  # the same rows as TensorBoard events, beside it
        # KL needs the policy we started from, frozen: with LoRA that is the model with its adapter off.
        self.ref_model = copy.deepcopy(model).eval().requires_grad_(False) if cfg.kl_coef > 0 and not self.lora \
            else None

    @contextmanager
    def _reference(self) -> Iterator[PackedLM]:
        if self.lora:
            with self.model.disable_adapter():
                yield PackedLM(self.model)
        else:
            yield PackedLM(self.ref_model)

    def trained_weights(self) -> bytes:
        """What a checkpoint keeps of the model: every weight, or with LoRA only the adapter."""
        if self.lora:
            return weights_to_bytes_of({k: v for k, v in self.model.named_parameters() if v.requires_grad})
        return weights_to_bytes(self.model)

    def export(self, path: Path) -> None:
        """The final policy as a plain Hugging Face directory (LoRA merged in): ``--model.name=<path>``."""
        model = self.model.merge_and_unload() if self.lora else self.model
        model.save_pretrained(path)

    def resume(self) -> bool:
        """Continue from the newest checkpoint of the run directory, if any: same weights, optimizer,
        step and policy version (rollout replicas ignore versions they already have, so a trainer
        restarted from scratch would be ignored)."""
        latest = self.latest_checkpoint()
        if latest is None:
            return False
        saved = bytes_to_weights((latest / "model.safetensors").read_bytes())
        if self.lora:  # the adapter's tensors, by name; the base weights are the run's model
            own = dict(self.model.named_parameters())
            with torch.no_grad():
                for name, tensor in saved.items():
                    own[name].copy_(tensor)
        else:
            load_weights_into(self.model, saved, allow_extra=("lm_head.weight",))
        state = torch.load(latest / "trainer_state.pt", weights_only=False)
        if state["optimizer"].get("backend") == "deepspeed":  # ZeRO's state is in its shards: a fresh AdamW
            log.warning("trainer_optimizer_state_not_resumed", checkpoint=str(latest), reason="written by deepspeed")
        else:
            self.optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        self.policy_version = max(int(state.get("policy_version", self.step)), self.recorded_version())
        log.info("trainer_resumed", checkpoint=str(latest), step=self.step, policy_version=self.policy_version)
        return True

    def checkpoint_due(self, step: int) -> bool:
        """Whether the step that brings the count to ``step`` ends with a checkpoint."""
        return bool(self.cfg.checkpoint_every and step % self.cfg.checkpoint_every == 0) or step == self.cfg.steps

    def checkpoint_dir(self, step: int) -> Path:
        return self.run_dir / "checkpoints" / f"step_{step:06d}"

    def write_checkpoint(self) -> None:
        """Weights, optimizer state, step and policy version of the step just taken; then the oldest go.
        ``trainer_state.pt`` is written last: a directory without it is an unfinished checkpoint."""
        save_checkpoint(self.trained_weights(), self.optimizer, self.step, self.checkpoint_dir(self.step),
                        {"policy_version": self.policy_version})
        self.prune_checkpoints()

    def latest_checkpoint(self) -> Path | None:
        """The newest finished checkpoint of the run directory (one a crash cut short is passed over)."""
        finished = [p for p in sorted((self.run_dir / "checkpoints").glob("step_*")) if (p / "trainer_state.pt").exists()]
        return finished[-1] if finished else None

    def prune_checkpoints(self) -> None:
        """Keep the newest ``trainer.keep_checkpoints`` (0 = all): a long run does not fill the disk."""
        keep = self.cfg.keep_checkpoints
        if keep <= 0:
            return
        for old in sorted((self.run_dir / "checkpoints").glob("step_*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------------ versions
    @property
    def version_file(self) -> Path:
        return self.run_dir / "policy_version"

    def recorded_version(self) -> int:
        """The highest version this run ever went to announce (0 = none)."""
        try:
            return int(self.version_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return 0

    def record_version(self, version: int) -> None:
        """Written (atomically) before version ``version`` is published."""
        tmp = self.version_file.with_suffix(".tmp")
        tmp.write_text(f"{version}\n")
        tmp.replace(self.version_file)

    async def adopt_announced_version(self) -> None:
        """Resume above the highest version ever announced: the policy KV's (another trainer's, or ours
        announced after our last checkpoint) and our own record, whichever is higher."""
        announced = 0
        try:
            kv = await self.js.key_value(self.subjects.policy_kv)
            entry = await kv.get(self.subjects.policy_version_key)
            note = decode(entry.value or b"", WeightsAnnouncement)
            announced = (self.policy_verifier.check(note) if self.policy_verifier else note).version
            if self.policy_verifier is not None and self.policy_verifier.key is not None:  # signed: it is ours
                self.published_digests.setdefault(note.version, note.digest)  # turns still played with it are checked
        except Exception as exc:  # no version yet, or an unreadable entry: our own record still holds
            log.info("no_announced_version", detail=type(exc).__name__)
        highest = max(self.policy_version, self.recorded_version(), announced)
        if highest != self.policy_version:
            log.info("policy_version_raised", checkpoint_version=self.policy_version, to=highest)
            self.policy_version = highest

    # ------------------------------------------------------------------ intake
    async def subscribe(self) -> JetStreamContext.PullSubscription:
        """Bind to the trainer's durable on TRAJ; on an open server create (or update) it first, so a resumed
        run's consumer gets today's ack_wait and max_deliver (with per-role users the admin does that)."""
        return await bind_durable(self.js, self.subjects.traj_stream, trainer_consumer(self.subjects, self.cfg),
                                  may_create=self.creates_durables)

    def check(self, traj: Trajectory) -> str | None:
        """What the schema cannot know: token ids inside this model's vocabulary, turn spans in order
        and covering every trained token (and, again, finite numbers), no longer than ``token_limit``. A
        reason to refuse it, or None."""
        limit = self.token_limit(traj.task)
        if len(traj.tokens) > limit:  # a step's cost grows with the square of it: 2 x 60k tokens took 189 s
            return (f"trajectory: {len(traj.tokens)} tokens, more than the {limit} the trainer takes for task "
                    f"{traj.task!r} (trainer.max_tokens, else rollout.max_context_tokens)")
        if traj.tokens and self.vocab_size is not None and max(traj.tokens) >= self.vocab_size:
            at = next(i for i, t in enumerate(traj.tokens) if t >= self.vocab_size)
            return f"trajectory.tokens[{at}]: token id {traj.tokens[at]} is outside the vocabulary ({self.vocab_size})"
        if not 0 <= traj.prompt_len <= len(traj.tokens):
            return f"trajectory.prompt_len: {traj.prompt_len} is outside the {len(traj.tokens)} tokens"
        end = 0
        for k, turn in enumerate(traj.turns):
            if turn.start < end or turn.end < turn.start:
                return f"trajectory.turns[{k}]: span [{turn.start}, {turn.end}) overlaps or precedes the one before"
            end = turn.end
        in_turns = bytearray(len(traj.tokens))
        for turn in traj.turns:
            in_turns[turn.start:turn.end] = b"\x01" * (turn.end - turn.start)
        stray = next((i for i, m in enumerate(traj.loss_mask) if m and not in_turns[i]), None)
        if stray is not None:
            return f"trajectory.loss_mask[{stray}]: a trained token outside every turn span"
        if any(not math.isfinite(x) for x in traj.logprobs) or not math.isfinite(traj.reward):
            return "trajectory: a non-finite logprob or reward"
        for k, turn in enumerate(traj.turns):  # the weights each turn was played with: the ones we announced?
            published = self.published_digests.get(turn.policy_version)
            if published is not None and turn.weights_digest != published:
                self.counters["train/digest_mismatch"] += 1
                return (f"trajectory.turns[{k}].weights_digest: {turn.weights_digest or 'none'} is not the digest of "
                        f"the weights published as version {turn.policy_version}")
        return None

    def token_limit(self, task: str) -> int:
        """The longest trajectory of ``task`` the trainer takes: ``trainer.max_tokens`` for it or for every task
        (``*``), else the rollout's context limit, which no trajectory a rollout plays exceeds."""
        return self.cfg.max_tokens.get(task, self.cfg.max_tokens.get("*", self.context_tokens))

    async def _refuse(self, msg: Msg, reason: str) -> None:
        """Dead-letter a trajectory we will not train on and terminate it (never redelivered)."""
        self.counters["train/dead_lettered"] += 1
        await dead_letter(self.js, self.subjects, service="trainer", origin_subject=msg.subject, reason=reason,
                          payload=msg.data)
        await term_quietly(msg)

    async def _intake(self, msg: Msg) -> None:
        traj = await decode_or_dead_letter(self.js, self.subjects, "trainer", msg, Trajectory)
        if traj is None:
            self.counters["train/dead_lettered"] += 1
            return
        delivered = msg.metadata.num_delivered if msg.metadata else 1
        group_id = self.seen_episodes.get(traj.episode_id)
        if group_id is not None:
            group = self.groups.get(group_id)
            if group is not None and traj.episode_id in group.items:  # held: keep the newest delivery to ack
                group.items[traj.episode_id] = (traj, msg)
            else:  # already trained on: a duplicate, or a redelivery whose ack was lost
                await msg.ack()
            return
        if traj.split != "train":  # an eval run's episodes on the same prefix: not ours to train on, not bad
            self.counters["train/skipped_other_split"] = self.counters.get("train/skipped_other_split", 0.0) + 1
            await msg.ack()
            return
        if delivered >= self.cfg.max_deliver:
            await self._refuse(msg, f"delivered {delivered} times (trainer.max_deliver) without being trained on: "
                                    "the trainer stopped or crashed each time it held it")
            return
        reason = self.check(traj)
        if reason is not None:
            await self._refuse(msg, reason)
            return
        self.seen_episodes[traj.episode_id] = traj.group_id
        while len(self.seen_episodes) > self.cfg.dedupe_window:  # bounded: older ids are past TRAJ's window too
            self.seen_episodes.popitem(last=False)
        group = self.groups.setdefault(traj.group_id, Group(traj.group_id, traj.group_size))
        group.items[traj.episode_id] = (traj, msg)

    def ready_groups(self) -> list[Group]:
        now = time.monotonic()
        ready = [g for g in self.groups.values() if g.complete() or now - g.first_seen > self.cfg.group_timeout_s]
        return sorted(ready, key=lambda g: g.first_seen)

    async def drop_flat_groups(self, ready: list[Group]) -> list[Group]:
        """``trainer.filter_flat_groups``: ack and leave out the ready groups whose trainable episodes all
        got one reward. Their advantages are all zero: training on them costs a forward and backward pass
        and adds only zeros to the loss, whose token count they still dilute; a step of flat groups alone
        changes nothing. Their episodes still count in the next step's per-task success (``flat``)."""
        keep = []
        for group in ready:
            rewards = {t.reward for t, _ in group.items.values() if _rl_trainable(t)}
            if len(rewards) > 1:
                keep.append(group)
                continue
            del self.groups[group.group_id]
            # for the step's per-task figures only: a long wait for signal holds outcomes, not whole contexts
            self.flat.extend(EpisodeOutcome.of(t) for t, _ in group.items.values())
            self.counters["train/flat_groups"] += 1
            self.flat_groups_since_step += 1
            if self.flat_groups_since_step % FLAT_GROUPS_WARNING == 0:  # no step comes while this lasts: say why
                log.warning("no_signal", flat_groups_since_last_step=self.flat_groups_since_step,
                            rewards=sorted(rewards), hint="every group's episodes got one reward (the tasks are "
                            "too hard or too easy for the policy); filter_flat_groups waits for groups with signal")
            for _, msg in group.items.values():
                try:
                    await retrying("trajectory_ack", msg.ack)
                except Exception as exc:  # redelivered later, then acked as already seen
                    log.warning("trajectory_ack_failed", error=repr(exc))
        return keep

    async def keep_held(self, stop: asyncio.Event) -> None:
        """``in_progress`` for every trajectory we hold (waiting groups and the step being taken), every
        quarter of ack_wait: while we live nothing is redelivered; when we die it all is, within ack_wait."""
        every = max(0.5, self.cfg.ack_wait_s / 4)
        while not stop.is_set():
            await asyncio.sleep(every)
            held = [m for g in list(self.groups.values()) for _, m in list(g.items.values())] + list(self.in_step)
            for msg in held:
                try:
                    await msg.in_progress()
                except Exception as exc:  # reconnecting: the next round touches them again
                    log.info("touch_failed", error=type(exc).__name__)
                    break

    async def run(self, stop: asyncio.Event) -> None:
        sub = await self.subscribe()
        keeper = supervise(lambda: self.keep_held(stop), "held_trajectories_keeper", stop, restart_s=1.0)
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
                await judge_each(self.js, self.subjects, "trainer", msgs, self._intake)  # each message alone
                ready = self.ready_groups()
                if self.cfg.filter_flat_groups and self.cfg.mode == "rl":
                    ready = await self.drop_flat_groups(ready)
                if len(ready) >= self.cfg.min_groups:
                    batch = ready[: self.cfg.max_groups]
                    for g in batch:
                        del self.groups[g.group_id]
                    await self.train_step(batch)
        finally:
            keeper.cancel()

    # ------------------------------------------------------------------ one step
    async def train_step(self, groups: list[Group]) -> dict[str, Any]:
        started = time.monotonic()
        trajs = [t for g in groups for t, _ in g.items.values()]
        self.in_step = [m for g in groups for _, m in g.items.values()]
        self._step_nonfinite = self._stepped = False
        stats = await asyncio.to_thread(self._optimise, trajs)
        if self.flat:  # per-task figures cover every episode the step consumed, left-out flat groups too
            stats.update(_task_stats([EpisodeOutcome.of(t) for t in trajs] + self.flat))
            self.flat, self.flat_groups_since_step = [], 0
        self.step += 1
        # A version names one set of weights forever: a new one only after a real optimizer step (a batch
        # without signal or with a non-finite loss changed nothing), and recorded before it is announced,
        # so a trainer restarted from an older checkpoint never announces the same number again.
        updated = self._stepped and not self._step_nonfinite
        if updated:
            self.policy_version += 1
            self.record_version(self.policy_version)
        # SFT plays the envs' oracles: no engine reads the weights until the run's model is exported
        publish_s = await self.publish_weights() if self.cfg.mode == "rl" and updated else 0.0
        if self.checkpoint_due(self.step):
            await asyncio.to_thread(self.write_checkpoint)
        for g in groups:
            for _, msg in g.items.values():
                try:
                    await retrying("trajectory_ack", msg.ack)
                except Exception as exc:  # redelivered later, then acked as already trained on
                    log.warning("trajectory_ack_failed", error=repr(exc))
        self.in_step = []
        stats.update(self.counters)
        stats.update({"train/step_s": time.monotonic() - started, "train/publish_s": publish_s,
                      "train/groups": float(len(groups)), "train/waiting_groups": float(len(self.groups))})
        self._record(stats)
        return stats

    def _optimise(self, trajs: list[Trajectory]) -> dict[str, Any]:
        """Staleness filter -> GRPO advantages -> task normalisation -> (decoupled) PPO -> AdamW."""
        shares, stats = self.plan_step(trajs)
        return stats | self.train_share(shares[self.rank])

    def plan_step(self, trajs: list[Trajectory]) -> tuple[list[RankShare], dict[str, Any]]:
        """Rank 0's part of a step (services/trainer/data_parallel.py): what needs whole groups (the
        staleness filter, group advantages, the minibatch of each trajectory), then each minibatch's
        trajectories cut, in prefix order, into one run per rank of about equal packed rows. Also the
        batch's own statistics."""
        usable = [t for t in trajs if t.status != EpisodeStatus.ENV_ERROR and sum(t.loss_mask) > 0]
        stats = self._batch_stats(trajs)
        shares = [RankShare("idle", self.step, self.policy_version) for _ in range(self.world)]
        if self.cfg.mode == "sft":  # demonstrations, split like an RL minibatch (one optimizer step)
            demos = [t for t in usable if t.reward >= self.cfg.sft_min_reward]
            if not demos:
                return shares, stats | {"train/sft_trajectories": 0.0}
            ordered = self._prefix_order(demos)
            dealt = split_contiguous([rows for _, rows in ordered], self.world)
            shares = [RankShare("sft", self.step, self.policy_version, trajs=[demos[ordered[p][0]] for p in picks])
                      for picks in dealt]
            return shares, stats | _balance(shares)
        usable = [t for t in trajs if _rl_trainable(t)]  # the same rule drop_flat_groups uses
        lag = [self.policy_version - t.min_policy_version for t in usable]
        weights = rl.staleness_weights(lag, [t.task for t in usable], self.cfg.max_staleness,
                                       self.cfg.staleness_mode, self.cfg.staleness_downweight)
        stats["train/stale_dropped"] = float(sum(w == 0.0 for w in weights))
        stats["train/stale_downweighted"] = float(sum(0.0 < w < 1.0 for w in weights))
        # Group statistics use every usable trajectory; dropped ones then contribute no tokens.
        seq_adv = rl.group_advantages(torch.tensor([t.reward for t in usable]), [t.group_id for t in usable]).tolist()
        kept = [i for i, w in enumerate(weights) if w > 0]
        if not kept:
            return shares, stats
        if self.cfg.kl_coef == 0 and not any(seq_adv[i] != 0 for i in kept):
            # Every group all-success or all-failure: the policy gradient is exactly zero. An AdamW step
            # would still move every weight along its old momentum, so there is no step at all.
            stats.update({"train/skipped_update": 1.0, "train/grad_norm": 0.0, "train/loss": 0.0,
                          "train/tokens": float(sum(len(_trained_positions(usable[i])) for i in kept)),
                          "train/lr": self.current_lr()})
            return shares, stats
        trajs = [usable[i] for i in kept]
        # The minibatches (optimizer steps) are those of one rank on the whole batch: every
        # ``minibatches``-th micro-batch of its plan.
        plan = self._plan(trajs)
        num_minibatches = min(self.cfg.minibatches, len(plan))
        minibatch_of = {i: k % num_minibatches for k, order in enumerate(plan) for i in order}
        tasks = sorted({t.task for t in trajs})
        shares = [RankShare("rl", self.step, self.policy_version, num_minibatches=num_minibatches, tasks=tasks)
                  for _ in range(self.world)]
        for m in range(num_minibatches):
            members = [i for i in range(len(trajs)) if minibatch_of[i] == m]
            ordered = self._prefix_order([trajs[i] for i in members])
            dealt = split_contiguous([rows for _, rows in ordered], self.world)
            for share, picks in zip(shares, dealt, strict=True):
                for p in picks:
                    i = members[ordered[p][0]]
                    share.trajs.append(trajs[i])
                    share.seq_advantages.append(seq_adv[kept[i]])
                    share.weights.append(weights[kept[i]])
                    share.minibatch.append(m)
        return shares, stats | _balance(shares)

    def train_share(self, share: RankShare) -> dict[str, Any]:
        """Every rank's part of a step: its share, with the whole batch's statistics (all-reduced)."""
        self.step, self.policy_version = share.step, share.policy_version
        self._apply_lr_schedule()
        if share.mode == "sft":
            return self._sft(share.trajs)
        if share.mode != "rl":
            return {}
        stats: dict[str, Any] = {}
        batch = self._rl_batch(share, stats)
        return stats | self._policy_update(batch)

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """``tensor`` summed (or ``op="max"``) over the ranks, in place. One rank holds the whole batch."""
        return tensor

    def _rl_batch(self, share: RankShare, stats: dict[str, Any]) -> TrainBatch:
        """This rank's trained tokens: advantages normalised per task with the whole batch's sums,
        micro-batches per minibatch, padded to the most passes any rank makes."""
        trajs = share.trajs
        trained = [_trained_positions(t) for t in trajs]
        counts = [len(p) for p in trained]
        code = {task: k for k, task in enumerate(share.tasks)}
        token_adv = _cat([torch.full((n,), a) for a, n in zip(share.seq_advantages, counts, strict=True)])
        token_code = _cat([torch.full((n,), code[t.task]) for t, n in zip(trajs, counts, strict=True)]).long()
        sums = self.all_reduce(rl.task_norm_sums(token_adv, token_code, len(share.tasks)))
        normalised = rl.task_normalize_with(token_adv, token_code, sums, self.cfg.task_norm)
        # Reported by rank 0, over the whole batch: per task a histogram (bins of 0.6 over [-3, 3]) and
        # the tokens whose sign normalisation changed (or that it gave a sign), summed over the ranks.
        flipped = ((normalised * token_adv) < 0) | ((normalised != 0) & (token_adv == 0))
        seen = torch.zeros(len(share.tasks), 11, dtype=torch.float64)
        for k in range(len(share.tasks)):
            sel = token_code == k
            seen[k, :10] = torch.histc(normalised[sel], bins=10, min=ADV_HIST_RANGE[0], max=ADV_HIST_RANGE[1])
            seen[k, 10] = float(flipped[sel].sum())
        seen = self.all_reduce(seen)
        for k, task in enumerate(share.tasks):
            count, total, squares, _ = sums[k].tolist()
            mean = total / max(count, 1.0)
            stats[f"task/{task}/adv_mean_raw"] = mean
            stats[f"task/{task}/adv_std_raw"] = math.sqrt(max(squares / max(count, 1.0) - mean * mean, 0.0))
            stats[f"task/{task}/adv_hist"] = [int(x) for x in seen[k, :10].tolist()]
        stats["train/adv_sign_flipped"] = float(seen[:, 10].sum())
        token_weight = _cat([torch.full((n,), w) for w, n in zip(share.weights, counts, strict=True)])
        advantages = list((normalised * token_weight).split(counts))
        behaviour = [torch.tensor(t.logprobs, dtype=torch.float32)[p] for t, p in zip(trajs, trained, strict=True)]
        temperature = [t.temperature if t.temperature > 0 else 1.0 for t in trajs]

        members = [[i for i, b in enumerate(share.minibatch) if b == m] for m in range(share.num_minibatches)]
        plans = [[[group[j] for j in order] for order in self._plan([trajs[i] for i in group])] for group in members]
        # ZeRO's collectives run inside each forward/backward pass: every rank makes as many as the busiest
        passes = self.all_reduce(torch.tensor([len(p) for p in plans], dtype=torch.float64), op="max")
        tokens = self.all_reduce(torch.tensor([sum(counts[i] for i in g) for g in members], dtype=torch.float64))
        seqs, marks = [t.tokens for t in trajs], [t.loss_mask for t in trajs]
        micro: list[MicroBatch] = []
        minibatches: list[list[int]] = []
        for plan, need in zip(plans, passes.tolist(), strict=True):
            start = len(micro)
            for order in plan:
                packed = pack(seqs, marks, order, share=self.cfg.shared_prefix)
                micro.append(MicroBatch(packed, torch.cat([advantages[i] for i in order]),
                                        torch.cat([behaviour[i] for i in order]), _per_token(temperature, packed),
                                        torch.ones(packed.targets.numel())))
            micro.extend(_padding_pass() for _ in range(int(need) - len(plan)))
            minibatches.append(list(range(start, len(micro))))
        return TrainBatch(trajs=trajs, micro_batches=micro, minibatches=minibatches,
                          minibatch_tokens=[int(n) for n in tokens.tolist()], num_tokens=int(tokens.sum()))

    def _prefix_order(self, trajs: list[Trajectory]) -> list[tuple[int, int]]:
        """``trajs`` (indices) in prefix order, each with the packed rows it adds (all of it without sharing)."""
        if not self.cfg.shared_prefix:
            return [(i, len(t.tokens)) for i, t in enumerate(trajs)]
        return prefix_order([t.tokens for t in trajs], [shareable_length(t.tokens, t.loss_mask) for t in trajs])

    def _plan(self, trajs: list[Trajectory], context: list[list[int]] | None = None) -> list[list[int]]:
        """Micro-batches (lists of indices into ``trajs``) of at most ``micro_batch_tokens`` packed rows,
        prefix-sharing neighbours together."""
        seqs = [t.tokens for t in trajs]
        marks = context if context is not None else [t.loss_mask for t in trajs]
        shareable = [shareable_length(s, m) for s, m in zip(seqs, marks, strict=True)]
        return plan_micro_batches(seqs, shareable, self.cfg.micro_batch_tokens)

    def _micro_batches(self, trajs: list[Trajectory], context: list[list[int]] | None = None) -> list[PackedBatch]:
        """Prefix-shared micro-batches of at most ``micro_batch_tokens`` packed rows."""
        seqs = [t.tokens for t in trajs]
        marks = context if context is not None else [t.loss_mask for t in trajs]
        return [pack(seqs, marks, order, share=self.cfg.shared_prefix) for order in self._plan(trajs, context)]

    def _policy_update(self, batch: TrainBatch) -> dict[str, Any]:
        lm = PackedLM(self.model)
        chunks = batch.micro_batches
        # The proximal policy is the one before this batch's first update. With one optimizer step per
        # batch it is the current policy itself (detached), so no separate pass is needed.
        proximal: list[torch.Tensor | None] = [None] * len(chunks)
        reference: list[torch.Tensor | None] = [None] * len(chunks)
        with torch.no_grad():
            if self.cfg.loss == "decoupled" and len(batch.minibatches) > 1:
                proximal = [packed_logprobs(lm, mb.packed, mb.temperature) for mb in chunks]
            if self.cfg.kl_coef > 0:
                with self._reference() as ref:
                    reference = [packed_logprobs(ref, mb.packed, mb.temperature) for mb in chunks]

        self.model.train()
        totals = torch.zeros(4, dtype=torch.float64)  # loss, clipped tokens, approx_kl, kl_ref: summed over ranks
        grad_norm = 0.0
        parts = batch.minibatches
        for part, part_tokens in zip(parts, batch.minibatch_tokens, strict=True):
            self.optimizer.zero_grad(set_to_none=True)
            for k in part:
                mb = chunks[k]
                logp = packed_logprobs(lm, mb.packed, mb.temperature)
                prox = proximal[k] if proximal[k] is not None else \
                    (logp.detach() if self.cfg.loss == "decoupled" else None)
                loss, st = rl.policy_loss(logp, mb.behaviour, mb.advantages, mb.weight, part_tokens,
                                          clip_eps=self.cfg.clip_eps, proximal_logp=prox, is_cap=self.cfg.is_cap,
                                          dual_clip=self.cfg.dual_clip or None)
                kl = torch.zeros(())
                if reference[k] is not None:
                    kl = (rl.kl_k3(logp, reference[k]) * mb.weight).sum() / part_tokens
                    loss = loss + self.cfg.kl_coef * kl
                if not math.isfinite(float(loss.detach())):
                    self._skip_nonfinite(f"loss {float(loss.detach())}")
                    if self.world == 1:
                        continue
                    # the other ranks' passes wait for this one's collectives: run it; the step is skipped
                # The ranks' gradients are averaged (ZeRO): each rank's share of the sum, times the ranks.
                self.backward(loss * self.world if self.world > 1 else loss)
                totals += torch.tensor([float(loss.detach()) / len(parts), st["clipped"], st["approx_kl"],
                                        float(kl.detach()) / len(parts)], dtype=torch.float64)
            grad_norm += self.optimizer_step() / len(parts)
        self.model.eval()
        live = [mb for mb in chunks if bool(mb.weight.any())]
        counts = torch.tensor([sum(mb.packed.num_rows for mb in live), float(len(live)),
                               sum(len(t.tokens) for t in batch.trajs)], dtype=torch.float64)
        loss_sum, clipped, approx_kl, kl_ref = self.all_reduce(totals).tolist()
        rows, micro_batches, unshared = self.all_reduce(counts).tolist()
        return {"train/loss": loss_sum, "train/clipfrac": clipped / batch.num_tokens,
                "train/approx_kl": approx_kl / batch.num_tokens, "train/kl_ref": kl_ref, "train/grad_norm": grad_norm,
                "train/tokens": float(batch.num_tokens), "train/packed_rows": rows, "train/unshared_rows": unshared,
                "train/micro_batches": micro_batches, "train/lr": self.current_lr()}

    def _sft(self, demos: list[Trajectory]) -> dict[str, float]:
        """Cross-entropy on the assistant tokens of successful trajectories (oracle warm start); with
        ``sft_context_weight`` > 0 also on the context after the system message (task, tool results).
        ``demos`` is this rank's share (maybe none); the normaliser is the whole batch's token count.
        Called by ``train_share``, which has set this step's learning rate."""
        lm = PackedLM(self.model)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        own = [[int(m) for m in t.loss_mask] for t in demos]
        context_weight = self.cfg.sft_context_weight
        scored = [_or(o, _context_mask(t)) for o, t in zip(own, demos, strict=True)] if context_weight > 0 else own
        num_tokens = int(self.all_reduce(torch.tensor([float(sum(sum(o[1:]) for o in own))], dtype=torch.float64)))
        chunks = self._micro_batches(demos, scored) if demos else []
        passes = int(self.all_reduce(torch.tensor([float(len(chunks))], dtype=torch.float64), op="max"))
        totals = torch.zeros(4, dtype=torch.float64)  # loss, context loss sum, context tokens, demos: over ranks
        for mb in chunks:
            logp = packed_logprobs(lm, mb, torch.ones(mb.targets.numel()))
            is_own = torch.cat([torch.tensor(own[i], dtype=torch.bool)[_positions(scored[i])] for i in mb.order])
            # normalised by the assistant tokens alone: the context term adds to, never dilutes, the SFT loss
            loss = -(logp[is_own].sum() + context_weight * logp[~is_own].sum()) / num_tokens
            if not math.isfinite(float(loss.detach())):
                self._skip_nonfinite(f"loss {float(loss.detach())}")
                if self.world == 1:
                    continue
            self.backward(loss * self.world if self.world > 1 else loss)  # ranks' gradients are averaged
            totals += torch.tensor([float(-logp[is_own].detach().sum()) / num_tokens,
                                    float(-logp[~is_own].detach().sum()), float((~is_own).sum()), 0.0],
                                   dtype=torch.float64)
        for _ in range(passes - len(chunks)):  # a rank with fewer micro-batches keeps ZeRO's collectives in step
            pad = _padding_pass()
            self.backward(packed_logprobs(lm, pad.packed, pad.temperature).sum() * 0.0)
        totals[3] = float(len(demos))
        grad_norm = self.optimizer_step()
        self.model.eval()
        total, context_total, context_tokens, num_demos = self.all_reduce(totals).tolist()
        stats = {"train/loss": total, "train/grad_norm": grad_norm, "train/tokens": float(num_tokens),
                 "train/sft_trajectories": num_demos, "train/lr": self.current_lr()}
        if context_tokens:
            stats["train/context_loss"] = context_total / context_tokens
        return stats

    def _batch_stats(self, trajs: list[Trajectory]) -> dict[str, float]:
        stats: dict[str, float] = {"train/trajectories": float(len(trajs))}
        stats.update(_task_stats([EpisodeOutcome.of(t) for t in trajs]))
        # versions behind the policy being trained, per policy turn trained on (oracle turns, -1, have none)
        staleness = [self.policy_version - turn.policy_version for t in trajs for turn in t.turns
                     if turn.policy_version >= 0]
        if staleness:
            stats["train/staleness_mean"] = sum(staleness) / len(staleness)
            stats["train/staleness_max"] = float(max(staleness))
            for lag, n in Counter(min(lag, STALENESS_BINS - 1) for lag in staleness).items():
                stats[f"train/staleness_hist/{lag}"] = float(n)  # the dashboard's "staleness of trained turns"
        return stats

    # ------------------------------------------------------------------ backend hooks
    # Plain torch here; services/trainer/deepspeed_backend.py overrides both (ZeRO owns grads and step).
    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def current_lr(self) -> float:
        """Linear warm-up to ``lr`` over ``warmup_steps`` optimizer steps of this run, then constant."""
        if self.cfg.warmup_steps <= 0:
            return self.cfg.lr
        return self.cfg.lr * min(1.0, (self.step + 1) / self.cfg.warmup_steps)

    def _apply_lr_schedule(self) -> None:
        for group in getattr(self.optimizer, "param_groups", []):  # a ZeRO wrapper keeps its own schedule
            group["lr"] = self.current_lr()

    def optimizer_step(self) -> float:
        """Clip, step; the gradient norm before clipping. A non-finite gradient (or loss) skips the step:
        the weights stay as they were, the step is counted (``train/nonfinite_skipped``)."""
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm))
        if not math.isfinite(grad_norm) or self._step_nonfinite:
            self._skip_nonfinite(f"gradient norm {grad_norm}")
            return 0.0
        self.optimizer.step()
        self._stepped = True
        return grad_norm

    def _skip_nonfinite(self, what: str) -> None:
        if self.world == 1:  # several ranks: mid-pass gradients are ZeRO's; DeepSpeed skips the step itself
            self.optimizer.zero_grad(set_to_none=True)
        if not self._step_nonfinite:
            self.counters["train/nonfinite_skipped"] += 1
            log.warning("nonfinite_step_skipped", step=self.step + 1, what=what)
        self._step_nonfinite = True

    # ------------------------------------------------------------------ weights and records
    async def publish_weights(self) -> float:
        started = time.monotonic()
        # LoRA: only the adapter travels, as (A, scaled B) pairs; every replica adds B @ A to its base weights
        data = await asyncio.to_thread(lora_delta_bytes if self.lora else weights_to_bytes, self.model,
                                       self.cfg.broadcast_dtype)
        # the bucket lookups too (a STREAM.INFO request): on a cluster that just lost the node this client was on,
        # or the bucket's leader, the request times out until the client reconnects and a new leader is elected
        store = await retrying("weights_bucket", lambda: self.js.object_store(self.subjects.weights_bucket))
        name = self.subjects.weights_object(self.policy_version)
        # 1 MiB chunks: ~1.6x the put rate and faster reads than nats-py's 128 KiB default
        # (docs/benchmarks/scale_out.md); well under the server's max_payload.
        meta = ObjectMeta(name=name, options=ObjectMetaOptions(max_chunk_size=1024 * 1024))
        # retried across a NATS restart: a put again replaces the object, the KV write and announcement repeat
        await retrying("weights_put", lambda: store.put(name, data, meta=meta))
        # BLAKE3 (shared/digest.py): each replica checks its copy against it in one pass while the chunks arrive
        note = WeightsAnnouncement(version=self.policy_version, object_name=name,
                                   digest=await asyncio.to_thread(digest, data), size=len(data),
                                   dtype=self.cfg.broadcast_dtype, format="lora" if self.lora else "full")
        if self.signer is not None:  # the announcement vouches for the weights: their digest is in what is signed
            note = self.signer.sign(note)
        self.published_digests[note.version] = note.digest  # every turn played with this version must name it
        for old in sorted(self.published_digests)[:-256]:  # far beyond any staleness bound
            del self.published_digests[old]
        kv = await retrying("policy_kv", lambda: self.js.key_value(self.subjects.policy_kv))
        await retrying("policy_kv_put", lambda: kv.put(self.subjects.policy_version_key, encode(note)))
        await self.nc.publish(self.subjects.weights_published, encode(note))
        old = self.policy_version - self.cfg.keep_weight_versions
        if old >= 1:
            try:
                await store.delete(self.subjects.weights_object(old))
            except Exception as exc:
                log.warning("old_weights_delete_failed", version=old, error=repr(exc))
        return time.monotonic() - started

    def _record(self, stats: dict[str, Any]) -> None:
        row = {"step": self.step, "policy_version": self.policy_version, "ts": time.time(), **stats}
        with open(self.metrics_file, "a") as fh:
            fh.write(json.dumps(row) + "\n")
        if self.tensorboard is not None:
            _write_tensorboard(self.tensorboard, self.step, row["ts"], stats)
        tasks = sorted({k.split("/")[1] for k in stats if k.startswith("task/") and k.endswith("/success")})
        per_task = " ".join(f"{t}={stats[f'task/{t}/success']:.2f}" for t in tasks)
        log.info("train_step", step=self.step, of=self.cfg.steps, trajectories=int(stats["train/trajectories"]),
                 success=per_task, loss=round(stats.get("train/loss", 0.0), 5),
                 seconds=round(stats["train/step_s"], 2))
        scalars = {k: float(v) for k, v in stats.items() if isinstance(v, (int, float))}
        for key, values in stats.items():  # histograms (task/<t>/adv_hist) travel as one scalar per bin
            if isinstance(values, list):
                scalars.update({f"{key}/{i}": float(x) for i, x in enumerate(values)})
        supervise(publish_metrics(self.nc, self.subjects, "trainer", self.replica_id, self.step, scalars),
                  "metrics_publish", None)


def _vocab_size(model: Any) -> int | None:
    """Rows of the model's input embedding: a token id at or past it would crash the forward pass."""
    embeddings = getattr(model, "get_input_embeddings", None)
    return int(embeddings().num_embeddings) if callable(embeddings) else None


def _positions(marks: list[int]) -> list[int]:
    """Trained positions (token ``t`` scored from the hidden state of ``t - 1``, so never 0), in the
    order ``services.trainer.packing.pack`` lays their logprobs out."""
    return [t for t in range(1, len(marks)) if marks[t]]


def _task_stats(outcomes: list[EpisodeOutcome]) -> dict[str, float]:
    """Per task: episodes, success and reward rates, turns per episode, env errors."""
    by_task: dict[str, list[EpisodeOutcome]] = defaultdict(list)
    for o in outcomes:
        by_task[o.task].append(o)
    stats: dict[str, float] = {}
    for task, items in sorted(by_task.items()):
        stats[f"task/{task}/episodes"] = float(len(items))
        stats[f"task/{task}/success"] = sum(o.success for o in items) / len(items)
        stats[f"task/{task}/reward"] = sum(o.reward for o in items) / len(items)
        stats[f"task/{task}/turns"] = sum(o.turns for o in items) / len(items)
        stats[f"task/{task}/env_errors"] = float(sum(o.env_error for o in items))
    return stats


def _rl_trainable(traj: Trajectory) -> bool:
    """An RL step trains on a trajectory without an env error, with trained tokens, whose turns all come
    from a policy: oracle turns (version -1) have no behaviour logprobs to correct with."""
    return (traj.status != EpisodeStatus.ENV_ERROR and sum(traj.loss_mask) > 0
            and all(turn.policy_version >= 0 for turn in traj.turns))


def _trained_positions(traj: Trajectory) -> list[int]:
    return _positions(traj.loss_mask)


def _balance(shares: list[RankShare]) -> dict[str, float]:
    """How even a split is: the fewest and most tokens a rank runs (several ranks only)."""
    if len(shares) < 2:
        return {}
    loads = [sum(len(t.tokens) for t in share.trajs) for share in shares]
    return {"train/rank_tokens_min": float(min(loads)), "train/rank_tokens_max": float(max(loads))}


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat`` that also takes no parts (a rank whose share is empty)."""
    return torch.cat(parts) if parts else torch.zeros(0)


def _padding_pass() -> MicroBatch:
    """A pass that changes no gradient (weight 0 on its one token), for a rank with fewer micro-batches
    than the others in a minibatch, or none: its collectives keep in step with theirs."""
    packed = pack([[0, 0]], [[0, 1]], [0])
    zero = torch.zeros(1)
    return MicroBatch(packed, zero, zero, torch.ones(1), zero)


def _per_token(values: list[float], mb: PackedBatch) -> torch.Tensor:
    """One value per trajectory, repeated over its trained tokens in the micro-batch's layout."""
    return torch.cat([torch.full((n,), float(values[i])) for i, n in zip(mb.order, mb.trained_per_traj, strict=True)])


def _or(a: list[int], b: list[int]) -> list[int]:
    return [int(x or y) for x, y in zip(a, b, strict=True)]


def _context_mask(traj: Trajectory) -> list[int]:
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


ADV_HIST_RANGE = (-3.0, 3.0)
"""The range ``task/<t>/adv_hist`` bins (``torch.histc`` in ``_rl_batch``), for TensorBoard's histograms."""


def _tensorboard_writer(run_dir: Path) -> Any:
    """A TensorBoard event writer in the run directory (``tensorboard --logdir runs`` shows every run),
    or None where the ``tensorboard`` package is missing (metrics.jsonl is the record either way)."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        log.warning("tensorboard_unavailable", error=str(exc))
        return None
    return SummaryWriter(log_dir=str(run_dir), flush_secs=30)


def _write_tensorboard(writer: Any, step: int, ts: float, stats: dict[str, Any]) -> None:
    """Every scalar of a metrics.jsonl row under its own key; histograms (lists of bin counts) as
    TensorBoard histograms. Flushed each step: a step is seconds to minutes, so this costs nothing."""
    for key, value in stats.items():
        if isinstance(value, bool | int | float):
            writer.add_scalar(key, float(value), step, walltime=ts)
        elif isinstance(value, list) and value and key.endswith("_hist"):
            lo, hi = ADV_HIST_RANGE
            width = (hi - lo) / len(value)
            limits = [lo + width * (i + 1) for i in range(len(value))]
            centres = [lo + width * (i + 0.5) for i in range(len(value))]
            count = float(sum(value))
            if count > 0:
                writer.add_histogram_raw(key, min=lo, max=hi, num=count,
                                         sum=sum(c * n for c, n in zip(centres, value, strict=True)),
                                         sum_squares=sum(c * c * n for c, n in zip(centres, value, strict=True)),
                                         bucket_limits=limits, bucket_counts=[float(n) for n in value],
                                         global_step=step, walltime=ts)
    writer.flush()
