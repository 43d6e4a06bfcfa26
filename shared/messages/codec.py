"""The one msgpack codec of every message: ``encode`` refuses what is too large, ``decode`` returns a
fully type-checked instance or raises ``BadMessage``."""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from shared.messages.base import MAX_MESSAGE_BYTES, BadMessage
from shared.msgshape import bound_error, reason_of

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
