"""Reading and writing the config: a TOML file, then ``JETRL__SECTION__KEY`` env vars, then
``--section.key=value`` flags, each layer over the last; ``save_config`` writes what ``load_config`` reads.

A key is found by walking its path down the sections (``rollout.vllm.dtype``, ``JETRL__ROLLOUT__VLLM__DTYPE``,
``[rollout.vllm] dtype``); an unknown one is refused naming the nearest known key. ``[env.<task>]`` tables
are kept as given, for the task's settings class (shared/tasks.py).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import tomllib
from collections.abc import Iterator
from typing import Any

from shared.config.env import EnvConfig
from shared.config.fields import ConfigError, check_field, keys, parse_text
from shared.config.root import JetRLConfig, validate


def _dotted_keys(section: Any, prefix: str) -> Iterator[str]:
    """Every key of ``section`` and of its sub-sections, dotted from ``prefix``."""
    for name, hint in keys(section).items():
        if dataclasses.is_dataclass(hint):
            yield from _dotted_keys(hint, f"{prefix}.{name}")
        else:
            yield f"{prefix}.{name}"


def _unknown_key(cfg: JetRLConfig, path: list[str], depth: int, node: Any) -> ConfigError:
    """The error for ``path[depth]``, unknown in ``node``: the nearest key of the section, one of its
    sub-sections' keys (``vllm_dtype``: ``vllm.dtype``), or a key of that name in another section."""
    name, dotted = path[depth], ".".join(path[:depth + 1])
    if depth == 0:
        near = difflib.get_close_matches(name, list(keys(cfg)), n=1, cutoff=0.6)
        hint = f"did you mean {near[0]}?" if near else f"known: {', '.join(keys(cfg))}"
        return ConfigError(f"unknown config section {name!r} ({hint})")
    spellings: dict[str, str] = {}  # a way to write a key -> the key
    for key, hint in keys(node).items():
        for sub in keys(hint) if dataclasses.is_dataclass(hint) else ():
            for spelling in (f"{key}.{sub}", f"{key}_{sub}", sub):
                spellings.setdefault(spelling, f"{key}.{sub}")
    spellings.update({key: key for key in keys(node)})
    near = difflib.get_close_matches(name, list(spellings), n=1, cutoff=0.6)
    elsewhere = [key[1:] for key in _dotted_keys(cfg, "") if key.rsplit(".", 1)[1] == name]
    if near:
        hint = f"did you mean {'.'.join([*path[:depth], spellings[near[0]]])}?"
    elif elsewhere:
        hint = f"did you mean {elsewhere[0]}?"
    else:
        hint = f"known: {', '.join(sorted(keys(node)))}"
    return ConfigError(f"unknown config key {dotted} ({hint})")


def _apply(cfg: JetRLConfig, path: list[str], value: Any, source: str) -> None:
    """Set the key at ``path`` (["rollout", "vllm", "dtype"], ["env", "<task>", "levels"]), walking down the
    sections. ``source`` is "file" (value already typed by TOML), "env var" or "flag" (value is text to parse)."""
    node: Any = cfg
    for depth, name in enumerate(path):
        dotted = ".".join(path[:depth + 1])
        hints = keys(node)
        if name not in hints:
            if isinstance(node, EnvConfig):  # [env.<task>]: kept as given, read by the task's plugin
                _apply_task_key(node, path, value, source)
                return
            raise _unknown_key(cfg, path, depth, node)
        hint = hints[name]
        if dataclasses.is_dataclass(hint):  # a section: go down, or take a TOML table key by key
            if depth + 1 < len(path):
                node = getattr(node, name)
                continue
            if source == "file" and isinstance(value, dict):
                for key, item in value.items():
                    _apply(cfg, [*path, key], item, source)
                return
            raise ConfigError(f"config {dotted} is a section: set its keys ({dotted}.<key>, known: "
                              f"{', '.join(keys(hint))})")
        if depth + 1 < len(path):
            raise ConfigError(f"config key {dotted} has no keys below it (got {'.'.join(path)})")
        value = value if source == "file" else parse_text(value, hint, dotted)
        declared = next(f for f in dataclasses.fields(node) if f.name == name)
        setattr(node, name, check_field(value, declared, hint, dotted))


