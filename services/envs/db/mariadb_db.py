"""The MariaDB/MySQL backend: a database and a user per episode on a shared server (backends.py says how)."""

from __future__ import annotations

import concurrent.futures
import queue
import re
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import unquote, urlparse

import structlog

from services.envs.db.backends import Limits, Result, format_rows, quote
from services.envs.db.grading import GROUP_CONCAT_MAX_LEN, combine_hashes
from services.envs.db.tasks import Table

log = structlog.get_logger()


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
