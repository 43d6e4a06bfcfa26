"""Every road an attacker took against a live run (tests/system/attack_roads.py), tried again all through a
`jetrl up` run (its embedded nats-server, one user per role and per replica, signed control messages), each
asserted refused while the run goes on training and ends on the trainer's own word (``make test-faults``).
tests/system/test_compose_run.py takes the same roads against a compose cluster."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from shared.config import save_config
from shared.subjects import Subjects
from tests.system.attack_roads import attack, check_refused
from tests.system.test_faults import fault_config, log_tails, steps_done

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.faults


def status(run_dir: Path) -> dict:
    url = (run_dir / "controller.url").read_text().strip()
    token = (run_dir / "controller.token").read_text().strip()
    request = urllib.request.Request(f"{url}/status", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(request, timeout=5) as resp:
        return json.load(resp)


def test_every_road_is_refused_while_the_run_trains_on(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    cfg = fault_config(run_dir, steps=4)
    cfg_path = tmp_path / "attacks.toml"
    save_config(cfg, cfg_path)
    up = subprocess.Popen([sys.executable, "-m", "jetrl.cli", "up", "--config", str(cfg_path), "--rollouts", "2"],
                          cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 400
        while steps_done(run_dir) < 1:  # the run trains before the attack
            assert time.monotonic() < deadline and up.poll() is None, log_tails(run_dir)
            time.sleep(1.0)
        s = Subjects(cfg.nats.prefix)
        before = status(run_dir)
        auth = run_dir / "nats" / "auth"
        found = asyncio.run(attack((run_dir / "nats.url").read_text().split()[0], s,
                                   lambda user: (auth / f"{user}.password").read_text().strip()))
        during = status(run_dir)
        out, _ = up.communicate(timeout=400)
    finally:
        if up.poll() is None:
            up.terminate()
            up.wait(timeout=60)
    logs = {p.name: p.read_text() for p in sorted((run_dir / "logs").glob("*.log"))}
    assert up.returncode == 0, out + log_tails(run_dir)
    assert "training finished: 4 steps" in out  # the run went on to its end, on the trainer's word
    check_refused(found, s, before, during, {name: logs[name] for name in ("rollout-0.log", "rollout-1.log")})
    finished = [line for line in logs["controller.log"].splitlines() if "event='training_finished'" in line]
    assert len(finished) == 1 and "step=4" in finished[0], finished
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]
