"""Who may read a run from outside, and with what: the status API's token of a ``jetrl up`` run, and
the observer's NATS credentials as a file any NATS tool takes (``jetrl creds observer``).

Under ``jetrl up`` the status API (``/status``, ``/metrics``, the dashboard and its data) is closed by
default: a token made for each run (or the one the user set) is written to ``<run>/controller.token``
(0600, like the NATS passwords) and the config the services read names only that file, so neither
``config.toml`` nor any command line carries it. The dashboard link ``jetrl up`` prints carries it.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from shared.auth import controller_token, inbox_prefix
from shared.config import JetRLConfig, load_config
from shared.subjects import Subjects

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


def observer_context(run_dir: Path) -> dict[str, str]:
    """The observer's NATS context for the run in ``run_dir``: the fields of a ``nats`` CLI context
    (url, user, password, inbox_prefix) and, for readers, the run's subject prefix and trajectory stream.

    The inbox prefix is not optional: the observer may subscribe only under ``_INBOX_observer``, and a
    JetStream read (an ordered consumer) delivers to an inbox, so a client on the default ``_INBOX``
    connects and subscribes to core subjects but reads no stream."""
    config_path = run_dir / "config.toml"
    if not config_path.is_file():
        raise FileNotFoundError(2, "no run there (no config.toml)", str(config_path))
    cfg = load_config(config_path, environ={})
    url = (run_dir / "nats.url").read_text().split()[0]
    user = "observer"
    if cfg.nats.auth_dir:
        password = (Path(cfg.nats.auth_dir) / f"{user}.password").read_text().strip()
    else:  # an open server (nats.embedded_auth=false): no user, the default inbox
        user = password = ""
    subjects = Subjects(cfg.nats.prefix)
    return {"description": f"JetRL run {run_dir} as {user or 'anyone'} (read-only)", "url": url, "user": user,
            "password": password, "inbox_prefix": inbox_prefix(user) if user else "_INBOX",
            "jetrl_prefix": cfg.nats.prefix, "jetrl_traj_subject": subjects.traj(">"),
            "jetrl_traj_stream": subjects.traj_stream}


def url_with_credentials(url: str, user: str, password: str) -> str:
    """``nats://user:password@host:port`` (the first server of a list), as both official clients take it."""
    first = urlsplit(url.split(",")[0])
    if not user:
        return urlunsplit(first)
    return urlunsplit(first._replace(netloc=f"{quote(user, safe='')}:{quote(password, safe='')}@{first.netloc}"))


def cmd_creds(args: argparse.Namespace) -> int:
    """``jetrl creds observer``: the run's read-only NATS credentials as a context file (0600) and a URL."""
    run_dir = Path(args.run_dir)
    context = observer_context(run_dir)
    path = run_dir / "nats" / f"{args.role}.context.json"
    write_private(path, json.dumps(context, indent=2) + "\n")
    print(f"context file: {path}  (nats CLI: copy it to ~/.config/nats/context/jetrl.json, then nats --context jetrl)")
    print(f"inbox prefix: {context['inbox_prefix']}  (set it in the client, or JetStream reads see nothing)")
    print(f"trajectories: {context['jetrl_traj_subject']}  (stream {context['jetrl_traj_stream']}; msgpack, "
          "schemas in docs/schemas/)")
    print(url_with_credentials(context["url"], context["user"], context["password"]))
    return 0
