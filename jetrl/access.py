"""Who may read a run from outside, and with what: the status API's token of a ``jetrl up`` run.

Under ``jetrl up`` the status API (``/status``, ``/metrics``, the dashboard and its data) is closed by
default: a token made for each run (or the one the user set) is written to ``<run>/controller.token``
(0600, like the NATS passwords) and the config the services read names only that file, so neither
``config.toml`` nor any command line carries it. The dashboard link ``jetrl up`` prints carries it.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from shared.auth import controller_token
from shared.config import JetRLConfig

TOKEN_FILE = "controller.token"


def write_private(path: Path, text: str) -> None:
    """``text`` into ``path``, readable by this user only (0600 from the start, never briefly wider)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def close_status_api(cfg: JetRLConfig, run_dir: Path) -> str:
    """The run's status token, kept in ``<run>/controller.token``; ``cfg`` then names the file only."""
    token = controller_token(cfg.controller) or secrets.token_urlsafe(24)
    path = run_dir / TOKEN_FILE
    write_private(path, token + "\n")
    cfg.controller.http_token, cfg.controller.http_token_file = "", str(path)
    return token


def dashboard_link(url: str, token: str) -> str:
    return f"{url}/dashboard?token={token}" if token else f"{url}/dashboard"
