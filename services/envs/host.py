"""Serve a TaskEnv as the NATS micro service ``<prefix>-env-<task>``: start / interact / cancel /
oracle / health. Sessions live on the replica that started them, so ``start`` is load-balanced
through the queue group and the other endpoints are pinned to the replica's own subjects.

Every handler runs in its own task (a slow tool call must not hold up other sessions), decodes at
the boundary (bad input -> coded error reply + dead letter), and turns any exception into a reply.
The episodes' blocking calls (open, tool call, oracle, close) share one bounded pool of threads
(``WorkerPool`` in services/envs/workers.py, ``env.worker_threads``), not a thread per session: a
replica holds thousands of sessions. Quick calls run one after another on one lane thread (threads
running them side by side only take turns on the GIL); a call that turns out slow moves off the lane and
runs beside the others. A session's calls still run one at a time and in the order they came (its lock
is first come, first served). On shutdown every open episode is closed before the interpreter ends.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.micro import add_service
from nats.micro.request import Request, ServiceError

from services.envs.base import Episode, TaskEnv, ToolError, ToolResult
from services.envs.calls import (
    DEFAULT_CALL_ID,
    call_id_of,
    calls_to_run,
    check_arguments,
    first_call_id,
    malformed,
    parse_call,
)
from services.envs.workers import WorkerPool
from shared.config import EnvConfig
from shared.delivery import dead_letter
from shared.lifecycle import supervise
from shared.messages import (
    BadMessage,
    EnvCancel,
    EnvHealth,
    EnvInteract,
    EnvOracle,
    EnvStart,
    EnvStarted,
    EnvStep,
    EnvTaskList,
    EpisodeStatus,
    decode,
    encode,
)
from shared.subjects import Subjects

log = structlog.get_logger()


@dataclass
class Session:
    session_id: str
    task_id: str
    episode: Episode
    turns: int = 0
    invalid_actions: int = 0
    last_active: float = field(default_factory=time.monotonic)
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    closed: bool = False
    running: asyncio.Future[ToolResult] | None = None
    """The last tool call's thread; one that timed out may still run, and the episode is freed after it."""


