"""The RL math against numbers worked out by hand (see each comment)."""

from __future__ import annotations

import math

import pytest
import torch

from services.trainer import rl


def test_group_advantages_by_hand() -> None:
    # group a: rewards 1,0,0,1 -> mean 0.5, population std 0.5 -> +1,-1,-1,+1
    # group b: 1,1 -> no spread -> 0,0 ; group c: a single episode -> 0
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.5])
    groups = ["a", "a", "b", "a", "a", "b", "c"]
    adv = rl.group_advantages(rewards, groups)
    assert adv.tolist() == pytest.approx([1.0, -1.0, 0.0, -1.0, 1.0, 0.0, 0.0], abs=1e-5)


def test_group_advantages_three_way() -> None:
    # 0,1,1: mean 2/3, std sqrt(2/9)=0.47140 -> -1.41421, 0.70711, 0.70711
    adv = rl.group_advantages(torch.tensor([0.0, 1.0, 1.0]), ["g"] * 3)
    assert adv.tolist() == pytest.approx([-math.sqrt(2), math.sqrt(0.5), math.sqrt(0.5)], abs=1e-4)
    centred = rl.group_advantages(torch.tensor([0.0, 1.0, 1.0]), ["g"] * 3, normalize_std=False)
    assert centred.tolist() == pytest.approx([-2 / 3, 1 / 3, 1 / 3], abs=1e-6)


def test_task_normalisation_by_hand() -> None:
    # task a: 1,3 -> mean 2, std 1 -> -1,+1
    # task b: 2,2,5 -> mean 3, std sqrt(2) -> -0.70711,-0.70711,+1.41421
    adv = torch.tensor([1.0, 2.0, 3.0, 2.0, 5.0])
    out = rl.task_normalize(adv, ["a", "b", "a", "b", "b"], "paper")
    assert out.tolist() == pytest.approx([-1.0, -0.70711, 1.0, -0.70711, 1.41421], abs=1e-4)
    for task in ("a", "b"):
        sel = torch.tensor([t == task for t in ["a", "b", "a", "b", "b"]])
        assert float(out[sel].mean()) == pytest.approx(0.0, abs=1e-6)
        assert float(out[sel].std(unbiased=False)) == pytest.approx(1.0, abs=1e-5)
    # a task whose tokens all share one advantage has nothing to say: zeros, not NaN
    assert rl.task_normalize(torch.tensor([0.7, 0.7]), ["c", "c"], "paper").tolist() == [0.0, 0.0]
    with pytest.raises(ValueError):
        rl.task_normalize(torch.tensor([1.0]), ["a", "b"])


def test_task_scaling_keeps_zero_signal_tokens_at_zero_by_hand() -> None:
    # task a: a success group of 3 tokens at +1 and a failure of 1 token at -1, then an all-fail group's
    # 4 tokens at 0. paper mode: mean (3 - 1) / 8 = 0.25 -> the zero tokens become negative.
    # scale mode: RMS over the 4 signal tokens = 1 -> +1,+1,+1,-1 and the zeros stay 0.
    # task b: signal tokens +2, -2 -> RMS 2 -> +1, -1.
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, 0.0, 0.0, 0.0, 0.0, 2.0, -2.0])
    tasks = ["a"] * 8 + ["b", "b"]
    paper = rl.task_normalize(adv, tasks, "paper")
    assert all(x < 0 for x in paper[4:8].tolist())  # the failure the paper's formula reinforces
    scaled = rl.task_normalize(adv, tasks, "scale")
    assert scaled.tolist() == pytest.approx([1.0, 1.0, 1.0, -1.0, 0.0, 0.0, 0.0, 0.0, 1.0, -1.0], abs=1e-6)
    assert rl.task_normalize(adv, tasks, "off").tolist() == adv.tolist()
    assert rl.task_normalize(torch.zeros(3), ["c"] * 3, "scale").tolist() == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        rl.task_normalize(adv, tasks, "bogus")


