"""A task from outside JetRL: the plugin package examples/plugin-arith, pip-installed into this venv, found
through its ``jetrl.envs`` entry point, checked by ``jetrl env-check``, evaluated by ``jetrl eval`` and
trained on by ``jetrl up``, each with its own embedded nats-server (a user per role, as by default), with
no JetRL file changed. Also the registry's rules: a factory from the config, an external ``command``
with its variables, and the errors that name what is wrong."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.config import ConfigError, JetRLConfig, load_config, save_config
from shared.tasks import ExternalEnv, UnknownTask, find_task, registered_tasks

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PLUGIN = REPO / "examples" / "plugin-arith"


@pytest.fixture(scope="module")
def plugin() -> Iterator[str]:
    """The plugin installed for this module's tests (editable, no dependencies: JetRL is here), then removed."""
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "install", "--no-deps", "--no-build-isolation", "-e", str(PLUGIN)], check=True,
                   capture_output=True, timeout=180)
    sys.path.insert(0, str(PLUGIN))  # this process started before the install: import it as a new one would
    importlib.invalidate_caches()
    try:
        yield "arith"
    finally:
        sys.path.remove(str(PLUGIN))
        sys.modules.pop("jetrl_arith", None)
        subprocess.run([*pip, "uninstall", "-y", "jetrl-arith"], check=True, capture_output=True, timeout=120)


