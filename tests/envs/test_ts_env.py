"""An env in another language: examples/ts-ledger (TypeScript on Node, the official NATS client, msgpack),
written from docs/env-protocol.md alone, beside a real nats-server with one user per role. Driven by
JetRL's own client (shared/envapi.py) as the rollout role: every split's tasks solved by the oracle, bad
calls answered with error observations, resent turns deduplicated, cancel, the turn limit, the session
limit, the idle timeout, coded errors and dead letters for bad requests, health, the micro service's
announcement, the registry heartbeat, replies that fit the spec's JSON Schemas and a clean SIGTERM.
Then as a task of a run (``[env.ledger] command``): ``jetrl env-check ledger`` passes, ``jetrl eval`` with
the oracle engine solves every test task through the Python rollout, and ``jetrl up`` trains two RL steps
on it, each with its embedded nats-server's per-role users. Skips, saying why, without node or npm."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import jsonschema
import msgspec
import pytest
from nats.aio.client import Client

from jetrl.schema import SCHEMA_DIR
from shared.auth import generate_passwords, server_authorization
from shared.bus import connect, declare_topology
from shared.config import JetRLConfig, NatsConfig, load_config, save_config
from shared.envapi import ERROR_CODE_HEADER, ERROR_HEADER, EnvClient, EnvError
from shared.messages import DeadLetter, EnvOracle, EnvStart, EnvStarted, EnvStep, Heartbeat, Trajectory, decode, encode
from shared.natsd import EmbeddedNats
from shared.subjects import Subjects
from tests.procs import log_tails

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "ts-ledger"
MAIN = EXAMPLE / "dist" / "main.js"
PREFIX = "tts" + uuid.uuid4().hex[:6]


def build_ts_ledger() -> None:
    """npm ci and tsc through the Makefile (mk/examples.mk); skip where node, npm or make are missing."""
    missing = [tool for tool in ("node", "npm", "make") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed: the TypeScript env cannot be built")
    major = int(subprocess.run(["node", "--version"], capture_output=True, text=True).stdout.strip().lstrip("v")
                .split(".")[0])
    if major < 18:
        pytest.skip(f"node {major} is too old for the TypeScript env (needs >= 18)")
    proc = subprocess.run(["make", "-s", "setup-ts-ledger"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"make setup-ts-ledger failed:\n{proc.stdout}\n{proc.stderr}"


@dataclass
class AuthServer:
    url: str
    auth_dir: Path

    def nats(self, role: str) -> NatsConfig:
        return NatsConfig(url=self.url, prefix=PREFIX, auth_dir=str(self.auth_dir), connect_timeout_s=3.0)


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthServer]:
    build_ts_ledger()
    root = tmp_path_factory.mktemp("tsnats")
    server = EmbeddedNats(root / "nats", authorization=server_authorization(Subjects(PREFIX),
                                                                            generate_passwords(root / "auth")))
    url = server.start()
    yield AuthServer(url, root / "auth")
    server.stop()


def start_replica(server: AuthServer, task: str, replica_id: str, log: Path, *flags: str) -> subprocess.Popen[bytes]:
    """The TypeScript env as `jetrl up` starts a `command` task: the contract's environment variables."""
    env = dict(os.environ, JETRL_NATS_URL=server.url, JETRL_NATS_USER="env",
               JETRL_NATS_PASSWORD_FILE=str(server.auth_dir / "env.password"), JETRL_NATS_PREFIX=PREFIX,
               JETRL_TASK=task, JETRL_REPLICA_ID=replica_id, JETRL_HEARTBEAT_TTL_S="10")
    with open(log, "ab") as fh:
        return subprocess.Popen(["node", str(MAIN), *flags], env=env, stdout=fh, stderr=subprocess.STDOUT)


@pytest.fixture
async def admin(auth_server: AuthServer) -> AsyncIterator[Client]:
    nc = await connect(auth_server.nats("admin"), "pytest-admin", role="admin")
    await declare_topology(nc.jetstream(), Subjects(PREFIX), auth_server.nats("admin"), role="admin")
    yield nc
    for stream in await nc.jetstream().streams_info():
        if stream.config.name.startswith(PREFIX.upper()) or PREFIX in stream.config.name:
            await nc.jetstream().delete_stream(stream.config.name)
    await nc.close()


