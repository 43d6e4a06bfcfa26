"""[env]: the generic keys every task's env service reads; each task's own keys in [env.<task>], read by
the task's settings class, which only its plugin knows (shared/tasks.py), where the task is served. A task
section overrides a generic key only where ``EnvConfig.TASK_OVERRIDES`` allows it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from shared.config.fields import check_type, keys, opt, parse_text


@dataclass
class EnvConfig:
    """[env]: what every task's env service reads; [env.<task>] sections hold each task's own keys,
    read by the task's plugin (shared/tasks.py): ``section(task)``, or ``env.<task>`` for short."""

    TASK_OVERRIDES: ClassVar[frozenset[str]] = frozenset({"max_observation_chars"})
    """Generic keys a task section may redefine, the task's value winning for that task (a results page
    or a list of admissible commands needs a longer observation). A task's settings class redefining
    any other generic key is refused (shared/tasks.py)."""

    task: str = opt("", "which task this env replica serves (python -m services.envs TASK sets it)")
    factory: str = opt("", "this env replica's make_env, package.module:make_env, overriding its task's "
                           "[env.<task>] factory and entry point (python -m services.envs TASK --env.factory=...)")
    max_sessions: int = opt(64, "open sessions per replica; start is refused (503) beyond it", ge=1)
    worker_threads: int = opt(32, "threads that run tool calls (and episode opens and closes) for all of a "
                                  "replica's sessions; a session's calls still run one at a time, in order. "
                                  "A call past action_timeout_s gives its slot back while its thread finishes", ge=1)
    session_timeout_s: float = opt(600.0, "an idle session is closed after this many seconds", gt=0)
    action_timeout_s: float = opt(10.0, "wall-clock limit for one tool call", gt=0)
    max_observation_chars: int = opt(800, "tool output beyond this is cut (and the cut stated); a task section "
                                          "may set its own")
    invalid_action_ends_episode: bool = opt(False, "a turn without a usable tool call ends the episode "
                                                   "(status invalid_action, reward 0) instead of an error observation")
    num_train_tasks: int = opt(256, "generated training tasks per task type")
    num_test_tasks: int = opt(64, "generated test tasks per task type")
    data_dir: str = opt("", "cache for built task data; empty = ~/.cache/jetrl/data")
    sections: dict[str, Any] = field(default_factory=dict, metadata={"task_sections": True})
    """[env.<task>] tables as given (a dict each; typed values from a file, text from flags and env vars), or
    a task's settings instance (tests); not a key itself. ``section(task)`` reads one."""

    def section(self, task: str) -> Any:
        """[env.<task>] as the task's settings: an instance of its ``Config`` dataclass, validated, or the
        table as a dict where it declares none (shared/tasks.py). Raises ConfigError for a bad key or an
        unknown task. Read once, then kept."""
        from shared.tasks import task_settings  # the registry reads EnvConfig: imported when first needed

        cache = self.__dict__.setdefault("_settings", {})
        if task not in cache:
            cache[task] = task_settings(task, self)
        return cache[task]

    def __getattr__(self, name: str) -> Any:
        """``env.<task>``: the task's settings (``section``), so a task's code reads ``cfg.<task>.key``."""
        if name.startswith("_") or name == "sections" or "sections" not in self.__dict__:
            raise AttributeError(name)
        from shared.tasks import UnknownTask

        try:
            return self.section(name)
        except UnknownTask:
            raise AttributeError(f"EnvConfig has no key {name!r} and no task of that name") from None

    def set_section(self, task: str, key: str, value: Any) -> None:
        """Set one key of [env.<task>] (the settings are read again on next use)."""
        raw = self.sections.setdefault(task, {})
        if not isinstance(raw, dict):
            raw = self.sections[task] = dataclasses.asdict(raw)
        raw[key] = value
        self.__dict__.get("_settings", {}).pop(task, None)
        self.__dict__.get("_unknown_tasks", set()).discard(task)

    def task_value(self, task: str, key: str) -> Any:
        """A generic key as one task sees it: the task section's value where it overrides the key
        (TASK_OVERRIDES), else [env]'s. A task no registry knows (a test's own env) sees [env]'s."""
        from shared.tasks import UnknownTask

        if key in self.TASK_OVERRIDES:
            unknown = self.__dict__.setdefault("_unknown_tasks", set())  # looked up once: a call per observation
            try:
                section = self.sections.get(task, {}) if task in unknown else self.section(task)
            except UnknownTask:
                unknown.add(task)
                section = self.sections.get(task, {})
            if isinstance(section, dict) and key in section:
                hint, value = keys(EnvConfig)[key], section[key]
                value = parse_text(value, hint, f"env.{task}.{key}") if isinstance(value, str) else value
                return check_type(value, hint, f"env.{task}.{key}")
            if not isinstance(section, dict) and hasattr(section, key):
                return getattr(section, key)
        return getattr(self, key)
