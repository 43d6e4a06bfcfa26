"""An OpenEnv environment server as a JetRL task, unchanged: one episode is one OpenEnv session.

* **session**: a WebSocket session (``/ws``) per episode where the server offers it, else ``/reset`` and
  ``/step`` over HTTP; ``reset`` gets the task's seed, its task name (``task_key``) and ``reset_kwargs``;
* **tools**: from ``/schema``'s action schema, one tool per action type (a union of actions gives one per
  member; a member's fixed discriminator, such as ``type: "move"``, is filled in, not asked for), its
  fields (less the base ``metadata``) as the arguments; an MCP-backed env (its actions are MCP's
  ``call_tool``) offers its own MCP tools instead, as its ``list_tools`` lists them;
* **a call**: the action goes to ``step``; the observation (less done, reward, metadata) is the tool
  result; an action the server refuses (a validation error, an exception in ``step``) is an error
  observation and the episode goes on;
* **end**: ``done`` ends the episode with the step's reward (``reward = "sum"``: the sum of every
  step's); a server that dies or closes the session ends it as env_error, one that hangs as env_timeout.

Task ids are ``seed-<i>`` (``<task>/seed-<i>`` with ``tasks``): training seeds 0.., test seeds from
``test_seed_offset``, so the splits never share one.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from typing import Any

import structlog

from services.envs.base import Episode, TaskEnv, TaskLevel, ToolCall, ToolError, ToolResult
from services.envs.openenv_env.client import HttpSession, ServerGone, WebSocketSession, get_json, offers_websocket
from services.envs.openenv_env.config import OpenEnvConfig
from services.envs.openenv_env.server import ManagedServer
from shared.messages import EpisodeStatus

log = structlog.get_logger()

HIDDEN_FIELDS = ("done", "reward", "metadata")
CAPACITY_WAIT_S = 2.0


@dataclass(frozen=True)
class ActionTool:
    """One action type as a tool: its schema, and the fields the tool fills in itself."""

    schema: dict[str, Any]
    fixed: dict[str, Any] = field(default_factory=dict)


def snake(title: str) -> str:
    name = re.sub(r"Action$", "", title) or "step"
    name = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower()
    return re.sub(r"[^a-z0-9_]", "_", name) or "step"


def action_tools(action_schema: dict[str, Any]) -> list[ActionTool]:
    """The tools of a plain (not MCP-backed) env's action schema."""
    defs = action_schema.get("$defs", {})

    def resolve(node: dict[str, Any]) -> dict[str, Any]:
        ref = node.get("$ref", "")
        return defs.get(ref.rsplit("/", 1)[-1], node) if ref.startswith("#/$defs/") else node

    members = action_schema.get("oneOf") or action_schema.get("anyOf") or [action_schema]
    tools = []
    for member in (resolve(m) for m in members):
        properties, fixed = {}, {}
        for name, prop in member.get("properties", {}).items():
            if name == "metadata":
                continue
            const = prop.get("const", prop["enum"][0] if len(prop.get("enum", [])) == 1 else None)
            if const is not None:
                fixed[name] = const  # a discriminator: the tool says which action it is
            else:
                properties[name] = prop
        parameters: dict[str, Any] = {"type": "object", "properties": properties,
                                      "required": [r for r in member.get("required", []) if r in properties]}
        if defs and "$ref" in json.dumps(properties):  # the member's fields refer to shared definitions
            parameters["$defs"] = defs
        title = str(member.get("title", "Action"))
        tools.append(ActionTool({"type": "function", "function": {
            "name": snake(title), "description": member.get("description") or f"Take the action {title}.",
            "parameters": parameters}}, fixed))
    names = [t.schema["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise ValueError(f"action types with the same tool name: {names}")
    return tools


def mcp_backed(action_schema: dict[str, Any]) -> bool:
    members = action_schema.get("oneOf") or action_schema.get("anyOf") or [action_schema]
    defs = action_schema.get("$defs", {})
    for member in members:
        member = defs.get(member.get("$ref", "").rsplit("/", 1)[-1], member)
        if {"tool_name", "arguments"} <= set(member.get("properties", {})):
            return True
    return False


def observation_text(observation: dict[str, Any], only: str) -> str:
    if only:
        value = observation.get(only, "")
        return value if isinstance(value, str) else json.dumps(value)
    shown = {k: v for k, v in observation.items() if k not in HIDDEN_FIELDS}
    if len(shown) == 1:
        (value,) = shown.values()
        return value if isinstance(value, str) else json.dumps(value)
    return json.dumps(shown)


def tool_result_text(observation: dict[str, Any]) -> str:
    """An MCP-backed env's CallToolObservation: its error, or the text of its result."""
    if observation.get("error"):
        raise ToolError(f"The tool failed: {observation['error'].get('message', observation['error'])}")
    result = observation.get("result")
    if isinstance(result, dict) and isinstance(result.get("content"), list):
        texts = [b.get("text", "") for b in result["content"] if isinstance(b, dict)]
        if result.get("is_error") or result.get("isError"):
            raise ToolError("The tool failed: " + "\n".join(texts))
        return "\n".join(texts)
    return result if isinstance(result, str) else json.dumps(result)


class OpenEnvEpisode(Episode):
    def __init__(self, env: OpenEnvEnv, reset_kwargs: dict[str, Any], url: str) -> None:
        self.env, self.settings = env, env.settings
        self.max_turns = self.settings.max_turns
        self.total = 0.0
        self.steps = 0
        self.session, first = self._start(url, reset_kwargs)
        try:
            if env.mcp:
                listed = self.session.step({"type": "list_tools"}).observation.get("tools", [])
                self.tools_by_name = {t["name"]: ActionTool({"type": "function", "function": {
                    "name": t["name"], "description": t.get("description", ""),
                    "parameters": t.get("input_schema") or t.get("inputSchema") or {"type": "object",
                                                                                     "properties": {}}}})
                    for t in listed}
            else:
                self.tools_by_name = {t.schema["function"]["name"]: t for t in env.tools}
        except BaseException:
            self.session.close()
            raise
        names = ", ".join(self.tools_by_name)
        system = self.settings.instructions or (
            f"You are acting in the environment {env.name}. Each turn, call one of its tools ({names}); the "
            "result is what the environment observes next. The episode ends when the environment says so.")
        self._opening = [{"role": "system", "content": system},
                         {"role": "user", "content": observation_text(first.observation, self.settings.observation_field)}]

    def _start(self, url: str, reset_kwargs: dict[str, Any]) -> tuple[Any, Any]:
        """A session and its reset. A server frees a closed session's slot a moment after the close, so a
        start that finds it at capacity tries again for ``CAPACITY_WAIT_S`` before it gives up."""
        timeout = self.settings.step_timeout_s
        deadline = time.monotonic() + CAPACITY_WAIT_S
        while True:
            session = WebSocketSession(url, timeout) if self.env.websocket else HttpSession(url, timeout)
            try:
                return session, session.reset(reset_kwargs)
            except ServerGone as exc:
                session.close()
                if "CAPACITY_REACHED" not in str(exc) or time.monotonic() > deadline:
                    raise
            except BaseException:
                session.close()
                raise
            time.sleep(0.1)

    @property
    def tools(self) -> list[dict[str, Any]]:
        return [t.schema for t in self.tools_by_name.values()]

    def opening(self) -> list[dict[str, Any]]:
        return [dict(m) for m in self._opening]

    def call(self, tool: ToolCall) -> ToolResult:
        if self.env.mcp:
            step = self.session.step({"type": "call_tool", "tool_name": tool.name, "arguments": tool.arguments})
            text = tool_result_text(step.observation)
        else:
            step = self.session.step({**tool.arguments, **self.tools_by_name[tool.name].fixed})
            text = observation_text(step.observation, self.settings.observation_field)
        self.steps += 1
        self.total += step.reward or 0.0
        metrics = {"env_steps": float(self.steps), "return": self.total}
        if step.done:
            reward = self.total if self.settings.reward == "sum" else (step.reward or 0.0)
            return ToolResult(content=text, finish=True, reward=reward, status=EpisodeStatus.COMPLETED,
                              metrics=metrics)
        return ToolResult(content=text, metrics=metrics)

    def limit_reached(self) -> ToolResult:
        reward = self.total if self.settings.reward == "sum" else 0.0
        return ToolResult(content="Turn limit reached.", finish=True, reward=reward,
                          status=EpisodeStatus.TASK_LIMIT_REACHED)

    def close(self) -> None:
        self.session.close()


class OpenEnvEnv(TaskEnv):
    def __init__(self, settings: OpenEnvConfig, num_train: int, num_test: int, name: str = "openenv") -> None:
        self.settings, self.name = settings, name
        if not settings.url and not settings.server_command:
            raise ValueError(f"env.{name}: name the OpenEnv server: url, or server_command that starts one")
        if settings.url and settings.server_command and "{port}" not in settings.url:
            raise ValueError(f"env.{name}.url: with server_command, the url of the started server has {{port}} "
                             f"in it (http://127.0.0.1:{{port}}/path), got {settings.url!r}")
        if settings.transport not in ("auto", "websocket", "http") or settings.reward not in ("last", "sum"):
            raise ValueError(f"env.{name}: transport is auto | websocket | http and reward is last | sum, got "
                             f"{settings.transport!r} and {settings.reward!r}")
        if num_train > settings.test_seed_offset:
            raise ValueError(f"env.{name}: {num_train} training seeds would reach the test seeds")
        self.server = ManagedServer(settings.server_command, settings.url, settings.server_startup_timeout_s, name) \
            if settings.server_command else None
        try:
            url = self.url()
            schema = get_json(url + "/schema", timeout_s=settings.step_timeout_s)
            self.mcp = mcp_backed(schema["action"])
            self.tools = [] if self.mcp else action_tools(schema["action"])
            self.websocket = settings.transport == "websocket" or (
                settings.transport == "auto" and offers_websocket(url, settings.step_timeout_s))
        except BaseException:
            self.close()
            raise
        prefixes = [f"{t}/" for t in settings.tasks] or [""]
        self.splits = {"train": [f"{p}seed-{i}" for p in prefixes for i in range(num_train)],
                       "test": [f"{p}seed-{settings.test_seed_offset + i}" for p in prefixes for i in range(num_test)]}
        self.known = {split: set(ids) for split, ids in self.splits.items()}
        log.info("openenv_ready", task=name, url=url, websocket=self.websocket, mcp_backed=self.mcp,
                 tools=[t.schema["function"]["name"] for t in self.tools])

    def url(self) -> str:
        return self.server.ensure_running() if self.server is not None else self.settings.url.rstrip("/")

    def task_ids(self, split: str) -> list[str]:
        return list(self.splits.get(split, []))

    def task_level(self, task_id: str, split: str) -> TaskLevel:
        if task_id not in self.known.get(split, set()):
            raise KeyError(task_id)
        return TaskLevel(level=0, kind=task_id.rpartition("/")[0])

    def open(self, task_id: str, split: str, seed: int) -> Episode:
        if task_id not in self.known.get(split, set()):
            raise KeyError(task_id)
        task, _, seed_part = task_id.rpartition("/")
        kwargs: dict[str, Any] = {**self.settings.reset_kwargs, "seed": int(seed_part.removeprefix("seed-"))}
        if task:
            kwargs[self.settings.task_key] = task
        return OpenEnvEpisode(self, kwargs, self.url())

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
