"""Two database backends behind one small interface: embedded SQLite (default) and a MariaDB/MySQL server.

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

import concurrent.futures
import queue
import re
import secrets
import sqlite3
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlparse

import structlog

from services.envs.db import dialect, strict
from services.envs.db.grading import GROUP_CONCAT_MAX_LEN, combine_hashes, rows_hash
from services.envs.db.tasks import Table

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


# --------------------------------------------------------------------------------------- SQLite
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


# -------------------------------------------------------------------------------------- MariaDB
@dataclass
class ServerInfo:
    host: str
    port: int
    user: str
    password: str

    @classmethod
    def parse(cls, url: str) -> ServerInfo:
        u = urlparse(url if "://" in url else f"mysql://{url}")
        return cls(host=u.hostname or "127.0.0.1", port=u.port or 3306, user=unquote(u.username or "root"),
                   password=unquote(u.password or ""))


class MariaDBServer:
    """Replica-wide: a pool of admin connections that create and drop the per-episode databases."""

    prefix = "jdb_"

    def __init__(self, url: str, limits: Limits, pool_size: int = 8) -> None:
        import pymysql  # imported here: SQLite-only replicas need no driver

        self.pymysql = pymysql
        self.info = ServerInfo.parse(url)
        # a local server needs no TLS, and building pymysql's default TLS context costs ~40 ms per connection
        self.local = self.info.host in ("127.0.0.1", "localhost", "::1")
        self.limits = limits
        self._pool: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pool_size = pool_size
        self._workers = concurrent.futures.ThreadPoolExecutor(pool_size, thread_name_prefix="db-admin")
        self._open: set[str] = set()
        self._lock = threading.Lock()
        # DROP DATABASE takes 50-100 ms (file removal): done by a background thread, off the episode's path
        self._drops: queue.Queue[str | None] = queue.Queue()
        self._dropper = threading.Thread(target=self._drop_loop, name="db-dropper", daemon=True)
        self._dropper.start()
        # one watchdog for all episodes: kills a statement still running past its deadline
        self._deadlines: dict[int, float] = {}
        self._killed: set[int] = set()
        self._closing = threading.Event()
        threading.Thread(target=self._watch_loop, name="db-watchdog", daemon=True).start()
        conn = self._admin()
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT VERSION()")
                self.version = cur.fetchone()[0]
        finally:
            self._release(conn)

    def connect(self, user: str, password: str, database: str | None = None, **kw: Any) -> Any:
        return self.pymysql.connect(host=self.info.host, port=self.info.port, user=user, password=password,
                                    database=database, charset="utf8mb4", autocommit=True, connect_timeout=5,
                                    ssl_disabled=self.local, **kw)

    def _admin(self) -> Any:
        while True:
            try:
                conn = self._pool.get_nowait()
            except queue.Empty:
                return self.connect(self.info.user, self.info.password)
            try:
                conn.ping(False)
                return conn
            except self.pymysql.MySQLError:
                conn.close()

    def _release(self, conn: Any) -> None:
        if self._pool.qsize() < self._pool_size:
            self._pool.put(conn)
        else:
            conn.close()

    def admin(self, statements: Sequence[str | tuple[str, Sequence[Any]]]) -> None:
        conn = self._admin()
        try:
            with conn.cursor() as cur:
                for st in statements:
                    if isinstance(st, tuple):
                        cur.execute(st[0], st[1])
                    else:
                        cur.execute(st)
        except Exception:
            conn.close()
            raise
        self._release(conn)

    def kill_query(self, thread_id: int) -> None:
        try:
            self.admin([f"KILL QUERY {int(thread_id)}"])
        except Exception as exc:  # the statement may have ended meanwhile
            log.warning("db_kill_failed", thread_id=thread_id, error=str(exc))

    def create(self, tables: Sequence[Table]) -> MariaDB:
        name = f"{self.prefix}{int(time.time())}_{secrets.token_hex(5)}"
        password = secrets.token_urlsafe(18)
        t = self.limits.timeout_s
        user: list[str | tuple[str, Sequence[Any]]] = [
            (f"CREATE USER '{name}'@'%%' IDENTIFIED BY %s WITH MAX_USER_CONNECTIONS 2 MAX_STATEMENT_TIME {t:g}",
             (password,)),
            f"GRANT SELECT, INSERT, UPDATE, DELETE, CREATE TEMPORARY TABLES ON {quote(name)}.* TO '{name}'@'%'",
        ]
        with self._lock:
            self._open.add(name)
        try:
            # CREATE TABLE mostly waits on the disk (~40 ms each here): the user and each table get their own
            # admin connection and run at once, which cuts a 4-table reset by ~3x
            self.admin([f"CREATE DATABASE {quote(name)} CHARACTER SET utf8mb4 COLLATE utf8mb4_general_ci"])
            jobs = [user] + [load_statements([t], name) for t in tables]
            for future in [self._workers.submit(self.admin, job) for job in jobs]:
                future.result()
            return MariaDB(self, name, password, tables)
        except Exception:
            self.drop(name)
            raise

    def watch(self, thread_id: int, deadline: float) -> None:
        self._deadlines[thread_id] = deadline

    def unwatch(self, thread_id: int) -> bool:
        """Stop watching; True if the watchdog killed this connection's statement."""
        self._deadlines.pop(thread_id, None)
        with self._lock:
            killed = thread_id in self._killed
            self._killed.discard(thread_id)
        return killed

    def _watch_loop(self) -> None:
        while not self._closing.wait(0.1):
            now = time.monotonic()
            for thread_id, deadline in list(self._deadlines.items()):
                if now > deadline and self._deadlines.pop(thread_id, None) is not None:
                    with self._lock:
                        self._killed.add(thread_id)
                    self.kill_query(thread_id)

    def drop_later(self, name: str) -> None:
        self._drops.put(name)

    def _drop_loop(self) -> None:
        while (name := self._drops.get()) is not None:
            self.drop(name)
            self._drops.task_done()
        self._drops.task_done()

    def drop(self, name: str) -> None:
        with self._lock:
            self._open.discard(name)
        try:
            self.admin([f"DROP USER IF EXISTS '{name}'@'%'", f"DROP DATABASE IF EXISTS {quote(name)}"])
        except Exception as exc:
            log.warning("db_drop_failed", database=name, error=str(exc))

    def reap(self, older_than_s: float) -> int:
        """Drop episode databases and users left by dead replicas (their name starts with the creation time)."""
        conn = self._admin()
        try:
            with conn.cursor() as cur:
                cur.execute("SELECT SCHEMA_NAME FROM information_schema.SCHEMATA WHERE SCHEMA_NAME LIKE 'jdb\\_%%'")
                names = [r[0] for r in cur.fetchall()]
                cur.execute("SELECT User FROM mysql.user WHERE User LIKE 'jdb\\_%%'")
                names += [r[0] for r in cur.fetchall()]
        finally:
            self._release(conn)
        cutoff, dropped = time.time() - older_than_s, set()
        for name in set(names):
            m = re.fullmatch(r"jdb_(\d+)_[0-9a-f]+", name)
            if m and int(m.group(1)) < cutoff and name not in self._open:
                self.drop(name)
                dropped.add(name)
        return len(dropped)

    def close(self) -> None:
        self._closing.set()
        self._drops.put(None)
        self._dropper.join(timeout=60)
        for name in list(self._open):
            self.drop(name)
        self._workers.shutdown(wait=True)
        while True:
            try:
                self._pool.get_nowait().close()
            except queue.Empty:
                break


