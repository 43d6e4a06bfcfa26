"""One MCP client session per episode, on one event loop thread shared by all of a replica's episodes.

The MCP SDK is asynchronous and an episode's calls come from the env host's worker threads, so each
session lives in a task on ``LoopThread`` and the threads hand it calls (``run``). The task holds the
``async with Client(...)`` the whole episode long (the SDK's transports must be entered and left by one
task) and leaves it on ``close``: a stdio server process is stopped, an HTTP session is ended. A server
that dies or hangs never leaves a call waiting: a call ends when its result comes, when the session's
transport closes (``ServerGone``) or after its timeout (``TimeoutError``, the host's env_timeout).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Coroutine
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

    def __init__(self, loop: LoopThread, target: Any, protocol: str, startup_timeout_s: float) -> None:
        self.loop = loop
        self.client: Any = None
        self.error: BaseException | None = None
        self.stop: asyncio.Event | None = None
        self.gone: asyncio.Event | None = None
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
            async with Client(target, mode=protocol) as client:
                self.client = client
                ready.set_result(None)
                await self.stop.wait()
        except BaseException as exc:  # the transport closed under the session (or never opened)
            self.error = exc
            if not ready.done():
                ready.set_exception(RuntimeError(f"cannot open an MCP session with {describe(target)}: "
                                                 f"{reason(exc)}"))
            elif not self.stop.is_set():
                log.warning("mcp_session_lost", server=describe(target), error=reason(exc))
        finally:
            self.gone.set()

    async def _call(self, method: str, *args: Any) -> Any:
        from mcp.shared.exceptions import MCPError

        assert self.gone is not None
        if self.gone.is_set():
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
            if self.gone.is_set() or "connection closed" in str(exc).lower():
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


def describe(target: Any) -> str:
    if isinstance(target, str):
        return target
    return " ".join([target.command, *target.args])


def reason(exc: BaseException | None) -> str:
    """The first real error inside the SDK's exception groups."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}" if exc is not None else "closed"
