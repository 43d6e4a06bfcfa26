"""`jetrl reverify` on a real nats-server: episodes played against one grader, replayed against a changed
one, and exactly those whose reward changes are found; a replay against the same env finds none."""

from __future__ import annotations

from jetrl.reverify import Regrade, reverify
from jetrl.streams import TrajectoryStream
from services.envs.host import EnvHost
from services.rollout.worker import RolloutWorker
from shared.config import EnvConfig, ModelConfig
from shared.messages import EpisodeJob, Trajectory, encode
from shared.model import load_tokenizer, quiet_transformers, resolve_model
from tests.sums_env import SumEnv


async def serve(nc, subjects, numeric: bool, name: str):
    host = EnvHost(SumEnv(numeric=numeric), EnvConfig(), subjects, name)
    return host, await host.serve(nc, nc.jetstream())


async def regrade_all(nc, config, subjects) -> tuple[list[Regrade], object]:
    results: list[Regrade] = []
    stream = TrajectoryStream(config.nats.url, config.nats, follow=False)
    async with stream:
        summary = await reverify(stream, nc, subjects, results.append, concurrency=3)
    return sorted(results, key=lambda r: r.episode_id), summary


async def test_a_changed_grader_is_found_in_exactly_the_episodes_it_regrades(nc, config, subjects) -> None:
    quiet_transformers()
    tokenizer = load_tokenizer(resolve_model(ModelConfig()))
    host, service = await serve(nc, subjects, numeric=True, name="env-sums-lenient")
    config.rollout.engine = "oracle"
    worker = RolloutWorker(nc, nc.jetstream(), subjects, config.rollout, None, tokenizer, "rollout-oracle")
    try:
        played = [await worker.play(EpisodeJob(episode_id=f"e{i}", group_id="g", task="sums", task_id=f"train-{i}"),
                                    attempt=1) for i in range(6)]
    finally:
        await service.stop()
        await host.shutdown()
    assert [t.reward for t in played] == [1.0] * 6  # the lenient grader reads "12.0" as 12
    failed = Trajectory(episode_id="e-env-error", group_id="g", task="sums", task_id="train-0", split="train",
                        group_size=1, tokens=[], logprobs=[], loss_mask=[], prompt_len=0, turns=[], reward=0.0,
                        status="env_error", replica_id="r")
    await nc.jetstream().publish(subjects.traj("sums"), encode(failed))

    # the same env again: the replay rule holds, nothing is graded differently
    host, service = await serve(nc, subjects, numeric=True, name="env-sums-again")
    try:
        same, summary = await regrade_all(nc, config, subjects)
    finally:
        await service.stop()
        await host.shutdown()
    assert (summary.replayed, summary.changed, summary.failed) == (6, 0, 1)
    assert all(not r.opening_differs and not r.answers_differ and r.turns == 2 for r in same if not r.error)
    assert "no action log" in next(r.error for r in same if r.episode_id == "e-env-error")

    # a strict grader: the odd tasks' decimal answers no longer count
    host, service = await serve(nc, subjects, numeric=False, name="env-sums-strict")
    try:
        strict, summary = await regrade_all(nc, config, subjects)
    finally:
        await service.stop()
        await host.shutdown()
    changed = {r.episode_id: r for r in strict if r.changed}
    assert sorted(changed) == ["e1", "e3", "e5"] and summary.changed == 3
    for r in changed.values():
        assert (r.stored_reward, r.replayed_reward, r.replayed_status) == (1.0, 0.0, "completed")
        assert r.answers_differ == [1]  # the tool's answer at the second turn says so too
    assert all(r.replayed_reward == 1.0 for r in strict if r.episode_id in ("e0", "e2", "e4"))
