"""Rollout replica entry point: ``python -m services.rollout [--config FILE] [--rollout.key=value ...]``."""

from __future__ import annotations

import asyncio
import os
import queue
import socket
import sys
import threading
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import uvicorn

from services.rollout.continuous import ContinuousEngine
from services.rollout.engine import Engine, HFEngine, QueuedEngine
from services.rollout.worker import RolloutWorker
from shared.auth import manages_topology
from shared.bus import connect, declare_topology, heartbeat_loop, replica_name
from shared.config import JetRLConfig, from_argv
from shared.lifecycle import (
    close_connection,
    exit_code,
    forward_signals,
    install_stop,
    run,
    stop_if_connection_closed,
    supervise,
)
from shared.log import setup_logging
from shared.messages import BadMessage, TrainingFinished, decode
from shared.model import load_tokenizer, quiet_transformers, resolve_model
from shared.signing import SignatureError, verifier_for
from shared.subjects import Subjects


class EngineHandoff:
    """The model engine that ``main`` builds on the asyncio thread, handed to the process's main thread to
    run its loop there (``QueuedEngine.serve_here``): in process, CPU decode steps ran ~35 % faster on the
    main thread than on a second one (docs/benchmarks.md, "SmolLM2 on 2 cores")."""

    def __init__(self) -> None:
        self._engines: queue.Queue[QueuedEngine | None] = queue.Queue()

    def give(self, engine: QueuedEngine | None) -> None:
        self._engines.put(engine)

    def serve(self) -> None:
        """On the main thread: run the engine that ``give`` hands over, until it is closed; returns at once
        on ``give(None)`` (no engine to run, or ``main`` ended before building one)."""
        engine = self._engines.get()
        if engine is not None:
            engine.serve_here()


async def main(argv: list[str], handoff: EngineHandoff | None = None) -> None:
    cfg, _ = from_argv(argv)
    replica_id = replica_name("rollout", cfg.nats)
    log = setup_logging("rollout", replica_id, cfg.run.log_level, cfg.run.log_format)
    subjects = Subjects(cfg.nats.prefix)
    stop = asyncio.Event()
    install_stop(stop, grace_s=8.0)  # gone within 10 s of SIGTERM, NATS or not

    quiet_transformers()
    model_path = await asyncio.to_thread(resolve_model, cfg.model)
    tokenizer = load_tokenizer(model_path)
    engine_id = cfg.rollout.engine_id or replica_id
    engine = None  # the oracle "engine" plays the env's scripted expert: no model needed
    if cfg.rollout.engine == "continuous":
        engine = ContinuousEngine(model_path, engine_id, [tokenizer.convert_tokens_to_ids("<|im_end|>")],
                                  threads=cfg.rollout.torch_threads, max_batch=cfg.rollout.max_batch,
                                  prefill_chunk=cfg.rollout.prefill_chunk, cache_tokens=cfg.rollout.kv_cache_tokens,
                                  slot_tokens=cfg.rollout.kv_slot_tokens,
                                  max_context=cfg.rollout.max_context_tokens, seed=cfg.run.seed,
                                  device=cfg.rollout.device, own_thread=handoff is None,
                                  matmul_dtype=cfg.rollout.matmul_dtype)
    elif cfg.rollout.engine == "hf":
        engine = HFEngine(model_path, engine_id, [tokenizer.convert_tokens_to_ids("<|im_end|>")],
                          tokenizer.pad_token_id, threads=cfg.rollout.torch_threads, device=cfg.rollout.device,
                          own_thread=handoff is None)
    elif cfg.rollout.engine == "vllm":  # scale-out: vllm is installed only where it runs (make venv-vllm)
        from services.rollout.vllm_engine import VLLMEngine
        engine = VLLMEngine(model_path, engine_id, [tokenizer.convert_tokens_to_ids("<|im_end|>")],
                            dtype=cfg.rollout.vllm_dtype,
                            max_model_len=cfg.rollout.vllm_max_model_len or cfg.rollout.max_context_tokens,
                            gpu_memory_utilization=cfg.rollout.vllm_gpu_memory_utilization,
                            kv_cache_gb=cfg.rollout.vllm_kv_cache_gb, enforce_eager=cfg.rollout.vllm_enforce_eager,
                            seed=cfg.run.seed)
    elif cfg.rollout.engine not in ("oracle", "openai"):
        raise SystemExit(f"unknown rollout.engine {cfg.rollout.engine!r}")
    if handoff is not None:
        handoff.give(engine if isinstance(engine, (ContinuousEngine, HFEngine)) else None)
    async with AsyncExitStack() as stack:
        if engine is not None:
            stack.callback(engine.close)
        nc = await connect(cfg.nats, replica_id, role="rollout")
        stack.push_async_callback(close_connection, nc)
        watch = supervise(stop_if_connection_closed(nc, stop), "connection_watch", stop)
        stack.callback(watch.cancel)
        js = nc.jetstream()
        await declare_topology(js, subjects, cfg.nats, cfg.controller.heartbeat_ttl_s, role="rollout")
        worker = RolloutWorker(nc, js, subjects, cfg.rollout, engine, tokenizer, replica_id, model_path,
                               tasks=list(cfg.controller.tasks))
        worker.creates_durables = manages_topology(cfg.nats, "rollout")
        worker.trainer_verifier = verifier_for(cfg.nats, "trainer")
        if worker.chat_api is not None:
            stack.push_async_callback(worker.chat_api.close)
        beat_info = {"engine_id": engine_id, "engine": cfg.rollout.engine, "kind": cfg.rollout.engine_kind,
                     "pid": os.getpid()}
        jobs: dict[str, Callable[[], Awaitable[None]]] = {
            "metrics_report": worker.report_metrics,
            # `jetrl serve` is a rollout user's replica that plays no episodes: its own role on the dashboard
            "heartbeat": lambda: heartbeat_loop(js, subjects, "rollout-serve" if cfg.serve.enabled else "rollout",
                                                replica_id, beat_info)}
        if cfg.serve.enabled:  # the policy over the OpenAI API (jetrl serve); its socket is bound once: no restart
            jobs["openai_api"] = lambda: serve_openai(cfg, engine, tokenizer, log, nc, subjects)
        if engine is not None:
            if cfg.rollout.follow_weights:
                jobs["weights_follower"] = worker.follow_weights
            if cfg.rollout.serve_pool:
                pool_service = await worker.serve_pool()
                stack.push_async_callback(pool_service.stop)
        for name, job in jobs.items():
            bg = supervise(job, name, stop, restart_s=None if name == "openai_api" else 1.0)
            stack.callback(bg.cancel)
        log.info("rollout_ready", model=str(model_path), engine=cfg.rollout.engine, engine_id=engine_id,
                 kind=cfg.rollout.engine_kind, concurrency=cfg.rollout.concurrency, serve_jobs=cfg.rollout.serve_jobs)
        if cfg.rollout.serve_jobs:
            await worker.run(stop)
        else:
            await stop.wait()
        log.info("rollout_stopping", episodes_done=worker.episodes_done, **(vars(engine.stats) if hasattr(engine, "stats") else {}))


