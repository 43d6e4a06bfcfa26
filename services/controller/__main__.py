"""Controller entry point: ``python -m services.controller [--config FILE] [--controller.key=value ...]``."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

from services.controller.api import create_app
from services.controller.controller import Controller
from services.controller.modes import evaluate, publish_until_stopped
from shared.auth import controller_token, manages_topology
from shared.bus import replica_name
from shared.config import from_argv
from shared.lifecycle import exit_code
from shared.service import Service, http_server, listen


async def main(argv: list[str]) -> None:
    cfg, _ = from_argv(argv)
    if not any(share > 0 for share in cfg.run.tasks.values()):
        raise SystemExit("controller: no task to run: set run.tasks (task -> share), e.g. "
                         "--run.tasks='{\"TASK\": 1}'")
    svc = Service(cfg, "controller", replica_name("controller"))  # gone within 10 s of SIGTERM, NATS or not
    sock, url = listen(cfg.controller.http_host, cfg.controller.http_port)
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "controller.url").write_text(url + "\n")
    async with svc:
        await svc.connect()
        nc, js = svc.nc, svc.js
        controller = Controller(nc, js, svc.subjects, cfg, svc.replica_id)
        controller.creates_durables = manages_topology(cfg.nats, "controller")
        await controller.follow_metrics_and_weights()
        server = http_server(create_app(controller, controller_token(cfg.controller)))
        # the HTTP server listens on one socket: if it fails, the service restarts
        svc.background("http_api", lambda: server.serve(sockets=[sock]), restart_s=None)
        svc.background("trajectory_tracking", controller.track_trajectories)
        svc.background("replica_watch", controller.watch_replicas)
        svc.background("episode_board", lambda: controller.board.follow(nc, js, lambda: len(controller.finished)))
        svc.heartbeat({"url": url})
        svc.stack.callback(lambda: setattr(server, "should_exit", True))
        svc.log.info("controller_ready", url=url, tasks=cfg.run.tasks, group_size=cfg.controller.group_size)
        if cfg.controller.mode == "eval":  # evaluate, write the report, exit (jetrl eval waits for us)
            await evaluate(controller, svc.stop, run_dir)
        else:
            await publish_until_stopped(controller, svc.stop)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
    sys.exit(exit_code())
