"""NATS plumbing every role shares: connect, declare the JetStream topology, heartbeat, metrics. The names
come from ``shared.subjects``; the payloads from ``shared.messages``. Retries, acks and dead letters are
``shared.delivery``; reading an object-store object is ``shared.objectread.read_object``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import socket
import ssl
import time
import weakref
from collections.abc import Callable
from typing import Any

import nats
import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import (
    DiscardPolicy,
    KeyValueConfig,
    ObjectStoreConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from shared.auth import credentials, manages_topology, replica_users, user_role
from shared.config import NatsConfig
from shared.messages import MAX_MESSAGE_BYTES, Heartbeat, MetricsReport, encode, now
from shared.subjects import Subjects, role_family

log = structlog.get_logger()

DAY_S = 24 * 3600.0

# When each client last got its connection back (see ``since_reconnect``).
_RECONNECTED_AT: weakref.WeakKeyDictionary[Client, float] = weakref.WeakKeyDictionary()
# What to call when a client gets its connection back (see ``on_reconnect``).
_RECONNECT_LISTENERS: weakref.WeakKeyDictionary[Client, list[Callable[[], None]]] = weakref.WeakKeyDictionary()


async def connect(cfg: NatsConfig, name: str, url: str | None = None, role: str | None = None) -> Client:
    """Connect with endless reconnects (a restarted server is waited for, not a crash). ``role`` picks
    the per-role user where ``nats.auth_dir`` is set (``shared.auth.credentials``)."""
    kwargs: dict[str, Any] = {}
    creds = credentials(cfg, role)
    if creds.creds_file:
        kwargs["user_credentials"] = creds.creds_file
    if creds.user:
        kwargs["user"], kwargs["password"] = creds.user, creds.password
    kwargs["inbox_prefix"] = creds.inbox_prefix  # a role reads only its own replies (shared/auth.py)
    if cfg.tls_ca or cfg.tls_cert:
        ctx = ssl.create_default_context(cafile=cfg.tls_ca or None)
        if cfg.tls_cert:
            ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key or None)
        kwargs["tls"] = ctx

    async def on_error(exc: Exception) -> None:
        text = str(exc).lower()
        if "authorization violation" in text or "permissions violation" in text:  # shared/auth.py
            log.error("nats_refused", error=repr(exc), user=creds.user or None, role=role,
                      hint="check nats.user / nats.password(_file) / nats.auth_dir, and the role's permissions "
                           "in shared/auth.py")
            return
        log.warning("nats_error", error=repr(exc))

    async def on_disconnected() -> None:
        log.info("nats_disconnected")  # also on a normal close; reconnects are logged as such

    holder: list[Client] = []

    async def on_reconnected() -> None:
        log.info("nats_reconnected")
        if holder:
            _RECONNECTED_AT[holder[0]] = time.monotonic()
            for listener in _RECONNECT_LISTENERS.get(holder[0], []):
                listener()

    target = url or cfg.url
    if not target:
        raise ValueError("no NATS url: set nats.url or start an embedded server (jetrl up does)")
    nc = await nats.connect(
        # a cluster's members, comma-separated: the client tries each and reconnects to a live one
        [u.strip() for u in target.split(",") if u.strip()],
        name=name,
        connect_timeout=cfg.connect_timeout_s,
        max_reconnect_attempts=-1,
        reconnect_time_wait=1,
        # a service's shutdown drains its subscriptions; a pull fetch still parked on the server would hold
        # the default 30 s drain open (every eval end paid it), and nothing is lost by giving up sooner:
        # unacked work is redelivered to the next replica
        drain_timeout=2,
        error_cb=on_error,
        disconnected_cb=on_disconnected,
        reconnected_cb=on_reconnected,
        **kwargs,
    )
    holder.append(nc)
    if nc.max_payload < MAX_MESSAGE_BYTES:  # a stock server allows 1 MiB: a trajectory or weights chunk would fail later
        await nc.close()
        raise NatsPayloadError(
            f"nats-server at {target} allows messages of {nc.max_payload} bytes, JetRL sends up to "
            f"{MAX_MESSAGE_BYTES} (shared.messages.MAX_MESSAGE_BYTES): start it with "
            f"--max_payload {MAX_MESSAGE_BYTES + 64 * 1024} (or max_payload in its config file)")
    return nc


class NatsPayloadError(RuntimeError):
    """The server's max_payload is below what JetRL's codec may send."""


def on_reconnect(nc: Client, listener: Callable[[], None]) -> None:
    """Call ``listener`` each time ``nc`` (a client from ``connect``) gets its connection back."""
    _RECONNECT_LISTENERS.setdefault(nc, []).append(listener)


def since_reconnect(nc: Client) -> float:
    """Seconds since this client last reconnected (inf if never): right after a server restart the
    other services may not have resubscribed yet, so 'no responders' then is not yet an answer."""
    at = _RECONNECTED_AT.get(nc)
    return float("inf") if at is None else time.monotonic() - at


def connection_disrupted(nc: Client, reconnects_before: int, grace_s: float = 15.0) -> bool:
    """Whether this client lost its connection since ``reconnects_before`` (``nc.stats['reconnects']``
    then), is reconnecting now, or got back less than ``grace_s`` ago."""
    return (nc.is_reconnecting or not nc.is_connected or nc.stats["reconnects"] != reconnects_before
            or since_reconnect(nc) < grace_s)


async def _ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    try:
        await js.add_stream(config)
    except BadRequestError:
        # Exists with another config: bring it up to date (e.g. a new subject or a longer max_age).
        await js.update_stream(config)


async def declare_topology(js: JetStreamContext, subjects: Subjects, cfg: NatsConfig,
                           role: str | None = None, wait_s: float = 120.0) -> None:
    """Create (or update) every stream and bucket. Idempotent: every role calls it at start-up. A role
    user of an authenticated server may not create streams (``shared.auth``): it waits for the admin
    (``jetrl up``, compose's ``topology`` service) to have declared them."""
    if not manages_topology(cfg, role):
        await wait_for_topology(js, subjects, wait_s)
        return
    replicas = cfg.stream_replicas
    bound = cfg.max_consumers
    await _ensure_stream(js, StreamConfig(
        name=subjects.jobs_stream, max_consumers=bound, subjects=[subjects.jobs(">")], retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE, max_age=DAY_S, num_replicas=replicas,
        description="episode assignments, one durable consumer shared by all rollout replicas",
    ))
    await _ensure_stream(js, StreamConfig(
        name=subjects.episodes_stream, subjects=subjects.episode_stream_subjects, max_consumers=bound,
        retention=RetentionPolicy.LIMITS, storage=StorageType.FILE, max_age=cfg.episodes_max_age_s,
        max_bytes=cfg.episodes_max_bytes, discard=DiscardPolicy.OLD, num_replicas=replicas,
        duplicate_window=120.0,  # an event resent across a reconnect carries the same Nats-Msg-Id
        description="every action and observation of every episode, in order",
    ))
    await _ensure_stream(js, StreamConfig(
        name=subjects.traj_stream, subjects=[subjects.traj(">")], retention=RetentionPolicy.LIMITS, max_consumers=bound,
        storage=StorageType.FILE, max_age=cfg.traj_max_age_s, max_bytes=cfg.traj_max_bytes, discard=DiscardPolicy.OLD,
        duplicate_window=3600.0, max_msg_size=MAX_MESSAGE_BYTES, num_replicas=replicas,
        description="finished trajectories, deduplicated by episode id (Nats-Msg-Id)",
    ))
    await _ensure_stream(js, StreamConfig(
        name=subjects.dlq_stream, subjects=[subjects.dead_letter(">")], retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE, max_age=7 * DAY_S, max_bytes=cfg.dlq_max_bytes, discard=DiscardPolicy.OLD,
        max_msgs_per_subject=cfg.dlq_max_per_origin, max_consumers=bound, num_replicas=replicas,
        description="messages a service could not accept, with the reason; a bound per service (dlq.<service>)",
    ))
    for kv_config in (
        KeyValueConfig(bucket=subjects.policy_kv, history=16, replicas=replicas,
                       description="latest published policy version"),
        KeyValueConfig(bucket=subjects.registry_kv, history=1, ttl=cfg.heartbeat_ttl_s, replicas=replicas,
                       description="live replicas; a key expires when its heartbeats stop"),
    ):
        try:
            await js.key_value(kv_config.bucket)
        except Exception:
            await js.create_key_value(kv_config)
        await _bound_consumers(js, f"KV_{kv_config.bucket}", bound)
    try:
        await js.object_store(subjects.weights_bucket)
    except Exception:
        await js.create_object_store(subjects.weights_bucket, ObjectStoreConfig(
            description="policy weights, one safetensors object per version", replicas=replicas))
    await _bound_consumers(js, Subjects.object_stream(subjects.weights_bucket), bound)


async def _bound_consumers(js: JetStreamContext, stream: str, bound: int) -> None:
    """A bucket's stream is made by nats-py without a bound on its consumers (every ``keys()`` and watch
    makes one): set it on the stream."""
    config = (await js.stream_info(stream)).config
    if config.max_consumers != bound:
        await js.update_stream(dataclasses.replace(config, max_consumers=bound))


async def wait_for_topology(js: JetStreamContext, subjects: Subjects, wait_s: float = 120.0) -> None:
    """Wait until every stream and bucket exists (stream info is all a role user may ask for)."""
    names = [subjects.jobs_stream, subjects.episodes_stream, subjects.traj_stream, subjects.dlq_stream,
             f"KV_{subjects.policy_kv}", f"KV_{subjects.registry_kv}", Subjects.object_stream(subjects.weights_bucket)]
    deadline = asyncio.get_running_loop().time() + wait_s
    for name in names:
        while True:
            try:
                await js.stream_info(name)
                break
            except NotFoundError:
                if asyncio.get_running_loop().time() > deadline:
                    raise RuntimeError(f"stream {name} was not declared within {wait_s:.0f} s: an admin client "
                                       "declares the topology (jetrl up does; compose: the topology service)") from None
                log.info("waiting_for_topology", stream=name)
                await asyncio.sleep(1.0)


async def policy_kv(js: JetStreamContext, subjects: Subjects) -> KeyValue:
    return await js.key_value(subjects.policy_kv)


async def weights_store(js: JetStreamContext, subjects: Subjects) -> ObjectStore:
    return await js.object_store(subjects.weights_bucket)


async def publish_metrics(nc: Client, subjects: Subjects, role: str, replica_id: str, step: int,
                          values: dict[str, float]) -> None:
    await nc.publish(subjects.metrics(role), encode(MetricsReport(role=role, replica_id=replica_id, step=step,
                                                                  values=values)))


def replica_name(role: str, cfg: NatsConfig | None = None) -> str:
    """A replica id unique on this cluster: one replica's own NATS user where it has one (``jetrl up`` gives
    each service its own: ``rollout-0``; the registry then lets it write that key alone; a compose replica
    claims one as it connects, ``claim_replica_user``, and takes its name then), else role, host and pid
    (subject-token safe)."""
    if cfg is not None and cfg.user and user_role(cfg.user) == role_family(role) != cfg.user:
        return cfg.user
    host = socket.gethostname().split(".")[0].replace("_", "-")
    if os.path.exists("/.dockerenv"):
        # In a container the pid is 1 or so, and with host networking (compose's local profile) every replica
        # has the host's hostname: two replicas of a role would share an id. A random token keeps them apart.
        return f"{role}-{host}-{os.getpid()}-{os.urandom(3).hex()}"
    return f"{role}-{host}-{os.getpid()}"


async def claim_replica_user(cfg: NatsConfig, service: str, subjects: Subjects, *, wait_s: float = 300.0) -> str:
    """Make ``cfg`` one of ``service``'s replica users (``nats.user`` ``rollout`` with ``nats.replica_passwords``:
    ``rollout-0``, ``rollout-1``, ...), the first no live replica holds, and return its name: this replica's id.

    Compose's ``--scale`` starts identical containers with no index of their own, so each claims a user here:
    as that user (only it may write that key, shared/auth.py) it creates its registry key, which the server
    creates only where none is live. The claim is its first heartbeat; its key expires with its heartbeats
    (``nats.heartbeat_ttl_s``), so a restarted container takes a free user, or this one once the old key
    expired. Waits up to ``wait_s`` for the topology (the admin declares the registry) or a free user."""
    users = replica_users(cfg.user, len(cfg.replica_passwords))
    deadline = time.monotonic() + wait_s
    while True:
        waiting_for = "a free replica user"
        for user, password in zip(users, cfg.replica_passwords, strict=True):
            trial = dataclasses.replace(cfg, user=user, password=password, replica_passwords=[])
            nc = await connect(trial, f"{user}-claim")
            try:
                kv = await nc.jetstream(timeout=5.0).key_value(subjects.registry_kv)
                beat = Heartbeat(role=service, replica_id=user, pid=os.getpid(), host=socket.gethostname(),
                                 started_at=now(), info={"state": "starting"})
                await kv.create(Subjects.registry_key(service, user), encode(beat))
            except KeyWrongLastSequenceError:
                continue  # a live replica holds this one
            except NotFoundError:
                waiting_for = "the registry (the topology service declares it)"
                break
            finally:
                await nc.close()
            cfg.user, cfg.password, cfg.replica_passwords = user, password, []
            return user
        if time.monotonic() > deadline:
            raise RuntimeError(f"{service}: no replica user free after {wait_s:.0f} s: all {len(users)} of "
                               f"{users[0]}..{users[-1]} are held by live replicas (scaled past them? `jetrl secrets "
                               f"--replicas {service}=N` makes more)" if waiting_for.startswith("a free") else
                               f"{service}: waited {wait_s:.0f} s for {waiting_for}")
        log.info("waiting_for_replica_user", service=service, waiting_for=waiting_for, users=len(users))
        await asyncio.sleep(2.0)


async def heartbeat_loop(js: JetStreamContext, subjects: Subjects, role: str, replica_id: str,
                         info: dict[str, Any], every_s: float = 2.0) -> None:
    """Refresh this replica's key in the registry until cancelled; the key expires when we die."""
    kv = await js.key_value(subjects.registry_kv)
    started = now()
    while True:
        try:
            beat = Heartbeat(role=role, replica_id=replica_id, pid=os.getpid(), host=socket.gethostname(),
                             started_at=started, info=dict(info))
            await kv.put(Subjects.registry_key(role, replica_id), encode(beat))
        except Exception as exc:
            log.warning("heartbeat_failed", error=repr(exc))
        await asyncio.sleep(every_s)
