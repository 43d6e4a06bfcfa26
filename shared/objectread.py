"""Read an object-store object's chunks straight into one buffer, on a connection of its own.

``read_object`` (at the end) reads the weights broadcast this way. Through nats-py, every received byte is
copied six or seven times before it reaches the caller: the asyncio stream's buffer, a 32 KiB ``bytes`` per
socket read, the protocol parser's buffer, a slice, the message's ``bytes``. The client process then costs
more CPU than nats-server does, and on this project's 2-core machine it capped the read at 250-390 MB/s
(docs/benchmarks/weights.md). Here a blocking socket in a helper thread reads each chunk's payload with
``recv_into`` into its place in the destination buffer. The kernel's copy is the only one, and the event
loop stays free meanwhile (``recv_into`` and the hashers release the GIL).

The connection speaks just enough of the NATS protocol for an ack-less pull consumer: INFO, CONNECT
(credentials, nkeys and TLS exactly as the caller's nats-py client has them), SUB to one inbox, PUB of the
pull requests, MSG/HMSG, PING/PONG. Two pull requests are kept in flight, so the server always has the
next batch to send. Together they ask for at most ``window_bytes``: nats-server drops a client that has
more than 64 MiB undelivered (a slow consumer).
"""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import ssl
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import ParseResult

import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from shared.digest import new_hasher, split_digest
from shared.subjects import Subjects

log = structlog.get_logger()

_CRLF = b"\r\n"
_SCRATCH_BYTES = 64 * 1024  # one socket read for protocol lines; payloads bypass it
_PULL_EXPIRES_NS = 60 * 10**9  # a pull request the server has not filled by then answers 408


# What of nats-py's insides this module reads (``endpoint_of``, ``_connect_line``; ``read_object`` the two of
# the JetStream context). Not its public API: ``missing_internals`` tells a version without them, and
# ``read_object`` then reads through nats-py's own ``ObjectStore.get`` instead.
CLIENT_INTERNALS = ("_current_server", "_server_info", "_auth_configured", "_connect_command")
JETSTREAM_INTERNALS = ("_prefix", "_nc")


def missing_internals(js: Any) -> list[str]:
    """The private attributes of nats-py that this reader needs and ``js`` (a JetStream context) or its
    client lack; empty when the fast read can run."""
    missing = [f"JetStreamContext.{a}" for a in JETSTREAM_INTERNALS if not hasattr(js, a)]
    nc = getattr(js, "_nc", None)
    if nc is not None:
        missing += [f"Client.{a}" for a in CLIENT_INTERNALS if not hasattr(nc, a)]
    return missing


class ObjectReadError(ValueError):
    """The server refused the read, answered with a status, or sent something that is not the object."""


@dataclass(frozen=True)
class ChunkPlan:
    """What to pull: the consumer (ack-less, on the object's chunk subject) and how much to expect."""

    api_prefix: str  # the JetStream API's subject prefix ("$JS.API", or a domain's)
    stream: str
    consumer: str
    subject: str  # the chunks' subject; every delivered message must carry it
    chunks: int
    size: int
    window_bytes: int


@dataclass(frozen=True)
class Endpoint:
    """Where and how the caller's nats-py client is connected, for a second connection like it."""

    host: str
    port: int
    tls: ssl.SSLContext  # the client's context (nats-py's default one when it has none)
    tls_wanted: bool  # the client asked for TLS; else only when the server requires it, as nats-py does
    tls_hostname: str | None
    tls_first: bool
    inbox: str
    timeout_s: float


async def endpoint_of(nc: Client, timeout_s: float = 30.0) -> Endpoint:
    """The server ``nc`` is connected to now, its TLS settings, and an inbox its user may subscribe to."""
    uri: ParseResult | None = nc.connected_url
    if uri is None or not uri.hostname:
        raise ConnectionError("object read: the NATS client is not connected")
    if uri.scheme in ("ws", "wss"):
        raise ObjectReadError("object read: websocket connections are not supported, only nats:// and tls://")
    server = nc._current_server  # the TLS name nats-py would check for this server (an implicit route's)
    tls_hostname = nc.options.get("tls_hostname") or getattr(server, "tls_name", None) or uri.hostname
    return Endpoint(host=uri.hostname, port=uri.port or 4222, tls=nc.ssl_context,
                    tls_wanted=bool(nc.options.get("tls")) or uri.scheme == "tls", tls_hostname=tls_hostname,
                    tls_first=bool(nc.options.get("tls_handshake_first")), inbox=nc.new_inbox(), timeout_s=timeout_s)


