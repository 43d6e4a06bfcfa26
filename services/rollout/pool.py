"""The engine pool (cross-policy sampling): each replica may offer its engine on ``Subjects.gen_pool`` (a
NATS micro service, one queue group: whichever replica is free answers), and may ask the pool for a turn
instead of its own engine. A request is one turn: prompt token ids in, a ``GenerateReply`` out."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog
from nats.aio.client import Client
from nats.micro import add_service
from nats.micro.request import Request

from services.rollout.engine import Engine, Generation
from shared.config import RolloutConfig
from shared.envapi import ERROR_CODE_HEADER, ERROR_HEADER
from shared.lifecycle import supervise
from shared.messages import BadMessage, GenerateReply, GenerateRequest, decode, encode
from shared.subjects import Subjects

log = structlog.get_logger()


async def generate_on_pool(nc: Client, subjects: Subjects, cfg: RolloutConfig, prompt: list[int],
                           max_new_tokens: int, temperature: float) -> Generation:
    """One turn from whichever pool engine answers; raises when none does or it refused."""
    reply = await nc.request(subjects.gen_pool(cfg.pool), encode(GenerateRequest(
        prompt=prompt, max_new_tokens=max_new_tokens, temperature=temperature)), timeout=cfg.env_timeout_s)
    if reply.headers and ERROR_CODE_HEADER in reply.headers:
        raise RuntimeError(reply.headers.get(ERROR_HEADER, "pool engine error"))
    g = decode(reply.data, GenerateReply)
    return Generation(g.tokens, g.logprobs, g.finish_reason, g.engine_id, g.policy_version, g.weights_digest)


def check_generate(req: GenerateRequest, vocab: int, max_context_tokens: int) -> str | None:
    """Bounds the schema cannot know: token ids this tokenizer has, a context the engine can hold."""
    if not req.prompt:
        return "generate_request.prompt: empty"
    if max(req.prompt) >= vocab:
        return f"generate_request.prompt: token id {max(req.prompt)} is outside the vocabulary ({vocab})"
    if not 0 < req.max_new_tokens <= max_context_tokens - len(req.prompt):
        return (f"generate_request.max_new_tokens: {req.max_new_tokens} does not fit the context "
                f"({len(req.prompt)} prompt tokens of {max_context_tokens})")
    if not 0.0 <= req.temperature <= 10.0 or req.temperature != req.temperature:
        return f"generate_request.temperature: {req.temperature} is outside [0, 10]"
    return None


async def serve_pool(nc: Client, subjects: Subjects, cfg: RolloutConfig, engine: Engine, vocab: int,
                     name_weights: Callable[[Generation], Generation]) -> Any:
    """Offer ``engine`` to the pool: requests from any replica, one turn each, batched by the engine with
    everything else it generates. ``name_weights`` fills in the digest of the weights each turn played with."""
    async def generate(request: Request) -> None:
        async def run() -> None:
            try:
                req = decode(request.data, GenerateRequest)
                problem = check_generate(req, vocab, cfg.max_context_tokens)
                if problem:  # a hostile request must not reach the engine's shared batch
                    await request.respond_error("400", problem)
                    return
                g = name_weights(await engine.generate(req.prompt, req.max_new_tokens, req.temperature))
                await request.respond(encode(GenerateReply(tokens=g.tokens, logprobs=g.logprobs,
                                                           finish_reason=g.finish_reason, engine_id=g.engine_id,
                                                           policy_version=g.policy_version,
                                                           weights_digest=g.weights_digest)))
            except BadMessage as exc:
                await request.respond_error(str(exc.code), exc.reason)
            except Exception as exc:
                log.exception("pool_generate_error")
                await request.respond_error("500", repr(exc))

        supervise(run(), "pool_request", None)  # concurrent requests: the engine batches them

    service = await add_service(nc, name=f"{subjects.prefix}-engine", version="1.0.0",
                                metadata={"engine_id": engine.engine_id, "kind": cfg.engine_kind})
    await service.add_endpoint(name="generate", subject=subjects.gen_pool(cfg.pool), handler=generate,
                               queue_group=subjects.gen_queue_group)
    return service
