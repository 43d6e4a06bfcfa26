"""Rollout replica entry point: ``python -m services.rollout [--config FILE] [--rollout.key=value ...]``."""

from __future__ import annotations

import asyncio
import os
import sys

from services.rollout.engines import EngineHandoff, build_engine, run_with_engine_on_main_thread
from services.rollout.serve import serve_openai
from services.rollout.worker import RolloutWorker
from shared.auth import manages_topology
from shared.bus import replica_name
from shared.config import from_argv
from shared.lifecycle import exit_code
from shared.model import load_tokenizer, quiet_transformers, resolve_model
from shared.service import Service
from shared.signing import verifier_for


async def main(argv: list[str], handoff: EngineHandoff | None = None) -> None:
    cfg, _ = from_argv(argv)
    rollout = cfg.rollout
    svc = Service(cfg, "rollout", replica_name("rollout", cfg.nats))  # gone within 10 s of SIGTERM, NATS or not
    quiet_transformers()
    model_path = await asyncio.to_thread(resolve_model, cfg.model)
    tokenizer = load_tokenizer(model_path)
    engine_id = rollout.engine_id or svc.replica_id
    engine = build_engine(cfg, model_path, tokenizer, engine_id, own_thread=handoff is None)
    if handoff is not None:
        handoff.give(engine)
    async with svc:
        if engine is not None:
            svc.stack.callback(engine.close)
        await svc.connect()
        worker = RolloutWorker(svc.nc, svc.js, svc.subjects, rollout, engine, tokenizer, svc.replica_id, model_path,
                               tasks=list(cfg.run.tasks))
        worker.creates_durables = manages_topology(cfg.nats, "rollout")
        worker.trainer_verifier = verifier_for(cfg.nats, "trainer")
        if worker.chat_api is not None:
            svc.stack.push_async_callback(worker.chat_api.close)
        if engine is not None and rollout.serve_pool:
            svc.stack.push_async_callback((await worker.serve_pool()).stop)
        svc.background("metrics_report", worker.report_metrics)
        # `jetrl serve` is a rollout user's replica that plays no episodes: its own role on the dashboard
        svc.heartbeat({"engine_id": engine_id, "engine": rollout.engine, "kind": rollout.engine_kind,
                       "pid": os.getpid()}, name="rollout-serve" if cfg.serve.enabled else "rollout")
        if cfg.serve.enabled:  # the policy over the OpenAI API (jetrl serve); its socket is bound once: no restart
            svc.background("openai_api", lambda: serve_openai(cfg, engine, tokenizer, svc.nc, svc.subjects),
                           restart_s=None)
        if engine is not None and rollout.follow_weights:
            svc.background("weights_follower", worker.follow_weights)
        svc.log.info("rollout_ready", model=str(model_path), engine=rollout.engine, engine_id=engine_id,
                     kind=rollout.engine_kind, concurrency=rollout.concurrency, serve_jobs=rollout.serve_jobs)
        await (worker.run(svc.stop) if rollout.serve_jobs else svc.stop.wait())
        svc.log.info("rollout_stopping", episodes_done=worker.episodes_done,
                     **(vars(engine.stats) if hasattr(engine, "stats") else {}))


if __name__ == "__main__":
    run_with_engine_on_main_thread(lambda handoff: main(sys.argv[1:], handoff))
    sys.exit(exit_code())
