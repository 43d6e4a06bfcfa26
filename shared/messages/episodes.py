"""An episode's messages, from its job to its trajectory: the job (stream JOBS), its events (stream
EPISODES), the trajectory (stream TRAJ), and the generation pool's turn requests on the way."""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from shared.messages.base import (
    BadMessage,
    LogProb,
    LossMask,
    Message,
    NewTokens,
    SubjectPart,
    SubjectToken,
    Temperature,
    TokenId,
    now,
)


# --------------------------------------------------------------------------------------------- #
# Episode assignments (controller -> rollout, stream JOBS)
# --------------------------------------------------------------------------------------------- #
class EpisodeJob(Message, tag="episode_job", kw_only=True):
    """One episode to play. The ``group_size`` episodes of a group share ``task_id`` (GRPO)."""

    episode_id: SubjectPart
    group_id: SubjectPart
    task: SubjectToken
    task_id: str
    split: str = "train"
    group_size: Annotated[int, msgspec.Meta(ge=1)] = 1
    temperature: Temperature = 1.0
    max_new_tokens: NewTokens = 128
    created_at: float = msgspec.field(default_factory=now)
    policy_version: int = -1
    """Synchronous mode (``controller.sync``): the policy version to play with; a rollout replica loads it
    before the first turn. -1 = whatever version the replica holds (asynchronous)."""


# --------------------------------------------------------------------------------------------- #
# Episode events (stream EPISODES): every action and observation, in order
# --------------------------------------------------------------------------------------------- #
class ActionEvent(Message, tag="action", kw_only=True):
    episode_id: str
    task: str
    turn: int
    replica_id: str
    engine_id: str
    policy_version: int
    message: dict[str, Any]
    ts: float = msgspec.field(default_factory=now)
    opening: list[dict[str, Any]] = msgspec.field(default_factory=list)
    """Turn 0 only: the env's opening messages (system prompt and task, OpenAI format), so that a reader of
    the EPISODES stream (the trajectory viewer) sees what the episode was about; empty on later turns."""


class ObservationEvent(Message, tag="observation", kw_only=True):
    episode_id: str
    task: str
    turn: int
    messages: list[dict[str, Any]]
    reward: float
    finish: bool
    status: str
    ts: float = msgspec.field(default_factory=now)


# --------------------------------------------------------------------------------------------- #
# Trajectories (stream TRAJ): one record per finished episode, token-in/token-out
# --------------------------------------------------------------------------------------------- #
class TurnInfo(msgspec.Struct, kw_only=True):
    """Span ``[start, end)`` of the tokens one engine generated in one turn, and who made them.

    Not a message of its own: inside a Trajectory it is a plain map, without kind or version.
    ``policy_version`` is -1 for the env's oracle (no policy made those tokens).
    """

    start: int
    end: int
    engine_id: str
    policy_version: int
    weights_digest: str = ""
    """The digest (``WeightsAnnouncement.digest``) of the weights the engine held for this turn, which the trainer
    checks against the one it signed for ``policy_version``; empty for the initial weights (version 0), the
    oracle's and an API model's turns."""


class Trajectory(Message, tag="trajectory", kw_only=True):
    """Exact sampled token ids with their behaviour logprobs; loss mask = assistant tokens only."""

    episode_id: str
    group_id: str
    task: str
    task_id: str
    split: str
    group_size: int
    tokens: list[TokenId]
    logprobs: list[LogProb]
    loss_mask: list[LossMask]
    prompt_len: int
    turns: list[TurnInfo]
    reward: float
    status: str
    replica_id: str
    metrics: dict[str, float] = msgspec.field(default_factory=dict)
    temperature: float = 1.0
    """Sampling temperature of the behaviour policy (the trainer scores tokens at the same one)."""
    created_at: float = msgspec.field(default_factory=now)
    level: int = 0
    """The task's level and kind as its env reports them (``EnvStarted``)."""
    task_kind: str = ""
    messages: list[dict[str, Any]] = msgspec.field(default_factory=list)
    """The episode as an OpenAI conversation: the env's opening messages, then each turn's assistant
    message exactly as the env received it (the action log ``jetrl reverify`` replays) followed by the
    env's answer. Empty for an episode the env could not run, or from a writer that does not record it."""
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)
    """The episode's tool schemas (OpenAI function-calling form), as the env opened it."""

    def __post_init__(self) -> None:
        super().__post_init__()
        n = len(self.tokens)
        if len(self.logprobs) != n or len(self.loss_mask) != n:
            raise BadMessage(f"trajectory {self.episode_id}: tokens/logprobs/loss_mask lengths differ "
                             f"({n}/{len(self.logprobs)}/{len(self.loss_mask)})")
        for i, turn in enumerate(self.turns):
            if not 0 <= turn.start <= turn.end <= n:
                raise BadMessage(f"trajectory {self.episode_id}: turns[{i}] spans [{turn.start}, {turn.end}), "
                                 f"outside its {n} tokens (0 <= start <= end <= len(tokens))")

    @property
    def min_policy_version(self) -> int:
        return min((t.policy_version for t in self.turns), default=-1)

    @property
    def success(self) -> bool:
        return self.reward >= 1.0


# --------------------------------------------------------------------------------------------- #
# Generation pool (cross-policy sampling): any rollout replica may ask any engine for one turn
# --------------------------------------------------------------------------------------------- #
class GenerateRequest(Message, tag="generate_request", kw_only=True):
    prompt: list[TokenId]
    max_new_tokens: NewTokens
    temperature: Temperature


class GenerateReply(Message, tag="generate_reply", kw_only=True):
    """Sampled token ids and behaviour logprobs, with the engine and policy version that made them."""

    tokens: list[TokenId]
    logprobs: list[LogProb]
    finish_reason: str
    engine_id: str
    policy_version: int
    weights_digest: str = ""
    """The digest of the weights that engine held (``TurnInfo.weights_digest``)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if len(self.tokens) != len(self.logprobs):
            raise BadMessage(f"generate_reply: tokens/logprobs lengths differ "
                             f"({len(self.tokens)}/{len(self.logprobs)})")
