"""Two database backends behind one small interface: embedded SQLite (default, ``sqlite_db.py``) and a
MariaDB/MySQL server (``mariadb_db.py``); this module holds what they share.

Each episode gets a private database that only it can reach:

* SQLite: a fresh in-memory database per episode; ATTACH is off (limit 0) and an authorizer refuses
  DDL and pragmas, so the agent has SELECT/INSERT/UPDATE/DELETE and temp tables, as on MariaDB.
  Statements are read as MySQL reads them (``dialect.py``: backslash escapes, digit-leading names,
  string-number comparison, a case- and accent-insensitive collation on TEXT columns).
* MariaDB: ``CREATE DATABASE jdb_<time>_<hex>`` (utf8mb4) and a user of the same name with a random
  password and only SELECT/INSERT/UPDATE/DELETE/CREATE TEMPORARY TABLES on that database; both are
  dropped on close. The agent's connection runs with ``sql_mode=''`` (non-strict, as AgentBench's
  MySQL) and ``max_statement_time``, re-applied after any statement that could have changed them; a
  watchdog kills any statement still running a second past the limit (``SET STATEMENT ... FOR`` can
  lift the session limit for one statement).

Both read a result lazily and stop at ``max_rows`` rows or ``max_chars`` characters of output (a
100 MB result is never held in memory), and state the cut in the observation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import structlog

log = structlog.get_logger()


@dataclass
class Limits:
    timeout_s: float = 5.0  # per statement
    max_rows: int = 1000  # rows read from one result
    max_chars: int = 800  # characters of result text kept (the observation limit)
    max_value_bytes: int = 1_000_000  # SQLite: longest string/blob a statement may build
    max_db_pages: int = 16_384  # SQLite: 64 MiB of 4 KiB pages per episode


@dataclass
class Result:
    rows: list[tuple[Any, ...]] | None  # None: the statement returned no result set
    text: str  # what the agent sees
    error: str | None = None
    truncated: bool = False
    elapsed_s: float = 0.0


def quote(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"


def format_rows(cur_iter: Any, limits: Limits) -> tuple[list[tuple[Any, ...]], str, bool]:
    """Read rows until a limit; text is AgentBench's ``str(list_of_tuples)`` form, cut where stated."""
    rows: list[tuple[Any, ...]] = []
    parts: list[str] = []
    size, truncated = 2, False
    for row in cur_iter:
        if len(rows) >= limits.max_rows:
            truncated = True
            break
        row = tuple(row)
        piece = repr(row)
        rows.append(row)
        parts.append(piece)
        size += len(piece) + 2
        if size > limits.max_chars:
            truncated = True
            break
    text = "[" + ", ".join(parts) + "]"
    if truncated:
        note = (f"[TRUNCATED: the result has more than {limits.max_rows} rows]" if len(rows) >= limits.max_rows
                else f"[TRUNCATED: output limited to {limits.max_chars} characters]")
        text = text[: max(0, limits.max_chars - len(note) - 1)] + " " + note
    return rows, text, truncated