def test_ppo_clip_by_hand() -> None:
    # ratio 1.5, A=+1: max(-1.5, -1.2) = -1.2 (clipped); ratio 0.5, A=+1: max(-0.5, -0.8) = -0.5
    # ratio 0.5, A=-1: max(0.5, 0.8) = 0.8 (clipped); ratio 4, A=-1: max(4, 1.2) = 4
    logp = torch.log(torch.tensor([1.5, 0.5, 0.5, 4.0]))
    old = torch.zeros(4)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0])
    loss, clipped = rl.ppo_token_loss(logp, old, adv, clip_eps=0.2)
    assert loss.tolist() == pytest.approx([-1.2, -0.5, 0.8, 4.0], abs=1e-5)
    assert clipped.tolist() == [1.0, 0.0, 1.0, 0.0]
    # dual clip c=3 caps the negative-advantage token with ratio 4 at 3
    loss, _ = rl.ppo_token_loss(logp, old, adv, clip_eps=0.2, dual_clip=3.0)
    assert loss.tolist() == pytest.approx([-1.2, -0.5, 0.8, 3.0], abs=1e-5)


def test_token_level_aggregation_and_gradient() -> None:
    # trained tokens: (-1.2) and (-0.5); the third is masked out -> (-1.2 - 0.5) / 2 = -0.85
    logp = torch.log(torch.tensor([1.5, 0.5, 9.0])).requires_grad_()
    loss, stats = rl.policy_loss(logp, torch.zeros(3), torch.tensor([1.0, 1.0, 5.0]), torch.tensor([1, 1, 0]),
                                 num_tokens=2, clip_eps=0.2)
    assert float(loss.detach()) == pytest.approx(-0.85, abs=1e-5)
    assert stats["clipped"] == 1.0
    loss.backward()
    # clipped token: no gradient; unclipped: d/dlogp of -A*exp(logp)/2 = -0.5*0.5 = -0.25; masked: 0
    assert logp.grad.tolist() == pytest.approx([0.0, -0.25, 0.0], abs=1e-6)


def test_decoupled_ppo_by_hand() -> None:
    # behaviour logp 0, proximal log 1.2, current log 1.8 -> ratio to proximal 1.5, clipped at 1.2:
    # token loss -1.2 (A=+1), times IS weight min(1.2, cap): cap 2 -> -1.44 ; cap 1.1 -> -1.32
    logp, prox, behav = torch.log(torch.tensor([1.8])), torch.log(torch.tensor([1.2])), torch.zeros(1)
    loss, _ = rl.policy_loss(logp, behav, torch.tensor([1.0]), torch.tensor([1]), 1, proximal_logp=prox, is_cap=2.0)
    assert float(loss) == pytest.approx(-1.44, abs=1e-5)
    loss, _ = rl.policy_loss(logp, behav, torch.tensor([1.0]), torch.tensor([1]), 1, proximal_logp=prox, is_cap=1.1)
    assert float(loss) == pytest.approx(-1.32, abs=1e-5)


def test_kl_k3_is_zero_at_equal_policies_and_positive_otherwise() -> None:
    # k3 at d = ref - logp = log(0.5): 0.5 - log(0.5) - 1 = 0.19315
    k = rl.kl_k3(torch.tensor([0.0, 0.0]), torch.tensor([0.0, math.log(0.5)]))
    assert k.tolist() == pytest.approx([0.0, 0.5 - math.log(0.5) - 1], abs=1e-6)


def test_staleness_bound_by_hand() -> None:
    # lags 0, 3, 5, 9 ; bounds db <= 4, everything else ("*") <= 8
    lags, tasks = [0, 3, 5, 9], ["db", "db", "db", "os"]
    bounds = {"db": 4, "*": 8}
    assert rl.staleness_weights(lags, tasks, bounds, "drop") == [1.0, 1.0, 0.0, 0.0]
    assert rl.staleness_weights(lags, tasks, bounds, "downweight", 0.25) == [1.0, 1.0, 0.25, 0.25]
    assert rl.staleness_weights(lags, tasks, {}, "drop") == [1.0] * 4  # no bound configured
    assert rl.staleness_weights([9], ["kg"], {"db": 4}, "drop") == [1.0]  # kg has no bound and no "*"
    with pytest.raises(ValueError):
        rl.staleness_weights([1], ["db"], {}, "sometimes")


def test_learning_rate_warm_up_by_hand(tmp_path) -> None:
    from services.trainer.trainer import Trainer
    from services.trainer.update import learning_rate
    from shared.config import TrainerConfig

    model = torch.nn.Linear(2, 1)
    trainer = Trainer(None, None, None, TrainerConfig(lr=1e-3, warmup_steps=4), model, tmp_path, "t")  # type: ignore[arg-type]
    lrs = []
    for step in range(6):
        trainer.backend.set_lr(learning_rate(trainer.cfg, step))
        lrs.append(trainer.backend.optimizer.param_groups[0]["lr"])
    # steps 0..3 ramp 1/4, 2/4, 3/4, 4/4 of lr; then constant
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])
