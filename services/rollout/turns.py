"""Where an episode's assistant turns come from: one ``TurnSource`` per replica, chosen by
``rollout.engine``, asked for each turn with the episode so far.

* ``OracleTurns`` (``oracle``): the env's own solution, for SFT data and smoke runs;
* ``EngineTurns`` (a model engine): token in, token out, from this replica's engine or, with
  ``cross_policy_prob``, from an engine of the pool (``services/rollout/pool.py``);
* ``OpenAITurns`` (``openai``): an OpenAI-compatible server, sent the conversation in the API's form.

Every turn comes back as the tokens the trajectory records for it (as our tokenizer writes it, with
logprobs where a policy made them) and the assistant message the env gets.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any, Protocol

import structlog
from nats.aio.client import Client

from services.rollout.adapters import BASE_VERSION
from services.rollout.engine import Engine, Generation
from services.rollout.openai_client import ContextLimit, OpenAIChatClient, history_after_turn
from services.rollout.pool import generate_on_pool
from shared.chat import parse_assistant, render_tool_call
from shared.config import RolloutConfig
from shared.envapi import EnvClient
from shared.messages import EpisodeJob
from shared.subjects import Subjects

log = structlog.get_logger()

ORACLE_ENGINE_ID = "oracle"
ORACLE_POLICY_VERSION = -1  # oracle and API turns come from no policy of ours: for SFT, never for RL ratios

__all__ = ["ContextLimit", "ORACLE_ENGINE_ID", "ORACLE_POLICY_VERSION", "AssistantTurn", "EngineTurns", "Exchange",
           "OpenAITurns", "OracleTurns", "TurnSource", "TurnState", "turn_source"]


@dataclass
class Exchange:
    """One played turn: the assistant message as the env got it, then the env's answer."""

    message: dict[str, Any]
    answer: list[dict[str, Any]]


@dataclass
class TurnState:
    """The episode so far, as a turn source sees it before the next turn."""

    job: EpisodeJob
    env: EnvClient
    env_replica: str  # the env replica holding the session
    session_id: str
    turn: int
    tokens: list[int]  # every token so far: the opening, each turn and each observation as the tokenizer writes them
    opening: list[dict[str, Any]]  # the env's opening messages (OpenAI form)
    tools: list[dict[str, Any]]
    exchanges: list[Exchange] = field(default_factory=list)


@dataclass
class AssistantTurn:
    generation: Generation  # the tokens the trajectory records for this turn, and who made them
    message: dict[str, Any]  # the assistant message the env gets


class TurnSource(Protocol):
    async def next_turn(self, state: TurnState) -> AssistantTurn:
        """The next assistant turn; raises ``ContextLimit`` when the conversation no longer fits the model."""
        ...


def weights_named(gen: Generation, digests: dict[int, str]) -> Generation:
    """A turn of our engine, naming the weights it held: the digest of the version it says it played with."""
    gen.weights_digest = digests.get(gen.policy_version, "")
    return gen


def parsed(gen: Generation, tokenizer: Any, turn: int) -> AssistantTurn:
    """A generated turn and the assistant message its text says (tool calls parsed out of it)."""
    return AssistantTurn(gen, parse_assistant(tokenizer.decode(gen.tokens, skip_special_tokens=True), turn))


class OracleTurns:
    def __init__(self, tokenizer: Any, counts: dict[str, int]) -> None:
        self.tokenizer, self.counts = tokenizer, counts
        self.end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")

    async def next_turn(self, state: TurnState) -> AssistantTurn:
        self.counts["oracle"] += 1
        message = await state.env.oracle(state.env_replica, state.session_id)
        ids = self.tokenizer.encode(render_tool_call(message), add_special_tokens=False) + [self.end_of_turn]
        # the env gets the demonstration as the trajectory writes it, read back the way a policy's turn is
        return parsed(Generation(ids, [0.0] * len(ids), "stop", ORACLE_ENGINE_ID, ORACLE_POLICY_VERSION),
                      self.tokenizer, state.turn)


