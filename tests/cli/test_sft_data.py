"""`jetrl sft --data`: a conversation from a file becomes the very tokens and loss mask the rollout records
for an oracle episode; the round trip `jetrl sft` (oracle) -> `jetrl export` of its successes -> `jetrl sft
--data` trains the same model, and its loss falls; a bad row is refused with its number and field."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jetrl.dataset import DatasetError, conversation
from jetrl.sft_data import check_dataset, demonstration
from services.envs.host import EnvHost
from services.rollout.worker import RolloutWorker
from shared.chat import tokenize_conversation
from shared.config import EnvConfig, JetRLConfig, ModelConfig, save_config
from shared.messages import EpisodeJob
from shared.model import load_tokenizer, quiet_transformers, resolve_model

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tokenizer():
    quiet_transformers()
    return load_tokenizer(resolve_model(ModelConfig()))


async def test_an_oracle_episodes_conversation_tokenizes_to_its_recorded_tokens(nc, config, subjects, tokenizer) -> None:
    """The trajectory's messages are the action log and its answers; tokenised the way `jetrl sft --data`
    does it, they give back the rollout's own token record: tokens, loss mask, turn spans."""
    from services.envs.db import make_env

    env_cfg = EnvConfig(num_train_tasks=4, num_test_tasks=2)
    host = EnvHost(make_env(env_cfg), env_cfg, subjects, "env-db-sft")
    service = await host.serve(nc, nc.jetstream())
    config.rollout.engine = "oracle"
    worker = RolloutWorker(nc, nc.jetstream(), subjects, config.rollout, None, tokenizer, "rollout-oracle")
    try:
        ids = host.env.task_ids("train")
        trajs = [await worker.play(EpisodeJob(episode_id=f"o{i}", group_id=f"o{i}", task="db", task_id=ids[i]),
                                   attempt=1) for i in range(3)]
    finally:
        await service.stop()
        await host.shutdown()
    for traj in trajs:
        assert traj.reward == 1.0 and traj.tools and traj.messages[0]["role"] == "system"
        assistant = [m for m in traj.messages if m["role"] == "assistant"]
        assert len(assistant) == len(traj.turns) and all(m.get("tool_calls") for m in assistant)
        assert traj.messages[-1]["role"] == "tool"  # the env's last answer is in the record
        tok = tokenize_conversation(traj.messages, traj.tools, tokenizer)
        assert tok.tokens == traj.tokens and tok.loss_mask == traj.loss_mask and tok.prompt_len == traj.prompt_len
        assert tok.turns == [(t.start, t.end) for t in traj.turns]
        demo = demonstration(conversation({"messages": traj.messages, "tools": json.dumps(traj.tools)}, 0),
                             tokenizer, "json", "d0")
        assert demo.tokens == traj.tokens and demo.group_size == 1 and demo.turns[0].engine_id == "dataset"


