"""NATS plumbing every role shares: connect, declare the JetStream topology, dead-letter, heartbeat,
metrics. The names come from ``shared.subjects``; the payloads from ``shared.messages``.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import os
import socket
import ssl
from typing import Any

import nats
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    KeyValueConfig,
    ObjectStoreConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BadRequestError
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from shared.config import NatsConfig
from shared.messages import MAX_MESSAGE_BYTES, BadMessage, DeadLetter, Heartbeat, M, MetricsReport, decode, encode, now
from shared.subjects import Subjects

log = structlog.get_logger()

DAY_S = 24 * 3600.0


async def connect(cfg: NatsConfig, name: str, url: str | None = None) -> Client:
    """Connect with endless reconnects (a restarted server is waited for, not a crash)."""
    kwargs: dict[str, Any] = {}
    if cfg.creds_file:
        kwargs["user_credentials"] = cfg.creds_file
    if cfg.user:
        kwargs["user"], kwargs["password"] = cfg.user, cfg.password
    if cfg.tls_ca or cfg.tls_cert:
        ctx = ssl.create_default_context(cafile=cfg.tls_ca or None)
        if cfg.tls_cert:
            ctx.load_cert_chain(cfg.tls_cert, cfg.tls_key or None)
        kwargs["tls"] = ctx

    async def on_error(exc: Exception) -> None:
        log.warning("nats_error", error=repr(exc))

    async def on_disconnected() -> None:
        log.info("nats_disconnected")  # also on a normal close; reconnects are logged as such

    async def on_reconnected() -> None:
        log.info("nats_reconnected")

    target = url or cfg.url
    if not target:
        raise ValueError("no NATS url: set nats.url or start an embedded server (jetrl up does)")
    return await nats.connect(
        target,
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


async def _ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    try:
        await js.add_stream(config)
    except BadRequestError:
        # Exists with another config: bring it up to date (e.g. a new subject or a longer max_age).
        await js.update_stream(config)


async def declare_topology(js: JetStreamContext, subjects: Subjects, cfg: NatsConfig,
                           heartbeat_ttl_s: float = 10.0) -> None:
    """Create (or update) every stream and bucket. Idempotent: every role calls it at start-up."""
    replicas = cfg.stream_replicas
    await _ensure_stream(js, StreamConfig(
        name=subjects.jobs_stream, subjects=[subjects.jobs(">")], retention=RetentionPolicy.WORK_QUEUE,
        storage=StorageType.FILE, max_age=DAY_S, num_replicas=replicas,
        description="episode assignments, one durable consumer shared by all rollout replicas",
    ))
    await _ensure_stream(js, StreamConfig(
        name=subjects.episodes_stream, subjects=subjects.episode_stream_subjects,
        retention=RetentionPolicy.LIMITS, storage=StorageType.FILE, max_age=7 * DAY_S,
        discard=DiscardPolicy.OLD, num_replicas=replicas,
        description="every action and observation of every episode, in order",
    ))
    await _ensure_stream(js, StreamConfig(
        name=subjects.traj_stream, subjects=[subjects.traj(">")], retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE, max_age=7 * DAY_S,
        duplicate_window=3600.0, max_msg_size=MAX_MESSAGE_BYTES, num_replicas=replicas,
        description="finished trajectories, deduplicated by episode id (Nats-Msg-Id)",
    ))
    await _ensure_stream(js, StreamConfig(
        name=subjects.dlq_stream, subjects=[subjects.dead_letter(">")], retention=RetentionPolicy.LIMITS,
        storage=StorageType.FILE, max_age=7 * DAY_S, num_replicas=replicas,
        description="messages a service could not accept, with the reason",
    ))
    for kv_config in (
        KeyValueConfig(bucket=subjects.policy_kv, history=16, replicas=replicas,
                       description="latest published policy version"),
        KeyValueConfig(bucket=subjects.registry_kv, history=1, ttl=heartbeat_ttl_s, replicas=replicas,
                       description="live replicas; a key expires when its heartbeats stop"),
    ):
        try:
            await js.key_value(kv_config.bucket)
        except Exception:
            await js.create_key_value(kv_config)
    try:
        await js.object_store(subjects.weights_bucket)
    except Exception:
        await js.create_object_store(subjects.weights_bucket, ObjectStoreConfig(
            description="policy weights, one safetensors object per version", replicas=replicas))


async def policy_kv(js: JetStreamContext, subjects: Subjects) -> KeyValue:
    return await js.key_value(subjects.policy_kv)


async def weights_store(js: JetStreamContext, subjects: Subjects) -> ObjectStore:
    return await js.object_store(subjects.weights_bucket)


async def dead_letter(js: JetStreamContext, subjects: Subjects, *, service: str, origin_subject: str,
                      reason: str, payload: bytes) -> None:
    """Keep a message we could not accept, with why. Never raises: a DLQ failure is only logged."""
    log.warning("dead_letter", origin_subject=origin_subject, reason=reason, size=len(payload))
    letter = DeadLetter(origin_subject=origin_subject, reason=reason, payload=payload[:MAX_MESSAGE_BYTES // 2],
                        service=service)
    try:
        await js.publish(subjects.dead_letter(service), encode(letter))
    except Exception as exc:  # the broker may be down; the log line above is the record then
        log.error("dead_letter_failed", error=repr(exc))


async def decode_or_dead_letter(js: JetStreamContext, subjects: Subjects, service: str, msg: Msg,
                                cls: type[M]) -> M | None:
    """Decode a stream message; one that cannot be accepted is dead-lettered and terminated (never
    redelivered), and None comes back. The consumer's rule at every JetStream boundary."""
    try:
        return decode(msg.data, cls)
    except BadMessage as exc:
        await dead_letter(js, subjects, service=service, origin_subject=msg.subject, reason=exc.reason,
                          payload=msg.data)
        await msg.term()
        return None


