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
default (``tests/shared/test_contract.py`` checks that they agree).

The messages by area: ``episodes`` (jobs, events, trajectories, the generation pool), ``env`` (the unified env
API), ``control`` (weights, registry, metrics, dead letters, run control); ``base`` holds what they share and
``codec`` the codec. Import them from ``shared.messages``.
"""

from __future__ import annotations

from shared.messages.base import (
    MAX_MESSAGE_BYTES,
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
from shared.messages.codec import M, decode, encode
from shared.messages.control import (
    DeadLetter,
    Heartbeat,
    MetricsReport,
    RunControl,
    TrainingFinished,
    WeightsAnnouncement,
)
from shared.messages.env import (
    EnvCancel,
    EnvHealth,
    EnvInteract,
    EnvOracle,
    EnvStart,
    EnvStarted,
    EnvStep,
    EnvTaskList,
    EpisodeStatus,
)
from shared.messages.episodes import (
    ActionEvent,
    EpisodeJob,
    GenerateReply,
    GenerateRequest,
    ObservationEvent,
    Trajectory,
    TurnInfo,
)

MESSAGES: tuple[type[Message], ...] = (
    EpisodeJob, EnvStart, EnvStarted, EnvInteract, EnvOracle, EnvCancel, EnvStep, EnvTaskList, EnvHealth,
    ActionEvent, ObservationEvent, Trajectory, GenerateRequest, GenerateReply, WeightsAnnouncement, Heartbeat,
    MetricsReport, DeadLetter, RunControl, TrainingFinished,
)
"""Every top-level message type."""

for _cls in MESSAGES:  # the tag is the one definition of a kind; KIND names it for code and logs
    _cls.KIND = _cls.__struct_config__.tag  # type: ignore[assignment]


__all__ = [
    "MAX_MESSAGE_BYTES", "MESSAGES", "ActionEvent", "BadMessage", "DeadLetter", "EnvCancel", "EnvHealth", "EnvInteract",
    "EnvOracle", "EnvStart", "EnvStarted", "EnvStep", "EnvTaskList", "EpisodeJob", "EpisodeStatus", "GenerateReply",
    "GenerateRequest", "Heartbeat", "LogProb", "LossMask", "M", "Message", "MetricsReport", "NewTokens",
    "ObservationEvent", "RunControl", "SubjectPart", "SubjectToken", "Temperature", "TokenId", "TrainingFinished",
    "Trajectory", "TurnInfo", "WeightsAnnouncement", "decode", "encode", "now",
]
