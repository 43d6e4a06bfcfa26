"""Services in one process against a real nats-server: env host boundary, rollout dead-lettering and
episodes, the trainer's step and weight broadcast into a rollout engine, the controller's API."""

from __future__ import annotations

import asyncio
import json

import msgpack
import pytest
from litestar.testing import AsyncTestClient

from services.controller.api import create_app
from services.controller.controller import Controller
from services.controller.planner import Planner
from services.envs.host import EnvHost
from services.rollout.engine import HFEngine
from services.rollout.worker import RolloutWorker
from services.trainer.intake import Group
from services.trainer.trainer import Trainer
from shared.bus import publish_metrics
from shared.config import EnvConfig, ModelConfig
from shared.envapi import EnvClient, EnvError
from shared.messages import DeadLetter, EpisodeJob, Trajectory, TurnInfo, decode, encode
from shared.model import load_model, load_tokenizer, quiet_transformers, resolve_model


@pytest.fixture(scope="module")
def model_path():
    quiet_transformers()
    return resolve_model(ModelConfig())


@pytest.fixture
async def db_host(nc, config, subjects):
    from services.envs.db import make_env

    cfg = EnvConfig(num_train_tasks=6, num_test_tasks=2, max_sessions=3, action_timeout_s=5.0)
    host = EnvHost(make_env(cfg), cfg, subjects, "env-db-test")
    service = await host.serve(nc, nc.jetstream())
    yield host
    await service.stop()
    await host.shutdown()


async def dead_letters(nc, subjects) -> list[DeadLetter]:
    sub = await nc.jetstream().subscribe(subjects.dead_letter(">"), ordered_consumer=True)
    out = []
    try:
        while True:
            out.append(decode((await sub.next_msg(timeout=1.0)).data, DeadLetter))
    except Exception:
        pass
    await sub.unsubscribe()
    return out


async def test_env_host_answers_bad_requests_with_codes_and_keeps_serving(nc, subjects, db_host) -> None:
    client = EnvClient(nc, subjects, "db", timeout_s=10)
    # undecodable bytes -> 400 and a dead letter with the reason
    reply = await nc.request(subjects.env_start("db"), b"\x93garbage", timeout=5)
    assert reply.headers["Nats-Service-Error-Code"] == "400"
    assert "not msgpack" in reply.headers["Nats-Service-Error"]
    with pytest.raises(EnvError) as err:
        await client.start("s-unknown-task", "no-such-task")
    assert err.value.code == "404"
    with pytest.raises(EnvError) as err:
        await client.interact("env-db-test", "never-started", {"role": "assistant", "content": "hi"})
    assert err.value.code == "404"
    ids = await client.task_ids("train")
    assert len(ids) == 6
    opened = [await client.start(f"s{i}", ids[i]) for i in range(3)]
    with pytest.raises(EnvError) as err:  # the replica's session limit
        await client.start("s3", ids[3])
    assert err.value.code == "503"
    # a broken tool call is an observation, not a crash; the episode goes on
    step = await client.interact(opened[0].replica_id, "s0", {"role": "assistant", "content": "",
                                                               "invalid_tool_call": "not valid JSON"})
    assert not step.finish and "Malformed tool call" in step.messages[0]["content"]
    step = await client.interact(opened[0].replica_id, "s0", {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "drop_everything", "arguments": "{}"}}]})
    assert "Unknown tool 'drop_everything'" in step.messages[0]["content"] and step.metrics["invalid_actions"] == 2
    # the oracle solves an episode through the same endpoints
    for _ in range(15):
        action = await client.oracle(opened[1].replica_id, "s1")
        step = await client.interact(opened[1].replica_id, "s1", action)
        if step.finish:
            break
    assert step.finish and step.reward == 1.0 and step.status == "completed"
    cancelled = await client.cancel(opened[2].replica_id, "s2")
    assert cancelled.status == "cancelled"
    assert (await client.health()).sessions == 1  # s0 still open
    letters = await dead_letters(nc, subjects)
    assert len(letters) == 1 and letters[0].payload == b"\x93garbage" and letters[0].service == "env-db"


