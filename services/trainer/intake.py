"""The trainer's intake: trajectories from its durable on TRAJ, judged one by one (schema, vocabulary,
spans, length bound, the weights digest each turn names), deduplicated, held in groups until a group is
complete (or old), touched while held so nothing is redelivered, and acked once trained on or left out.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from services.trainer.batch import rl_trainable
from services.trainer.records import EpisodeOutcome
from shared.config import RolloutConfig, TrainerConfig
from shared.delivery import dead_letter, decode_or_dead_letter, retrying, term_quietly
from shared.keepalive import keep_touching
from shared.messages import Trajectory
from shared.subjects import Subjects

log = structlog.get_logger()

FLAT_GROUPS_WARNING = 16  # filter_flat_groups: a warning every this many groups left out without a step


@dataclass
class Held:
    """A trajectory the trainer holds, and the message to ack (the newest delivery of it)."""

    traj: Trajectory
    msg: Msg


@dataclass
class Group:
    group_id: str
    size: int
    first_seen: float = field(default_factory=time.monotonic)
    items: dict[str, Held] = field(default_factory=dict)  # episode id -> its trajectory

    def complete(self) -> bool:
        return len(self.items) >= self.size

    def add(self, traj: Trajectory, msg: Msg) -> None:
        self.items[traj.episode_id] = Held(traj, msg)

    def trajectories(self) -> list[Trajectory]:
        return [h.traj for h in self.items.values()]

    def messages(self) -> list[Msg]:
        return [h.msg for h in self.items.values()]


def vocab_size(model: Any) -> int | None:
    """Rows of the model's input embedding: a token id at or past it would crash the forward pass."""
    embeddings = getattr(model, "get_input_embeddings", None)
    return int(embeddings().num_embeddings) if callable(embeddings) else None


async def ack_all(msgs: list[Msg]) -> None:
    """Ack each message (retried across a reconnect); one whose ack is lost is redelivered later and then
    acked as already seen."""
    for msg in msgs:
        try:
            await retrying("trajectory_ack", msg.ack)
        except Exception as exc:
            log.warning("trajectory_ack_failed", error=repr(exc))


class Intake:
    def __init__(self, js: JetStreamContext, subjects: Subjects, cfg: TrainerConfig, counters: dict[str, float],
                 published_digests: dict[int, str], vocab_size: int | None) -> None:
        self.js, self.subjects, self.cfg, self.counters = js, subjects, cfg, counters
        self.published_digests = published_digests  # version -> digest we announced (checked in each turn)
        self.vocab_size = vocab_size
        self.context_tokens = RolloutConfig().max_context_tokens  # the run's rollout.max_context_tokens (__main__)
        self.groups: dict[str, Group] = {}
        # episode id -> its group while held; ids of trained ones are kept (bounded) to drop duplicates
        self.seen_episodes: OrderedDict[str, str] = OrderedDict()
        self.in_step: list[Msg] = []  # the messages of the step being taken (acked after it)
        self.flat: list[EpisodeOutcome] = []  # episodes of groups left out since the last step
        self.flat_groups_since_step = 0

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

    async def take(self, msg: Msg) -> None:
        """One delivered message: held in its group, acked (a duplicate, another split's), or refused."""
        traj = await decode_or_dead_letter(self.js, self.subjects, "trainer", msg, Trajectory)
        if traj is None:
            self.counters["train/dead_lettered"] += 1
            return
        delivered = msg.metadata.num_delivered if msg.metadata else 1
        group_id = self.seen_episodes.get(traj.episode_id)
        if group_id is not None:
            group = self.groups.get(group_id)
            if group is not None and traj.episode_id in group.items:  # held: keep the newest delivery to ack
                group.add(traj, msg)
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
        self.groups.setdefault(traj.group_id, Group(traj.group_id, traj.group_size)).add(traj, msg)

    async def next_batch(self) -> list[Group] | None:
        """The groups of the next step, taken out of the intake: every ready group (complete, or waited
        for past ``group_timeout_s``), oldest first, up to ``max_groups``; None while fewer than
        ``min_groups`` are ready. Flat groups are acked and left out first where the run filters them."""
        now = time.monotonic()
        ready = sorted((g for g in self.groups.values() if g.complete() or now - g.first_seen > self.cfg.group_timeout_s),
                       key=lambda g: g.first_seen)
        if self.cfg.filter_flat_groups and self.cfg.mode == "rl":
            ready = await self._drop_flat_groups(ready)
        if len(ready) < self.cfg.min_groups:
            return None
        batch = ready[: self.cfg.max_groups]
        for g in batch:
            del self.groups[g.group_id]
        return batch

    async def _drop_flat_groups(self, ready: list[Group]) -> list[Group]:
        """``trainer.filter_flat_groups``: ack and leave out the ready groups whose trainable episodes all
        got one reward. Their advantages are all zero: training on them costs a forward and backward pass
        and adds only zeros to the loss, whose token count they still dilute; a step of flat groups alone
        changes nothing. Their episodes still count in the next step's per-task success (``flat``)."""
        keep = []
        for group in ready:
            rewards = {t.reward for t in group.trajectories() if rl_trainable(t)}
            if len(rewards) > 1:
                keep.append(group)
                continue
            del self.groups[group.group_id]
            # for the step's per-task figures only: a long wait for signal holds outcomes, not whole contexts
            self.flat.extend(EpisodeOutcome.of(t) for t in group.trajectories())
            self.counters["train/flat_groups"] += 1
            self.flat_groups_since_step += 1
            if self.flat_groups_since_step % FLAT_GROUPS_WARNING == 0:  # no step comes while this lasts: say why
                log.warning("no_signal", flat_groups_since_last_step=self.flat_groups_since_step,
                            rewards=sorted(rewards), hint="every group's episodes got one reward (the tasks are "
                            "too hard or too easy for the policy); filter_flat_groups waits for groups with signal")
            await ack_all(group.messages())
        return keep

    def take_flat(self) -> list[EpisodeOutcome]:
        """The outcomes of groups left out since the last step (which then counts them)."""
        flat, self.flat, self.flat_groups_since_step = self.flat, [], 0
        return flat

    def begin_step(self, groups: list[Group]) -> None:
        """The step's trajectories stay touched (``keep_held``) until ``finish_step`` acks them."""
        self.in_step = [m for g in groups for m in g.messages()]

    async def finish_step(self, groups: list[Group]) -> None:
        """After the step that used them: ack the groups' trajectories, hold nothing for the step."""
        await ack_all([m for g in groups for m in g.messages()])
        self.in_step = []

    def held(self) -> list[Msg]:
        """Every trajectory we hold: the waiting groups' and the step's being taken."""
        return [h.msg for g in list(self.groups.values()) for h in list(g.items.values())] + list(self.in_step)

    async def keep_held(self, stop: asyncio.Event) -> None:
        """``in_progress`` for every trajectory we hold, every quarter of ack_wait: while we live nothing is
        redelivered; when we die it all is, within ack_wait."""
        await keep_touching(self.held, max(0.5, self.cfg.ack_wait_s / 4), "trajectory", stop)
