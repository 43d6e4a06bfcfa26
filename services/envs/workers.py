"""The env host's worker pool: the episodes' blocking calls (open, tool call, oracle, close), on a bounded
set of threads shared by every session of a replica (``env.worker_threads``), not a thread per session."""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class WorkerPool:
    """The episodes' blocking calls, on threads, with as few of them running Python at once as the work
    allows. Calls queue in arrival order and ``lanes`` threads (default 1) take them one after another,
    with no trip through the event loop between two calls. A call still running ``spill_after_s`` after
    it started (a slow query, a command in a sandbox) no longer counts as a lane: another thread takes
    up the queue while it goes on, and its thread leaves once it ends (or takes a lane back if one is
    free). Quick calls are the common case (a SQL episode's calls take 0.1-1.5 ms) and mostly hold the
    GIL: threads running them beside each other take turns on it at every SQLite step, and with 32 such
    threads a replica did half the work per CPU second that one thread did (docs/benchmarks/env_host.md).

    At most ``size`` calls are in the pool at once (queued or running); a call the host stopped waiting
    for (past ``action_timeout_s``) gives its slot back at once and finishes on its thread, so stuck tools
    do not starve the other sessions; past ``2 * size`` threads more calls queue behind them. The order
    of one session's calls is its lock's business, not the pool's."""

    def __init__(self, size: int, lanes: int = 1, spill_after_s: float = 0.02) -> None:
        self.size, self.lanes, self.spill_after_s = size, min(lanes, size), spill_after_s
        self.max_threads = 2 * size
        self.slots = asyncio.Semaphore(size)
        self.queue: deque[_Call] = deque()
        self.running: set[_Call] = set()  # calls running on a lane
        self.cv = threading.Condition()
        self.lane_threads = 0  # threads that take calls off the queue (idle or running one)
        self.idle = 0
        self.threads = 0  # lane threads and threads still running a spilled call
        self.spilled = 0  # calls that outran spill_after_s, for the shutdown line
        self.closed = False
        self._watch: asyncio.TimerHandle | None = None

    async def run(self, fn: Callable[[], T], timeout_s: float | None = None,
                  started: Callable[[asyncio.Future[T]], None] | None = None) -> T:
        """``fn()`` on a pool thread. ``started`` gets the call's future: it runs on when the caller is
        cancelled or its ``timeout_s`` passes (TimeoutError), and a caller that must free what it makes
        (an opened episode, a running tool) keeps it."""
        async with self.slots:
            future = self.submit(fn)
            if started is not None:
                started(future)
            return await asyncio.wait_for(asyncio.shield(future), timeout_s)

    def submit(self, fn: Callable[[], T]) -> asyncio.Future[T]:
        """Queue ``fn()`` (on the event loop's thread) and return its future; outside ``slots``."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        with self.cv:
            if self.closed:
                raise RuntimeError("the worker pool is closed")
            self.queue.append(_Call(fn, future, loop))
            if self.idle:
                self.cv.notify()
            elif self.lane_threads < self.lanes and self.threads < self.max_threads:
                self._start_lane()
        if self._watch is None:
            self._watch = loop.call_later(self.spill_after_s / 2, self._spill_slow, loop)
        return future

    def _start_lane(self) -> None:  # under cv
        self.lane_threads += 1
        self.threads += 1
        threading.Thread(target=self._lane, name=f"env-{self.threads}", daemon=True).start()

    def _lane(self) -> None:
        """A lane thread: calls off the queue until the pool closes, or its call was spilled and no lane
        is free for it."""
        while True:
            with self.cv:
                while not self.queue and not self.closed:
                    self.idle += 1
                    self.cv.wait()
                    self.idle -= 1
                if not self.queue:  # closed
                    self.lane_threads -= 1
                    self.threads -= 1
                    return
                call = self.queue.popleft()
                call.started = time.monotonic()
                self.running.add(call)
            call.run()
            with self.cv:
                self.running.discard(call)
                if call.spilled:  # this thread left the lanes while its call ran
                    if self.lane_threads >= self.lanes or self.closed:
                        self.threads -= 1
                        return
                    self.lane_threads += 1

    def _spill_slow(self, loop: asyncio.AbstractEventLoop) -> None:
        """Every spill_after_s / 2 while calls are in the pool: calls that outran spill_after_s leave the
        lanes, and a new lane thread takes up the queue."""
        now = time.monotonic()
        with self.cv:
            for call in [c for c in self.running if now - c.started > self.spill_after_s]:
                self.running.discard(call)
                call.spilled = True
                self.spilled += 1
                self.lane_threads -= 1
            while (self.queue and self.lane_threads < self.lanes and self.threads < self.max_threads
                   and not self.closed):
                self._start_lane()
            busy = bool(self.running or self.queue)
        self._watch = loop.call_later(self.spill_after_s / 2, self._spill_slow, loop) if busy else None

    def close(self) -> None:
        """No more calls; the queued ones are cancelled; threads still running a stuck tool end with it
        (the process exit does not wait on them beyond the stop watchdog, shared.lifecycle)."""
        with self.cv:
            self.closed = True
            queued, self.queue = list(self.queue), deque()
            self.cv.notify_all()
        for call in queued:
            call.future.cancel()
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None


class _Call:
    __slots__ = ("fn", "future", "loop", "started", "spilled")

    def __init__(self, fn: Callable[[], Any], future: asyncio.Future[Any], loop: asyncio.AbstractEventLoop) -> None:
        self.fn, self.future, self.loop = fn, future, loop
        self.started = 0.0
        self.spilled = False

    def run(self) -> None:
        """On a pool thread: the call, its outcome handed to the event loop."""
        try:
            result = self.fn()
        except BaseException as exc:
            self._settle(None, exc)
        else:
            self._settle(result, None)

    def _settle(self, result: Any, exc: BaseException | None) -> None:
        try:
            self.loop.call_soon_threadsafe(_set_outcome, self.future, result, exc)
        except RuntimeError:  # the loop is closed: nobody waits for it any more
            pass


def _set_outcome(future: asyncio.Future[Any], result: Any, exc: BaseException | None) -> None:
    if future.done():  # cancelled by close()
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
