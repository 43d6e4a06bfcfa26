"""Telling JetStream that a message is still being worked on (``in_progress``), so that it is not
redelivered to another consumer while we live; when we die, it is, within its ack wait.

Every service that holds a message longer than its ack wait uses these: the rollout holds a job for a
whole episode, the trainer holds trajectories while their group fills and its step runs. A failed touch
(the broker reconnecting) costs nothing: the next one retries, and an ack wait is far longer than a
reconnect."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterable

import structlog
from nats.aio.msg import Msg

from shared.lifecycle import supervise

log = structlog.get_logger()


async def touch(msg: Msg, what: str) -> bool:
    """One ``in_progress`` for ``msg`` (``what`` it holds, for the log); False when the broker is away."""
    try:
        await msg.in_progress()
    except Exception as exc:
        log.info("touch_failed", what=what, error=type(exc).__name__)
        return False
    return True


async def keep_touching(held: Callable[[], Iterable[Msg]], every_s: float, what: str,
                        stop: asyncio.Event | None = None) -> None:
    """Every ``every_s``, touch each message ``held()`` names then, until ``stop`` (or cancelled). A round
    stops at the first failure: the connection is down, and the next round touches them all again."""
    while stop is None or not stop.is_set():
        await asyncio.sleep(every_s)
        for msg in list(held()):
            if not await touch(msg, what):
                break


@contextlib.asynccontextmanager
async def touching(msg: Msg | None, every_s: float, what: str) -> AsyncIterator[None]:
    """Touch ``msg`` every ``every_s`` while the block runs: one slow step inside it (a busy engine, a
    remote API taking a minute) must not get the message redelivered meanwhile. ``msg`` None: no touching
    (work that came from no message)."""
    if msg is None:
        yield
        return
    task = supervise(keep_touching(lambda: (msg,), every_s, what), f"{what}_touch", None)
    try:
        yield
    finally:
        task.cancel()
