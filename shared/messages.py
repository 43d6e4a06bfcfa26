"""Every message type that crosses a NATS subject, and the one msgpack codec for all of them.

Each message is a dataclass with a ``KIND`` and a schema ``VERSION``. On the wire it is a msgpack map
``{"kind": KIND, "v": VERSION, **fields}``. ``decode(data, Type)`` either returns a fully
type-checked instance or raises ``BadMessage`` with the reason: the boundary of every service.
Readers accept any message whose version is ``<= VERSION`` for fields they know; a newer major
version is refused rather than misread.
"""

from __future__ import annotations

import dataclasses
import time
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import msgpack

MAX_MESSAGE_BYTES = 8 * 1024 * 1024
"""Largest message the codec accepts. nats-server's max_payload must be at least this (see natsd)."""


class BadMessage(ValueError):
    """A message that cannot be accepted: undecodable, wrong kind/version, wrong types, too large."""

    def __init__(self, reason: str, code: int = 400) -> None:
        super().__init__(reason)
        self.reason = reason
        self.code = code


def now() -> float:
    return time.time()


# --------------------------------------------------------------------------------------------- #
# Episode assignments (controller -> rollout, stream JOBS)
# --------------------------------------------------------------------------------------------- #
@dataclass
class EpisodeJob:
    """One episode to play. The ``group_size`` episodes of a group share ``task_id`` (GRPO)."""

    KIND: ClassVar[str] = "episode_job"
    VERSION: ClassVar[int] = 1

    episode_id: str
    group_id: str
    task: str
    task_id: str
    split: str = "train"
    group_size: int = 1
    temperature: float = 1.0
    max_new_tokens: int = 128
    created_at: float = field(default_factory=now)


# --------------------------------------------------------------------------------------------- #
# Unified function-call environment API (rollout <-> env services, request/reply)
# --------------------------------------------------------------------------------------------- #
@dataclass
class EnvStart:
    KIND: ClassVar[str] = "env_start"
    VERSION: ClassVar[int] = 1

    session_id: str
    task_id: str
    split: str = "train"
    seed: int = 0


@dataclass
class EnvStarted:
    """The opening of an episode: OpenAI-format messages and tool schemas."""

    KIND: ClassVar[str] = "env_started"
    VERSION: ClassVar[int] = 1

    session_id: str
    replica_id: str
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]]
    max_turns: int


@dataclass
class EnvInteract:
    """One assistant message in OpenAI format (``content`` and optional ``tool_calls``)."""

    KIND: ClassVar[str] = "env_interact"
    VERSION: ClassVar[int] = 1

    session_id: str
    message: dict[str, Any]


@dataclass
class EnvOracle:
    """Ask for the oracle's next assistant message; the reply is an EnvInteract-shaped message."""

    KIND: ClassVar[str] = "env_oracle"
    VERSION: ClassVar[int] = 1

    session_id: str


@dataclass
class EnvCancel:
    KIND: ClassVar[str] = "env_cancel"
    VERSION: ClassVar[int] = 1

    session_id: str
    reason: str = "cancelled"


@dataclass
class EnvStep:
    """The env's answer to interact or cancel: ``{finish, reward, status, messages, metrics}``."""

    KIND: ClassVar[str] = "env_step"
    VERSION: ClassVar[int] = 1

    finish: bool
    reward: float
    status: str
    messages: list[dict[str, Any]]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class EnvTaskList:
    """Request (``task_ids`` empty) and reply: the ids of one split's tasks, stable across replicas."""

    KIND: ClassVar[str] = "env_task_list"
    VERSION: ClassVar[int] = 1

    split: str
    task_ids: list[str] = field(default_factory=list)


@dataclass
class EnvHealth:
    KIND: ClassVar[str] = "env_health"
    VERSION: ClassVar[int] = 1

    replica_id: str
    task: str
    sessions: int
    max_sessions: int
    sessions_started: int
    uptime_s: float
    task_counts: dict[str, int] = field(default_factory=dict)


class EpisodeStatus:
    """Statuses an episode can end with (AgentBench's names where it has them)."""

    RUNNING = "running"
    COMPLETED = "completed"
    TASK_LIMIT_REACHED = "task_limit_reached"
    INVALID_ACTION = "invalid_action"
    AGENT_CONTEXT_LIMIT = "agent_context_limit"
    ENV_ERROR = "env_error"
    CANCELLED = "cancelled"
    TIMEOUT = "timeout"


