"""How a service stops: SIGTERM or SIGINT sets its stop event, and a watchdog makes sure the process
is gone within a bound even when a clean shutdown cannot finish (NATS is down and a drain waits on
it, a tool call is stuck in its thread and ``asyncio.run`` would wait for the thread pool)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

import structlog
from nats.aio.client import Client

log = structlog.get_logger()

EXIT_ON_SIGNAL = 128 + signal.SIGTERM  # what a shell reports for a process ended by SIGTERM


T = TypeVar("T")


def run(main: Coroutine[Any, Any, T]) -> T:
    """Run a service's main coroutine on uvloop, libuv's event loop: every NATS round trip, task and
    thread hand-off costs about half of what it does on asyncio's own loop (an env call: see
    docs/benchmarks/env_host.md). Falls back to asyncio's loop where uvloop is not installed."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(main)


def install_stop(stop: asyncio.Event, grace_s: float = 8.0) -> None:
    """SIGTERM/SIGINT -> ``stop`` is set and the service shuts down cleanly; if it is still running
    ``grace_s`` later it exits there and then. A second signal exits at once."""
    loop = asyncio.get_running_loop()

    def force() -> None:
        log.warning("shutdown_forced", grace_s=grace_s)
        sys.stderr.flush()
        os._exit(EXIT_ON_SIGNAL)

    def on_signal() -> None:
        if stop.is_set():
            force()
        stop.set()
        timer = threading.Timer(grace_s, force)
        timer.daemon = True
        timer.start()

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
    else:  # the main thread runs something else (a model engine) and hands signals over: forward_signals
        _signal_targets.append(lambda: loop.call_soon_threadsafe(on_signal))


_signal_targets: list[Callable[[], None]] = []


def forward_signals() -> None:
    """For a process whose asyncio loop runs on a second thread (the rollout's main thread runs its model
    engine): call on the main thread before starting the loop's thread; SIGINT and SIGTERM then reach
    the loop's ``install_stop`` as they would on the main thread."""
    def handler(signum: int, frame: Any) -> None:
        for target in list(_signal_targets):
            target()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, handler)


async def close_connection(nc: Client, timeout_s: float = 3.0) -> None:
    """Drain when the server is there (in-flight acks and publishes go out); close when it is not or
    the drain takes too long: never block a shutdown on a broker that is gone."""
    if nc.is_closed:
        return
    try:
        if nc.is_connected:
            await asyncio.wait_for(nc.drain(), timeout_s)
            return
    except Exception as exc:
        log.info("drain_skipped", error=type(exc).__name__)
    try:
        await asyncio.wait_for(nc.close(), timeout_s)
    except Exception as exc:
        log.info("close_failed", error=type(exc).__name__)


_failures: list[str] = []


async def stop_if_connection_closed(nc: Client, stop: asyncio.Event, every_s: float = 1.0) -> None:
    """A connection the server closed (it refused something we sent) never comes back by itself:
    stop the service with a failure exit code, so that whoever supervises it starts a fresh one."""
    while not stop.is_set():
        await asyncio.sleep(every_s)
        if nc.is_closed and not stop.is_set():
            log.error("nats_connection_closed", detail="the server closed the connection; exiting to be restarted")
            _failures.append("nats connection closed")
            stop.set()


def exit_code() -> int:
    """0, or 1 when the service stopped because it failed (see ``stop_if_connection_closed``)."""
    return 1 if _failures else 0
