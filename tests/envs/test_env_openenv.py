"""OpenEnv servers through the openenv_env adapter, against real servers built with openenv-core's own
``create_app`` and started as processes: envs written for the tests (tests/servers/openenv_guess.py: plain,
a union of action types, MCP-backed) and the sample env openenv-core ships (``openenv init``'s echo
template), started by the adapter from a command. Sessions in parallel, a server at capacity, a server
killed mid-episode (env_error at once, then a fresh server), a hung step (env_timeout) and cancel."""

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

pytest.importorskip("openenv", reason="the openenv extra: pip install 'jetrl[openenv]' (make venv installs it)")

from services.envs.base import ToolCall, ToolError  # noqa: E402
from services.envs.host import EnvHost  # noqa: E402
from services.envs.openenv_env import OpenEnvConfig, OpenEnvEnv  # noqa: E402
from shared.config import EnvConfig  # noqa: E402
from shared.envapi import EnvClient, EnvError  # noqa: E402
from tests.procs import env_check, stop_processes  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(url: str, timeout_s: float = 120.0) -> None:
    import urllib.request

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.3)


@pytest.fixture(scope="module")
def server() -> Any:
    """The test envs' OpenEnv server (one process, three envs under /guess, /shapes, /calc)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tests.servers.openenv_guess", str(port)], cwd=REPO)
    wait_for(f"http://127.0.0.1:{port}/guess/health")
    yield f"http://127.0.0.1:{port}"
    stop_processes([proc], timeout_s=5)


def guess(n: Any) -> ToolCall:
    return ToolCall("guess", {"guess": n})


def bisect(episode: Any, top: int) -> list[Any]:
    """Plays a guess episode to the number; the results of every step."""
    lo, hi, results = 1, top, []
    while True:
        middle = (lo + hi) // 2
        result = episode.call(guess(middle))
        results.append(result)
        if result.finish:
            return results
        lo, hi = (middle + 1, hi) if result.content.startswith("higher") else (lo, middle - 1)


def test_a_websocket_session_per_episode_in_parallel(server: str) -> None:
    settings = OpenEnvConfig(url=f"{server}/guess", tasks=["easy", "normal"], task_key="difficulty")
    env = OpenEnvEnv(settings, num_train=4, num_test=2, name="guess")
    assert env.websocket and not env.mcp
    assert env.task_ids("train")[:2] == ["easy/seed-0", "easy/seed-1"] and len(env.task_ids("train")) == 8
    assert env.task_ids("test") == ["easy/seed-1000000", "easy/seed-1000001", "normal/seed-1000000",
                                    "normal/seed-1000001"]
    ep = env.open("easy/seed-1", "train", 0)
    assert ep.opening()[1]["content"] == "I picked a number from 1 to 10. You have 7 guesses."  # task -> reset kwarg
    (tool,) = ep.tools
    assert tool["function"]["name"] == "guess" and tool["function"]["description"] == "Guess the secret number."
    assert tool["function"]["parameters"]["properties"] == {"guess": {"description": "your guess", "title": "Guess",
                                                                      "type": "integer"}}  # no base metadata
    with pytest.raises(ToolError, match="valid integer"):
        ep.call(guess("seven"))
    results = bisect(ep, 10)
    assert (results[-1].content, results[-1].reward, results[-1].status) == ("Right!", 1.0, "completed")
    ep.close()

    def play(task_id: str) -> tuple[int, float]:
        episode = env.open(task_id, "train", 0)
        try:
            steps = bisect(episode, 100)
            return len(steps), steps[-1].reward
        finally:
            episode.close()

    with ThreadPoolExecutor(8) as pool:  # eight sessions at once, each its own env on the server
        played = list(pool.map(play, [f"normal/seed-{i % 4}" for i in range(8)]))
    assert all(reward == 1.0 for _, reward in played)
    assert played[:4] == played[4:]  # a task is the same game on every session: seed and task name
    out_of_guesses = env.open("normal/seed-0", "train", 0)
    for _ in range(6):
        assert not out_of_guesses.call(guess(0)).finish
    last = out_of_guesses.call(guess(0))
    assert last.finish and last.reward == 0.0 and "No guesses left" in last.content
    out_of_guesses.close()


def test_union_actions_mcp_backed_envs_and_plain_http(server: str) -> None:
    shapes = OpenEnvEnv(OpenEnvConfig(url=f"{server}/shapes"), 1, 1, name="shapes").open("seed-0", "train", 0)
    tools = {t["function"]["name"]: t["function"] for t in shapes.tools}
    assert set(tools) == {"circle", "square"} and tools["square"]["parameters"]["properties"] == {
        "side": {"title": "Side", "type": "number"}}  # the discriminator is filled in, not asked for
    area = shapes.call(ToolCall("square", {"side": 3}))
    assert (area.content, area.finish, area.reward) == ("9.0", True, 1.0)
    shapes.close()

    calc_env = OpenEnvEnv(OpenEnvConfig(url=f"{server}/calc"), 1, 1, name="calc")
    assert calc_env.mcp
    calc = calc_env.open("seed-0", "train", 0)
    assert [t["function"]["name"] for t in calc.tools] == ["add", "submit"]
    assert calc.tools[0]["function"]["parameters"]["required"] == ["a", "b"]  # the env's own MCP schema
    assert calc.call(ToolCall("add", {"a": 40, "b": 2})).content == "42"
    with pytest.raises(ToolError, match="Unknown tool"):
        calc.call(ToolCall("multiply", {}))
    done = calc.call(ToolCall("submit", {"answer": 42}))
    assert (done.finish, done.reward) == (True, 1.0)
    calc.close()

    http = OpenEnvEnv(OpenEnvConfig(url=f"{server}/guess", transport="http"), 1, 1, name="guess")
    assert not http.websocket
    ep = http.open("seed-0", "train", 0)
    assert ep.call(guess(50)).content in ("higher.", "lower.", "Right!")
    with pytest.raises(ToolError, match="refused the action"):
        ep.call(guess("x"))


def test_settings_that_cannot_work_fail_at_start(server: str) -> None:
    with pytest.raises(ValueError, match="url, or server_command"):
        OpenEnvEnv(OpenEnvConfig(), 1, 1)
    with pytest.raises(ValueError, match="has {port} in it"):
        OpenEnvEnv(OpenEnvConfig(url=f"{server}/guess", server_command=["prog"]), 1, 1)
    with pytest.raises(ValueError, match="transport is auto"):
        OpenEnvEnv(OpenEnvConfig(url=f"{server}/guess", transport="grpc"), 1, 1)
    with pytest.raises(RuntimeError, match="exited with 2 before it answered"):
        OpenEnvEnv(OpenEnvConfig(server_command=[sys.executable, "-c", "raise SystemExit(2)"]), 1, 1)


@pytest.fixture
def echo_template(tmp_path: Path) -> list[str]:
    """openenv-core's sample env (the template ``openenv init`` writes), as a command that serves it."""
    from openenv.cli.commands.init import _copy_template_directory, _create_template_replacements

    _copy_template_directory("openenv.cli.templates.openenv_env", "", tmp_path / "echo_env",
                             _create_template_replacements("echo_env"), "echo_env")
    return [sys.executable, "-m", "uvicorn", "--app-dir", str(tmp_path), "echo_env.server.app:app",
            "--host", "127.0.0.1", "--port", "{port}", "--log-level", "warning"]


