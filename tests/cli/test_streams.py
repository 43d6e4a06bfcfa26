"""`jetrl.streams` on a real nats-server: task filters, resume from a stored sequence, only new ones, a
poison message skipped, a reader that carries on across a server restart; the two example tools on it."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path

from jetrl.streams import subscribe
from shared.bus import connect, declare_topology
from shared.config import JetRLConfig
from shared.delivery import publish_retrying
from shared.messages import Trajectory, TurnInfo, encode
from shared.natsd import EmbeddedNats
from shared.subjects import Subjects

REPO = Path(__file__).resolve().parents[2]


def traj(i: int, task: str = "db", reward: float = 1.0, status: str = "completed", answer: str | None = None,
         tool_call: bool = True, turns: int = 1, task_id: str | None = None) -> Trajectory:
    content = answer if answer is not None else f"answer {i}"
    call = [{"id": "call_0", "type": "function", "function": {"name": "commit_final_answer",
                                                              "arguments": f'{{"answer": "{content}"}}'}}]
    last = {"role": "assistant", "content": "" if tool_call else content, **({"tool_calls": call} if tool_call else {})}
    return Trajectory(episode_id=f"{task}-{i}", group_id="g", task=task, task_id=task_id or f"t{i}", split="train",
                      group_size=1, tokens=[1, 2, 3], logprobs=[0.0, -0.1, -0.2], loss_mask=[0, 1, 1], prompt_len=1,
                      turns=[TurnInfo(start=1, end=3, engine_id="e", policy_version=i)] * turns, reward=reward,
                      status=status, replica_id="r", messages=[{"role": "user", "content": "q"}, last])


async def publish(nc, subjects: Subjects, trajs: list[Trajectory]) -> None:
    js = nc.jetstream()
    for t in trajs:  # retried: right after a server restart JetStream takes a moment to answer
        await publish_retrying(js, subjects.traj(t.task), encode(t), headers={"Nats-Msg-Id": t.episode_id})


async def read(stream, n: int | None = None) -> list[str]:
    out = []
    async for t in stream:
        out.append(t.episode_id)
        if n is not None and len(out) == n:
            break
    return out


async def test_filters_resume_new_only_and_a_poison_message(nc, config, subjects) -> None:
    await publish(nc, subjects, [traj(i, task="kg" if i % 3 == 0 else "db") for i in range(9)])
    await nc.jetstream().publish(subjects.traj("db"), b"\xc1 not msgpack")  # a poison message, skipped
    async with subscribe(config.nats.url, config.nats, tasks=["kg"], follow=False) as only_kg:
        assert await read(only_kg) == ["kg-0", "kg-3", "kg-6"]
    async with subscribe(config.nats.url, config.nats, follow=True) as first:
        head = await read(first, 4)
        position = first.position
    assert head == ["kg-0", "db-1", "db-2", "kg-3"] and position is not None and position.sequence == 4
    async with subscribe(config.nats.url, config.nats, start_sequence=position.sequence + 1, follow=False) as rest:
        tail = await read(rest)
        assert rest.bad == 1 and rest.pending == 0
    assert head + tail == [t for t in (f"{'kg' if i % 3 == 0 else 'db'}-{i}" for i in range(9))]
    async with subscribe(config.nats.url, config.nats, from_start=False) as new_only:
        reader = asyncio.create_task(read(new_only, 1))
        await asyncio.sleep(1.0)
        await publish(nc, subjects, [traj(9)])
        assert await asyncio.wait_for(reader, 10) == ["db-9"]


async def test_a_reader_carries_on_across_a_server_restart(tmp_path: Path) -> None:
    server = EmbeddedNats(tmp_path / "nats")
    cfg = JetRLConfig()
    cfg.nats.url, cfg.nats.prefix = server.start(), "restart"
    subjects = Subjects("restart")
    nc = await connect(cfg.nats, "pytest-publisher")
    await declare_topology(nc.jetstream(), subjects, cfg.nats)
    await publish(nc, subjects, [traj(i) for i in range(10)])
    seen: list[str] = []
    stream = subscribe(cfg.nats.url, cfg.nats, batch=4)
    try:
        async with stream:
            async for t in stream:
                seen.append(t.episode_id)
                if len(seen) == 6:  # the server goes away mid-read and comes back on the same port and store
                    server.stop()
                    server.port = int(cfg.nats.url.rsplit(":", 1)[1])
                    server.start()
                    for _ in range(100):
                        if nc.is_connected:
                            break
                        await asyncio.sleep(0.2)
                    await publish(nc, subjects, [traj(i) for i in range(10, 15)])
                if len(seen) == 15:
                    break
        assert seen == [f"db-{i}" for i in range(15)]  # nothing lost, nothing twice, in order
        assert stream.reconnects >= 1
    finally:
        await nc.close()
        server.stop()


def _example(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "examples" / "stream_tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


async def test_the_leaderboard_and_the_monitor_on_a_stream(nc, config, subjects, capsys) -> None:
    episodes = [traj(0, reward=1.0), traj(1, reward=0.0), traj(2, task="kg", reward=1.0),
                traj(3, reward=1.0, tool_call=False),                              # a reward without a tool call
                traj(4, reward=1.0, status="task_limit_reached"),                  # a success at the turn limit
                *(traj(5 + k, task="os", answer="42") for k in range(4))]          # one answer, four tasks
    await publish(nc, subjects, episodes)
    leaderboard, monitor = _example("leaderboard"), _example("monitor")
    board = await leaderboard.run(config.nats.url, config.nats, recent=2, every_s=1e9, follow=False)
    rows = {r["task"]: r for r in board.table()}
    assert rows["db"]["episodes"] == 4 and rows["db"]["success"] == 0.75 and rows["db"]["recent_success"] == 1.0
    assert rows["os"]["policy_version"] == 8 and rows["kg"]["success"] == 1.0
    assert "db" in capsys.readouterr().out
    flags = await monitor.run(config.nats.url, config.nats, monitor.Monitor(same_answer_tasks=3), follow=False,
                              as_json=True)
    assert sorted((f.check, f.episode_id) for f in flags) == [
        ("reward_without_tool_call", "db-3"), ("same_answer_across_tasks", "os-8"),
        ("success_at_turn_limit", "db-4")]
