"""MCP tool servers through the mcp_tools adapter, against a real MCP server written with PyPI ``mcp``
(tests/servers/sql_tools.py) over stdio and streamable HTTP: the server's tools as it lists them, a
session of its own per episode, every grader, a server that dies mid-episode (env_error, no hang), and
cancel and idle timeouts that close the server's session; and a pool of sessions shared by episodes in
parallel, one of whose servers is killed mid-episode."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("mcp", reason="the mcp extra: pip install 'jetrl[mcp]' (make venv installs it)")

from services.envs.base import ToolCall  # noqa: E402
from services.envs.host import EnvHost  # noqa: E402
from services.envs.mcp_tools import McpToolsConfig, McpToolsEnv  # noqa: E402
from services.envs.mcp_tools.session import ServerGone  # noqa: E402
from shared.config import EnvConfig  # noqa: E402
from shared.envapi import EnvClient  # noqa: E402
from tests.procs import env_check, stop_processes  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
SERVER = [sys.executable, "-m", "tests.servers.sql_tools"]
SALES = [{"tool": "execute_sql", "arguments": {"query": "CREATE TABLE sales (item TEXT, amount INTEGER)"}},
         {"tool": "execute_sql", "arguments": {"query": "INSERT INTO sales VALUES ('a', 3), ('b', 4), ('c', 5)"}}]
TASKS = [
    {"id": "total", "prompt": "What is the total amount of the sales table?", "setup": SALES,
     "grader": "tool:check_total", "verifier_arguments": {"table": "sales"}, "level": 2, "kind": "sum"},
    {"id": "count", "prompt": "How many rows has the sales table?", "setup": SALES, "answer": "3"},
    {"id": "mean", "prompt": "Mean amount?", "setup": SALES, "answer": 4, "grader": "numeric"},
    {"id": "item", "prompt": "Name the item with amount 4.", "setup": SALES, "answer": "(?i)b|item b",
     "grader": "regex"},
    {"id": "checked", "prompt": "How many rows has the sales table?", "setup": SALES, "answer": "3",
     "grader": "tests.servers.graders:used_sql_and_right"},
    {"id": "held-out", "prompt": "How many tables are there?", "answer": "0", "split": "test"},
]

STATELESS_TASKS = [{"id": f"add-{n}", "prompt": f"What is {n} + 1?", "answer": str(n + 1)} for n in range(8)]


def call(name: str, **arguments: Any) -> ToolCall:
    return ToolCall(name, arguments)


@pytest.fixture
def tasks_file(tmp_path: Path) -> str:
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in TASKS))
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def stateless_tasks_file(tmp_path: Path) -> str:
    """Tasks without setup: what a pool of shared sessions serves."""
    path = tmp_path / "stateless.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in STATELESS_TASKS))
    return str(path)


@pytest.fixture
def http_server() -> Any:
    """The SQL tool server over streamable HTTP, as its own process; yields (url, process)."""
    yield from serve_http("http")


@pytest.fixture
def stateless_http_server() -> Any:
    """The SQL tool server over stateless streamable HTTP (it assigns no Mcp-Session-Id)."""
    yield from serve_http("http-stateless")


def serve_http(mode: str) -> Any:
    port = free_port()
    proc = subprocess.Popen([*SERVER, mode, str(port)], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
            break
        except OSError:
            time.sleep(0.2)
    yield f"http://127.0.0.1:{port}/mcp", proc
    stop_processes([proc], timeout_s=5)


def server_children() -> list[int]:
    """Pids of the stdio servers this test process started (and that still run)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and b"tests.servers.sql_tools" in cmdline and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def test_stdio_tools_as_listed_a_verifier_tool_grades(tasks_file: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("JETRL_TEST_SECRET", "not for the server")
    env = McpToolsEnv(McpToolsConfig(server_command=SERVER, tasks_file=tasks_file, server_env={"SQL_MODE": "strict"}),
                      name="sql")
    try:
        assert env.task_ids("train") == ["total", "count", "mean", "item", "checked"]
        assert env.task_ids("test") == ["held-out"] and env.task_level("total", "train").kind == "sum"
        ep = env.open("total", "train", 0)
        names = [t["function"]["name"] for t in ep.tools]
        assert names == ["execute_sql", "list_tables", "getenv", "wait", "crash", "submit_answer"]  # the verifier is hidden
        sql = ep.tools[0]["function"]
        assert sql["description"] == "Run one SQL statement on this session's database and return its rows."
        assert sql["parameters"]["properties"]["query"]["type"] == "string" and sql["parameters"]["required"] == ["query"]
        assert ep.call(call("list_tables")).content == "sales"  # the task's setup ran on this session
        assert ep.call(ToolCall("getenv", {"name": "SQL_MODE"})).content == "strict"
        assert ep.call(ToolCall("getenv", {"name": "JETRL_TEST_SECRET"})).content == ""  # the replica's own stay with it
        bad = ep.call(call("execute_sql", query="SELEC 1"))
        assert not bad.finish and bad.content.startswith("Error") and "syntax error" in bad.content
        assert ep.call(call("execute_sql", query="SELECT SUM(amount) FROM sales")).content == "[(12,)]"
        right = ep.call(call("submit_answer", answer="12"))
        assert (right.finish, right.reward, right.status) == (True, 1.0, "completed")
        ep.close()
        with pytest.raises(KeyError):
            env.open("held-out", "train", 0)
        held_out = env.open("held-out", "test", 0)  # a task with an answer: the oracle submits it
        assert held_out.call(env.oracle(held_out)).reward == 1.0
        held_out.close()
    finally:
        env.close()
    assert server_children() == []  # every episode's server process was stopped


def test_http_one_session_per_episode_and_every_grader(tasks_file: str, http_server: Any) -> None:
    url, _ = http_server
    env = McpToolsEnv(McpToolsConfig(url=url, tasks_file=tasks_file), name="sql")
    try:
        a, b = env.open("count", "train", 0), env.open("held-out", "test", 0)
        a.call(call("execute_sql", query="CREATE TABLE only_in_a (x)"))
        assert a.call(call("list_tables")).content == "only_in_a\nsales"
        assert b.call(call("list_tables")).content == '{"result": []}'  # b's session has its own database
        assert b.call(call("submit_answer", answer="0")).reward == 1.0
        a.close()
        b.close()
        answers = {"count": (" 3 ", 1.0), "mean": ("4.0000000001", 1.0), "item": ("Item B", 1.0), "checked": ("3", 0.5)}
        for task_id, (answer, reward) in answers.items():
            ep = env.open(task_id, "train", 0)
            assert ep.call(call("submit_answer", answer=answer)).reward == reward, task_id
            ep.close()
        ep = env.open("checked", "train", 0)
        ep.call(call("execute_sql", query="SELECT COUNT(*) FROM sales"))
        assert ep.call(call("submit_answer", answer="3")).reward == 1.0  # the callable read the transcript
        ep.close()
    finally:
        env.close()


def test_bad_settings_and_task_files_fail_at_start(tmp_path: Path, tasks_file: str, http_server: Any) -> None:
    def env(**over: Any) -> McpToolsEnv:
        return McpToolsEnv(McpToolsConfig(**{"url": http_server[0], "tasks_file": tasks_file, **over}), name="sql")

    with pytest.raises(ValueError, match="exactly one of url or server_command"):
        env(server_command=SERVER)
    lines = {"not json": "not JSON", '{"id": 1}': "non-empty string 'prompt'",
             '{"prompt": "p", "answer": 1, "split": "dev"}': "split must be train or test",
             '{"prompt": "p"}': "needs the task's answer", '{"prompt": "p", "grader": "fuzzy"}': "expected exact"}
    for line, why in lines.items():
        path = tmp_path / "bad.jsonl"
        path.write_text('{"prompt": "fine", "answer": 1}\n' + line + "\n")
        with pytest.raises(ValueError, match=why) as raised:
            env(tasks_file=str(path))
        assert "bad.jsonl:2" in str(raised.value)
    with pytest.raises(ValueError, match="also a tool of the server"):
        env(answer_tool="list_tables")
    (tmp_path / "v.jsonl").write_text('{"prompt": "p", "grader": "tool:nope"}\n')
    with pytest.raises(ValueError, match="verifier tool.*nope"):
        env(tasks_file=str(tmp_path / "v.jsonl"))
    with pytest.raises(RuntimeError, match="cannot open an MCP session"):
        env(url="", server_command=[sys.executable, "-c", "import sys; sys.exit(2)"])


def test_a_server_that_dies_mid_episode_ends_it_without_a_hang(tasks_file: str, http_server: Any) -> None:
    env = McpToolsEnv(McpToolsConfig(server_command=SERVER, tasks_file=tasks_file), name="sql")
    try:
        ep = env.open("count", "train", 0)
        started = time.monotonic()
        with pytest.raises(ServerGone):
            ep.call(call("crash"))
        with pytest.raises(ServerGone, match="closed the session"):
            ep.call(call("list_tables"))
        assert time.monotonic() - started < 5
        ep.close()
    finally:
        env.close()
    url, proc = http_server
    env = McpToolsEnv(McpToolsConfig(url=url, tasks_file=tasks_file, call_timeout_s=3.0), name="sql")
    try:
        ep = env.open("count", "train", 0)
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="within 3s"):  # the host's env_timeout
            ep.call(call("wait", seconds=30))
        assert time.monotonic() - started < 5
        proc.kill()
        proc.wait()
        started = time.monotonic()
        with pytest.raises(ServerGone):
            ep.call(call("list_tables"))
        assert time.monotonic() - started < 5
        ep.close()
    finally:
        env.close()


