"""[env.<task>] of an OpenEnv environment server served as a JetRL task."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.config import opt


@dataclass
class OpenEnvConfig:
    """[env.openenv] (or any task whose factory is ``services.envs.openenv_env:make_env``): an OpenEnv server,
    unchanged."""

    url: str = opt("", "base URL of a running OpenEnv server (http://host:port); with server_command, where the "
                       "started server serves its env (default http://127.0.0.1:{port})")
    server_command: list[str] = opt([], "a command that starts an OpenEnv server, once per env replica; "
                                        "{port} in it (and $PORT) is a free port the replica picked "
                                        "(docker run -p {port}:8000 IMAGE works too); restarted if it exits")
    server_startup_timeout_s: float = opt(120.0, "how long a started server may take to answer /health")
    transport: str = opt("auto", "websocket (/ws: one session per episode) | http (/reset and /step: the "
                                 "server's own state, one episode at a time) | auto (websocket where offered)")
    tasks: list[str] = opt([], "the env's own task names, passed to reset as task_key; empty = seeds only")
    task_key: str = opt("task_id", "the reset argument that names the task")
    reset_kwargs: dict[str, Any] = opt({}, "more reset arguments, the same for every episode")
    reward: str = opt("last", "the episode's reward: last (the reward of the step that says done) | sum (of "
                              "every step's reward)")
    observation_field: str = opt("", "show only this field of an observation; empty = the one field there is, "
                                     "else every field but done, reward and metadata, as JSON")
    max_turns: int = opt(30, "steps per episode")
    instructions: str = opt("", "the system message; empty = one that names the tools")
    step_timeout_s: float = opt(8.0, "limit of one reset or step (keep below env.action_timeout_s); past it "
                                     "the episode ends as env_timeout")
    test_seed_offset: int = opt(1_000_000, "test task i resets with seed offset + i, train task i with seed i")
