"""Env service entry point: ``python -m services.envs <task> [--config FILE] [--env.key=value ...]``.

The task's make_env comes from the task registry (shared/tasks.py): ``--env.factory``, ``[env.<task>] factory``
or the task's ``jetrl.envs`` entry point; it is imported only here, so one task's optional dependencies never
break another's replica."""

from __future__ import annotations

import asyncio
import sys
from contextlib import AsyncExitStack

from services.envs.host import EnvHost
from shared.bus import connect, declare_topology, heartbeat_loop, replica_name
from shared.config import ConfigError, from_argv
from shared.lifecycle import close_connection, exit_code, install_stop, run, stop_if_connection_closed, supervise
from shared.log import setup_logging
from shared.readiness import build_announced
from shared.subjects import Subjects, check_token
from shared.tasks import find_task, load_factory


async def main(argv: list[str]) -> None:
    cfg, (task,) = from_argv(argv, positional=1)
    cfg.env.task = check_token(task, "task")
    try:
        make_env = load_factory(find_task(task, cfg.env))
        cfg.env.section(task)  # its settings, checked before anything starts
    except ConfigError as exc:
        raise SystemExit(f"python -m services.envs {task}: {exc}") from None
    replica_id = replica_name(f"env-{task}", cfg.nats)
    log = setup_logging(f"env-{task}", replica_id, cfg.run.log_level, cfg.run.log_format)
    subjects = Subjects(cfg.nats.prefix)
    stop = asyncio.Event()
    install_stop(stop, grace_s=8.0)  # gone within 10 s of SIGTERM, NATS or not

    async with AsyncExitStack() as stack:
        nc = await connect(cfg.nats, replica_id, role="env")
        stack.push_async_callback(close_connection, nc)
        watch = supervise(stop_if_connection_closed(nc, stop), "connection_watch", stop)
        stack.callback(watch.cancel)
        js = nc.jetstream()
        await declare_topology(js, subjects, cfg.nats, cfg.controller.heartbeat_ttl_s, role="env")
        # heartbeats from now on: while the task data builds they say so (the controller waits for it)
        info = {"task": task, "max_sessions": cfg.env.max_sessions}
        beats = supervise(lambda: heartbeat_loop(js, subjects, f"env-{task}", replica_id, info), "heartbeat", stop,
                          restart_s=1.0)
        stack.callback(beats.cancel)
        env = await build_announced(info, lambda: make_env(cfg.env))
        env.name = task  # the host serves the subjects of the task it was started for
        host = EnvHost(env, cfg.env, subjects, replica_id)
        service = await host.serve(nc, js)
        stack.push_async_callback(host.shutdown)
        stack.push_async_callback(service.stop)
        reaper = supervise(host.reap_idle, "idle_reaper", stop, restart_s=1.0)
        stack.callback(reaper.cancel)
        log.info("env_ready", task=task, train_tasks=len(env.task_ids("train")), test_tasks=len(env.task_ids("test")))
        await stop.wait()
        log.info("env_stopping", task=task, open_sessions=len(host.sessions))


if __name__ == "__main__":
    run(main(sys.argv[1:]))
    sys.exit(exit_code())
