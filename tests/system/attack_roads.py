"""Every road an attacker took against a live run, as one function both runs call: tests/system/test_attacks.py
against `jetrl up` (its embedded nats-server, ``make test-faults``) and tests/system/test_compose_run.py against a
compose cluster (``make test-compose``). The roads, one user's credentials at a time (each NATS user its own inbox prefix):

- the observer rewriting the trainer's durable (the bare ``CONSUMER.CREATE.<stream>``: a filter nothing
  publishes on starves it, ``max_ack_pending = 1`` makes it crawl);
- a rollout replica making the server deliver bytes of its own (its registry key holding a forged
  ``TrainingFinished``) onto ``trainer.finished``, through a push consumer or a direct get;
- one rollout replica reading another's inbox (its replies, its consumers' deliveries);
- status from anyone: a rollout's report claiming to be the supervisor's, a heartbeat claiming a trainer;
- and, past every permission (the admin's credentials, which an operator must protect), an unsigned
  announcement of version 10^6 in the policy KV and an unsigned ``TrainingFinished``: refused by signature.

``check_refused`` asserts what a run shows of each refusal: the server's permission violations, the controller's
status (refused reports and signatures, the thief still a rollout), the rollouts' logs (the forged weights refused).
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field

import nats

from shared.auth import inbox_prefix
from shared.messages import Heartbeat, MetricsReport, TrainingFinished, WeightsAnnouncement, encode
from shared.subjects import Subjects

HUGE = 10**6


@dataclass
class Findings:
    """What the attacker saw: requests that got no answer (refused) and the server's errors to its clients."""

    durable_rewrite_refused: bool = False
    push_delivery_refused: bool = False
    errors: list[str] = field(default_factory=list)

    @property
    def violations(self) -> str:
        return " ".join(e for e in self.errors if "permissions violation" in e.lower()).lower()


async def as_user(url: str, user: str, password: str, findings: Findings) -> nats.aio.client.Client:
    async def on_error(exc: Exception) -> None:
        findings.errors.append(str(exc))

    return await nats.connect(url, user=user, password=password, inbox_prefix=inbox_prefix(user),
                              allow_reconnect=False, connect_timeout=3, error_cb=on_error, name=f"attacker-{user}")


async def refused_request(client: nats.aio.client.Client, subject: str, body: dict) -> bool:
    try:
        await client.request(subject, json.dumps(body).encode(), timeout=0.5)
    except nats.errors.TimeoutError:
        return True
    return False


async def attack(url: str, s: Subjects, password: Callable[[str], str], *, thief: str = "rollout-1",
                 victim: str = "rollout-0") -> Findings:
    """Every road, against the server at ``url`` with the users' passwords (``password(user)``): ``thief`` and
    ``victim`` are two live rollout replicas' users."""
    found = Findings()
    observer = await as_user(url, "observer", password("observer"), found)
    starve = {"stream_name": s.traj_stream, "config": {"name": s.trainer_consumer, "ack_policy": "explicit",
                                                        "filter_subject": f"{s.prefix}.nothing", "max_ack_pending": 1}}
    found.durable_rewrite_refused = await refused_request(observer, f"$JS.API.CONSUMER.CREATE.{s.traj_stream}",
                                                          starve)
    rollout = await as_user(url, thief, password(thief), found)
    forged = encode(TrainingFinished(step=HUGE, policy_version=HUGE, replica_id="trainer-forged"))
    key = s.registry_entries("rollout", thief)
    await rollout.jetstream(timeout=2).publish(key, forged)  # its own key: allowed, and a forgery inside
    registry = f"KV_{s.registry_kv}"
    push = {"stream_name": registry, "config": {"name": "x", "ack_policy": "none", "deliver_subject": s.training_finished}}
    found.push_delivery_refused = all([
        await refused_request(rollout, f"$JS.API.CONSUMER.CREATE.{registry}", push),
        await refused_request(rollout, f"$JS.API.CONSUMER.CREATE.{registry}.x.>", push)])
    await rollout.publish(f"$JS.API.DIRECT.GET.{registry}.{key}", b"", reply=s.training_finished)
    await rollout.subscribe(f"{inbox_prefix(victim)}.>")  # the other replica's replies
    await rollout.publish(s.metrics("rollout"), encode(MetricsReport(
        role="supervisor", replica_id="jetrl-up", step=1, values={"restarts/trainer": 999.0, "restarts/total": 999.0})))
    fake = Heartbeat(role="trainer", replica_id=thief, pid=1, host="h", started_at=0.0, info={})
    await rollout.jetstream(timeout=2).publish(key, encode(fake))
    admin = await as_user(url, "admin", password("admin"), found)  # past every permission: only signatures stand
    kv = await admin.jetstream().key_value(s.policy_kv)
    await kv.put(s.policy_version_key, encode(WeightsAnnouncement(
        version=HUGE, object_name=s.weights_object(1), digest="0" * 64, size=4, dtype="float32")))
    await admin.publish(s.training_finished, forged)
    await admin.publish(s.weights_published, encode(WeightsAnnouncement(
        version=HUGE, object_name="x", digest="0" * 64, size=1, dtype="float32")))
    await asyncio.sleep(3.0)  # heartbeats, polls and the controller's counters catch up
    for client in (observer, rollout, admin):
        await client.close()
    return found


FORGED_VERSION = re.compile(rf"policy_version\W{{1,4}}{HUGE}\b")  # key=value and JSON logs alike


def check_refused(found: Findings, s: Subjects, before: dict, during: dict, rollout_logs: dict[str, str], *,
                  thief: str = "rollout-1", victim: str = "rollout-0") -> None:
    """Each road refused: ``before`` and ``during`` are the controller's /status around ``attack``,
    ``rollout_logs`` every rollout replica's log (name -> text)."""
    assert found.durable_rewrite_refused and found.push_delivery_refused, found
    violations = found.violations
    assert f"$js.api.consumer.create.{s.traj_stream.lower()}" in violations, found.errors
    assert f"{inbox_prefix(victim)}.>".lower() in violations and "direct.get" in violations, found.errors
    assert during["service_restarts"] == {} and during["refused_reports"] > before["refused_reports"], during
    assert during["refused_signatures"] >= 2, during  # the forged TrainingFinished and announcement
    assert [(r["role"], r["replica_id"]) for r in during["replicas"] if r["replica_id"] == thief] == \
        [("rollout", thief)], during["replicas"]
    assert rollout_logs, "no rollout replica's log"
    for name, text in rollout_logs.items():
        assert not FORGED_VERSION.search(text) and "unsigned_weights_refused" in text, name
