"""The codec's own checks around msgspec (``shared.messages.decode``): a bound on the shape of msgpack
bytes, checked before msgspec decodes them, and msgspec's refusals in the codec's words.

msgspec decodes nested containers recursively, counted against Python's recursion limit: msgpack nested
~1,000 deep (``b"\\x91" * 1000 + b"\\x00"``, 1,001 bytes) raises ``RecursionError`` from inside the decoder,
whichever type it decodes into (an unknown field is skipped recursively too), and where it raises depends
on how deep the caller's own stack already is. An untyped part of a message (``dict[str, Any]``) also
turns every empty container into a Python object: 8 MiB of ``0x90`` bytes would be ~8 million lists.

``shape_error`` walks the bytes once, without building anything, and names the first bound a message
breaks: at most ``MAX_DEPTH`` containers deep and ``MAX_CONTAINERS`` containers in all. Runs of
fixed-size scalars are matched and counted by the ``re`` engine, so the walk's Python work is per
container and string; the engine still spends ~0.5 us a scalar, several times msgspec's whole typed
decode of a trajectory's token ids. So ``bound_error`` walks only the fields without a schema (below);
docs/benchmarks/faults.md has the cost. Bytes that are not msgpack at all (truncated, a reserved byte,
trailing data) pass: the decoder reports those in its own words.
"""

from __future__ import annotations

import re
import sys
from typing import Any

import msgspec
import msgspec.inspect

MAX_DEPTH = 64
"""Deepest nesting accepted: a trajectory nests 3 deep, an OpenAI tool schema in ``EnvStarted`` ~10."""
MAX_CONTAINERS = 100_000
"""Most arrays and maps in one message (a trajectory has one map per turn; an opening a few hundred)."""

# One msgpack scalar of a fixed size: positive/negative fixint, nil, false, true, then the 1-, 2-, 4-
# and 8-byte ints and floats with their lead byte.
_SCALAR = rb"[\x00-\x7f\xc0\xc2\xc3\xe0-\xff]|[\xcc\xd0][\s\S]|[\xcd\xd1][\s\S]{2}|[\xca\xce\xd2][\s\S]{4}|[\xcb\xcf\xd3][\s\S]{8}"
_SCALAR_ITEM = re.compile(_SCALAR)
_SCALAR_RUN = re.compile(rb"(?:" + _SCALAR + rb")+")
_FIXED_LEADS = frozenset([*range(0x00, 0x80), 0xc0, 0xc2, 0xc3, *range(0xe0, 0x100), *range(0xca, 0xd4)])

# lead byte -> (bytes of the length that follows it, extra bytes after the length) for str, bin and ext
_SIZED = {0xd9: (1, 0), 0xda: (2, 0), 0xdb: (4, 0), 0xc4: (1, 0), 0xc5: (2, 0), 0xc6: (4, 0),
          0xc7: (1, 1), 0xc8: (2, 1), 0xc9: (4, 1)}
_FIXEXT = {0xd4: 3, 0xd5: 4, 0xd6: 6, 0xd7: 10, 0xd8: 18}  # whole size, lead byte included
# lead byte -> (bytes of the item count, items per entry) for array16/32 and map16/32
_COUNTED = {0xdc: (2, 1), 0xdd: (4, 1), 0xde: (2, 2), 0xdf: (4, 2)}


def shape_error(data: bytes | memoryview, max_depth: int = MAX_DEPTH, max_containers: int = MAX_CONTAINERS,
                depth: int = 0) -> str | None:
    """The bound ``data`` breaks (a reason for ``BadMessage``), or None; ``depth``: containers around it."""
    size = len(data)
    open_items: list[int] = []  # items still to come in each enclosing container
    remaining = 1  # items still to come at this level: the message itself
    containers = pos = 0
    while True:
        while remaining == 0:
            if not open_items:
                return None  # the message is whole; trailing bytes are the decoder's to report
            remaining = open_items.pop()
        if pos >= size:
            return None  # truncated: the decoder says so
        lead = data[pos]
        if lead in _FIXED_LEADS:  # a run of fixed-size scalars, which may close containers as it goes
            end = _SCALAR_RUN.match(data, pos).end()  # type: ignore[union-attr]  # one scalar at least
            count = 1 if end - pos == 1 else len(_SCALAR_ITEM.findall(data, pos, end))
            pos = end
            while count >= remaining and open_items:
                count -= remaining
                remaining = open_items.pop()
            remaining = max(0, remaining - count)
            continue
        if 0x80 <= lead <= 0x9f or lead in _COUNTED:
            if lead <= 0x8f:
                items, pos = 2 * (lead & 0x0f), pos + 1
            elif lead <= 0x9f:
                items, pos = lead & 0x0f, pos + 1
            else:
                width, per_entry = _COUNTED[lead]
                items = per_entry * int.from_bytes(data[pos + 1:pos + 1 + width], "big")
                pos += 1 + width
            containers += 1
            if containers > max_containers:
                return f"more than {max_containers} arrays and maps in one message"
            remaining -= 1
            if items:
                open_items.append(remaining)
                remaining = items
                if len(open_items) + depth > max_depth:
                    return f"nested more than {max_depth} arrays or maps deep"
            continue
        if 0xa0 <= lead <= 0xbf:
            pos += 1 + (lead & 0x1f)
        elif lead in _SIZED:
            width, extra = _SIZED[lead]
            pos += 1 + width + extra + int.from_bytes(data[pos + 1:pos + 1 + width], "big")
        elif lead in _FIXEXT:
            pos += _FIXEXT[lead]
        else:  # 0xc1, never used by msgpack: the decoder refuses it
            return None
        remaining -= 1


