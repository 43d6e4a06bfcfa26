"""The three adapters train and evaluate through ``jetrl up`` and ``jetrl eval``, each against a real server
of its standard, named only in the config: Gymnasium's FrozenLake (task ``gym``), the MCP SQL tool server
over stdio (``mcp``, tests/servers/sql_tools.py) and an openenv-core server the env replica starts itself
(``openenv``, tests/servers/openenv_guess.py). A tiny model, two RL steps: what is checked is that every
episode runs through each adapter to an end of its own (none an env_error), not that anything is learned."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from shared.config import JetRLConfig, save_config
from tests.procs import log_tails

pytestmark = pytest.mark.slow

for package in ("gymnasium", "mcp", "openenv"):
    pytest.importorskip(package, reason="the gym, mcp and openenv extras (make venv installs them)")

REPO = Path(__file__).resolve().parents[2]
TASKS = ["gym", "mcp", "openenv"]
SALES = [{"tool": "execute_sql", "arguments": {"query": "CREATE TABLE sales (item TEXT, amount INTEGER)"}},
         {"tool": "execute_sql", "arguments": {"query": "INSERT INTO sales VALUES ('a', 3), ('b', 4)"}}]


def adapters_run(tmp_path: Path, name: str) -> Path:
    tasks_file = tmp_path / "sql_tasks.jsonl"
    tasks_file.write_text("".join(json.dumps(t) + "\n" for t in [
        *({"id": f"sum-{i}", "prompt": f"What is the total amount of the sales table, plus {i}?", "setup": SALES,
           "answer": 7 + i, "grader": "numeric"} for i in range(4)),
        *({"id": f"rows-{i}", "prompt": "How many rows has the sales table?", "setup": SALES, "answer": "2",
           "split": "test"} for i in range(2))]))
    cfg = JetRLConfig()
    cfg.run.dir = str(tmp_path / name)
    cfg.run.tasks = {task: 1.0 for task in TASKS}
    cfg.controller.group_size = 2
    cfg.controller.max_inflight = 6
    cfg.controller.eval_limit = 2
    cfg.rollout.max_new_tokens = 12
    cfg.rollout.concurrency = 3
    cfg.trainer.steps = 2
    cfg.trainer.min_groups = 1
    cfg.trainer.kl_coef = 0.01  # all-failure groups still make an optimizer step, and so a new policy version
    cfg.env.num_train_tasks, cfg.env.num_test_tasks = 4, 2
    cfg.env.sections = {
        "gym": {"id": "FrozenLake-v1", "kwargs": {"render_mode": "ansi", "is_slippery": False}, "max_turns": 3},
        "mcp": {"server_command": [sys.executable, "-m", "tests.servers.sql_tools"], "tasks_file": str(tasks_file),
                "max_turns": 3},
        "openenv": {"server_command": [sys.executable, "-m", "tests.servers.openenv_guess", "{port}"],
                    "url": "http://127.0.0.1:{port}/guess", "max_turns": 3},
    }
    path = tmp_path / f"{name}.toml"
    save_config(cfg, path)
    return path


def jetrl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "jetrl.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=420)


def test_jetrl_up_and_eval_run_every_adapter(tmp_path: Path) -> None:
    proc = jetrl("up", "--config", str(adapters_run(tmp_path, "up")), "--rollouts", "1")
    run_dir = tmp_path / "up"
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{log_tails(run_dir)}"
    assert "training finished: 2 steps" in proc.stdout
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for task in TASKS:  # every adapter played episodes to an end of its own (the trainer sees only some groups)
        closed = re.findall(r"event='session_closed'.* status='(\w+)'", (run_dir / "logs" / f"env-{task}-0.log").read_text())
        assert len(closed) >= 2 and "env_error" not in closed, (task, closed)

    proc = jetrl("eval", "--config", str(adapters_run(tmp_path, "eval")), "--rollouts", "1")
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{log_tails(tmp_path / 'eval')}"
    report = json.loads((tmp_path / "eval" / "eval.json").read_text())["greedy"]
    for task in TASKS:
        assert report[task]["episodes"] == 2, report[task]
        assert report[task]["statuses"].get("env_error", 0) == 0, (task, report[task]["statuses"])


def test_a_stopped_eval_keeps_what_it_finished_and_says_which_tasks_are_whole(tmp_path: Path) -> None:
    """SIGINT to `jetrl eval` part way: no eval.json (that is a whole report), but eval.partial.json with every
    episode that came back, each task's report naming the episodes it planned and whether all came back."""
    config = adapters_run(tmp_path, "stopped")
    run_dir = tmp_path / "stopped"
    out = open(tmp_path / "eval.out", "w")
    proc = subprocess.Popen([sys.executable, "-m", "jetrl.cli", "eval", "--config", str(config), "--rollouts", "1",
                             '--controller.eval_passes=["greedy", "sampled"]', "--controller.eval_samples=200"],
                            cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    closed = 0
    while closed < 40 and proc.poll() is None and time.monotonic() < deadline:  # some episodes back, most not
        time.sleep(0.5)
        closed = sum(p.read_text().count("event='session_closed'") for p in (run_dir / "logs").glob("env-*.log"))
    assert proc.poll() is None, f"the eval ended before it was stopped:\n{log_tails(run_dir)}"
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130
    assert not (run_dir / "eval.json").exists()
    partial = json.loads((run_dir / "eval.partial.json").read_text())
    planned = {"greedy": 2, "sampled": 2 * 200}
    episodes = 0
    for name, by_task in partial.items():
        for task, report in by_task.items():
            assert report["planned"] == planned[name], (name, task, report["planned"])
            assert report["complete"] == (report["episodes"] == planned[name]) and report["episodes"] <= planned[name]
            episodes += report["episodes"]
    assert episodes >= 1 and not all(r["complete"] for by_task in partial.values() for r in by_task.values())