# --------------------------------------------------------------------------------------------- #
# Episode events (stream EPISODES): every action and observation, in order
# --------------------------------------------------------------------------------------------- #
@dataclass
class ActionEvent:
    KIND: ClassVar[str] = "action"
    VERSION: ClassVar[int] = 1

    episode_id: str
    task: str
    turn: int
    replica_id: str
    engine_id: str
    policy_version: int
    message: dict[str, Any]
    ts: float = field(default_factory=now)


@dataclass
class ObservationEvent:
    KIND: ClassVar[str] = "observation"
    VERSION: ClassVar[int] = 1

    episode_id: str
    task: str
    turn: int
    messages: list[dict[str, Any]]
    reward: float
    finish: bool
    status: str
    ts: float = field(default_factory=now)


# --------------------------------------------------------------------------------------------- #
# Trajectories (stream TRAJ): one record per finished episode, token-in/token-out
# --------------------------------------------------------------------------------------------- #
@dataclass
class TurnInfo:
    """Span ``[start, end)`` of the tokens one engine generated in one turn, and who made them."""

    KIND: ClassVar[str] = "turn"
    VERSION: ClassVar[int] = 1

    start: int
    end: int
    engine_id: str
    policy_version: int


@dataclass
class Trajectory:
    """Exact sampled token ids with their behaviour logprobs; loss mask = assistant tokens only."""

    KIND: ClassVar[str] = "trajectory"
    VERSION: ClassVar[int] = 1

    episode_id: str
    group_id: str
    task: str
    task_id: str
    split: str
    group_size: int
    tokens: list[int]
    logprobs: list[float]
    loss_mask: list[int]
    prompt_len: int
    turns: list[TurnInfo]
    reward: float
    status: str
    replica_id: str
    metrics: dict[str, float] = field(default_factory=dict)
    temperature: float = 1.0
    """Sampling temperature of the behaviour policy (the trainer scores tokens at the same one)."""
    created_at: float = field(default_factory=now)

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if len(self.logprobs) != n or len(self.loss_mask) != n:
            raise BadMessage(
                f"trajectory {self.episode_id}: tokens/logprobs/loss_mask lengths differ "
                f"({n}/{len(self.logprobs)}/{len(self.loss_mask)})"
            )

    @property
    def min_policy_version(self) -> int:
        return min((t.policy_version for t in self.turns), default=-1)

    @property
    def success(self) -> bool:
        return self.reward >= 1.0


# --------------------------------------------------------------------------------------------- #
# Generation pool (cross-policy sampling): any rollout replica may ask any engine for one turn
# --------------------------------------------------------------------------------------------- #
@dataclass
class GenerateRequest:
    KIND: ClassVar[str] = "generate_request"
    VERSION: ClassVar[int] = 1

    prompt: list[int]
    max_new_tokens: int
    temperature: float


@dataclass
class GenerateReply:
    """Sampled token ids and behaviour logprobs, with the engine and policy version that made them."""

    KIND: ClassVar[str] = "generate_reply"
    VERSION: ClassVar[int] = 1

    tokens: list[int]
    logprobs: list[float]
    finish_reason: str
    engine_id: str
    policy_version: int


# --------------------------------------------------------------------------------------------- #
# Weights, registry, metrics, dead letters, run control
# --------------------------------------------------------------------------------------------- #
@dataclass
class WeightsAnnouncement:
    KIND: ClassVar[str] = "weights"
    VERSION: ClassVar[int] = 1

    version: int
    object_name: str
    digest: str
    size: int
    dtype: str
    ts: float = field(default_factory=now)
    format: str = "full"
    """``full``: every weight; ``lora``: an adapter (``shared.model.lora_delta``) to add to the base weights."""


@dataclass
class Heartbeat:
    KIND: ClassVar[str] = "heartbeat"
    VERSION: ClassVar[int] = 1

    role: str
    replica_id: str
    pid: int
    host: str
    started_at: float
    info: dict[str, Any] = field(default_factory=dict)
    ts: float = field(default_factory=now)


@dataclass
class MetricsReport:
    KIND: ClassVar[str] = "metrics"
    VERSION: ClassVar[int] = 1

    role: str
    replica_id: str
    step: int
    values: dict[str, float]
    ts: float = field(default_factory=now)


@dataclass
class DeadLetter:
    KIND: ClassVar[str] = "dead_letter"
    VERSION: ClassVar[int] = 1

    origin_subject: str
    reason: str
    payload: bytes
    service: str
    ts: float = field(default_factory=now)


@dataclass
class RunControl:
    KIND: ClassVar[str] = "run_control"
    VERSION: ClassVar[int] = 1

    event: str
    step: int = 0
    info: dict[str, Any] = field(default_factory=dict)
    ts: float = field(default_factory=now)