async def test_rollout_dead_letters_a_bad_job_and_plays_the_next(nc, config, subjects, db_host, model_path) -> None:
    tokenizer = load_tokenizer(model_path)
    engine = HFEngine(model_path, "hf-test", [tokenizer.convert_tokens_to_ids("<|im_end|>")], tokenizer.pad_token_id)
    config.rollout.concurrency = 1
    worker = RolloutWorker(nc, nc.jetstream(), subjects, config.rollout, engine, tokenizer, "rollout-test")
    js = nc.jetstream()
    body = msgpack.unpackb(encode(EpisodeJob(episode_id="bad", group_id="g", task="db", task_id="x")))
    body["group_size"] = "two"  # wrong type
    await js.publish(subjects.jobs("db"), msgpack.packb(body))
    task_id = (await EnvClient(nc, subjects, "db").task_ids("train"))[0]
    await js.publish(subjects.jobs("db"), encode(EpisodeJob(episode_id="good", group_id="g", task="db",
                                                            task_id=task_id, max_new_tokens=8)))
    traj_sub = await js.subscribe(subjects.traj(">"), ordered_consumer=True)
    stop = asyncio.Event()
    runner = asyncio.create_task(worker.run(stop))
    try:
        traj = decode((await traj_sub.next_msg(timeout=120)).data, Trajectory)
    finally:
        stop.set()
        await runner
        engine.close()
    assert traj.episode_id == "good" and traj.turns and traj.prompt_len > 0
    assert sum(traj.loss_mask) == sum(t.end - t.start for t in traj.turns)
    letters = await dead_letters(nc, subjects)
    assert len(letters) == 1 and "group_size: expected an integer" in letters[0].reason
    info = await js.stream_info(subjects.jobs_stream)
    assert info.state.messages == 0  # both jobs left the work queue: one acked, one terminated


def make_traj(episode: str, group: str, reward: float, tokens: list[int], logprobs: list[float]) -> Trajectory:
    mask = [0] * (len(tokens) - 3) + [1, 1, 1]
    lps = [0.0] * (len(tokens) - 3) + logprobs
    return Trajectory(episode_id=episode, group_id=group, task="db", task_id="t", split="train", group_size=2,
                      tokens=tokens, logprobs=lps, loss_mask=mask, prompt_len=len(tokens) - 3,
                      turns=[TurnInfo(start=len(tokens) - 3, end=len(tokens), engine_id="e", policy_version=0)],
                      reward=reward, status="completed", replica_id="r")


async def test_trainer_step_changes_the_policy_and_the_engine_loads_it(nc, config, subjects, model_path,
                                                                       tmp_path) -> None:
    import torch

    model = load_model(model_path)
    tokenizer = load_tokenizer(model_path)
    engine = HFEngine(model_path, "hf-test", [tokenizer.convert_tokens_to_ids("<|im_end|>")], tokenizer.pad_token_id)
    prompt = tokenizer.encode("<|im_start|>user\nSay yes<|im_end|>\n<|im_start|>assistant\n")
    gens = [await engine.generate(prompt, 3, 1.0) for _ in range(2)]
    config.trainer.lr = 1e-2
    trainer = Trainer(nc, nc.jetstream(), subjects, config.trainer, model, tmp_path, "trainer-test")
    group = Group("g1", 2)
    for i, (g, reward) in enumerate(zip(gens, [1.0, 0.0], strict=True)):
        group.add(make_traj(f"e{i}", "g1", reward, prompt + g.tokens, g.logprobs), _NoAck())
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stats = await trainer.train_step([group])
    assert stats["task/db/success"] == 0.5 and stats["train/tokens"] == 6
    # what the dashboard's "staleness of trained turns" shows: both turns trained at the version that made them
    assert stats["train/staleness_hist/0"] == 2.0 and stats["train/staleness_mean"] == 0.0
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    # The rollout side picks the new version up from the KV entry and the object store.
    worker = RolloutWorker(nc, nc.jetstream(), subjects, config.rollout, engine, tokenizer, "rollout-test")
    follower = asyncio.create_task(worker.follow_weights())
    for _ in range(100):
        if engine.policy_version == 1:
            break
        await asyncio.sleep(0.1)
    follower.cancel()
    assert engine.policy_version == 1
    # same weights on both sides: the engine's logprob of a sampled token equals the trainer model's
    gen = await engine.generate(prompt, 2, 1.0)
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt + gen.tokens])).logits[0].float(), -1)
    assert gen.policy_version == 1
    assert gen.logprobs[0] == pytest.approx(float(lp[len(prompt) - 1, gen.tokens[0]]), abs=1e-4)
    engine.close()
    row = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert row["step"] == 1 and row["policy_version"] == 1
    # A restarted trainer continues from the checkpoint, not from version 0.
    config.trainer.steps = 1
    fresh = Trainer(nc, nc.jetstream(), subjects, config.trainer, load_model(model_path), tmp_path, "trainer-2")
    assert fresh.resume() and fresh.step == 1 and fresh.policy_version == 1
    for name, value in fresh.model.state_dict().items():
        assert torch.equal(value, model.state_dict()[name]), name
    assert fresh.backend.optimizer.state_dict()["state"]  # AdamW moments came back too


