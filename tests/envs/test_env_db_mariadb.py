"""DB env on a real MariaDB server (127.0.0.1:3306 here; JETRL_TEST_DB_SERVER to point elsewhere):
AgentBench fidelity, per-episode confinement and limits, cleanup, and the env served over NATS."""

from __future__ import annotations

import json
import os
import time
import uuid
from pathlib import Path

import pytest

from services.envs.base import ToolCall
from services.envs.db import make_env
from services.envs.db.backends import Limits
from services.envs.db.config import DBTaskConfig
from services.envs.db.mariadb_db import MariaDBServer
from services.envs.db.sqlite_db import SQLiteDB
from services.envs.db.tasks import Table
from services.envs.host import EnvHost
from shared.config import EnvConfig
from shared.envapi import EnvClient
from tests.envs.test_env_db import need_sources

SERVER = os.environ.get("JETRL_TEST_DB_SERVER", "mysql://root@127.0.0.1:3306")


def sql(query: str) -> ToolCall:
    return ToolCall("execute_sql", {"query": query})


def commit(*answers: str) -> ToolCall:
    return ToolCall("commit_final_answer", {"answers": list(answers)})


@pytest.fixture(scope="module")
def server() -> MariaDBServer:
    try:
        srv = MariaDBServer(SERVER, Limits(timeout_s=1.0, max_chars=800))
    except ImportError:
        pytest.skip("pymysql is not installed (pip install -e '.[db]')")
    except Exception as exc:
        pytest.skip(f"no MariaDB/MySQL server at {SERVER}: {exc}")
    yield srv
    srv.close()


def gone(server: MariaDBServer, name: str, wait_s: float = 10.0) -> bool:
    """True once the episode's database and user no longer exist (drops run in the background)."""
    conn = server.connect(server.info.user, server.info.password)
    try:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            with conn.cursor() as cur:
                cur.execute("SELECT COUNT(*) FROM information_schema.SCHEMATA WHERE SCHEMA_NAME = %s", (name,))
                dbs = cur.fetchone()[0]
                cur.execute("SELECT COUNT(*) FROM mysql.user WHERE User = %s", (name,))
                users = cur.fetchone()[0]
            if dbs == users == 0:
                return True
            time.sleep(0.05)
        return False
    finally:
        conn.close()


def test_agentbench_dev_gold_and_perturbed_on_mariadb(server, agentbench: Path) -> None:
    env = make_env(EnvConfig(sections={"db": DBTaskConfig(server=SERVER, agentbench_file=str(agentbench / "dbbench" / "dev.jsonl"))}))
    try:
        ids = env.task_ids("dev")
        assert len(ids) == 60
        gold_ok, wrong_ok, failures = 0, 0, []
        for tid in ids:
            task = env.task(tid, "dev")
            ep = env.open(tid, "dev", 0)
            if task.modifies:  # AgentBench's gold SQL, graded by the md5 of the table on the server
                ep.call(sql(task.ref_sql))
            ok = ep.call(commit(*(task.label or ["done"]))).reward == 1.0
            gold_ok += ok
            if not ok:
                failures.append(tid)
            ep.close()
            ep = env.open(tid, "dev", 0)
            if task.modifies:
                ep.call(sql(task.ref_sql))
                t = task.tables[0]
                ep.call(sql(f"INSERT INTO `{t.name}` (`{t.column_names[0]}`) VALUES ('perturbed')"))
                wrong_ok += ep.call(commit("done")).reward == 0.0
            else:
                wrong_ok += ep.call(commit(*[f"{a} perturbed" for a in task.label])).reward == 0.0
            ep.close()
        assert gold_ok >= 58, failures
        assert wrong_ok == 60
    finally:
        env.close()


def test_generated_tasks_grade_alike_on_both_backends(server) -> None:
    need_sources()
    env = make_env(EnvConfig(num_train_tasks=60, num_test_tasks=12, sections={"db": DBTaskConfig(server=SERVER)}))
    lite = make_env(EnvConfig(num_train_tasks=60, num_test_tasks=12))
    try:
        for split in ("train", "test"):
            for tid in env.task_ids(split)[::3]:
                ep, ref = env.open(tid, split, 0), lite.open(tid, split, 0)
                for _ in range(3):
                    r = ep.call(env.oracle(ep))
                    if r.finish:
                        break
                assert r.finish and r.reward == 1.0, (tid, ep.task.ref_sql)
                if ep.task.modifies:  # same rows -> same md5 whether MariaDB or Python computes it
                    assert ep.gold == ref.gold, (tid, ep.task.ref_sql)
                ep.close()
                ref.close()
    finally:
        env.close()
        lite.close()


