"""Getting messages through: retries across a server restart, confirmed acks, dead letters, and the
rule for a fetched batch (each message judged alone). Every role's publishes and consumers use these."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from nats.aio.msg import Msg
from nats.errors import ConnectionReconnectingError, MsgAlreadyAckdError, NoRespondersError, OutboundBufferLimitError
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.api import PubAck
from nats.js.errors import NoStreamResponseError, ServiceUnavailableError

from shared.lifecycle import supervise
from shared.messages import BadMessage, DeadLetter, M, decode, encode
from shared.subjects import Subjects

log = structlog.get_logger()

DEAD_LETTER_PAYLOAD_BYTES = 64 * 1024
"""A dead letter keeps this much of the message it refused (``nats.dlq_max_per_origin`` letters a service)."""

# What a publish or request may raise while the server restarts or the client reconnects: worth a retry.
TRANSIENT = (NatsTimeout, TimeoutError, NoRespondersError, NoStreamResponseError, ServiceUnavailableError,
             OutboundBufferLimitError, ConnectionReconnectingError)


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
