"""``jetrl config``: every key with its type, default and help, as the declarations say them."""

from __future__ import annotations

import dataclasses
from typing import Any

from shared.config.env import EnvConfig
from shared.config.fields import ConfigError, field_help, keys, type_name
from shared.config.root import JetRLConfig


def describe(task: str | None = None, env: EnvConfig | None = None) -> str:
    """Every key with its type, default and help: the text behind `jetrl config`. With a task, only
    what that task's env service reads: [env] and [env.<task>] (from the task's settings class, found
    through ``env``'s sections or the task's entry point: shared/tasks.py)."""
    from shared.tasks import registered_tasks, settings_help

    env = env if env is not None else EnvConfig()
    out: list[str] = []

    def line(key: str, hint: Any, value: Any, help: str, note: str = "") -> None:
        out.append(f"  {key} ({type_name(hint)}) = {value!r}  # {help}{note}")

    def table(name: str, section: Any, overridden: set[str] = frozenset()) -> None:
        out.append(f"[{name}]")
        hints, nested = keys(section), []
        for f in dataclasses.fields(section):
            if f.name not in hints:
                continue
            if dataclasses.is_dataclass(hints[f.name]):
                nested.append(f.name)
                continue
            note = f"  [{task} uses env.{task}.{f.name} instead]" if f.name in overridden else ""
            line(f.name, hints[f.name], getattr(section, f.name), field_help(f), note)
        for child in nested:
            table(f"{name}.{child}", getattr(section, child))

    def task_table(name: str) -> None:
        try:
            rows = settings_help(name, env)
        except ConfigError as exc:
            out.append(f"[env.{name}]  # its settings cannot be read here: {exc}")
            return
        out.append(f"[env.{name}]")
        for key, hint, value, help in rows:
            line(key, hint, value, help)

    cfg = JetRLConfig()
    if task is not None:
        task_keys = {key for key, *_ in settings_help(task, env)}  # an unknown task: UnknownTask, naming the known
        table("env", cfg.env, task_keys & EnvConfig.TASK_OVERRIDES)
        task_table(task)
        out.insert(0, f"# what the {task} env service reads: [env] (every task) and [env.{task}]; "
                      "`jetrl config` lists every section")
        return "\n".join(out)
    for name in keys(cfg):
        table(name, getattr(cfg, name))
    for name in sorted(registered_tasks()):
        task_table(name)
    return "\n".join(out)
