"""An OpenEnv server the replica starts itself (``server_command``), on a free port, and stops on close."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time

import structlog

from services.envs.openenv_env.client import get_json

log = structlog.get_logger()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ManagedServer:
    """Started at once; ``url`` answers /health before the constructor returns. ``ensure_running`` starts it
    again if it exited (an episode opened after a crash gets a fresh server; the ones in flight ended with it)."""

    def __init__(self, command: list[str], url: str, startup_timeout_s: float, task: str) -> None:
        """``{port}`` in ``command`` and ``url`` is the port picked for the server."""
        if not command:
            raise ValueError(f"env.{task}.server_command: empty")
        self.command, self.url_template, self.startup_timeout_s, self.task = command, url, startup_timeout_s, task
        self.lock = threading.Lock()
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""
        self.starts = 0
        self._start()

    def _start(self) -> None:
        port = free_port()
        argv = [part.replace("{port}", str(port)) for part in self.command]
        # its own process group, so that a server that forks workers is stopped whole
        self.proc = subprocess.Popen(argv, env={**os.environ, "PORT": str(port)}, start_new_session=True)
        self.url = (self.url_template or "http://127.0.0.1:{port}").replace("{port}", str(port)).rstrip("/")
        self.starts += 1
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"env.{self.task}.server_command {argv} exited with {self.proc.returncode} "
                                   f"before it answered {self.url}/health")
            try:
                get_json(self.url + "/health", timeout_s=2.0)
                break
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"env.{self.task}.server_command {argv}: no answer at {self.url}/health "
                                       f"within {self.startup_timeout_s:g}s") from None
                time.sleep(0.25)
        log.info("openenv_server_started", task=self.task, url=self.url, pid=self.proc.pid, starts=self.starts)

    def ensure_running(self) -> str:
        with self.lock:
            if self.proc is not None and self.proc.poll() is not None:
                log.warning("openenv_server_exited", task=self.task, returncode=self.proc.returncode)
                self._start()
            return self.url

    def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        except ProcessLookupError:
            pass
