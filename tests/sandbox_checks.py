"""Isolation checks every OS sandbox backend must pass (bwrap: tests/test_env_os.py, docker:
tests/test_env_os_docker.py), given ``out(command) -> output`` of a shell inside the sandbox."""

from __future__ import annotations

import time
from collections.abc import Callable


def assert_limits_hold(out: Callable[[str], str]) -> None:
    """The time limit stops a command, a fork bomb is capped and ended, a memory hog is stopped, and the
    shell answers after each."""
    t0 = time.monotonic()
    stopped = out("sleep 1000")
    assert "ran longer than the 3s limit and was stopped" in stopped and time.monotonic() - t0 < 8
    t0 = time.monotonic()
    out(":(){ :|:& };:")  # a fork bomb: capped by the pids limit, then ended
    assert "alive" in out("echo alive") and time.monotonic() - t0 < 10
    assert int(out("ps -e --no-headers | wc -l").split()[-1]) < 20
    hog = out("python3 -c 'b = bytearray(512 << 20); print(len(b))' 2>&1")  # past the 256 MB cap
    assert str(512 << 20) not in hog and ("Killed" in hog or "MemoryError" in hog or "was stopped" in hog)
    assert "alive" in out("echo alive")
