"""The trainer's update, pinned: three steps on a fixed batch, through the real intake (trajectories
published on TRAJ of a real nats-server, the trainer's ``run`` loop), must leave exactly the weights (and
step figures) recorded in ``tests/trainer/data/trainer_update_pin.json`` for the full-weights RL path (KL,
two minibatches, several micro-batches, staleness downweighting, warm-up), the LoRA path and SFT.

On the machine and library versions that recorded the fixture the weights must match bit for bit (a
digest of every trained tensor; ``fingerprint`` names the CPU, its features and the libraries); elsewhere
a different kernel may add in another order, so per tensor the sum, the norm and a fixed random projection
must agree within what float order explains (the fixture was recorded on an Intel Xeon with AMX).

``JETRL_PIN_WRITE=1 pytest tests/trainer/test_trainer_update.py`` records the fixture again: only for a change
meant to change the update.
"""

from __future__ import annotations

import asyncio
import copy
import hashlib
import json
import os
import platform
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers

from services.trainer.trainer import Trainer
from shared.config import ModelConfig
from shared.messages import Trajectory, TurnInfo, encode
from shared.model import load_model, quiet_transformers, resolve_model

PIN = Path(__file__).parent / "data" / "trainer_update_pin.json"
STEPS = 3
CASES: dict[str, dict[str, Any]] = {
    "full": dict(lr=1e-3, kl_coef=0.01, minibatches=2, micro_batch_tokens=40, warmup_steps=2, dual_clip=3.0,
                 max_staleness={"*": 1}, staleness_mode="downweight"),
    "lora": dict(lr=5e-3, lora_rank=4, lora_alpha=8.0, kl_coef=0.01, micro_batch_tokens=40),
    "sft": dict(lr=1e-3, mode="sft", sft_context_weight=0.5, micro_batch_tokens=40),
}
STAT_KEYS = ("train/loss", "train/grad_norm", "train/tokens", "train/lr", "train/clipfrac", "train/approx_kl",
             "train/kl_ref", "train/packed_rows", "train/context_loss", "train/stale_downweighted")


@pytest.fixture(scope="module")
def base_model() -> Any:
    quiet_transformers()
    return load_model(resolve_model(ModelConfig()))


def fixed_batch() -> list[Trajectory]:
    """Two groups per step, two tasks, two turns per episode with a tool result between them; each
    group shares its opening (prefix sharing), the ChatML-like first token opens every message."""
    rng = random.Random(7)
    out = []
    for g in range(2 * STEPS):
        task = "db" if g % 2 == 0 else "os"
        opening = [1] + [rng.randrange(2, 4000) for _ in range(5)] + [1] + [rng.randrange(2, 4000) for _ in range(4)]
        for e in range(2):
            first = [rng.randrange(2, 4000) for _ in range(4)]
            tool = [1] + [rng.randrange(2, 4000) for _ in range(3)]
            second = [rng.randrange(2, 4000) for _ in range(3)]
            tokens = opening + first + tool + second
            a, b = len(opening), len(opening) + len(first)
            c = b + len(tool)
            mask = [0] * a + [1] * len(first) + [0] * len(tool) + [1] * len(second)
            logprobs = [round(-rng.uniform(0.2, 3.0), 4) if m else 0.0 for m in mask]
            out.append(Trajectory(
                episode_id=f"e{g}-{e}", group_id=f"g{g}", task=task, task_id=f"t{g}", split="train", group_size=2,
                tokens=tokens, logprobs=logprobs, loss_mask=mask, prompt_len=a,
                turns=[TurnInfo(start=a, end=b, engine_id="x", policy_version=0),
                       TurnInfo(start=c, end=len(tokens), engine_id="x", policy_version=0)],
                reward=[1.0, 0.0, 0.5, 1.0][(g + e) % 4] if g != 1 else 1.0, status="completed", replica_id="r",
                temperature=[1.0, 0.8][e]))
    return out


def fingerprint() -> str:
    """What decides the float order of the update: kernels (the CPU and its features, library versions).
    torch's capability alone is not enough: an AVX-512 AMD EPYC and an AVX-512 Intel Xeon with AMX report
    the same one and differ in the sixth digit after three steps."""
    return (f"{platform.machine()} {torch.backends.cpu.get_cpu_capability()} torch {torch.__version__} "
            f"transformers {transformers.__version__} threads {torch.get_num_threads()} cpu {cpu_model()}")


