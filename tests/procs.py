"""Helpers for tests that run the services as real processes."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Iterable
from pathlib import Path


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
