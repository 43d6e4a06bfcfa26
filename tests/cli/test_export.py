"""`jetrl export`: trajectories from a real nats-server into Parquet and JSONL in the chat format, read
back by pandas and by Hugging Face `datasets`; filters; a finished run's store opened again with its
own users; memory that does not grow with the export's size."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from jetrl.export import TrajectoryFilter, export
from jetrl.streams import RunAccess
from shared.auth import generate_passwords, server_authorization
from shared.bus import connect, declare_topology
from shared.config import JetRLConfig, save_config
from shared.messages import Trajectory, TurnInfo, encode
from shared.natsd import EmbeddedNats
from shared.subjects import Subjects

REPO = Path(__file__).resolve().parents[2]
TOOLS = [{"type": "function", "function": {"name": "execute_sql", "description": "Run SQL",
                                           "parameters": {"type": "object", "properties": {"sql": {"type": "string"}},
                                                          "required": ["sql"]}}}]


def episode(i: int, task: str = "db", reward: float = 1.0, status: str = "completed", version: int = 3,
            split: str = "train", tokens: int = 40) -> Trajectory:
    """A two-turn episode: a tool call and its result, then the answer."""
    call = {"id": "call_0", "type": "function", "function": {"name": "execute_sql", "arguments": '{"sql": "SELECT 1"}'}}
    messages = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": f"question {i}"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0", "content": "[(1,)]"},
                {"role": "assistant", "content": "", "invalid_tool_call": "not JSON"},
                {"role": "tool", "tool_call_id": "call_0", "content": "Error: malformed"}]
    half = tokens // 2
    return Trajectory(episode_id=f"{task}-e{i}", group_id=f"g{i // 2}", task=task, task_id=f"t{i}", split=split,
                      group_size=2, tokens=list(range(tokens)), logprobs=[-0.5] * tokens, loss_mask=[0] * half + [1] * half,
                      prompt_len=half, reward=reward, status=status, replica_id="r",
                      turns=[TurnInfo(start=half, end=half + 2, engine_id="rollout-a", policy_version=version),
                             TurnInfo(start=half + 2, end=tokens, engine_id="oracle", policy_version=version + 1)],
                      metrics={"turns": 2.0}, messages=messages, tools=TOOLS)


async def publish(cfg: JetRLConfig, trajs: list[Trajectory], role: str | None = None) -> None:
    nc = await connect(cfg.nats, "pytest-publisher", role=role)
    js = nc.jetstream()
    subjects = Subjects(cfg.nats.prefix)
    await declare_topology(js, subjects, cfg.nats, role=role)
    for start in range(0, len(trajs), 200):  # pipelined: a batch of publishes, then their acks
        acks = [js.publish(subjects.traj(t.task), encode(t), headers={"Nats-Msg-Id": t.episode_id})
                for t in trajs[start:start + 200]]
        await asyncio.gather(*acks)
    await nc.close()


async def test_export_writes_chat_rows_that_pandas_and_datasets_read(nc, config, tmp_path) -> None:
    import datasets
    import pandas as pd

    trajs = [episode(0), episode(1, reward=0.0, status="task_limit_reached"), episode(2, task="kg", version=7),
             episode(3, split="test"), episode(4, version=0)]
    await publish(config, trajs)
    access = RunAccess(config.nats.url, config.nats)
    everything = await export(access, tmp_path / "all.parquet", "parquet", TrajectoryFilter(), progress=False)
    assert (everything.read, everything.written) == (5, 5)

    frame = pd.read_parquet(tmp_path / "all.parquet")
    assert list(frame["episode_id"]) == [t.episode_id for t in trajs]  # the stream's order
    ds = datasets.load_dataset("parquet", data_files=str(tmp_path / "all.parquet"), split="train")
    row = ds[0]
    assert row["task"] == "db" and row["task_id"] == "t0" and row["reward"] == 1.0 and row["status"] == "completed"
    assert json.loads(row["tools"]) == TOOLS
    system, user, first, result, second, _ = row["messages"]
    assert (system["role"], user["content"]) == ("system", "question 0")
    assert first["tool_calls"] == [{"id": "call_0", "type": "function",
                                    "function": {"name": "execute_sql", "arguments": '{"sql": "SELECT 1"}'}}]
    assert (first["engine_id"], first["policy_version"]) == ("rollout-a", 3)  # per turn
    assert (second["engine_id"], second["policy_version"]) == ("oracle", 4)
    assert second["tool_calls"] is None and "invalid_tool_call" not in second  # only the API's keys
    assert result == {"role": "tool", "content": "[(1,)]", "tool_calls": None, "tool_call_id": "call_0",
                      "name": None, "engine_id": None, "policy_version": None}
    assert "tokens" not in ds.column_names

    # filters: task, split, status, reward, policy version; JSONL with tokens
    keep = TrajectoryFilter(tasks=["db"], splits=["train"], statuses=["completed"], min_reward=1.0, min_policy_version=3)
    kept = await export(access, tmp_path / "good.jsonl", "jsonl", keep, tokens=True, progress=False)
    lines = [json.loads(x) for x in (tmp_path / "good.jsonl").read_text().splitlines()]
    assert kept.written == 1 and [x["episode_id"] for x in lines] == ["db-e0"]
    assert lines[0]["tools"] == TOOLS and lines[0]["tokens"] == list(range(40)) and lines[0]["loss_mask"][-1] == 1
    assert lines[0]["turns"][0] == {"start": 20, "end": 22, "engine_id": "rollout-a", "policy_version": 3}
    assert "engine_id" not in lines[0]["messages"][1]  # JSONL leaves absent keys out
    ds = datasets.load_dataset("json", data_files=str(tmp_path / "good.jsonl"), split="train")
    assert ds[0]["messages"][2]["tool_calls"][0]["function"]["name"] == "execute_sql"
    newest = await export(access, tmp_path / "v7.parquet", "parquet", TrajectoryFilter(min_policy_version=5),
                          progress=False)
    assert newest.written == 1 and list(pd.read_parquet(tmp_path / "v7.parquet")["task"]) == ["kg"]
    only_kg = await export(access, tmp_path / "kg.parquet", "parquet", TrajectoryFilter(tasks=["kg"]))  # with a bar
    assert (only_kg.read, only_kg.written) == (1, 1)  # the task filter is the consumer's: other tasks are not read


def test_export_of_a_finished_run_reopens_its_store_with_its_users(tmp_path: Path) -> None:
    """The run is over (its nats-server gone): `jetrl export --run-dir` starts one on the run's store with
    the run's users and reads as the observer; the file lists every trajectory."""
    run_dir = tmp_path / "run"
    auth_dir = run_dir / "nats" / "auth"
    cfg = JetRLConfig()
    cfg.nats.prefix, cfg.nats.auth_dir, cfg.run.dir = "finished", str(auth_dir), str(run_dir)
    server = EmbeddedNats(run_dir / "nats", authorization=server_authorization(Subjects("finished"),
                                                                                generate_passwords(auth_dir)))
    cfg.nats.url = server.start()
    try:
        asyncio.run(publish(cfg, [episode(i) for i in range(7)], role="admin"))
    finally:
        server.stop()
    save_config(cfg, run_dir / "config.toml")
    (run_dir / "nats.url").write_text(f"{cfg.nats.url}\nfinished\n")
    out = tmp_path / "run.parquet"
    proc = subprocess.run([sys.executable, "-m", "jetrl.cli", "export", "--run-dir", str(run_dir), "-o", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "jetrl export: 7 of 7 trajectories" in proc.stderr
    import pandas as pd

    assert len(pd.read_parquet(out)) == 7


PEAK = ("import sys\nfrom jetrl.cli import main\nrc = main(sys.argv[1:])\n"
        "print(next(x for x in open('/proc/self/status') if x.startswith('VmHWM')).split()[1])\nsys.exit(rc)")
"""`jetrl` that prints its peak resident memory (kB) on exit: VmHWM starts afresh at exec, so the pytest
process it was forked from does not count (a child's ru_maxrss would include it)."""


def _export_peak_mb(url: str, prefix: str, out: Path, *flags: str) -> float:
    proc = subprocess.run([sys.executable, "-c", PEAK, "export", "--url", url, "--prefix", prefix, "-o", str(out),
                           "--no-progress", *flags], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return int(proc.stdout.split()[-1]) / 1024


@pytest.mark.timeout(240)
def test_export_memory_does_not_grow_with_the_number_of_trajectories(config, tmp_path) -> None:
    """Exporting 300 trajectories of 8k tokens with their tokens (about 30 MB of messages) takes no more
    memory than exporting 100 of them: rows go to the file a row group (about 80 of these) at a time.
    docs/data.md has the figures for 100k small ones."""
    small_prefix, big_prefix = config.nats.prefix + "s", config.nats.prefix + "b"
    for prefix, count in ((small_prefix, 100), (big_prefix, 300)):
        cfg = JetRLConfig()
        cfg.nats.url, cfg.nats.prefix = config.nats.url, prefix
        asyncio.run(publish(cfg, [episode(i, tokens=8_000) for i in range(count)]))
    small = _export_peak_mb(config.nats.url, small_prefix, tmp_path / "small.parquet", "--tokens")
    big = _export_peak_mb(config.nats.url, big_prefix, tmp_path / "big.parquet", "--tokens")
    assert big < small + 30, f"peak {big:.0f} MB for 300 trajectories against {small:.0f} MB for 100"
    import pyarrow.parquet as pq

    assert pq.ParquetFile(tmp_path / "big.parquet").metadata.num_rows == 300

    async def cleanup() -> None:
        client = await connect(config.nats, "pytest-cleanup")
        for prefix in (small_prefix, big_prefix):
            for name in await client.jetstream().streams_info():
                if name.config.name.startswith(prefix.upper() + "_"):
                    await client.jetstream().delete_stream(name.config.name)
        await client.close()

    asyncio.run(cleanup())
