"""One engine holding several LoRA versions beside the base weights (cross-policy sampling without a second
model): every version the continuous engine holds, and the base model, gives the logprobs of the HF model with
that adapter merged, in one batch (the reference engine too, batch by batch); caches are reused only by
requests of their own version; the retention rule keeps an older version every ``keep_every`` versions; a
cross-policy turn draws among the older versions held and names its version, engine id and digest."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
import torch

from services.rollout.adapters import AdapterSet, parse_adapter
from services.rollout.continuous import ContinuousEngine
from services.rollout.engine import HFEngine
from shared.config import ModelConfig
from shared.lm import PackedLM, token_logprobs
from shared.model import (
    add_lora,
    load_model,
    load_state_file,
    load_tokenizer,
    load_weights_into,
    lora_delta,
    merge_lora_delta,
    quiet_transformers,
    resolve_model,
)

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def setup():
    quiet_transformers()
    path = resolve_model(ModelConfig(name="tiny"))
    tok = load_tokenizer(path)
    base = load_state_file(path)
    adapters = {}
    for version in (1, 2, 3):  # three trained-looking adapters (B != 0), each its own
        torch.manual_seed(100 + version)
        peft_model = add_lora(load_model(path), rank=4, alpha=8, targets=TARGETS)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.3)
        adapters[version] = {k: v.detach().clone() for k, v in lora_delta(peft_model).items()}
    merged = {}
    for version, delta in adapters.items():
        model = load_model(path).eval()
        load_weights_into(model, merge_lora_delta(base, delta))
        merged[version] = model
    merged[0] = load_model(path).eval()
    return {"path": path, "stop": [tok.convert_tokens_to_ids("<|im_end|>")], "base": base, "adapters": adapters,
            "merged": merged}


def prompts(n: int, seed: int, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    common = [rng.randrange(100, 20000) for _ in range(shared)]
    return [common + [rng.randrange(100, 20000) for _ in range(rng.randrange(5, 30))] for _ in range(n)]


def teacher_forced(model, prompt: list[int], tokens: list[int], temperature: float = 1.0) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: -1].float()
    return token_logprobs(logits, torch.tensor(tokens), temperature)


async def load(engine: ContinuousEngine, setup, version: int) -> None:
    delta = setup["adapters"][version]
    await engine.update_weights(merge_lora_delta(setup["base"], delta), version, delta)


async def test_every_held_version_and_the_base_give_their_own_logprobs_in_one_batch(setup) -> None:
    engine = ContinuousEngine(setup["path"], "e", setup["stop"], prefill_chunk=16, seed=1, adapter_versions=3)
    try:
        for version in (1, 2, 3):
            await load(engine, setup, version)
        assert engine.held_versions == (0, 1, 2, 3) and engine.policy_version == 3
        batch = prompts(8, seed=2, shared=20)
        versions = [0, 1, 2, 3, 3, 2, 1, 0]  # rows of every version decode together, sharing an opening by version
        gens = await asyncio.gather(*[engine.generate(p, 10, 1.0, version=v)
                                      for p, v in zip(batch, versions, strict=True)])
    finally:
        engine.close()
    for prompt, version, gen in zip(batch, versions, gens, strict=True):
        assert gen.policy_version == version
        assert gen.engine_id == ("e" if version == 3 else f"e@v{version}")
        torch.testing.assert_close(torch.tensor(gen.logprobs),
                                   teacher_forced(setup["merged"][version], prompt, gen.tokens), rtol=0, atol=1e-4)
    # the references differ: each row really played its own version
    p, g = batch[1], gens[1]
    assert not torch.allclose(teacher_forced(setup["merged"][1], p, g.tokens),
                              teacher_forced(setup["merged"][2], p, g.tokens), atol=1e-2)


async def test_a_cache_is_reused_only_by_its_own_version_and_survives_an_update_while_held(setup) -> None:
    engine = ContinuousEngine(setup["path"], "e", setup["stop"], seed=2, adapter_versions=2)
    prompt = prompts(1, seed=3)[0]
    try:
        await load(engine, setup, 1)
        await load(engine, setup, 2)
        first = await engine.generate(prompt, 8, 1.0, version=1)
        before = engine.stats.prefilled_tokens
        second_prompt = prompt + first.tokens + [11, 12, 13]
        other = await engine.generate(second_prompt, 8, 1.0, version=2)  # the v1 cache is no good for v2
        recomputed = engine.stats.prefilled_tokens - before
        again = await engine.generate(second_prompt + other.tokens + [14], 8, 1.0, version=1)
        await load(engine, setup, 3)  # v2 becomes the older version held, v1 is dropped with its caches
        assert engine.held_versions == (0, 2, 3)
        resumed_before = engine.stats.prefilled_tokens
        resumed_prompt = second_prompt + other.tokens + [15, 16]
        resumed = await engine.generate(resumed_prompt, 8, 1.0, version=2)
        resumed_fed = engine.stats.prefilled_tokens - resumed_before
        gone = await engine.generate(prompt, 4, 1.0, version=1)  # no longer held: the current version plays
    finally:
        engine.close()
    assert recomputed == len(second_prompt)
    assert again.policy_version == 1 and other.policy_version == 2 and resumed.policy_version == 2
    assert resumed_fed == 3  # the v2 sequence kept across the update: the last sampled token and two new ones
    assert gone.policy_version == 3 and gone.engine_id == "e"
    for model_version, p, g in ((2, second_prompt, other), (1, second_prompt + other.tokens + [14], again),
                                (2, resumed_prompt, resumed), (3, prompt, gone)):
        torch.testing.assert_close(torch.tensor(g.logprobs), teacher_forced(setup["merged"][model_version], p, g.tokens),
                                   rtol=0, atol=1e-4)


async def test_bf16_matmuls_with_held_versions_stay_close_to_each_version(setup) -> None:
    engine = ContinuousEngine(setup["path"], "e", setup["stop"], seed=4, adapter_versions=2, matmul_dtype="bfloat16")
    batch = prompts(4, seed=5)
    try:
        await load(engine, setup, 1)
        await load(engine, setup, 2)
        gens = await asyncio.gather(*[engine.generate(p, 8, 0.0, version=v) for p, v in zip(batch, [0, 1, 2, 1],
                                                                                           strict=True)])
    finally:
        engine.close()
    for prompt, version, gen in zip(batch, [0, 1, 2, 1], gens, strict=True):
        assert gen.policy_version == version
        reference = teacher_forced(setup["merged"][version], prompt, gen.tokens)
        assert (torch.tensor(gen.logprobs) - reference).abs().max() < 0.05


async def test_the_reference_engine_plays_held_versions_batch_by_batch(setup) -> None:
    tok = load_tokenizer(setup["path"])
    engine = HFEngine(setup["path"], "h", setup["stop"], tok.pad_token_id, adapter_versions=3)
    batch = prompts(4, seed=6)
    versions = [0, 1, 2, 1]
    try:
        await load(engine, setup, 1)
        await load(engine, setup, 2)
        gens = await asyncio.gather(*[engine.generate(p, 8, 1.0, version=v) for p, v in zip(batch, versions,
                                                                                           strict=True)])
        current = await engine.generate(batch[0], 8, 1.0)  # the hooks of the last batch are gone
    finally:
        engine.close()
    for prompt, version, gen in [*zip(batch, versions, gens, strict=True), (batch[0], 2, current)]:
        assert gen.policy_version == version and gen.engine_id == ("h" if version == 2 else f"h@v{version}")
        torch.testing.assert_close(torch.tensor(gen.logprobs),
                                   teacher_forced(setup["merged"][version], prompt, gen.tokens), rtol=0, atol=1e-4)


def test_older_versions_are_kept_every_keep_every_versions(setup) -> None:
    lm = PackedLM(load_model(setup["path"]))
    store = AdapterSet(lm, capacity=3, keep_every=3)
    delta = setup["adapters"][1]
    held = []
    for version in range(1, 12):
        store.advance(version, parse_adapter(delta, version))
        held.append(store.versions)
    # v1 is kept when v2 comes (nothing older held), then one every 3 versions; at most 2 older ones
    assert held[:4] == [(0, 1), (0, 1, 2), (0, 1, 3), (0, 1, 4)]
    assert held[4] == (0, 1, 4, 5) and held[6] == (0, 1, 4, 7) and held[7] == (0, 4, 7, 8) and held[8] == (0, 4, 7, 9)
    assert held[10] == (0, 7, 10, 11)
    assert store.corrections(np.array([11, 11, 11])) is None  # a step of the current version only: no extra work
    step = store.corrections(np.array([11, 0, 7, 11]))
    assert step is not None and step.rows.tolist() == [1, 2]
    assert step.masks["qkv"].shape == (2, 3 * 4 * 3)  # 3 held adapters of rank 4, q/k/v each
    store.advance(12, None)  # a full-weights broadcast: nothing older can be played from these weights
    assert store.versions == (12,)


def test_an_adapter_on_a_module_the_engine_cannot_reach_is_refused(setup) -> None:
    delta = dict(setup["adapters"][1])
    delta["lm_head.lora_A"] = torch.zeros(4, 8)
    delta["lm_head.lora_B"] = torch.zeros(8, 4)
    with pytest.raises(ValueError, match="lm_head"):
        parse_adapter(delta, 1)


async def test_cross_policy_turns_draw_the_older_versions_the_engine_holds(setup) -> None:
    from services.rollout.turns import EngineTurns, TurnState
    from shared.config import RolloutConfig
    from shared.messages import EpisodeJob

    tok = load_tokenizer(setup["path"])
    engine = ContinuousEngine(setup["path"], "e", setup["stop"], seed=6, adapter_versions=3)
    job = EpisodeJob(episode_id="x", group_id="g", task="db", task_id="t", group_size=1, max_new_tokens=4)
    played: dict[bool, set[tuple[int, str]]] = {}
    try:
        for base in (False, True):
            cfg = RolloutConfig(cross_policy_prob=1.0, adapter_versions=3, cross_policy_base=base)
            counts = {"local": 0, "pool": 0, "held": 0}
            source = EngineTurns(engine, tok, None, None, cfg, random.Random(0), {1: "d1", 2: "d2", 3: "d3"}, counts)
            state = TurnState(job=job, env=None, env_replica="", session_id="s", turn=0, tokens=prompts(1, seed=7)[0],
                              opening=[], tools=[])
            if not base:  # nothing older held yet: the current version plays, and counts as local
                first = await source.next_turn(state)
                assert first.generation.policy_version == 0 and counts == {"local": 1, "pool": 0, "held": 0}
                for version in (1, 2, 3):
                    await load(engine, setup, version)
                counts["local"] = 0
            turns = [(await source.next_turn(state)).generation for _ in range(12)]
            played[base] = {(g.policy_version, g.weights_digest) for g in turns}
            assert counts["held"] == 12 and counts["local"] == 0 and counts["pool"] == 0
            assert all(g.engine_id == f"e@v{g.policy_version}" for g in turns)
    finally:
        engine.close()
    assert played[False] == {(1, "d1"), (2, "d2")}  # every older adapter held, each naming its own digest
    assert played[True] == {(0, ""), (1, "d1"), (2, "d2")}  # and the base model, which has no digest
