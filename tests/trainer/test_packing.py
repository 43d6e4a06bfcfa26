"""Shared-prefix training is exact: the packed prefix tree gives the logprobs and gradients of the plain
unshared computation (transformers' own forward pass on padded rows), on real models."""

from __future__ import annotations

import random

import pytest
import torch

from services.trainer.packing import pack, packed_logprobs, plan_micro_batches, shareable_length
from shared.config import ModelConfig
from shared.lm import PackedLM, token_logprobs
from shared.model import load_model, quiet_transformers, resolve_model


@pytest.fixture(scope="module", params=["tiny", "smollm2"])
def model(request):
    quiet_transformers()
    torch.manual_seed(0)
    return load_model(resolve_model(ModelConfig(name=request.param))).eval()


def hand_built_groups(seed: int = 0) -> tuple[list[list[int]], list[list[int]]]:
    """Two groups sharing a system prompt, a third group on its own: each episode is its group's opening,
    an assistant turn, an observation and a second turn, of lengths that differ episode by episode."""
    rng = random.Random(seed)
    words = lambda n: [rng.randrange(200, 20000) for _ in range(n)]  # noqa: E731
    system = words(40)
    openings = [system + words(12), system + words(17), words(25)]
    seqs, trained = [], []
    for opening in openings:
        for _ in range(3):
            turn, obs, turn2 = words(rng.randrange(3, 25)), words(rng.randrange(2, 9)), words(rng.randrange(1, 7))
            seqs.append(opening + turn + obs + turn2)
            trained.append([0] * len(opening) + [1] * len(turn) + [0] * len(obs) + [1] * len(turn2))
    return seqs, trained


def unshared_reference(model, seqs: list[list[int]], trained: list[list[int]]) -> list[torch.Tensor]:
    """transformers' forward pass on one padded batch: rows padded on the left (0, 1 or 2 tokens) and on
    the right, position ids counted from each row's first real token."""
    width = max(len(s) for s in seqs) + 2
    ids = torch.zeros((len(seqs), width), dtype=torch.long)
    attn = torch.zeros_like(ids)
    for i, s in enumerate(seqs):
        left = i % 3
        ids[i, left: left + len(s)] = torch.tensor(s)
        attn[i, left: left + len(s)] = 1
    positions = (attn.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attn, position_ids=positions).logits.float()
    out = []
    for i, s in enumerate(seqs):
        t = [j for j in range(1, len(s)) if trained[i][j]]
        out.append(token_logprobs(logits[i, [i % 3 + j - 1 for j in t]], torch.tensor([s[j] for j in t]), 1.0))
    return out


def test_prefix_tree_logprobs_match_the_unshared_forward(model) -> None:
    seqs, trained = hand_built_groups()
    reference = unshared_reference(model, seqs, trained)
    shareable = [shareable_length(s, m) for s, m in zip(seqs, trained, strict=True)]
    batches = plan_micro_batches(seqs, shareable, max_rows=150)
    assert len(batches) >= 3  # several micro-batches
    lm, rows, seen = PackedLM(model), 0, []
    for order in batches:
        mb = pack(seqs, trained, order)
        rows += mb.num_rows
        with torch.no_grad():
            lp = packed_logprobs(lm, mb, torch.ones(mb.targets.numel()))
        for i, part in zip(mb.order, lp.split(mb.trained_per_traj), strict=True):
            assert part.shape == reference[i].shape
            torch.testing.assert_close(part, reference[i], rtol=1e-5, atol=2e-5)
            seen.append(i)
    assert sorted(seen) == list(range(len(seqs)))
    assert rows < sum(len(s) for s in seqs) * 0.85  # the openings ran once per micro-batch, not per episode


def test_one_group_pays_for_its_opening_once() -> None:
    opening = list(range(100, 160))
    seqs = [opening + [7] * n for n in (5, 9, 3)]
    trained = [[0] * 60 + [1] * n for n in (5, 9, 3)]
    mb = pack(seqs, trained, [0, 1, 2])
    assert mb.num_rows == 60 + 5 + 9 + 3
    assert [(s.start, s.end, s.num_context) for s in mb.segments] == [(0, 60, 0), (60, 65, 60), (65, 74, 60),
                                                                       (74, 77, 60)]
    assert mb.trained_per_traj == [5, 9, 3]  # the first trained token is scored from the shared row 59
    assert int(mb.predict_rows[0]) == 59
    unshared = pack(seqs, trained, [0, 1, 2], share=False)
    assert unshared.num_rows == sum(len(s) for s in seqs)


def test_gradients_match_the_unshared_computation() -> None:
    quiet_transformers()
    model = load_model(resolve_model(ModelConfig(name="tiny")))
    seqs, trained = hand_built_groups(seed=3)
    weights = torch.linspace(-1.0, 1.0, sum(sum(m[1:]) for m in trained))

    def grads(share: bool) -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        shareable = [shareable_length(s, m) for s, m in zip(seqs, trained, strict=True)]
        (order,) = plan_micro_batches(seqs, shareable, max_rows=10_000)  # one micro-batch, neighbours sharing
        mb = pack(seqs, trained, order, share=share)
        lp = packed_logprobs(PackedLM(model), mb, torch.ones(mb.targets.numel()))
        (lp * weights[: lp.numel()]).sum().backward()
        return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])

    shared, unshared = grads(True), grads(False)
    assert float((shared - unshared).norm() / unshared.norm()) < 1e-5
