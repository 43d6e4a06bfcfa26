"""How a config key is declared and checked: ``opt(default, help, ge=..., le=...)`` beside a typed field.

A field's type says what it holds (``int``, ``list[str]``, ``dict[str, int]``, a ``Literal`` of its choices);
its bounds, declared with it, say which numbers it admits (on a map or a list, every value). The checks
(``check_field``) and the help (``field_help``, ``type_name``) are made from these declarations, for every
section and every task's settings class alike, so a choice or a range is written once, beside its key.
"""

from __future__ import annotations

import dataclasses
import json
import typing
from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    pass


@dataclass(frozen=True)
class Bounds:
    """The numbers a key admits: ``ge`` <= value <= ``le``, value > ``gt`` (each None: no bound)."""

    ge: float | None = None
    le: float | None = None
    gt: float | None = None

    def admits(self, value: float) -> bool:
        return ((self.ge is None or value >= self.ge) and (self.le is None or value <= self.le)
                and (self.gt is None or value > self.gt))

    def text(self) -> str:
        """``in [0, 1]``, ``>= 1``, ``> 0``: as the help and the errors write the bounds."""
        low = f"[{_num(self.ge)}" if self.ge is not None else f"({_num(self.gt)}" if self.gt is not None else ""
        if low and self.le is not None:
            return f"in {low}, {_num(self.le)}]"
        if self.le is not None:
            return f"<= {_num(self.le)}"
        return f">= {_num(self.ge)}" if self.ge is not None else f"> {_num(self.gt)}"


def _num(value: float | None) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def opt(default: Any, help: str, *, path: bool = False, ge: float | None = None, le: float | None = None,
        gt: float | None = None) -> Any:
    """A config field: its default and its one-line help; ``ge``/``le``/``gt``: the numbers it admits (on a
    map or a list, each value); ``path``: it names a file (or a list of files or globs) that must exist when
    set, which ``jetrl up`` checks before it starts anything."""
    bounds = Bounds(ge, le, gt) if (ge, le, gt) != (None, None, None) else None
    metadata = {"help": help, "path": path, "bounds": bounds}
    if isinstance(default, (dict, list)):
        return field(default_factory=lambda: json.loads(json.dumps(default)), metadata=metadata)
    return field(default=default, metadata=metadata)


def section(cls: type) -> Any:
    """A sub-section field (``[rollout.vllm]``): a dataclass of its own keys, made fresh for each config."""
    return field(default_factory=cls, metadata={"help": " ".join((cls.__doc__ or "").split())})


def keys(section: Any) -> dict[str, Any]:
    """Key -> type of a config section (a dataclass or its class), its sub-sections included; ClassVars and
    the env section's task tables are not keys."""
    hints = typing.get_type_hints(section if isinstance(section, type) else type(section))
    return {f.name: hints[f.name] for f in dataclasses.fields(section) if not f.metadata.get("task_sections")}


def type_name(hint: Any) -> str:
    """A type as a reader writes it: ``int``, ``list[str]``, ``"a" | "b"`` for a Literal."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin is typing.Union or type(hint).__name__ == "UnionType":
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{', '.join(type_name(a) for a in args)}]" if args else name
    if hint is Any:
        return "any"
    return getattr(hint, "__name__", str(hint))


def field_help(f: dataclasses.Field[Any]) -> str:
    """A key's help as ``jetrl config`` and the reference page print it: its own words, then its bounds."""
    text, bounds = f.metadata.get("help", ""), f.metadata.get("bounds")
    if bounds is None:
        return text
    return f"{text}; {'each value ' if _is_container(f.type) else ''}must be {bounds.text()}"


def _is_container(hint: Any) -> bool:
    return typing.get_origin(hint) in (dict, list) or (isinstance(hint, str) and hint.startswith(("dict", "list")))


def parse_text(raw: str, hint: Any, key: str) -> Any:
    """Parse a string from an env var or the command line into the field's type."""
    origin = typing.get_origin(hint)
    try:
        if origin is typing.Literal:  # read as its choices' type: zero_stage=3 is the int 3
            return parse_text(raw, type(typing.get_args(hint)[0]), key)
        if hint is bool:
            low = raw.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if hint is int:
            return int(raw)
        if hint is float:
            return float(raw)
        if hint is str:
            return raw
        if origin is dict:  # JSON, or "a=1,b=2"
            if raw.strip().startswith("{"):
                return json.loads(raw)
            _, value_hint = typing.get_args(hint)  # each value read as the map's value type: int stays int
            pairs = [p.split("=", 1) for p in raw.split(",") if p.strip()]
            return {k.strip(): parse_text(v.strip(), value_hint, f"{key}.{k.strip()}") for k, v in pairs}
        if origin is list:
            if raw.strip().startswith("["):
                return json.loads(raw)
            (item,) = typing.get_args(hint)
            return [parse_text(p.strip(), item, f"{key}[]") for p in raw.split(",") if p.strip()]
    except (ValueError, json.JSONDecodeError):
        raise ConfigError(f"config key {key}: cannot read {raw!r} as {type_name(hint)}") from None
    raise ConfigError(f"config key {key}: unsupported type {hint}")


def check_type(value: Any, hint: Any, key: str) -> Any:
    """``value`` as the field's type (an int where a float is declared becomes one), or ConfigError naming
    the key: a Literal admits only its choices."""
    origin = typing.get_origin(hint)
    if hint is Any:  # a value the task hands on as it is (a constructor's keyword arguments)
        return value
    if origin is typing.Literal:
        if any(value == choice and type(value) is type(choice) for choice in typing.get_args(hint)):
            return value
        raise ConfigError(f"config key {key}: expected one of {type_name(hint)}, got {value!r}")
    if hint is float and type(value) in (int, float):
        return float(value)
    if hint in (int, str, bool) and type(value) is hint:
        return value
    if origin is dict and isinstance(value, dict):
        _, val_t = typing.get_args(hint)
        return {str(k): check_type(v, val_t, f"{key}.{k}") for k, v in value.items()}
    if origin is list and isinstance(value, list):
        (item,) = typing.get_args(hint)
        return [check_type(v, item, f"{key}[]") for v in value]
    raise ConfigError(f"config key {key}: expected {type_name(hint)}, got {value!r}")


def check_bounds(value: Any, bounds: Bounds | None, key: str) -> None:
    """ConfigError naming the key where ``value`` (each value of a map or a list) is out of its bounds."""
    if bounds is None:
        return
    items = value.items() if isinstance(value, dict) else ((f"[{i}]", v) for i, v in enumerate(value)) \
        if isinstance(value, list) else (("", value),)
    for sub, item in items:
        if not bounds.admits(item):
            where = f"{key}.{sub}" if isinstance(value, dict) else f"{key}{sub}"
            raise ConfigError(f"config key {where} must be {bounds.text()}, got {item!r}")


def check_field(value: Any, f: dataclasses.Field[Any], hint: Any, key: str) -> Any:
    """``value`` checked against everything field ``f`` declares (its type, its bounds), as the type has it."""
    value = check_type(value, hint, key)
    check_bounds(value, f.metadata.get("bounds"), key)
    return value


def check_section(section: Any, name: str) -> None:
    """Every key of ``section`` (and of its sub-sections) against its declaration, however it was set (a
    file, a flag, code assigning a field); a float field given an int keeps the float."""
    hints = keys(section)
    for f in dataclasses.fields(section):
        if f.name not in hints:
            continue
        value = getattr(section, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            check_section(value, f"{name}.{f.name}")
        else:
            setattr(section, f.name, check_field(value, f, hints[f.name], f"{name}.{f.name}"))