def test_episodes_are_confined_and_bounded(server) -> None:
    big = Table("big", [("n", "INTEGER"), ("pad", "TEXT")], [[i, "x" * 50] for i in range(3000)])
    a, b = server.create([big]), server.create([big])
    try:
        for stmt in (f"DROP DATABASE `{b.name}`", f"DROP TABLE `{b.name}`.big", f"DELETE FROM `{b.name}`.big",
                     f"SELECT * FROM `{b.name}`.big", f"DROP DATABASE `{a.name}`", "DROP TABLE big",
                     "CREATE USER intruder IDENTIFIED BY 'x'", "SELECT * FROM mysql.user",
                     "SET GLOBAL max_connections = 1", "SELECT 'x' INTO OUTFILE '/tmp/db-env-test.txt'"):
            r = a.execute(stmt)
            assert r.error and ("denied" in r.error or "Access" in r.error), (stmt, r.text)
        assert [x[0] for x in a.execute("SHOW DATABASES").rows] == ["information_schema", a.name]
        for stmt in ("SELECT SLEEP(100)", "SET STATEMENT max_statement_time = 0 FOR SELECT SLEEP(100)",
                     "SELECT COUNT(*) FROM big x, big y, big z"):
            t0 = time.monotonic()
            r = a.execute(stmt)
            assert r.error and "longer than 1s" in r.text and time.monotonic() - t0 < 3.0, (stmt, r.text)
        a.execute("SET SESSION max_statement_time = 0")  # reset before the next statement anyway
        t0 = time.monotonic()
        assert "longer than 1s" in a.execute("SELECT SLEEP(100)").text and time.monotonic() - t0 < 3.0
        t0 = time.monotonic()  # ~450 GB if read in full; 100 MB through one huge column
        for stmt in ("SELECT x.pad, y.pad, z.pad FROM big x, big y, big z",
                     "SELECT REPEAT('x', 1000000) FROM big x, big y LIMIT 100"):
            r = a.execute(stmt)
            assert r.truncated and len(r.text) <= 800 and "TRUNCATED" in r.text
        assert time.monotonic() - t0 < 3.0
        assert a.execute("SELECT COUNT(*) FROM big").rows == [(3000,)]  # the session still works
        assert b.execute("SELECT COUNT(*) FROM big").rows == [(3000,)]  # and the other is untouched
        assert a.execute("SELECT @@sql_mode").rows == [("",)]  # non-strict, as AgentBench's MySQL
        assert a.execute("INSERT INTO big (n) VALUES ('not a number')").error is None
    finally:
        a.close()
        b.close()
    assert gone(server, a.name) and gone(server, b.name)


def test_python_hash_matches_server_hash(server) -> None:
    rows = [[f"r{i}", i, i / 4 if i % 3 else None, "é ü 中"] for i in range(300)]
    table = Table("mixed types", [("k", "TEXT"), ("n", "INTEGER"), ("x", "REAL"), ("u", "TEXT")], rows)
    db, lite = server.create([table]), SQLiteDB([table], Limits())
    try:
        for max_len in (1024, None):
            assert db.table_hash(max_len) == lite.table_hash(max_len)
        db.execute("DELETE FROM `mixed types`")
        lite.execute("DELETE FROM `mixed types`")
        assert db.table_hash(1024) == lite.table_hash(1024) == "None"
    finally:
        db.close()
        lite.close()


def test_mysql_idioms_read_the_same_on_both_backends(server) -> None:
    tables = [Table("Race Results", [("Round", "INTEGER"), ("Driver", "TEXT"), ("Pts", "REAL")],
                    [[1, "Ann", 1.5], [2, "Bo", None]]),
              Table("alpha", [("x", "TEXT")], [["2007-03-04"]])]
    db, lite = server.create(tables), SQLiteDB(tables, Limits())
    try:
        for stmt in ("SHOW TABLES", "DESCRIBE `Race Results`", "desc alpha;", "SHOW COLUMNS FROM `Race Results`",
                     "SELECT IF(Round > 1, 'late', 'early') FROM `Race Results` ORDER BY Round",
                     "SELECT YEAR(x), MONTH(x), DAY(x) FROM alpha",
                     "SELECT CONCAT(Driver, '-', Round), CONCAT_WS(',', Driver, Pts) FROM `Race Results` ORDER BY 1"):
            assert db.execute(stmt).text == lite.execute(stmt).text, stmt
    finally:
        db.close()
        lite.close()


