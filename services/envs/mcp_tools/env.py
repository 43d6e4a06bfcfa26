"""An MCP tool server as a JetRL task, unchanged: the server's tools are the episode's tools, a task file
gives the prompts, a grader the reward.

* **session**: every episode opens its own MCP session (a stdio server is started for it; an HTTP
  server gives it an ``Mcp-Session-Id``) and closes it when the episode ends, is cancelled or times out
  idle, so one episode's state never leaks into another's; or, for a server that keeps no per-session
  state (``sessions = "pooled"``, or ``auto`` and an HTTP server that assigns no session id), the
  episodes share a pool of open sessions, each call borrowing one, and an episode's own state is what
  the episode holds (its task, its transcript);
* **tools**: as the episode's session lists them (name, description, ``inputSchema`` as the function's
  parameters), less ``hide_tools`` and a verifier, plus ``submit_answer(answer)``, which ends the episode;
* **a call**: its content blocks become the tool result; a result the server marks ``isError`` is shown
  as ``Error: ...`` and the episode goes on, as does a call the server refuses (an unknown tool, bad
  arguments);
* **end**: the answer is graded (``tasks.py``); a server that dies mid-episode ends it as env_error, a
  call past ``call_timeout_s`` as env_timeout, never with a reward.
"""

from __future__ import annotations

from typing import Any

import structlog

from services.envs.base import Episode, TaskEnv, TaskLevel, ToolCall, ToolError, ToolResult
from services.envs.mcp_tools.config import McpToolsConfig
from services.envs.mcp_tools.session import LoopThread, McpSession, SessionPool
from services.envs.mcp_tools.tasks import (
    BUILT_IN,
    VERIFIER,
    McpTask,
    grade_answer,
    load_callable,
    load_tasks,
    result_text,
    verifier_reward,
)
from shared.messages import EpisodeStatus

log = structlog.get_logger()


def server_target(settings: McpToolsConfig, task: str) -> Any:
    """What ``mcp.Client`` connects to: the URL, or the stdio server's parameters."""
    from mcp import StdioServerParameters
    from mcp.client.stdio import get_default_environment

    if bool(settings.url) == bool(settings.server_command):
        raise ValueError(f"env.{task}: name the MCP server by exactly one of url or server_command")
    if settings.url:
        return settings.url
    command, *args = settings.server_command
    # the SDK's own rule: only variables safe to inherit (HOME, PATH, ...), never the replica's credentials
    return StdioServerParameters(command=command, args=args, env={**get_default_environment(), **settings.server_env})


def as_function(tool: Any) -> dict[str, Any]:
    """An MCP tool as an OpenAI function schema, its names and schema as the server lists them."""
    parameters = dict(tool.input_schema or {"type": "object", "properties": {}})
    parameters.setdefault("properties", {})
    return {"type": "function", "function": {"name": tool.name, "description": tool.description or "",
                                             "parameters": parameters}}


class McpEpisode(Episode):
    calls_per_message = "all"  # as an MCP client runs a model's parallel tool calls: each, in order

    def __init__(self, env: McpToolsEnv, task: McpTask) -> None:
        self.env, self.task, self.settings = env, task, env.settings
        self.max_turns = self.settings.max_turns
        self.transcript: list[dict[str, Any]] = []
        self.tool_errors = 0
        self.own_session = env.pool is None  # a pooled episode borrows a session for each call instead
        self.session: McpSession | SessionPool
        if env.pool is not None:
            self.session = env.pool
        else:
            self.session = McpSession(env.loop, env.target, self.settings.protocol, self.settings.startup_timeout_s)
            env.sessions.add(self.session)
        try:
            listed = self.session.list_tools(self.settings.startup_timeout_s)
            for step in task.setup:
                result = self.session.call_tool(step["tool"], step.get("arguments", {}), self.settings.call_timeout_s)
                if result.is_error:
                    raise RuntimeError(f"task {task.id}: setup call {step['tool']} failed: {result_text(result)}")
        except BaseException:
            self.close()
            raise
        hidden = set(self.settings.hide_tools) | env.verifiers
        self._tools = [as_function(t) for t in listed if t.name not in hidden] + [env.answer_schema]

    @property
    def tools(self) -> list[dict[str, Any]]:
        return self._tools

    def opening(self) -> list[dict[str, Any]]:
        names = ", ".join(t["function"]["name"] for t in self._tools[:-1]) or "none"
        system = self.settings.instructions or (
            f"Solve the task with the tools you are given ({names}). Call one tool per turn. When you know "
            f"the answer, call {self.settings.answer_tool} with it; that ends the task.")
        return [{"role": "system", "content": system}, {"role": "user", "content": self.task.prompt}]

    def call(self, tool: ToolCall) -> ToolResult:
        if tool.name == self.settings.answer_tool:
            return self._grade(str(tool.arguments["answer"]))
        from mcp.shared.exceptions import MCPError

        try:
            result = self.session.call_tool(tool.name, tool.arguments, self.settings.call_timeout_s)
        except MCPError as exc:  # the server refused the call (a JSON-RPC error): the agent sees why
            raise ToolError(f"The server refused the call: {exc}") from None
        text = result_text(result)
        self.transcript.append({"tool": tool.name, "arguments": tool.arguments, "result": text,
                                "is_error": bool(result.is_error)})
        if result.is_error:
            self.tool_errors += 1
            text = text if text.lower().startswith("error") else f"Error: {text}"
        return ToolResult(content=text, metrics={"tool_errors": float(self.tool_errors)})

    def _grade(self, answer: str) -> ToolResult:
        self.transcript.append({"tool": self.settings.answer_tool, "arguments": {"answer": answer}, "result": "",
                                "is_error": False})
        grader = self.task.grader
        if grader in BUILT_IN:
            reward = grade_answer(grader, answer, self.task.answer, self.settings.numeric_tolerance)
        elif grader.startswith(VERIFIER):
            arguments = {"answer": answer, **self.task.verifier_arguments}
            reward = verifier_reward(self.session.call_tool(grader[len(VERIFIER):], arguments,
                                                            self.settings.call_timeout_s))
        else:
            reward = float(load_callable(grader)(dict(self.task.record), [dict(t) for t in self.transcript]))
        verdict = "correct" if reward >= 1.0 else f"graded {reward:g}"
        return ToolResult(content=f"Answer submitted: {verdict}.", finish=True, reward=reward,
                          status=EpisodeStatus.COMPLETED, metrics={"tool_errors": float(self.tool_errors)})

    def close(self) -> None:
        if self.own_session:
            assert isinstance(self.session, McpSession)
            self.session.close()
            self.env.sessions.discard(self.session)


