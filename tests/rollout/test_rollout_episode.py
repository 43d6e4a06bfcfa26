"""What the rollout worker writes for one episode, pinned: the trajectory (tokens, logprobs, loss mask,
turns, reward, status, conversation, tools) and the action and observation events of episodes played by
each turn source against the sums env on a real nats-server: the env's oracle, the tiny model greedy
(token in, token out), and the tiny model behind the OpenAI chat API (``jetrl serve``'s app, in process).

The expected records are in ``tests/rollout/data/rollout_episodes_pin.json``, written by a run of this test with
``JETRL_WRITE_GOLDEN=1``; every field is compared except the clock's (``created_at``, ``ts``,
``metrics.duration_s``). A change in what an episode records shows here as the field that moved."""

from __future__ import annotations

import asyncio
import json
import os
import socket
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch
import uvicorn

from services.envs.host import EnvHost
from services.rollout.engine import HFEngine
from services.rollout.openai_api import ChatCompletions, create_app
from services.rollout.worker import RolloutWorker
from shared.config import EnvConfig, ModelConfig
from shared.messages import ActionEvent, EpisodeJob, ObservationEvent, Trajectory, decode
from shared.model import load_tokenizer, quiet_transformers, resolve_model
from tests.sums_env import SumEnv

GOLDEN = Path(__file__).parent / "data" / "rollout_episodes_pin.json"
CLOCK_FIELDS = ("created_at", "ts")
LOGPROB_TOLERANCE = 1e-4  # float order on another CPU; the token ids themselves must match exactly


def record(message: msgspec.Struct) -> dict[str, Any]:
    """The message as plain data, without the fields that only say when it was made."""
    data = msgspec.to_builtins(message)
    for key in CLOCK_FIELDS:
        data.pop(key, None)
    if isinstance(data.get("metrics"), dict):
        data["metrics"].pop("duration_s", None)
    return data


class Recorder:
    """Every action and observation event of the namespace, in arrival order, per episode."""

    def __init__(self) -> None:
        self.events: dict[str, list[dict[str, Any]]] = {}

    async def start(self, nc: Any, subjects: Any) -> list[Any]:
        async def on_action(msg: Any) -> None:
            event = decode(msg.data, ActionEvent)
            self.events.setdefault(event.episode_id, []).append(record(event))

        async def on_observation(msg: Any) -> None:
            event = decode(msg.data, ObservationEvent)
            self.events.setdefault(event.episode_id, []).append(record(event))

        return [await nc.subscribe(subjects.action(), cb=on_action),
                await nc.subscribe(subjects.observation(), cb=on_observation)]