def test_reap_drops_what_a_dead_replica_left(server) -> None:
    name = f"jdb_{int(time.time()) - 7200}_{uuid.uuid4().hex[:10]}"
    server.admin([f"CREATE DATABASE `{name}`", f"CREATE USER '{name}'@'%' IDENTIFIED BY 'pw-left-behind'"])
    assert server.reap(older_than_s=3600) >= 1
    assert gone(server, name, wait_s=0.5)


async def test_served_over_nats_on_mariadb(server, config, subjects, nc) -> None:
    need_sources()
    config.env.db.server, config.env.num_train_tasks, config.env.num_test_tasks = SERVER, 12, 3
    config.env.db.query_timeout_s, config.env.action_timeout_s = 1.0, 5.0
    env = make_env(config.env)
    host = EnvHost(env, config.env, subjects, "db-m1")
    service = await host.serve(nc, nc.jetstream())
    client = EnvClient(nc, subjects, "db", timeout_s=20)
    names = []
    try:
        for tid in env.task_ids("train")[:6]:
            sid = uuid.uuid4().hex
            started = await client.start(sid, tid, "train")
            names.append(host.sessions[sid].episode.db.name)
            for _ in range(started.max_turns):
                step = await client.interact(started.replica_id, sid, await client.oracle(started.replica_id, sid))
                if step.finish:
                    break
            assert step.finish and step.reward == 1.0
        sid = uuid.uuid4().hex
        started = await client.start(sid, env.task_ids("train")[0], "train")
        names.append(host.sessions[sid].episode.db.name)
        message = {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "execute_sql", "arguments": json.dumps({"query": "SELECT SLEEP(100)"})}}]}
        t0 = time.monotonic()
        step = await client.interact(started.replica_id, sid, message)
        assert not step.finish and "longer than 1s" in step.messages[0]["content"] and time.monotonic() - t0 < 4
        await client.cancel(started.replica_id, sid)  # cancel drops the episode's database and user
        assert (await client.health()).sessions == 0
    finally:
        await host.shutdown()
        await service.stop()
    assert all(gone(server, n) for n in names)


def test_mysql_dialect_probes_give_mariadbs_rows_on_sqlite(server) -> None:
    """The SQLite probes of test_env_db.py (escapes, collation, digit-leading names, string/number
    comparison) return on MariaDB the rows the SQLite test expects: the expectations are MySQL's."""
    from tests.envs.test_env_db import DIALECT_PROBES, DIALECT_TABLE

    db, lite = server.create([DIALECT_TABLE]), SQLiteDB([DIALECT_TABLE], Limits())
    try:
        for stmt, expected in DIALECT_PROBES:
            assert db.execute(stmt).rows == expected, stmt
            assert lite.execute(stmt).text == db.execute(stmt).text, stmt
    finally:
        db.close()
        lite.close()


def test_strict_mysql_refuses_what_mariadb_refuses(server) -> None:
    """The statements env.db.mysql_strict refuses on SQLite are refused by MariaDB, the accepted ones give its rows."""
    from tests.envs.test_env_db import STRICT_ACCEPTED, STRICT_REFUSED, STRICT_TABLE

    db = server.create([STRICT_TABLE])
    try:
        for stmt, _ in STRICT_REFUSED:
            assert db.execute(stmt).error is not None, stmt
        for stmt, rows in STRICT_ACCEPTED:
            assert db.execute(stmt).rows == rows, stmt
    finally:
        db.close()


def test_agentbench_dev_statements_agree_on_both_backends(server, agentbench: Path) -> None:
    """Every SQL statement of AgentBench's dev file (its sql.query, the gold SQL of INSERT/UPDATE tasks)
    gives the same result text, or the same table hash, on SQLite as on MariaDB."""
    from services.envs.db.tasks import load_agentbench

    same, differ = 0, []
    for task in load_agentbench(agentbench / "dbbench" / "dev.jsonl"):
        db, lite = server.create(task.tables), SQLiteDB(task.tables, Limits())
        try:
            a, b = db.execute(task.ref_sql), lite.execute(task.ref_sql)
            if task.modifies:
                ok = a.error is None and b.error is None and db.table_hash(1024) == lite.table_hash(1024)
            else:
                ok = (a.error is None) == (b.error is None) and (a.error is not None or a.text == b.text)
            same += ok
            if not ok:
                differ.append((task.task_id, task.ref_sql, a.text[:120], b.text[:120]))
        finally:
            db.close()
            lite.close()
    assert same == 60, differ  # see docs/benchmarks/db.md
