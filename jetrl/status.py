"""``jetrl status``: the controller's /status of a run."""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from pathlib import Path

from jetrl.access import dashboard_link
from jetrl.errors import CliError
from jetrl.rundir import run_config
from shared.auth import controller_token


def cmd_status(args: argparse.Namespace) -> int:
    url_file = Path(args.run_dir) / "controller.url"
    if not url_file.is_file():
        raise CliError(f"no run in {args.run_dir} (no controller.url there): start one with `jetrl up`, or name "
                       f"its directory with --run-dir")
    url = url_file.read_text().strip()
    token = controller_token(run_config(args.run_dir).controller)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{url}/status", headers=headers), timeout=5) as resp:
            status = json.load(resp)
    except urllib.error.HTTPError as exc:
        raise CliError(f"the controller of {args.run_dir} at {url} answered HTTP {exc.code} {exc.reason}") from None
    except OSError as exc:
        raise CliError(f"the controller of {args.run_dir} at {url} does not answer ({exc}): the run has ended "
                       f"or not started yet") from None
    print(json.dumps(status, indent=2))
    print(f"dashboard: {dashboard_link(url, token)}", file=sys.stderr)  # stderr: stdout stays one JSON document
    return 0
