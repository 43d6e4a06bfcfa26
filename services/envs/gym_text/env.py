"""A Gymnasium-style text env as a JetRL task: one episode is one ``reset(seed)`` and the ``step`` calls after it.

* **opening**: a system message (``instructions``) and the observation ``reset`` returns;
* **tool**: ``act(action: str)``; the text is read as the action space wants it (as it is for a text
  space, an integer for ``Discrete``, JSON for anything else) and checked with ``action_space.contains``:
  an action the space refuses is an error observation and costs no step;
* **observation**: the env's own text; an env whose observations are not text shows ``render()`` when
  it renders ``ansi`` (Gymnasium's toy-text games), else the observation as JSON;
* **end**: ``terminated`` ends the episode as completed, ``truncated`` (the env's TimeLimit) as
  task_limit_reached, both with the return: the sum of the step rewards, as the env defines them.
  JetRL counts an episode as a success when that reward is at least 1.

Task ids are seeds: ``seed-<i>`` for training (seed i), ``seed-<offset + i>`` for test, so the splits never
share one and any replica rebuilds an episode from its id and actions. Nothing here changes the env: a
``step`` that raises ends the episode as env_error (the host's rule), with the env's message.
"""

from __future__ import annotations

import json
import string
from collections.abc import Callable
from typing import Any

import numpy as np
import structlog

from services.envs.base import Episode, TaskEnv, TaskLevel, ToolCall, ToolError, ToolResult
from services.envs.gym_text.config import GymTextConfig
from shared.messages import EpisodeStatus

log = structlog.get_logger()


def act_tool(action_help: str) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {
        "name": "act",
        "description": f"Take one action in the environment and see what happens. {action_help}".strip(),
        "parameters": {"type": "object", "properties": {
            "action": {"type": "string", "description": "The action, as text."}},
            "required": ["action"], "additionalProperties": False}}}]


def describe_space(space: Any) -> str:
    """What an action of ``space`` looks like, for the tool's description."""
    from gymnasium import spaces

    if isinstance(space, spaces.Discrete):
        return f"An action is an integer from {int(space.start)} to {int(space.start + space.n - 1)}."
    if isinstance(space, spaces.Text):
        return f"An action is text of {space.min_length} to {space.max_length} characters."
    if isinstance(space, FreeText):
        return f"An action is text of at most {space.max_length} characters."
    return f"An action is JSON for the space {space}."


class FreeText:
    """An action space of any text up to ``max_length`` characters (TextArena's moves, reasoning-gym's answers).
    Gymnasium's ``Text`` wants a fixed charset, which free text in any language does not have."""

    def __init__(self, max_length: int = 4096) -> None:
        self.max_length = max_length

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length

    def __repr__(self) -> str:
        return f"FreeText({self.max_length})"


def read_action(space: Any, text: str) -> Any:
    """The tool's text as an action of ``space``; ToolError (the agent sees why) when it is not one."""
    from gymnasium import spaces

    if space is None:
        return text
    if isinstance(space, (spaces.Text, FreeText)):
        action: Any = text
    elif isinstance(space, spaces.Discrete):
        try:
            action = np.int64(int(text.strip()))
        except ValueError:
            raise ToolError(f"Action {text[:80]!r} is not an integer. {describe_space(space)}") from None
    else:
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            raise ToolError(f"Action {text[:80]!r} is not JSON. {describe_space(space)}") from None
        dtype = getattr(space, "dtype", None)
        action = np.asarray(value, dtype=dtype) if dtype is not None and not isinstance(value, dict) else value
    try:
        valid = bool(space.contains(action))
    except Exception:  # a space that cannot even compare the value: not one of its actions
        valid = False
    if not valid:
        if isinstance(space, spaces.Text):
            charset = "".join(sorted(space.character_set))
            allowed = "letters and digits" if set(charset) == set(string.ascii_letters + string.digits) else repr(charset)
            raise ToolError(f"Action {text[:80]!r} is not in the action space: {space.min_length} to "
                            f"{space.max_length} characters, each one of {allowed}.")
        raise ToolError(f"Action {text[:80]!r} is not in the action space. {describe_space(space)}")
    return action


