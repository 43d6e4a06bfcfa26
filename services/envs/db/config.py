"""[env.db]: this task's own settings, read by the task registry (shared/tasks.py) from the
package's ``Config`` and checked key by key; the task's code reads them as ``cfg.db``."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config import opt


@dataclass
class DBTaskConfig:
    """[env.db]: SQL over SQLite (default) or a MariaDB/MySQL server."""

    server: str = opt("", "MariaDB/MySQL admin URL (mysql://user:pass@host:port), one database per episode; "
                          "empty = embedded SQLite")
    query_timeout_s: float = opt(5.0, "time limit of one SQL statement (keep below env.action_timeout_s)")
    max_rows: int = opt(1000, "rows read from one result set before it is cut")
    agentbench_file: str = opt("", "AgentBench dbbench jsonl served as split 'dev'; empty = none", path=True)
    levels: list[int] = opt([1, 2, 3], "difficulty levels of the generated splits (1 one table, 2 one table with two "
                                       "conditions, 3 several tables); task i has level 1 + i % 3 and the others of "
                                       "the num_*_tasks are left out")
    mysql_strict: str = opt("auto", "on the SQLite backend, refuse the agent's SQL that MySQL refuses (T-SQL [brackets], "
                                    "reserved words unquoted, table names in the wrong case): on | off | auto = on "
                                    "when training for AgentBench, i.e. when agentbench_file is set")