async def test_over_nats_a_crash_is_env_error_and_cancel_and_idle_close_the_server(nc, subjects,
                                                                                   tasks_file: str) -> None:
    env = McpToolsEnv(McpToolsConfig(server_command=SERVER, tasks_file=tasks_file), name="sql")
    host = EnvHost(env, EnvConfig(task="sql", max_sessions=8, worker_threads=4),
                   subjects, "env-sql-1")
    service = await host.serve(nc, nc.jetstream())
    client = EnvClient(nc, subjects, "sql", timeout_s=30.0)

    def message(name: str, **arguments: Any) -> dict[str, Any]:
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}

    reaper = None
    try:
        opened = await asyncio.gather(*(client.start(f"s{i}", "count") for i in range(3)))
        assert len(server_children()) == 3  # a server process per episode
        r = opened[0].replica_id
        unknown = await client.interact(r, "s0", message("drop_everything"), turn=0)
        assert not unknown.finish and "Unknown tool" in unknown.messages[0]["content"]
        crashed = await client.interact(r, "s0", message("crash"), turn=1)
        assert crashed.finish and crashed.status == "env_error" and crashed.reward == 0.0
        assert "closed the session" in crashed.messages[0]["content"]
        cancelled = await client.cancel(r, "s1")
        assert cancelled.status == "cancelled"
        host.cfg.session_timeout_s = 0.5  # s2 is idle past it: the reaper closes it
        reaper = asyncio.create_task(host.reap_idle(every_s=0.2))
        await asyncio.sleep(1.5)
        assert host.sessions == {}
        deadline = time.monotonic() + 10
        while server_children() and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        assert server_children() == []
    finally:
        if reaper is not None:
            reaper.cancel()
        await service.stop()
        await host.shutdown()


