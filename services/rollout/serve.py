"""The policy over the OpenAI API (``jetrl serve``): POST /v1/chat/completions with this replica's engine."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import structlog
from nats.aio.client import Client

from services.rollout.engine import Engine
from shared.config import JetRLConfig
from shared.messages import BadMessage, TrainingFinished, decode
from shared.service import http_server, listen
from shared.signing import SignatureError, verifier_for
from shared.subjects import Subjects

log = structlog.get_logger()


async def serve_openai(cfg: JetRLConfig, engine: Engine | None, tokenizer: Any, nc: Client,
                       subjects: Subjects) -> None:
    """Serve until cancelled; the URL goes to <run>/serve.url. The trainer's TrainingFinished marks the run
    it follows as ended (``/health`` says so)."""
    from services.rollout.openai_api import ChatCompletions, create_app

    if engine is None:
        raise SystemExit(f"serve.enabled needs a model engine, not rollout.engine={cfg.rollout.engine!r}")
    sock, base_url = listen(cfg.serve.host, cfg.serve.port)
    url = f"{base_url}/v1"
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
    server = http_server(create_app(chat))
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "serve.url").write_text(url + "\n")
    log.info("openai_api_ready", url=url, model=cfg.serve.model_name)
    try:
        await server.serve(sockets=[sock])
    finally:
        server.should_exit = True
        await finished.unsubscribe()