@pytest.fixture
async def rollout(auth_server: AuthServer, admin: Client) -> AsyncIterator[Client]:
    nc = await connect(auth_server.nats("rollout"), "pytest-rollout", role="rollout")
    yield nc
    await nc.close()


async def wait_for_env(client: EnvClient, deadline_s: float = 30.0) -> None:
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            await client.health()
            return
        except EnvError:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


def call(name: str, call_id: str = "call_0", **arguments: object) -> dict[str, object]:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": name, "arguments": msgspec.json.encode(arguments).decode()}}]}


async def play_oracle(env: EnvClient, opening: EnvStarted, session_id: str) -> tuple[EnvStep, int]:
    for turn in range(opening.max_turns):
        move = await env.oracle(opening.replica_id, session_id)
        step = await env.interact(opening.replica_id, session_id, move, turn=turn)
        if step.finish:
            return step, turn + 1
    raise AssertionError(f"the oracle did not finish {session_id} within {opening.max_turns} turns")


async def test_ledger_env_speaks_the_protocol(auth_server: AuthServer, admin: Client, rollout: Client,
                                              tmp_path: Path) -> None:
    subjects = Subjects(PREFIX)
    replica = start_replica(auth_server, "ledger", "ledger-a", tmp_path / "ledger.log", "--num-train-tasks=9",
                            "--num-test-tasks=6")
    try:
        env = EnvClient(rollout, subjects, "ledger", timeout_s=10.0)
        await wait_for_env(env)
        train, test = await env.task_ids("train"), await env.task_ids("test")
        assert len(train) == 9 and len(test) == 6 and not set(train) & set(test)
        with pytest.raises(EnvError) as unknown_split:
            await env.task_ids("dev")
        assert unknown_split.value.code == "404"

        # every split, every level: the oracle's moves, played through interact, solve the task
        for split, ids in (("train", train[:3]), ("test", test[:3])):
            for task_id in ids:
                session_id = f"{split}-{task_id}-oracle"
                opening = await env.start(session_id, task_id, split, seed=7)
                assert opening.replica_id == "ledger-a" and opening.level in (1, 2, 3) and opening.task_kind
                assert [m["role"] for m in opening.messages] == ["system", "user"]
                assert {t["function"]["name"] for t in opening.tools} == {"get_price", "calculate", "submit_answer"}
                step, turns = await play_oracle(env, opening, session_id)
                assert (step.reward, step.status, step.metrics["turns"], step.metrics["invalid_actions"]) == \
                    (1.0, "completed", turns, 0)
                with pytest.raises(EnvError) as closed:  # finished: the session is gone
                    await env.interact("ledger-a", session_id, call("get_price", item="apple"))
                assert closed.value.code == "404"
        assert sorted({(await env.start(f"lv-{i}", t)).level for i, t in enumerate(train[:3])}) == [1, 2, 3]

        # bad actions are observations: the episode goes on, each counted as invalid
        await env.start("bad", train[1])
        bad_turns = [
            ({"role": "assistant", "content": "the total is 12"}, "No tool call found"),
            (call("get_discount", code="x"), "Unknown tool 'get_discount'. Available tools: calculate, get_price"),
            (call("submit_answer", answer="12"), "argument answer must be of type integer"),
            (call("get_price", item="apple", size="big"), "unexpected argument(s) size"),
            (call("get_price"), "missing argument(s) item"),
            ({"role": "assistant", "content": "", "invalid_tool_call": "<tool_call>{broken"}, "Malformed tool call"),
            (call("calculate", expression="2 ** 3; rm -rf /"), "Error: unexpected"),
        ]
        for turn, (message, error) in enumerate(bad_turns[:6]):
            step = await env.interact("ledger-a", "bad", message, turn=turn)
            assert (step.finish, step.status, step.reward) == (False, "running", 0.0)
            assert step.messages[0]["role"] == "tool" and step.messages[0]["content"].startswith("Error: ")
            assert error in step.messages[0]["content"], step.messages[0]["content"]
            assert step.metrics == {"turns": turn + 1.0, "invalid_actions": turn + 1.0}
        again = await env.interact("ledger-a", "bad", bad_turns[0][0], turn=0)  # a resent turn: its first reply
        assert again.metrics["turns"] == 1.0
        # the turn limit (8) ends the episode on the 8th turn, whatever that turn was
        step = await env.interact("ledger-a", "bad", bad_turns[6][0], turn=6)
        assert not step.finish and "unexpected" in step.messages[0]["content"]
        move = await env.oracle("ledger-a", "bad")  # a good move, but the last one the episode takes
        move["tool_calls"][0]["id"] = "call_7"
        step = await env.interact("ledger-a", "bad", move, turn=7)
        assert (step.finish, step.status, step.reward) == (True, "task_limit_reached", 0.0)
        assert step.messages[0]["tool_call_id"] == "call_7" and "Turn limit reached." in step.messages[0]["content"]

        # a wrong answer is graded, not refused
        opening = await env.start("wrong", test[0], "test")
        step = await env.interact("ledger-a", "wrong", call("submit_answer", answer=-1), turn=0)
        assert (step.finish, step.status, step.reward, step.metrics["correct"]) == (True, "completed", 0.0, 0.0)

        # cancel: the session ends, a resent cancel gets the same answer, anything after it a 404
        await env.start("gone", train[0])
        first = await env.cancel("ledger-a", "gone")
        assert (first.finish, first.status, first.messages) == (True, "cancelled", [])
        assert await env.cancel("ledger-a", "gone") == first
        with pytest.raises(EnvError) as cancelled:
            await env.oracle("ledger-a", "gone")
        assert cancelled.value.code == "404"
        with pytest.raises(EnvError) as unknown_task:
            await env.start("nope", "train-9999")
        assert unknown_task.value.code == "404"

        # a request that is not the message it should be: 400 with the reason, and a dead letter
        for payload, reason in ((b"\xc1not msgpack", "not msgpack"),
                                (msgspec.msgpack.encode({"kind": "env_start", "v": 1, "session_id": 5, "task_id": "t"}),
                                 "env_start.session_id: expected str, got int"),
                                (msgspec.msgpack.encode({"kind": "env_start", "v": 2, "session_id": "s", "task_id": "t"}),
                                 "unsupported schema version 2")):
            reply = await rollout.request(subjects.env_start("ledger"), payload, timeout=5)
            assert reply.data == b"" and reply.headers[ERROR_CODE_HEADER] == "400"
            assert reason in reply.headers[ERROR_HEADER]
        letters = await admin.jetstream().subscribe(subjects.dead_letter("env-ledger"), ordered_consumer=True)
        letter = decode((await letters.next_msg(timeout=5)).data, DeadLetter)
        assert (letter.service, letter.origin_subject, letter.payload) == \
            ("env-ledger", subjects.env_start("ledger"), b"\xc1not msgpack")
        await letters.unsubscribe()

        health = await env.health()
        assert (health.replica_id, health.task, health.max_sessions, health.task_counts) == \
            ("ledger-a", "ledger", 64, {"train": 9, "test": 6})
        assert health.sessions == 3 and health.sessions_started == 12 and health.interact_ms_p99 > 0

        # the bytes a TypeScript writer sends fit the spec's JSON Schemas (docs/schemas/, from shared/messages/)
        schemas = {kind: json.loads((SCHEMA_DIR / f"{kind}.json").read_text())
                   for kind in ("env_started", "env_step", "env_interact", "env_health", "heartbeat")}
        started = await rollout.request(subjects.env_start("ledger"), encode(EnvStart(session_id="raw", task_id=test[2],
                                                                                      split="test")), timeout=5)
        move = await rollout.request(subjects.env_oracle("ledger", "ledger-a"), encode(EnvOracle(session_id="raw")),
                                     timeout=5)
        step = await rollout.request(subjects.env_interact("ledger", "ledger-a"), move.data, timeout=5)
        raw_health = await rollout.request(subjects.env_health("ledger"), b"", timeout=5)
        for kind, data in (("env_started", started.data), ("env_interact", move.data), ("env_step", step.data),
                           ("env_health", raw_health.data)):
            jsonschema.validate(msgspec.msgpack.decode(data), schemas[kind])

        # what it announces: the micro service (name, version, metadata, endpoints) and its heartbeat
        info = msgspec.json.decode((await admin.request(f"$SRV.INFO.{subjects.env_service_name('ledger')}", b"",
                                                        timeout=5)).data)
        assert (info["name"], info["version"], info["metadata"]) == (f"{PREFIX}-env-ledger", "1.0.0",
                                                                     {"replica_id": "ledger-a"})
        assert {e["name"]: e["subject"] for e in info["endpoints"]} == {
            "start": subjects.env_start("ledger"), "tasks": subjects.env_tasks("ledger"),
            "health": subjects.env_health("ledger"), "interact": subjects.env_interact("ledger", "ledger-a"),
            "cancel": subjects.env_cancel("ledger", "ledger-a"), "oracle": subjects.env_oracle("ledger", "ledger-a")}
        kv = await admin.jetstream().key_value(subjects.registry_kv)
        entry = await kv.get(Subjects.registry_key("env-ledger", "ledger-a"))
        jsonschema.validate(msgspec.msgpack.decode(entry.value), schemas["heartbeat"])
        beat = decode(entry.value, Heartbeat)
        assert (beat.role, beat.replica_id, beat.pid, beat.info) == ("env-ledger", "ledger-a", replica.pid,
                                                                     {"task": "ledger", "max_sessions": 64})
        assert time.time() - beat.ts < 5

        replica.send_signal(signal.SIGTERM)  # leaves at once, exit 0; nothing answers after it
        assert replica.wait(timeout=10) == 0
        with pytest.raises(EnvError) as stopped:
            await env.health()
        assert stopped.value.code == "503"
    finally:
        if replica.poll() is None:
            replica.kill()
    log = (tmp_path / "ledger.log").read_text()
    assert '"event":"env_ready"' in log and '"event":"env_host_stopped"' in log and "Violation" not in log, log