class EngineTurns:
    """This replica's engine, or with ``cross_policy_prob`` an engine drawn from the pool (whichever of its
    replicas answers first; the local engine when none does). With ``adapter_versions`` a cross-policy turn
    plays instead an older version this engine holds, drawn evenly (the base model among them with
    ``cross_policy_base``); the current one while it holds none. The draws are this replica's own sequence."""

    def __init__(self, engine: Engine, tokenizer: Any, nc: Client, subjects: Subjects, cfg: RolloutConfig,
                 rng: random.Random, digests: dict[int, str], counts: dict[str, int]) -> None:
        self.engine, self.tokenizer, self.nc, self.subjects, self.cfg = engine, tokenizer, nc, subjects, cfg
        self.rng, self.digests, self.counts = rng, digests, counts

    def other_versions(self) -> list[int]:
        """The versions a cross-policy turn may play in this engine: those it holds, minus the current one."""
        current = self.engine.policy_version
        return [v for v in self.engine.held_versions
                if v != current and (v != BASE_VERSION or self.cfg.cross_policy_base)]

    async def next_turn(self, state: TurnState) -> AssistantTurn:
        job = state.job
        if self.cfg.cross_policy_prob > 0 and self.rng.random() < self.cfg.cross_policy_prob:
            if self.cfg.adapter_versions > 0:
                others = self.other_versions()
                version = self.rng.choice(others) if others else None
                gen = await self.engine.generate(state.tokens, job.max_new_tokens, job.temperature, version=version)
                self.counts["held" if version is not None and gen.policy_version == version else "local"] += 1
                return parsed(weights_named(gen, self.digests), self.tokenizer, state.turn)
            try:
                gen = await generate_on_pool(self.nc, self.subjects, self.cfg, state.tokens, job.max_new_tokens,
                                             job.temperature)
                self.counts["pool"] += 1
                return parsed(gen, self.tokenizer, state.turn)
            except Exception as exc:  # no pool engine answered: generate locally rather than stall
                log.warning("pool_generate_failed", error=repr(exc))
        self.counts["local"] += 1
        gen = await self.engine.generate(state.tokens, job.max_new_tokens, job.temperature)
        return parsed(weights_named(gen, self.digests), self.tokenizer, state.turn)


class OpenAITurns:
    """An API model's turns: the server gets the conversation in the API's form and its message goes to the
    env as it is; the trajectory records that message as our tokenizer writes it, with no logprobs and no
    policy version (like the oracle's turns), the engine id naming the server's model."""

    def __init__(self, client: OpenAIChatClient, tokenizer: Any, cfg: RolloutConfig, counts: dict[str, int]) -> None:
        self.client, self.tokenizer, self.cfg, self.counts = client, tokenizer, cfg, counts
        self.end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")

    async def next_turn(self, state: TurnState) -> AssistantTurn:
        history = list(state.opening)
        for exchange in state.exchanges:
            history.extend(history_after_turn(exchange.message, exchange.answer))
        message = await self.client.complete(history, state.tools, state.job.temperature, state.job.max_new_tokens)
        self.counts["openai"] += 1
        try:
            text = render_tool_call(message)
        except (ValueError, TypeError, KeyError):  # arguments that are not JSON: keep them as the server sent them
            text = f"{message.get('content') or ''}\n<tool_call>{json.dumps(message.get('tool_calls'))}</tool_call>"
        ids = self.tokenizer.encode(text, add_special_tokens=False) + [self.end_of_turn]
        return AssistantTurn(Generation(ids, [0.0] * len(ids), "stop", f"openai:{self.cfg.openai.model}",
                                        ORACLE_POLICY_VERSION), message)


def turn_source(cfg: RolloutConfig, engine: Engine | None, tokenizer: Any, nc: Client, subjects: Subjects,
                rng: random.Random, digests: dict[int, str], counts: dict[str, int],
                chat_api: OpenAIChatClient | None) -> TurnSource:
    """The replica's source for ``rollout.engine``."""
    if chat_api is not None:
        return OpenAITurns(chat_api, tokenizer, cfg, counts)
    if cfg.engine == "oracle":
        return OracleTurns(tokenizer, counts)
    if engine is None:
        raise ValueError(f"rollout.engine={cfg.engine!r} needs a model engine")
    return EngineTurns(engine, tokenizer, nc, subjects, cfg, rng, digests, counts)
