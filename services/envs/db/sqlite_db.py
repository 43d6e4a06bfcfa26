"""The SQLite backend: a fresh in-memory database per episode, read as MySQL reads it (backends.py says how)."""

from __future__ import annotations

import re
import sqlite3
import time
from collections.abc import Sequence
from typing import Any

import structlog

from services.envs.db import dialect, strict
from services.envs.db.backends import Limits, Result, format_rows, quote
from services.envs.db.grading import combine_hashes, rows_hash
from services.envs.db.tasks import Table

log = structlog.get_logger()


_SQLITE_DENY = {
    sqlite3.SQLITE_ATTACH, sqlite3.SQLITE_DETACH, sqlite3.SQLITE_CREATE_TABLE, sqlite3.SQLITE_DROP_TABLE,
    sqlite3.SQLITE_ALTER_TABLE, sqlite3.SQLITE_CREATE_INDEX, sqlite3.SQLITE_DROP_INDEX, sqlite3.SQLITE_CREATE_VIEW,
    sqlite3.SQLITE_DROP_VIEW, sqlite3.SQLITE_CREATE_TRIGGER, sqlite3.SQLITE_DROP_TRIGGER,
    sqlite3.SQLITE_CREATE_VTABLE, sqlite3.SQLITE_DROP_VTABLE,
}
_SQLITE_READ_PRAGMAS = {"table_info", "table_xinfo", "table_list", "index_list", "index_info", "foreign_key_list"}


def _concat(*args: Any) -> str | None:  # MySQL's CONCAT (NULL if any argument is NULL)
    return None if any(a is None for a in args) else "".join(str(a) for a in args)


def _concat_ws(sep: Any, *args: Any) -> str | None:
    return None if sep is None else str(sep).join(str(a) for a in args if a is not None)


def _date_part(start: int, end: int) -> Any:
    def part(value: Any) -> int | None:
        try:
            return int(str(value)[start:end])
        except (TypeError, ValueError):
            return None
    return part


_MYSQL_FUNCTIONS: dict[str, tuple[int, Any]] = {  # MySQL functions an agent reaches for, by arity
    "concat": (-1, _concat), "concat_ws": (-1, _concat_ws), "if": (3, lambda c, a, b: a if c else b),
    "year": (1, _date_part(0, 4)), "month": (1, _date_part(5, 7)), "day": (1, _date_part(8, 10)),
}
_SHOW_TABLES = re.compile(r"\s*SHOW\s+(FULL\s+)?TABLES\s*;?\s*", re.I)
_DESCRIBE = re.compile(r"\s*(?:DESCRIBE|DESC|SHOW\s+(?:FULL\s+)?(?:COLUMNS|FIELDS)\s+(?:FROM|IN))\s+"
                       r"(`[^`]+`|[^\s;]+)\s*;?\s*", re.I)
_MYSQL_TYPES = {"INTEGER": "bigint(20)", "REAL": "double", "TEXT": "text"}  # as MariaDB shows our columns


STRICT_DATABASE = "db"  # the database name MySQL's "Table 'db.x' doesn't exist" names


