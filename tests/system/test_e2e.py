"""End to end through all four services, each its own process, over a real nats-server.

* ``jetrl up`` trains two steps: jobs -> rollout <-> env-db -> trajectories -> trainer -> weights.
* A rollout replica is SIGKILLed mid-episode: its job is redelivered to the other replica and every
  episode is still counted exactly once.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from shared.bus import connect
from shared.config import JetRLConfig, save_config
from shared.messages import ActionEvent, Trajectory, WeightsAnnouncement, decode
from shared.subjects import Subjects
from tests.procs import log_tails, stop_processes

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def small_config(config: JetRLConfig, tmp_path: Path, **over: object) -> JetRLConfig:
    config.run.tasks = {"db": 1.0}
    config.controller.group_size = 2
    config.controller.max_inflight = 4
    config.rollout.max_new_tokens = 12
    config.rollout.concurrency = 2
    config.trainer.steps = 2
    config.trainer.min_groups = 1
    config.trainer.lr = 1e-3
    # an untrained model's groups are all failures (no policy gradient): the KL term makes every step a real
    # optimizer step, and only those make a new policy version
    config.trainer.kl_coef = 0.01
    config.env.num_train_tasks = 8
    config.env.num_test_tasks = 4
    for key, value in over.items():
        section, name = key.split("__")
        setattr(getattr(config, section), name, value)
    return config


def spawn(args: list[str], config_path: Path, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as fh:
        return subprocess.Popen([sys.executable, "-m", *args, "--config", str(config_path)], cwd=REPO,
                                stdout=fh, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))


async def read_stream(config: JetRLConfig, subject: str, cls: type) -> list:
    """Every message on a stream subject so far (an ephemeral ordered read)."""
    nc = await connect(config.nats, "pytest-reader")
    js = nc.jetstream()
    out = []
    sub = await js.subscribe(subject, ordered_consumer=True)
    try:
        while True:
            msg = await sub.next_msg(timeout=2.0)
            out.append(decode(msg.data, cls))
    except Exception:  # nats TimeoutError: nothing more
        pass
    await nc.close()
    return out


def test_jetrl_up_trains_two_steps_through_all_services(config: JetRLConfig, tmp_path: Path) -> None:
    cfg = small_config(config, tmp_path)
    cfg_path = tmp_path / "e2e.toml"
    save_config(cfg, cfg_path)
    proc = subprocess.run([sys.executable, "-m", "jetrl.cli", "up", "--config", str(cfg_path), "--rollouts", "1"],
                          cwd=REPO, capture_output=True, text=True, timeout=420)
    run_dir = Path(cfg.run.dir)
    logs = log_tails(run_dir)
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{logs}"
    # progress printed per step, with per-task success
    assert "step 1" in proc.stdout and "step 2" in proc.stdout and "db: success" in proc.stdout
    assert "training finished: 2 steps" in proc.stdout

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["train/trajectories"] >= 2 and "task/db/success" in r for r in rows)
    assert (run_dir / "checkpoints" / "step_000002" / "model.safetensors").is_file()
    assert (run_dir / "config.toml").is_file()

    subjects = Subjects(cfg.nats.prefix)
    trajs = asyncio.run(read_stream(cfg, subjects.traj(">"), Trajectory))
    assert len(trajs) >= 4
    assert len({t.episode_id for t in trajs}) == len(trajs)  # deduplicated by episode id
    for t in trajs:
        assert t.task == "db" and t.group_size == 2 and t.turns
        trained = [i for i, m in enumerate(t.loss_mask) if m]
        in_turns = [i for turn in t.turns for i in range(turn.start, turn.end)]
        assert trained == in_turns  # loss mask = exactly the sampled assistant tokens
        assert all(t.logprobs[i] <= 0.0 for i in trained) and any(t.logprobs[i] < 0 for i in trained)
        assert all(t.logprobs[i] == 0.0 for i in range(len(t.tokens)) if not t.loss_mask[i])
    actions = asyncio.run(read_stream(cfg, subjects.action(), ActionEvent))
    for t in trajs:  # the EPISODES stream holds one action event per generated turn, in order
        turns = [a.turn for a in actions if a.episode_id == t.episode_id]
        assert turns == list(range(len(t.turns)))

    async def policy_version() -> int:
        nc = await connect(cfg.nats, "pytest-kv")
        kv = await nc.jetstream().key_value(subjects.policy_kv)
        note = decode((await kv.get(subjects.policy_version_key)).value, WeightsAnnouncement)
        await nc.close()
        return note.version

    assert asyncio.run(policy_version()) == 2
    rollout_log = (run_dir / "logs" / "rollout-0.log").read_text()
    assert "weights_loaded" in rollout_log and "policy_version=1" in rollout_log


def test_killed_rollout_replica_job_is_redelivered_and_counted_once(config: JetRLConfig, tmp_path: Path) -> None:
    cfg = small_config(config, tmp_path, rollout__concurrency=1, rollout__job_ack_wait_s=4.0,
                       trainer__steps=3, controller__max_inflight=4)
    run_dir = Path(cfg.run.dir)
    (run_dir / "logs").mkdir(parents=True)
    cfg_path = tmp_path / "kill.toml"
    save_config(cfg, cfg_path)
    subjects = Subjects(cfg.nats.prefix)
    procs = {
        "env": spawn(["services.envs", "db"], cfg_path, run_dir / "logs" / "env.log"),
        "rollout-a": spawn(["services.rollout"], cfg_path, run_dir / "logs" / "rollout-a.log"),
        "rollout-b": spawn(["services.rollout"], cfg_path, run_dir / "logs" / "rollout-b.log"),
        "trainer": spawn(["services.trainer"], cfg_path, run_dir / "logs" / "trainer.log"),
        "controller": spawn(["services.controller"], cfg_path, run_dir / "logs" / "controller.log"),
    }
    by_pid = {p.pid: name for name, p in procs.items()}

    async def kill_first_actor() -> tuple[str, str]:
        """SIGKILL the replica that plays the first action, right after that action."""
        nc = await connect(cfg.nats, "pytest-killer")
        sub = await nc.subscribe(subjects.action())
        while True:
            event = decode((await sub.next_msg(timeout=240)).data, ActionEvent)
            # replica ids are role-host-pid (plus a random token in a container): find the pid among its parts
            name = next((by_pid[int(t)] for t in event.replica_id.split("-") if t.isdigit() and int(t) in by_pid), None)
            if name and name.startswith("rollout") and event.turn == 0:
                procs[name].send_signal(signal.SIGKILL)
                await nc.close()
                return name, event.episode_id

    try:
        killed, episode_id = asyncio.run(kill_first_actor())
        assert procs[killed].wait(timeout=10) == -signal.SIGKILL
        assert procs["trainer"].wait(timeout=400) == 0, (run_dir / "logs" / "trainer.log").read_text()[-3000:]
        # The trainer may finish its steps on other groups before the redelivered job (ack wait 4 s) is
        # played again; the replicas keep serving it, so wait for it before stopping them.
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(
                t.episode_id == episode_id for t in asyncio.run(read_stream(cfg, subjects.traj(">"), Trajectory))):
            time.sleep(1.0)
        status = json.load(urllib.request.urlopen((run_dir / "controller.url").read_text().strip() + "/status",
                                                  timeout=5))
    finally:
        stop_processes(procs.values(), timeout_s=20)

    trajs = asyncio.run(read_stream(cfg, subjects.traj(">"), Trajectory))
    ids = [t.episode_id for t in trajs]
    assert len(ids) == len(set(ids)), "an episode was stored twice"
    survivor = [t for t in trajs if t.episode_id == episode_id]
    assert len(survivor) == 1, "the killed replica's episode never finished"
    killed_pid = procs[killed].pid
    assert not survivor[0].replica_id.endswith(f"-{killed_pid}")  # finished by the other replica
    assert status["duplicate_trajectories"] == 0
    assert {"rollout", "env-db", "controller"} <= {r["role"] for r in status["replicas"]}
    assert status["episodes_finished"] >= len(set(ids)) - 2  # (a last trajectory may land after /status)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    consumed = sum(int(r["train/trajectories"]) for r in rows)
    assert consumed <= len(set(ids))  # the trainer never trained on an episode twice


def test_stopping_a_run_gives_the_trainer_time_to_save_and_kills_a_stuck_role(tmp_path: Path) -> None:
    """`jetrl up` on Ctrl-C: a trainer in the middle of a long step still saves; a role that ignores
    SIGTERM is killed after the short timeout."""
    import signal
    import subprocess
    import sys
    import time

    from jetrl.supervisor import Supervisor

    saved = tmp_path / "model-saved"
    trainer = ("import signal, time, pathlib\n"
               "signal.signal(signal.SIGTERM, lambda *a: None)\n"  # finishes its step, then saves
               "print('ready', flush=True); time.sleep(2.0)\n"
               f"pathlib.Path({str(saved)!r}).write_text('ok')\n")
    stuck = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint('ready', flush=True)\ntime.sleep(60)\n"
    sup = Supervisor(JetRLConfig(), tmp_path / "config.toml", tmp_path)
    for name, code in (("trainer", trainer), ("rollout-0", stuck)):
        sup.procs[name] = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
        assert sup.procs[name].stdout.readline().strip() == b"ready"
    started = time.monotonic()
    sup.stop_all(timeout_s=0.5, trainer_grace_s=30.0)
    assert saved.read_text() == "ok"
    assert sup.procs["rollout-0"].returncode == -signal.SIGKILL
    assert time.monotonic() - started < 20