async def test_lora_step_broadcasts_only_the_adapter_and_replicas_merge_it(nc, config, subjects, model_path,
                                                                            tmp_path) -> None:
    """LoRA: only the adapter trains and travels; a replica adds it to its base weights, and then scores
    tokens exactly as the trainer's model does; checkpoints hold the adapter, the export is merged."""
    import torch

    from services.rollout.continuous import ContinuousEngine
    from shared.messages import WeightsAnnouncement

    tokenizer = load_tokenizer(model_path)
    engine = ContinuousEngine(model_path, "c-test", [tokenizer.convert_tokens_to_ids("<|im_end|>")])
    prompt = tokenizer.encode("<|im_start|>user\nSay yes<|im_end|>\n<|im_start|>assistant\n")
    gens = [await engine.generate(prompt, 3, 1.0) for _ in range(2)]
    config.trainer.lr, config.trainer.lora_rank, config.trainer.lora_alpha = 5e-2, 4, 8.0
    config.trainer.steps = 2
    model = load_model(model_path)
    base = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = Trainer(nc, nc.jetstream(), subjects, config.trainer, model, tmp_path, "trainer-lora")
    trainable = [n for n, p in trainer.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    group = Group("g1", 2)
    for i, (g, reward) in enumerate(zip(gens, [1.0, 0.0], strict=True)):
        group.add(make_traj(f"e{i}", "g1", reward, prompt + g.tokens, g.logprobs), _NoAck())
    announcements = []

    async def on_weights(msg) -> None:
        announcements.append(decode(msg.data, WeightsAnnouncement))

    sub = await nc.subscribe(subjects.weights_published, cb=on_weights)
    await trainer.train_step([group])
    await nc.flush()
    await asyncio.sleep(0.2)
    await sub.unsubscribe()
    (note,) = announcements
    full = sum(v.numel() * 4 for v in base.values())
    assert note.format == "lora" and note.size < full / 10  # the adapter, not the model
    worker = RolloutWorker(nc, nc.jetstream(), subjects, config.rollout, engine, tokenizer, "rollout-lora",
                           model_path)
    await worker._load(note)
    assert engine.policy_version == 1
    gen = await engine.generate(prompt, 3, 1.0)
    with torch.no_grad():
        lp = torch.log_softmax(trainer.model(input_ids=torch.tensor([prompt + gen.tokens])).logits[0].float(), -1)
    assert gen.logprobs[0] == pytest.approx(float(lp[len(prompt) - 1, gen.tokens[0]]), abs=1e-4)
    engine.close()
    # the checkpoint holds the adapter alone; a restarted trainer gets it back
    saved = (tmp_path / "checkpoints" / "step_000001" / "model.safetensors").stat().st_size
    assert saved < full / 10
    fresh = Trainer(nc, nc.jetstream(), subjects, config.trainer, load_model(model_path), tmp_path, "trainer-lora-2")
    assert fresh.resume() and fresh.policy_version == 1
    for (name, a), (_, b) in zip(fresh.model.named_parameters(), trainer.model.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    # the export is a plain model with the adapter merged in: same logits as the adapter model
    trainer.export(tmp_path / "model")
    exported = load_model(tmp_path / "model")
    with torch.no_grad():
        want = fresh.model(input_ids=torch.tensor([prompt])).logits
        got = exported(input_ids=torch.tensor([prompt])).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


class _NoAck:
    async def ack(self) -> None:
        self.acked = True

    async def in_progress(self) -> None:
        pass


def test_planner_keeps_the_task_mix_exact() -> None:
    planner = Planner({"db": 0.5, "os": 0.25, "kg": 0.25}, {"db": ["a"], "os": ["b"], "kg": ["c"]}, seed=0)
    picks = [planner.next_group()[0] for _ in range(8)]
    assert picks.count("db") == 4 and picks.count("os") == 2 and picks.count("kg") == 2
    assert picks[:2] != ["db", "db"]  # interleaved, not clumped


async def test_controller_status_and_prometheus_metrics(nc, config, subjects) -> None:
    controller = Controller(nc, nc.jetstream(), subjects, config, "controller-test")
    await controller.follow_metrics_and_weights()
    traj = make_traj("e1", "g", 1.0, [1, 2, 3, 4], [-0.1, -0.2, -0.3])
    controller.inflight["e1"] = 0.0
    controller.books["db"].published = 2
    controller.on_trajectory(traj)
    controller.on_trajectory(traj)  # a duplicate is counted as such, not as a second episode
    await publish_metrics(nc, subjects, "trainer", "t1", 3, {"train/loss": 0.25})
    await asyncio.sleep(0.3)
    controller.replicas = await controller.read_replicas()
    async with AsyncTestClient(app=create_app(controller)) as client:
        status = (await client.get("/status")).json()
        metrics = (await client.get("/metrics")).text
    assert status["episodes_finished"] == 1 and status["duplicate_trajectories"] == 1
    assert status["tasks"]["db"]["success_rate"] == 1.0 and status["trainer"]["train/loss"] == 0.25
    assert 'jetrl_task_success_ratio{task="db"} 1.0' in metrics
    assert 'jetrl_episodes_finished_total{status="completed",task="db"} 1.0' in metrics
    assert 'jetrl_trajectories_duplicate_total 1.0' in metrics
    assert 'jetrl_trainer_loss 0.25' in metrics
    assert status["replicas"] == []
    controller.inflight["e-stale"] = 0.0  # published at the epoch: long past any timeout
    controller.expire_lost()
    assert "e-stale" not in controller.inflight and controller.status()["episodes_lost"] == 1


async def test_controller_train_limit_draws_from_the_first_training_tasks(nc, config, subjects, db_host) -> None:
    """train_limit = N: groups come from the env's first N training tasks, the ones a probe with
    eval_split=train and eval_limit=N runs (so training success is measured on the tasks trained on)."""
    every = await Controller(nc, nc.jetstream(), subjects, config, "c-all").fetch_task_ids()
    config.controller.train_limit = 3
    limited = await Controller(nc, nc.jetstream(), subjects, config, "c-limited").fetch_task_ids()
    assert len(every["db"]) == 6 and limited["db"] == every["db"][:3]


async def test_controller_pauses_while_the_trainer_backlog_is_full(nc, config, subjects, db_host, tmp_path) -> None:
    """Finished trajectories the trainer has not taken stop further publishing; taking them resumes it."""
    import torch

    config.controller.group_size, config.controller.max_inflight, config.controller.max_backlog = 2, 4, 6
    config.trainer.min_groups, config.trainer.steps = 1, 100
    js = nc.jetstream()
    controller = Controller(nc, js, subjects, config, "controller-test")
    trainer_sub = await Trainer(nc, js, subjects, config.trainer, torch.nn.Linear(1, 1), tmp_path, "t").subscribe()
    jobs = await js.pull_subscribe(subjects.jobs(">"), durable="fake-rollout", stream=subjects.jobs_stream)
    stop = asyncio.Event()

    async def fake_rollout() -> None:  # plays every job at once: a trajectory per job
        while not stop.is_set():
            try:
                msgs = await jobs.fetch(4, timeout=0.2)
            except Exception:  # nats-py turns a fetch timeout (and a cancel) into its own errors
                continue
            for msg in msgs:
                job = decode(msg.data, EpisodeJob)
                traj = make_traj(job.episode_id, job.group_id, 1.0, [1, 2, 3, 4], [-0.1, -0.2, -0.3])
                await js.publish(subjects.traj(job.task), encode(traj), headers={"Nats-Msg-Id": job.episode_id})
                await msg.ack()

    tasks = [asyncio.create_task(c) for c in (controller.track_trajectories(), controller.publish_jobs(stop),
                                              fake_rollout())]
    try:
        await asyncio.sleep(3.0)
        paused_at = controller.groups_published
        await asyncio.sleep(1.5)
        assert controller.groups_published == paused_at  # held: the trainer has taken nothing
        # backlog >= bound (6) stops it; a stale reading (0.5 s) and the in-flight window allow a little more
        assert 3 <= paused_at <= 3 + 2 + 2
        assert await controller.trainer_backlog() >= 6
        taken = 0
        while taken < 2 * paused_at:  # the trainer takes the backlog: publishing resumes
            for msg in await trainer_sub.fetch(64, timeout=2.0):
                await msg.ack()
                taken += 1
        await asyncio.sleep(2.0)
        assert controller.groups_published > paused_at
    finally:
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def sft(trainer: Trainer, demos: list[Trajectory]) -> dict[str, float]:
    """One SFT update of ``trainer``'s model on ``demos``."""
    from services.trainer.update import StepLedger, sft_update

    return sft_update(trainer.backend, trainer.cfg, demos, StepLedger(1, trainer.counters), trainer.cfg.lr)


def test_sft_context_mask_takes_task_and_tool_results_not_system_prompt_or_own_tokens() -> None:
    from services.trainer.batch import context_mask

    # 7 = <|im_start|>: system block [0..3), user block [3..6), assistant [6..8) (own), tool result [8..10)
    traj = make_traj("e", "g", 1.0, [7, 1, 2, 7, 3, 4, 7, 5, 7, 6], [-0.1, -0.2, -0.3])
    traj.loss_mask = [0, 0, 0, 0, 0, 0, 0, 1, 0, 0]
    assert context_mask(traj) == [0] * 3 + [1] * 4 + [0, 1, 1]


async def test_sft_learns_the_demonstrations_and_the_context_term_adds_to_the_loss(nc, config, subjects,
                                                                                    model_path, tmp_path) -> None:
    import torch

    torch.manual_seed(0)
    config.trainer.mode, config.trainer.lr = "sft", 3e-3
    demos = []
    for i in range(2):
        tokens = [1, 50, 51, 52, 1, 60 + i, 61 + i, 62 + i, 1, 60 + i, 61 + i, 62 + i, 2]
        traj = make_traj(f"e{i}", "g", 1.0, tokens, [-1.0, -1.0, -1.0])
        traj.loss_mask = [0] * 9 + [1, 1, 1, 1]  # the agent copies the user's three tokens
        demos.append(traj)
    plain = Trainer(nc, nc.jetstream(), subjects, config.trainer, load_model(model_path), tmp_path, "t")
    losses = [sft(plain, demos)["train/loss"] for _ in range(30)]
    assert losses[-1] < 0.5 * losses[0]
    config.trainer.sft_context_weight = 0.5
    with_context = Trainer(nc, nc.jetstream(), subjects, config.trainer, load_model(model_path), tmp_path, "t")
    stats = sft(with_context, demos)
    assert stats["train/loss"] == pytest.approx(losses[0], rel=1e-4)  # same assistant loss before any update
    assert stats["train/context_loss"] > 0


async def test_a_batch_without_signal_leaves_the_weights_alone(nc, config, subjects, model_path, tmp_path) -> None:
    """After a real update AdamW holds momentum; a batch whose groups are all-equal (zero advantage
    everywhere) must not move the weights along it."""
    import torch

    model = load_model(model_path)
    config.trainer.lr = 1e-2
    trainer = Trainer(nc, nc.jetstream(), subjects, config.trainer, model, tmp_path, "trainer-test")
    tokens = [1, 2, 3, 4, 10, 11, 12]

    def batch(rewards: list[float]) -> list[Trajectory]:
        return [make_traj(f"e{i}", "g", r, tokens[:4] + [t + i for t in tokens[4:]], [-1.0, -1.0, -1.0])
                for i, r in enumerate(rewards)]

    stats, _ = trainer.optimise(batch([1.0, 0.0]))
    assert stats["train/grad_norm"] > 0 and "train/skipped_update" not in stats
    before = {k: v.clone() for k, v in model.state_dict().items()}
    for rewards in ([0.0, 0.0], [1.0, 1.0]):
        stats, _ = trainer.optimise(batch(rewards))
        assert stats["train/skipped_update"] == 1.0 and stats["train/grad_norm"] == 0.0
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


async def test_the_pipeline_demos_steps_without_signal_change_the_weights_they_version(nc, config, subjects,
                                                                                     model_path, tmp_path) -> None:
    """configs/pipeline.toml: the untrained model's groups all fail (no policy gradient), yet every step is
    published as a new policy version; each one must name new weights (weight decay moves them), not the
    initial model again under another number. Nothing is learned, and the figures say so."""
    import hashlib
    from pathlib import Path

    from shared.config import load_config

    demo = load_config(Path(__file__).resolve().parents[2] / "configs" / "pipeline.toml", environ={})
    model = load_model(model_path)  # the demo's model: "tiny"

    def weights_digest() -> str:
        h = hashlib.sha256()
        for value in model.state_dict().values():
            h.update(value.detach().contiguous().numpy().tobytes())
        return h.hexdigest()

    trainer = Trainer(nc, nc.jetstream(), subjects, demo.trainer, model, tmp_path, "trainer-demo")
    digests, losses = [weights_digest()], []
    for step in (1, 2):
        group = Group(f"g{step}", 2)
        for i in range(2):
            traj = make_traj(f"s{step}e{i}", f"g{step}", 0.0, [1, 2, 3, 4, 10 + i, 11, 12], [-1.0, -1.0, -1.0])
            group.add(traj, _NoAck())
        stats = await trainer.train_step([group])
        digests.append(weights_digest())
        losses.append(stats["train/loss"])
    assert trainer.policy_version == 2 and len(set(digests)) == 3, digests
    assert losses == [0.0, 0.0]