def as_text(env: Any, observation: Any) -> str:
    """An observation as the agent reads it (see the module docstring)."""
    if isinstance(observation, str):
        return observation
    if getattr(env, "render_mode", None) == "ansi":
        rendered = env.render()
        if isinstance(rendered, str):
            return rendered
    return json.dumps(observation, default=_jsonable)


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return str(value)


class GymTextEpisode(Episode):
    def __init__(self, env: Any, seed: int, settings: GymTextConfig, task: str) -> None:
        self.env, self.seed = env, seed
        self.max_turns = settings.max_turns
        self.steps = 0
        self.total = 0.0
        self._tools = act_tool(settings.action_help or describe_space(env.action_space))
        observation, _ = env.reset(seed=seed)
        instructions = settings.instructions or getattr(env, "instructions", "") or (
            f"You are acting in the text environment {task}. Each turn, call the tool act with one action; "
            f"its result is what the environment shows next. {describe_space(env.action_space)}")
        self._opening = [{"role": "system", "content": instructions},
                         {"role": "user", "content": as_text(env, observation)}]

    @property
    def tools(self) -> list[dict[str, Any]]:
        return self._tools

    def opening(self) -> list[dict[str, Any]]:
        return [dict(m) for m in self._opening]

    def call(self, tool: ToolCall) -> ToolResult:
        action = read_action(self.env.action_space, tool.arguments["action"])
        observation, reward, terminated, truncated, _ = self.env.step(action)
        self.steps += 1
        self.total += float(reward)
        metrics = {"env_steps": float(self.steps), "return": self.total}
        text = as_text(self.env, observation)
        if terminated or truncated:
            status = EpisodeStatus.COMPLETED if terminated else EpisodeStatus.TASK_LIMIT_REACHED
            return ToolResult(content=text, finish=True, reward=self.total, status=status, metrics=metrics)
        return ToolResult(content=text, metrics=metrics)

    def limit_reached(self) -> ToolResult:
        """Out of turns: the episode is truncated, as a TimeLimit would, and keeps its return."""
        return ToolResult(content="Turn limit reached.", finish=True, reward=self.total,
                          status=EpisodeStatus.TASK_LIMIT_REACHED)

    def close(self) -> None:
        self.env.close()


class GymTextEnv(TaskEnv):
    """``build()`` makes one fresh env per episode (an env holds one episode's state)."""

    def __init__(self, settings: GymTextConfig, build: Callable[[], Any], num_train: int, num_test: int,
                 name: str = "gym") -> None:
        self.settings, self.build, self.name = settings, build, name
        offset = settings.test_seed_offset
        if num_train > offset:
            raise ValueError(f"env.{name}: {num_train} training seeds would reach the test seeds "
                             f"(test_seed_offset = {offset})")
        self.splits = {"train": [f"seed-{i}" for i in range(num_train)],
                       "test": [f"seed-{offset + i}" for i in range(num_test)]}
        self.seeds = {split: {t: int(t.removeprefix("seed-")) for t in ids} for split, ids in self.splits.items()}
        probe = build()  # a bad id or entry point fails here, at start, not in the first episode
        probe.close()

    def task_ids(self, split: str) -> list[str]:
        return list(self.splits.get(split, []))

    def task_level(self, task_id: str, split: str) -> TaskLevel:
        if task_id not in self.seeds.get(split, {}):
            raise KeyError(task_id)
        return TaskLevel(level=0, kind=self.settings.id or self.settings.entry_point)

    def oracle(self, episode: Episode) -> ToolCall:
        """Where the env knows its answer (a reasoning-gym question), the scripted expert submits it; a
        Gymnasium env or a TextArena game has no such expert."""
        assert isinstance(episode, GymTextEpisode)
        answer = getattr(episode.env, "oracle_action", None)
        if answer is None:
            raise NotImplementedError(f"{self.name} has no oracle: a {self.settings.source} env has no scripted expert")
        return ToolCall("act", {"action": answer()})

    def open(self, task_id: str, split: str, seed: int) -> Episode:
        env_seed = self.seeds[split][task_id]  # KeyError: unknown task
        env = self.build()
        try:
            return GymTextEpisode(env, env_seed, self.settings, self.name)
        except BaseException:
            env.close()
            raise
