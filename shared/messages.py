"""Every message type that crosses a NATS subject, and the one msgpack codec for all of them.

Each message is a ``msgspec.Struct`` tagged by its kind. On the wire it is a msgpack map
``{"kind": KIND, "v": VERSION, **fields}``, the very bytes the hand-written codec wrote before
earlier releases, so any other reader (the Node client) reads our streams as it did. ``decode(data, Type)``
either returns a fully type-checked instance or raises ``BadMessage`` with the reason and the field
path (``trajectory.tokens[17]: expected an integer >= 0``): the boundary of every service.

msgspec decodes straight into the typed Struct in C, value constraints included (token ids,
loss masks, logprobs: see the aliases below); checks across fields (equal lengths, turn spans) run
in ``__post_init__``, on construction and on decode alike.

Versions: readers accept any message whose ``v`` is ``<=`` their ``VERSION`` and ignore fields
they do not know (a newer writer may add optional ones); a newer ``v`` is refused rather than
misread. A message without ``v`` is read as the reader's version (the old codec refused it; every
writer sends ``v``). To change a message incompatibly, raise its ``VERSION`` and give ``v`` the same
default (``tests/test_contract.py`` checks that they agree).
"""

from __future__ import annotations

import sys
import time
from typing import Annotated, Any, ClassVar, TypeVar

import msgspec

from shared.msgshape import bound_error, reason_of

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


# Value constraints, checked by msgspec while it decodes (construction does not check them).
TokenId = Annotated[int, msgspec.Meta(ge=0)]
"""A vocabulary index."""
LossMask = Annotated[int, msgspec.Meta(ge=0, le=1)]
"""1 = a sampled token the loss trains on, 0 = prompt, observation or template."""
LogProb = Annotated[float, msgspec.Meta(ge=-sys.float_info.max, le=0.0)]
"""A behaviour logprob: finite (the lower bound refuses -inf, and NaN fails every bound) and <= 0."""
SubjectToken = Annotated[str, msgspec.Meta(pattern=r"^[A-Za-z0-9_-]+$", max_length=128)]
"""A value that becomes one token of a subject (a task name, a replica id): nothing a subject cannot hold."""
SubjectPart = Annotated[str, msgspec.Meta(pattern=r"^[^\s*>]+$", max_length=512)]
"""A value that becomes part of a subject or header (an episode id): no spaces or wildcards, bounded, so a
hostile one cannot make a client publish a subject the server refuses (which closes its connection)."""
Temperature = Annotated[float, msgspec.Meta(ge=0.0, le=100.0)]
NewTokens = Annotated[int, msgspec.Meta(ge=1, le=1 << 20)]


class Message(msgspec.Struct, tag_field="kind", kw_only=True):
    """Base of every top-level message: ``kind`` is the struct's tag, ``v`` its schema version.

    Keyword-only, so ``v`` comes first on the wire as it always did, and adding a field can never
    shift a positional argument.
    """

    KIND: ClassVar[str]
    """The tag (``kind`` on the wire); set from the class's ``tag=`` at the end of this module."""
    VERSION: ClassVar[int] = 1
    v: int = 1
    """Schema version the writer used."""

    def __post_init__(self) -> None:
        if not 1 <= self.v <= self.VERSION:
            raise BadMessage(f"{self.KIND}: unsupported schema version {self.v} (this reader knows <= {self.VERSION})")


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
# Unified function-call environment API (rollout <-> env services, request/reply)
# --------------------------------------------------------------------------------------------- #
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


# --------------------------------------------------------------------------------------------- #
# Weights, registry, metrics, dead letters, run control
# --------------------------------------------------------------------------------------------- #
class WeightsAnnouncement(Message, tag="weights", kw_only=True):
    version: int
    object_name: str
    digest: str
    size: int
    dtype: str
    ts: float = msgspec.field(default_factory=now)
    format: str = "full"
    """``full``: every weight; ``lora``: an adapter (``shared.model.lora_delta``) to add to the base weights."""
    signature: str = ""
    """The trainer's Ed25519 signature (hex) of the run's prefix and this message without it (shared/signing.py)."""


class Heartbeat(Message, tag="heartbeat", kw_only=True):
    """A replica's entry in the registry KV (key: ``<user role>.<replica id>``, e.g. ``env.<id>``), rewritten every
    few seconds."""

    role: str
    """What it is: ``trainer``, ``controller``, ``rollout``, ``env-<task>``."""
    replica_id: str
    """Its id, the same as its key's last token."""
    pid: int
    """Its process id on ``host``."""
    host: str
    """The host (container) it runs on."""
    started_at: float
    """When it started (Unix seconds)."""
    info: dict[str, Any] = msgspec.field(default_factory=dict)
    """What the role adds (an env: ``{"task": str, "max_sessions": int}``)."""
    ts: float = msgspec.field(default_factory=now)
    """When this beat was written (Unix seconds)."""


class MetricsReport(Message, tag="metrics", kw_only=True):
    role: str
    replica_id: str
    step: int
    values: dict[str, float]
    ts: float = msgspec.field(default_factory=now)


