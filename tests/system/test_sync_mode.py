"""``controller.sync``: the on-policy baseline, through ``jetrl up`` (every service its own process) over a
real nats-server. Each batch is played with the weights of the step before it and trained at staleness 0;
no turn of batch k+1 starts before batch k is trained and its weights are loaded."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from shared.config import JetRLConfig, save_config
from shared.messages import ActionEvent, Trajectory
from shared.subjects import Subjects
from tests.procs import log_tails
from tests.system.test_e2e import REPO, read_stream, small_config

pytestmark = pytest.mark.slow


def test_sync_mode_trains_every_batch_on_policy(config: JetRLConfig, tmp_path: Path) -> None:
    cfg = small_config(config, tmp_path, trainer__steps=3, controller__sync=True, controller__max_inflight=16)
    cfg_path = tmp_path / "sync.toml"
    save_config(cfg, cfg_path)
    proc = subprocess.run([sys.executable, "-m", "jetrl.cli", "up", "--config", str(cfg_path), "--rollouts", "2"],
                          cwd=REPO, capture_output=True, text=True, timeout=420)
    run_dir = Path(cfg.run.dir)
    logs = log_tails(run_dir)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{logs}"

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy_version"] for r in rows] == [1, 2, 3]  # every step a real update (kl_coef)
    assert all(r["train/staleness_max"] == 0.0 and r["train/trajectories"] == 2 for r in rows)

    subjects = Subjects(cfg.nats.prefix)
    trajs = asyncio.run(read_stream(cfg, subjects.traj(">"), Trajectory))
    actions = asyncio.run(read_stream(cfg, subjects.action(), ActionEvent))
    by_version: dict[int, list[Trajectory]] = defaultdict(list)
    for t in trajs:
        versions = {turn.policy_version for turn in t.turns}
        assert len(versions) == 1, f"{t.episode_id} mixes policy versions {versions}"
        by_version[versions.pop()].append(t)
    # one batch (min_groups = 1 group of 2) per version, then the next batch on the next version
    assert sorted(by_version) == [0, 1, 2] and all(len(b) == 2 for b in by_version.values())
    first_turn = {a.episode_id: a.ts for a in actions if a.turn == 0}
    for version in (1, 2):
        done_before = max(t.created_at for t in by_version[version - 1])
        started = min(first_turn[t.episode_id] for t in by_version[version])
        assert started > done_before, f"batch v{version} started before batch v{version - 1} was played"