async def publish_metrics(nc: Client, subjects: Subjects, role: str, replica_id: str, step: int,
                          values: dict[str, float]) -> None:
    await nc.publish(subjects.metrics(role), encode(MetricsReport(role=role, replica_id=replica_id, step=step,
                                                                  values=values)))


def replica_name(role: str) -> str:
    """A replica id unique on this cluster: role, host and pid (subject-token safe)."""
    host = socket.gethostname().split(".")[0].replace("_", "-")
    if os.path.exists("/.dockerenv"):
        # In a container the pid is 1 or so, and with host networking (compose's local profile) every replica
        # has the host's hostname: two replicas of a role would share an id. A random token keeps them apart.
        return f"{role}-{host}-{os.getpid()}-{os.urandom(3).hex()}"
    return f"{role}-{host}-{os.getpid()}"


async def heartbeat_loop(js: JetStreamContext, subjects: Subjects, role: str, replica_id: str,
                         info: dict[str, Any], every_s: float = 2.0) -> None:
    """Refresh this replica's key in the registry until cancelled; the key expires when we die."""
    kv = await js.key_value(subjects.registry_kv)
    started = now()
    while True:
        try:
            beat = Heartbeat(role=role, replica_id=replica_id, pid=os.getpid(), host=socket.gethostname(),
                             started_at=started, info=dict(info))
            await kv.put(replica_id, encode(beat))
        except Exception as exc:
            log.warning("heartbeat_failed", error=repr(exc))
        await asyncio.sleep(every_s)


async def read_object(js: JetStreamContext, bucket: str, name: str, window_bytes: int = 16 * 1024**2) -> bytes:
    """Read a whole object-store object fast. nats-py's ``ObjectStore.get`` grows one ``bytes`` by
    concatenation over a flow-controlled push consumer (~12 MB/s for 25 MB here); this pulls every
    chunk through an ack-less ephemeral pull consumer in big batches, joins once (~200-400 MB/s) and
    checks the SHA-256 digest the store recorded. One batch asks for at most ``window_bytes``: the
    server drops a client with more than 64 MiB undelivered (slow consumer), and weights are bigger."""
    store = await js.object_store(bucket)
    info = await store.get_info(name)
    if not info.nuid:
        raise ValueError(f"object {name!r} in {bucket!r} has no data")
    if not info.size:
        return b""
    sub = await js.pull_subscribe(
        Subjects.object_chunks(bucket, info.nuid), stream=Subjects.object_stream(bucket),
        config=ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL, inactive_threshold=30.0),
        pending_bytes_limit=1024**3, pending_msgs_limit=1_000_000,
    )
    chunks: list[bytes] = []
    per_batch = max(1, window_bytes // -(-info.size // info.chunks))
    try:
        while len(chunks) < info.chunks:
            want = min(per_batch, info.chunks - len(chunks))
            chunks.extend(m.data for m in await sub.fetch(want, timeout=10.0))
    finally:
        await sub.unsubscribe()
    data = b"".join(chunks)
    expected = base64.urlsafe_b64decode(info.digest.split("=", 1)[1]) if info.digest else None
    if len(data) != info.size or (expected is not None and hashlib.sha256(data).digest() != expected):
        raise ValueError(f"object {name!r}: got {len(data)} bytes of {info.size}, or a digest mismatch")
    return data