class DeadLetter(Message, tag="dead_letter", kw_only=True):
    """A message a service could not accept, kept with the reason (stream DLQ, subject ``dlq.<service>``)."""

    origin_subject: str
    """The subject it came on."""
    reason: str
    """Why it was refused (the codec's reason, with the field path)."""
    payload: bytes
    """Its bytes (up to 4 MiB)."""
    service: str
    """Who refused it (``env-<task>``, ``trainer``, ...)."""
    ts: float = msgspec.field(default_factory=now)
    """When (Unix seconds)."""


class RunControl(Message, tag="run_control", kw_only=True):
    event: str
    step: int = 0
    info: dict[str, Any] = msgspec.field(default_factory=dict)
    ts: float = msgspec.field(default_factory=now)
    signature: str = ""
    """The controller's Ed25519 signature (hex) of the run's prefix and this message without it."""


class TrainingFinished(Message, tag="training_finished", kw_only=True):
    """The trainer's word that it has done its last step (subject ``trainer.finished``, trainer only):
    the controller ends the plan on this, never on a policy version it did not expect."""

    step: int
    policy_version: int
    replica_id: str
    ts: float = msgspec.field(default_factory=now)
    signature: str = ""
    """The trainer's Ed25519 signature (hex) of the run's prefix and this message without it."""


MESSAGES: tuple[type[Message], ...] = (
    EpisodeJob, EnvStart, EnvStarted, EnvInteract, EnvOracle, EnvCancel, EnvStep, EnvTaskList, EnvHealth,
    ActionEvent, ObservationEvent, Trajectory, GenerateRequest, GenerateReply, WeightsAnnouncement, Heartbeat,
    MetricsReport, DeadLetter, RunControl, TrainingFinished,
)
"""Every top-level message type."""

for _cls in MESSAGES:  # the tag is the one definition of a kind; KIND names it for code and logs
    _cls.KIND = _cls.__struct_config__.tag  # type: ignore[assignment]


# --------------------------------------------------------------------------------------------- #
# Codec
# --------------------------------------------------------------------------------------------- #
M = TypeVar("M")

_encoder = msgspec.msgpack.Encoder()


class _NoKind(msgspec.Struct, tag_field="kind", tag="\x00"):
    """Never sent. msgspec only insists on the tag when it decodes a tagged *union*, so every
    decoder reads ``Type | _NoKind``: a message without ``kind`` is refused, not guessed."""


_decoders: dict[type, msgspec.msgpack.Decoder[Any]] = {}


def _decoder(cls: type) -> msgspec.msgpack.Decoder[Any]:
    if cls not in _decoders:
        _decoders[cls] = msgspec.msgpack.Decoder(cls | _NoKind)
    return _decoders[cls]


def encode(msg: Any) -> bytes:
    """Encode a message; refuses one larger than MAX_MESSAGE_BYTES."""
    data = _encoder.encode(msg)
    if len(data) > MAX_MESSAGE_BYTES:
        raise BadMessage(f"{msg.KIND} message is {len(data)} bytes, limit {MAX_MESSAGE_BYTES}", code=413)
    return data


def decode(data: bytes, cls: type[M]) -> M:
    """Decode and validate bytes into ``cls`` or raise BadMessage with the reason and field path. Nothing
    else ever comes out of it, whatever the bytes: this is the boundary of every service."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise BadMessage(f"message is {len(data)} bytes, limit {MAX_MESSAGE_BYTES}", code=413)
    kind = cls.KIND  # type: ignore[attr-defined]
    shape = bound_error(data, cls)  # msgspec builds a field without a schema as deep and as big as sent
    if shape is not None:
        raise BadMessage(f"{kind}.{shape}")
    try:
        msg = _decoder(cls).decode(data)
    except msgspec.ValidationError as exc:
        # msgspec stops at the first wrong value; bytes that are not msgpack at all say so first (read
        # without building anything: the value may be what failed validation because it nests too deep)
        try:
            _skipper.decode(data)
        except msgspec.DecodeError as not_msgpack:
            raise BadMessage(f"not msgpack: {not_msgpack}") from None
        except Exception:  # nested too deep to skip: the validation error still says what is wrong
            pass
        raise BadMessage(reason_of(str(exc), kind)) from None
    except msgspec.DecodeError as exc:
        raise BadMessage(f"not msgpack: {exc}") from None
    except RecursionError:  # a field this reader does not know, nested deeper than the decoder can skip
        raise BadMessage(f"{kind}: nested too deep to decode") from None
    except Exception as exc:  # nothing else is expected from the decoder; whatever comes is the message's
        raise BadMessage(f"{kind}: undecodable ({type(exc).__name__}: {exc})") from None
    if not isinstance(msg, cls):  # a message that claims to be _NoKind
        raise BadMessage(f"expected kind {kind!r}, got {msg.__struct_config__.tag!r}")
    return msg


_skipper = msgspec.msgpack.Decoder(msgspec.Raw)
"""Walks one msgpack value without building it: is it msgpack at all?"""
