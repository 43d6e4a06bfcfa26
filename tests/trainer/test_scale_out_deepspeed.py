"""DeepSpeed trainer backend: two data-parallel ranks (ZeRO 1/2/3, gloo on the CPU) make the update of
one plain-torch rank on the whole batch, apply the learning-rate schedule they report, and resume from
their checkpoints with their optimizer state.

Opt-in tier (``make test-deepspeed``): each two-rank run starts DeepSpeed, ~20-60 s here, and the
first start ever compiles DeepSpeed's shared-memory comm op (about a minute, then cached). The
single-rank reference and the split's bookkeeping need no DeepSpeed and run in ``make test``.

The file is also the per-rank script: ``torchrun --nproc_per_node 2 tests/trainer/test_scale_out_deepspeed.py
--backend deepspeed --zero-stage 2 --out run/curve.json``.
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

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # run as a script by torchrun, too

from services.trainer import rl  # noqa: E402
from services.trainer.batch import plan_step, trained_positions  # noqa: E402
from services.trainer.data_parallel import split_contiguous  # noqa: E402
from services.trainer.packing import pack, packed_logprobs  # noqa: E402
from services.trainer.trainer import Trainer  # noqa: E402
from shared.config import JetRLConfig, ModelConfig, TrainerConfig  # noqa: E402
from shared.lm import PackedLM  # noqa: E402
from shared.messages import EpisodeStatus, Trajectory, TurnInfo  # noqa: E402
from shared.model import load_model, quiet_transformers, resolve_model, weights_to_bytes  # noqa: E402
from shared.subjects import Subjects  # noqa: E402

# The steps every run takes: the fixed batch, then a batch where one trajectory alone is trained (its
# group mate is past the staleness bound), so one of two ranks has no trained token in that step, then
# the fixed batch again. Three warm-up steps: the learning rate differs in each.
PLAN = ("main", "lone", "main")
WARMUP = 3
LR = 3e-3
DEEPSPEED = pytest.mark.skipif(os.environ.get("JETRL_TEST_DEEPSPEED") != "1",
                               reason="opt-in tier: make test-deepspeed")


def trainer_config(**over: object) -> TrainerConfig:
    # A big learning rate and small micro-batches: the curve moves, and every step accumulates over
    # several backward passes and two optimizer steps (minibatches), as a real batch does.
    cfg = TrainerConfig(lr=LR, micro_batch_tokens=200, minibatches=2, max_grad_norm=1.0, warmup_steps=WARMUP,
                        steps=len(PLAN), checkpoint_every=0, keep_checkpoints=0, max_staleness={"kg": 0})
    for key, value in over.items():
        setattr(cfg, key, value)
    return cfg


def _traj(gen: torch.Generator, vocab: int, episode: str, group: str, task: str, n: int, reward: float,
          group_size: int) -> Trajectory:
    prompt = 12
    tokens = torch.randint(0, vocab, (n,), generator=gen).tolist()
    return Trajectory(episode_id=episode, group_id=group, task=task, task_id=group, split="train",
                      group_size=group_size, tokens=tokens, logprobs=[0.0] * n, loss_mask=[0] * prompt + [1] * (n - prompt),
                      prompt_len=prompt, turns=[TurnInfo(start=prompt, end=n, engine_id="e", policy_version=0)],
                      reward=reward, status=EpisodeStatus.COMPLETED, replica_id="r")


def fixed_batches(model: torch.nn.Module, groups: int = 3, group_size: int = 4) -> dict[str, list[Trajectory]]:
    """The same batches in every process: random tokens of uneven lengths, rewards that differ within
    each group, and behaviour logprobs from the initial model, nudged so the ratios are not all 1."""
    gen = torch.Generator().manual_seed(7)
    vocab = model.config.vocab_size
    main = [_traj(gen, vocab, f"e{g}-{i}", f"g{g}", "db" if g % 2 else "os", int(torch.randint(20, 160, (1,), generator=gen)),
                  float(i % 2 == g % 2), group_size) for g in range(groups) for i in range(group_size)]
    lone = [_traj(gen, vocab, f"k-{i}", "gk", "kg", 40 + 10 * i, float(i == 0), 2) for i in range(2)]
    with torch.no_grad():
        for t in main + lone:
            mb = pack([t.tokens], [t.loss_mask], [0])
            lp = packed_logprobs(PackedLM(model), mb, torch.ones(mb.targets.numel()))
            noise = 0.05 * torch.randn(lp.shape, generator=gen)
            t.logprobs = [0.0] * t.prompt_len + (lp + noise).tolist()
    return {"main": main, "lone": lone}


def batch_for(batches: dict[str, list[Trajectory]], name: str, policy_version: int) -> list[Trajectory]:
    if name == "main":
        return batches["main"]
    # "kg" allows no lag: the first trajectory is on the current policy, its mate one version behind
    # (dropped, but its reward still makes the group's advantage).
    assert policy_version >= 1, "the lone batch needs a trainer that has stepped"
    lone = batches["lone"]
    lone[0].turns[0].policy_version, lone[1].turns[0].policy_version = policy_version, policy_version - 1
    return lone


def run_curve(backend: str, zero_stage: int, out: Path, stop_after: int = len(PLAN), checkpoint_every: int = 0,
              mode: str = "rl") -> None:
    """Train the PLAN's steps (resuming from ``out``'s directory if it holds a checkpoint); rank 0 writes
    per-step losses, grad norms, reported and applied learning rates, and the final weights."""
    quiet_transformers()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    cfg = JetRLConfig()
    cfg.model = ModelConfig()
    cfg.trainer = trainer_config(backend=backend, checkpoint_every=checkpoint_every, mode=mode)
    cfg.trainer.deepspeed.zero_stage = zero_stage
    model = load_model(resolve_model(cfg.model))
    batches = fixed_batches(model)
    run_dir = out.parent
    if backend == "deepspeed":
        from services.trainer.deepspeed_backend import start_ranks

        make = start_ranks(cfg, model, run_dir)  # ranks > 0 follow and exit in here
    else:
        make = Trainer
    trainer = make(None, None, Subjects("t"), cfg.trainer, model, run_dir, "trainer-test")
    curve: dict[str, object] = {"resumed": trainer.resume(), "start_step": trainer.step}
    rows = []
    while trainer.step < stop_after:
        stats, ledger = trainer.optimise(batch_for(batches, PLAN[trainer.step], trainer.policy_version))
        applied = trainer.backend.applied_lr()
        trainer.step += 1  # what Trainer.train_step does after the optimizer step, less NATS
        if ledger.updated:
            trainer.policy_version += 1
        if trainer.run_state.checkpoint_due(trainer.step):
            trainer.write_checkpoint()
        rows.append({"loss": stats["train/loss"], "grad_norm": stats["train/grad_norm"], "lr": stats["train/lr"],
                     "lr_applied": applied, "tokens": stats["train/tokens"],
                     "rank_tokens_min": stats.get("train/rank_tokens_min"),
                     "rank_tokens_max": stats.get("train/rank_tokens_max")})
    trainer.backend.close()  # the other ranks stop
    curve.update(rows=rows, policy_version=trainer.policy_version)
    state = {k: v.float() for k, v in trainer.model.state_dict().items()}
    torch.save(state, out.with_suffix(".pt"))
    out.write_text(json.dumps(curve))
    assert len(weights_to_bytes(trainer.model)) > 0


def _two_ranks(out: Path, zero_stage: int, *extra: str) -> tuple[dict, dict]:
    env = dict(os.environ, DS_BUILD_OPS="0", OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(Path(__file__)), "--backend", "deepspeed", "--zero-stage", str(zero_stage), "--out", str(out), *extra],
        env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(out.read_text()), torch.load(out.with_suffix(".pt"))


class Runs(dict):
    """Runs made on first use, by key (several tests compare with the same run)."""

    def __init__(self, make: object) -> None:
        super().__init__()
        self.make = make

    def __missing__(self, key: object) -> tuple[dict, dict]:
        self[key] = self.make(key)  # type: ignore[operator]
        return self[key]


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """The plain torch trainer, one process, the whole batch, by mode (rl | sft): what the ranks must add up to."""
    def make(mode: str) -> tuple[dict, dict]:
        out = tmp_path_factory.mktemp(f"torch-{mode}") / "torch.json"
        run_curve("torch", 0, out, mode=mode)
        return json.loads(out.read_text()), torch.load(out.with_suffix(".pt"))

    return Runs(make)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    """Two-rank DeepSpeed runs by (mode, ZeRO stage)."""
    def make(key: tuple[str, int]) -> tuple[dict, dict]:
        mode, stage = key
        pytest.importorskip("deepspeed", reason="deepspeed not installed: make test-deepspeed installs it")
        return _two_ranks(tmp_path_factory.mktemp(f"{mode}-zero{stage}") / "run.json", stage, "--mode", mode)

    return Runs(make)


def _worst(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


@DEEPSPEED
@pytest.mark.parametrize(("mode", "zero_stage"), [("rl", 1), ("rl", 2), ("rl", 3), ("sft", 2)])
def test_two_ranks_make_the_one_rank_update(one_rank: Runs, two_ranks: Runs, mode: str, zero_stage: int) -> None:
    ref, ref_state = one_rank[mode]
    got, state = two_ranks[mode, zero_stage]
    ref_rows, rows = ref["rows"], got["rows"]
    # The split was uneven, and in the lone step one rank had no trained token at all.
    assert rows[0]["rank_tokens_min"] < rows[0]["rank_tokens_max"], rows[0]
    assert rows[1]["rank_tokens_min"] == 0.0 and rows[1]["tokens"] > 0, rows[1]
    # The learning rate each step is the one reported, on the torch optimizer DeepSpeed steps, and it ramps.
    ramp = [LR * min(1.0, (k + 1) / WARMUP) for k in range(len(PLAN))]
    assert [r["lr_applied"] for r in rows] == pytest.approx(ramp, rel=1e-9)
    assert [r["lr"] for r in rows] == pytest.approx(ramp, rel=1e-9)
    assert [r["lr_applied"] for r in ref_rows] == pytest.approx(ramp, rel=1e-9)
    # Same losses, gradient norms and weights as one rank on the whole batch.
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in ref_rows], rel=1e-3, abs=1e-5), (rows, ref_rows)
    assert [r["grad_norm"] for r in rows] == pytest.approx([r["grad_norm"] for r in ref_rows], rel=1e-3), (rows, ref_rows)
    assert got["policy_version"] == ref["policy_version"] == len(PLAN)
    worst = _worst(state, ref_state)
    assert worst < 1e-4, worst


@DEEPSPEED
@pytest.mark.parametrize("zero_stage", [2, 3])
def test_two_ranks_resume_with_their_optimizer_state(tmp_path: Path, two_ranks: Runs, zero_stage: int) -> None:
    uninterrupted, full_state = two_ranks["rl", zero_stage]
    out = tmp_path / "run.json"
    first, _ = _two_ranks(out, zero_stage, "--stop-after", "2", "--checkpoint-every", "1")
    assert not first["resumed"] and len(first["rows"]) == 2
    shards = sorted(p.name for p in (tmp_path / "checkpoints" / "step_000002" / "deepspeed").iterdir())
    assert any("optim_states" in name for name in shards), shards  # ZeRO's own sharded optimizer state
    second, state = _two_ranks(out, zero_stage)  # a new pair of processes: the trainer restarted
    assert second["resumed"] and second["start_step"] == 2 and len(second["rows"]) == 1
    assert second["policy_version"] == uninterrupted["policy_version"] == len(PLAN)
    assert second["rows"][0]["loss"] == pytest.approx(uninterrupted["rows"][2]["loss"], rel=1e-3, abs=1e-5)
    # Adam's moments came back: without them the third step would move every weight by about lr (3e-3).
    worst = _worst(state, full_state)
    assert worst < 1e-4, worst


@DEEPSPEED
@pytest.mark.slow
def test_jetrl_up_with_two_trainer_ranks_trains_and_resumes(config: JetRLConfig, tmp_path: Path) -> None:
    """``jetrl up --trainer-ranks 2``: torchrun, two DeepSpeed ranks behind one trainer service, two steps
    with checkpoints; then ``--resume`` with a third step: both ranks load their shards and the run goes
    on from step 2 at its policy version."""
    pytest.importorskip("deepspeed", reason="deepspeed not installed: make test-deepspeed installs it")
    from shared.config import save_config
    from tests.system.test_e2e import small_config

    cfg = small_config(config, tmp_path)
    cfg_path = tmp_path / "ranks.toml"
    save_config(cfg, cfg_path)
    run_dir = Path(cfg.run.dir)
    env = dict(os.environ, DS_BUILD_OPS="0", PYTHONPATH=str(REPO))

    def up(*extra: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "jetrl.cli", "up", "--config", str(cfg_path), "--rollouts", "1",
                               "--trainer-ranks", "2", *extra], cwd=REPO, env=env, capture_output=True, text=True,
                              timeout=600)
        trainer_log = (run_dir / "logs" / "trainer.log").read_text()
        assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{trainer_log[-6000:]}"
        return trainer_log

    log_text = up()
    assert log_text.count("deepspeed_ready") == 2 and "world=2" in log_text  # both ranks, one service
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all("train/rank_tokens_min" in r for r in rows)
    assert (run_dir / "checkpoints" / "step_000002" / "deepspeed").is_dir()
    version = rows[-1]["policy_version"]

    log_text = up("--resume", "--trainer.steps=3")
    assert "trainer_resumed" in log_text and "ranks=2" in log_text
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert rows[-1]["policy_version"] == version + 1  # every e2e step is a real optimizer step (KL term)


def test_one_rank_reference_moves(one_rank: Runs) -> None:
    """The reference the DeepSpeed tier compares with (cheap: runs in make test)."""
    ref, _ = one_rank["rl"]
    losses = [r["loss"] for r in ref["rows"]]
    assert len(losses) == len(PLAN) and all(r["grad_norm"] > 0 for r in ref["rows"])
    assert abs(losses[-1] - losses[0]) > 1e-3, losses
    assert ref["policy_version"] == len(PLAN)


def test_ranks_shares_add_up_to_the_whole_batch(tmp_path: Path) -> None:
    """Rank 0's split (no DeepSpeed: the plan is plain Python): every trained trajectory on exactly one
    rank, token loads balanced, and task normalisation from the ranks' summed sums equal to the whole
    batch's, trajectory by trajectory."""
    cfg = trainer_config()
    quiet_transformers()
    model = load_model(resolve_model(ModelConfig()))
    batch = fixed_batches(model)["main"]
    (single,), _ = plan_step(cfg, batch, step=0, policy_version=0, world=1, lr=cfg.lr)
    shares, stats = plan_step(cfg, batch, step=0, policy_version=0, world=2, lr=cfg.lr)
    assert sorted(t.episode_id for s in shares for t in s.trajs) == sorted(t.episode_id for t in single.trajs)
    loads = [sum(len(t.tokens) for t in s.trajs) for s in shares]
    assert stats["train/rank_tokens_min"] == min(loads)
    # whole trajectories, cut per minibatch: each cut within one trajectory of its even share
    assert max(loads) - min(loads) <= 2 * cfg.minibatches * max(len(t.tokens) for t in batch)

    def token_view(share):  # type: ignore[no-untyped-def]
        counts = [len(trained_positions(t)) for t in share.trajs]
        adv = torch.cat([torch.full((n,), item.advantage) for item, n in zip(share.items, counts, strict=True)])
        code = torch.cat([torch.full((n,), share.tasks.index(t.task)) for t, n in zip(share.trajs, counts, strict=True)])
        return adv, code.long(), counts

    for mode in ("scale", "paper"):
        views = [token_view(s) for s in shares]
        sums = sum(rl.task_norm_sums(a, c, len(shares[0].tasks)) for a, c, _ in views)
        by_episode = {}
        for share, (adv, code, counts) in zip(shares, views, strict=True):
            normalised = rl.task_normalize_with(adv, code, sums, mode)
            by_episode.update({t.episode_id: x for t, x in zip(share.trajs, normalised.split(counts), strict=True)})
        adv, code, counts = token_view(single)
        expected = rl.task_normalize(adv, code, mode).split(counts)
        for t, x in zip(single.trajs, expected, strict=True):
            assert torch.allclose(by_episode[t.episode_id], x, atol=1e-6), (mode, t.episode_id)


