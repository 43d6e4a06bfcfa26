"""The service logs ``jetrl up`` writes under ``<run>/logs``, bounded in size.

A child's stdout and stderr go into a pipe that one thread of ``jetrl up`` copies into ``<name>.log``.
Past ``supervisor.log_max_bytes`` the file is rotated the way ``logging.handlers.RotatingFileHandler``
does it (``<name>.log`` -> ``<name>.log.1`` -> ... up to ``supervisor.log_backups``), always between two
lines: a long run (or a flood of refused messages, each logged) can no longer fill the disk. A restarted
service writes on into the same file, through the same ``RotatingLog``.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import IO

CHUNK_BYTES = 64 * 1024


class RotatingLog:
    """One log file that rotates past ``max_bytes`` (0 = never), keeping ``backups`` older files."""

    def __init__(self, path: Path, max_bytes: int, backups: int) -> None:
        self.path, self.max_bytes, self.backups = path, max_bytes, max(1, backups)
        self.lock = threading.Lock()
        self.file = open(path, "ab", buffering=0)  # unbuffered: what a service said is on disk at once
        self.size = self.file.tell()

    def write(self, data: bytes) -> None:
        with self.lock:
            if self.max_bytes and self.size and self.size + len(data) > self.max_bytes:
                self._rotate()
            self.file.write(data)
            self.size += len(data)

    def _rotate(self) -> None:
        self.file.close()
        for i in range(self.backups - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{i}")
            if older.exists():
                older.replace(self.path.with_name(f"{self.path.name}.{i + 1}"))
        self.path.replace(self.path.with_name(f"{self.path.name}.1"))
        self.file = open(self.path, "ab", buffering=0)
        self.size = 0

    def copy_from(self, pipe: IO[bytes]) -> threading.Thread:
        """Copy ``pipe`` (a child's stdout) into the log until it closes, whole lines at a time (a line
        longer than a chunk is written in pieces); the thread that does it."""
        def run() -> None:
            carry = b""
            try:
                while chunk := pipe.read1(CHUNK_BYTES):  # type: ignore[attr-defined]
                    carry += chunk
                    cut = carry.rfind(b"\n") + 1 if len(carry) < CHUNK_BYTES else len(carry)
                    if cut:
                        self.write(carry[:cut])
                        carry = carry[cut:]
            finally:
                if carry:
                    self.write(carry)
                pipe.close()

        thread = threading.Thread(target=run, name=f"log-{self.path.stem}", daemon=True)
        thread.start()
        return thread
