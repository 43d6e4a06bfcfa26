"""The open task registry: which code serves a task, and what its ``[env.<task>]`` settings are.

A task is found by name, in this order:

1. ``env.factory`` (``python -m services.envs T --env.factory=pkg.mod:make_env``: this replica only);
2. ``[env.T] factory = "pkg.mod:make_env"`` in the config (or ``--env.T.factory=...``);
3. ``[env.T] command = ["prog", "arg", ...]``: an external program, in any language, that serves T over
   the env subjects (docs/env-protocol.md); ``jetrl up`` starts it instead of ``python -m services.envs T``,
   with the variables of ``ExternalEnv`` set;
4. the Python entry point named T in the group ``jetrl.envs`` (value ``pkg.mod:make_env``): how JetRL's own
   tasks register (its pyproject.toml) and how an installed plugin package does.

``make_env(env: EnvConfig) -> TaskEnv`` builds the task's env. Its settings: when the module named in the
factory (``pkg.mod``) defines a dataclass ``Config``, ``[env.T]`` is read into an instance of it (unknown
keys refused, types checked, as for every other section) and ``make_env`` reads it as ``env.section(T)``
(built-in code writes ``env.<task>``); a task without one gets the table as a dict. ``factory`` and ``command``
are reserved keys of every task section, never settings. Nothing here knows a task by name.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import json
import typing
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from shared.config import ConfigError, EnvConfig
from shared.config.fields import check_field, field_help, keys, parse_text

ENTRY_POINT_GROUP = "jetrl.envs"
"""The entry-point group a package registers its tasks in: ``name = "package.module:make_env"``."""
RESERVED_KEYS = ("factory", "command")
"""Keys of every ``[env.<task>]`` that say how the task is served, not how it behaves."""


class UnknownTask(ConfigError):
    """No factory, command or entry point serves this task name."""


@dataclass(frozen=True)
class TaskSource:
    """Where a task comes from: a Python factory (``pkg.mod:make_env``) or an external command."""

    task: str
    factory: str = ""
    command: tuple[str, ...] = ()
    origin: str = ""
    """What named it, for messages: ``env.factory``, ``env.<task>.factory``, ``env.<task>.command``,
    or ``entry point <dist>``."""


def registered_tasks() -> dict[str, str]:
    """Task name -> ``pkg.mod:make_env`` of every installed ``jetrl.envs`` entry point."""
    return {ep.name: ep.value for ep in entry_points(group=ENTRY_POINT_GROUP)}


def known_tasks(env: EnvConfig) -> list[str]:
    """Every task this config can serve: the entry points and the sections naming a factory or a command."""
    named = {task for task, raw in env.sections.items() if isinstance(raw, dict) and set(raw) & set(RESERVED_KEYS)}
    return sorted(set(registered_tasks()) | named)


def _reserved(raw: Any, key: str) -> Any:
    return raw.get(key) if isinstance(raw, dict) else None


def command_of(task: str, raw: Any) -> tuple[str, ...]:
    """``env.<task>.command`` as argv: a TOML list of strings, or from a flag JSON (``["node","env.js"]``)."""
    value = _reserved(raw, "command")
    if value in (None, "", []):
        return ()
    if isinstance(value, str):
        try:
            value = json.loads(value) if value.strip().startswith("[") else value.split()
        except json.JSONDecodeError:
            raise ConfigError(f"config key env.{task}.command: cannot read {value!r} as a list of strings") from None
    if not isinstance(value, list) or not value or not all(isinstance(a, str) and a for a in value):
        raise ConfigError(f"config key env.{task}.command: expected a list of strings (the program and its "
                          f"arguments), got {value!r}")
    return tuple(value)


def find_task(task: str, env: EnvConfig) -> TaskSource:
    """Where ``task`` comes from (the order in the module docstring), or UnknownTask naming the known ones."""
    raw = env.sections.get(task, {})
    factory = _reserved(raw, "factory")
    if factory is not None and not isinstance(factory, str):
        raise ConfigError(f"config key env.{task}.factory: expected 'package.module:make_env', got {factory!r}")
    if env.factory and env.task == task:
        return TaskSource(task, factory=env.factory, origin="env.factory")
    if factory:
        return TaskSource(task, factory=factory, origin=f"env.{task}.factory")
    command = command_of(task, raw)
    if command:
        return TaskSource(task, command=command, origin=f"env.{task}.command")
    for ep in entry_points(group=ENTRY_POINT_GROUP, name=task):
        return TaskSource(task, factory=ep.value, origin=f"entry point of {ep.dist.name if ep.dist else '?'}")
    known = ", ".join(known_tasks(env)) or "none"
    raise UnknownTask(f"unknown task {task!r} (known: {known}); a task comes from a `{ENTRY_POINT_GROUP}` entry "
                      f"point (JetRL's own: `make venv` installs them), [env.{task}] factory = "
                      f"\"package.module:make_env\", or [env.{task}] command = [...]")


def _split(factory: str) -> tuple[str, str]:
    module, sep, attr = factory.partition(":")
    if not sep or not module or not attr:
        raise ConfigError(f"task factory {factory!r}: expected 'package.module:make_env'")
    return module, attr


def _module(factory: str, task: str) -> Any:
    module, _ = _split(factory)
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ConfigError(f"task {task!r}: cannot import {module} (its factory {factory}): {exc}") from exc


def load_factory(source: TaskSource) -> Callable[[EnvConfig], Any]:
    """The task's ``make_env``."""
    if not source.factory:
        raise ConfigError(f"task {source.task!r} is served by an external program ({source.origin} = "
                          f"{list(source.command)}): `jetrl up` starts it; there is no Python factory to call")
    make_env = getattr(_module(source.factory, source.task), _split(source.factory)[1], None)
    if not callable(make_env):
        raise ConfigError(f"task {source.task!r}: {source.factory} ({source.origin}) is not a function")
    return make_env


