"""The DB task env: AgentBench's function-calling DB task over a private database per episode.

Tools (AgentBench's names and arguments): ``execute_sql(query)`` runs one statement and returns the
raw result (``str`` of the row tuples, cut at the observation limit with the cut stated; SQL errors
come back as observations); ``commit_final_answer(answers)`` ends the episode and grades it.

Splits: ``train`` / ``test`` are generated (``generate.py``); ``dev`` is AgentBench's dbbench jsonl
when ``env.db.agentbench_file`` names one. Gold given by the data is used as is; generated tasks get theirs
by running the reference SQL on the episode's own database at open (a SELECT, or a DML statement
inside a transaction that is rolled back), so SQLite and MariaDB each grade by their own rendering.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import structlog

from services.envs.base import Episode, TaskEnv, TaskLevel, ToolCall, ToolError, ToolResult
from services.envs.db.backends import Limits
from services.envs.db.generate import generate, level_of
from services.envs.db.grading import answers_from_rows, compare
from services.envs.db.mariadb_db import MariaDBServer
from services.envs.db.sqlite_db import SQLiteDB
from services.envs.db.tasks import Task, load_agentbench, opening_messages
from shared.config import EnvConfig
from shared.messages import EpisodeStatus

log = structlog.get_logger()

TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "execute_sql",
        "description": "Executes a given SQL statement on the database and returns the result.",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string", "description": "The SQL query to be executed."}},
            "required": ["query"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "commit_final_answer",
        "description": "Commits the final answer after all operations are completed.",
        "parameters": {"type": "object", "properties": {
            "answers": {"type": "array", "items": {"type": "string"},
                        "description": "The list of final answers to commit."}},
            "required": ["answers"], "additionalProperties": False}}},
]


class DBEpisode(Episode):
    max_turns = 15  # AgentBench's max_round for dbbench
    calls_per_message = "all"  # AgentBench's dbbench runs every call of a message, in order

    def __init__(self, task: Task, db: Any, gold: Any = None) -> None:
        self.task, self.db = task, db
        self.calls: list[ToolCall] = []  # the action log, for replay and the oracle
        self.sql_errors = 0
        self.truncated = 0
        self.sql_time_s = 0.0
        # a call the host gave up on (action_timeout_s) may still run in its thread: the next one waits for it
        self._lock = threading.Lock()
        if gold is not None:  # computed by an earlier episode of the same task on this replica
            self.gold = gold
        elif task.modifies:
            self.gold = task.answer_md5 if task.answer_md5 is not None else \
                db.gold(task.ref_sql, True, task.hash_max_len)[1]
        elif task.label is not None:
            self.gold = task.label
        else:
            rows, _ = db.gold(task.ref_sql, False, task.hash_max_len)
            self.gold = answers_from_rows(rows or [])
        self.oracle_answers: list[str] = [] if task.modifies else list(self.gold)

    @property
    def tools(self) -> list[dict[str, Any]]:
        return TOOLS

    def opening(self) -> list[dict[str, Any]]:
        return opening_messages(self.task)

    def call(self, tool: ToolCall) -> ToolResult:
        with self._lock:
            return self._call(tool)

    def _call(self, tool: ToolCall) -> ToolResult:
        self.calls.append(tool)
        if tool.name == "execute_sql":
            sql = tool.arguments["query"]
            if not sql.strip():
                raise ToolError("execute_sql: the query is empty.")
            result = self.db.execute(sql)
            self.sql_time_s += result.elapsed_s
            self.sql_errors += result.error is not None
            self.truncated += result.truncated
            return ToolResult(content=result.text, metrics=self._metrics())
        if tool.name == "commit_final_answer":
            answers = tool.arguments["answers"]
            if not all(isinstance(a, str) for a in answers):
                raise ToolError("commit_final_answer: answers must be a list of strings.")
            if self.task.modifies:
                correct = compare(self.db.table_hash(self.task.hash_max_len), self.gold, self.task.type)
            else:
                correct = compare(answers, self.gold, self.task.type)
            return ToolResult(content=f"Answer committed; it is {'correct' if correct else 'wrong'}.", finish=True,
                              reward=1.0 if correct else 0.0, status=EpisodeStatus.COMPLETED,
                              metrics=dict(self._metrics(), correct=float(correct), level=float(self.task.level)))
        raise ToolError(f"Unknown tool {tool.name!r}.")

    def _metrics(self) -> dict[str, float]:
        return {"sql_errors": float(self.sql_errors), "sql_time_s": self.sql_time_s, "truncated": float(self.truncated)}

    def close(self) -> None:
        self.db.close()


class DBEnv(TaskEnv):
    name = "db"

    def __init__(self, cfg: EnvConfig) -> None:
        self.cfg = cfg
        # a statement must end (or be killed, +1 s) before the host stops waiting for the tool call
        timeout_s = min(cfg.db.query_timeout_s, max(0.5, cfg.action_timeout_s - 2.0))
        if timeout_s < cfg.db.query_timeout_s:
            log.warning("db_query_timeout_clamped", query_timeout_s=cfg.db.query_timeout_s, used=timeout_s,
                        action_timeout_s=cfg.action_timeout_s)
        self.limits = Limits(timeout_s=timeout_s, max_rows=cfg.db.max_rows,
                             max_chars=cfg.task_value("db", "max_observation_chars"))
        self.server = MariaDBServer(cfg.db.server, self.limits) if cfg.db.server else None
        if self.server is not None:
            reaped = self.server.reap(older_than_s=max(3 * cfg.session_timeout_s, 3600.0))
            log.info("db_server_ready", version=self.server.version, reaped=reaped)
        if cfg.db.mysql_strict not in ("auto", "on", "off"):
            raise ValueError(f"env.db.mysql_strict must be auto, on or off, got {cfg.db.mysql_strict!r}")
        # training for AgentBench (its data served): the agent must not learn SQL that AgentBench's MySQL refuses
        self.mysql_strict = cfg.db.mysql_strict == "on" or (cfg.db.mysql_strict == "auto" and bool(cfg.db.agentbench_file))
        self.dev: dict[str, Task] = {}
        if cfg.db.agentbench_file:
            self.dev = {t.task_id: t for t in load_agentbench(Path(cfg.db.agentbench_file))}
        self.counts = {"train": cfg.num_train_tasks, "test": cfg.num_test_tasks}
        unknown = set(cfg.db.levels) - {1, 2, 3}
        if unknown or not cfg.db.levels:
            raise ValueError(f"env.db.levels must be a non-empty subset of [1, 2, 3], got {cfg.db.levels}")
        self.levels = frozenset(cfg.db.levels)
        self._cache: dict[str, Task] = {}
        self._gold: dict[tuple[str, str], Any] = {}
        self._images: dict[tuple[str, str], bytes | None] = {}  # SQLite: each task's tables as built, ~20 kB
        self._lock = threading.Lock()
        self._sources: Any = None

    @property
    def backend(self) -> str:
        return "mariadb" if self.server is not None else "sqlite"

    def task_ids(self, split: str) -> list[str]:
        if split == "dev":
            return list(self.dev)
        return [f"{split}-{i:05d}" for i in range(self.counts.get(split, 0)) if level_of(i) in self.levels]

    def task(self, task_id: str, split: str) -> Task:
        if split == "dev":
            return self.dev[task_id]
        prefix, _, num = task_id.rpartition("-")
        if (prefix != split or split not in self.counts or not num.isdigit() or int(num) >= self.counts[split]
                or level_of(int(num)) not in self.levels):
            raise KeyError(task_id)
        with self._lock:
            if task_id not in self._cache:
                self._cache[task_id] = generate(split, int(num), **self.sources())
            return self._cache[task_id]

    def task_level(self, task_id: str, split: str) -> TaskLevel:
        task = self.task(task_id, split)
        return TaskLevel(task.level, task.type)

    def sources(self) -> dict[str, Any]:
        """Real tables (pydataset) and the multi-table generator (Chinook), built once and cached."""
        if self._sources is None:
            from services.envs.db.sources import load_sources

            self._sources = load_sources(self.cfg.data_dir)
        return self._sources

    def open(self, task_id: str, split: str, seed: int) -> DBEpisode:
        task = self.task(task_id, split)
        if self.server is not None:
            db = self.server.create(task.tables)
        else:  # a GRPO group opens the same task group_size times: the tables are built once, then copied
            image = self._images.get((split, task_id))
            db = SQLiteDB(task.tables, self.limits, image, mysql_strict=self.mysql_strict)
            if image is None:
                self._images[(split, task_id)] = db.image()
        try:
            episode = DBEpisode(task, db, self._gold.get((split, task_id)))
        except Exception:
            db.close()
            raise
        self._gold[(split, task_id)] = episode.gold  # a GRPO group plays the same task group_size times
        return episode

    def replay(self, task_id: str, split: str, seed: int, calls: list[ToolCall]) -> DBEpisode:
        """Rebuild a session from its action log (SQL statements are the whole state)."""
        episode = self.open(task_id, split, seed)
        for call in calls:
            if call.name == "execute_sql":
                episode.call(call)
        return episode

    def oracle(self, episode: Episode) -> ToolCall:
        assert isinstance(episode, DBEpisode)
        ran = any(c.name == "execute_sql" and c.arguments.get("query") == episode.task.ref_sql for c in episode.calls)
        if not ran and episode.task.ref_sql:
            return ToolCall("execute_sql", {"query": episode.task.ref_sql})
        return ToolCall("commit_final_answer", {"answers": episode.oracle_answers})

    def close(self) -> None:
        if self.server is not None:
            self.server.close()


def make_env(cfg: EnvConfig) -> DBEnv:
    return DBEnv(cfg)
