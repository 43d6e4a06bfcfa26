"""The env host at scale, against a real nats-server: many sessions on one bounded worker pool with each
session's calls run in the order they came, a stuck tool that does not starve the others, a replica
SIGTERMed with a thousand open db sessions exiting cleanly, and job acks that are retried (never raised)
across a server restart."""

from __future__ import annotations

import asyncio
import itertools
import random
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from services.envs.base import Episode, TaskEnv, ToolCall, ToolResult
from services.envs.host import EnvHost
from shared.bus import connect, declare_topology
from shared.config import EnvConfig, JetRLConfig, save_config
from shared.delivery import Acker
from shared.envapi import EnvClient
from shared.messages import EpisodeJob, encode
from shared.natsd import EmbeddedNats
from shared.subjects import Subjects
from tests.procs import stop_processes

REPO = Path(__file__).resolve().parents[2]
TOOLS = [{"type": "function", "function": {"name": "note", "description": "Record a number.", "parameters": {
    "type": "object", "properties": {"n": {"type": "integer"}, "sleep_s": {"type": "number"}},
    "required": ["n"]}}}]


class NoteEpisode(Episode):
    """Records the order its calls ran in, and on which threads; a call may sleep (a slow tool)."""

    max_turns = 1000

    def __init__(self, env: NoteEnv) -> None:
        self.env = env
        self.seen: list[int] = []
        self.closed = False

    @property
    def tools(self) -> list[dict[str, Any]]:
        return TOOLS

    def opening(self) -> list[dict[str, Any]]:
        return [{"role": "user", "content": "note numbers"}]

    def call(self, tool: ToolCall) -> ToolResult:
        with self.env.lock:
            self.env.running += 1
            self.env.peak = max(self.env.peak, self.env.running)
            self.env.threads.add(threading.get_ident())
        try:
            time.sleep(tool.arguments.get("sleep_s", random.random() * 0.002))  # shuffles the threads' finishing order
            self.seen.append(tool.arguments["n"])
            return ToolResult(content=",".join(map(str, self.seen)))
        finally:
            with self.env.lock:
                self.env.running -= 1

    def close(self) -> None:
        self.closed = True


class NoteEnv(TaskEnv):
    name = "note"

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.running = self.peak = 0
        self.threads: set[int] = set()
        self.episodes: list[NoteEpisode] = []

    def task_ids(self, split: str) -> list[str]:
        return ["t0"]

    def open(self, task_id: str, split: str, seed: int) -> NoteEpisode:
        episode = NoteEpisode(self)
        self.episodes.append(episode)
        return episode


def note(n: int, sleep_s: float | None = None) -> dict[str, Any]:
    args: dict[str, Any] = {"n": n} if sleep_s is None else {"n": n, "sleep_s": sleep_s}
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"c{n}", "type": "function", "function": {"name": "note", "arguments": args}}]}


async def test_many_sessions_on_a_bounded_pool_keep_each_sessions_order(nc, subjects) -> None:
    """800 sessions, each sending 6 calls at once without waiting for the replies: every session's calls run
    in the order sent, none on more than ``worker_threads`` threads at a time, and shutdown closes them all."""
    sessions, calls, threads = 800, 6, 4
    env = NoteEnv()
    cfg = EnvConfig(task="note", max_sessions=sessions, worker_threads=threads, action_timeout_s=20.0)
    host = EnvHost(env, cfg, subjects, "env-note-1")
    service = await host.serve(nc, nc.jetstream())
    client = EnvClient(nc, subjects, "note", timeout_s=60.0)
    try:
        opened = await asyncio.gather(*(client.start(f"s{i}", "t0") for i in range(sessions)))
        assert len(host.sessions) == sessions
        # every call of every session is in flight at once: 4,800 requests, published in this order
        pending = [asyncio.ensure_future(client.interact(o.replica_id, f"s{i}", note(n), turn=n))
                   for n in range(calls) for i, o in enumerate(opened)]
        steps = await asyncio.gather(*pending)
        assert all(not s.finish for s in steps)
        assert [e.seen for e in env.episodes] == [list(range(calls))] * sessions
        assert env.peak <= threads and len(env.threads) <= 2 * threads
    finally:
        await service.stop()
        await host.shutdown()
    assert host.sessions == {} and all(e.closed for e in env.episodes)


