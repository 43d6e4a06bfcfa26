"""Operator tooling: TensorBoard events beside metrics.jsonl, progress with ETA, the container healthcheck."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shared.bus import heartbeat_loop
from shared.progress import Progress, format_duration, ticking, track

REPO = Path(__file__).resolve().parents[2]


async def test_trainer_writes_tensorboard_events_with_the_metrics_jsonl_keys(nc, config, subjects, tmp_path) -> None:
    import torch

    from services.trainer.trainer import Trainer

    event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator",
                                            reason="PyPI tensorboard is not installed")
    trainer = Trainer(nc, nc.jetstream(), subjects, config.trainer, torch.nn.Linear(1, 1), tmp_path, "trainer-t")
    assert trainer.recorder.tensorboard is not None
    for step, success in ((1, 0.25), (2, 0.75)):
        trainer.recorder.record(step, step, {"train/trajectories": 8.0, "train/step_s": 1.5,
                                             "train/loss": -0.01 * step, "task/db/success": success,
                                             "task/db/adv_hist": [0, 1, 2, 3, 4, 4, 3, 2, 1, 0]})
    await asyncio.sleep(0.1)  # the metrics publish the trainer schedules
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    acc = event_accumulator.EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    scalar_keys = {k for k, v in rows[0].items() if isinstance(v, float) and k not in ("ts",)}
    assert set(acc.Tags()["scalars"]) == scalar_keys  # the same keys, one event stream per key
    assert [(e.step, e.value) for e in acc.Scalars("task/db/success")] == [(1, 0.25), (2, 0.75)]
    hist = acc.Histograms("task/db/adv_hist")
    assert [h.step for h in hist] == [1, 2] and list(hist[0].histogram_value.bucket) == [0, 1, 2, 3, 4, 4, 3, 2, 1, 0]


def test_track_wraps_an_iterable(capsys, monkeypatch) -> None:
    monkeypatch.setenv("JETRL_PROGRESS", "lines")
    assert list(track(iter([1, 2, 3]), "bench stages", total=3, unit="stages")) == [1, 2, 3]
    assert "bench stages [########################] 3/3 stages 100%" in capsys.readouterr().err


def test_ticking_reports_elapsed_time_while_a_build_runs() -> None:
    import time

    log = io.StringIO()
    with ticking("kg graph", every_s=0.4, stream=log):
        time.sleep(1.0)
    lines = log.getvalue().splitlines()
    assert len(lines) >= 3 and all(x.startswith("kg graph  elapsed 0:0") for x in lines)
    assert lines[0].endswith("still working") and lines[-1].endswith("done")


def test_progress_bar_on_a_terminal_and_lines_in_a_log() -> None:
    tty = io.StringIO()
    bar = Progress("eval db", total=4, unit="episodes", stream=tty, tty=True, every_s=0)
    for _ in range(4):
        bar.update(note="db")
    bar.close()
    frames = tty.getvalue().split("\r\x1b[2K")
    assert len(frames) >= 4 and "[########################] 4/4 episodes 100%" in frames[-1]
    assert frames[-1].endswith("\n") and "eta 0:00" in frames[-1]

    log = io.StringIO()
    lines = Progress("build", total=10, unit="games", stream=log, tty=False, every_s=3600)
    lines.update(5)  # within every_s of the last line: nothing yet (the first update draws)
    lines.update(1)
    lines.set(10)  # the end always draws
    out = log.getvalue().splitlines()
    assert len(out) == 2 and out[0].startswith("build [############............] 5/10 games  50%")
    assert "eta" in out[0] and "10/10" in out[1] and "\r" not in log.getvalue()
    assert format_duration(3725) == "1:02:05" and format_duration(65) == "1:05"


def _healthcheck(config, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, JETRL__NATS__URL=config.nats.url, JETRL__NATS__PREFIX=config.nats.prefix)
    return subprocess.run([sys.executable, "-m", "shared.healthcheck", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=60)


async def test_container_healthcheck_reads_this_hosts_heartbeats(nc, config, subjects) -> None:
    sick = await asyncio.to_thread(_healthcheck, config)  # nothing heartbeats yet
    assert sick.returncode == 1 and "no replica" in sick.stderr
    beat = asyncio.create_task(heartbeat_loop(nc.jetstream(), subjects, "rollout", "rollout-hc", {}, every_s=0.5))
    try:
        await asyncio.sleep(0.5)
        ok = await asyncio.to_thread(_healthcheck, config)
        assert ok.returncode == 0 and "rollout-hc" in ok.stdout, ok.stderr
        other = await asyncio.to_thread(_healthcheck, config, "--host", "some-other-container")
        assert other.returncode == 1
        dead_http = await asyncio.to_thread(_healthcheck, config, "--http", "http://127.0.0.1:9/status")
        assert dead_http.returncode == 1 and "http://127.0.0.1:9/status" in dead_http.stderr
    finally:
        beat.cancel()


def test_a_long_build_reports_the_megabytes_it_has_written(tmp_path, monkeypatch, capfd) -> None:
    """The OS rootfs build (mmdebstrap, minutes) shows progress: the size of its target so far."""
    from services.envs.os_task.rootfs import _run_with_progress

    monkeypatch.setenv("JETRL_PROGRESS_EVERY_S", "0.5")
    monkeypatch.setenv("JETRL_PROGRESS", "lines")
    target = tmp_path / "rootfs"
    # the build is polled every 2 s: 4.5 s give two polls 2 s apart (2.5 s gave one, 0.5 s before the last
    # set, and the second line came or not by a few milliseconds)
    script = f"mkdir -p {target} && head -c 3000000 /dev/zero > {target}/a && sleep 4.5 && echo done >&2"
    rc, stderr = _run_with_progress(["sh", "-c", script], target, "os rootfs test", env=dict(os.environ))
    assert rc == 0 and stderr.strip() == "done"
    lines = [x for x in capfd.readouterr().err.splitlines() if x.startswith("os rootfs test")]
    assert len(lines) >= 2 and lines[-1].startswith("os rootfs test 3 MB") and "elapsed 0:0" in lines[-1]


async def test_jetrl_eval_progress_reads_the_controllers_plan(nc, config, subjects, tmp_path, capfd,
                                                              monkeypatch) -> None:
    """`jetrl eval` shows finished episodes against the controller's plan, per task, from /status."""
    from jetrl.run_progress import EvalProgress
    from services.controller.api import create_app
    from services.controller.controller import Controller
    from tests.controller.test_dashboard import served

    monkeypatch.setenv("JETRL_PROGRESS", "lines")
    controller = Controller(nc, nc.jetstream(), subjects, config, "controller-eval")
    controller.eval_planned = {"db": 8, "kg": 4}
    controller.books["db"].finished, controller.books["kg"].finished = 6, 0
    async with served(create_app(controller)) as client:
        (tmp_path / "controller.url").write_text(str(client.base_url) + "\n")
        progress = EvalProgress(tmp_path, every_s=0.0)
        await progress.poll()
        controller.books["kg"].finished = 4
        await progress.poll()
        progress.bar.close()
    lines = [x for x in capfd.readouterr().err.splitlines() if x.startswith("jetrl eval")]
    assert lines[0].startswith("jetrl eval [############............] 6/12 episodes  50%") and "db 6/8  kg 0/4" in lines[0]
    assert "eta" in lines[0] and "10/12" in lines[-1] and "kg 4/4" in lines[-1]


def test_a_child_of_jetrl_up_reads_the_effective_config_not_the_variables_again(tmp_path, monkeypatch) -> None:
    """JETRL__TRAINER__STEPS=5 jetrl up --trainer.steps=10: the CLI's config says 10 (flags over variables), and
    so does every child, which reads that config and not the variables a second time."""
    import time

    from jetrl.supervisor import Supervisor
    from shared.config import load_config, save_config

    monkeypatch.setenv("JETRL__TRAINER__STEPS", "5")
    cfg = load_config(overrides=["--trainer.steps=10"])
    assert cfg.trainer.steps == 10
    config_path = tmp_path / "config.toml"
    save_config(cfg, config_path)
    sup = Supervisor(cfg, config_path, tmp_path)
    child = ("import sys; from shared.config import load_config; "
             "print('child steps', load_config(sys.argv[1]).trainer.steps, flush=True)")
    sup.spawn("probe", [], command=[sys.executable, "-c", child, str(config_path)], cwd=str(REPO))
    deadline = time.monotonic() + 60
    while sup.procs["probe"].poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert sup.procs["probe"].returncode == 0
    time.sleep(0.5)  # the log copier writes what the child printed
    assert "child steps 10" in (tmp_path / "logs" / "probe.log").read_text()
