"""Client side of the unified function-call environment API (start / interact / cancel / oracle).

Any agent, not only JetRL's rollout service, can drive an env service with this over NATS.
"""

from __future__ import annotations

import asyncio
import itertools
import time
import weakref
import zlib
from typing import Any

from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from shared.bus import connection_disrupted, on_reconnect
from shared.messages import (
    EnvCancel,
    EnvHealth,
    EnvInteract,
    EnvOracle,
    EnvStart,
    EnvStarted,
    EnvStep,
    EnvTaskList,
    decode,
    encode,
)
from shared.subjects import Subjects

RECONNECT_GRACE_S = 30.0
"""How long past its own timeout a request keeps being retried while the connection was disrupted."""

ERROR_HEADER = "Nats-Service-Error"
ERROR_CODE_HEADER = "Nats-Service-Error-Code"


class EnvError(RuntimeError):
    """The env answered with an error (code as in HTTP: 400, 404, 409, 500, 503) or did not answer."""

    def __init__(self, code: str, description: str) -> None:
        super().__init__(f"env error {code}: {description}")
        self.code = code
        self.description = description


class _Resend(Exception):
    """The connection came back while a request waited: send it again."""


NO_RESPONDERS_STATUS = "503"


class _Replies:
    """Every env request of one connection and their replies: one wildcard reply subscription, a future per
    request (what ``nc.request`` does too). Unlike ``nc.request`` it fails the requests still waiting when
    the connection comes back (``_Resend``: their replies were lost with it), so they are sent again at
    once rather than after their timeout, without a watcher task per request (an env call's cost is
    counted in tenths of a millisecond: docs/benchmarks/env_host.md). For a client that did not come from
    ``shared.bus.connect`` the resend waits for the timeout instead."""

    def __init__(self, nc: Client) -> None:
        self.nc = weakref.proxy(nc)  # kept per client in a weak mapping: must not keep its client alive
        self.prefix = nc.new_inbox()  # under the role's inbox prefix (shared/auth.py)
        self.tokens = itertools.count()
        self.waiting: dict[str, asyncio.Future[Msg]] = {}
        self.subscribed: asyncio.Future[None] | None = None
        on_reconnect(nc, self.resend_waiting)

    async def request(self, subject: str, payload: bytes, timeout: float) -> Msg:
        if self.subscribed is None or (self.subscribed.done() and self.subscribed.exception() is not None):
            self.subscribed = asyncio.ensure_future(self._subscribe())
        await asyncio.shield(self.subscribed)
        token = str(next(self.tokens))
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Msg] = loop.create_future()
        self.waiting[token] = future
        expiry = loop.call_later(timeout, _expire, future)
        try:
            await self.nc.publish(subject, payload, reply=f"{self.prefix}.{token}")
            reply = await future
        finally:
            expiry.cancel()
            self.waiting.pop(token, None)
        if not reply.data and reply.headers and reply.headers.get("Status") == NO_RESPONDERS_STATUS:
            raise NoRespondersError
        return reply

    async def _subscribe(self) -> None:
        await self.nc.subscribe(f"{self.prefix}.*", cb=self._on_reply)

    async def _on_reply(self, msg: Msg) -> None:
        future = self.waiting.get(msg.subject[len(self.prefix) + 1:])
        if future is not None and not future.done():
            future.set_result(msg)

    def resend_waiting(self) -> None:
        for future in self.waiting.values():
            if not future.done():
                future.set_exception(_Resend())


def _expire(future: asyncio.Future[Msg]) -> None:
    if not future.done():
        future.set_exception(NatsTimeout())


_REPLIES: weakref.WeakKeyDictionary[Client, _Replies] = weakref.WeakKeyDictionary()


def episode_seed(episode_id: str) -> int:
    """The seed an episode's env session is opened with: a function of its id alone, so a replay of a
    stored episode (``jetrl reverify``, a new replica) opens the very same session."""
    return zlib.crc32(episode_id.encode())


class EnvClient:
    def __init__(self, nc: Client, subjects: Subjects, task: str, timeout_s: float = 30.0) -> None:
        self.nc, self.subjects, self.task, self.timeout_s = nc, subjects, task, timeout_s
        replies = _REPLIES.get(nc)
        if replies is None:  # one reply subscription per connection, however many clients use it
            replies = _REPLIES[nc] = _Replies(nc)
        self.replies = replies

    async def _request(self, subject: str, payload: bytes, timeout_s: float | None = None) -> bytes:
        """One request; resent while our own connection is disrupted (a NATS restart: the request or its
        reply was lost, or the env has not resubscribed yet), so an episode fails only for a reason of
        its own. Resending is safe: start, interact (with its turn), cancel are deduplicated by the env."""
        timeout = timeout_s or self.timeout_s
        deadline = time.monotonic() + timeout + RECONNECT_GRACE_S
        while True:
            reconnects = self.nc.stats["reconnects"]
            try:
                reply = await self.replies.request(subject, payload, timeout)
                break
            except NoRespondersError:
                if connection_disrupted(self.nc, reconnects) and time.monotonic() < deadline:
                    await asyncio.sleep(0.5)
                    continue
                raise EnvError("503", f"no env replica answers on {subject}") from None
            except (NatsTimeout, TimeoutError):
                if connection_disrupted(self.nc, reconnects, grace_s=0.0) and time.monotonic() < deadline:
                    continue
                raise EnvError("504", f"no reply on {subject} within {timeout}s") from None
            except _Resend:
                continue
        headers = reply.headers or {}
        if ERROR_CODE_HEADER in headers:
            raise EnvError(headers[ERROR_CODE_HEADER], headers.get(ERROR_HEADER, ""))
        return reply.data

    async def start(self, session_id: str, task_id: str, split: str = "train", seed: int = 0,
                    timeout_s: float | None = None) -> EnvStarted:
        data = await self._request(self.subjects.env_start(self.task),
                                   encode(EnvStart(session_id=session_id, task_id=task_id, split=split, seed=seed)),
                                   timeout_s)
        return decode(data, EnvStarted)

    async def interact(self, replica_id: str, session_id: str, message: dict[str, Any], turn: int = -1) -> EnvStep:
        data = await self._request(self.subjects.env_interact(self.task, replica_id),
                                   encode(EnvInteract(session_id=session_id, message=message, turn=turn)))
        return decode(data, EnvStep)

    async def oracle(self, replica_id: str, session_id: str) -> dict[str, Any]:
        data = await self._request(self.subjects.env_oracle(self.task, replica_id),
                                   encode(EnvOracle(session_id=session_id)))
        return decode(data, EnvInteract).message

    async def cancel(self, replica_id: str, session_id: str, reason: str = "cancelled") -> EnvStep:
        data = await self._request(self.subjects.env_cancel(self.task, replica_id),
                                   encode(EnvCancel(session_id=session_id, reason=reason)))
        return decode(data, EnvStep)

    async def task_ids(self, split: str = "train") -> list[str]:
        data = await self._request(self.subjects.env_tasks(self.task), encode(EnvTaskList(split=split)))
        return decode(data, EnvTaskList).task_ids

    async def health(self) -> EnvHealth:
        return decode(await self._request(self.subjects.env_health(self.task), b""), EnvHealth)