def test_env_check_passes(tmp_path: Path, http_server: Any) -> None:
    """`jetrl env-check mcp` against the HTTP server: the oracle submits each task's answer."""
    path = tmp_path / "answered.jsonl"
    path.write_text("".join(json.dumps(t) + "\n" for t in TASKS if t["id"] in ("count", "mean", "held-out")))
    out = env_check("mcp", f"--env.mcp.url={http_server[0]}", f"--env.mcp.tasks_file={path}")
    assert "2/2 solved" in out and "1/1 solved" in out and "env-check mcp: 11 passed" in out


def wait_for(condition: Any, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return bool(condition())


def solve_adding(env: McpToolsEnv, task_id: str) -> float:
    """One pooled episode: a slow call, a query, the answer."""
    ep = env.open(task_id, "train", 0)
    try:
        assert [t["function"]["name"] for t in ep.tools][-1] == "submit_answer"
        assert ep.call(call("wait", seconds=0.5)).content == "waited"
        n = int(task_id.split("-")[1])
        rows = ep.call(call("execute_sql", query=f"SELECT {n} + 1")).content
        assert rows == f"[({n + 1},)]"
        return ep.call(call("submit_answer", answer=rows.strip("[(,)]"))).reward
    finally:
        ep.close()


def test_pooled_stdio_episodes_in_parallel_share_a_few_servers(tasks_file: str, stateless_tasks_file: str) -> None:
    with pytest.raises(ValueError, match="setup calls"):  # setup gives an episode state of its own: not pooled
        McpToolsEnv(McpToolsConfig(server_command=SERVER, tasks_file=tasks_file, sessions="pooled"), name="sql")
    assert wait_for(lambda: server_children() == [])
    env = McpToolsEnv(McpToolsConfig(server_command=SERVER, tasks_file=stateless_tasks_file, sessions="pooled",
                                     pool_size=2), name="sql")
    try:
        assert env.pool is not None and wait_for(lambda: len(server_children()) == 2)
        started = time.monotonic()
        with ThreadPoolExecutor(8) as threads:
            rewards = list(threads.map(lambda t: solve_adding(env, t), env.task_ids("train")))
        assert rewards == [1.0] * 8
        assert time.monotonic() - started < 3.0  # eight 0.5 s calls at once, not one after another
        assert len(server_children()) == 2  # no process of an episode's own
    finally:
        env.close()
    assert wait_for(lambda: server_children() == [])
    auto = McpToolsEnv(McpToolsConfig(server_command=SERVER, tasks_file=stateless_tasks_file, sessions="auto"),
                       name="sql")
    try:
        assert auto.pool is None  # nothing lets a stdio server declare itself stateless
    finally:
        auto.close()


def test_a_pooled_stdio_server_killed_mid_episode_ends_only_the_calls_on_it(stateless_tasks_file: str) -> None:
    env = McpToolsEnv(McpToolsConfig(server_command=SERVER, tasks_file=stateless_tasks_file, sessions="pooled",
                                     pool_size=2), name="sql")
    try:
        assert wait_for(lambda: len(server_children()) == 2)
        a, b = env.open("add-1", "train", 0), env.open("add-2", "train", 0)

        def slow(ep: Any) -> Any:
            try:
                return ep.call(call("wait", seconds=4)).content
            except ServerGone as exc:
                return exc

        with ThreadPoolExecutor(2) as threads:
            first = threads.submit(slow, a)
            time.sleep(0.3)  # a's call holds one session: b's goes to the other, the least busy
            second = threads.submit(slow, b)
            time.sleep(0.5)
            killed = server_children()[0]
            os.kill(killed, signal.SIGKILL)
            killed_at = time.monotonic()
            done = [first.result(10), second.result(10)]
            gone = [r for r in done if isinstance(r, ServerGone)]
            assert len(gone) == 1 and done.count("waited") == 1
        assert wait_for(lambda: len(server_children()) == 2 and killed not in server_children())  # replaced
        survivor = a if isinstance(done[1], ServerGone) else b
        assert survivor.call(call("execute_sql", query="SELECT 7")).content == "[(7,)]"
        assert time.monotonic() - killed_at < 10
        c = env.open("add-3", "train", 0)
        assert c.call(call("submit_answer", answer="4")).reward == 1.0
        for ep in (a, b, c):
            ep.close()
        # every session killed at once: the next call gets a replacement, or opens one itself
        assert env.pool is not None
        dead = list(env.pool.sessions)
        for pid in server_children():
            os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: not any(s.alive for s in dead))
        d = env.open("add-4", "train", 0)
        assert d.call(call("execute_sql", query="SELECT 5")).content == "[(5,)]"
        d.close()
    finally:
        env.close()
    assert wait_for(lambda: server_children() == [])