def assert_same(actual: Any, expected: Any, where: str) -> None:
    """Exact equality, floats of logprobs within LOGPROB_TOLERANCE; the failure names the path that differs."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and sorted(actual) == sorted(expected), f"{where}: keys {sorted(actual)}"
        for key in expected:
            assert_same(actual[key], expected[key], f"{where}.{key}")
    elif isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), \
            f"{where}: {len(actual) if isinstance(actual, list) else actual!r} items, expected {len(expected)}"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{where}[{i}]")
    elif isinstance(expected, float) and where.split("[")[0].endswith("logprobs"):
        assert abs(actual - expected) <= LOGPROB_TOLERANCE, f"{where}: {actual} != {expected}"
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


@pytest.fixture
async def sums_host(nc: Any, subjects: Any) -> Any:
    host = EnvHost(SumEnv(), EnvConfig(), subjects, "env-sums-pinned")
    service = await host.serve(nc, nc.jetstream())
    yield host
    await service.stop()
    await host.shutdown()


@pytest.fixture(scope="module")
def tiny() -> Any:
    quiet_transformers()
    path = resolve_model(ModelConfig())
    tokenizer = load_tokenizer(path)
    threads = torch.get_num_threads()
    engine = HFEngine(path, "hf-pinned", [tokenizer.convert_tokens_to_ids("<|im_end|>")], tokenizer.pad_token_id)
    torch.set_num_threads(threads)  # the engine set this thread's count too: later tests' float order is theirs
    yield tokenizer, engine
    engine.close()


async def serve_chat_api(engine: Any, tokenizer: Any, config: Any) -> tuple[str, uvicorn.Server, asyncio.Task[Any]]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    chat = ChatCompletions(engine, tokenizer, config.serve, config.rollout.tool_format,
                           config.rollout.max_context_tokens)
    server = uvicorn.Server(uvicorn.Config(create_app(chat), log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.05)
    return f"http://127.0.0.1:{sock.getsockname()[1]}/v1", server, task


def job(episode_id: str, task_id: str, max_new_tokens: int = 512) -> EpisodeJob:
    return EpisodeJob(episode_id=episode_id, group_id="g-" + episode_id, task="sums", task_id=task_id,
                      max_new_tokens=max_new_tokens, temperature=0.0)


async def play_every_source(nc: Any, subjects: Any, config: Any, tiny: Any) -> dict[str, Any]:
    tokenizer, engine = tiny
    recorder = Recorder()
    subs = await recorder.start(nc, subjects)
    trajectories: dict[str, Trajectory] = {}
    js = nc.jetstream()

    config.rollout.engine = "oracle"
    oracle = RolloutWorker(nc, js, subjects, config.rollout, None, tokenizer, "rollout-oracle")
    for episode_id, task_id in (("oracle-0", "train-0"), ("oracle-1", "train-1")):
        trajectories[episode_id] = await oracle.play(job(episode_id, task_id), attempt=1)
    context = config.rollout.max_context_tokens
    # the same task again, with one token too few for its second turn: it ends after the first
    config.rollout.max_context_tokens = trajectories["oracle-0"].turns[-1].start + 15
    trajectories["oracle-short"] = await oracle.play(job("oracle-short", "train-0", max_new_tokens=16), attempt=1)
    config.rollout.max_context_tokens = context

    config.rollout.engine = "hf"
    model = RolloutWorker(nc, js, subjects, config.rollout, engine, tokenizer, "rollout-model")
    trajectories["model-0"] = await model.play(job("model-0", "train-3", max_new_tokens=24), attempt=1)
    trajectories["model-1"] = await model.play(job("model-1", "train-4", max_new_tokens=6), attempt=2)

    url, server, serving = await serve_chat_api(engine, tokenizer, config)
    try:
        config.rollout.engine, config.rollout.openai.base_url, config.rollout.openai.model = ("openai", url,
                                                                                         config.serve.model_name)
        api = RolloutWorker(nc, js, subjects, config.rollout, None, tokenizer, "rollout-api")
        trajectories["api-0"] = await api.play(job("api-0", "train-5", max_new_tokens=24), attempt=1)
        assert api.chat_api is not None
        await api.chat_api.close()
    finally:
        server.should_exit = True
        await serving
    await nc.flush()
    await asyncio.sleep(0.2)  # the last events reach the recorder
    for sub in subs:
        await sub.unsubscribe()
    return {episode_id: {"trajectory": record(traj), "events": recorder.events.get(episode_id, [])}
            for episode_id, traj in trajectories.items()}


async def test_each_turn_source_records_its_episodes_as_pinned(nc, subjects, config, sums_host, tiny) -> None:
    played = await play_every_source(nc, subjects, config, tiny)
    if os.environ.get("JETRL_WRITE_GOLDEN") == "1":
        GOLDEN.parent.mkdir(exist_ok=True)
        GOLDEN.write_text(json.dumps(played, indent=1, sort_keys=True) + "\n")
    expected = json.loads(GOLDEN.read_text())
    assert sorted(played) == sorted(expected)
    for episode_id in expected:
        assert_same(json.loads(json.dumps(played[episode_id])), expected[episode_id], episode_id)
    # the pinned episodes cover each way an episode ends and each kind of turn
    statuses = {e: expected[e]["trajectory"]["status"] for e in expected}
    assert statuses["oracle-0"] == "completed" and statuses["oracle-short"] == "agent_context_limit"
    assert {t["engine_id"] for t in expected["api-0"]["trajectory"]["turns"]} == {f"openai:{config.serve.model_name}"}
    assert all(expected[e]["trajectory"]["messages"] for e in expected)