def bound_error(data: bytes, cls: type) -> str | None:
    """The bound a message of type ``cls`` breaks in its fields without a schema (``field: reason``), or None.

    Only there does the sender decide how deep and how many containers msgspec builds: the typed fields'
    schema bounds their depth (a trajectory's turns: 3), and a field the reader does not know is skipped
    without being built. So the fields with an ``Any`` somewhere in their type are found first, by a decode
    into a struct of ``msgspec.Raw`` fields (msgspec's C skip, nothing built), and only their bytes are
    walked: a trajectory's conversation, not its token ids. Anything that decode cannot read is left to
    the real decode to refuse in its own words."""
    fields, shadow = _shadow(cls)
    if not fields:
        return None
    try:
        raw = shadow.decode(data)
    except Exception:
        return None
    for name in fields:
        part = memoryview(getattr(raw, name))
        if len(part):
            reason = shape_error(part, depth=1)  # inside the message's map
            if reason is not None:
                return f"{name}: {reason}"
    return None


_shadows: dict[type, tuple[list[str], Any]] = {}


def _shadow(cls: type) -> tuple[list[str], Any]:
    """The wire names of ``cls``'s fields that have an ``Any`` in their type, and a decoder that reads
    just those fields' bytes (``msgspec.Raw``)."""
    if cls not in _shadows:
        info = msgspec.inspect.type_info(cls)
        fields = [f.encode_name for f in info.fields if _has_any(f.type, set())]  # type: ignore[attr-defined]
        shadow = msgspec.defstruct(f"{cls.__name__}Bytes", [(n, msgspec.Raw, msgspec.Raw()) for n in fields])
        _shadows[cls] = (fields, msgspec.msgpack.Decoder(shadow))
    return _shadows[cls]


def _has_any(node: Any, seen: set[int]) -> bool:
    if isinstance(node, msgspec.inspect.AnyType):
        return True
    if id(node) in seen or not isinstance(node, msgspec.inspect.Type):
        return False
    seen.add(id(node))
    if isinstance(node, msgspec.inspect.StructType):
        return any(_has_any(f.type, seen) for f in node.fields)
    parts = [getattr(node, a) for a in ("item_type", "key_type", "value_type") if hasattr(node, a)]
    return any(_has_any(p, seen) for p in [*parts, *getattr(node, "types", ()), *getattr(node, "item_types", ())])


# msgspec's words for types, in the codec's own (the reasons services log and dead-letter).
_EXPECTED = {"int": "an integer", "float": "a number", "array": "a list", "object": "a map"}
_GOT = {"array": "list", "object": "map"}
_FINITE = f"`float` >= {-sys.float_info.max!r}"  # LogProb's lower bound, which only -inf and NaN miss


def reason_of(error: str, kind: str) -> str:
    """``Expected `int`, got `str` - at `$.turns[0].start``` -> ``trajectory.turns[0].start:
    expected an integer, got str``: the field path first, in the codec's words."""
    text, _, where = error.partition(" - at `")
    where = where.removesuffix("`")
    if where.startswith("key` in `"):  # a map key: "key` in `$.metrics"
        where = where.removeprefix("key` in `") + " key"
    path = kind + where.removeprefix("$") if where else kind
    if where == "$.kind" or (not where and text.endswith("field `kind`")):
        got = re.search(r"Invalid value (.*)|got `(\w+)`", text)  # a wrong value or type; else missing
        return f"expected kind {kind!r}, got {got[1] or got[2] if got else None}"
    if not where and text.startswith("Expected `object`"):  # the message itself is no map
        got = text.rsplit("`", 2)[-2]
        return f"expected a msgpack map, got {_GOT.get(got, got)}"
    if text.startswith("Expected " + _FINITE):
        return f"{path}: expected a finite number"
    missing = re.fullmatch(r"Object missing required field `(\w+)`", text)
    if missing:
        return f"{path}: missing field {missing[1]!r}"
    typed = re.fullmatch(r"Expected `(\w+)`(.*)", text)
    if typed:
        rest = re.sub(r"got `(\w+)`", lambda m: "got " + _GOT.get(m[1], m[1]), typed[2])
        return f"{path}: expected {_EXPECTED.get(typed[1], typed[1])}{rest}"
    if not where:  # raised by a __post_init__: already names the message
        return text
    return f"{path}: {text[:1].lower()}{text[1:]}"
