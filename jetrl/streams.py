"""A small client for tools that read a run's trajectories: every finished episode, decoded and typed.

    from jetrl.streams import subscribe

    async with subscribe(url, creds, tasks=["mytask"], from_start=True) as trajectories:
        async for traj in trajectories:          # shared.messages.Trajectory
            print(traj.task, traj.reward, trajectories.position.sequence)

``creds`` is a ``NatsConfig`` (its ``user`` / ``password`` / ``password_file`` / ``creds_file``, or an
``auth_dir`` whose ``observer.password`` is read): the client connects as the read-only observer
(``shared/auth.py``), whose replies arrive under the observer's own inbox prefix (``shared.auth`` names
it; ``shared.bus.connect`` sets it). ``open_run(run_dir)`` gives both for a run directory, and starts a
nats-server on the run's own store when the run is over; ``from_context(file)`` reads them from the file
``jetrl creds observer`` writes.

The stream is read through an ephemeral pull consumer (no acks, removed by the server a minute after
the client goes away), ``batch`` messages at a time: memory stays bounded however long the stream.
When the connection drops or the consumer is lost, the reader makes a new consumer from the sequence
after the last one it yielded: nothing is skipped and nothing yielded twice. ``position`` is that last
message's stream sequence and time: store it and pass ``start_sequence=position.sequence + 1`` to resume.
A message that does not decode is skipped and counted (``bad``): one poison message must not stop a tool.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import socket
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import structlog
from nats.aio.client import Client
from nats.errors import TimeoutError as NatsTimeout
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from jetrl.errors import CliError
from shared.auth import generate_passwords, server_authorization
from shared.bus import connect
from shared.config import NatsConfig, load_config
from shared.messages import BadMessage, Trajectory, decode
from shared.natsd import EmbeddedNats, StoreInUse
from shared.subjects import Subjects, check_token

log = structlog.get_logger()

CONSUMER_IDLE_S = 60.0
"""The server removes a reader's consumer this long after the reader stopped asking."""


@dataclass(frozen=True)
class StreamPosition:
    """Where a message sits in the TRAJ stream: its sequence (resume from ``sequence + 1``) and when
    the server stored it (unix seconds)."""

    sequence: int
    time: float