def test_pooled_http_in_parallel_auto_pools_a_stateless_server_and_a_kill_is_an_error(
        stateless_tasks_file: str, http_server: Any, stateless_http_server: Any) -> None:
    stateful = McpToolsEnv(McpToolsConfig(url=http_server[0], tasks_file=stateless_tasks_file, sessions="auto"),
                           name="sql")
    try:
        assert stateful.pool is None  # it assigns an Mcp-Session-Id: a session of its own per episode
    finally:
        stateful.close()
    url, proc = stateless_http_server
    env = McpToolsEnv(McpToolsConfig(url=url, tasks_file=stateless_tasks_file, sessions="auto", pool_size=3,
                                     startup_timeout_s=3.0), name="sql")
    try:
        assert env.pool is not None and len(env.pool.sessions) == 3
        started = time.monotonic()
        with ThreadPoolExecutor(8) as threads:
            rewards = list(threads.map(lambda t: solve_adding(env, t), env.task_ids("train")))
        assert rewards == [1.0] * 8 and time.monotonic() - started < 3.0
        ep = env.open("add-0", "train", 0)
        with ThreadPoolExecutor(1) as threads:
            slow = threads.submit(ep.call, call("wait", seconds=30))
            time.sleep(0.5)
            proc.kill()
            proc.wait()
            killed_at = time.monotonic()
            with pytest.raises(ServerGone):
                slow.result(10)
            assert time.monotonic() - killed_at < 5  # the call in flight ends, no hang
        started = time.monotonic()
        with pytest.raises(ServerGone):
            ep.call(call("list_tables"))
        assert time.monotonic() - started < 8  # no session opens: an error, bounded by startup_timeout_s
        ep.close()
    finally:
        env.close()


