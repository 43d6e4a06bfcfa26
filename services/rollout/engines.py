"""Which model engine a rollout replica runs, and on which thread: the engine's loop runs on the process's
main thread and asyncio (NATS, the worker, the HTTP API) on a second one."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any

from services.rollout.continuous import ContinuousEngine
from services.rollout.engine import Engine, HFEngine, QueuedEngine
from shared.config import JetRLConfig
from shared.lifecycle import forward_signals, run


def build_engine(cfg: JetRLConfig, model_path: Path, tokenizer: Any, engine_id: str, *,
                 own_thread: bool) -> Engine | None:
    """The engine ``rollout.engine`` names; None for the oracle (it plays the env's scripted expert) and
    the OpenAI engine (the worker calls an OpenAI endpoint): no model needed. ``own_thread`` False: the
    caller runs its loop (``EngineHandoff``)."""
    rollout = cfg.rollout
    end_of_turn = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    if rollout.engine == "continuous":
        continuous = rollout.continuous
        return ContinuousEngine(model_path, engine_id, end_of_turn, threads=rollout.torch_threads,
                                max_batch=continuous.max_batch, prefill_chunk=continuous.prefill_chunk,
                                cache_tokens=continuous.kv_cache_tokens, slot_tokens=continuous.kv_slot_tokens,
                                max_context=rollout.max_context_tokens, seed=cfg.run.seed, device=rollout.device,
                                own_thread=own_thread, matmul_dtype=continuous.matmul_dtype,
                                adapter_versions=rollout.adapter_versions, adapter_keep_every=rollout.stale_every)
    if rollout.engine == "hf":
        return HFEngine(model_path, engine_id, end_of_turn, tokenizer.pad_token_id, threads=rollout.torch_threads,
                        device=rollout.device, own_thread=own_thread, adapter_versions=rollout.adapter_versions,
                        adapter_keep_every=rollout.stale_every)
    if rollout.engine == "vllm":  # scale-out: vllm is installed only where it runs (make venv-vllm)
        from services.rollout.vllm_engine import VLLMEngine
        vllm = rollout.vllm
        return VLLMEngine(model_path, engine_id, end_of_turn, dtype=vllm.dtype,
                          max_model_len=vllm.max_model_len or rollout.max_context_tokens,
                          gpu_memory_utilization=vllm.gpu_memory_utilization, kv_cache_gb=vllm.kv_cache_gb,
                          enforce_eager=vllm.enforce_eager, seed=cfg.run.seed)
    return None  # one of ENGINES_WITHOUT_MODEL: the config admits no other engine


class EngineHandoff:
    """The model engine that the service builds on the asyncio thread, handed to the process's main thread to
    run its loop there (``QueuedEngine.serve_here``): in process, CPU decode steps ran ~35 % faster on the
    main thread than on a second one (docs/benchmarks.md, "SmolLM2 on 2 cores")."""

    def __init__(self) -> None:
        self._engines: queue.Queue[QueuedEngine | None] = queue.Queue()

    def give(self, engine: Engine | None) -> None:
        """Hand over ``engine`` if its loop can run on the main thread; else release the main thread."""
        self._engines.put(engine if isinstance(engine, (ContinuousEngine, HFEngine)) else None)

    def serve(self) -> None:
        """On the main thread: run the engine that ``give`` hands over, until it is closed; returns at once
        on ``give(None)`` (no engine to run, or the service ended before building one)."""
        engine = self._engines.get()
        if engine is not None:
            engine.serve_here()


def run_with_engine_on_main_thread(main: Callable[[EngineHandoff], Coroutine[Any, Any, None]]) -> None:
    """``main(handoff)`` on a second thread's event loop; the engine it hands over runs on this one."""
    handoff = EngineHandoff()
    forward_signals()
    failure: list[BaseException] = []

    def service() -> None:
        try:
            run(main(handoff))
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
