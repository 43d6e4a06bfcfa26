"""NATS plumbing every role shares: connect, declare the JetStream topology, dead-letter, heartbeat,
metrics. The names come from ``shared.subjects``; the payloads from ``shared.messages``.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import os
import socket
import ssl
import time
import uuid
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import nats
import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import ConnectionReconnectingError, MsgAlreadyAckdError, NoRespondersError, OutboundBufferLimitError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    KeyValueConfig,
    ObjectStoreConfig,
    PubAck,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import (
    BadRequestError,
    KeyWrongLastSequenceError,
    NoStreamResponseError,
    NotFoundError,
    ServiceUnavailableError,
)
from nats.js.kv import KeyValue
from nats.js.object_store import ObjectStore

from shared.auth import credentials, manages_topology, replica_users, user_role
from shared.config import NatsConfig
from shared.digest import new_hasher, split_digest
from shared.lifecycle import supervise
from shared.messages import MAX_MESSAGE_BYTES, BadMessage, DeadLetter, Heartbeat, M, MetricsReport, decode, encode, now
from shared.objectread import ChunkPlan, ObjectReadError, missing_internals, read_chunks
from shared.subjects import Subjects, role_family

log = structlog.get_logger()

DAY_S = 24 * 3600.0
DEAD_LETTER_PAYLOAD_BYTES = 64 * 1024
"""A dead letter keeps this much of the message it refused (``nats.dlq_max_per_origin`` letters a service)."""

# When each client last got its connection back (see ``since_reconnect``).
_RECONNECTED_AT: weakref.WeakKeyDictionary[Client, float] = weakref.WeakKeyDictionary()
# What to call when a client gets its connection back (see ``on_reconnect``).
_RECONNECT_LISTENERS: weakref.WeakKeyDictionary[Client, list[Callable[[], None]]] = weakref.WeakKeyDictionary()

# What a publish or request may raise while the server restarts or the client reconnects: worth a retry.
TRANSIENT = (NatsTimeout, TimeoutError, NoRespondersError, NoStreamResponseError, ServiceUnavailableError,
             OutboundBufferLimitError, ConnectionReconnectingError)


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


async def publish_retrying(js: JetStreamContext, subject: str, payload: bytes, *, headers: dict[str, str] | None = None,
                           retry_s: float = 120.0, timeout_s: float = 5.0) -> PubAck:
    """A JetStream publish that survives a server restart: transient failures (no PubAck in time, no
    stream responders, JetStream not ready, reconnecting) are retried with backoff for ``retry_s``.
    Give a ``Nats-Msg-Id`` header: a retry whose first try did land is then dropped by the stream's
    duplicate window instead of being stored twice."""
    deadline = time.monotonic() + retry_s
    delay = 0.25
    tries = 0
    while True:
        tries += 1
        try:
            return await js.publish(subject, payload, headers=headers, timeout=timeout_s)
        except TRANSIENT as exc:
            if time.monotonic() + delay > deadline:
                log.error("publish_gave_up", subject=subject, tries=tries, error=repr(exc))
                raise
            log.warning("publish_retry", subject=subject, attempt=tries, error=type(exc).__name__)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)


async def retrying(what: str, call: Any, retry_s: float = 60.0) -> Any:
    """Await ``call()`` (an ack, a KV write...), retrying transient failures for ``retry_s``."""
    deadline = time.monotonic() + retry_s
    delay = 0.25
    while True:
        try:
            return await call()
        except TRANSIENT as exc:
            if time.monotonic() + delay > deadline:
                raise
            log.warning("nats_retry", what=what, error=type(exc).__name__)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)


class Acker:
    """Acks JetStream messages in the background, each confirmed by the server (``ack_sync``) and retried on
    a transient failure (no confirmation in time: a busy event loop or server; reconnecting) with backoff
    for ``retry_s``. The caller goes on at once, and a message whose result is stored is acked even across
    a server restart. Nothing raises out of it (an ack repeated after one that did land is confirmed
    again); one given up is logged and counted, and its message is redelivered after its ack wait, which
    its consumer must deduplicate."""

    def __init__(self, what: str, timeout_s: float = 5.0, retry_s: float = 600.0) -> None:
        self.what, self.timeout_s, self.retry_s = what, timeout_s, retry_s
        self.pending: set[asyncio.Task[bool]] = set()
        self.acked = 0
        self.retries = 0
        self.given_up = 0

    def ack(self, msg: Msg, **context: Any) -> asyncio.Task[bool]:
        """Start acking ``msg``; the task's result says whether the server confirmed it."""
        task = supervise(self._ack(msg, context), f"{self.what}_ack", None)
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)
        return task

    async def _ack(self, msg: Msg, context: dict[str, Any]) -> bool:
        deadline = time.monotonic() + self.retry_s
        delay = 0.25
        tries = 0
        while True:
            tries += 1
            try:
                await msg.ack_sync(timeout=self.timeout_s)
            except MsgAlreadyAckdError:
                pass
            except TRANSIENT as exc:
                if time.monotonic() + delay > deadline:
                    self.given_up += 1
                    log.error("ack_gave_up", what=self.what, tries=tries, error=repr(exc), **context)
                    return False
                self.retries += 1
                log.info("ack_retry", what=self.what, attempt=tries, error=type(exc).__name__, **context)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)
                continue
            except Exception as exc:  # the connection is closed for good: the message comes back after its ack wait
                self.given_up += 1
                log.warning("ack_failed", what=self.what, tries=tries, error=repr(exc), **context)
                return False
            self.acked += 1
            return True

    async def drain(self, timeout_s: float = 5.0) -> None:
        """On shutdown: let the acks under way finish (up to ``timeout_s``), then stop the rest."""
        if self.pending:
            await asyncio.wait(set(self.pending), timeout=timeout_s)
        for task in list(self.pending):
            task.cancel()
        await asyncio.gather(*self.pending, return_exceptions=True)


