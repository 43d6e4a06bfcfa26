"""One episode, turn by turn, against the env service, and the one place its ``Trajectory`` is made.

The record is token in, token out: the opening as the tokenizer writes it (no loss), each assistant turn's
tokens as its ``TurnSource`` made them (trained on), each observation (no loss); the conversation beside
it in the OpenAI form, each assistant message exactly as the env got it. Each action and observation is
published as an event as it happens (the trajectory viewer, ``jetrl reverify``). No trajectory is longer
than ``max_context_tokens``: an episode with no room for another turn ends as ``agent_context_limit``.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from services.rollout.turns import ContextLimit, Exchange, TurnSource, TurnState
from shared.chat import render_observation, render_opening
from shared.config import RolloutConfig
from shared.delivery import publish_retrying
from shared.envapi import EnvClient, episode_seed
from shared.keepalive import touch, touching
from shared.messages import ActionEvent, EpisodeJob, EpisodeStatus, ObservationEvent, Trajectory, TurnInfo, encode
from shared.subjects import Subjects

log = structlog.get_logger()


@dataclass
class EpisodeBuffer:
    """Token-in/token-out record of one episode as it is played."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    turns: list[TurnInfo] = field(default_factory=list)

    def add(self, tokens: list[int], logprobs: list[float] | None, trainable: bool) -> None:
        self.tokens.extend(tokens)
        self.logprobs.extend(logprobs if logprobs is not None else [0.0] * len(tokens))
        self.loss_mask.extend([1 if trainable else 0] * len(tokens))


@dataclass
class EpisodeRecord:
    """What an episode leaves for its trajectory: what was played, how it ended, what the env said of it."""

    status: str
    reward: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)
    buffer: EpisodeBuffer = field(default_factory=EpisodeBuffer)
    prompt_len: int = 0
    level: int = 0
    task_kind: str = ""
    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def env_failed(cls) -> EpisodeRecord:
        """An episode the env could not run: it still completes its group, with nothing to learn from."""
        return cls(status=EpisodeStatus.ENV_ERROR, metrics={"error": 1.0})

    def trajectory(self, job: EpisodeJob, replica_id: str) -> Trajectory:
        buf = self.buffer
        return Trajectory(
            episode_id=job.episode_id, group_id=job.group_id, task=job.task, task_id=job.task_id, split=job.split,
            group_size=job.group_size, tokens=buf.tokens, logprobs=buf.logprobs, loss_mask=buf.loss_mask,
            prompt_len=self.prompt_len, turns=buf.turns, reward=self.reward, status=self.status,
            replica_id=replica_id, metrics=self.metrics, temperature=job.temperature, level=self.level,
            task_kind=self.task_kind, messages=self.messages, tools=self.tools,
        )


