"""Fault suite (issue 16): real processes, a real nats-server, real faults. ``make test-faults``.

* ``jetrl up`` with every service kind and the nats-server itself killed (SIGKILL) one after the other
  while it trains: the run reaches its last step; counted by episode id, no episode is lost (every job
  the controller published has its trajectory stored, or is still queued in JOBS for a later run) or
  stored twice, none ended ``env_error``, and every death was restarted and counted.
* >= 10,000 malformed messages over every subject a service consumes: no service crashes, and the
  run still trains afterwards.
* A schema-valid poison trajectory (a token id outside the vocabulary) is dead-lettered with the
  reason, and the trainer goes on.

The figures are in docs/benchmarks/faults.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import msgspec
import pytest

from shared.bus import connect
from shared.config import JetRLConfig, save_config
from shared.messages import DeadLetter, EpisodeJob, Trajectory, TurnInfo, decode, encode
from shared.natsd import EmbeddedNats
from shared.subjects import Subjects

pytestmark = pytest.mark.faults

REPO = Path(__file__).resolve().parent.parent


def fault_config(run_dir: Path, steps: int) -> JetRLConfig:
    """The db task on the tiny model, small groups, short redelivery times: a fault costs seconds."""
    cfg = JetRLConfig()
    cfg.run.dir = str(run_dir)
    cfg.nats.prefix = "faults"
    cfg.controller.tasks = {"db": 1.0}
    cfg.controller.group_size = 2
    cfg.controller.max_inflight = 6
    cfg.rollout.max_new_tokens = 12
    cfg.rollout.concurrency = 2
    cfg.rollout.job_ack_wait_s = 8.0
    cfg.rollout.env_timeout_s = 10.0
    cfg.env.num_train_tasks = 8
    cfg.env.num_test_tasks = 4
    cfg.env.invalid_action_ends_episode = True
    cfg.trainer.steps = steps
    cfg.trainer.min_groups = 1
    cfg.trainer.max_groups = 2
    cfg.trainer.lr = 1e-3
    cfg.trainer.ack_wait_s = 6.0
    cfg.supervisor.restart_backoff_s = 0.5
    return cfg


def children(pid: int) -> list[int]:
    """Direct children of a process (Linux /proc)."""
    out: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def steps_done(run_dir: Path) -> int:
    try:
        return max((json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()),
                   default=0)
    except (OSError, ValueError):
        return 0


async def stream_messages(nc, stream: str, subject: str) -> list[bytes]:
    """Every message of a stream subject (an ordered ephemeral read)."""
    js = nc.jetstream()
    info = await js.stream_info(stream)
    out: list[bytes] = []
    if not info.state.messages:
        return out
    sub = await js.subscribe(subject, ordered_consumer=True, stream=stream)
    try:
        while len(out) < info.state.messages:
            out.append((await sub.next_msg(timeout=5.0)).data)
    except Exception:
        pass
    await sub.unsubscribe()
    return out


async def account(run_dir: Path, prefix: str) -> dict[str, object]:
    """Restart the run's own JetStream store and count, by episode id: jobs published (JOBS' last
    sequence: the controller publishes each job once, deduplicated by episode id), jobs still queued,
    trajectories stored, and dead letters."""
    subjects = Subjects(prefix)
    with EmbeddedNats(run_dir / "nats", log_file=run_dir / "nats" / "audit.log") as url:
        cfg = JetRLConfig()
        nc = await connect(cfg.nats, "audit", url=url)
        js = nc.jetstream()
        jobs_info = await js.stream_info(subjects.jobs_stream)
        queued = [decode(d, EpisodeJob).episode_id
                  for d in await stream_messages(nc, subjects.jobs_stream, subjects.jobs(">"))]
        raw_trajs = await stream_messages(nc, subjects.traj_stream, subjects.traj(">"))
        trajs = [decode(d, Trajectory) for d in raw_trajs]
        letters = [decode(d, DeadLetter) for d in await stream_messages(nc, subjects.dlq_stream,
                                                                         subjects.dead_letter(">"))]
        await nc.close()
    stored = [t.episode_id for t in trajs]
    published = int(jobs_info.state.last_seq)
    return {"published": published, "queued": len(queued), "stored": len(set(stored)),
            "stored_twice": len(stored) - len(set(stored)),
            "lost": published - len(set(stored) | set(queued)),
            "env_error": sum(t.status == "env_error" for t in trajs),
            "dead_letters": len(letters), "statuses": sorted({t.status for t in trajs})}


def test_every_service_and_nats_killed_under_jetrl_up_the_run_finishes_and_loses_nothing(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    steps = 9
    cfg = fault_config(run_dir, steps)
    cfg_path = tmp_path / "faults.toml"
    save_config(cfg, cfg_path)
    out = open(tmp_path / "up.out", "w")
    up = subprocess.Popen([sys.executable, "-m", "jetrl.cli", "up", "--config", str(cfg_path), "--rollouts", "2"],
                          cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    # one fault per step: (step reached, process to SIGKILL)
    plan = [(1, "services.envs"), (2, "services.rollout"), (3, "services.trainer"), (4, "services.controller"),
            (5, "nats-server")]
    killed: list[tuple[str, int, int, float]] = []
    started = time.monotonic()
    try:
        while plan and up.poll() is None and time.monotonic() - started < 900:
            step, target = plan[0]
            if steps_done(run_dir) >= step:
                victim = next((p for p in children(up.pid) if target in cmdline(p)), None)
                if victim is not None:
                    os.kill(victim, signal.SIGKILL)
                    killed.append((target, step, victim, round(time.monotonic() - started, 1)))
                    plan.pop(0)
            time.sleep(0.2)
        rc = up.wait(timeout=max(10, 900 - (time.monotonic() - started)))
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            up.wait(timeout=60)
        out.close()
    elapsed = time.monotonic() - started
    text = (tmp_path / "up.out").read_text()
    logs = "\n".join(f"--- {p.name}\n{p.read_text()[-2500:]}" for p in sorted((run_dir / "logs").glob("*.log")))
    assert rc == 0, f"{text}\n{logs}"
    assert [k[0] for k in killed] == ["services.envs", "services.rollout", "services.trainer",
                                      "services.controller", "nats-server"], text
    assert f"training finished: {steps} steps" in text
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert {r["step"] for r in rows} == set(range(1, steps + 1)), rows
    restarts = json.loads((run_dir / "restarts.json").read_text())
    assert {"env-db-0", "trainer", "controller", "nats-server"} <= set(restarts), restarts
    assert any(name.startswith("rollout-") for name in restarts), restarts

    books = asyncio.run(account(run_dir, cfg.nats.prefix))
    print(json.dumps({"killed": killed, "restarts": restarts, "seconds": round(elapsed, 1), **books}))
    (tmp_path.parent / "faults-kill.json").write_text(json.dumps({"killed": killed, "restarts": restarts,
                                                                  "seconds": round(elapsed, 1), **books}))
    assert books["stored_twice"] == 0
    assert books["lost"] == 0, books
    assert books["env_error"] == 0, books
    assert books["published"] >= 2 * steps
