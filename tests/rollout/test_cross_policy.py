"""Cross-policy sampling: one episode whose turns come from two engines at two policy versions (the
local current engine and a stale engine of the pool on another "replica"), and the trainer scoring it
with the right per-turn behaviour logprobs."""

from __future__ import annotations

import pytest
import torch

from services.envs.host import EnvHost
from services.rollout.engine import HFEngine
from services.rollout.worker import RolloutWorker
from services.trainer.intake import Group
from services.trainer.packing import pack, packed_logprobs
from services.trainer.trainer import Trainer
from shared.config import EnvConfig, ModelConfig
from shared.envapi import EnvClient
from shared.lm import PackedLM
from shared.messages import EpisodeJob
from shared.model import (
    bytes_to_weights,
    load_model,
    load_tokenizer,
    quiet_transformers,
    resolve_model,
    weights_to_bytes,
)


def scored(model, trajs) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """Per trajectory: its trained positions, their logprobs under ``model`` (the trainer's packed
    path) and their behaviour logprobs."""
    mb = pack([t.tokens for t in trajs], [t.loss_mask for t in trajs], list(range(len(trajs))))
    with torch.no_grad():
        lp = packed_logprobs(PackedLM(model), mb, torch.ones(mb.targets.numel()))
    out = []
    for t, part in zip(trajs, lp.split(mb.trained_per_traj), strict=True):
        positions = [i for i in range(1, len(t.tokens)) if t.loss_mask[i]]
        out.append((positions, part, torch.tensor([t.logprobs[i] for i in positions])))
    return out


def version_of(traj, position: int) -> int:
    return next(turn.policy_version for turn in traj.turns if turn.start <= position < turn.end)


class _Msg:
    async def ack(self) -> None:
        pass

    async def in_progress(self) -> None:
        pass


@pytest.fixture(scope="module")
def model_path():
    quiet_transformers()
    return resolve_model(ModelConfig())


async def test_trajectory_mixes_two_engines_and_versions(nc, config, subjects, model_path, tmp_path) -> None:
    from services.envs.db import make_env

    env_cfg = EnvConfig(num_train_tasks=4, num_test_tasks=2)
    host = EnvHost(make_env(env_cfg), env_cfg, subjects, "env-db-x")
    env_service = await host.serve(nc, nc.jetstream())
    tok = load_tokenizer(model_path)
    stop_ids = [tok.convert_tokens_to_ids("<|im_end|>")]

    # Version 1 of the policy: the initial weights nudged, as if after one step.
    v1_model = load_model(model_path)
    torch.manual_seed(7)
    with torch.no_grad():
        for p in v1_model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    current = HFEngine(model_path, "engine-current", stop_ids, tok.pad_token_id)
    await current.update_weights(bytes_to_weights(weights_to_bytes(v1_model)), 1)
    stale = HFEngine(model_path, "engine-stale", stop_ids, tok.pad_token_id)  # still version 0

    config.rollout.cross_policy_prob = 0.5
    config.rollout.max_new_tokens = 8
    stale_replica = RolloutWorker(nc, nc.jetstream(), subjects, config.rollout, stale, tok, "rollout-stale")
    pool_service = await stale_replica.serve_pool()  # only the stale engine serves the pool here
    worker = RolloutWorker(nc, nc.jetstream(), subjects, config.rollout, current, tok, "rollout-current")
    task_id = (await EnvClient(nc, subjects, "db").task_ids("train"))[0]
    try:
        trajs = [await worker.play(EpisodeJob(episode_id=f"x{i}", group_id="gx", task="db", task_id=task_id,
                                              group_size=2, max_new_tokens=8), attempt=1) for i in range(2)]
    finally:
        await pool_service.stop()
        await env_service.stop()
        await host.shutdown()
        current.close()
        stale.close()

    turns = [turn for t in trajs for turn in t.turns]
    assert {(turn.engine_id, turn.policy_version) for turn in turns} == {("engine-current", 1), ("engine-stale", 0)}
    assert worker.turn_sources["pool"] > 0 and worker.turn_sources["local"] > 0

    # Each turn's behaviour logprobs are those of the engine and version that generated it.
    v0_model = load_model(model_path)
    for version, model in ((0, v0_model), (1, v1_model)):
        for traj, (positions, lp, behaviour) in zip(trajs, scored(model, trajs), strict=True):
            sel = torch.tensor([version_of(traj, p) == version for p in positions])
            if sel.any():
                assert lp[sel].tolist() == pytest.approx(behaviour[sel].tolist(), abs=2e-4)

    # The trainer (at version 1) consumes the mixed trajectories: staleness 1 on the old turns, and its
    # proximal logprobs equal the behaviour ones exactly where the turn came from version 1.
    trainer = Trainer(nc, nc.jetstream(), subjects, config.trainer, v1_model, tmp_path, "trainer-x")
    trainer.policy_version = 1
    prox, behav, versions = [], [], []
    for traj, (positions, lp, behaviour) in zip(trajs, scored(v1_model, trajs), strict=True):
        prox.append(lp)
        behav.append(behaviour)
        versions += [version_of(traj, p) for p in positions]
    prox, behav, trained_versions = torch.cat(prox), torch.cat(behav), torch.tensor(versions)
    assert torch.allclose(prox[trained_versions == 1], behav[trained_versions == 1], atol=2e-4)
    assert not torch.allclose(prox[trained_versions == 0], behav[trained_versions == 0], atol=1e-2)
    group = Group("gx", 2)
    for t in trajs:
        group.add(t, _Msg())
    stats = await trainer.train_step([group])
    assert stats["train/staleness_max"] == 1.0 and stats["train/tokens"] == float(len(trained_versions))
