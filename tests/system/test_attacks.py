"""Every road an attacker took against a live run, tried again all through a `jetrl up` run (its embedded
nats-server, one user per role and per replica, signed control messages), each asserted refused while the
run goes on training and ends on the trainer's own word (``make test-faults``). The roads, one role's
credentials at a time:

- the observer rewriting the trainer's durable (the bare ``CONSUMER.CREATE.<stream>``: a filter nothing
  publishes on starves it, ``max_ack_pending = 1`` makes it crawl);
- a rollout replica making the server deliver bytes of its own (its registry key holding a forged
  ``TrainingFinished``) onto ``trainer.finished``, through a push consumer or a direct get;
- one rollout replica reading another's inbox (its replies, its consumers' deliveries);
- status from anyone: a rollout's report claiming to be the supervisor's, a heartbeat claiming a trainer;
- and, past every permission (the admin's credentials, which an operator must protect), an unsigned
  announcement of version 10^6 in the policy KV and an unsigned ``TrainingFinished``: refused by signature.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nats
import pytest

from shared.auth import inbox_prefix
from shared.config import save_config
from shared.messages import Heartbeat, MetricsReport, TrainingFinished, WeightsAnnouncement, encode
from shared.subjects import Subjects
from tests.system.test_faults import fault_config, log_tails, steps_done

REPO = Path(__file__).resolve().parents[2]
HUGE = 10**6
pytestmark = pytest.mark.faults


async def as_user(url: str, auth_dir: Path, user: str, refused: list[str]) -> nats.aio.client.Client:
    async def on_error(exc: Exception) -> None:
        refused.append(str(exc))

    return await nats.connect(url, user=user, password=(auth_dir / f"{user}.password").read_text().strip(),
                              inbox_prefix=inbox_prefix(user), allow_reconnect=False, connect_timeout=3,
                              error_cb=on_error, name=f"attacker-{user}")


async def refused_request(client: nats.aio.client.Client, subject: str, body: dict) -> bool:
    try:
        await client.request(subject, json.dumps(body).encode(), timeout=0.5)
    except nats.errors.TimeoutError:
        return True
    return False


def status(run_dir: Path) -> dict:
    url = (run_dir / "controller.url").read_text().strip()
    token = (run_dir / "controller.token").read_text().strip()
    request = urllib.request.Request(f"{url}/status", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=5) as resp:
        return json.load(resp)


async def attack(run_dir: Path, url: str, s: Subjects) -> dict[str, object]:
    auth = run_dir / "nats" / "auth"
    refused: list[str] = []
    found: dict[str, object] = {}
    observer = await as_user(url, auth, "observer", refused)
    starve = {"stream_name": s.traj_stream, "config": {"name": s.trainer_consumer, "ack_policy": "explicit",
                                                        "filter_subject": f"{s.prefix}.nothing", "max_ack_pending": 1}}
    found["durable rewrite refused"] = await refused_request(observer, f"$JS.API.CONSUMER.CREATE.{s.traj_stream}",
                                                             starve)
    thief = await as_user(url, auth, "rollout-1", refused)
    forged = encode(TrainingFinished(step=HUGE, policy_version=HUGE, replica_id="trainer-forged"))
    key = s.registry_entries("rollout", "rollout-1")
    await thief.jetstream(timeout=2).publish(key, forged)  # its own key: allowed, and a forgery inside
    registry = f"KV_{s.registry_kv}"
    push = {"stream_name": registry, "config": {"name": "x", "ack_policy": "none", "deliver_subject": s.training_finished}}
    found["push delivery refused"] = all([
        await refused_request(thief, f"$JS.API.CONSUMER.CREATE.{registry}", push),
        await refused_request(thief, f"$JS.API.CONSUMER.CREATE.{registry}.x.>", push)])
    await thief.publish(f"$JS.API.DIRECT.GET.{registry}.{key}", b"", reply=s.training_finished)
    await thief.subscribe(f"{inbox_prefix('rollout-0')}.>")  # the other replica's replies
    await thief.publish(s.metrics("rollout"), encode(MetricsReport(
        role="supervisor", replica_id="jetrl-up", step=1, values={"restarts/trainer": 999.0, "restarts/total": 999.0})))
    fake = Heartbeat(role="trainer", replica_id="rollout-1", pid=1, host="h", started_at=0.0, info={})
    await thief.jetstream(timeout=2).publish(key, encode(fake))
    admin = await as_user(url, auth, "admin", refused)  # past every permission: only signatures stand
    kv = await admin.jetstream().key_value(s.policy_kv)
    await kv.put(s.policy_version_key, encode(WeightsAnnouncement(
        version=HUGE, object_name=s.weights_object(1), digest="0" * 64, size=4, dtype="float32")))
    await admin.publish(s.training_finished, forged)
    await admin.publish(s.weights_published, encode(WeightsAnnouncement(
        version=HUGE, object_name="x", digest="0" * 64, size=1, dtype="float32")))
    await asyncio.sleep(3.0)  # heartbeats, polls and the controller's counters catch up
    found["violations"] = [e for e in refused if "permissions violation" in e.lower()]
    for client in (observer, thief, admin):
        await client.close()
    return found


def test_every_road_is_refused_while_the_run_trains_on(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = fault_config(run_dir, steps=4)
    cfg_path = tmp_path / "attacks.toml"
    save_config(cfg, cfg_path)
    up = subprocess.Popen([sys.executable, "-m", "jetrl.cli", "up", "--config", str(cfg_path), "--rollouts", "2"],
                          cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 400
        while steps_done(run_dir) < 1:  # the run trains before the attack
            assert time.monotonic() < deadline and up.poll() is None, log_tails(run_dir)
            time.sleep(1.0)
        s = Subjects(cfg.nats.prefix)
        before = status(run_dir)
        found = asyncio.run(attack(run_dir, (run_dir / "nats.url").read_text().split()[0], s))
        during = status(run_dir)
        out, _ = up.communicate(timeout=400)
    finally:
        if up.poll() is None:
            up.terminate()
            up.wait(timeout=60)
    logs = {p.name: p.read_text() for p in sorted((run_dir / "logs").glob("*.log"))}
    assert up.returncode == 0, out + log_tails(run_dir)
    assert "training finished: 4 steps" in out  # the run went on to its end, on the trainer's word
    assert found["durable rewrite refused"] and found["push delivery refused"], found
    violations = " ".join(found["violations"]).lower()  # type: ignore[arg-type]
    assert f"$js.api.consumer.create.{s.traj_stream.lower()}" in violations
    assert f"{inbox_prefix('rollout-0')}.>".lower() in violations and "direct.get" in violations
    assert during["service_restarts"] == {} and during["refused_reports"] > before["refused_reports"]
    assert during["refused_signatures"] >= 2  # the forged TrainingFinished and announcement
    assert [(r["role"], r["replica_id"]) for r in during["replicas"] if r["replica_id"] == "rollout-1"] == \
        [("rollout", "rollout-1")]
    for rollout in ("rollout-0.log", "rollout-1.log"):
        assert f"policy_version={HUGE}" not in logs[rollout] and "unsigned_weights_refused" in logs[rollout]
    finished = [line for line in logs["controller.log"].splitlines() if "event='training_finished'" in line]
    assert len(finished) == 1 and "step=4" in finished[0], finished
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