async def test_over_nats_a_pooled_crash_is_env_error_and_the_other_episodes_go_on(nc, subjects,
                                                                                stateless_tasks_file: str) -> None:
    env = McpToolsEnv(McpToolsConfig(server_command=SERVER, tasks_file=stateless_tasks_file, sessions="pooled",
                                     pool_size=1), name="sql")
    host = EnvHost(env, EnvConfig(task="sql", max_sessions=8, worker_threads=4), subjects, "env-sql-1")
    service = await host.serve(nc, nc.jetstream())
    client = EnvClient(nc, subjects, "sql", timeout_s=30.0)

    def message(name: str, **arguments: Any) -> dict[str, Any]:
        return {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}

    try:
        opened = await asyncio.gather(*(client.start(f"s{i}", "add-1") for i in range(3)))
        r = opened[0].replica_id
        assert len(server_children()) == 1  # one server for the three episodes
        crashed = await client.interact(r, "s0", message("crash"), turn=0)
        assert crashed.finish and crashed.status == "env_error" and crashed.reward == 0.0
        assert "closed the session" in crashed.messages[0]["content"]
        went_on = await client.interact(r, "s1", message("execute_sql", query="SELECT 1 + 1"), turn=0)
        assert not went_on.finish and went_on.messages[0]["content"] == "[(2,)]"
        solved = await client.interact(r, "s2", message("submit_answer", answer="2"), turn=0)
        assert solved.finish and solved.status == "completed" and solved.reward == 1.0
    finally:
        await service.stop()
        await host.shutdown()
    deadline = time.monotonic() + 10
    while server_children() and time.monotonic() < deadline:
        await asyncio.sleep(0.1)
    assert server_children() == []
