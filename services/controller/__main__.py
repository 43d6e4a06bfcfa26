"""Controller entry point: ``python -m services.controller [--config FILE] [--controller.key=value ...]``."""

from __future__ import annotations

import asyncio
import json
import socket
import sys
from contextlib import AsyncExitStack
from pathlib import Path

import uvicorn

from services.controller.api import create_app
from services.controller.controller import Controller
from shared.auth import controller_token, manages_topology
from shared.bus import connect, declare_topology, heartbeat_loop, replica_name
from shared.config import from_argv
from shared.lifecycle import close_connection, exit_code, install_stop, stop_if_connection_closed, supervise
from shared.log import setup_logging
from shared.subjects import Subjects


async def main(argv: list[str]) -> None:
    cfg, _ = from_argv(argv)
    if not any(share > 0 for share in cfg.controller.tasks.values()):
        raise SystemExit("controller: no task to run: set controller.tasks (task -> share), e.g. "
                         "--controller.tasks='{\"TASK\": 1}'")
    replica_id = replica_name("controller")
    log = setup_logging("controller", replica_id, cfg.run.log_level, cfg.run.log_format)
    subjects = Subjects(cfg.nats.prefix)
    stop = asyncio.Event()
    install_stop(stop, grace_s=8.0)  # gone within 10 s of SIGTERM, NATS or not

    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((cfg.controller.http_host, cfg.controller.http_port))  # port 0: the OS picks a free one
    url = f"http://{cfg.controller.http_host}:{sock.getsockname()[1]}"
    run_dir = Path(cfg.run.dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "controller.url").write_text(url + "\n")
    async with AsyncExitStack() as stack:
        nc = await connect(cfg.nats, replica_id, role="controller")
        stack.push_async_callback(close_connection, nc)
        watch = supervise(stop_if_connection_closed(nc, stop), "connection_watch", stop)
        stack.callback(watch.cancel)
        js = nc.jetstream()
        await declare_topology(js, subjects, cfg.nats, cfg.controller.heartbeat_ttl_s, role="controller")
        controller = Controller(nc, js, subjects, cfg, replica_id)
        controller.creates_durables = manages_topology(cfg.nats, "controller")
        await controller.follow_metrics_and_weights()
        server = uvicorn.Server(uvicorn.Config(create_app(controller, controller_token(cfg.controller)), log_level="warning", lifespan="off"))
        jobs = {"http_api": lambda: server.serve(sockets=[sock]), "trajectory_tracking": controller.track_trajectories,
                "replica_watch": controller.watch_replicas,
                "episode_board": lambda: controller.board.follow(nc, js, lambda: len(controller.finished)),
                "heartbeat": lambda: heartbeat_loop(js, subjects, "controller", replica_id, {"url": url})}
        for name, job in jobs.items():  # the HTTP server listens on one socket: if it fails, the service restarts
            bg = supervise(job, name, stop, restart_s=None if name == "http_api" else 1.0)
            stack.callback(bg.cancel)
        stack.callback(lambda: setattr(server, "should_exit", True))
        log.info("controller_ready", url=url, tasks=cfg.controller.tasks, group_size=cfg.controller.group_size)
        if cfg.controller.mode == "eval":  # evaluate, write the report, exit (jetrl eval waits for us)
            try:
                report = await controller.run_eval(stop)
            except RuntimeError as exc:  # no env answered: say so and wait to be stopped, not crash-loop
                controller.fail(exc)
                await stop.wait()
                return
            (run_dir / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
            log.info("eval_done", report=report)
            return
        publisher = supervise(controller.publish_jobs(stop), "job_publisher", None)  # logged; fail() says why

        def publisher_done(task: asyncio.Task[None]) -> None:
            if not task.cancelled() and task.exception() is not None:
                controller.fail(task.exception())

        publisher.add_done_callback(publisher_done)
        await stop.wait()
        publisher.cancel()
        log.info("controller_stopping", **{k: v for k, v in controller.status().items() if k != "trainer"})


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1:]))
    sys.exit(exit_code())
