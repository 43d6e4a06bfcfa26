"""The continuous-batching engine against the reference engine and a teacher-forced forward pass, on a
real model: same greedy tokens, exact behaviour logprobs, KV reuse across turns and across a group,
weight updates between turns."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from services.rollout.continuous import ContinuousEngine
from services.rollout.engine import HFEngine
from shared.config import ModelConfig
from shared.lm import token_logprobs
from shared.model import load_model, load_tokenizer, quiet_transformers, resolve_model, weights_to_bytes


@pytest.fixture(scope="module")
def setup():
    quiet_transformers()
    path = resolve_model(ModelConfig(name="tiny"))
    tok = load_tokenizer(path)
    stop = [tok.convert_tokens_to_ids("<|im_end|>")]
    return {"path": path, "stop": stop, "pad": tok.pad_token_id, "model": load_model(path).eval()}


def prompts(n: int, seed: int = 0, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    common = [rng.randrange(100, 20000) for _ in range(shared)]
    return [common + [rng.randrange(100, 20000) for _ in range(rng.randrange(5, 40))] for _ in range(n)]


def teacher_forced(model, prompt: list[int], tokens: list[int], temperature: float = 1.0) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: -1].float()
    return token_logprobs(logits, torch.tensor(tokens), temperature)


async def test_greedy_tokens_match_the_reference_engine(setup) -> None:
    batch = prompts(6, seed=1)
    reference = HFEngine(setup["path"], "hf", setup["stop"], setup["pad"])
    engine = ContinuousEngine(setup["path"], "c", setup["stop"], max_batch=4, prefill_chunk=16)
    try:
        want = [await reference.generate(p, 12, 0.0) for p in batch]  # one at a time: no padding effects
        got = await asyncio.gather(*[engine.generate(p, 12, 0.0) for p in batch])
    finally:
        reference.close()
        engine.close()
    for w, g in zip(want, got, strict=True):
        assert g.tokens == w.tokens and g.finish_reason == w.finish_reason
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)


async def test_sampled_logprobs_are_exact_for_what_was_sampled(setup) -> None:
    engine = ContinuousEngine(setup["path"], "c", setup["stop"], prefill_chunk=8, seed=3)
    try:
        gens = await asyncio.gather(*[engine.generate(p, 16, t) for p, t in zip(prompts(8, seed=2), [1.0, 0.7] * 4,
                                                                                strict=True)])
    finally:
        engine.close()
    for p, g, t in zip(prompts(8, seed=2), gens, [1.0, 0.7] * 4, strict=True):
        assert len(g.tokens) == len(g.logprobs) > 0
        torch.testing.assert_close(torch.tensor(g.logprobs), teacher_forced(setup["model"], p, g.tokens, t),
                                   rtol=1e-5, atol=1e-4)


async def test_turns_extend_the_cache_and_a_group_shares_its_opening(setup) -> None:
    engine = ContinuousEngine(setup["path"], "c", setup["stop"], seed=5)
    group = prompts(4, seed=4, shared=120)  # four episodes of one task: a long common opening
    try:
        first = await asyncio.gather(*[engine.generate(p, 6, 1.0) for p in group])
        after_first = engine.stats.prefilled_tokens
        # the opening is encoded once; the others attend to it by reference and encode only their own tokens
        assert after_first < sum(len(p) for p in group) - 2 * 120
        assert engine.stats.shared_prefix_tokens >= 3 * 120
        assert engine.stats.sealed_tokens <= 2 * 120  # the opening's keys/values are copied once, not per episode
        second_prompts = [p + g.tokens + [11, 12, 13] for p, g in zip(group, first, strict=True)]
        second = await asyncio.gather(*[engine.generate(p, 6, 1.0) for p in second_prompts])
        # the next turn encodes only the last sampled token and the three observation tokens
        assert engine.stats.prefilled_tokens - after_first == 4 * 4
    finally:
        engine.close()
    for p, g in zip(second_prompts, second, strict=True):
        torch.testing.assert_close(torch.tensor(g.logprobs), teacher_forced(setup["model"], p, g.tokens),
                                   rtol=1e-5, atol=1e-4)


async def test_weights_change_between_turns_and_old_caches_are_dropped(setup) -> None:
    from shared.model import bytes_to_weights

    engine = ContinuousEngine(setup["path"], "c", setup["stop"])
    nudged = load_model(setup["path"]).eval()
    with torch.no_grad():
        for param in nudged.parameters():
            param.add_(0.02 * torch.randn_like(param))
    prompt = prompts(1, seed=6)[0]
    try:
        before = await engine.generate(prompt, 8, 0.0)
        pending = [asyncio.create_task(engine.generate(p, 8, 1.0)) for p in prompts(3, seed=7)]
        await engine.update_weights(bytes_to_weights(weights_to_bytes(nudged)), 1)
        running_then = await asyncio.gather(*pending)
        after = await engine.generate(prompt + before.tokens, 8, 0.0)  # its cache is from version 0
    finally:
        engine.close()
    assert before.policy_version == 0 and after.policy_version == 1
    assert {g.policy_version for g in running_then} <= {0, 1}
    torch.testing.assert_close(torch.tensor(after.logprobs), teacher_forced(nudged, prompt + before.tokens,
                                                                           after.tokens), rtol=1e-5, atol=1e-4)


async def test_a_prompt_beyond_the_context_fails_alone(setup) -> None:
    engine = ContinuousEngine(setup["path"], "c", setup["stop"], max_context=64)
    try:
        with pytest.raises(ValueError, match="max_context"):
            await engine.generate(list(range(100, 160)), 8, 1.0)
        ok = await engine.generate(list(range(100, 120)), 8, 1.0)
    finally:
        engine.close()
    assert 0 < len(ok.tokens) <= 8


async def test_small_tail_slots_seal_segments_and_evict_without_changing_logprobs(setup) -> None:
    """Tails of 32 tokens: long prompts and turns are sealed into segments as they fill, a pool of few
    slots evicts idle sequences, groups still share their opening; every logprob stays exact."""
    engine = ContinuousEngine(setup["path"], "c", setup["stop"], seed=9, slot_tokens=32, prefill_chunk=16,
                              max_batch=6, cache_tokens=7 * 32)
    groups = [prompts(3, seed=10 + g, shared=90) for g in range(2)]  # two tasks, three episodes each
    try:
        flat = [p for group in groups for p in group]
        first = await asyncio.gather(*[engine.generate(p, 40, 1.0) for p in flat])
        # each later episode shares the opening at least up to the 16-token chunk its leader was encoding
        assert engine.stats.shared_prefix_tokens >= 2 * 2 * (90 - 15) and engine.stats.sealed_tokens > 0
        second_prompts = [p + g.tokens + [21, 22, 23, 24, 25] for p, g in zip(flat, first, strict=True)]
        second = await asyncio.gather(*[engine.generate(p, 40, 1.0) for p in second_prompts])
        assert len(engine.sequences) <= engine.pool.max_slots
    finally:
        engine.close()
    for p, g in zip(flat + second_prompts, first + second, strict=True):
        assert len(g.tokens) == len(g.logprobs) > 0
        torch.testing.assert_close(torch.tensor(g.logprobs), teacher_forced(setup["model"], p, g.tokens),
                                   rtol=1e-5, atol=1e-4)


async def test_bf16_matmuls_give_exact_logprobs_for_their_own_numbers(setup) -> None:
    """``matmul_dtype = bfloat16``: the behaviour logprobs are those of the bf16-matmul model (a teacher-forced
    packed pass with the same weights), and stay close to the fp32 model's."""
    from shared.lm import PackedLM

    engine = ContinuousEngine(setup["path"], "c", setup["stop"], prefill_chunk=8, seed=4, matmul_dtype="bfloat16")
    batch = prompts(6, seed=7, shared=24)
    try:
        gens = await asyncio.gather(*[engine.generate(p, 16, 1.0) for p in batch])
    finally:
        engine.close()
    lm = PackedLM(engine.model)
    for p, g in zip(batch, gens, strict=True):
        ids = torch.tensor(p + g.tokens)
        with torch.no_grad():
            hidden = lm.hidden(ids, torch.arange(len(ids)), lambda i, q, k, v: lm.attention(q, k, v, 0))
            own = token_logprobs(lm.logits(hidden[len(p) - 1: -1]), torch.tensor(g.tokens), 1.0)
        torch.testing.assert_close(torch.tensor(g.logprobs), own, rtol=0, atol=2e-3)
        fp32 = teacher_forced(setup["model"], p, g.tokens)
        assert (torch.tensor(g.logprobs) - fp32).abs().mean() < 0.05


def test_an_unknown_matmul_dtype_is_refused(setup) -> None:
    with pytest.raises(ValueError, match="matmul_dtype"):
        ContinuousEngine(setup["path"], "c", setup["stop"], matmul_dtype="float8")