class TrajectoryStream:
    """The trajectories of one run, in the order the stream stored them (see the module docstring).

    ``follow=False`` stops at the last trajectory stored when the reader started (an export);
    ``follow=True`` waits for new ones until closed (a live tool).
    """

    def __init__(self, url: str, creds: NatsConfig | None = None, *, prefix: str | None = None,
                 tasks: Sequence[str] | None = None, from_start: bool = True, start_sequence: int | None = None,
                 since: float | None = None, follow: bool = True, batch: int = 32, name: str = "jetrl-streams",
                 retry_s: float = 1.0) -> None:
        self.url = url
        self.creds = creds if creds is not None else NatsConfig()
        self.subjects = Subjects(prefix or self.creds.prefix)
        self.tasks = [check_token(t, "task") for t in tasks or []]
        self.from_start, self.start_sequence, self.since = from_start, start_sequence, since
        self.follow, self.batch, self.name, self.retry_s = follow, batch, name, retry_s
        self.position: StreamPosition | None = None
        """The last message yielded (or skipped as bad): resume after it."""
        self.pending: int | None = None
        """Matching messages stored after ``position`` when it was read (None before the first)."""
        self.bad = 0
        """Messages that did not decode as a Trajectory (skipped)."""
        self.reconnects = 0
        """Times the reader made a new consumer after losing its connection or consumer."""
        self.nc: Client | None = None
        self._end: int | None = None  # follow=False: the stream's last sequence when the reader started
        self._iterator: AsyncIterator[Trajectory] | None = None

    # ------------------------------------------------------------------ lifecycle
    async def __aenter__(self) -> TrajectoryStream:
        await self.open()
        return self

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()

    async def open(self) -> None:
        if self.nc is None:
            self.nc = await connect(self.creds, self.name, url=self.url, role="observer")

    async def close(self) -> None:
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()
            self.nc = None

    def __aiter__(self) -> AsyncIterator[Trajectory]:
        if self._iterator is None:
            self._iterator = self._read()
        return self._iterator

    async def stored(self) -> int:
        """Messages the stream holds now on the subjects this reader follows (every task: the stream's
        count; some tasks: the sum over their subjects), for a progress bar's total."""
        await self.open()
        assert self.nc is not None
        js = self.nc.jetstream()
        if not self.tasks:
            return int((await js.stream_info(self.subjects.traj_stream)).state.messages)
        info = await js.stream_info(self.subjects.traj_stream, subjects_filter=self.subjects.traj(">"))
        wanted = {self.subjects.traj(t) for t in self.tasks}
        return sum(n for subject, n in (info.state.subjects or {}).items() if subject in wanted)

    # ------------------------------------------------------------------ reading
    def _consumer_config(self) -> ConsumerConfig:
        config = ConsumerConfig(ack_policy=AckPolicy.NONE, inactive_threshold=CONSUMER_IDLE_S, max_ack_pending=-1)
        if len(self.tasks) == 1:
            config.filter_subject = self.subjects.traj(self.tasks[0])
        elif self.tasks:
            config.filter_subjects = [self.subjects.traj(t) for t in self.tasks]
        else:
            config.filter_subject = self.subjects.traj(">")
        if self.position is not None:  # a reader that lost its consumer goes on after the last message it had
            config.deliver_policy, config.opt_start_seq = DeliverPolicy.BY_START_SEQUENCE, self.position.sequence + 1
        elif self.start_sequence is not None:
            config.deliver_policy, config.opt_start_seq = DeliverPolicy.BY_START_SEQUENCE, self.start_sequence
        elif self.since is not None:
            config.deliver_policy = DeliverPolicy.BY_START_TIME
            config.opt_start_time = dt.datetime.fromtimestamp(self.since, dt.UTC).isoformat().replace("+00:00", "Z")
        else:
            config.deliver_policy = DeliverPolicy.ALL if self.from_start else DeliverPolicy.NEW
        return config

    async def _read(self) -> AsyncIterator[Trajectory]:
        await self.open()
        assert self.nc is not None
        js = self.nc.jetstream()
        if not self.follow:
            self._end = int((await js.stream_info(self.subjects.traj_stream)).state.last_seq)
        sub = None
        reconnects = delivered = 0  # the connection's reconnects when the consumer was made; its last delivery
        try:
            while True:
                try:
                    if sub is not None and self.nc.stats["reconnects"] != reconnects:
                        # a reconnect may have lost deliveries in flight (no acks: the consumer counts them as
                        # done): a new consumer from the message after the last one we yielded
                        raise ConnectionError("reconnected")
                    if sub is None:
                        config = self._consumer_config()  # nats-py files a single filter under the subject
                        reconnects, delivered = self.nc.stats["reconnects"], 0
                        sub = await js.pull_subscribe(config.filter_subject or "", stream=self.subjects.traj_stream,
                                                      config=config)
                    try:
                        msgs = await sub.fetch(self.batch, timeout=1.0)
                    except (NatsTimeout, TimeoutError):
                        if not self.follow and await self._caught_up(sub):
                            return
                        continue
                    if msgs and msgs[0].metadata.sequence.consumer != delivered + 1:
                        raise ConnectionError(f"deliveries {delivered + 1}..{msgs[0].metadata.sequence.consumer - 1} "
                                              "were lost")
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the connection or the consumer went away: a new one from where we are
                    log.info("trajectory_stream_retry", error=repr(exc), after=self.position)
                    self.reconnects += 1
                    sub = await self._drop(sub)
                    await asyncio.sleep(self.retry_s)
                    continue
                for msg in msgs:
                    meta = msg.metadata
                    delivered = meta.sequence.consumer
                    self.position = StreamPosition(meta.sequence.stream, meta.timestamp.timestamp())
                    self.pending = meta.num_pending
                    try:
                        traj = decode(msg.data, Trajectory)
                    except BadMessage as exc:
                        self.bad += 1
                        log.warning("trajectory_stream_bad_message", sequence=meta.sequence.stream, reason=exc.reason)
                        traj = None
                    if traj is not None:
                        yield traj
                    if self._end is not None and self.position.sequence >= self._end:
                        return
        finally:
            await self._drop(sub)

    async def _caught_up(self, sub: object) -> bool:
        """follow=False and a fetch found nothing: done when nothing that matches is left before the end."""
        if self._end is not None and self.position is not None and self.position.sequence >= self._end:
            return True
        info = await sub.consumer_info()  # type: ignore[attr-defined]
        return info.num_pending == 0

    @staticmethod
    async def _drop(sub: object) -> None:
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()  # type: ignore[attr-defined]
        return None


