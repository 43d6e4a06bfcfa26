"""MCP client sessions, one per episode or a pool shared by episodes, on one event loop thread shared by all
of a replica's episodes.

The MCP SDK is asynchronous and an episode's calls come from the env host's worker threads, so each
session lives in a task on ``LoopThread`` and the threads hand it calls (``run``). The task holds the
``async with Client(...)`` the whole episode long (the SDK's transports must be entered and left by one
task) and leaves it on ``close``: a stdio server process is stopped, an HTTP session is ended. A server
that dies or hangs never leaves a call waiting: a call ends when its result comes, when the session's
transport closes (``ServerGone``) or after its timeout (``TimeoutError``, the host's env_timeout).

``SessionPool`` keeps a few sessions open for a stateless server and lends one to each call; a session that
dies is dropped from the pool and another is opened in its place, while the calls that were in flight on it
end with ``ServerGone`` like any other.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

import structlog

log = structlog.get_logger()

T = TypeVar("T")


class ServerGone(RuntimeError):
    """The MCP server closed the session (it died, or the connection broke): the episode ends as env_error."""


class LoopThread:
    """An asyncio event loop on a daemon thread; ``run`` blocks the calling thread until a coroutine ends."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float) -> T:
        future = self.submit(coro)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"no answer from the MCP server within {timeout_s:g}s") from None

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5.0)


