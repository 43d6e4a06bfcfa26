"""A run that cannot go on says so: the controller waits for an env replica that is still building its
task data (its heartbeats say "building, <stage> N %"), and gives up only on an env that neither answers
nor builds; ``jetrl up`` then prints the reason in one line and ends with a non-zero exit.

* In one process against a real nats-server: a real db env replica whose build reports progress (a real
  ``shared.progress.Progress``) for longer than ``controller.env_wait_s``, the controller's real wait.
* ``jetrl up`` as a process, with its embedded nats-server and auth, and no env replica at all.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.controller.controller import Controller
from services.envs.db import make_env
from services.envs.host import EnvHost
from shared.bus import heartbeat_loop
from shared.config import EnvConfig, JetRLConfig, save_config
from shared.messages import Heartbeat, decode
from shared.progress import Progress
from shared.readiness import build_announced

REPO = Path(__file__).resolve().parents[2]


async def test_the_controller_waits_for_an_env_that_is_building(nc, config, subjects) -> None:
    js = nc.jetstream()
    config.run.tasks = {"db": 1.0}
    controller = Controller(nc, js, subjects, config, "controller-test")
    env_cfg = EnvConfig(num_train_tasks=6, num_test_tasks=2)

    def slow_build():  # a build that takes 3 s, 4 times env_wait_s, and counts its stages as builds do
        with Progress("db sources", total=6, unit="stages", every_s=60) as bar:
            for _ in range(6):
                time.sleep(0.5)
                bar.update()
        return make_env(env_cfg)

    info: dict = {"task": "db"}
    seen: list[dict] = []
    jobs = [asyncio.create_task(controller.watch_replicas(every_s=0.2)),
            asyncio.create_task(heartbeat_loop(js, subjects, "env-db", "env-db-test", info, every_s=0.2))]
    kv = await js.key_value(subjects.registry_kv)

    async def record() -> None:
        while True:
            try:
                seen.append(decode((await kv.get(subjects.registry_key("env-db", "env-db-test"))).value, Heartbeat).info)
            except Exception:
                pass
            await asyncio.sleep(0.2)

    jobs.append(asyncio.create_task(record()))
    states: set[str] = set()

    async def watch_state() -> None:
        while True:
            states.add(controller.state)
            await asyncio.sleep(0.1)

    jobs.append(asyncio.create_task(watch_state()))
    try:
        async def env_replica() -> None:
            env = await build_announced(info, slow_build)
            host = EnvHost(env, env_cfg, subjects, "env-db-test")
            jobs.append(asyncio.create_task(host.serve(nc, js)))

        jobs.append(asyncio.create_task(env_replica()))
        started = time.monotonic()
        ids = await asyncio.wait_for(controller.fetch_task_ids(timeout_s=0.75), timeout=60)
        waited = time.monotonic() - started
    finally:
        for job in jobs:
            job.cancel()
    assert len(ids["db"]) == 6 and waited > 2.0, (ids, waited)
    building = [i for i in seen if i.get("state") == "building"]
    percents = [i["percent"] for i in building if i.get("percent") is not None]
    assert building and percents == sorted(percents) and max(percents) > 0, seen
    assert any(s.startswith("waiting for env db: building, db sources") and s.endswith("%") for s in states), states


async def test_an_env_that_neither_answers_nor_builds_fails_the_plan_with_the_key_to_change(
        nc, config, subjects) -> None:
    config.run.tasks = {"db": 1.0}
    controller = Controller(nc, nc.jetstream(), subjects, config, "controller-test")
    with pytest.raises(RuntimeError, match=r"env service for task 'db' did not answer within 0.5s "
                                           r"\(controller.env_wait_s\)"):
        await controller.fetch_task_ids(timeout_s=0.5)


@pytest.mark.slow
def test_jetrl_up_prints_a_failed_run_in_one_line_and_exits_non_zero(tmp_path: Path) -> None:
    cfg = JetRLConfig()
    cfg.run.dir = str(tmp_path / "run")
    cfg.run.tasks = {"db": 1.0}
    cfg.controller.env_wait_s = 1.0
    path = tmp_path / "fail.toml"
    save_config(cfg, path)
    started = time.monotonic()
    # no env replica: the controller's plan fails after env_wait_s; the run must end, not sit there
    proc = subprocess.run([sys.executable, "-m", "jetrl.cli", "up", "--config", str(path), "--rollouts", "0",
                           "--env-replicas", "0"], cwd=REPO, capture_output=True, text=True, timeout=180)
    took = time.monotonic() - started
    failed = [line for line in proc.stderr.splitlines() if "run failed" in line]
    assert proc.returncode == 1, (proc.stdout, proc.stderr)
    assert len(failed) == 1, proc.stderr
    assert "env service for task 'db' did not answer within 1s (controller.env_wait_s)" in failed[0]
    assert "Traceback" not in proc.stderr and took < 150, (took, proc.stderr)


async def test_jetrl_up_says_what_the_run_waits_for(nc, config, subjects, tmp_path, capsys) -> None:
    """Before the first step, `jetrl up` prints the controller's state while it waits for a building env."""
    from jetrl.outcome import WaitNotice
    from services.controller.api import create_app
    from tests.controller.test_dashboard import served

    controller = Controller(nc, nc.jetstream(), subjects, config, "controller-test")
    async with served(create_app(controller, "tok")) as client:
        (tmp_path / "controller.url").write_text(f"{client.base_url}\n")
        notice = WaitNotice(tmp_path, "tok", every_s=0.0)
        assert await notice.poll() is None  # "starting": nothing to say
        controller.state = "waiting for env kg: building, kg test questions 43 %"
        assert await notice.poll() == controller.state
    assert capsys.readouterr().out.splitlines() == ["jetrl: waiting for env kg: building, kg test questions 43 %"]
