"""What every message shares: the ``Message`` base (kind and version), ``BadMessage``, the size limit and
the value constraints msgspec checks while it decodes."""

from __future__ import annotations

import sys
import time
from typing import Annotated, ClassVar

import msgspec

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
    """The tag (``kind`` on the wire); set from the class's ``tag=`` in ``shared/messages/__init__.py``."""
    VERSION: ClassVar[int] = 1
    v: int = 1
    """Schema version the writer used."""

    def __post_init__(self) -> None:
        if not 1 <= self.v <= self.VERSION:
            raise BadMessage(f"{self.KIND}: unsupported schema version {self.v} (this reader knows <= {self.VERSION})")