async def _ensure_stream(js: JetStreamContext, config: StreamConfig) -> None:
    try:
        await js.add_stream(config)
    except BadRequestError:
        # Exists with another config: bring it up to date (e.g. a new subject or a longer max_age).
        await js.update_stream(config)


async def declare_topology(js: JetStreamContext, subjects: Subjects, cfg: NatsConfig,
                           heartbeat_ttl_s: float = 10.0, role: str | None = None,
                           wait_s: float = 120.0) -> None:
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
        KeyValueConfig(bucket=subjects.registry_kv, history=1, ttl=heartbeat_ttl_s, replicas=replicas,
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


async def dead_letter(js: JetStreamContext, subjects: Subjects, *, service: str, origin_subject: str,
                      reason: str, payload: bytes) -> None:
    """Keep a message we could not accept, with why. Never raises: a DLQ failure is only logged."""
    log.warning("dead_letter", origin_subject=origin_subject, reason=reason[:500], size=len(payload))
    if len(payload) > DEAD_LETTER_PAYLOAD_BYTES:  # the DLQ's bound is per service in letters: keep letters small
        reason = f"{reason} (payload: its first {DEAD_LETTER_PAYLOAD_BYTES} of {len(payload)} bytes)"
    letter = DeadLetter(origin_subject=origin_subject, reason=reason[:4096],
                        payload=payload[:DEAD_LETTER_PAYLOAD_BYTES], service=service)
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
        await term_quietly(msg)
        return None


async def term_quietly(msg: Msg) -> None:
    """Terminate a message we will never take; a broker that is away then redelivers it, to be refused again."""
    try:
        await msg.term()
    except Exception as exc:
        log.warning("term_failed", subject=msg.subject, error=repr(exc))


async def judge_each(js: JetStreamContext, subjects: Subjects, service: str, msgs: list[Msg],
                     take: Callable[[Msg], Awaitable[object]]) -> None:
    """Hand each fetched message to ``take`` on its own, so one bad message never costs the batch around it
    (the rest would come back until their last delivery and be lost). A message whose ``take`` raises is
    dead-lettered with the reason and terminated; a broker that is away (``TRANSIENT``) leaves it to be
    redelivered instead: nothing valid is dead-lettered for the broker's sake."""
    for msg in msgs:
        try:
            await take(msg)
        except asyncio.CancelledError:
            raise
        except TRANSIENT as exc:
            log.warning("message_left_for_redelivery", subject=msg.subject, error=repr(exc))
        except Exception as exc:
            log.exception("message_refused", subject=msg.subject)
            await dead_letter(js, subjects, service=service, origin_subject=msg.subject,
                              reason=f"{service} failed on it: {type(exc).__name__}: {exc}"[:2000], payload=msg.data)
            await term_quietly(msg)


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
    (``controller.heartbeat_ttl_s``), so a restarted container takes a free user, or this one once the old key
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


_slow_read_warned = False  # the fallback below says why once per process, not at every version


def _warn_slow_object_read(missing: list[str]) -> None:
    global _slow_read_warned
    if not _slow_read_warned:
        _slow_read_warned = True
        log.warning("object_read_fallback", missing=missing, hint="this nats-py lacks what shared.objectread reads "
                    "of its insides: objects are read through ObjectStore.get (slower); pin nats-py to a tested "
                    "version (pyproject.toml) or update shared/objectread.py")


async def read_object(js: JetStreamContext, bucket: str, name: str, window_bytes: int = 32 * 1024**2,
                      expected_digest: str | None = None, into: bytearray | None = None) -> bytearray:
    """Read a whole object-store object fast, into one buffer, checked by one hash pass.

    nats-py's ``ObjectStore.get`` grows one ``bytes`` by concatenation over a flow-controlled push consumer
    (~12 MB/s for 25 MB here). This makes an ack-less ephemeral pull consumer on the object's chunks and
    reads them on a connection of its own (``shared.objectread``): each chunk's payload goes from the socket
    straight into its place in a buffer of the object's size, with no copy in between
    (``shared.model.weights_from_buffer`` makes tensors that are views into it). Each chunk is hashed as it
    arrives: against ``expected_digest`` (``algorithm:hex``, e.g. a ``WeightsAnnouncement``'s BLAKE3) when
    given, else against the SHA-256 the store recorded, never both. The pull requests in flight ask for
    at most ``window_bytes`` together: the server drops a client with more than 64 MiB undelivered (slow
    consumer), and weights are bigger.

    ``into``: a buffer to fill instead of a new one when it has the object's size (the previous version's,
    which nothing may use any more). Fresh memory costs a page fault per 4 KiB on first write: about 0.4 s
    of CPU for 651 MB here, a third of the read.

    The fast read uses some of nats-py's private attributes (``shared.objectread.missing_internals``); with a
    nats-py that lacks them it warns once and reads through ``ObjectStore.get``, checked the same way."""
    store = await js.object_store(bucket)
    info = await store.get_info(name)
    if not info.nuid:
        raise ValueError(f"object {name!r} in {bucket!r} has no data")
    if expected_digest is not None:
        algorithm, want = split_digest(expected_digest)
    elif info.digest:
        algorithm, want = "sha256", base64.urlsafe_b64decode(info.digest.split("=", 1)[1]).hex()
    else:
        algorithm, want = "sha256", None
    hasher = new_hasher(algorithm)
    buf = into if into is not None and len(into) == info.size else bytearray(info.size)
    missing = missing_internals(js)
    if info.size and missing:  # a nats-py without what the fast reader uses: its own (slower) read
        _warn_slow_object_read(missing)
        data = (await store.get(name)).data or b""
        if len(data) != info.size:
            raise ValueError(f"object {name!r}: got {len(data)} bytes of {info.size}")
        buf[:] = data
        hasher.update(buf)
    elif info.size:
        stream, subject = Subjects.object_stream(bucket), Subjects.object_chunks(bucket, info.nuid)
        # named: the API subject then carries the consumer's name and filter, which is all a reader's permission
        # allows (CONSUMER.CREATE.<stream>.*.<chunks>, shared/auth.py), so it can touch no other consumer
        consumer = await js.add_consumer(stream, ConsumerConfig(
            name=uuid.uuid4().hex, ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL, filter_subject=subject,
            inactive_threshold=30.0, mem_storage=True, num_replicas=1))
        plan = ChunkPlan(api_prefix=js._prefix, stream=stream, consumer=consumer.name, subject=subject,
                         chunks=info.chunks, size=info.size, window_bytes=window_bytes)
        try:
            filled = await read_chunks(js._nc, plan, buf, hasher)
        except ObjectReadError as exc:
            raise ValueError(f"object {name!r}: {exc}") from None
        finally:
            try:  # the server would drop it after inactive_threshold anyway
                await js.delete_consumer(stream, consumer.name)
            except Exception as exc:
                log.debug("object_read_consumer_delete", error=repr(exc))
        if filled != info.size:
            raise ValueError(f"object {name!r}: got {filled} bytes of {info.size}")
    if want is not None and hasher.hexdigest() != want:
        raise ValueError(f"object {name!r}: {algorithm} digest mismatch ({hasher.hexdigest()} != {want})")
    return buf