async def test_session_limit_and_idle_timeout(auth_server: AuthServer, rollout: Client, tmp_path: Path) -> None:
    replica = start_replica(auth_server, "ledgerquick", "quick-a", tmp_path / "quick.log", "--max-sessions=2",
                            "--session-timeout-s=4")
    try:
        env = EnvClient(rollout, Subjects(PREFIX), "ledgerquick", timeout_s=10.0)
        await wait_for_env(env)
        task_id = (await env.task_ids("train"))[0]
        await env.start("one", task_id)
        await env.start("two", task_id)
        with pytest.raises(EnvError) as full:
            await env.start("three", task_id)
        assert full.value.code == "503" and "limit of 2 sessions" in full.value.description
        assert (await env.health()).sessions == 2
        deadline = time.monotonic() + 15
        while (await env.health()).sessions and time.monotonic() < deadline:  # idle past 4 s: reaped
            await asyncio.sleep(0.25)
        assert (await env.health()).sessions == 0
        with pytest.raises(EnvError) as reaped:
            await env.interact("quick-a", "one", call("get_price", item="apple"))
        assert reaped.value.code == "404"
        assert (await env.start("three", task_id)).replica_id == "quick-a"
    finally:
        replica.send_signal(signal.SIGTERM)
        replica.wait(timeout=10)


