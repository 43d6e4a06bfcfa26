"""Env service entry point: ``python -m services.envs <task> [--config FILE] [--env.key=value ...]``.

The task's make_env comes from the task registry (shared/tasks.py): ``--env.factory``, ``[env.<task>] factory``
or the task's ``jetrl.envs`` entry point; it is imported only here, so one task's optional dependencies never
break another's replica."""

from __future__ import annotations

import sys

from services.envs.host import EnvHost
from shared.bus import replica_name
from shared.config import ConfigError, from_argv
from shared.lifecycle import exit_code, run
from shared.readiness import build_announced
from shared.service import Service
from shared.subjects import check_token
from shared.tasks import find_task, load_factory


async def main(argv: list[str]) -> None:
    cfg, (task,) = from_argv(argv, positional=1)
    cfg.env.task = check_token(task, "task")
    try:
        make_env = load_factory(find_task(task, cfg.env))
        cfg.env.section(task)  # its settings, checked before anything starts
    except ConfigError as exc:
        raise SystemExit(f"python -m services.envs {task}: {exc}") from None
    svc = Service(cfg, f"env-{task}", replica_name(f"env-{task}", cfg.nats), role="env")
    async with svc:
        await svc.connect()
        # heartbeats from now on: while the task data builds they say so (the controller waits for it)
        info = {"task": task, "max_sessions": cfg.env.max_sessions}
        svc.heartbeat(info)
        env = await build_announced(info, lambda: make_env(cfg.env))
        env.name = task  # the host serves the subjects of the task it was started for
        host = EnvHost(env, cfg.env, svc.subjects, svc.replica_id)
        service = await host.serve(svc.nc, svc.js)
        svc.stack.push_async_callback(host.shutdown)
        svc.stack.push_async_callback(service.stop)
        svc.background("idle_reaper", host.reap_idle)
        svc.log.info("env_ready", task=task, train_tasks=len(env.task_ids("train")),
                     test_tasks=len(env.task_ids("test")))
        await svc.stop.wait()
        svc.log.info("env_stopping", task=task, open_sessions=len(host.sessions))


if __name__ == "__main__":
    run(main(sys.argv[1:]))
    sys.exit(exit_code())
