"""The rollout replica: pull an episode job, play it against the env service turn by turn, publish the
trajectory, then ack the job. Weight announcements swap the engine's weights between turns.

Lanes (``rollout.task_concurrency``): each task pulls from its own consumer into its own slots, so a
slow task (a sandbox, a game engine) cannot take every slot from a fast one; without it, one consumer feeds
``concurrency`` slots with every task. Synchronous mode: a job naming a policy version waits for this
replica to load it before its first turn.

Exactly-once bookkeeping: the job is acked only after the trajectory's PubAck (so a replica that
dies mid-episode has its job redelivered to another replica), and trajectories carry the episode id
as ``Nats-Msg-Id`` (so a job redelivered after its trajectory was stored is deduplicated by TRAJ).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.errors import TimeoutError as NatsTimeout
from nats.js import JetStreamContext
from nats.js.errors import BadRequestError

from services.rollout.engine import Engine, Generation
from services.rollout.episode import EpisodePlayer, EpisodeRecord
from services.rollout.openai_client import OpenAIChatClient
from services.rollout.pool import serve_pool
from services.rollout.turns import ORACLE_POLICY_VERSION, turn_source, weights_named
from shared.bus import publish_metrics
from shared.config import RolloutConfig
from shared.config.rollout import ENGINES_WITHOUT_MODEL
from shared.consumers import JOB_MAX_DELIVER, bind_durable, job_consumer, job_consumer_name, job_lanes
from shared.delivery import TRANSIENT, Acker, dead_letter, decode_or_dead_letter, judge_each, publish_retrying
from shared.envapi import EnvClient, EnvError
from shared.lifecycle import supervise
from shared.messages import BadMessage, EpisodeJob, Trajectory, WeightsAnnouncement, decode, encode
from shared.model import load_state_file, merge_lora_delta, weights_from_buffer
from shared.objectread import read_object
from shared.signing import SignatureError, Verifier
from shared.subjects import Subjects

log = structlog.get_logger()

MAX_DELIVER = JOB_MAX_DELIVER
OVERLAPPING_CONSUMER = 10100  # JetStream: "filtered consumer not unique on workqueue stream"


@dataclass
class WeightsLoadTimes:
    """One weights version into the engine (bench/bench_weights.py reports these)."""

    read_s: float  # from the object store into one buffer, hashed as the chunks arrived
    hold_s: float  # from that buffer (received, verified) to the engine holding the weights
    reused_buffer: bool = False  # read into the previous version's buffer (cfg.keep_weights_buffer)


class RolloutWorker:
    def __init__(self, nc: Client, js: JetStreamContext, subjects: Subjects, cfg: RolloutConfig,
                 engine: Engine | None, tokenizer: Any, replica_id: str, model_path: Path | None = None,
                 tasks: Sequence[str] = ()) -> None:
        self.nc, self.js, self.subjects, self.cfg = nc, js, subjects, cfg
        self.tasks = list(tasks)  # the run's tasks: one lane each when rollout.task_concurrency is set
        self.model_path = model_path  # the base weights a broadcast LoRA adapter is added to
        self.base_weights: dict[str, Any] | None = None
        self._weights_buffer: bytearray | None = None  # the last version's bytes (cfg.keep_weights_buffer)
        self.engine, self.tokenizer, self.replica_id = engine, tokenizer, replica_id
        if engine is None and cfg.engine not in ENGINES_WITHOUT_MODEL:
            raise ValueError(f"rollout.engine={cfg.engine!r} needs a model engine")
        # engine = openai: turns come from an OpenAI-compatible server, in the API's message form
        self.chat_api = OpenAIChatClient(cfg.openai) if cfg.engine == "openai" else None
        # turns by where they came from; "held": an older version (or the base model) of this engine's own
        self.turn_sources: dict[str, int] = {"local": 0, "pool": 0, "held": 0, "oracle": 0, "openai": 0}
        self.weights_digests: dict[int, str] = {}  # version -> digest of the weights loaded for it (its turns name it)
        rng = random.Random(zlib.crc32(replica_id.encode()))  # this replica's own cross-policy draws
        self.player = EpisodePlayer(turn_source(cfg, engine, tokenizer, nc, subjects, rng, self.weights_digests,
                                                self.turn_sources, self.chat_api), tokenizer, cfg, js, subjects,
                                    replica_id)
        self.clients: dict[str, EnvClient] = {}
        self.episodes_done = 0
        self.active = 0
        self._weights_lock = asyncio.Lock()
        self._weights_loaded = asyncio.Condition()  # notified after each load (synchronous mode waits on it)
        self.creates_durables = True  # an open server; with per-role users the admin makes them (shared/consumers.py)
        self.trainer_verifier = Verifier("", subjects.prefix, "trainer")  # an unsigned run; __main__ sets the run's
        self.refused_signatures = 0
        self.acks = Acker("job_ack")  # confirmed in the background, retried: a stored trajectory's job is acked

    # ------------------------------------------------------------------ jobs
    def lanes(self) -> dict[str, int]:
        """Lane -> its slots: one per task with ``task_concurrency``, else ``">"`` (every task) alone."""
        return job_lanes(self.cfg, self.tasks)

    def lane_consumer(self, lane: str) -> str:
        return job_consumer_name(self.subjects, lane)

    async def subscribe_jobs(self, lane: str = ">") -> JetStreamContext.PullSubscription:
        """The durable consumer of one lane (``">"``: every task's jobs), shared by every replica."""
        return await bind_durable(self.js, self.subjects.jobs_stream, job_consumer(self.subjects, self.cfg, lane),
                                  may_create=self.creates_durables)

    async def run(self, stop: asyncio.Event) -> None:
        """Keep every lane's slots busy; fetch a job only when a slot is free (no hoarding)."""
        lanes = self.lanes()
        try:
            subs = {lane: await self.subscribe_jobs(lane) for lane in lanes}
        except BadRequestError as exc:
            if exc.err_code != OVERLAPPING_CONSUMER:
                raise
            raise RuntimeError(
                f"JOBS already has a rollout consumer whose subjects overlap these lanes ({list(lanes)}): a run "
                "uses per-task lanes (rollout.task_concurrency) or one consumer for every task, never both. "
                f"Delete the old consumers of stream {self.subjects.jobs_stream} or start on a fresh prefix.") from None
        for lane in lanes:
            await self.handle_exhausted_jobs(self.lane_consumer(lane))
        await asyncio.gather(*(self._pull(lane, subs[lane], slots, stop) for lane, slots in lanes.items()))

    async def _pull(self, lane: str, sub: JetStreamContext.PullSubscription, concurrency: int,
                    stop: asyncio.Event) -> None:
        slots = asyncio.Semaphore(concurrency)
        tasks: set[asyncio.Task[None]] = set()
        while not stop.is_set():
            try:  # a lane whose every slot is stuck must still see the stop
                await asyncio.wait_for(slots.acquire(), timeout=1.0)
            except TimeoutError:
                continue
            try:
                msgs = await sub.fetch(1, timeout=1.0)
            except (TimeoutError, NatsTimeout):
                slots.release()
                continue
            except Exception as exc:  # broker restarting: wait and retry
                slots.release()
                log.warning("job_fetch_failed", lane=lane, error=repr(exc))
                await asyncio.sleep(1.0)
                continue
            task = supervise(judge_each(self.js, self.subjects, "rollout", msgs, self._handle), "job", None)
            tasks.add(task)
            task.add_done_callback(lambda t: (tasks.discard(t), slots.release()))
        for task in tasks:  # shutting down: unacked jobs are redelivered to other replicas
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.acks.drain()

    async def _handle(self, msg: Msg) -> None:
        job = await decode_or_dead_letter(self.js, self.subjects, "rollout", msg, EpisodeJob)
        if job is None:
            return
        attempt = msg.metadata.num_delivered if msg.metadata else 1
        self.active += 1
        try:
            traj = await self.play(job, attempt, msg)
        except EnvError as exc:
            if exc.code in ("503", "504") and attempt < MAX_DELIVER:
                log.warning("episode_retry_later", episode_id=job.episode_id, error=str(exc))
                await self._nak(msg, 2.0 * attempt)
                return
            traj = None
            log.error("episode_env_failed", episode_id=job.episode_id, error=str(exc))
            await self._publish_failed(job, str(exc))
        except asyncio.CancelledError:
            raise
        except TRANSIENT as exc:  # the broker stayed away past every retry: not the episode's fault, play it again
            log.warning("episode_retry_later", episode_id=job.episode_id, error=repr(exc))
            await self._nak(msg, 2.0 * attempt)
            return
        except Exception as exc:
            log.exception("episode_failed", episode_id=job.episode_id)
            await self._publish_failed(job, repr(exc))
            traj = None
        finally:
            self.active -= 1
        self.acks.ack(msg, episode_id=job.episode_id)  # the trajectory is stored; a replay TRAJ would deduplicate
        self.episodes_done += 1
        if traj is not None:
            log.info("episode_done", task=job.task, episode_id=job.episode_id, reward=traj.reward,
                     status=traj.status, turns=len(traj.turns), tokens=len(traj.tokens), attempt=attempt)

    @staticmethod
    async def _nak(msg: Msg, delay_s: float) -> None:
        try:
            await msg.nak(delay=delay_s)
        except Exception as exc:  # unreachable broker: the job comes back after its ack wait anyway
            log.info("job_nak_failed", error=type(exc).__name__)

    async def handle_exhausted_jobs(self, consumer: str = "") -> Any:
        """A job whose every delivery failed silently (its replica died or stalled each time) would
        vanish and leave its group waiting: on the server's max-deliveries advisory, one replica (a
        queue group) dead-letters it, stores an ``env_error`` trajectory for it and removes it."""
        subject = self.subjects.max_deliveries_advisory(self.subjects.jobs_stream,
                                                        consumer or self.subjects.rollout_consumer)

        async def on_advisory(msg: Msg) -> None:
            try:
                seq = int(json.loads(msg.data)["stream_seq"])
                raw = await self.js.get_msg(self.subjects.jobs_stream, seq)
            except Exception as exc:
                log.warning("exhausted_job_unreadable", error=repr(exc))
                return
            reason = f"job ran out of its {MAX_DELIVER} deliveries (its replicas died or stalled each time)"
            await dead_letter(self.js, self.subjects, service="rollout", origin_subject=raw.subject or "",
                              reason=reason, payload=raw.data or b"")
            try:
                job = decode(raw.data or b"", EpisodeJob)
                await self._publish_failed(job, reason)
            except BadMessage:
                pass  # already dead-lettered above, with its payload
            except Exception as exc:
                log.error("exhausted_job_not_stored", error=repr(exc))
                return
            try:
                await self.js.delete_msg(self.subjects.jobs_stream, seq)
            except Exception as exc:
                log.warning("exhausted_job_delete_failed", seq=seq, error=repr(exc))

        return await self.nc.subscribe(subject, queue="rollout-exhausted", cb=on_advisory)

    async def _publish_failed(self, job: EpisodeJob, reason: str) -> None:
        """An episode the env could not run still completes its group, with nothing to learn from."""
        await self._publish_trajectory(EpisodeRecord.env_failed().trajectory(job, self.replica_id))
        log.warning("episode_env_error", episode_id=job.episode_id, reason=reason)

    async def _publish_trajectory(self, traj: Trajectory) -> None:
        await publish_retrying(self.js, self.subjects.traj(traj.task), encode(traj),
                               headers={"Nats-Msg-Id": traj.episode_id})

    # ------------------------------------------------------------------ one episode
    async def play(self, job: EpisodeJob, attempt: int, msg: Msg | None = None) -> Trajectory:
        env = self.clients.setdefault(job.task, EnvClient(self.nc, self.subjects, job.task, self.cfg.env_timeout_s))
        session_id = f"{job.episode_id}-a{attempt}"  # a redelivered job opens a fresh session
        if job.policy_version > self.engine_version():  # synchronous mode: play with that version, not older
            async with self.player.touching(msg):
                await self.wait_for_version(job.policy_version)
        record = await self.player.play(job, env, session_id, msg)
        traj = record.trajectory(job, self.replica_id)
        await self._publish_trajectory(traj)
        return traj

    def engine_version(self) -> int:
        """The version this replica plays with; an engine that does not follow the trainer (the oracle, a stale
        or a foreign pool engine) counts as holding any version: it has nothing to wait for."""
        if self.engine is None or not self.cfg.follow_weights or self.cfg.engine_kind != "current":
            return 1 << 62
        return self.engine.policy_version

    async def wait_for_version(self, version: int) -> None:
        started = time.monotonic()
        async with self._weights_loaded:
            await self._weights_loaded.wait_for(lambda: self.engine_version() >= version)
        log.info("sync_weights_waited", policy_version=version, seconds=round(time.monotonic() - started, 3))

    def with_digest(self, gen: Generation) -> Generation:
        """A turn of our engine, naming the weights it held: the digest of the version it says it played with."""
        return weights_named(gen, self.weights_digests)

    async def serve_pool(self) -> Any:
        """Offer this replica's engine to the pool: requests from any replica, one turn each."""
        assert self.engine is not None
        return await serve_pool(self.nc, self.subjects, self.cfg, self.engine, len(self.tokenizer), self.with_digest)

    # ------------------------------------------------------------------ weights
    async def follow_weights(self, poll_s: float = 5.0) -> None:
        """Follow the policy KV (the trainer writes it before announcing) and load the newest version only:
        versions that came while one loaded are skipped. Each write of the key is published on its subject
        (``Subjects.policy_entry``), which we subscribe to before reading the key, so no version published in
        between is missed; a slow poll of the key covers writes a NATS restart cut off. No consumer of our
        own on the bucket: nothing a replica could point elsewhere (shared/auth.py)."""
        newest: list[WeightsAnnouncement] = []
        refused_last: list[bytes] = [b""]  # the poll reads a refused entry again and again: count it once
        fresh = asyncio.Event()
        kv = await self.js.key_value(self.subjects.policy_kv)

        def offer(data: bytes | None, origin: str) -> None:
            if not data:
                return
            try:
                note = self.trainer_verifier.check(decode(data, WeightsAnnouncement))
            except BadMessage as exc:
                log.warning("bad_weights_entry", origin=origin, reason=exc.reason)
                return
            except SignatureError as exc:  # not the trainer's: counted, dead-lettered (once per entry), never loaded
                if data != refused_last[0]:
                    refused_last[0] = data
                    self.refused_signatures += 1
                    log.warning("unsigned_weights_refused", origin=origin, reason=str(exc))
                    supervise(dead_letter(self.js, self.subjects, service="rollout", reason=str(exc),  # held until done
                                          origin_subject=self.subjects.policy_entry, payload=data), "dead_letter", None)
                return
            if not newest or note.version > newest[0].version:
                newest[:] = [note]
                fresh.set()

        async def on_entry(msg: Msg) -> None:
            if msg.subject != self.subjects.policy_entry:  # only the one key is the policy's
                log.warning("policy_entry_refused", subject=msg.subject)
                return
            offer(msg.data, "live")

        live = await self.nc.subscribe(self.subjects.policy_entry, cb=on_entry)

        async def poll() -> None:
            while True:
                try:
                    offer((await kv.get(self.subjects.policy_version_key)).value, "poll")
                except Exception as exc:  # no version yet (the initial weights are version 0), or reconnecting
                    log.debug("policy_poll", detail=type(exc).__name__)
                await asyncio.sleep(poll_s)

        helpers = [supervise(poll, "policy_poll", None, restart_s=1.0)]
        try:
            while True:
                await fresh.wait()
                fresh.clear()
                note = newest[0]
                try:
                    await self._load(note)
                except Exception:
                    log.exception("weights_update_failed", policy_version=note.version)
                    await asyncio.sleep(1.0)
                    if self.engine is not None and self.engine.policy_version < note.version:
                        fresh.set()  # try the newest again (the next poll may bring a newer one)
        finally:
            for task in helpers:
                task.cancel()
            try:
                await live.unsubscribe()
            except Exception as exc:  # the connection is closing
                log.debug("policy_unsubscribe", error=repr(exc))

    async def _load(self, note: WeightsAnnouncement) -> WeightsLoadTimes | None:
        """Load one announced version into the engine; its times, or None when it was skipped."""
        async with self._weights_lock:
            if self.engine is None or note.version <= self.engine.policy_version:
                return None
            if self.cfg.engine_kind == "stale" and note.version - self.engine.policy_version < self.cfg.stale_every:
                return None  # a stale engine skips versions on purpose (cross-policy sampling)
            started = time.monotonic()
            # one pass: the chunks are hashed against the announcement's digest (written by the trainer only,
            # shared/auth.py) as they arrive, into one buffer the tensors below are views of
            spare = self._spare_weights_buffer()
            data = await read_object(self.js, self.subjects.weights_bucket, note.object_name,
                                     expected_digest=note.digest, into=spare)
            reused = data is spare
            del spare
            received = time.monotonic()
            state = weights_from_buffer(data)
            adapter = None
            if note.format == "lora":  # an adapter: the full weights are the base's plus B @ A
                if self.base_weights is None:
                    self.base_weights = await asyncio.to_thread(load_state_file, self.model_path)
                # an engine that holds versions (rollout.adapter_versions) keeps the adapter beside them
                adapter = state if self.cfg.adapter_versions > 0 else None
                state = await asyncio.to_thread(merge_lora_delta, self.base_weights, state)
            elif note.format != "full":
                raise ValueError(f"weights v{note.version}: unknown format {note.format!r}")
            await self.engine.update_weights(state, note.version, adapter)
            del adapter
            self.weights_digests[note.version] = note.digest  # what its turns of this version name
            playable = set(getattr(self.engine, "held_versions", ()))
            for old in sorted(self.weights_digests)[:-64]:  # a turn played with a version this old is long trained on
                if old not in playable:  # unless the engine still plays it
                    del self.weights_digests[old]
            async with self._weights_loaded:
                self._weights_loaded.notify_all()
            held = time.monotonic()
            del state
            if self.cfg.keep_weights_buffer:
                self._weights_buffer = data
            log.info("weights_loaded", policy_version=note.version, size=len(data), dtype=note.dtype, reused_buffer=reused,
                     read_s=round(received - started, 3), hold_s=round(held - received, 3),
                     seconds=round(held - started, 3))
            return WeightsLoadTimes(read_s=received - started, hold_s=held - received, reused_buffer=reused)

    def _spare_weights_buffer(self) -> bytearray | None:
        """The last version's buffer, to read the next one into, if nothing refers to it any more: every
        tensor view of it (``weights_from_buffer``) holds a reference to the bytearray, so while an engine
        still holds a view it is not overwritten (a fresh buffer is read then). Taken out of the worker
        while it is filled."""
        spare, self._weights_buffer = self._weights_buffer, None
        # 2 references: ``spare`` and getrefcount's argument; any more is a view or a holder somewhere else
        return spare if spare is not None and sys.getrefcount(spare) == 2 else None

    async def report_metrics(self, every_s: float = 5.0) -> None:
        while True:
            await asyncio.sleep(every_s)
            version = self.engine.policy_version if self.engine else ORACLE_POLICY_VERSION
            engine_stats = getattr(self.engine, "stats", None)
            engine = {f"engine/{k}": float(v) for k, v in vars(engine_stats).items()} if engine_stats else {}
            await publish_metrics(self.nc, self.subjects, "rollout", self.replica_id, version,
                                  {"rollout/episodes_done": float(self.episodes_done),
                                   "rollout/active_episodes": float(self.active),
                                   "rollout/refused_signatures": float(self.refused_signatures),
                                   **{f"rollout/turns_{k}": float(v) for k, v in self.turn_sources.items()},
                                   **engine})
