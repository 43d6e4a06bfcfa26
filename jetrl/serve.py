"""``jetrl serve``: the policy over the OpenAI API, following a run's weight broadcasts."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from pathlib import Path

from jetrl.preflight import preflight
from jetrl.supervisor import Supervisor
from shared.config import load_config, save_config
from shared.natsd import EmbeddedNats


def cmd_serve(args: argparse.Namespace, overrides: list[str]) -> int:
    """One rollout replica that serves no jobs and answers /v1/chat/completions instead, following the weight
    broadcasts of the run on ``nats.url`` (a training run's config.toml names it); without one, an embedded
    nats-server, where anything may publish weights."""
    cfg = load_config(args.config, ["serve.enabled=true", "rollout.serve_jobs=false", "rollout.serve_pool=false"]
                      + overrides)
    preflight(cfg, serving=True)
    run_dir = Path(cfg.run.dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.run.dir = str(run_dir)
    server = None
    if not cfg.nats.url:
        server = EmbeddedNats(run_dir / "nats-serve")
        cfg.nats.url = server.start()
    config_path = run_dir / "serve.toml"
    save_config(cfg, config_path)
    url_file = run_dir / "serve.url"
    url_file.unlink(missing_ok=True)
    sup = Supervisor(cfg, config_path, run_dir)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    rc = 0
    try:
        sup.spawn("serve", ["services.rollout"])
        announced = False
        while not stop["now"]:
            if not announced and url_file.exists():
                print(f"jetrl serve: {cfg.serve.model_name} at {url_file.read_text().strip()} (OpenAI chat "
                      f"completions; weights from NATS {cfg.nats.url}, prefix {cfg.nats.prefix}); Ctrl-C stops",
                      flush=True)
                announced = True
            if sup.dead():
                print(f"jetrl serve: the server exited; see {run_dir / 'logs' / 'serve.log'}", file=sys.stderr)
                rc = 1
                break
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        sup.stop_all()
        if server is not None:
            server.stop()
    return rc