async def test_an_undecodable_request_on_any_endpoint_gets_a_coded_reply_and_the_replica_serves_on(
        nc, subjects) -> None:
    """msgpack nested 1,000 deep on every endpoint: each gets a 400 naming the reason (never a 500), the
    request is dead-lettered, and the same session then plays on."""
    env = NoteEnv()
    host = EnvHost(env, EnvConfig(task="note", max_sessions=4), subjects, "env-note-3")
    service = await host.serve(nc, nc.jetstream())
    client = EnvClient(nc, subjects, "note", timeout_s=10.0)
    nested = b"\x91" * 1000 + b"\x00"
    try:
        opened = await client.start("s0", "t0")
        for subject in (subjects.env_start("note"), subjects.env_tasks("note"), subjects.env_interact("note", opened.replica_id),
                        subjects.env_cancel("note", opened.replica_id), subjects.env_oracle("note", opened.replica_id)):
            reply = await nc.request(subject, nested, timeout=10.0)
            assert reply.headers and reply.headers.get("Nats-Service-Error-Code") == "400", (subject, reply.headers)
            assert reply.headers.get("Nats-Service-Error") == "expected a msgpack map, got list", reply.headers
        step = await client.interact(opened.replica_id, "s0", note(7), turn=0)
        assert not step.finish and env.episodes[0].seen == [7]
    finally:
        await service.stop()
        await host.shutdown()


async def test_a_stuck_tool_gives_its_slot_back_and_the_others_go_on(nc, subjects) -> None:
    """One worker thread: a tool past action_timeout_s ends its episode (env_timeout) and frees the slot,
    so the next session's call runs while the stuck one still sleeps; its episode is closed after it."""
    env = NoteEnv()
    cfg = EnvConfig(task="note", max_sessions=4, worker_threads=1, action_timeout_s=0.5)
    host = EnvHost(env, cfg, subjects, "env-note-2")
    service = await host.serve(nc, nc.jetstream())
    client = EnvClient(nc, subjects, "note", timeout_s=10.0)
    try:
        a, b = await client.start("slow", "t0"), await client.start("fast", "t0")
        stuck = await client.interact(a.replica_id, "slow", note(0, sleep_s=3.0), turn=0)
        assert stuck.finish and stuck.status == "env_timeout"
        fast = await client.interact(b.replica_id, "fast", note(1, sleep_s=0.0), turn=0)
        assert not fast.finish and fast.messages[0]["content"] == "1"
        assert not env.episodes[0].closed  # its tool still runs: closed only once it returns
    finally:
        await service.stop()
        await host.shutdown(wait_s=5.0)
    assert all(e.closed for e in env.episodes)