class EnvHost:
    def __init__(self, env: TaskEnv, cfg: EnvConfig, subjects: Subjects, replica_id: str) -> None:
        self.env, self.cfg, self.subjects, self.replica_id = env, cfg, subjects, replica_id
        self.task = env.name
        self.sessions: dict[str, Session] = {}
        self.sessions_started = 0
        self.started_at = time.monotonic()
        self._tasks: set[asyncio.Task[None]] = set()
        self._closing_tasks: set[asyncio.Task[None]] = set()  # frees of sessions whose tool still runs
        self.pool = WorkerPool(cfg.worker_threads)
        self.interact_s: deque[float] = deque(maxlen=10_000)  # recent interact answer times, for health
        self.stopping = False
        self.js: JetStreamContext | None = None
        # The last replies of start / interact (per turn) / cancel: a request resent after a NATS reconnect
        # (its reply was lost) gets the same answer instead of a second session or a second tool run.
        self.replies: OrderedDict[tuple[str, str], bytes] = OrderedDict()
        # only a session's latest reply is ever asked for again: a few per open session is plenty
        self.reply_cache = max(256, 8 * cfg.max_sessions)

    def _remember(self, key: tuple[str, str], reply: bytes) -> bytes:
        self.replies[key] = reply
        while len(self.replies) > self.reply_cache:
            self.replies.popitem(last=False)
        return reply

    # ------------------------------------------------------------------ service wiring
    async def serve(self, nc: Client, js: JetStreamContext) -> Any:
        self.js = js
        s, t, r = self.subjects, self.task, self.replica_id
        service = await add_service(nc, name=s.env_service_name(t), version="1.0.0",
                                    description=f"JetRL {t} environment", metadata={"replica_id": r})
        await service.add_endpoint(name="start", subject=s.env_start(t), handler=self._spawn(self.start))
        await service.add_endpoint(name="tasks", subject=s.env_tasks(t), handler=self._spawn(self.tasks))
        await service.add_endpoint(name="health", subject=s.env_health(t), handler=self._spawn(self.health),
                                   queue_group=f"health-{r}")  # every replica answers a health request
        await service.add_endpoint(name="interact", subject=s.env_interact(t, r),
                                   handler=self._spawn(self.interact, timed=self.interact_s))
        await service.add_endpoint(name="cancel", subject=s.env_cancel(t, r), handler=self._spawn(self.cancel))
        await service.add_endpoint(name="oracle", subject=s.env_oracle(t, r), handler=self._spawn(self.oracle))
        return service

    def _spawn(self, handler: Callable[[bytes], Awaitable[bytes]],
               timed: deque[float] | None = None) -> Callable[[Request], Awaitable[None]]:
        async def run(request: Request) -> None:
            started = time.perf_counter()
            try:
                await request.respond(await handler(request.data))
                if timed is not None:
                    timed.append(time.perf_counter() - started)
            except BadMessage as exc:
                await request.respond_error(str(exc.code), exc.reason)
                if self.js is not None:
                    await dead_letter(self.js, self.subjects, service=f"env-{self.task}",
                                      origin_subject=request.subject, reason=exc.reason, payload=request.data)
            except ServiceError as exc:
                await request.respond_error(exc.code, exc.description)
            except Exception as exc:  # a bug: answer 500, count it, keep serving
                log.exception("env_handler_failed", subject=request.subject)
                await request.respond_error("500", repr(exc))

        async def dispatch(request: Request) -> None:
            task = supervise(run(request), "env_request", None)
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        return dispatch

    # ------------------------------------------------------------------ endpoints
    async def start(self, data: bytes) -> bytes:
        req = decode(data, EnvStart)
        if (req.session_id, "start") in self.replies:  # a resent start: the session it opened
            return self.replies[(req.session_id, "start")]
        if req.session_id in self.sessions:
            raise ServiceError("409", f"session {req.session_id} already exists")
        if self.stopping:
            raise ServiceError("503", f"replica {self.replica_id} is shutting down")
        if len(self.sessions) >= self.cfg.max_sessions:
            raise ServiceError("503", f"replica {self.replica_id} is at its limit of {self.cfg.max_sessions} sessions")
        opening: list[asyncio.Future[Episode]] = []
        try:
            episode = await self.pool.run(functools.partial(self.env.open, req.task_id, req.split, req.seed),
                                          started=opening.append)
        except KeyError:
            raise ServiceError("404", f"unknown {self.task} task {req.task_id!r} in split {req.split!r}") from None
        except asyncio.CancelledError:  # shutdown: the episode the thread is still opening is closed once open
            if opening:
                opening[0].add_done_callback(self._close_orphan)
            raise
        if self.stopping or req.session_id in self.sessions:  # shut down, or a duplicate start opened one too
            await self._free_episode(req.session_id, episode)
            if self.stopping:
                raise ServiceError("503", f"replica {self.replica_id} is shutting down")
            raise ServiceError("409", f"session {req.session_id} already exists")
        self.sessions[req.session_id] = Session(req.session_id, req.task_id, episode)
        self.sessions_started += 1
        log.info("session_started", task=self.task, session_id=req.session_id, task_id=req.task_id)
        level = self.env.task_level(req.task_id, req.split)
        return self._remember((req.session_id, "start"), encode(EnvStarted(
            session_id=req.session_id, replica_id=self.replica_id, messages=episode.opening(), tools=episode.tools,
            max_turns=episode.max_turns, level=level.level, task_kind=level.kind)))

    def _session(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None or session.closed:
            raise ServiceError("404", f"no open session {session_id} on replica {self.replica_id}")
        return session

    async def interact(self, data: bytes) -> bytes:
        req = decode(data, EnvInteract)
        key = (req.session_id, f"turn-{req.turn}")
        if req.turn >= 0 and key in self.replies:  # resent after a reconnect: this turn already ran
            return self.replies[key]
        session = self._session(req.session_id)
        async with session.lock:
            if req.turn >= 0 and key in self.replies:  # the first copy ran while this one waited
                return self.replies[key]
            if session.closed:
                raise ServiceError("404", f"session {req.session_id} was closed")
            session.last_active = time.monotonic()
            session.turns += 1
            results = await self._run_message(session, req.message)
            for _, result in results:
                result.content = self._truncate(result.content)
            result = results[-1][1]  # the last call that ran decides the turn's ending and reward
            if not result.finish and session.turns >= session.episode.max_turns:
                limit = session.episode.limit_reached()
                result.content = f"{result.content}\n\n{limit.content}"
                result.finish, result.reward, result.status = True, limit.reward, limit.status
            metrics = dict(result.metrics, turns=float(session.turns), invalid_actions=float(session.invalid_actions))
            if result.finish:
                await self._close(session, result.status)
            session.last_active = time.monotonic()
            messages = [{"role": "tool", "tool_call_id": call_id, "content": r.content} if r.role == "tool"
                        else {"role": r.role, "content": r.content} for call_id, r in results]
            reply = encode(EnvStep(finish=result.finish, reward=float(result.reward), status=result.status,
                                   messages=messages, metrics=metrics))
            return self._remember(key, reply) if req.turn >= 0 else reply

    def _truncate(self, content: str) -> str:
        """Every observation, error text included (it may echo a huge argument), within the limit
        (the task's own where its section overrides env.max_observation_chars)."""
        limit = self.cfg.task_value(self.task, "max_observation_chars")
        if len(content) <= limit:
            return content
        return content[:limit] + f"\n[truncated: {len(content) - limit} more characters not shown]"

    async def _run_message(self, session: Session, message: dict[str, Any]) -> list[tuple[str, ToolResult]]:
        """The calls of one assistant message that the episode's rule runs, in order, each with its result;
        the first that ends the episode is the last to run."""
        episode = session.episode
        if episode.takes_whole_message:  # the episode reads every call itself (parallel calls, graded together)
            if malformed(message):  # still the episode's to grade; counted for the well-formed rate
                session.invalid_actions += 1
            return [(first_call_id(message), await self._run(session, functools.partial(episode.respond, message)))]
        if not (message.get("tool_calls") or message.get("invalid_tool_call")):
            # a text-only turn: most tasks refuse it, some read a final answer ("Final Answer: #3") from it
            content = str(message.get("content") or "")
            return [(DEFAULT_CALL_ID, await self._run(session, functools.partial(episode.reply, content)))]
        try:
            raw_calls = calls_to_run(message, episode.calls_per_message)
        except ToolError as exc:
            return [(first_call_id(message), self._refused(session, exc))]
        results: list[tuple[str, ToolResult]] = []
        for k, raw in enumerate(raw_calls):
            call_id = call_id_of(raw, DEFAULT_CALL_ID if k == 0 else f"{DEFAULT_CALL_ID}_{k}")
            try:
                call = parse_call(raw)
                check_arguments(episode.tools, call)
            except ToolError as exc:
                result = self._refused(session, exc)
            else:
                timeout_s = max(self.cfg.action_timeout_s, episode.call_timeout_s(call) or 0.0)
                result = await self._run(session, functools.partial(episode.call, call), timeout_s)
            results.append((call_id, result))
            if result.finish:
                break
        return results

    def _refused(self, session: Session, exc: ToolError) -> ToolResult:
        session.invalid_actions += 1
        if self.cfg.invalid_action_ends_episode:
            return ToolResult(content=f"Error: {exc}", finish=True, reward=0.0, status=EpisodeStatus.INVALID_ACTION)
        return ToolResult(content=f"Error: {exc}", status=EpisodeStatus.RUNNING)

    async def _run(self, session: Session, run: Callable[[], ToolResult], timeout_s: float | None = None) -> ToolResult:
        """One call of the episode on the pool; a ToolError is the agent's, anything else ends the episode."""
        timeout_s = timeout_s or self.cfg.action_timeout_s
        try:
            # a thread cannot be stopped: one past the timeout runs on, and the episode is freed once it
            # returns (see _close)
            return await self.pool.run(run, timeout_s, started=functools.partial(setattr, session, "running"))
        except ToolError as exc:
            return self._refused(session, exc)
        except TimeoutError:  # the episode ends: its tool still runs, and the next call must not run beside it
            log.warning("tool_call_timeout", task=self.task, session_id=session.session_id, timeout_s=timeout_s)
            return ToolResult(content=f"Error: the tool call took longer than {timeout_s:g}s; the episode ends.",
                              finish=True, reward=0.0, status=EpisodeStatus.ENV_TIMEOUT)
        except Exception as exc:
            log.exception("tool_call_failed", task=self.task, session_id=session.session_id)
            return ToolResult(content=f"Environment error: {exc!r}", finish=True, reward=0.0,
                              status=EpisodeStatus.ENV_ERROR)

    async def oracle(self, data: bytes) -> bytes:
        req = decode(data, EnvOracle)
        session = self._session(req.session_id)
        call = await self.pool.run(functools.partial(self.env.oracle, session.episode))
        message: dict[str, Any] = {"role": "assistant", "content": call.content}
        if call.name:  # an empty name is a text-only turn (a final answer such as "Final Answer: #3")
            message["tool_calls"] = [{"id": f"call_{session.turns}", "type": "function",
                                      "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}]
        return encode(EnvInteract(session_id=req.session_id, message=message))

    async def cancel(self, data: bytes) -> bytes:
        req = decode(data, EnvCancel)
        if (req.session_id, "cancel") in self.replies:
            return self.replies[(req.session_id, "cancel")]
        session = self._session(req.session_id)
        await self._close(session, EpisodeStatus.CANCELLED)
        return self._remember((req.session_id, "cancel"), encode(EnvStep(
            finish=True, reward=0.0, status=EpisodeStatus.CANCELLED, messages=[], metrics={"turns": float(session.turns)})))

    async def tasks(self, data: bytes) -> bytes:
        req = decode(data, EnvTaskList)
        try:
            ids = self.env.task_ids(req.split)
        except KeyError:
            raise ServiceError("404", f"{self.task} has no split {req.split!r}") from None
        return encode(EnvTaskList(split=req.split, task_ids=list(ids)))

    async def health(self, data: bytes) -> bytes:
        counts: dict[str, int] = {}
        for split in ("train", "test"):
            counts[split] = len(self.env.task_ids(split))
        recent = sorted(self.interact_s)
        p50, p99 = (1000 * recent[int(q * (len(recent) - 1))] if recent else 0.0 for q in (0.5, 0.99))
        return encode(EnvHealth(replica_id=self.replica_id, task=self.task, sessions=len(self.sessions),
                                max_sessions=self.cfg.max_sessions, sessions_started=self.sessions_started,
                                uptime_s=time.monotonic() - self.started_at, task_counts=counts,
                                interact_ms_p50=p50, interact_ms_p99=p99))

    # ------------------------------------------------------------------ lifecycle
    async def _close(self, session: Session, status: str) -> None:
        if session.closed:
            return
        session.closed = True
        self.sessions.pop(session.session_id, None)
        if session.running is not None and not session.running.done():  # a timed-out tool is still running
            task = supervise(self._free(session, status), "session_close", None)
            self._closing_tasks.add(task)
            task.add_done_callback(self._closing_tasks.discard)
        else:
            await self._free(session, status)

    async def _free(self, session: Session, status: str) -> None:
        if session.running is not None:
            await asyncio.wait({session.running})  # never close an episode under its own running tool
        await self._free_episode(session.session_id, session.episode)
        log.info("session_closed", task=self.task, session_id=session.session_id, status=status, turns=session.turns)

    async def _free_episode(self, session_id: str, episode: Episode) -> None:
        try:
            await self.pool.run(episode.close)
        except Exception:
            log.exception("session_close_failed", session_id=session_id)

    def _close_orphan(self, future: asyncio.Future[Episode]) -> None:
        """An episode whose start was cancelled while its thread opened it: close it, never leak it."""
        if future.cancelled() or future.exception() is not None:
            return
        episode = future.result()
        try:
            self.pool.submit(episode.close)
        except RuntimeError:  # the pool is already shut: close it here, the loop is ending anyway
            episode.close()

    async def reap_idle(self, every_s: float = 5.0) -> None:
        """Close sessions whose agent went quiet (a dead rollout replica leaves them behind)."""
        while True:
            await asyncio.sleep(every_s)
            cutoff = time.monotonic() - self.cfg.session_timeout_s
            for session in [s for s in self.sessions.values() if s.last_active < cutoff and not s.lock.locked()]:
                await self._close(session, EpisodeStatus.TIMEOUT)

    async def shutdown(self, wait_s: float = 3.0) -> None:
        """Refuse new starts, let the requests in flight finish (up to ``wait_s``), then close every open
        episode through the pool and the env itself. Nothing is left for the interpreter's exit to
        tear down: thousands of SQLite connections (with Python callbacks) freed at interpreter exit
        crashed it (SIGSEGV in libpython) before."""
        self.stopping = True
        in_flight = set(self._tasks)
        if in_flight:
            await asyncio.wait(in_flight, timeout=wait_s)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        open_sessions = list(self.sessions.values())
        await asyncio.gather(*(self._close(session, EpisodeStatus.CANCELLED) for session in open_sessions))
        if self._closing_tasks:  # episodes waiting for a stuck tool: closed if it ends in time
            await asyncio.wait(set(self._closing_tasks), timeout=wait_s)
        try:
            await self.pool.run(self.env.close)
        finally:
            self.pool.close()
        log.info("env_host_stopped", task=self.task, sessions_closed=len(open_sessions),
                 stuck_tools=len(self._closing_tasks), spilled_calls=self.pool.spilled)
