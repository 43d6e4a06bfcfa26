"""MCP tool servers as JetRL tasks, unchanged: ``env.py`` says what maps to what, ``session.py`` how an
episode holds its MCP session, ``tasks.py`` the task file and the graders. Optional extra:
``pip install 'jetrl[mcp]'``."""

from __future__ import annotations

from services.envs.mcp_tools.config import McpToolsConfig
from services.envs.mcp_tools.env import McpEpisode, McpToolsEnv
from shared.config import EnvConfig

Config = McpToolsConfig
"""[env.<task>]: the settings the task registry (shared/tasks.py) reads and checks."""


def make_env(cfg: EnvConfig) -> McpToolsEnv:
    return McpToolsEnv(cfg.section(cfg.task), name=cfg.task)


__all__ = ["Config", "McpEpisode", "McpToolsConfig", "McpToolsEnv", "make_env"]