# ---------------------------------------------------------------------------- the TypeScript env in a run
def run_config(tmp_path: Path, mode: str) -> Path:
    """A small run on the ledger task alone, served by the TypeScript program (``[env.ledger] command``);
    no nats.url: `jetrl` starts its own server, one user per role."""
    build_ts_ledger()
    cfg = JetRLConfig()
    cfg.run.dir = str(tmp_path / mode)
    cfg.run.tasks = {"ledger": 1.0}
    cfg.controller.group_size = 2
    cfg.controller.max_inflight = 4
    cfg.rollout.max_new_tokens = 12
    cfg.rollout.concurrency = 2
    cfg.trainer.steps = 2
    cfg.trainer.min_groups = 1
    cfg.trainer.lr = 1e-3
    cfg.trainer.kl_coef = 0.01  # an untrained model's groups all fail: the KL term still makes each step a real one
    path = tmp_path / f"{mode}.toml"
    save_config(cfg, path)
    # the command runs in the config's directory; an absolute path to the program works from anywhere
    command = json.dumps(["node", str(MAIN), "--num-train-tasks=6", "--num-test-tasks=6"])
    path.write_text(path.read_text() + f"\n[env.ledger]\ncommand = {command}\n")
    return path


def jetrl(mode: str, config: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "jetrl.cli", mode, "--config", str(config), "--rollouts", "1", *flags],
                          cwd=REPO, capture_output=True, text=True, timeout=400)