def _apply_task_key(env: EnvConfig, path: list[str], value: Any, source: str) -> None:
    """A key of [env.<task>] (``path`` = ["env", task, key], or ["env", task] with a TOML table). Only its
    name is checked here: the task's settings class, which only the task's plugin knows, checks the rest
    where the task is served (``EnvConfig.section``)."""
    from shared.subjects import check_token

    task = path[1]
    if len(path) == 2 and source == "file" and isinstance(value, dict):
        for key, item in value.items():
            _apply_task_key(env, [*path, key], item, source)
        return
    if len(path) != 3:
        near = difflib.get_close_matches(task, list(keys(env)), n=1, cutoff=0.6) if len(path) == 2 else []
        hint = (f"did you mean env.{near[0]}?" if near else f"known: {', '.join(sorted(keys(env)))}; a task's own "
                "keys go in its section: [env.<task>] key = ..., --env.<task>.key=...")
        raise ConfigError(f"unknown config key {'.'.join(path)} ({hint})")
    try:
        check_token(task, "task")
    except ValueError as exc:
        raise ConfigError(f"config section env.{task}: {exc}") from None
    env.set_section(task, path[2], value)


def load_config(path: str | os.PathLike[str] | None = None, overrides: list[str] | None = None,
                environ: dict[str, str] | None = None) -> JetRLConfig:
    """File, then env vars ``JETRL__SECTION__KEY`` (``JETRL__ENV__DB__LEVELS``), then
    ``section.key=value`` overrides (``env.<task>.levels=1,2``)."""
    cfg = JetRLConfig()
    if path:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except IsADirectoryError:
            raise ConfigError(f"config file {path} is a directory") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        for section, values in data.items():
            if not isinstance(values, dict):
                raise ConfigError(f"config file {path}: top-level key {section!r} must be a [section]")
            for key, value in values.items():
                _apply(cfg, [section, key], value, "file")
    env = os.environ if environ is None else environ
    for name, raw in sorted(env.items()):
        if name.startswith("JETRL__"):
            parts = name[len("JETRL__"):].lower().split("__")
            if len(parts) < 2 or not all(parts):
                raise ConfigError(f"env var {name}: expected JETRL__SECTION__KEY (or JETRL__ENV__TASK__KEY)")
            _apply(cfg, parts, raw, "env var")
    for item in overrides or []:
        item = item[2:] if item.startswith("--") else item
        if "=" not in item or "." not in item.split("=", 1)[0]:
            raise ConfigError(f"override {item!r}: expected section.key=value")
        dotted, raw = item.split("=", 1)
        _apply(cfg, [part.replace("-", "_") for part in dotted.split(".")], raw, "flag")
    validate(cfg)
    return cfg


def save_config(cfg: JetRLConfig, path: str | os.PathLike[str]) -> None:
    """Write the config as TOML (readable back by load_config): [section], then its [section.sub], then
    each [env.<task>] given (all of a task's keys, typed, once its settings were read)."""
    lines: list[str] = []

    def table(name: str, values: dict[str, Any]) -> None:
        lines.append(f"[{name}]")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in values.items())
        lines.append("")

    def tables(name: str, section: Any) -> None:
        hints = keys(section)
        table(name, {key: getattr(section, key) for key, hint in hints.items() if not dataclasses.is_dataclass(hint)})
        for key, hint in hints.items():
            if dataclasses.is_dataclass(hint):
                tables(f"{name}.{key}", getattr(section, key))

    for name in keys(cfg):
        tables(name, getattr(cfg, name))
    for task, raw in cfg.env.sections.items():
        values = dict(raw) if isinstance(raw, dict) else dataclasses.asdict(raw)
        typed = cfg.env.__dict__.get("_settings", {}).get(task)
        if dataclasses.is_dataclass(typed):
            values.update(dataclasses.asdict(typed))
        table(f"env.{task}", values)
    # 0600, like the NATS passwords: a config may hold secrets (an API key, a password)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # an existing file keeps its mode through O_CREAT: narrow it too
    with os.fdopen(fd, "w") as fh:
        fh.write("\n".join(lines))


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + " }"
    raise ConfigError(f"cannot write {value!r} as TOML")


def from_argv(argv: list[str], positional: int = 0) -> tuple[JetRLConfig, list[str]]:
    """``[positional...] [--config FILE] [--section.key=value ...]`` as every entry point takes them."""
    args, path, overrides = [], None, []
    it = iter(argv)
    for item in it:
        if item in ("-h", "--help"):
            from shared.config.describe import describe

            print(describe())
            raise SystemExit(0)
        if item == "--config":
            path = next(it, None)
        elif item.startswith("--config="):
            path = item.split("=", 1)[1]
        elif item.startswith("--") or ("=" in item and "." in item.split("=", 1)[0]):
            overrides.append(item)
        else:
            args.append(item)
    if len(args) != positional:
        raise ConfigError(f"expected {positional} positional argument(s), got {args}")
    return load_config(path, overrides), args