def test_sigterm_mid_traffic_with_a_thousand_open_db_sessions_exits_cleanly(tmp_path: Path) -> None:
    """A db replica playing 1,200 live episodes at once (SQLite sessions opening, running and closing on its
    threads) is SIGTERMed mid-traffic: it closes every open session and exits 0 inside the stop watchdog's
    grace. Before the bounded pool such a replica crashed (SIGSEGV) or hung with hundreds of threads."""
    live = 1200
    with EmbeddedNats(tmp_path / "nats") as url:
        cfg = JetRLConfig()
        cfg.nats.url, cfg.nats.prefix = url, "tsig"
        cfg.env.max_sessions, cfg.env.num_train_tasks = live + 64, 16
        save_config(cfg, tmp_path / "env.toml")
        log_path = tmp_path / "env.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen([sys.executable, "-m", "services.envs", "db", "--config", str(tmp_path / "env.toml")],
                                    cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        try:
            async def play_then_stop() -> tuple[int, int, float]:
                nc = await connect(cfg.nats, "pytest-sigterm")
                subjects = Subjects(cfg.nats.prefix)
                await declare_topology(nc.jetstream(), subjects, cfg.nats)
                client = EnvClient(nc, subjects, "db", timeout_s=60.0)
                deadline = time.monotonic() + 120
                while True:
                    try:
                        ids = await client.task_ids("train")
                        break
                    except Exception:
                        assert time.monotonic() < deadline, "the env replica did not come up"
                        await asyncio.sleep(0.5)

                async def player(i: int) -> None:
                    for n in itertools.count():
                        opened = await client.start(f"p{i}-{n}", ids[(i + n) % len(ids)])
                        for turn in range(opened.max_turns):
                            action = await client.oracle(opened.replica_id, f"p{i}-{n}")
                            if (await client.interact(opened.replica_id, f"p{i}-{n}", action, turn=turn)).finish:
                                break

                players = [asyncio.create_task(player(i)) for i in range(live)]
                while (health := await client.health()).sessions_started < 2 * live:  # all live, some replaced
                    assert not any(p.done() for p in players), [p.exception() for p in players if p.done()][:1]
                    await asyncio.sleep(0.5)
                proc.terminate()
                started = time.monotonic()
                code = await asyncio.to_thread(proc.wait, 30)
                for p in players:
                    p.cancel()
                await asyncio.gather(*players, return_exceptions=True)
                await nc.close()
                return code, health.sessions, time.monotonic() - started

            code, open_sessions, stop_s = asyncio.run(play_then_stop())
        finally:
            stop_processes([proc])
    text = log_path.read_text()
    assert code == 0, text[-3000:]
    assert stop_s < 8.0  # closed by the host, not forced by the watchdog (exit code 143)
    assert open_sessions > live // 2 and "env_host_stopped" in text and "sessions_closed=" in text


@pytest.fixture
def restartable(tmp_path: Path) -> Any:
    server = EmbeddedNats(tmp_path / "nats")
    url = server.start()
    server.port = int(url.rsplit(":", 1)[1])  # a restart comes back on the same port, with the same store
    yield server
    server.stop()


async def test_a_job_ack_is_retried_across_a_server_restart_and_never_raises(restartable) -> None:
    cfg = JetRLConfig()
    cfg.nats.url, cfg.nats.prefix = restartable.url, "tack"
    subjects = Subjects(cfg.nats.prefix)
    nc = await connect(cfg.nats, "pytest-ack")
    js = nc.jetstream()
    await declare_topology(js, subjects, cfg.nats)
    for episode_id in ("e1", "e2"):
        await js.publish(subjects.jobs("db"), encode(EpisodeJob(
            episode_id=episode_id, group_id="g1", task="db", task_id="train-00000", split="train", group_size=2,
            temperature=1.0, max_new_tokens=8)))
    sub = await js.pull_subscribe(subjects.jobs(">"), durable=subjects.rollout_consumer, stream=subjects.jobs_stream,
                                  config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, ack_wait=600,
                                                        deliver_policy=DeliverPolicy.ALL))
    msg, other = await sub.fetch(2, timeout=5)
    acks = Acker("job_ack", timeout_s=0.5, retry_s=60.0)
    restartable.stop()  # the server goes away before the ack: its first tries get no confirmation
    acked = acks.ack(msg, episode_id="e1")
    await asyncio.sleep(1.5)
    assert not acked.done()
    restartable.start()
    assert await asyncio.wait_for(acked, 60) is True
    assert acks.retries >= 1 and acks.acked == 1
    info = await js.consumer_info(subjects.jobs_stream, subjects.rollout_consumer)
    assert info.num_ack_pending == 1 and info.num_pending == 0  # e2's, fetched and not acked yet
    assert (await js.stream_info(subjects.jobs_stream)).state.messages == 1  # a work queue drops what is acked
    # acking it again (a retry whose first try did land) is confirmed too, not raised
    assert await acks.ack(msg, episode_id="e1") is True
    await nc.close()
    # a connection closed for good: the ack gives up and says so, nothing is raised
    assert await acks.ack(other, episode_id="e2") is False
    assert acks.given_up == 1
    await acks.drain()