def message(name: str, **arguments: Any) -> dict[str, Any]:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}


async def test_the_shipped_sample_env_killed_mid_episode_over_nats(nc, subjects, echo_template: list[str]) -> None:
    env = OpenEnvEnv(OpenEnvConfig(server_command=echo_template), 2, 2, name="echo")
    host = EnvHost(env, EnvConfig(task="echo", max_sessions=4, worker_threads=2), subjects, "env-echo-1")
    service = await host.serve(nc, nc.jetstream())
    client = EnvClient(nc, subjects, "echo", timeout_s=60.0)
    try:
        started = await client.start("a", "seed-0")
        assert started.messages[1]["content"] == json.dumps({"echoed_message": "Echo Env environment ready!",
                                                             "message_length": 0})
        assert [t["function"]["name"] for t in started.tools] == ["echo"]
        echoed = await client.interact(started.replica_id, "a", message("echo", message="hello"), turn=0)
        assert not echoed.finish and json.loads(echoed.messages[0]["content"])["echoed_message"] == "hello"
        with pytest.raises(EnvError, match="CAPACITY_REACHED"):  # the template allows one session at a time
            await client.start("b", "seed-1")
        os.killpg(env.server.proc.pid, signal.SIGKILL)
        begun = time.monotonic()
        dead = await client.interact(started.replica_id, "a", message("echo", message="again"), turn=1)
        assert dead.finish and dead.status == "env_error" and dead.reward == 0.0
        assert "closed the session" in dead.messages[0]["content"] and time.monotonic() - begun < 5
        again = await client.start("c", "seed-1")  # the next episode gets a fresh server
        assert env.server.starts == 2 and again.tools == started.tools
    finally:
        await service.stop()
        await host.shutdown()
    assert env.server.proc.poll() is not None  # stopped with the replica


async def test_a_hung_step_is_env_timeout_and_cancel_closes_the_session(nc, subjects, server: str) -> None:
    env = OpenEnvEnv(OpenEnvConfig(url=f"{server}/guess", step_timeout_s=1.0), 2, 2, name="guess")
    host = EnvHost(env, EnvConfig(task="guess", max_sessions=4, worker_threads=2), subjects, "env-guess-1")
    service = await host.serve(nc, nc.jetstream())
    client = EnvClient(nc, subjects, "guess", timeout_s=30.0)
    try:
        a, b = await client.start("a", "seed-0"), await client.start("b", "seed-1")
        hung = await client.interact(a.replica_id, "a", message("guess", guess=-1), turn=0)
        assert hung.finish and hung.status == "env_timeout" and hung.reward == 0.0
        b_episode = host.sessions["b"].episode
        assert (await client.cancel(b.replica_id, "b")).status == "cancelled"
        await asyncio.sleep(0.2)
        assert b_episode.session.ws.state.name == "CLOSED"  # the server's session is ended, not left open
    finally:
        await service.stop()
        await host.shutdown()


def test_env_check_passes(server: str) -> None:
    """`jetrl env-check openenv` against the guess server: no oracle, every other check."""
    out = env_check("openenv", f"--env.openenv.url={server}/guess", "--env.num_train_tasks=2", "--env.num_test_tasks=2")
    assert "has no oracle" in out and "env-check openenv: 9 passed" in out