def test_a_bad_row_is_refused_with_its_number_and_field(tmp_path: Path) -> None:
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    rows = [good, {"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "?"}]}]
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DatasetError, match=r"row 1: messages\[1\]\.role 'robot'"):
        check_dataset(path, 1.0)
    call = {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{x"}}]}
    with pytest.raises(DatasetError, match=r"row 3: messages\[1\]\.tool_calls\[0\]\.function\.arguments is not JSON"):
        conversation({"messages": [{"role": "user", "content": "q"}, call]}, 3)
    with pytest.raises(DatasetError, match="row 0: no assistant turn"):
        conversation({"messages": [{"role": "user", "content": "q"}]}, 0)
    # another dataset's shape: no reward, no tools, arguments as a map, content as parts
    other = conversation({"messages": [{"role": "user", "content": [{"type": "text", "text": "q"}]},
                                       {"role": "assistant", "content": None, "tool_calls": [
                                           {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]}]},
                         5)
    assert (other.reward, other.task, other.task_id, other.messages[0]["content"]) == (1.0, "data", "5", "q")


def _jetrl(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "jetrl.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def oracle_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A real `jetrl sft` run: db's oracle and the sums test env's through every service, its own embedded
    server and store, then over (the run directory and its config file)."""
    tmp_path = tmp_path_factory.mktemp("oracle")
    config = JetRLConfig()
    config.nats.prefix = "oracle"
    config.run.tasks = {"db": 1.0, "sums": 1.0}
    config.env.sections["sums"] = {"factory": "tests.sums_env:make_env"}  # a grader with a setting
    config.controller.max_inflight = 8
    config.env.num_train_tasks, config.env.num_test_tasks = 8, 2
    config.trainer.steps, config.trainer.min_groups, config.trainer.max_groups = 1, 8, 8
    cfg_path = tmp_path / "sft.toml"
    save_config(config, cfg_path)
    run_dir = tmp_path / "run"
    proc = _jetrl("sft", "--config", str(cfg_path), "--rollouts", "1", f"--run.dir={run_dir}")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return run_dir, cfg_path


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_export_of_a_runs_successes_trains_with_sft_data_and_the_loss_falls(oracle_run: tuple[Path, Path],
                                                                          tmp_path: Path) -> None:
    """The oracle run's successful episodes exported from its finished store, then `jetrl sft --data` on
    that file: no env or rollout runs, every step trains on a full batch, the loss falls step by step."""
    oracle_run_dir, _ = oracle_run
    demos = tmp_path / "demos.parquet"
    proc = _jetrl("export", "--run-dir", str(oracle_run_dir), "-o", str(demos), "--task", "db", "--status",
                  "completed", "--min-reward", "1", timeout=120)
    assert proc.returncode == 0, proc.stderr
    import pandas as pd

    frame = pd.read_parquet(demos)
    assert len(frame) >= 8 and set(frame["reward"]) == {1.0} and set(frame["task"]) == {"db"}
    four = tmp_path / "four.parquet"  # pandas writes it back: the same four conversations every step
    frame.head(4).to_parquet(four)

    data_run = tmp_path / "from-data"
    proc = _jetrl("sft", "--data", str(four), f"--run.dir={data_run}",  # the defaults: no task mix, none needed
                  "--trainer.steps=4", "--trainer.lr=3e-3", "--trainer.min_groups=4", "--trainer.max_groups=4",
                  "--trainer.checkpoint_every=0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "4 conversations (db 4)" in proc.stdout
    assert "started trainer" in proc.stdout and "env-db" not in proc.stdout  # no env, rollout or controller
    rows = [json.loads(line) for line in (data_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 5))
    assert all(r["train/sft_trajectories"] == 4 for r in rows)
    losses = [r["train/loss"] for r in rows]
    assert all(b < a for a, b in zip(losses, losses[1:], strict=False)) and losses[-1] < 0.97 * losses[0], losses
    assert (data_run / "model" / "config.json").is_file()


@pytest.mark.slow
def test_reverify_replays_the_runs_episodes_and_finds_a_changed_grader(oracle_run: tuple[Path, Path],
                                                                      tmp_path: Path) -> None:
    """The replay rule: each stored episode's task, seed and action log, replayed by `jetrl reverify`
    against fresh db and sums envs, give the same opening, answers and grade. Then sums' grader made
    strict by a config override: exactly the episodes of its odd tasks (decimal answers) lose their reward."""
    run_dir, _ = oracle_run
    out = tmp_path / "same.jsonl"
    proc = _jetrl("reverify", "--run-dir", str(run_dir), "--out", str(out), timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [json.loads(line) for line in out.read_text().splitlines()]
    assert {r["task"] for r in results} == {"db", "sums"}
    assert f"{len(results)} episodes replayed, 0 graded differently" in proc.stdout
    assert all(r["replayed_reward"] == r["stored_reward"] == 1.0 and r["replayed_status"] == "completed"
               and not r["opening_differs"] and not r["answers_differ"] for r in results)

    out = tmp_path / "strict.jsonl"
    proc = _jetrl("reverify", "--run-dir", str(run_dir), "--task", "sums", "--env.sums.numeric=false", "--out",
                  str(out), timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = [json.loads(line) for line in out.read_text().splitlines()]
    odd = {r["episode_id"] for r in results if int(r["task_id"].rsplit("-", 1)[1]) % 2 == 1}
    assert odd and {r["episode_id"] for r in results if r["changed"]} == odd
    assert f"{len(odd)} graded differently" in proc.stdout
    assert all(r["replayed_reward"] == 0.0 for r in results if r["changed"])