def subscribe(url: str, creds: NatsConfig | None = None, *, prefix: str | None = None,
              tasks: Sequence[str] | None = None, from_start: bool = True, start_sequence: int | None = None,
              since: float | None = None, follow: bool = True, batch: int = 32) -> TrajectoryStream:
    """The trajectories on ``url`` under ``prefix`` (default: ``creds.prefix``), as the observer.

    ``tasks``: only these tasks (default every task). Where to start: ``start_sequence`` (resume),
    else ``since`` (unix time), else the first stored (``from_start``) or only new ones. ``follow``:
    wait for new trajectories (True) or stop at the end of what is stored (False)."""
    return TrajectoryStream(url, creds, prefix=prefix, tasks=tasks, from_start=from_start,
                            start_sequence=start_sequence, since=since, follow=follow, batch=batch)


# ---------------------------------------------------------------------------- a run directory
@dataclass
class RunAccess:
    """How to reach a run's streams: its NATS URL and the client settings (prefix, credentials)."""

    url: str
    nats: NatsConfig
    restarted: bool = False
    """True when the run was over and its store was opened by a nats-server of our own."""


def _listening(url: str, timeout_s: float = 1.0) -> bool:
    for part in url.split(","):
        host_port = part.strip().split("://", 1)[-1].rsplit("@", 1)[-1]
        host, _, port = host_port.rpartition(":")
        try:
            with socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout_s):
                return True
        except (OSError, ValueError):
            continue
    return False


def from_context(path: str | Path) -> RunAccess:
    """The access a context file of ``jetrl creds observer`` gives (its URL, user, password and the run's
    prefix); the inbox prefix follows from the user (``shared.auth``)."""
    try:
        ctx = json.loads(Path(path).read_text())
        return RunAccess(ctx["url"], NatsConfig(prefix=ctx["jetrl_prefix"], user=ctx.get("user") or "",
                                                password=ctx.get("password") or ""))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CliError(f"{path}: not a context file of `jetrl creds observer` ({exc})") from None


@contextlib.contextmanager
def open_run(run_dir: str | Path, overrides: Sequence[str] = ()) -> Iterator[RunAccess]:
    """A run directory's streams: the live run's nats-server, or, when the run is over, a nats-server of
    our own on the run's JetStream store (``<run>/nats``, the same users and passwords), stopped on exit."""
    run_dir = Path(run_dir)
    url_file, config_file = run_dir / "nats.url", run_dir / "config.toml"
    if not url_file.is_file() or not config_file.is_file():
        raise CliError(f"{run_dir} is not a run directory (no nats.url or config.toml): give --run-dir "
                                "of a jetrl up / sft / eval run, or --url and --prefix")
    cfg = load_config(config_file, list(overrides))
    url, *rest = url_file.read_text().split()
    cfg.nats.prefix = rest[0] if rest else cfg.nats.prefix
    store = run_dir / "nats"
    if _listening(url) or not (store / "jetstream").is_dir():
        yield RunAccess(url, cfg.nats)
        return
    authorization = ""
    if cfg.nats.auth_dir:  # the run's users, read back from their password files
        authorization = server_authorization(Subjects(cfg.nats.prefix), generate_passwords(cfg.nats.auth_dir))
    server = EmbeddedNats(store, authorization=authorization, log_file=store / "nats-server.reopened.log")
    try:
        local = server.start()
    except StoreInUse as exc:  # the run's own server is there after all (restarting): never a second one on its store
        raise CliError(str(exc)) from None
    try:
        yield RunAccess(local, cfg.nats, restarted=True)
    finally:
        server.stop()
