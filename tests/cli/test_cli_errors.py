"""A user's mistake is one line, found before anything starts (jetrl/preflight.py, jetrl/errors.py):
an unknown task or key (with "did you mean"), a model or file that is not there, a missing config file,
`jetrl status` without a run. No traceback unless --debug; nothing started, no run directory made."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from jetrl.cli import main
from jetrl.preflight import check_config
from shared.config import JetRLConfig, save_config
from shared.tasks import registered_tasks

REPO = Path(__file__).resolve().parents[2]


def errors_of(capsys: pytest.CaptureFixture[str], argv: list[str]) -> list[str]:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.splitlines()


def test_jetrl_up_refuses_a_bad_config_in_one_line_before_starting_anything(tmp_path, capsys) -> None:
    run_dir = tmp_path / "run"
    up = ["up", f"--run.dir={run_dir}", '--run.tasks={"db": 1}']
    assert errors_of(capsys, [*up, '--run.tasks={"dbb": 1}']) == [
        "jetrl: error: run.tasks: unknown task 'dbb' (did you mean 'db'?) (known: "
        f"{', '.join(sorted(registered_tasks()))})"]
    assert errors_of(capsys, [*up, "--model.name=runs/nowhere/model"]) == [
        f"jetrl: error: model.name='runs/nowhere/model': not 'tiny', 'smollm2' or a directory "
        f"({Path('runs/nowhere/model').resolve()} does not exist)"]
    empty = tmp_path / "empty-model"
    empty.mkdir()
    (empty / "config.json").write_text('{"model_type": "qwen2"}')
    assert errors_of(capsys, [*up, f"--model.name={empty}"]) == [
        f"jetrl: error: model.name='{empty}': no weights in {empty} (*.safetensors or pytorch_model*.bin)",
        f"jetrl: error: model.name='{empty}': no tokenizer in {empty} (tokenizer.json or tokenizer_config.json)"]
    assert errors_of(capsys, [*up, "--run.task=db"]) == [
        "jetrl: error: unknown config key run.task (did you mean run.tasks?)"]
    assert errors_of(capsys, [*up, "--trainr.steps=3"])[0].startswith(
        "jetrl: error: unknown config section 'trainr' (did you mean trainer?)")
    assert errors_of(capsys, [*up, '--run.tasks={"kg": 1}', "--env.kg.ntriples=/no/such.nt"]) == [
        "jetrl: error: env.kg.ntriples: /no/such.nt does not exist"]
    assert errors_of(capsys, [*up, "--config", str(tmp_path / "missing.toml")]) == [
        f"jetrl: error: config file {tmp_path / 'missing.toml'} does not exist"]
    broken = tmp_path / "broken.toml"
    broken.write_text("[trainer\nsteps = 3\n")
    (line,) = errors_of(capsys, [*up, "--config", str(broken)])
    assert line.startswith(f"jetrl: error: config file {broken} is not valid TOML: ")
    assert not run_dir.exists()  # nothing was started, nothing written


def test_status_without_a_run_is_one_line_and_debug_shows_the_traceback(tmp_path, capsys) -> None:
    assert errors_of(capsys, ["status", "--run-dir", str(tmp_path / "none")]) == [
        f"jetrl: error: no run in {tmp_path / 'none'} (no controller.url there): start one with `jetrl up`, or "
        "name its directory with --run-dir"]
    (tmp_path / "controller.url").write_text("http://127.0.0.1:9\n")  # a run whose controller is gone
    (line,) = errors_of(capsys, ["status", "--run-dir", str(tmp_path)])
    assert line.startswith(f"jetrl: error: the controller of {tmp_path} at http://127.0.0.1:9 does not answer")
    debug = subprocess.run([sys.executable, "-m", "jetrl.cli", "status", "--run-dir", str(tmp_path / "none"),
                            "--debug"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "CliError" in debug.stderr


def test_the_whole_check_takes_well_under_a_second(tmp_path) -> None:
    cfg = JetRLConfig()
    cfg.run.tasks = {"db": 1.0, "kg": 1.0, "os": 1.0}
    started = time.perf_counter()
    for _ in range(10):
        assert check_config(cfg) == []
    assert (time.perf_counter() - started) / 10 < 0.1
    # the whole command, Python's start and imports included, on a busy 2-core machine
    cfg.run.tasks = {"nope": 1.0}
    path = tmp_path / "bad.toml"
    save_config(cfg, path)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "jetrl.cli", "up", "--config", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    took = time.monotonic() - started
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "unknown task 'nope'" in proc.stderr
    assert took < 5.0, took
