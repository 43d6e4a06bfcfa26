"""[env.<task>] of an MCP tool server served as a JetRL task: the server, the task file, the grader."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from shared.config import opt


@dataclass
class McpToolsConfig:
    """[env.mcp] (or any task whose factory is ``services.envs.mcp_tools:make_env``): an MCP server, unchanged."""

    server_command: list[str] = opt([], "a stdio MCP server: the program and its arguments, started once per "
                                        "episode (its own process is the episode's session), or pool_size of "
                                        "them for a pool")
    server_env: dict[str, str] = opt({}, "environment variables for the stdio server, beside the few the MCP SDK "
                                         "passes on (HOME, PATH, ...: never the replica's own)")
    url: str = opt("", "a streamable-HTTP MCP server (http://host:port/mcp): one MCP session per "
                       "episode, or pool_size of them for a pool")
    sessions: Literal["per_episode", "pooled", "auto"] = opt(
        "per_episode", "per_episode: each episode opens its own MCP session (a stdio process, an HTTP "
                       "Mcp-Session-Id) | pooled: pool_size open sessions shared by every episode, each call "
                       "borrowing one (only for a server that keeps no per-session state; tasks with setup "
                       "are refused) | auto: pooled where the HTTP server assigns no Mcp-Session-Id, else "
                       "per_episode (nothing in MCP lets a stdio server declare itself stateless)")
    pool_size: int = opt(4, "sessions = pooled: how many sessions the pool keeps open", ge=1)
    protocol: str = opt("legacy", "legacy: MCP's initialize handshake, one Mcp-Session-Id per episode (what "
                                  "servers keeping per-session state need) | auto: try the sessionless 2026 "
                                  "protocol first, then legacy")
    tasks_file: str = opt("", "JSONL, one task per line: prompt, and optionally id, answer, split (train | "
                              "test; default train), setup (tool calls run before the agent's first turn: "
                              "[{tool, arguments}]), grader, verifier_arguments, level, kind", path=True)
    grader: str = opt("exact", "how an answer is graded, unless its task names one: exact | regex (the task's "
                               "answer is a pattern the whole answer must match) | numeric | tool:NAME (the "
                               "server's tool NAME returns the reward) | pkg.mod:function(task, transcript)")
    answer_tool: str = opt("submit_answer", "the tool the agent ends an episode with, submit_answer(answer); "
                                            "added to the server's tools")
    hide_tools: list[str] = opt([], "server tools the agent is not shown (a verifier tool is never shown)")
    instructions: str = opt("", "the system message; empty = one that says to finish with the answer tool")
    max_turns: int = opt(15, "tool calls per episode")
    call_timeout_s: float = opt(8.0, "limit of one tool call on the server (keep below env.action_timeout_s); "
                                     "past it the episode ends as env_timeout")
    startup_timeout_s: float = opt(20.0, "limit of opening one session (starting the stdio server, the handshake, "
                                         "listing tools and the task's setup)")
    numeric_tolerance: float = opt(1e-6, "numeric grader: relative tolerance of a right answer")
