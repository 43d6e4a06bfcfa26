"""The skeleton every service's entry point shares, in the shape of nats.py's micro example: SIGTERM or
SIGINT sets ``stop``; an ``AsyncExitStack`` holds the connection and everything the service opens, and
closes them in reverse order when it ends; background jobs run supervised (shared/lifecycle.py) and are
cancelled on the way out. An entry point reads::

    svc = Service(cfg, "trainer", replica_name("trainer"))   # logging; stop on SIGTERM from now on
    ...                                                       # load what takes long before connecting
    async with svc:
        await svc.connect()                                   # connect, watch, declare the topology
        svc.heartbeat({"steps": ...})
        ...                                                   # start the service, then wait for svc.stop

The skeleton lives beside shared/lifecycle.py, not in it: shared/delivery.py uses lifecycle's ``supervise``,
and this module uses the bus."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable, Coroutine, Iterator
from contextlib import AsyncExitStack, contextmanager
from types import TracebackType
from typing import Any

import structlog
import uvicorn
from nats.aio.client import Client
from nats.js import JetStreamContext

from shared.bus import claim_replica_user, connect, declare_topology, heartbeat_loop
from shared.config import JetRLConfig
from shared.lifecycle import close_connection, install_stop, stop_if_connection_closed, supervise
from shared.log import setup_logging
from shared.subjects import Subjects


class Service:
    """One running service: its config, names, logger, subjects, stop event and exit stack; after
    ``connect`` also its NATS connection and JetStream context.

    ``name`` is what its logs and heartbeats call it (``env-gsm8k``); ``role`` what the topology and its
    NATS user know it as (``env``; the name where not given). ``grace_s`` bounds a clean shutdown after
    SIGTERM (``install_stop``)."""

    nc: Client
    js: JetStreamContext

    def __init__(self, cfg: JetRLConfig, name: str, replica_id: str, *, role: str | None = None,
                 grace_s: float = 8.0) -> None:
        self.cfg = cfg
        self.name = name
        self.role = role or name
        self.replica_id = replica_id
        self.log = setup_logging(name, replica_id, cfg.run.log_level, cfg.run.log_format)
        self.subjects = Subjects(cfg.nats.prefix)
        self.stop = asyncio.Event()
        install_stop(self.stop, grace_s=grace_s)
        self.stack = AsyncExitStack()

    async def __aenter__(self) -> Service:
        await self.stack.__aenter__()
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        trace: TracebackType | None) -> bool:
        return await self.stack.__aexit__(kind, error, trace)

    async def connect(self) -> None:
        """Connect to NATS (drained, or closed, as the service exits), stop the service if the server
        closes the connection, and declare what of the topology this role declares. A service given several
        replica users (compose: ``nats.replica_passwords``) first claims one, and is that replica from then on."""
        if self.cfg.nats.replica_passwords:
            users = len(self.cfg.nats.replica_passwords)
            self.replica_id = await claim_replica_user(self.cfg.nats, self.name, self.subjects)
            structlog.contextvars.bind_contextvars(replica_id=self.replica_id)
            self.log.info("replica_user_claimed", user=self.replica_id, of=users)
        self.nc = await connect(self.cfg.nats, self.replica_id, role=self.role)
        self.stack.push_async_callback(close_connection, self.nc)
        self.background("connection_watch", stop_if_connection_closed(self.nc, self.stop), restart_s=None)
        self.js = self.nc.jetstream()
        await declare_topology(self.js, self.subjects, self.cfg.nats, role=self.role)

    def background(self, name: str, job: Coroutine[Any, Any, Any] | Callable[[], Awaitable[Any]], *,
                   restart_s: float | None = 1.0) -> asyncio.Task[Any]:
        """Run ``job`` supervised until the service exits: restarted ``restart_s`` after a failure, or,
        with ``restart_s`` None (a job that holds something only it can open, a bound socket), the
        service stops with a failure exit code."""
        task = supervise(job, name, self.stop, restart_s=restart_s)
        self.stack.callback(task.cancel)
        return task

    def heartbeat(self, info: dict[str, Any], *, name: str | None = None) -> asyncio.Task[Any]:
        """This replica's key in the registry, refreshed until the service exits (``heartbeat_loop``)."""
        return self.background("heartbeat", lambda: heartbeat_loop(self.js, self.subjects, name or self.name,
                                                                    self.replica_id, info))


def listen(host: str, port: int) -> tuple[socket.socket, str]:
    """A socket bound for an HTTP server, and its URL (port 0: the OS picks a free one); bound before the
    server starts, so that the URL can be written down first."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    return sock, f"http://{host}:{sock.getsockname()[1]}"


class HttpServer(uvicorn.Server):
    """uvicorn inside a service. The service's ``stop`` owns SIGINT and SIGTERM, and the server ends when
    the service sets ``should_exit`` on its way out. uvicorn would otherwise take the signals for itself,
    end its own serve(), and raise the signal again once it returned. The service would then see a second
    signal while stopping, and a second signal exits at once: a probe's report would not be written."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def http_server(app: Any) -> HttpServer:
    return HttpServer(uvicorn.Config(app, log_level="warning", lifespan="off"))
