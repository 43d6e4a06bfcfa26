"""OpenEnv environment servers as JetRL tasks, unchanged: ``env.py`` says what maps to what, ``client.py``
speaks OpenEnv's protocol (WebSocket sessions, or HTTP), ``server.py`` starts a server when the config
gives a command. The adapter needs only ``websockets``; the ``[openenv]`` extra installs ``openenv-core``,
whose servers the tests run."""

from __future__ import annotations

from services.envs.openenv_env.config import OpenEnvConfig
from services.envs.openenv_env.env import OpenEnvEnv, OpenEnvEpisode
from shared.config import EnvConfig

Config = OpenEnvConfig
"""[env.<task>]: the settings the task registry (shared/tasks.py) reads and checks."""


def make_env(cfg: EnvConfig) -> OpenEnvEnv:
    return OpenEnvEnv(cfg.section(cfg.task), cfg.num_train_tasks, cfg.num_test_tasks, name=cfg.task)


__all__ = ["Config", "OpenEnvConfig", "OpenEnvEnv", "OpenEnvEpisode", "make_env"]