def test_jetrl_up_trainer_ranks_command() -> None:
    """What ``jetrl up --trainer-ranks N`` starts: the plain trainer for 1, torchrun with N DeepSpeed ranks
    sharing the trainer's threads otherwise, a clear error without DeepSpeed or for N < 1."""
    import importlib.util

    from jetrl.errors import CliError
    from jetrl.supervisor import trainer_command

    assert trainer_command(1, 2) == (["services.trainer"], [])
    with pytest.raises(CliError, match="must be >= 1"):
        trainer_command(0, 2)
    if importlib.util.find_spec("deepspeed") is None:
        with pytest.raises(CliError, match="make venv-deepspeed"):
            trainer_command(2, 2)
        return
    module_args, overrides = trainer_command(4, 2)
    assert module_args == ["torch.distributed.run", "--standalone", "--nproc_per_node=4", "-m", "services.trainer"]
    assert overrides == ["--trainer.backend=deepspeed", "--trainer.torch_threads=1"]


def test_split_contiguous_keeps_groups_together_and_balances_packed_rows() -> None:
    # two groups of four in prefix order: each opening (600 rows) is paid by its first episode, the others
    # add only their own 50: one group per rank, so each opening runs once
    assert split_contiguous([600, 50, 50, 50, 600, 50, 50, 50], 2) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert split_contiguous([100, 10, 10, 10, 70], 2) == [[0], [1, 2, 3, 4]]  # 100 against 100
    assert split_contiguous([5, 5, 5], 2) == [[0, 1], [2]]
    assert split_contiguous([40], 2) == [[0], []]  # fewer trajectories than ranks: a rank gets none
    assert split_contiguous([], 3) == [[], [], []]
    with pytest.raises(ValueError):
        split_contiguous([1], 0)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--backend", default="deepspeed")
    parser.add_argument("--zero-stage", type=int, default=2)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stop-after", type=int, default=len(PLAN))
    parser.add_argument("--checkpoint-every", type=int, default=0)
    parser.add_argument("--mode", default="rl")
    args = parser.parse_args()
    run_curve(args.backend, args.zero_stage, args.out, args.stop_after, args.checkpoint_every, args.mode)
