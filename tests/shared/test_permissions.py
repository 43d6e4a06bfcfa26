"""No role acts past its permissions: each road an attacker holding one role's credentials took against a
live run, tried against a real nats-server with the real permissions (shared/auth.py), and refused.

- the observer rewriting a service's durable consumer (its filter, max_ack_pending, ...) through the bare
  ``CONSUMER.CREATE.<stream>``, whose body may name any consumer;
- a service role creating or updating its own durable (the admin makes them: shared/consumers.py);
- a role putting bytes of its own on a subject it may not publish, by reading back a stream it writes
  through a push consumer's deliver subject or a direct get's reply subject (nats-server sends stored
  messages there on the client's behalf, past its publish permissions);
- status from anyone: a metrics report or a heartbeat whose body names another role;
- one replica reading another's replies, or writing its registry key (one user per replica).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client

from services.controller.controller import Controller
from shared.auth import inbox_prefix
from shared.bus import connect, heartbeat_loop, publish_metrics, replica_name
from shared.config import JetRLConfig
from shared.messages import Heartbeat, MetricsReport, TrainingFinished, encode
from shared.subjects import Subjects
from tests.shared import test_auth
from tests.shared.test_auth import PREFIX, Errors, as_role, role_cfg

auth_server, admin = test_auth.auth_server, test_auth.admin  # the same authenticated server and topology

HUGE = 10**6
Auth = tuple[str, Path, Path]


async def api(client: Client, subject: str, body: dict | None = None, timeout: float = 0.25) -> dict | None:
    """One JetStream API request; None when the server refused it (a permission violation: no answer)."""
    try:
        reply = await client.request(subject, json.dumps(body or {}).encode(), timeout=timeout)
    except nats.errors.TimeoutError:
        return None
    return json.loads(reply.data)


def consumer_request(stream: str, **config: object) -> dict:
    return {"stream_name": stream, "config": {"ack_policy": "explicit", **config}}


async def durable_settings(js: nats.js.JetStreamContext, stream: str, name: str) -> tuple:
    c = (await js.consumer_info(stream, name)).config
    return c.filter_subject, c.max_ack_pending, c.ack_wait, c.max_deliver, c.deliver_subject


async def test_the_observer_cannot_rewrite_a_services_durable(auth_server: Auth, admin: Client) -> None:
    s, js = Subjects(PREFIX), admin.jetstream()
    durables = [s.trainer_consumer, s.controller_consumer]
    before = {d: await durable_settings(js, s.traj_stream, d) for d in durables}
    errors = Errors()
    observer = await as_role(auth_server, "observer", errors)
    api_ = "$JS.API.CONSUMER"
    for name in durables:
        starve = consumer_request(s.traj_stream, name=name, filter_subject=f"{s.prefix}.nothing", max_ack_pending=1)
        assert await api(observer, f"{api_}.CREATE.{s.traj_stream}", starve) is None  # the bare create
        assert await api(observer, f"{api_}.CREATE.{s.traj_stream}.{name}.{s.prefix}.nothing", starve) is None
        assert await api(observer, f"{api_}.DURABLE.CREATE.{s.traj_stream}.{name}",
                         consumer_request(s.traj_stream, durable_name=name, max_ack_pending=1)) is None
        # a name of its own in the subject and the durable's in the body: the server holds the body to the subject
        answer = await api(observer, f"{api_}.CREATE.{s.traj_stream}.mine.{s.prefix}.traj.>",
                           consumer_request(s.traj_stream, durable_name=name, filter_subject=f"{s.prefix}.traj.>",
                                            max_ack_pending=1))
        assert answer is not None and answer["error"]["err_code"] == 10017  # name in subject != durable name
        assert await api(observer, f"{api_}.DELETE.{s.traj_stream}.{name}") is None
    await asyncio.sleep(0.2)
    assert {d: await durable_settings(js, s.traj_stream, d) for d in durables} == before
    assert f"$js.api.consumer.create.{s.traj_stream.lower()}" in errors.refused()
    await observer.close()


@pytest.mark.parametrize("role, stream, durable", [
    ("trainer", "traj", "trainer"), ("controller", "traj", "controller"), ("rollout", "jobs", "rollout")])
async def test_no_service_creates_or_updates_a_durable(auth_server: Auth, admin: Client, role: str, stream: str,
                                                       durable: str) -> None:
    s, js = Subjects(PREFIX), admin.jetstream()
    stream = s.traj_stream if stream == "traj" else s.jobs_stream
    before = await durable_settings(js, stream, durable)
    client = await as_role(auth_server, role)
    cjs = client.jetstream(timeout=0.5)
    for config in ({"durable_name": durable, "max_ack_pending": 1}, {"name": durable, "max_deliver": 1},
                   {"durable_name": f"{durable}-2"}):  # nor a durable of its own beside it
        with pytest.raises(nats.errors.TimeoutError):
            await cjs.add_consumer(stream, **config)
    assert await durable_settings(js, stream, durable) == before
    await client.close()


async def test_no_role_reads_back_a_stream_it_writes_onto_a_subject_it_may_not_publish(
        auth_server: Auth, admin: Client) -> None:
    """The forged TrainingFinished road: every service may write its registry keys; a consumer of the
    bucket delivering to ``trainer.finished``, or a direct get answering there, would have the server publish
    the stored bytes for it. Each role is refused every such reader on the streams it writes."""
    s = Subjects(PREFIX)
    finished = await admin.subscribe(s.training_finished)
    forged = encode(TrainingFinished(step=HUGE, policy_version=HUGE, replica_id="trainer-forged"))
    writes = {"rollout": [s.traj_stream, s.episodes_stream, f"KV_{s.registry_kv}", s.dlq_stream],
              "controller": [s.jobs_stream, f"KV_{s.registry_kv}", s.dlq_stream],
              "env": [f"KV_{s.registry_kv}", s.dlq_stream],
              "trainer": [f"KV_{s.policy_kv}", Subjects.object_stream(s.weights_bucket), f"KV_{s.registry_kv}"]}
    for role, streams in writes.items():
        client = await as_role(auth_server, role)
        key = f"{s.registry_entry_prefix}{role}.{role}-forger"
        assert (await client.jetstream(timeout=2).publish(key, forged)).seq > 0  # its own key: allowed
        for stream in streams:
            push = consumer_request(stream, ack_policy="none", deliver_subject=s.training_finished, name="x")
            assert await api(client, f"$JS.API.CONSUMER.CREATE.{stream}", push) is None, (role, stream)
            assert await api(client, f"$JS.API.CONSUMER.CREATE.{stream}.x", push) is None, (role, stream)
            assert await api(client, f"$JS.API.CONSUMER.CREATE.{stream}.x.>", push) is None, (role, stream)
            await client.publish(f"$JS.API.DIRECT.GET.{stream}.{key}", b"", reply=s.training_finished)
        await client.flush()
    await client.close()
    with pytest.raises(nats.errors.TimeoutError):
        await finished.next_msg(timeout=0.5)


async def test_status_comes_from_the_source_never_from_the_body(auth_server: Auth, admin: Client) -> None:
    """A rollout's report claiming to be the supervisor's or the trainer's, and a heartbeat claiming a trainer,
    are refused by the controller; the supervisor's subject and another role's registry keys by the server."""
    s = Subjects(PREFIX)
    cfg = JetRLConfig()
    cfg.nats = role_cfg(auth_server)
    cfg.run.dir = str(auth_server[1].parent / "run")
    nc = await connect(cfg.nats, "pytest-controller", role="controller")
    controller = Controller(nc, nc.jetstream(), s, cfg, "controller-test")
    controller.creates_durables = False
    await controller.follow_metrics_and_weights()
    watcher = asyncio.create_task(controller.watch_replicas(every_s=0.1))
    errors = Errors()
    rollout = await as_role(auth_server, "rollout", errors)
    rjs = rollout.jetstream(timeout=0.5)
    await asyncio.sleep(0.2)
    lie = {"restarts/trainer": 999.0, "restarts/total": 999.0}
    for role in ("supervisor", "trainer"):  # on its own subject, a body naming another role
        await rollout.publish(s.metrics("rollout"), encode(MetricsReport(role=role, replica_id="r", step=HUGE,
                                                                         values=lie)))
    await rollout.publish(s.metrics("supervisor"), encode(MetricsReport(role="supervisor", replica_id="r", step=1,
                                                                        values=lie)))  # refused by the server
    fake = Heartbeat(role="trainer", replica_id="trainer-fake", pid=1, host="h", started_at=0.0, info={})
    with pytest.raises(nats.errors.TimeoutError):
        await rjs.publish(s.registry_entries("trainer", "trainer-fake"), encode(fake))
    await rjs.publish(s.registry_entries("rollout", "trainer-fake"), encode(fake))  # its own role's key, a lie inside
    beat = asyncio.create_task(heartbeat_loop(rjs, s, "rollout", "rollout-honest", {}, every_s=0.1))
    await publish_metrics(rollout, s, "rollout", "rollout-honest", 1, {"rollout/episodes_done": 1.0})
    for _ in range(50):
        await asyncio.sleep(0.1)
        if controller.replicas and "rollout/rollout-honest" in controller.latest_metrics:
            break
    status = controller.status()
    assert status["service_restarts"] == {} and status["trainer"] == {} and controller.trainer_step == 0
    assert [(r["role"], r["replica_id"]) for r in status["replicas"]] == [("rollout", "rollout-honest")]
    assert status["refused_reports"] == 3  # two reports and one heartbeat
    assert {s.metrics("supervisor"), s.registry_entries("trainer", "trainer-fake").lower()} <= errors.refused()
    for task in (beat, watcher):
        task.cancel()
    await asyncio.gather(beat, watcher, return_exceptions=True)
    await rollout.close()
    await nc.close()


async def test_a_replica_reads_no_other_replicas_replies_and_writes_only_its_own_key(auth_server: Auth,
                                                                                   admin: Client) -> None:
    s = Subjects(PREFIX)
    errors = Errors()
    victim = await as_role(auth_server, "rollout-0")
    thief = await as_role(auth_server, "rollout-1", errors)
    stolen = await thief.subscribe(f"{inbox_prefix('rollout-0')}.>")  # refused: nothing comes
    for _ in range(3):  # the victim's JetStream API replies (stream info, its policy KV read, ...)
        await victim.jetstream().stream_info(s.jobs_stream)
    with pytest.raises(nats.errors.TimeoutError):
        await stolen.next_msg(timeout=0.3)
    tjs = thief.jetstream(timeout=0.5)
    with pytest.raises(nats.errors.TimeoutError):  # the victim's heartbeat key
        await tjs.publish(s.registry_entries("rollout", "rollout-0"), b"x")
    assert (await tjs.publish(s.registry_entries("rollout", "rollout-1"), b"x")).seq > 0
    await asyncio.sleep(0.2)
    assert f"{inbox_prefix('rollout-0')}.>".lower() in errors.refused()
    cfg = role_cfg(auth_server)
    cfg.user, cfg.password_file = "rollout-0", str(auth_server[1] / "rollout-0.password")
    assert replica_name("rollout", cfg) == "rollout-0" and inbox_prefix("rollout-0") == "_INBOX_rollout-0"
    assert replica_name("rollout").startswith("rollout-") and replica_name("rollout") != "rollout-0"
    for client in (victim, thief):
        await client.close()