class McpToolsEnv(TaskEnv):
    def __init__(self, settings: McpToolsConfig, name: str = "mcp") -> None:
        self.settings, self.name = settings, name
        self.target = server_target(settings, name)
        self.tasks = {t.id: t for t in load_tasks(settings.tasks_file, settings.grader)}
        self.splits = {split: [t.id for t in self.tasks.values() if t.split == split] for split in ("train", "test")}
        self.verifiers = {t.grader[len(VERIFIER):] for t in self.tasks.values() if t.grader.startswith(VERIFIER)}
        for grader in {t.grader for t in self.tasks.values()} - set(BUILT_IN):
            if not grader.startswith(VERIFIER):
                load_callable(grader)  # a grader that does not import fails at start
        self.answer_schema = {"type": "function", "function": {
            "name": settings.answer_tool, "description": "Submit your final answer; this ends the task.",
            "parameters": {"type": "object", "properties": {
                "answer": {"type": "string", "description": "The final answer."}},
                "required": ["answer"], "additionalProperties": False}}}
        self.loop = LoopThread(f"mcp-{name}")
        self.sessions: set[McpSession] = set()  # open ones; any left at close are closed with the replica
        self.pool: SessionPool | None = None
        try:
            self._check_server()
        except BaseException:
            self.close()
            raise

    def _check_server(self) -> None:
        """One session at start: the server answers, the answer tool is free, the verifiers exist; then the
        pool, where the episodes share one."""
        session = McpSession(self.loop, self.target, self.settings.protocol, self.settings.startup_timeout_s)
        try:
            names = {t.name for t in session.list_tools(self.settings.startup_timeout_s)}
        finally:
            session.close()
        with_setup = sorted(t.id for t in self.tasks.values() if t.setup)
        mode = self.settings.sessions
        if mode == "auto":
            # MCP's one standard word on state: a streamable-HTTP server MAY assign an Mcp-Session-Id; one that
            # does not (stateless HTTP, the sessionless protocol) has no per-session state for a session of an
            # episode's own to isolate. A stdio process is its session: nothing declares it stateless.
            sessionless = isinstance(self.target, str) and session.http_session_id is None
            mode = "pooled" if sessionless and not with_setup else "per_episode"
        elif mode == "pooled" and with_setup:
            raise ValueError(f"env.{self.name}.sessions = pooled: task(s) {', '.join(with_setup[:5])} have setup "
                             "calls, which give an episode server-side state of its own; use per_episode")
        self._check_tools(names)
        if mode == "pooled":
            self.pool = SessionPool(self.loop, self.target, self.settings.protocol, self.settings.pool_size,
                                    self.settings.startup_timeout_s)
        log.info("mcp_server_checked", task=self.name, tools=len(names), tasks=len(self.tasks), sessions=mode)

    def _check_tools(self, names: set[str]) -> None:
        if self.settings.answer_tool in names:
            raise ValueError(f"env.{self.name}.answer_tool {self.settings.answer_tool!r} is also a tool of the "
                             f"server: choose another name")
        missing = sorted(self.verifiers - names)
        if missing:
            raise ValueError(f"env.{self.name}: verifier tool(s) {', '.join(missing)} not offered by the server "
                             f"(its tools: {', '.join(sorted(names))})")

    def task_ids(self, split: str) -> list[str]:
        return list(self.splits.get(split, []))

    def task_level(self, task_id: str, split: str) -> TaskLevel:
        task = self.tasks[task_id]
        if task.split != split:
            raise KeyError(task_id)
        return TaskLevel(level=task.level, kind=task.kind)

    def open(self, task_id: str, split: str, seed: int) -> Episode:
        task = self.tasks.get(task_id)
        if task is None or task.split != split:
            raise KeyError(task_id)
        return McpEpisode(self, task)

    def oracle(self, episode: Episode) -> ToolCall:
        """The task's own answer, submitted: what a task with an ``answer`` is solved by (demonstrations for
        ``jetrl sft``, ``jetrl env-check``). A task graded by a verifier or a function alone has no oracle."""
        assert isinstance(episode, McpEpisode)
        if episode.task.answer is None:
            raise NotImplementedError(f"{self.name} has no oracle for task {episode.task.id}: no answer to submit")
        answer = episode.task.answer
        if episode.task.grader == "regex":
            raise NotImplementedError(f"{self.name} has no oracle for task {episode.task.id}: its answer is a "
                                      "pattern")
        return ToolCall(self.settings.answer_tool, {"answer": str(answer)})

    def close(self) -> None:
        for session in list(self.sessions):
            session.close()
        if self.pool is not None:
            self.pool.close()
        self.loop.close()

