"""Helpers for tests that run the services as real processes."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def stop_processes(procs: Iterable[subprocess.Popen[bytes]], timeout_s: float = 30.0) -> None:
    """SIGTERM every process still running, then wait for each; kill one that does not exit in time."""
    procs = list(procs)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def log_tails(run_dir: Path, chars: int = 3000) -> str:
    """The end of every service log of a run, for an assertion message."""
    return "\n".join(f"--- {p.name}\n{p.read_text()[-chars:]}" for p in sorted((run_dir / "logs").glob("*.log")))


def env_check(task: str, *args: str, timeout_s: float = 300) -> str:
    """``jetrl env-check TASK`` as a user runs it (its own nats-server with a user per role, the task's env
    started as ``jetrl up`` would): every check passed (``ok``) or did not apply (``--``); its output."""
    proc = subprocess.run([sys.executable, "-m", "jetrl.cli", "env-check", task, *args], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout_s)
    lines = proc.stdout.splitlines()
    assert proc.returncode == 0 and lines[-1].endswith(", 0 failed"), proc.stdout + proc.stderr[-3000:]
    assert all(line.startswith(("ok ", "-- ")) for line in lines[:-1]), proc.stdout
    return proc.stdout