def cpu_model() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown"
    model = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "")
    return model + (" amx" if " amx_tile" in info else "")


def summary(trained: dict[str, torch.Tensor]) -> dict[str, Any]:
    digest = hashlib.sha256()
    tensors = {}
    for name in sorted(trained):
        value = trained[name].detach().contiguous()
        digest.update(name.encode() + value.numpy().tobytes())
        flat = value.double().flatten()
        probe = torch.randn(flat.numel(), generator=torch.Generator().manual_seed(11), dtype=torch.float64)
        tensors[name] = [float(flat.sum()), float(flat.norm()), float(flat @ probe)]
    return {"digest": digest.hexdigest(), "tensors": tensors}


async def three_steps(case: str, nc: Any, config: Any, subjects: Any, base_model: Any, tmp_path: Path) -> dict:
    for key, value in CASES[case].items():
        setattr(config.trainer, key, value)
    config.trainer.steps, config.trainer.min_groups, config.trainer.max_groups = STEPS, 2, 2
    config.trainer.checkpoint_every = 0
    js = nc.jetstream()
    for traj in fixed_batch():
        await js.publish(subjects.traj(traj.task), encode(traj))
    torch.manual_seed(0)  # the LoRA adapter's initial A
    trainer = Trainer(nc, js, subjects, config.trainer, copy.deepcopy(base_model), tmp_path, "trainer-pin")
    await asyncio.wait_for(trainer.run(asyncio.Event()), 120)
    assert trainer.step == STEPS
    trained = {k: v for k, v in trainer.model.named_parameters() if v.requires_grad}
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return summary(trained) | {"policy_version": trainer.policy_version,
                               "stats": [{k: row[k] for k in STAT_KEYS if k in row} for row in rows]}


@pytest.fixture
def pinned_threads() -> Any:
    """The thread count the fixture was recorded with: it decides the order of the kernels' sums, and a test
    before this one may have changed it (an engine sets one thread)."""
    before = torch.get_num_threads()
    if PIN.exists() and os.environ.get("JETRL_PIN_WRITE") != "1":
        recorded = next(iter(json.loads(PIN.read_text()).values()))["fingerprint"]
        torch.set_num_threads(int(recorded.rsplit("threads ", 1)[1]))
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("case", sorted(CASES))
async def test_three_steps_leave_the_pinned_weights(case: str, nc, config, subjects, base_model, tmp_path,
                                                    pinned_threads) -> None:
    got = await three_steps(case, nc, config, subjects, base_model, tmp_path)
    if os.environ.get("JETRL_PIN_WRITE") == "1":
        pins = json.loads(PIN.read_text()) if PIN.exists() else {}
        pins[case] = got | {"fingerprint": fingerprint()}
        PIN.parent.mkdir(exist_ok=True)
        PIN.write_text(json.dumps(pins, indent=1, sort_keys=True) + "\n")
        return
    want = json.loads(PIN.read_text())[case]
    assert got["policy_version"] == want["policy_version"]
    assert [sorted(r) for r in got["stats"]] == [sorted(r) for r in want["stats"]]
    same_kernels = want["fingerprint"] == fingerprint()
    rel = 1e-5 if same_kernels else 1e-4  # other kernels add in another order; three Adam steps amplify it
    for got_row, want_row in zip(got["stats"], want["stats"], strict=True):
        for key, value in want_row.items():
            assert got_row[key] == pytest.approx(value, rel=rel, abs=1e-9), key
    assert sorted(got["tensors"]) == sorted(want["tensors"])
    if same_kernels:
        assert got["digest"] == want["digest"], "the update changed: the weights after three steps differ"
    for name, figures in want["tensors"].items():
        # Other kernels: Adam divides by the root of the squared gradients, so an element whose gradient is
        # near zero moves by about +-lr whichever way float order tips it. Measured across CPUs: up to 8e-5 of
        # the tensor's norm; a change of the update itself moves every element by ~lr, ~5e-2 of the norm.
        spread = 1e-7 if same_kernels else 5e-4 * figures[1]
        assert got["tensors"][name] == pytest.approx(figures, rel=rel, abs=spread), name
