"""The unified env API: the requests and replies between a rollout and an env service, and how an episode
ends (``EpisodeStatus``). docs/env-protocol.md is the spec; ``jetrl schema`` makes its field tables from here."""

from __future__ import annotations

from typing import Any

import msgspec

from shared.messages.base import Message, SubjectToken


class EnvStart(Message, tag="env_start", kw_only=True):
    """Open a session of one task (request of ``env.<task>.start``); the reply is EnvStarted."""

    session_id: str
    """Chosen by the caller, unique per episode attempt; every later call of the session names it."""
    task_id: str
    """One of the ids the split's ``tasks`` endpoint lists."""
    split: str = "train"
    """``train`` or ``test``."""
    seed: int = 0
    """For whatever the episode draws at random (the task itself is fixed by its id); 0 .. 2**32 - 1."""


class EnvStarted(Message, tag="env_started", kw_only=True):
    """The opening of an episode: OpenAI-format messages and tool schemas."""

    session_id: str
    """The request's session id."""
    replica_id: SubjectToken
    """The replica that holds the session: interact, cancel and oracle go to its own subjects."""
    messages: list[dict[str, Any]]
    """The opening conversation, OpenAI chat format (``{"role": "system" | "user", "content": str}``)."""
    tools: list[dict[str, Any]]
    """The tools, OpenAI function-calling schemas (``{"type": "function", "function": {"name", "description",
    "parameters"}}``)."""
    max_turns: int
    """The most assistant turns the episode takes; the env ends it at that turn at the latest."""
    level: int = 0
    """The task's difficulty level (1 easy .. 3 hard; 0 = none), for per-level reports."""
    task_kind: str = ""
    """The task's kind (a question shape, a task family; "" = none), for per-kind reports."""


class EnvInteract(Message, tag="env_interact", kw_only=True):
    """One assistant message in OpenAI format (``content`` and optional ``tool_calls``)."""

    session_id: str
    """The session this turn belongs to."""
    message: dict[str, Any]
    """``{"role": "assistant", "content": str, "tool_calls": [{"id", "type": "function", "function": {"name",
    "arguments": JSON text}}]}``; ``invalid_tool_call`` (text) instead where the agent wrote a call that
    could not be read."""
    turn: int = -1
    """The turn this message plays (0, 1, ...): a retried request for the same turn (its reply was lost
    in a NATS reconnect) gets the first reply again instead of running the tool twice. -1 = no dedupe."""


class EnvOracle(Message, tag="env_oracle", kw_only=True):
    """Ask for the oracle's next assistant message; the reply is an EnvInteract-shaped message."""

    session_id: str
    """The session whose next move is asked for (the oracle reads its state; nothing is played)."""


class EnvCancel(Message, tag="env_cancel", kw_only=True):
    """End a session now (request of ``cancel``); the reply is an EnvStep with status ``cancelled``."""

    session_id: str
    """The session to end."""
    reason: str = "cancelled"
    """Why the caller ends it (``task_limit_reached``, ``agent_context_limit``, ``rollout_aborted``), for logs."""


class EnvStep(Message, tag="env_step", kw_only=True):
    """The env's answer to interact or cancel: ``{finish, reward, status, messages, metrics}``."""

    finish: bool
    """The episode is over; its session is closed."""
    reward: float
    """In [0, 1]; the final reward once ``finish`` (1.0 = success), 0 before."""
    status: str
    """``running`` until the end, then how it ended (EpisodeStatus)."""
    messages: list[dict[str, Any]]
    """The observation: ``{"role": "tool", "tool_call_id", "content": str}`` answering a tool call, or
    ``{"role": "user", "content": str}``; empty on cancel."""
    metrics: dict[str, float] = msgspec.field(default_factory=dict)
    """Per-episode figures; ``turns`` and ``invalid_actions`` (turns whose call was refused) always."""


class EnvTaskList(Message, tag="env_task_list", kw_only=True):
    """Request (``task_ids`` empty) and reply: the ids of one split's tasks, stable across replicas."""

    split: str
    """``train`` or ``test``."""
    task_ids: list[str] = msgspec.field(default_factory=list)
    """In the request: empty. In the reply: every task of the split, in a fixed order, the same on every replica."""


class EnvHealth(Message, tag="env_health", kw_only=True):
    """A replica's answer on ``health`` (the request is empty)."""

    replica_id: str
    """The answering replica."""
    task: str
    """The task it serves."""
    sessions: int
    """Sessions open now."""
    max_sessions: int
    """Its limit: a start beyond it is refused (503)."""
    sessions_started: int
    """Sessions opened since the replica started."""
    uptime_s: float
    """Seconds since the replica started."""
    task_counts: dict[str, int] = msgspec.field(default_factory=dict)
    """Tasks per split (``{"train": n, "test": m}``)."""
    interact_ms_p50: float = 0.0
    """Time the replica took to answer its recent interact calls (up to 10,000): from the request's
    dispatch to its reply, waits for the session and the worker pool included."""
    interact_ms_p99: float = 0.0
    """The same, 99th percentile."""


class EpisodeStatus:
    """Statuses an episode can end with (AgentBench's names where it has them)."""

    RUNNING = "running"
    """Not over: every step before the last."""
    COMPLETED = "completed"
    """The agent gave its answer and it was graded (the reward says how well)."""
    TASK_LIMIT_REACHED = "task_limit_reached"
    """The turn limit came first (reward 0)."""
    INVALID_ACTION = "invalid_action"
    """A turn without a usable tool call ended the episode (where the env is set to end it so; reward 0)."""
    AGENT_CONTEXT_LIMIT = "agent_context_limit"
    """The agent's context is full (set by the rollout, which cancels the session)."""
    ENV_ERROR = "env_error"
    """The env failed (a tool raised): not the agent's fault, reward 0."""
    CANCELLED = "cancelled"
    """Ended by a cancel request."""
    TIMEOUT = "timeout"
    """Closed by the env after the session went idle (no reply is sent: nobody is waiting)."""
    ENV_TIMEOUT = "env_timeout"
    """A tool call ran past ``env.action_timeout_s``: the episode ends (its tool may still be running)."""
