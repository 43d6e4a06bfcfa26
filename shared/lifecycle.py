"""How a service lives and stops: SIGTERM or SIGINT sets its stop event, and a watchdog makes sure the
process is gone within a bound even when a clean shutdown cannot finish (NATS is down and a drain waits
on it, a tool call is stuck in its thread and ``asyncio.run`` would wait for the thread pool). Every
background task runs under ``supervise``: one that raises is logged and restarted, or stops the service
with a failure exit code so that its supervisor (``jetrl up``, compose) starts a fresh one; none dies
unseen while the process looks alive."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable, Coroutine
from functools import partial
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


_background: set[asyncio.Task[Any]] = set()  # asyncio keeps only weak references to running tasks


def supervise(job: Awaitable[Any] | Callable[[], Awaitable[Any]], name: str, stop: asyncio.Event | None, *,
              restart_s: float | None = None) -> asyncio.Task[Any]:
    """Run ``job`` (an awaitable, or a function that makes one) as a background task that cannot die unseen.

    If it raises: with ``restart_s`` (and a function) it is logged (``task_failed``, traceback included)
    and started again ``restart_s`` later; otherwise it is logged and ``stop`` is set with the failure
    exit code (``exit_code``), so the service ends and its supervisor restarts it. ``stop`` None is for
    a unit of work (one message, one request) whose failure is logged only: its message comes back.
    A service's long-lived loops never return; one that does while ``stop`` is not set is logged."""
    async def run_job() -> Any:
        while True:
            try:
                return await (job() if callable(job) else job)
            except asyncio.CancelledError:
                raise
            except Exception:
                if restart_s is None or not callable(job):
                    raise
                log.exception("task_failed", task=name, then=f"restarting in {restart_s} s")
                await asyncio.sleep(restart_s)

    task = asyncio.create_task(run_job(), name=name)
    _background.add(task)
    task.add_done_callback(partial(_task_done, name, stop, job))
    return task


def _task_done(name: str, stop: asyncio.Event | None, job: Any, task: asyncio.Task[Any]) -> None:
    _background.discard(task)
    if asyncio.iscoroutine(job):  # cancelled before it started: close it (it is done otherwise, and this is a no-op)
        job.close()
    if task.cancelled():
        return
    error = task.exception()
    if error is None:
        if stop is not None and not stop.is_set():
            log.warning("task_ended", task=name)
        return
    if stop is None:
        log.error("task_failed", task=name, error=repr(error), exc_info=error)
        return
    log.error("task_failed", task=name, error=repr(error), then="stopping the service to be restarted",
              exc_info=error)
    _failures.append(f"task {name} failed")
    stop.set()


def exit_code() -> int:
    """0, or 1 when the service stopped because it failed (``stop_if_connection_closed``, ``supervise``)."""
    return 1 if _failures else 0