async def serve_openai(cfg: JetRLConfig, engine: Engine | None, tokenizer: Any, log: Any, nc: Any,
                       subjects: Subjects) -> None:
    """POST /v1/chat/completions with this replica's engine, until cancelled; the URL goes to <run>/serve.url.
    The trainer's TrainingFinished marks the run it follows as ended (``/health`` says so)."""
    from services.rollout.openai_api import ChatCompletions, create_app

    if engine is None:
        raise SystemExit(f"serve.enabled needs a model engine, not rollout.engine={cfg.rollout.engine!r}")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((cfg.serve.host, cfg.serve.port))  # port 0: the OS picks a free one
    url = f"http://{cfg.serve.host}:{sock.getsockname()[1]}/v1"
    chat = ChatCompletions(engine, tokenizer, cfg.serve, cfg.rollout.tool_format, cfg.rollout.max_context_tokens)

    trainer = verifier_for(cfg.nats, "trainer")  # the trainer's signed word alone ends the run (shared/signing.py)

    async def on_finished(msg: Any) -> None:
        try:
            done = trainer.check(decode(msg.data, TrainingFinished))
        except BadMessage as exc:
            log.warning("bad_training_finished", reason=exc.reason)
            return
        except SignatureError as exc:
            log.warning("unsigned_training_finished_refused", reason=str(exc))
            return
        chat.run_ended = {"step": done.step, "policy_version": done.policy_version, "trainer": done.replica_id,
                          "ts": done.ts}
        log.info("followed_run_ended", step=done.step, policy_version=done.policy_version)

    finished = await nc.subscribe(subjects.training_finished, cb=on_finished)
    server = uvicorn.Server(uvicorn.Config(create_app(chat), log_level="warning", lifespan="off"))
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "serve.url").write_text(url + "\n")
    log.info("openai_api_ready", url=url, model=cfg.serve.model_name)
    try:
        await server.serve(sockets=[sock])
    finally:
        server.should_exit = True
        await finished.unsubscribe()


def run_with_engine_on_main_thread(argv: list[str]) -> None:
    """asyncio (NATS, the worker, the HTTP API) on a second thread; the model engine's loop on this one."""
    handoff = EngineHandoff()
    forward_signals()
    failure: list[BaseException] = []

    def service() -> None:
        try:
            run(main(argv, handoff))
        except BaseException as exc:  # SystemExit included: re-raised on the main thread
            failure.append(exc)
        finally:
            handoff.give(None)  # the main thread is not left waiting for an engine that never comes

    thread = threading.Thread(target=service, name="asyncio")
    thread.start()
    handoff.serve()
    thread.join()
    if failure:
        raise failure[0]


if __name__ == "__main__":
    run_with_engine_on_main_thread(sys.argv[1:])
    sys.exit(exit_code())
