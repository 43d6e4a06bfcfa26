"""``jetrl sft --data FILE``: the warm start from a dataset file instead of the envs' oracles.

The file is a chat dataset (``jetrl export``'s Parquet or JSONL, or any with ``messages`` in the OpenAI
shape and optional ``tools``). Each conversation becomes the trajectory the rollout would have recorded
had an oracle played it (``shared.chat.tokenize_conversation``: the same prompt, the same tokens, loss
mask on the assistant turns only) and is published on the run's TRAJ stream, where the trainer in SFT
mode trains on it exactly as on oracle demonstrations (``trainer.sft_min_reward`` and
``trainer.sft_context_weight`` included). No env, rollout or controller runs.

The file is read as it is published, cycled (epoch after epoch) until the trainer has taken
``trainer.steps`` steps, and never further ahead of the trainer than two batches (``trainer.max_groups``
conversations each): memory and the stream stay bounded whatever the file's size. Every row is checked
before anything starts; a bad one stops the command with its row number and field.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
from nats.js import JetStreamContext
from nats.js.errors import NotFoundError

from jetrl.dataset import Conversation, DatasetError, read_conversations
from jetrl.errors import CliError
from shared.bus import connect
from shared.chat import tokenize_conversation
from shared.config import JetRLConfig
from shared.delivery import publish_retrying
from shared.messages import BadMessage, EpisodeStatus, Trajectory, TurnInfo, encode
from shared.subjects import Subjects

log = structlog.get_logger()

ENGINE_ID = "dataset"
"""The engine id of a turn that came from a dataset file (its policy version is -1, like an oracle's)."""
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,128}$")


@dataclass
class DatasetSummary:
    rows: int
    trained: int
    """Rows with at least ``trainer.sft_min_reward``: the ones the trainer will train on."""
    tasks: dict[str, int]


def check_dataset(path: str | Path, min_reward: float) -> DatasetSummary:
    """Read every row once, checked (a ``DatasetError`` names the first bad one); what the file holds."""
    rows = trained = 0
    tasks: dict[str, int] = {}
    for conv in read_conversations(path):
        rows += 1
        trained += conv.reward >= min_reward
        tasks[conv.task] = tasks.get(conv.task, 0) + 1
    if not trained:
        raise DatasetError(f"{path}: none of its {rows} rows has a reward >= trainer.sft_min_reward "
                           f"({min_reward:g}): nothing to train on")
    return DatasetSummary(rows=rows, trained=trained, tasks=tasks)


def demonstration(conv: Conversation, tokenizer: Any, tool_format: str, episode_id: str) -> Trajectory:
    """The trajectory an oracle would have left for this conversation: its own group of one."""
    tok = tokenize_conversation(conv.messages, conv.tools, tokenizer, tool_format)
    task = conv.task if _TOKEN.match(conv.task) else "data"  # the task names a subject: TRAJ's traj.<task>
    return Trajectory(
        episode_id=episode_id, group_id=episode_id, task=task, task_id=conv.task_id, split="train", group_size=1,
        tokens=tok.tokens, logprobs=[0.0] * len(tok.tokens), loss_mask=tok.loss_mask, prompt_len=tok.prompt_len,
        turns=[TurnInfo(start=s, end=e, engine_id=ENGINE_ID, policy_version=-1) for s, e in tok.turns],
        reward=conv.reward, status=conv.status or EpisodeStatus.COMPLETED, replica_id="jetrl-sft-data",
        messages=conv.messages, tools=conv.tools)


async def _backlog(js: JetStreamContext, subjects: Subjects, published: int) -> int:
    """Trajectories the trainer has not finished with: on its consumer, waiting or held; before the trainer
    made its consumer, everything published so far."""
    try:
        info = await js.consumer_info(subjects.traj_stream, subjects.trainer_consumer)
    except NotFoundError:
        return published
    return int(info.num_pending + info.num_ack_pending)


async def feed(cfg: JetRLConfig, path: str | Path, stop: asyncio.Event) -> int:
    """Publish the file's conversations as demonstrations until ``stop``; returns how many were published."""
    from shared.model import load_tokenizer, resolve_model  # torch and transformers: only for this command

    tokenizer = await asyncio.to_thread(lambda: load_tokenizer(resolve_model(cfg.model)))
    subjects = Subjects(cfg.nats.prefix)
    bound = 2 * max(cfg.trainer.max_groups, cfg.trainer.min_groups)
    nc = await connect(cfg.nats, "jetrl-sft-data", role="admin")  # `jetrl sft` made the run's users
    js = nc.jetstream()
    published = epoch = 0
    try:
        while not stop.is_set():
            for conv in read_conversations(path):
                while await _backlog(js, subjects, published) >= bound and not stop.is_set():
                    await asyncio.sleep(0.2)
                if stop.is_set():
                    break
                traj = demonstration(conv, tokenizer, cfg.rollout.tool_format, f"data-{epoch}-{conv.row}")
                try:
                    payload = encode(traj)
                except BadMessage as exc:  # a conversation over the message limit: said, and left out
                    log.warning("dataset_row_skipped", row=conv.row, reason=exc.reason)
                    continue
                await publish_retrying(js, subjects.traj(traj.task), payload, headers={"Nats-Msg-Id": traj.episode_id})
                published += 1
            epoch += 1
    finally:
        await nc.close()
    return published


def describe_dataset(path: str | Path, cfg: JetRLConfig) -> str:
    """Check the model and the file (a bad row: a ``DatasetError`` naming it), and say what the run will train
    on. No task is played, so the task mix is not checked (``preflight(serving=True)``)."""
    from jetrl.preflight import check_model

    problems = check_model(cfg.model.name)
    if problems:
        raise CliError("\n".join(problems))
    summary = check_dataset(path, cfg.trainer.sft_min_reward)
    tasks = ", ".join(f"{t} {n}" for t, n in sorted(summary.tasks.items()))
    return (f"{path}: {summary.rows} conversations ({tasks}), {summary.trained} with reward >= "
            f"{cfg.trainer.sft_min_reward:g}; each step trains on up to {cfg.trainer.max_groups}")


async def follow_with_dataset(follow: Awaitable[int], cfg: JetRLConfig, path: str | Path) -> int:
    """``jetrl sft --data``: the run's progress (``follow``, which ends with the trainer) while the file's
    conversations are published; the feed stops when the run does. A feed that fails ends the run."""
    stop = asyncio.Event()
    feeding = asyncio.create_task(feed(cfg, path, stop))
    following = asyncio.ensure_future(follow)
    try:
        done, _ = await asyncio.wait({feeding, following}, return_when=asyncio.FIRST_COMPLETED)
        if feeding in done and feeding.exception() is not None:
            following.cancel()
            raise feeding.exception()  # type: ignore[misc]
        return await following
    finally:
        stop.set()
        feeding.cancel()
        await asyncio.gather(feeding, return_exceptions=True)
