"""Codec speed: decode and encode of one trajectory (1,024 tokens by default), µs per call, medians.

Three codecs side by side in one run, on the same bytes:

- ``bare``: ``msgpack.unpackb`` / ``msgpack.packb`` of the map, no types, no checks (the floor);
- ``legacy``: the hand-written reflective codec JetRL used in an earlier version, copied below verbatim
  (with the two message dataclasses it needs here) as the baseline;
- ``msgspec``: ``shared.messages`` today: typed Structs decoded in C, constraints included.

It also checks that the three agree on the wire: the legacy and new encoders write the same bytes,
and each decodes the other's. The goal is decode <= 1.5x bare.

    .venv/bin/python bench/bench_codec.py                   # the figures in docs/benchmarks.md
    .venv/bin/python bench/bench_codec.py --tokens 4096 --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
import timeit
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import msgpack

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from shared import messages  # noqa: E402
from shared.messages import BadMessage  # noqa: E402


# --------------------------------------------------------------------------------------------- #
# The legacy codec: shared/messages.py at daf4aeb, verbatim but for the names (legacy_*, Legacy*).
# tests/shared/test_contract.py uses it too, as the reference for wire compatibility.
# --------------------------------------------------------------------------------------------- #
def now() -> float:
    return time.time()


@dataclass
class LegacyEpisodeJob:
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


@dataclass
class LegacyDeadLetter:
    KIND: ClassVar[str] = "dead_letter"
    VERSION: ClassVar[int] = 1

    origin_subject: str
    reason: str
    payload: bytes
    service: str
    ts: float = field(default_factory=now)


@dataclass
class LegacyEnvStep:
    KIND: ClassVar[str] = "env_step"
    VERSION: ClassVar[int] = 1

    finish: bool
    reward: float
    status: str
    messages: list[dict[str, Any]]
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class LegacyTurnInfo:
    KIND: ClassVar[str] = "turn"
    VERSION: ClassVar[int] = 1

    start: int
    end: int
    engine_id: str
    policy_version: int


@dataclass
class LegacyTrajectory:
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
    turns: list[LegacyTurnInfo]
    reward: float
    status: str
    replica_id: str
    metrics: dict[str, float] = field(default_factory=dict)
    temperature: float = 1.0
    created_at: float = field(default_factory=now)

    def __post_init__(self) -> None:
        n = len(self.tokens)
        if len(self.logprobs) != n or len(self.loss_mask) != n:
            raise BadMessage(
                f"trajectory {self.episode_id}: tokens/logprobs/loss_mask lengths differ "
                f"({n}/{len(self.logprobs)}/{len(self.loss_mask)})"
            )


M = TypeVar("M")
MAX_MESSAGE_BYTES = messages.MAX_MESSAGE_BYTES


def legacy_encode(msg: Any) -> bytes:
    """Encode a message dataclass; refuses one larger than MAX_MESSAGE_BYTES."""
    body = {"kind": msg.KIND, "v": msg.VERSION}
    body.update(_to_plain(msg))
    data = msgpack.packb(body, use_bin_type=True)
    if len(data) > MAX_MESSAGE_BYTES:
        raise BadMessage(f"{msg.KIND} message is {len(data)} bytes, limit {MAX_MESSAGE_BYTES}", code=413)
    return data


def legacy_decode(data: bytes, cls: type[M]) -> M:
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


# --------------------------------------------------------------------------------------------- #
# The benchmark
# --------------------------------------------------------------------------------------------- #
def sample_trajectory(n_tokens: int, seed: int = 0) -> dict[str, Any]:
    """A DB-like episode: a ~300-token prompt, then 7 turns of sampled tokens and observations."""
    rng = random.Random(seed)
    prompt = min(300, n_tokens // 3)
    tokens = [rng.randrange(49152) for _ in range(n_tokens)]  # SmolLM2's vocabulary
    logprobs, mask, turns = [0.0] * n_tokens, [0] * n_tokens, []
    per_turn = (n_tokens - prompt) // 7
    for t in range(7):
        start = prompt + t * per_turn
        end = start + per_turn // 2  # the other half: the observation
        for i in range(start, end):
            logprobs[i], mask[i] = -rng.expovariate(1.0), 1
        turns.append({"start": start, "end": end, "engine_id": "rollout-host-4242", "policy_version": 12})
    return dict(episode_id="g0123456789abcdef-3", group_id="g0123456789abcdef", task="db",
                task_id="db-train-00042", split="train", group_size=8, tokens=tokens, logprobs=logprobs,
                loss_mask=mask, prompt_len=prompt, turns=turns, reward=1.0, status="completed",
                replica_id="rollout-host-4242", metrics={"turns": 7.0, "invalid_actions": 0.0, "duration_s": 3.2},
                temperature=1.0, created_at=1.7e9)


def make(cls: Any, turn_cls: Any, fields: dict[str, Any]) -> Any:
    return cls(**dict(fields, turns=[turn_cls(**t) for t in fields["turns"]]))


def per_call_us(fn: Any, number: int, repeat: int) -> float:
    return statistics.median(timeit.repeat(fn, number=number, repeat=repeat)) / number * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--number", type=int, default=1000, help="calls per timing")
    p.add_argument("--repeat", type=int, default=21, help="timings; the median is reported")
    p.add_argument("--json", default=None, help="also write the figures here")
    a = p.parse_args()

    fields = sample_trajectory(a.tokens)
    new = make(messages.Trajectory, messages.TurnInfo, fields)
    old = make(LegacyTrajectory, LegacyTurnInfo, fields)
    data = messages.encode(new)
    # Wire compatibility first: same bytes, and each codec reads the other's.
    assert legacy_encode(old) == data, "the legacy and msgspec encoders disagree"
    assert messages.decode(legacy_encode(old), messages.Trajectory) == new
    assert legacy_decode(data, LegacyTrajectory) == old

    plain = msgpack.unpackb(data)
    t = {
        "bare": (per_call_us(lambda: msgpack.unpackb(data), a.number, a.repeat),
                 per_call_us(lambda: msgpack.packb(plain), a.number, a.repeat)),
        "legacy": (per_call_us(lambda: legacy_decode(data, LegacyTrajectory), a.number, a.repeat),
                   per_call_us(lambda: legacy_encode(old), a.number, a.repeat)),
        "msgspec": (per_call_us(lambda: messages.decode(data, messages.Trajectory), a.number, a.repeat),
                    per_call_us(lambda: messages.encode(new), a.number, a.repeat)),
    }
    bare_dec, bare_enc = t["bare"]
    print(f"trajectory of {a.tokens} tokens, {len(data)} bytes; medians of {a.repeat} x {a.number} calls")
    print("| codec | decode µs | decode / bare | encode µs | encode / bare |")
    print("|---|---|---|---|---|")
    for name, (dec, enc) in t.items():
        print(f"| {name} | {dec:.1f} | {dec / bare_dec:.2f}x | {enc:.1f} | {enc / bare_enc:.2f}x |")
    if a.json:
        out = {"tokens": a.tokens, "bytes": len(data), "number": a.number, "repeat": a.repeat,
               "us": {k: {"decode": d, "encode": e} for k, (d, e) in t.items()}}
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
