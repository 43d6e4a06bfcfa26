"""The DB task (AgentBench dbbench, function-calling version): ``make_env(cfg)`` for ``python -m services.envs db``."""

from services.envs.db.config import DBTaskConfig
from services.envs.db.env import DBEnv, make_env

Config = DBTaskConfig
"""[env.db]: the settings the task registry (shared/tasks.py) reads and checks."""

__all__ = ["Config", "DBEnv", "make_env"]