def load_statements(tables: Sequence[Table], database: str, batch: int = 500) -> list[str | tuple[str, Sequence[Any]]]:
    """CREATE TABLE + multi-row INSERTs, with the server quoting the values."""
    creates: list[str | tuple[str, Sequence[Any]]] = []
    inserts: list[str | tuple[str, Sequence[Any]]] = []
    types = {"INTEGER": "BIGINT", "REAL": "DOUBLE", "TEXT": "TEXT"}
    for t in tables:
        qname = f"{quote(database)}.{quote(t.name)}"
        cols = ", ".join(f"{quote(c)} {types.get(ty, ty)}" for c, ty in t.columns)
        creates.append(f"CREATE TABLE {qname} ({cols}) ENGINE=InnoDB DEFAULT CHARSET=utf8mb4")
        row_marks = "(" + ", ".join(["%s"] * len(t.columns)) + ")"
        for i in range(0, len(t.rows), batch):
            chunk = t.rows[i: i + batch]
            args = [v for row in chunk for v in row]
            inserts.append((f"INSERT INTO {qname} VALUES " + ", ".join([row_marks] * len(chunk)), args))
    # DDL commits implicitly, so tables first, then every row in one transaction (one log flush, not one per table)
    return creates + ["START TRANSACTION"] + inserts + ["COMMIT"]