# --------------------------------------------------------------------------------------------- #
# Codec
# --------------------------------------------------------------------------------------------- #
M = TypeVar("M")


def encode(msg: Any) -> bytes:
    """Encode a message dataclass; refuses one larger than MAX_MESSAGE_BYTES."""
    body = {"kind": msg.KIND, "v": msg.VERSION}
    body.update(_to_plain(msg))
    data = msgpack.packb(body, use_bin_type=True)
    if len(data) > MAX_MESSAGE_BYTES:
        raise BadMessage(f"{msg.KIND} message is {len(data)} bytes, limit {MAX_MESSAGE_BYTES}", code=413)
    return data


def decode(data: bytes, cls: type[M]) -> M:
    """Decode and validate bytes into ``cls`` or raise BadMessage with the reason."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise BadMessage(f"message is {len(data)} bytes, limit {MAX_MESSAGE_BYTES}", code=413)
    try:
        body = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except Exception as exc:  # msgpack raises several unrelated types
        raise BadMessage(f"not msgpack: {exc}") from None
    if not isinstance(body, dict):
        raise BadMessage(f"expected a msgpack map, got {type(body).__name__}")
    kind, version = body.pop("kind", None), body.pop("v", None)
    if kind != cls.KIND:  # type: ignore[attr-defined]
        raise BadMessage(f"expected kind {cls.KIND!r}, got {kind!r}")  # type: ignore[attr-defined]
    if not isinstance(version, int) or version < 1 or version > cls.VERSION:  # type: ignore[attr-defined]
        raise BadMessage(
            f"{kind}: unsupported schema version {version!r} (this reader knows <= {cls.VERSION})"  # type: ignore[attr-defined]
        )
    return _from_plain(body, cls, kind)


def _to_plain(msg: Any) -> dict[str, Any]:
    out = {}
    for f in dataclasses.fields(msg):
        value = getattr(msg, f.name)
        if isinstance(value, list) and value and dataclasses.is_dataclass(value[0]):
            value = [_to_plain(v) for v in value]
        elif dataclasses.is_dataclass(value):
            value = _to_plain(value)
        out[f.name] = value
    return out


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


def _from_plain(body: dict[str, Any], cls: type[M], where: str) -> M:
    if not isinstance(body, dict):
        raise BadMessage(f"{where}: expected a map, got {type(body).__name__}")
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in body:
            kwargs[f.name] = _check(body[f.name], hints[f.name], f"{where}.{f.name}")
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise BadMessage(f"{where}: missing field {f.name!r}")
    # Unknown fields are ignored on purpose: a newer minor writer may add optional fields.
    try:
        return cls(**kwargs)
    except BadMessage:
        raise
    except (TypeError, ValueError) as exc:
        raise BadMessage(f"{where}: {exc}") from None


def _check(value: Any, hint: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if hint is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        for option in typing.get_args(hint):
            try:
                return _check(value, option, where)
            except BadMessage:
                continue
        raise BadMessage(f"{where}: {type(value).__name__} does not match {hint}")
    if hint is type(None):
        if value is None:
            return None
        raise BadMessage(f"{where}: expected null")
    if origin is list:
        if not isinstance(value, list):
            raise BadMessage(f"{where}: expected a list, got {type(value).__name__}")
        (item,) = typing.get_args(hint) or (Any,)
        if item is int:  # hot path: token ids
            if not all(type(v) is int for v in value):
                raise BadMessage(f"{where}: expected a list of integers")
            return value
        if item is float:  # hot path: logprobs
            if not all(type(v) in (float, int) for v in value):
                raise BadMessage(f"{where}: expected a list of numbers")
            return [float(v) for v in value]
        return [_check(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise BadMessage(f"{where}: expected a map, got {type(value).__name__}")
        key_t, val_t = typing.get_args(hint) or (Any, Any)
        return {_check(k, key_t, f"{where} key"): _check(v, val_t, f"{where}[{k!r}]") for k, v in value.items()}
    if dataclasses.is_dataclass(hint):
        return _from_plain(value, hint, where)  # type: ignore[arg-type]
    if hint is float:
        if type(value) in (float, int):
            return float(value)
        raise BadMessage(f"{where}: expected a number, got {type(value).__name__}")
    if hint is int:
        if type(value) is int:
            return value
        raise BadMessage(f"{where}: expected an integer, got {type(value).__name__}")
    if hint in (str, bool, bytes):
        if type(value) is hint:
            return value
        raise BadMessage(f"{where}: expected {hint.__name__}, got {type(value).__name__}")
    raise TypeError(f"codec cannot check type {hint!r} at {where}")  # a bug in a message definition