def settings_class(source: TaskSource) -> type | None:
    """The dataclass ``Config`` of the factory's module, if it has one; checked against the generic keys:
    a field may redefine an ``[env]`` key only where ``EnvConfig.TASK_OVERRIDES`` allows it, with its type."""
    if not source.factory:
        return None
    cls = getattr(_module(source.factory, source.task), "Config", None)
    if cls is None or not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        return None
    generic = keys(EnvConfig)
    for key, hint in keys(cls).items():
        if key in RESERVED_KEYS:
            raise ConfigError(f"{cls.__module__}.Config: its key {key!r} is reserved in [env.{source.task}]")
        if key in generic and (key not in EnvConfig.TASK_OVERRIDES or hint != generic[key]):
            raise ConfigError(f"{cls.__module__}.Config: env.{source.task}.{key} shadows env.{key}, which "
                              f"EnvConfig.TASK_OVERRIDES does not allow")
    return cls


def read_settings(cls: type, raw: dict[str, Any], task: str) -> Any:
    """``[env.<task>]`` (reserved keys left out) as an instance of ``cls``: an unknown key or a value of
    the wrong type is refused naming the key. Text (a flag, an env var) is read as the field's type."""
    hints = keys(cls)
    declared = {f.name: f for f in dataclasses.fields(cls)}
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if key in RESERVED_KEYS:
            continue
        dotted = f"env.{task}.{key}"
        if key not in hints:
            near = difflib.get_close_matches(key, list(hints), n=1, cutoff=0.6)
            hint = f"did you mean env.{task}.{near[0]}?" if near else f"known: {', '.join(sorted(hints))}"
            raise ConfigError(f"unknown config key {dotted} ({hint})")
        hint = hints[key]
        if isinstance(value, str) and hint is not str and typing.get_origin(hint) is not typing.Union:
            value = parse_text(value, hint, dotted)
        values[key] = check_field(value, declared[key], hint, dotted)
    return cls(**values)


def task_settings(task: str, env: EnvConfig) -> Any:
    """What ``env.section(task)`` returns: the task's ``Config`` instance, or its table as a dict."""
    raw = env.sections.get(task, {})
    cls = settings_class(find_task(task, env))
    if cls is None:
        return {k: v for k, v in raw.items() if k not in RESERVED_KEYS} if isinstance(raw, dict) else raw
    if isinstance(raw, cls):
        return raw
    if not isinstance(raw, dict):
        raise ConfigError(f"env.{task}: expected a table of settings or a {cls.__name__}, got {raw!r}")
    return read_settings(cls, raw, task)


def check_sections(env: EnvConfig, tasks: list[str]) -> None:
    """Every task of ``tasks`` and every ``[env.<task>]`` present must be servable and its settings valid:
    what ``jetrl up`` checks before it starts anything (an error here, not a crash loop later)."""
    for task in sorted(set(tasks) | set(env.sections)):
        env.section(task)


def settings_help(task: str, env: EnvConfig) -> list[tuple[str, Any, Any, str]]:
    """(key, type, default, help) of each key of ``[env.<task>]``: what ``jetrl config --task`` prints."""
    cls = settings_class(find_task(task, env))
    out: list[tuple[str, Any, Any, str]] = [
        ("factory", str, "", "the task's make_env, package.module:make_env (reserved; empty = its entry point)"),
        ("command", list[str], [], "an external program serving the task over NATS (reserved; docs/env-protocol.md)")]
    if cls is None:
        return out
    default = cls()
    for f in dataclasses.fields(cls):
        out.append((f.name, keys(cls)[f.name], getattr(default, f.name), field_help(f)))
    return out


@dataclass(frozen=True)
class ExternalEnv:
    """What ``jetrl up`` tells an external env program (``[env.<task>] command``), as environment variables
    (``VARIABLES``: the one place their names are written). The program connects to ``nats_url`` as
    ``nats_user`` with the password in ``nats_password_file`` (both empty on an open server), serves the env
    subjects of ``task`` under ``nats_prefix`` and heartbeats as ``replica_id`` (docs/env-protocol.md)."""

    nats_url: str
    nats_user: str
    nats_password_file: str
    nats_prefix: str
    task: str
    replica_id: str
    heartbeat_ttl_s: float

    VARIABLES: typing.ClassVar[dict[str, str]] = {
        "nats_url": "JETRL_NATS_URL",  # nats://host:port (a cluster's members comma-separated)
        "nats_user": "JETRL_NATS_USER",  # the env role's user; empty = no auth
        "nats_password_file": "JETRL_NATS_PASSWORD_FILE",  # a file holding its password; empty = no auth
        "nats_prefix": "JETRL_NATS_PREFIX",  # the run's namespace: every subject starts with it
        "task": "JETRL_TASK",  # the task to serve
        "replica_id": "JETRL_REPLICA_ID",  # this replica's id, unique in the run (its registry key)
        "heartbeat_ttl_s": "JETRL_HEARTBEAT_TTL_S",  # a replica silent this long is dropped from the registry
    }

    def environ(self) -> dict[str, str]:
        return {name: str(getattr(self, key)) for key, name in self.VARIABLES.items()}