def jetrl(*args: str, timeout: float = 300, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "jetrl.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def small_run(tmp_path: Path, name: str, **sections: dict) -> Path:
    """A config as a user would write one for a tiny, quick run: no nats.url, so `jetrl up` starts its own."""
    cfg = JetRLConfig()
    cfg.run.dir = str(tmp_path / name)
    cfg.run.tasks = {"arith": 1.0}
    cfg.controller.group_size = 2
    cfg.controller.max_inflight = 4
    cfg.controller.eval_limit = 4
    cfg.rollout.max_new_tokens = 12
    cfg.rollout.concurrency = 2
    cfg.trainer.steps = 2
    cfg.trainer.min_groups = 1
    cfg.trainer.kl_coef = 0.01  # all-failure groups still make an optimizer step, and so a new policy version
    cfg.env.num_train_tasks, cfg.env.num_test_tasks = 8, 4
    cfg.env.sections = {"arith": {"max_operand": 9}, **sections}
    path = tmp_path / f"{name}.toml"
    save_config(cfg, path)
    return path


def test_env_check_passes_on_the_installed_plugin(plugin: str) -> None:
    assert registered_tasks()[plugin] == "jetrl_arith:make_env"
    proc = jetrl("env-check", plugin, "--env.num_train_tasks=4", "--env.num_test_tasks=2", "--env.arith.max_operand=5")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    assert all(line.startswith("ok") for line in lines[:-1]) and len(lines) == 12, proc.stdout
    assert "oracle test" in proc.stdout and "2/2 solved" in proc.stdout
    assert lines[-1] == "env-check arith: 11 passed, 0 failed"
    text = jetrl("config", "--task", plugin).stdout
    assert "[env.arith]\n" in text and "max_operand (int) = 20  # largest number in a question" in text


def test_jetrl_eval_and_up_run_the_plugin_task(plugin: str, tmp_path: Path) -> None:
    proc = jetrl("eval", "--config", str(small_run(tmp_path, "eval")), "--rollouts", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "eval" / "eval.json").read_text())["greedy"]["arith"]
    assert report["episodes"] == 4 and report["statuses"].get("env_error", 0) == 0, report
    assert set(report["by_level"]) <= {"1", "2", "3"} and "arith" in proc.stdout  # levels as the plugin reports them

    proc = jetrl("up", "--config", str(small_run(tmp_path, "up")), "--rollouts", "1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "step 2" in proc.stdout and "arith: success" in proc.stdout and "training finished: 2 steps" in proc.stdout
    rows = [json.loads(line) for line in (tmp_path / "up" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all("task/arith/success" in r for r in rows)
    assert "auth" in (tmp_path / "up" / "config.toml").read_text()  # its env ran as an env user (shared/auth.py)


WRAPPER = """
    # an "external" env program: it is told everything through the JETRL_* variables and nothing else
    import os, sys
    names = {names!r}
    seen = {{key: os.environ[name] for key, name in names.items()}}
    open("told.json", "w").write(__import__("json").dumps(seen))  # in the config's directory (cwd)
    os.execv(sys.executable, [sys.executable, "-m", "services.envs", seen["task"], "--nats.url=" + seen["nats_url"],
             "--nats.user=" + seen["nats_user"], "--nats.password_file=" + seen["nats_password_file"],
             "--nats.prefix=" + seen["nats_prefix"], "--env.factory=jetrl_arith:make_env", "--env.num_test_tasks=4"])
"""


def test_a_command_task_is_started_with_the_jetrl_variables(plugin: str, tmp_path: Path) -> None:
    """`[env.T] command`: `jetrl eval` starts the program (any language; here a script) in the config's directory
    with the JETRL_* variables, under the same supervisor, and the run goes through it as through any env."""
    (tmp_path / "serve_env.py").write_text(textwrap.dedent(WRAPPER.format(names=ExternalEnv.VARIABLES)))
    config = small_run(tmp_path, "cmd", sums={"command": [sys.executable, "serve_env.py"]})
    text = config.read_text().replace('tasks = { "arith" = 1.0 }', 'tasks = { "sums" = 1.0 }')
    config.write_text(text)
    proc = jetrl("eval", "--config", str(config), "--rollouts", "1", "--env-replicas", "1", cwd=REPO)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads((tmp_path / "cmd" / "eval.json").read_text())["greedy"]["sums"]["episodes"] == 4
    told = json.loads((tmp_path / "told.json").read_text())
    assert told["task"] == "sums" and told["replica_id"] == "env-sums-0" and told["nats_user"].startswith("env")
    assert Path(told["nats_password_file"]).is_file() and told["nats_url"].startswith("nats://")
    assert float(told["heartbeat_ttl_s"]) > 0 and told["nats_prefix"] == "jetrl"


def test_registry_order_and_errors(plugin: str, tmp_path: Path) -> None:
    cfg = load_config(None, ["env.other.factory=jetrl_arith:make_env", "env.other.max_operand=7"], environ={})
    assert find_task("other", cfg.env).origin == "env.other.factory"
    assert cfg.env.section("other").max_operand == 7 and cfg.env.other.max_turns == 4  # the plugin's Config
    assert find_task("arith", cfg.env).origin == "entry point of jetrl-arith"
    with pytest.raises(ConfigError, match=r"unknown config key env\.arith\.max_operandd \(did you mean env\.arith\.max_operand\?\)"):
        load_config(None, ["env.arith.max_operandd=3"], environ={}).env.section("arith")
    with pytest.raises(ConfigError, match=r"env\.arith\.max_operand: cannot read 'many'"):
        load_config(None, ["env.arith.max_operand=many"], environ={}).env.section("arith")
    with pytest.raises(UnknownTask, match=r"unknown task 'nosuch' \(known: .*arith.*db"):
        find_task("nosuch", cfg.env)
    with pytest.raises(ConfigError, match=r"cannot import no_such_module"):
        load_config(None, ["env.x.factory=no_such_module:make_env"], environ={}).env.section("x")
    assert load_config(None, ['env.y.command=["node", "env.js"]'], environ={}).env.section("y") == {}
    # `jetrl up` says what is wrong before it starts anything
    bad = small_run(tmp_path, "bad", arith={"max_operand": 9, "colour": "red"})
    proc = jetrl("up", "--config", str(bad), timeout=60)
    assert proc.returncode != 0 and "unknown config key env.arith.colour" in proc.stderr, proc.stderr
    proc = jetrl("up", "--run.tasks={}", timeout=60)
    assert proc.returncode != 0 and "run.tasks: no task to run" in proc.stderr, proc.stderr
    proc = jetrl("up", '--run.tasks={"nosuch": 1}', timeout=60)
    assert proc.returncode != 0 and "unknown task 'nosuch'" in proc.stderr, proc.stderr
