"""Gymnasium-style text envs as JetRL tasks, unchanged: a ``gymnasium.Env`` (by id or entry point), a
TextArena game or a reasoning-gym dataset. ``env.py`` says what maps to what; ``sources.py`` how each
source is seen as a Gymnasium env. Optional extra: ``pip install 'jetrl[gym]'``."""

from __future__ import annotations

from services.envs.gym_text.config import GymTextConfig
from services.envs.gym_text.env import GymTextEnv
from services.envs.gym_text.sources import builder
from shared.config import EnvConfig

Config = GymTextConfig
"""[env.<task>]: the settings the task registry (shared/tasks.py) reads and checks."""


def build_env(settings: GymTextConfig, task: str, num_train: int, num_test: int) -> GymTextEnv:
    return GymTextEnv(settings, builder(settings, task), num_train, num_test, name=task)


def make_env(cfg: EnvConfig) -> GymTextEnv:
    return build_env(cfg.section(cfg.task), cfg.task, cfg.num_train_tasks, cfg.num_test_tasks)


__all__ = ["Config", "GymTextConfig", "GymTextEnv", "build_env", "make_env"]
