"""Fault suite, bounds: one bad message or one lost supervisor never stops a run. ``make test-faults``.

* Under ``jetrl up`` (per-role users), a client with the rollout's credentials publishes msgpack nested
  1,000 deep on every subject a rollout may publish on, and then a 60,000-token trajectory: the run keeps
  training, no service dies, the long trajectory is dead-lettered within seconds (never trained on), and
  no valid message is dead-lettered.
* ``kill -9`` of ``jetrl up``: its nats-server goes with it (and every service); ``jetrl up --resume``
  continues the run on the same store, and a second ``--resume`` while it runs is refused in one line.

The figures are in docs/benchmarks/faults.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared.bus import connect
from shared.config import NatsConfig, save_config
from shared.envapi import EnvClient
from shared.messages import BadMessage, DeadLetter, Trajectory, TurnInfo, decode, encode
from shared.subjects import Subjects
from tests.procs import log_tails
from tests.system.test_faults import REPO, children, cmdline, fault_config, steps_done, stream_messages

pytestmark = pytest.mark.faults

NESTED = b"\x91" * 1000 + b"\x00"  # 1,001 bytes that once made msgspec raise RecursionError


def start_up(run_dir: Path, cfg_path: Path, *extra: str) -> subprocess.Popen[bytes]:
    out = open(run_dir.parent / f"up{len(list(run_dir.parent.glob('up*.out')))}.out", "w")
    return subprocess.Popen([sys.executable, "-m", "jetrl.cli", "up", "--config", str(cfg_path), *extra],
                            cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))


def wait_for(condition, timeout_s: float, what: str, run_dir: Path, up: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        ended = up is not None and up.poll() is not None
        if ended or time.monotonic() > deadline:
            outs = "\n".join(p.read_text()[-3000:] for p in sorted(run_dir.parent.glob("up*.out")))
            pytest.fail(f"{what}{' (jetrl up ended)' if ended else ''}\n{outs}\n{log_tails(run_dir)}")
        time.sleep(0.2)


def long_trajectory(tokens: int) -> bytes:
    return encode(Trajectory(episode_id="long-0", group_id="long", task="db", task_id="t", split="train",
                             group_size=1, tokens=[1] * tokens, logprobs=[0.0] * 2 + [-0.1] * (tokens - 2),
                             loss_mask=[0] * 2 + [1] * (tokens - 2), prompt_len=2,
                             turns=[TurnInfo(start=2, end=tokens, engine_id="x", policy_version=0)], reward=1.0,
                             status="completed", replica_id="rollout-forged"))


def test_nested_messages_on_every_rollout_subject_and_a_60k_token_trajectory_leave_the_run_training(
        tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = fault_config(run_dir, steps=10_000)  # trains until stopped
    cfg_path = tmp_path / "bounds.toml"
    save_config(cfg, cfg_path)
    up = start_up(run_dir, cfg_path, "--rollouts", "1")
    figures: dict[str, object] = {}
    try:
        wait_for(lambda: steps_done(run_dir) >= 2, 240, "no training step", run_dir, up)
        url = (run_dir / "nats.url").read_text().split()[0]
        subjects = Subjects(cfg.nats.prefix)

        async def attack() -> dict[str, object]:
            nats_cfg = NatsConfig(url=url, prefix=cfg.nats.prefix, auth_dir=str(run_dir / "nats" / "auth"))
            nc = await connect(nats_cfg, "forger", role="rollout")
            js = nc.jetstream()
            replica = (await EnvClient(nc, subjects, "db", timeout_s=10.0).health()).replica_id
            # every subject a rollout may publish on (shared/auth.py), each with the nested message
            published = [subjects.action("db", "forged-0"), subjects.observation("db", "forged-0"), subjects.traj("db"),
                         subjects.dead_letter("rollout"), subjects.registry_entries("rollout", "forged-0")]
            for subject in published:  # stored: each PubAck awaited
                await js.publish(subject, NESTED)
            await nc.publish(subjects.metrics("rollout"), NESTED)  # a core subject: the controller and jetrl up read it
            published.append(subjects.metrics("rollout"))
            requested = [subjects.env_start("db"), subjects.env_tasks("db"), subjects.env_health("db"),
                         subjects.env_interact("db", replica), subjects.env_cancel("db", replica),
                         subjects.env_oracle("db", replica), subjects.gen_pool()]
            codes = {}
            for subject in requested:
                try:
                    reply = await nc.request(subject, NESTED, timeout=10.0)
                    codes[subject.removeprefix(subjects.prefix + ".")] = (reply.headers or {}).get(
                        "Nats-Service-Error-Code", "ok")
                except Exception as exc:  # no responder (no pool on this run): said, not hidden
                    codes[subject.removeprefix(subjects.prefix + ".")] = type(exc).__name__
            admin = await connect(nats_cfg, "audit", role="admin")  # reads the DLQ (a rollout may not)
            letters = await admin.jetstream().subscribe(subjects.dead_letter("trainer"), ordered_consumer=True)
            sent = time.monotonic()
            await js.publish(subjects.traj("db"), long_trajectory(60_000), headers={"Nats-Msg-Id": "long-0"})
            long_s = None
            while long_s is None and time.monotonic() - sent < 60:
                letter = decode((await letters.next_msg(timeout=60)).data, DeadLetter)
                if "60000 tokens" in letter.reason:
                    long_s = round(time.monotonic() - sent, 2)
            await admin.close()
            await nc.close()
            return {"replies": codes, "long_dead_lettered_s": long_s, "subjects": len(published) + len(requested)}

        figures.update(asyncio.run(attack()))
        assert figures["long_dead_lettered_s"] is not None and figures["long_dead_lettered_s"] < 30, figures
        # every request is answered 400 with the reason, but health's (it reads no body: its answer is the health)
        assert all(code == ("ok" if s.endswith(".health") else "400") for s, code in figures["replies"].items()
                   if not s.startswith("gen.")), figures
        after = steps_done(run_dir)
        wait_for(lambda: steps_done(run_dir) >= after + 2, 240, "training stopped after the attack", run_dir, up)
        assert up.poll() is None
        restarts = json.loads((run_dir / "restarts.json").read_text()) if (run_dir / "restarts.json").exists() else {}
        assert restarts == {}, restarts

        async def audit() -> list[DeadLetter]:
            nats_cfg = NatsConfig(url=url, prefix=cfg.nats.prefix, auth_dir=str(run_dir / "nats" / "auth"))
            nc = await connect(nats_cfg, "audit", role="admin")
            out = []
            for data in await stream_messages(nc, subjects.dlq_stream, subjects.dead_letter(">")):
                try:
                    out.append(decode(data, DeadLetter))
                except BadMessage:  # the forger's own nested "letter" on dlq.rollout
                    assert data == NESTED
            await nc.close()
            return out

        dlq = asyncio.run(audit())
        sent_payloads = {NESTED, long_trajectory(60_000)[:64 * 1024]}
        valid = [d for d in dlq if d.payload not in sent_payloads and d.service != "rollout"]
        assert valid == [], [(d.service, d.reason[:200]) for d in valid]  # nothing valid was dead-lettered
        figures.update(steps_before_and_after=[after, steps_done(run_dir)], dead_letters=len(dlq),
                       by_service={s: sum(d.service == s for d in dlq) for s in sorted({d.service for d in dlq})})
        print(json.dumps(figures))
        (tmp_path.parent / "faults-bounds.json").write_text(json.dumps(figures))
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            up.wait(timeout=120)


def test_kill_9_of_jetrl_up_takes_its_nats_server_and_resume_continues_alone(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = fault_config(run_dir, steps=10_000)
    cfg_path = tmp_path / "resume.toml"
    save_config(cfg, cfg_path)
    up = start_up(run_dir, cfg_path, "--rollouts", "1")
    figures: dict[str, object] = {}
    try:
        wait_for(lambda: steps_done(run_dir) >= 1, 240, "no training step", run_dir, up)
        kids = children(up.pid)
        server = next(p for p in kids if "nats-server" in cmdline(p))
        killed_at = time.monotonic()
        up.send_signal(signal.SIGKILL)
        up.wait()

        def gone(pid: int) -> bool:
            try:
                return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
            except OSError:
                return True

        wait_for(lambda: all(gone(p) for p in kids), 30, "a child outlived jetrl up", run_dir)
        figures["children_gone_s"] = round(time.monotonic() - killed_at, 2)
        before = steps_done(run_dir)
        resumed = start_up(run_dir, cfg_path, "--rollouts", "1", "--resume")
        try:
            wait_for(lambda: steps_done(run_dir) >= before + 1, 240, "the resumed run did not train", run_dir, resumed)
            second = subprocess.run([sys.executable, "-m", "jetrl.cli", "up", "--config", str(cfg_path), "--resume"],
                                    cwd=REPO, capture_output=True, text=True, timeout=120)
            lines = second.stderr.strip().splitlines()
            assert second.returncode == 2 and len(lines) == 1, second.stderr
            assert "is in use by another nats-server or jetrl up" in lines[0], lines
            figures.update(steps_before_kill=before, resumed_to=steps_done(run_dir), second_refused=lines[0],
                           nats_server_pid_gone=gone(server))
            assert resumed.poll() is None
        finally:
            resumed.send_signal(signal.SIGINT)
            resumed.wait(timeout=120)
        print(json.dumps(figures))
        (tmp_path.parent / "faults-resume.json").write_text(json.dumps(figures))
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
