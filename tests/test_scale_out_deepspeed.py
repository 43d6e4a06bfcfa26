"""DeepSpeed trainer backend: ZeRO 1/2/3 over gloo on the CPU, two ranks, trains the tiny model to the
same loss curve as the plain torch backend on the same fixed batch.

Opt-in tier (``make test-deepspeed``): each two-rank run starts DeepSpeed twice, ~30-60 s here, and the
first start ever compiles DeepSpeed's shared-memory comm op (about a minute, then cached).

The file is also the per-rank script: ``torchrun --nproc_per_node 2 tests/test_scale_out_deepspeed.py
--backend deepspeed --zero-stage 2 --out curve.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script by torchrun, too

from services.trainer.packing import pack, packed_logprobs  # noqa: E402
from services.trainer.trainer import Trainer  # noqa: E402
from shared.config import JetRLConfig, ModelConfig, TrainerConfig  # noqa: E402
from shared.lm import PackedLM  # noqa: E402
from shared.messages import EpisodeStatus, Trajectory, TurnInfo  # noqa: E402
from shared.model import load_model, quiet_transformers, resolve_model, weights_to_bytes  # noqa: E402
from shared.subjects import Subjects  # noqa: E402

STEPS = 4


def trainer_config(**over: object) -> TrainerConfig:
    # A big learning rate and small micro-batches: the curve moves, and every step accumulates over
    # several backward passes and two optimizer steps (minibatches), as a real batch does.
    cfg = TrainerConfig(lr=3e-3, micro_batch_tokens=200, minibatches=2, max_grad_norm=1.0)
    for key, value in over.items():
        setattr(cfg, key, value)
    return cfg


def fixed_batch(model: torch.nn.Module, groups: int = 3, group_size: int = 4) -> list[Trajectory]:
    """The same batch in every process: random tokens, rewards that differ within each group, and
    behaviour logprobs from the initial model, nudged so the importance ratios are not all 1."""
    gen = torch.Generator().manual_seed(7)
    vocab = model.config.vocab_size
    trajs = []
    for g in range(groups):
        for i in range(group_size):
            prompt, n = 12, int(torch.randint(30, 70, (1,), generator=gen))
            tokens = torch.randint(0, vocab, (n,), generator=gen).tolist()
            mask = [0] * prompt + [1] * (n - prompt)
            trajs.append(Trajectory(
                episode_id=f"e{g}-{i}", group_id=f"g{g}", task="db" if g % 2 else "os", task_id=str(g), split="train",
                group_size=group_size, tokens=tokens, logprobs=[0.0] * n, loss_mask=mask, prompt_len=prompt,
                turns=[TurnInfo(start=prompt, end=n, engine_id="e", policy_version=0)], reward=float(i % 2 == g % 2),
                status=EpisodeStatus.COMPLETED, replica_id="r"))
    with torch.no_grad():
        for t in trajs:
            mb = pack([t.tokens], [t.loss_mask], [0])
            lp = packed_logprobs(PackedLM(model), mb, torch.ones(mb.targets.numel()))
            noise = 0.05 * torch.randn(lp.shape, generator=gen)
            t.logprobs = [0.0] * t.prompt_len + (lp + noise).tolist()
    return trajs


def run_curve(backend: str, zero_stage: int, out: Path) -> None:
    """Train STEPS steps on the fixed batch; rank 0 writes losses, grad norms and final weights."""
    quiet_transformers()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = JetRLConfig()
    cfg.model = ModelConfig()
    cfg.trainer = trainer_config(backend=backend, zero_stage=zero_stage)
    model = load_model(resolve_model(cfg.model))
    batch = fixed_batch(model)
    run_dir = out.parent
    if backend == "deepspeed":
        from services.trainer.deepspeed_backend import start_ranks

        cls = start_ranks(cfg, model, run_dir)  # ranks > 0 follow and exit in here
    else:
        cls = Trainer
    trainer = cls(None, None, Subjects("t"), cfg.trainer, model, run_dir, "trainer-test")
    curve: dict[str, list[float]] = {"loss": [], "grad_norm": []}
    for _ in range(STEPS):
        stats = trainer._optimise(batch)
        trainer.step += 1
        curve["loss"].append(stats["train/loss"])
        curve["grad_norm"].append(stats["train/grad_norm"])
    if backend == "deepspeed":
        trainer._broadcast(("stop",))
    state = {k: v.float() for k, v in trainer.model.state_dict().items()}
    torch.save(state, out.with_suffix(".pt"))
    out.write_text(json.dumps(curve))
    assert len(weights_to_bytes(trainer.model)) > 0


def _deepspeed_run(tmp_path: Path, zero_stage: int) -> tuple[dict, dict]:
    out = tmp_path / f"zero{zero_stage}.json"
    env = dict(os.environ, DS_BUILD_OPS="0", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(Path(__file__)), "--backend", "deepspeed", "--zero-stage", str(zero_stage), "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text()), torch.load(out.with_suffix(".pt"))


@pytest.fixture(scope="module")
def torch_curve(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, dict]:
    out = tmp_path_factory.mktemp("torch") / "torch.json"
    run_curve("torch", 0, out)
    return json.loads(out.read_text()), torch.load(out.with_suffix(".pt"))


@pytest.mark.skipif(os.environ.get("JETRL_TEST_DEEPSPEED") != "1", reason="opt-in tier: make test-deepspeed")
@pytest.mark.parametrize("zero_stage", [1, 2, 3])
def test_deepspeed_matches_torch_loss_curve(tmp_path: Path, torch_curve: tuple[dict, dict], zero_stage: int) -> None:
    pytest.importorskip("deepspeed", reason="deepspeed not installed: make test-deepspeed installs it")
    ref, ref_state = torch_curve
    got, state = _deepspeed_run(tmp_path, zero_stage)
    # The curve must move, or matching it would prove nothing.
    assert abs(ref["loss"][-1] - ref["loss"][0]) > 1e-3, ref
    assert got["loss"] == pytest.approx(ref["loss"], rel=1e-3, abs=1e-5), (got, ref)
    assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-3), (got, ref)
    assert state.keys() == ref_state.keys()
    worst = max(float((state[k] - ref_state[k]).abs().max()) for k in ref_state)
    assert worst < 1e-4, worst


def test_plain_torch_curve_moves(torch_curve: tuple[dict, dict]) -> None:
    """The reference the DeepSpeed tier compares with (cheap: runs in make test)."""
    ref, _ = torch_curve
    assert len(ref["loss"]) == STEPS and all(g > 0 for g in ref["grad_norm"])
    assert abs(ref["loss"][-1] - ref["loss"][0]) > 1e-3, ref


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="deepspeed")
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    run_curve(args.backend, args.zero_stage, args.out)