class MariaDB:
    kind = "mariadb"

    def __init__(self, server: MariaDBServer, name: str, password: str, tables: Sequence[Table]) -> None:
        self.server, self.name, self.tables, self.limits = server, name, list(tables), server.limits
        self._password = password
        self._session_setup = (f"SET SESSION sql_mode = '', max_statement_time = {self.limits.timeout_s:g}, "
                               f"group_concat_max_len = {GROUP_CONCAT_MAX_LEN}, sql_select_limit = DEFAULT")
        self._connect()

    def _connect(self) -> None:
        self.conn = self.server.connect(self.name, self._password, self.name,
                                        cursorclass=self.server.pymysql.cursors.SSCursor)
        self.thread_id = self.conn.thread_id()
        with self.conn.cursor() as cur:
            cur.execute(self._session_setup)
        self._dirty = False

    def execute(self, sql: str) -> Result:
        pymysql = self.server.pymysql
        start = time.monotonic()
        cur = self.conn.cursor()
        try:
            if self._dirty:  # only SET can change session variables (no routines: no privilege to create them)
                cur.execute(self._session_setup)
            self._dirty = "set" in sql.lower()
            self.server.watch(self.thread_id, start + self.limits.timeout_s + 1.0)
            cur.execute(sql)
            if cur.description is None:
                return Result(rows=None, text="[]", elapsed_s=time.monotonic() - start)
            rows, text, truncated = format_rows(iter(cur.fetchone, None), self.limits)
            if truncated:  # stop the server sending the rest, then drain what is in flight
                self.server.kill_query(self.thread_id)
            return Result(rows=rows, text=text, truncated=truncated, elapsed_s=time.monotonic() - start)
        except pymysql.MySQLError as exc:
            code, msg = (exc.args + ("",))[:2] if exc.args else (0, str(exc))
            if self.server.unwatch(self.thread_id) or code in (1969, 3024):  # 1969: max_statement_time exceeded
                msg = f"the statement ran longer than {self.limits.timeout_s:g}s and was stopped"
            return Result(rows=None, text=f"Error {code}: {msg}", error=f"{code}: {msg}",
                          elapsed_s=time.monotonic() - start)
        finally:
            self.server.unwatch(self.thread_id)
            try:
                cur.close()
            except pymysql.MySQLError:
                pass  # the killed rest of a cut result
            if not self.conn.open:  # the server dropped the connection: the data is safe, temp tables are lost
                log.warning("db_reconnect", database=self.name)
                self._connect()

    def table_hash(self, max_len: int | None) -> str:
        hashes = []
        with self.conn.cursor() as cur:
            cur.execute(f"SET SESSION group_concat_max_len = {max_len or 1 << 30}, sql_select_limit = DEFAULT")
            for t in self.tables:
                cols = ", ".join(quote(c) for c in t.column_names)
                try:
                    cur.execute("SELECT md5(group_concat(h ORDER BY h)) FROM (SELECT substring(md5(concat_ws(',', "
                                f"{cols})), 1, 5) AS h FROM {quote(self.name)}.{quote(t.name)}) AS sub")
                    value = cur.fetchall()[0][0]
                    hashes.append("None" if value is None else str(value))
                except self.server.pymysql.MySQLError as exc:
                    hashes.append(f"error:{exc}")
            cur.execute(f"SET SESSION group_concat_max_len = {GROUP_CONCAT_MAX_LEN}")
        return combine_hashes(hashes)

    def gold(self, ref_sql: str, modifies: bool, max_len: int | None) -> tuple[list[tuple[Any, ...]] | None, str | None]:
        with self.conn.cursor() as cur:
            cur.execute(self._session_setup)
            cur.execute("START TRANSACTION")
            try:
                cur.execute(ref_sql)
                rows = [tuple(r) for r in cur.fetchall()] if cur.description is not None else None
                after = self.table_hash(max_len) if modifies else None
            finally:
                cur.execute("ROLLBACK")
        return (None, after) if modifies else (rows, None)

    def close(self) -> None:
        try:
            self.conn.close()
        except Exception:
            pass
        self.server.drop_later(self.name)