class SQLiteDB:
    kind = "sqlite"

    def __init__(self, tables: Sequence[Table], limits: Limits, image: bytes | None = None,
                 mysql_strict: bool = False) -> None:
        """A fresh database with ``tables``; from ``image`` (``self.image()`` of a database made from the
        same tables) it is a copy of those pages, ~8x cheaper than inserting the rows again (0.09
        against 0.7 ms for a generated task), and the first cost of a db episode at thousands of
        sessions (docs/benchmarks/env_host.md). ``mysql_strict``: the agent's statements are refused where
        MySQL refuses them (``strict.py``)."""
        self.limits = limits
        self.mysql_strict = mysql_strict
        self.tables = list(tables)
        self.conn = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        self.conn.setlimit(sqlite3.SQLITE_LIMIT_ATTACHED, 0)
        self.conn.setlimit(sqlite3.SQLITE_LIMIT_LENGTH, limits.max_value_bytes)
        for fname, (arity, fn) in _MYSQL_FUNCTIONS.items():
            self.conn.create_function(fname, arity, fn, deterministic=True)
        dialect.install(self.conn)  # MySQL's case- and accent-insensitive text comparison and LIKE
        if image is not None and hasattr(self.conn, "deserialize"):  # Python >= 3.11
            self.conn.deserialize(image)
        else:
            for t in self.tables:
                cols = ", ".join(f"{quote(c)} {ty}" + (f" COLLATE {dialect.COLLATION}" if ty == "TEXT" else "")
                                 for c, ty in t.columns)
                self.conn.execute(f"CREATE TABLE {quote(t.name)} ({cols})")
                marks = ", ".join("?" * len(t.columns))
                self.conn.executemany(f"INSERT INTO {quote(t.name)} VALUES ({marks})", t.rows)
        self.conn.execute(f"PRAGMA max_page_count = {limits.max_db_pages}")  # after deserialize: it resets it
        self.conn.set_authorizer(self._authorize)
        self._deadline = float("inf")
        self.conn.set_progress_handler(self._progress, 10_000)

    def _authorize(self, action: int, arg1: Any, arg2: Any, db: Any, trigger: Any) -> int:
        if action in _SQLITE_DENY:
            return sqlite3.SQLITE_DENY
        if action == sqlite3.SQLITE_PRAGMA and (arg1 or "").lower() not in _SQLITE_READ_PRAGMAS:
            return sqlite3.SQLITE_DENY
        if action == sqlite3.SQLITE_FUNCTION and (arg2 or "").lower() in ("fts3_tokenizer", "load_extension"):
            return sqlite3.SQLITE_DENY  # fts3_tokenizer hands out (and with two arguments takes) raw pointers
        return sqlite3.SQLITE_OK

    def _progress(self) -> int:
        return 1 if time.monotonic() > self._deadline else 0  # non-zero interrupts the statement

    def _mysql_meta(self, sql: str) -> list[tuple[Any, ...]] | None:
        """SHOW TABLES and DESCRIBE as MySQL answers them (the agent is told it talks to MySQL)."""
        if _SHOW_TABLES.fullmatch(sql):
            return [(t.name,) for t in sorted(self.tables, key=lambda t: t.name)]
        m = _DESCRIBE.fullmatch(sql)
        if m:
            name = m.group(1).strip("`")
            table = next((t for t in self.tables if t.name.lower() == name.lower()), None)
            if table is not None:
                return [(c, _MYSQL_TYPES.get(ty, ty.lower()), "YES", "", None, "") for c, ty in table.columns]
        return None

    def execute(self, sql: str) -> Result:
        start = time.monotonic()
        meta = self._mysql_meta(sql)
        if meta is not None:
            rows, text, truncated = format_rows(meta, self.limits)
            return Result(rows=rows, text=text, truncated=truncated, elapsed_s=time.monotonic() - start)
        self._deadline = start + self.limits.timeout_s
        cur = self.conn.cursor()
        try:
            try:
                if self.mysql_strict:
                    strict.check(sql, list(dialect.tokens(sql)), [t.name for t in self.tables],
                                 [c for t in self.tables for c, _ in t.columns], STRICT_DATABASE)
                translated = dialect.translate(sql)
            except dialect.DialectError as exc:
                return Result(rows=None, text=f"Error: {exc}", error=str(exc), elapsed_s=time.monotonic() - start)
            cur.execute(translated)
            if cur.description is None:
                return Result(rows=None, text="[]", elapsed_s=time.monotonic() - start)
            rows, text, truncated = format_rows(cur, self.limits)
            return Result(rows=rows, text=text, truncated=truncated, elapsed_s=time.monotonic() - start)
        except (sqlite3.Error, OverflowError, ValueError) as exc:
            msg = str(exc)
            if msg == "interrupted":
                msg = f"the statement ran longer than {self.limits.timeout_s:g}s and was stopped"
            elif "not authorized" in msg or "authorization denied" in msg:
                msg = "not authorized: this database allows only SELECT, INSERT, UPDATE, DELETE and temporary tables"
            elif "too big" in msg:
                msg = f"{msg} (values are limited to {self.limits.max_value_bytes} bytes)"
            if self.conn.in_transaction and msg.startswith("the statement ran longer"):
                self.conn.rollback()
            return Result(rows=None, text=f"Error: {msg}", error=msg, elapsed_s=time.monotonic() - start)
        finally:
            self._deadline = float("inf")
            cur.close()

    def table_hash(self, max_len: int | None) -> str:
        hashes = []
        for t in self.tables:
            cols = ", ".join(quote(c) for c in t.column_names)
            try:
                rows = self.conn.execute(f"SELECT {cols} FROM main.{quote(t.name)}").fetchall()
            except sqlite3.Error as exc:
                hashes.append(f"error:{exc}")
                continue
            hashes.append(rows_hash(rows, max_len))
        return combine_hashes(hashes)

    def gold(self, ref_sql: str, modifies: bool, max_len: int | None) -> tuple[list[tuple[Any, ...]] | None, str | None]:
        """Run the reference SQL and undo it: (result rows, None) or (None, table hash after it)."""
        self.conn.execute("BEGIN")
        try:
            cur = self.conn.execute(dialect.translate(ref_sql))
            rows = cur.fetchall() if cur.description is not None else None
            return (None, self.table_hash(max_len)) if modifies else (rows, None)
        finally:
            self.conn.execute("ROLLBACK")

    def image(self) -> bytes | None:
        """The database's pages, for ``SQLiteDB(tables, limits, image)``; None where this Python cannot."""
        if not hasattr(self.conn, "serialize"):
            return None
        self.conn.set_authorizer(None)  # serialize reads the page count with a pragma the agent may not run
        try:
            return self.conn.serialize()
        finally:
            self.conn.set_authorizer(self._authorize)

    def close(self) -> None:
        self.conn.close()