def env_log(run_dir: Path) -> str:
    return (run_dir / "logs" / "env-ledger-0.log").read_text()


@pytest.mark.slow
def test_env_check_passes_and_jetrl_eval_with_the_oracle_solves_every_test_task_of_the_ts_env(tmp_path: Path) -> None:
    config = run_config(tmp_path, "eval")
    check = subprocess.run([sys.executable, "-m", "jetrl.cli", "env-check", "ledger", "--config", str(config)],
                           cwd=REPO, capture_output=True, text=True, timeout=120)
    assert check.returncode == 0 and ", 0 failed" in check.stdout, check.stdout + check.stderr
    proc = jetrl("eval", config, "--engine", "oracle")
    run_dir = tmp_path / "eval"
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{log_tails(run_dir)}"
    report = json.loads((run_dir / "eval.json").read_text())["greedy"]["ledger"]
    assert (report["episodes"], report["success"], report["well_formed_rate"]) == (6, 1.0, 1.0)
    assert set(report["by_level"]) == {"1", "2", "3"} and set(report["by_kind"]) == {"single", "basket", "discount"}
    log = env_log(run_dir)
    assert '"event":"env_ready"' in log and '"event":"env_host_stopped"' in log and "Violation" not in log, log


@pytest.mark.slow
def test_jetrl_up_trains_two_rl_steps_on_the_ts_env(tmp_path: Path) -> None:
    config = run_config(tmp_path, "up")
    proc = jetrl("up", config)
    run_dir = tmp_path / "up"
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{log_tails(run_dir)}"
    assert "training finished: 2 steps" in proc.stdout and "ledger: success" in proc.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train/trajectories"] >= 2 and "task/ledger/success" in r for r in rows)
    assert (run_dir / "checkpoints" / "step_000002" / "model.safetensors").is_file()
    trajectories = asyncio.run(stored_trajectories(run_dir))
    assert len(trajectories) >= 4 and {t.task for t in trajectories} == {"ledger"}
    for t in trajectories:  # every turn the policy played went through the TypeScript env and came back
        assert t.turns and t.level in (1, 2, 3) and t.task_kind in ("single", "basket", "discount")
        assert t.status != "env_error" and t.metrics["invalid_actions"] <= t.metrics["turns"]
    log = env_log(run_dir)
    assert '"event":"env_ready"' in log and "Violation" not in log, log


async def stored_trajectories(run_dir: Path) -> list[Trajectory]:
    """The run's TRAJ stream, read back after the run from its JetStream store on a fresh server."""
    server = EmbeddedNats(run_dir / "nats")
    url = server.start()
    try:
        nc = await connect(NatsConfig(url=url), "pytest-reader")
        prefix = load_config(str(run_dir / "config.toml")).nats.prefix
        sub = await nc.jetstream().subscribe(Subjects(prefix).traj(">"), ordered_consumer=True)
        out: list[Trajectory] = []
        try:
            while True:
                out.append(decode((await sub.next_msg(timeout=2.0)).data, Trajectory))
        except Exception:  # nats TimeoutError: nothing more
            pass
        await nc.close()
        return out
    finally:
        server.stop()
