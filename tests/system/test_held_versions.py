"""Cross-policy sampling in one engine, through every service: ``jetrl up`` with ``rollout.adapter_versions``,
one rollout replica whose engine holds older LoRA versions (and the base model) beside the current one."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest

from services.trainer.intake import Intake
from shared.bus import connect
from shared.config import JetRLConfig, save_config
from shared.messages import Trajectory, WeightsAnnouncement, decode
from shared.subjects import Subjects
from tests.procs import log_tails
from tests.system.test_e2e import REPO, read_stream, small_config

pytestmark = pytest.mark.slow


def test_jetrl_up_one_replica_plays_held_versions_and_the_trainer_takes_them(config: JetRLConfig, tmp_path: Path) -> None:
    """``rollout.adapter_versions``: one rollout replica, one engine, turns of two or more policy versions in
    its trajectories (older LoRA adapters and the base model beside the current version), each naming the
    digest of the version it played, and the trainer trains on them without refusing one."""
    cfg = small_config(config, tmp_path)
    cfg.trainer.steps = 4
    cfg.trainer.lora_rank = 4
    cfg.trainer.lora_alpha = 8
    cfg.trainer.lr = 5e-3
    cfg.rollout.adapter_versions = 2
    cfg.rollout.stale_every = 1
    cfg.rollout.cross_policy_prob = 0.5
    cfg.rollout.cross_policy_base = True
    cfg.rollout.serve_pool = False  # the older versions are in the replica's own engine: no pool involved
    cfg_path = tmp_path / "held.toml"
    save_config(cfg, cfg_path)
    proc = subprocess.run([sys.executable, "-m", "jetrl.cli", "up", "--config", str(cfg_path), "--rollouts", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=420)
    run_dir = Path(cfg.run.dir)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{log_tails(run_dir)}"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert rows[-1]["train/dead_lettered"] == 0 and rows[-1]["train/digest_mismatch"] == 0

    subjects = Subjects(cfg.nats.prefix)
    trajs = asyncio.run(read_stream(cfg, subjects.traj(">"), Trajectory))

    async def announced() -> list[WeightsAnnouncement]:
        nc = await connect(cfg.nats, "pytest-kv")
        kv = await nc.jetstream().key_value(subjects.policy_kv)
        notes = [decode(e.value, WeightsAnnouncement) for e in await kv.history(subjects.policy_version_key)]
        await nc.close()
        return notes

    notes = asyncio.run(announced())
    assert all(n.format == "lora" for n in notes)  # only the adapter travels
    digests = {n.version: n.digest for n in notes}
    assert sorted(digests) == [1, 2, 3, 4]  # every step published a version
    turns = [turn for t in trajs for turn in t.turns]
    assert len({t.replica_id for t in trajs}) == 1  # one rollout replica played every episode
    engine = turns[0].engine_id.split("@")[0]
    played = {(turn.engine_id, turn.policy_version) for turn in turns}
    held_turns = [turn for turn in turns if "@" in turn.engine_id]
    assert held_turns, played  # turns of a version other than the one current when they were played
    for turn in held_turns:
        assert turn.engine_id == f"{engine}@v{turn.policy_version}"
    mixed = [t for t in trajs if len({turn.policy_version for turn in t.turns}) >= 2]
    assert mixed, played  # one episode played by two versions of one engine
    for turn in turns:  # each turn names the weights of the version it played (none for the base model)
        assert turn.weights_digest == digests.get(turn.policy_version, ""), turn
    intake = Intake(None, subjects, cfg.trainer, {"train/digest_mismatch": 0.0}, digests, None)
    assert [intake.check(t) for t in trajs] == [None] * len(trajs)
    trained = sum(r["train/trajectories"] for r in rows)
    assert trained >= 4 and max(r.get("train/staleness_max", 0) for r in rows) >= 1