class McpSession:
    """``target`` is a URL (streamable HTTP) or an ``mcp.StdioServerParameters``; ``protocol`` is the
    SDK's ``mode`` (legacy | auto)."""

    def __init__(self, loop: LoopThread, target: Any, protocol: str, startup_timeout_s: float,
                 on_lost: Callable[[McpSession], None] | None = None) -> None:
        self.loop = loop
        self.client: Any = None
        self.error: BaseException | None = None
        self.stop: asyncio.Event | None = None
        self.gone: asyncio.Event | None = None
        self.on_lost = on_lost  # called on the loop thread when the server closes the session under us
        self.http_session_id: str | None = None  # the Mcp-Session-Id an HTTP server assigned, if it did
        self.in_flight = 0  # calls running on it (a pool lends the least busy)
        self.lost = False  # the server closed it under us (seen by _hold, or by a call the transport failed)
        self.server = describe(target)
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self.runner = loop.submit(self._hold(target, protocol, ready))
        try:
            ready.result(startup_timeout_s)
        except concurrent.futures.TimeoutError:
            self.close()
            raise TimeoutError(f"the MCP server did not open a session within {startup_timeout_s:g}s") from None

    async def _hold(self, target: Any, protocol: str, ready: concurrent.futures.Future[None]) -> None:
        from mcp import Client

        self.stop, self.gone = asyncio.Event(), asyncio.Event()
        try:
            async with contextlib.AsyncExitStack() as stack:
                streams = await stack.enter_async_context(self._watched(target))
                client = await stack.enter_async_context(Client(Streams(streams), mode=protocol))
                self.client = client
                ready.set_result(None)
                await self.stop.wait()
        except BaseException as exc:  # the transport closed under the session (or never opened)
            self.error = exc
            if not ready.done():
                ready.set_exception(RuntimeError(f"cannot open an MCP session with {describe(target)}: "
                                                 f"{reason(exc)}"))
            elif not self.stop.is_set():
                self._lose(reason(exc))
        finally:
            self.gone.set()

    def _lose(self, why: str) -> None:
        """On the loop thread: the server closed the session under us. It is left (a stdio process is
        stopped), every call still on it ends with ServerGone, and its pool replaces it."""
        if self.lost:
            return
        self.lost = True
        log.warning("mcp_session_lost", server=self.server, error=why)
        assert self.stop is not None
        self.stop.set()
        if self.on_lost is not None:
            self.on_lost(self)

    @contextlib.asynccontextmanager
    async def _watched(self, target: Any) -> AsyncIterator[tuple[Any, Any]]:
        """The SDK's transport, its read side forwarded through a stream of our own: when the server closes it
        (a stdio server that died, idle or not) the session is lost at once, not at its next call. Over HTTP
        it runs on a client of our own, which notes whether the server assigned an ``Mcp-Session-Id``."""
        import anyio
        from mcp.client.stdio import stdio_client
        from mcp.client.streamable_http import streamable_http_client
        from mcp.shared._httpx_utils import create_mcp_http_client

        async with contextlib.AsyncExitStack() as stack:
            if isinstance(target, str):
                async def note_session_id(response: Any) -> None:
                    self.http_session_id = self.http_session_id or response.headers.get("mcp-session-id")

                http = await stack.enter_async_context(create_mcp_http_client())
                http.event_hooks["response"].append(note_session_id)
                transport = streamable_http_client(target, http_client=http)
            else:
                transport = stdio_client(target)
            server_read, write = await stack.enter_async_context(transport)
            send, read = anyio.create_memory_object_stream[Any](0)

            async def forward() -> None:
                async with send:
                    try:
                        async for message in server_read:
                            await send.send(message)
                    except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                        pass
                assert self.stop is not None
                if not self.stop.is_set():
                    self._lose("the server closed the connection")

            forwarder = asyncio.ensure_future(forward())
            try:
                yield read, write
            finally:
                forwarder.cancel()

    @property
    def alive(self) -> bool:
        return self.gone is not None and not self.gone.is_set() and not self.lost

    async def _call(self, method: str, *args: Any) -> Any:
        from mcp.shared.exceptions import MCPError
        from mcp_types import CONNECTION_CLOSED

        assert self.gone is not None
        if self.gone.is_set() or self.lost:
            raise ServerGone(f"the MCP server closed the session ({reason(self.error)})")
        call = asyncio.ensure_future(getattr(self.client, method)(*args))
        gone = asyncio.ensure_future(self.gone.wait())
        try:
            done, _ = await asyncio.wait({call, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when the caller gave up (its timeout): no request is left waiting on the session
            gone.cancel()
            if not call.done():
                call.cancel()
        if call not in done:
            raise ServerGone(f"the MCP server closed the session ({reason(self.error)})")
        try:
            return call.result()
        except MCPError as exc:
            # the SDK's code for a transport that ended under the call (a stdio pipe, an HTTP stream cut off)
            if self.gone.is_set() or exc.code == CONNECTION_CLOSED or "connection closed" in str(exc).lower():
                self._lose(str(exc))
                raise ServerGone(f"the MCP server closed the session ({exc})") from None
            raise

    def list_tools(self, timeout_s: float) -> list[Any]:
        return list(self.loop.run(self._call("list_tools"), timeout_s).tools)

    def call_tool(self, name: str, arguments: dict[str, Any], timeout_s: float) -> Any:
        return self.loop.run(self._call("call_tool", name, arguments), timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Leave the session: the stdio server is stopped, the HTTP session ended."""
        if self.stop is not None:
            self.loop.loop.call_soon_threadsafe(self.stop.set)
        try:
            self.runner.result(timeout_s)
        except concurrent.futures.TimeoutError:
            self.runner.cancel()
        except Exception:  # already reported by _hold
            pass


class SessionPool:
    """``size`` open sessions to a stateless server, shared by a replica's episodes: each call borrows the least
    busy live one. A session the server closes leaves the pool at once (its calls in flight end with
    ``ServerGone``) and a new one is opened in its place on a thread of its own; a call that finds no live
    session opens one itself, and fails as the server is failing if it cannot."""

    def __init__(self, loop: LoopThread, target: Any, protocol: str, size: int, startup_timeout_s: float) -> None:
        self.loop, self.target, self.protocol = loop, target, protocol
        self.size, self.startup_timeout_s = size, startup_timeout_s
        self.lock = threading.Lock()
        self.sessions: list[McpSession] = []
        self.opening = 0  # replacements being opened
        self.closed = False
        try:
            for _ in range(size):
                self.sessions.append(self._open())
        except BaseException:
            self.close()
            raise

    def _open(self) -> McpSession:
        return McpSession(self.loop, self.target, self.protocol, self.startup_timeout_s, on_lost=self._lost)

    def _lost(self, session: McpSession) -> None:
        with self.lock:
            if session not in self.sessions:
                return
            self.sessions.remove(session)
            self._refill()
        log.info("mcp_pool_session_replaced", server=describe(self.target), live=len(self.sessions))

    def _refill(self) -> None:
        """Under the lock: start opening the sessions the pool lacks, each on a thread of its own (a session
        opens on the loop thread, which must not wait for itself)."""
        for _ in range(self.size - len(self.sessions) - self.opening):
            if self.closed:
                return
            self.opening += 1
            threading.Thread(target=self._replace, name="mcp-pool-refill", daemon=True).start()

    def _replace(self) -> None:
        session: McpSession | None = None
        try:
            session = self._open()
        except Exception as exc:  # the server is down: the next call that finds no live session tries again
            log.warning("mcp_pool_refill_failed", server=describe(self.target), error=reason(exc))
        with self.lock:
            self.opening -= 1
            if session is not None and not self.closed and len(self.sessions) < self.size:
                self.sessions.append(session)
                session = None
        if session is not None:
            session.close()

    def borrow(self) -> McpSession:
        """The least busy live session, its ``in_flight`` counted; give it back with ``give_back``."""
        with self.lock:
            if self.closed:
                raise ServerGone("the MCP session pool is closed")
            self.sessions = [s for s in self.sessions if s.alive]
            self._refill()
            if self.sessions:
                session = min(self.sessions, key=lambda s: s.in_flight)
                session.in_flight += 1
                return session
        try:  # none left: every replacement is still opening or failed; open one for this call
            session = self._open()
        except (RuntimeError, TimeoutError) as exc:
            raise ServerGone(f"no open session to the MCP server and none opens: {exc}") from None
        with self.lock:
            if self.closed:
                session.close()
                raise ServerGone("the MCP session pool is closed")
            self.sessions.append(session)
            session.in_flight += 1
        return session

    def give_back(self, session: McpSession) -> None:
        with self.lock:
            session.in_flight -= 1

    def list_tools(self, timeout_s: float) -> list[Any]:
        session = self.borrow()
        try:
            return session.list_tools(timeout_s)
        finally:
            self.give_back(session)

    def call_tool(self, name: str, arguments: dict[str, Any], timeout_s: float) -> Any:
        session = self.borrow()
        try:
            return session.call_tool(name, arguments, timeout_s)
        finally:
            self.give_back(session)

    def close(self) -> None:
        with self.lock:
            self.closed = True
            sessions, self.sessions = self.sessions, []
        for session in sessions:
            session.close()


class Streams:
    """A transport already entered, as ``mcp.Client`` takes one: it yields the streams and owns nothing."""

    def __init__(self, streams: tuple[Any, Any]) -> None:
        self.streams = streams

    async def __aenter__(self) -> tuple[Any, Any]:
        return self.streams

    async def __aexit__(self, *exc: object) -> None:
        return None


def describe(target: Any) -> str:
    if isinstance(target, str):
        return target
    return " ".join([target.command, *target.args])


def reason(exc: BaseException | None) -> str:
    """The first real error inside the SDK's exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}" if exc is not None else "closed"