def _connect_line(nc: Client, server_info: dict[str, Any]) -> bytes:
    """The CONNECT nats-py would send to a server that announced ``server_info``: the same credentials
    (user and password, token, nkey or JWT signature over this connection's nonce). Runs on the client's
    event loop; nats-py reads the server info from the client, so it is swapped in and out without an
    await between (no other coroutine sees it)."""
    own_info, own_auth = nc._server_info, nc._auth_configured
    nc._server_info = server_info
    nc._auth_configured = own_auth or bool(server_info.get("auth_required"))
    try:
        line: bytes = nc._connect_command()
    finally:
        nc._server_info, nc._auth_configured = own_info, own_auth
    # this connection only pulls: no echo of our own publishes, headers on (the server's status replies)
    options = json.loads(line.split(b" ", 1)[1])
    options.update(verbose=False, pedantic=False, echo=False, headers=True, no_responders=True,
                   name=f"{options.get('name') or 'jetrl'}-object-read")
    return b"CONNECT " + json.dumps(options).encode() + _CRLF


class ChunkReader:
    """One object's chunks into ``buf``, in a helper thread, over its own connection (see the module)."""

    def __init__(self, endpoint: Endpoint, plan: ChunkPlan, buf: bytearray, hasher: Any,
                 connect_line: Callable[[dict[str, Any]], bytes]) -> None:
        self.endpoint, self.plan, self.buf, self.hasher = endpoint, plan, buf, hasher
        self.connect_line = connect_line  # server_info -> CONNECT bytes (runs on the caller's loop)
        self.sock: socket.socket | None = None
        self.pending = bytearray()  # bytes read but not parsed yet: protocol lines, a payload's first part
        self.scratch = bytearray(_SCRATCH_BYTES)

    # ------------------------------------------------------------------------------------ the wire
    def _recv_more(self) -> None:
        assert self.sock is not None
        n = self.sock.recv_into(self.scratch)
        if n == 0:
            raise ConnectionError("object read: the server closed the connection")
        self.pending += memoryview(self.scratch)[:n]

    def _line(self) -> bytes:
        while True:
            end = self.pending.find(_CRLF)
            if end >= 0:
                line = bytes(self.pending[:end])
                del self.pending[:end + 2]
                return line
            if len(self.pending) > 16 * 1024:
                raise ObjectReadError(f"object read: no protocol line in {len(self.pending)} bytes")
            self._recv_more()

    def _read_into(self, target: memoryview) -> None:
        """Exactly ``len(target)`` bytes: what is already pending, then straight from the socket."""
        assert self.sock is not None
        have = min(len(self.pending), len(target))
        if have:
            target[:have] = memoryview(self.pending)[:have]
            del self.pending[:have]
        while have < len(target):
            n = self.sock.recv_into(target[have:])
            if n == 0:
                raise ConnectionError("object read: the server closed the connection mid-message")
            have += n

    def _skip(self, count: int) -> bytes:
        out = bytearray(count)
        self._read_into(memoryview(out))
        return bytes(out)

    def _send(self, data: bytes) -> None:
        assert self.sock is not None
        self.sock.sendall(data)

    def _request(self, batch: int) -> None:
        body = json.dumps({"batch": batch, "expires": _PULL_EXPIRES_NS}).encode()
        subject = f"{self.plan.api_prefix}.CONSUMER.MSG.NEXT.{self.plan.stream}.{self.plan.consumer}"
        self._send(f"PUB {subject} {self.endpoint.inbox} {len(body)}\r\n".encode() + body + _CRLF)

    # ------------------------------------------------------------------------------------ the session
    def _open(self) -> None:
        ep = self.endpoint
        sock = socket.create_connection((ep.host, ep.port), timeout=ep.timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            # a bigger receive buffer lets the server write more per round; best effort (the kernel caps it)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 * 1024 * 1024)
        except OSError:
            pass
        if ep.tls_first:
            sock = ep.tls.wrap_socket(sock, server_hostname=ep.tls_hostname)
        self.sock = sock
        line = self._line()
        if not line.startswith(b"INFO "):
            raise ObjectReadError(f"object read: expected INFO from the server, got {line[:60]!r}")
        info = json.loads(line[5:])
        if not ep.tls_first and (ep.tls_wanted or info.get("tls_required")):
            if self.pending:
                raise ObjectReadError("object read: the server sent data before the TLS handshake")
            self.sock = sock = ep.tls.wrap_socket(sock, server_hostname=ep.tls_hostname)
        self._send(self.connect_line(info) + b"PING\r\n")
        while True:  # the PONG says CONNECT was accepted; a refusal comes as -ERR
            line = self._line()
            if line == b"PONG":
                break
            if line.startswith(b"-ERR"):
                raise ObjectReadError(f"object read: the server refused the connection: {line.decode(errors='replace')}")
            if line == b"PING":
                self._send(b"PONG\r\n")
        self._send(f"SUB {ep.inbox} 1\r\n".encode())

    def run(self) -> int:
        """Fill ``buf`` with the chunks in order, hashing each; the number of bytes filled."""
        plan = self.plan
        try:
            self._open()
            chunk_size = -(-plan.size // plan.chunks)
            per_request = max(1, min(plan.chunks, (plan.window_bytes // 2) // chunk_size))
            view = memoryview(self.buf)
            try:
                return self._pull(view, per_request)
            finally:
                view.release()  # a bytearray with an exported view cannot be resized or handed on safely
        finally:
            self.close()

    def _pull(self, view: memoryview, per_request: int) -> int:
        plan = self.plan
        requested = got = filled = 0
        while requested < min(plan.chunks, 2 * per_request):  # two requests in flight
            batch = min(per_request, plan.chunks - requested)
            self._request(batch)
            requested += batch
        subject = plan.subject.encode()
        while got < plan.chunks:
            line = self._line()
            op, _, rest = line.partition(b" ")
            if op == b"MSG":  # MSG <subject> <sid> [reply] <size>
                args = rest.split(b" ")
                header_size, size = 0, int(args[-1])
            elif op == b"HMSG":  # HMSG <subject> <sid> [reply] <header size> <total size>
                args = rest.split(b" ")
                header_size, size = int(args[-2]), int(args[-1]) - int(args[-2])
            elif op == b"PING":
                self._send(b"PONG\r\n")
                continue
            elif op in (b"PONG", b"+OK", b"INFO"):  # INFO: the server's news (cluster members, lame duck)
                continue
            elif op == b"-ERR":
                raise ObjectReadError(f"object read: server error {line.decode(errors='replace')}")
            else:
                raise ObjectReadError(f"object read: unexpected protocol line {line[:60]!r}")
            headers = self._skip(header_size) if header_size else b""
            if args[0] != subject:  # a status (no chunk): 408 request expired, 409 consumer gone, 100 heartbeat
                self._skip(size + 2)
                status = headers.split(_CRLF, 1)[0].decode(errors="replace")
                if headers.startswith(b"NATS/1.0 100"):
                    continue
                raise ObjectReadError(f"object read: {status or 'a message on ' + args[0].decode()!r} after "
                                      f"{got} of {plan.chunks} chunks")
            end = filled + size
            if end > plan.size:
                raise ObjectReadError(f"object read: chunks exceed the object's size of {plan.size} bytes")
            self._read_into(view[filled:end])
            if self._skip(2) != _CRLF:
                raise ObjectReadError("object read: a chunk does not end where its size says")
            self.hasher.update(view[filled:end])
            filled, got = end, got + 1
            if requested < plan.chunks and got > requested - per_request:  # one request done: the next one
                batch = min(per_request, plan.chunks - requested)
                self._request(batch)
                requested += batch
        return filled

    def close(self) -> None:
        """Close the connection; a ``run`` in progress fails at its next read (how a cancel stops it)."""
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self.sock.close()


async def read_chunks(nc: Client, plan: ChunkPlan, buf: bytearray, hasher: Any, timeout_s: float = 30.0) -> int:
    """Run a ``ChunkReader`` in a helper thread; the bytes filled. A cancel closes its connection."""
    loop = asyncio.get_running_loop()
    endpoint = await endpoint_of(nc, timeout_s)

    def connect_line(info: dict[str, Any]) -> bytes:
        # nats-py's credential callbacks belong to the client's loop: build the line there
        async def build() -> bytes:
            return _connect_line(nc, info)
        return asyncio.run_coroutine_threadsafe(build(), loop).result(timeout=timeout_s)

    reader = ChunkReader(endpoint, plan, buf, hasher, connect_line)
    task = loop.run_in_executor(None, reader.run)
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        reader.close()
        await asyncio.gather(task, return_exceptions=True)
        raise


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
    reads them on a connection of its own (``read_chunks`` above): each chunk's payload goes from the socket
    straight into its place in a buffer of the object's size, with no copy in between
    (``shared.model.weights_from_buffer`` makes tensors that are views into it). Each chunk is hashed as it
    arrives: against ``expected_digest`` (``algorithm:hex``, e.g. a ``WeightsAnnouncement``'s BLAKE3) when
    given, else against the SHA-256 the store recorded, never both. The pull requests in flight ask for
    at most ``window_bytes`` together: the server drops a client with more than 64 MiB undelivered (slow
    consumer), and weights are bigger.

    ``into``: a buffer to fill instead of a new one when it has the object's size (the previous version's,
    which nothing may use any more). Fresh memory costs a page fault per 4 KiB on first write: about 0.4 s
    of CPU for 651 MB here, a third of the read.

    The fast read uses some of nats-py's private attributes (``missing_internals``); with a
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