class EpisodePlayer:
    def __init__(self, source: TurnSource, tokenizer: Any, cfg: RolloutConfig, js: JetStreamContext,
                 subjects: Subjects, replica_id: str) -> None:
        self.source, self.tokenizer, self.cfg, self.js, self.subjects = source, tokenizer, cfg, js, subjects
        self.replica_id = replica_id
        self.end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def touching(self, msg: Msg | None) -> Any:
        """While a turn is generated, the job is touched every third of ``job_ack_wait_s``: a slow turn must
        not get it redelivered to another replica, which would play the episode twice."""
        return touching(msg, max(0.2, self.cfg.job_ack_wait_s / 3), "job")

    async def _publish_event(self, subject: str, payload: bytes, msg_id: str) -> None:
        """An action or observation event; retried across a NATS restart, deduplicated by ``msg_id``."""
        await publish_retrying(self.js, subject, payload, headers={"Nats-Msg-Id": msg_id})

    async def play(self, job: EpisodeJob, env: EnvClient, session_id: str, msg: Msg | None) -> EpisodeRecord:
        """Play ``job`` in a fresh env session ``session_id``; ``msg`` (its job) is touched as it goes."""
        cfg = self.cfg
        started = time.monotonic()
        opening = await env.start(session_id, job.task_id, job.split, seed=episode_seed(job.episode_id),
                                  timeout_s=cfg.env_start_timeout_s)
        buf = EpisodeBuffer()
        opening_text = render_opening(opening.messages, opening.tools, cfg.tool_format)
        buf.add(self.tokenizer.encode(opening_text, add_special_tokens=False), None, trainable=False)
        state = TurnState(job=job, env=env, env_replica=opening.replica_id, session_id=session_id, turn=0,
                          tokens=buf.tokens, opening=opening.messages, tools=opening.tools)
        prompt_len = len(buf.tokens)
        reward, status, metrics = 0.0, EpisodeStatus.RUNNING, {}
        closed = False  # the env session ended (finish, cancel); otherwise we cancel it on the way out
        try:
            for turn in range(opening.max_turns):
                state.turn = turn
                if len(buf.tokens) + job.max_new_tokens > cfg.max_context_tokens:
                    status = EpisodeStatus.AGENT_CONTEXT_LIMIT
                    await env.cancel(opening.replica_id, session_id, reason=status)
                    closed = True
                    break
                try:
                    async with self.touching(msg):
                        played = await self.source.next_turn(state)
                except ContextLimit:
                    status = EpisodeStatus.AGENT_CONTEXT_LIMIT
                    await env.cancel(opening.replica_id, session_id, reason=status)
                    closed = True
                    break
                gen, action = played.generation, played.message
                start = len(buf.tokens)
                buf.add(gen.tokens, gen.logprobs, trainable=True)
                buf.turns.append(TurnInfo(start=start, end=len(buf.tokens), engine_id=gen.engine_id,
                                          policy_version=gen.policy_version, weights_digest=gen.weights_digest))
                if gen.finish_reason != "stop":  # cut off: close the turn as the template would
                    buf.add([self.end_of_turn], None, trainable=False)
                await self._publish_event(self.subjects.action(job.task, job.episode_id), encode(ActionEvent(
                    episode_id=job.episode_id, task=job.task, turn=turn, replica_id=self.replica_id,
                    engine_id=gen.engine_id, policy_version=gen.policy_version, message=action,
                    opening=opening.messages if turn == 0 else [])),
                    f"{session_id}-act-{turn}")
                step = await env.interact(opening.replica_id, session_id, action, turn=turn)
                state.exchanges.append(Exchange(action, step.messages))
                await self._publish_event(self.subjects.observation(job.task, job.episode_id), encode(ObservationEvent(
                    episode_id=job.episode_id, task=job.task, turn=turn, messages=step.messages, reward=step.reward,
                    finish=step.finish, status=step.status)), f"{session_id}-obs-{turn}")
                if msg is not None:
                    await touch(msg, "job")  # long episodes are not redelivered while we are alive
                reward, status, metrics = step.reward, step.status, step.metrics
                if step.finish:
                    closed = True
                    break
                observed = self.tokenizer.encode(render_observation(step.messages), add_special_tokens=False)
                if len(buf.tokens) + len(observed) + job.max_new_tokens > cfg.max_context_tokens:
                    # no room for another turn after it: end here, so that no trajectory is ever longer than
                    # max_context_tokens (the trainer refuses longer ones: trainer.max_tokens)
                    status = EpisodeStatus.AGENT_CONTEXT_LIMIT
                    await env.cancel(opening.replica_id, session_id, reason=status)
                    closed = True
                    break
                buf.add(observed, None, trainable=False)
            else:
                status = EpisodeStatus.TASK_LIMIT_REACHED
                await env.cancel(opening.replica_id, session_id, reason=status)
                closed = True
        except BaseException:  # engine failure, broker trouble, shutdown: free the env session now
            if not closed:
                await asyncio.shield(self._cancel_quietly(env, opening.replica_id, session_id))
            raise
        conversation = list(opening.messages)  # each action as the env got it, then its answer
        for exchange in state.exchanges:
            conversation += [exchange.message, *exchange.answer]
        return EpisodeRecord(status=status, reward=reward, metrics=dict(metrics, duration_s=time.monotonic() - started),
                             buffer=buf, prompt_len=prompt_len, level=opening.level, task_kind=opening.task_kind,
                             messages=conversation, tools=opening.tools)

    async def _cancel_quietly(self, env: EnvClient, replica_id: str, session_id: str) -> None:
        try:
            await env.cancel(replica_id, session_id, reason="rollout_aborted")
        except Exception as exc:  # the env may be the thing that failed; its reaper cleans up then
            log.warning("env_cancel_failed", session_id=session_id, error=repr(exc))
