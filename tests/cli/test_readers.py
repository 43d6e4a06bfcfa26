"""Outside readers of a run (examples/readers, jetrl/access.py): ``jetrl creds observer`` writes the run's
read-only credentials as a NATS context file and prints a URL; the Python example (nats-py) and the Node
one (the official nats.js client and @msgpack/msgpack, from npm) read every trajectory of ``<prefix>.traj.>``
with them, against a real nats-server with per-role users, as in a ``jetrl up`` run. The Node reader skips
where node or npm is missing."""

from __future__ import annotations

import asyncio
import json
import shutil
import stat
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import nats
import pytest

from shared.auth import generate_passwords, server_authorization
from shared.bus import connect, declare_topology
from shared.config import JetRLConfig, save_config
from shared.messages import Trajectory, TurnInfo, encode
from shared.natsd import EmbeddedNats
from shared.subjects import Subjects

REPO = Path(__file__).resolve().parents[2]
READERS = REPO / "examples" / "readers"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A run directory as `jetrl up` leaves it (config.toml, nats.url, nats/auth), its server holding three
    trajectories published by a rollout."""
    run = tmp_path_factory.mktemp("run")
    cfg = JetRLConfig()
    cfg.nats.prefix = "tread" + uuid.uuid4().hex[:6]
    subjects = Subjects(cfg.nats.prefix)
    auth_dir = run / "nats" / "auth"
    server = EmbeddedNats(run / "nats" / "store", authorization=server_authorization(subjects,
                                                                                     generate_passwords(auth_dir)))
    cfg.nats.url, cfg.nats.auth_dir = server.start(), str(auth_dir)
    save_config(cfg, run / "config.toml")
    (run / "nats.url").write_text(f"{cfg.nats.url}\n{cfg.nats.prefix}\n")

    async def publish() -> None:
        admin = await connect(cfg.nats, "pytest-admin", role="admin")
        await declare_topology(admin.jetstream(), subjects, cfg.nats, role="admin")
        rollout = await connect(cfg.nats, "pytest-rollout", role="rollout")
        for i, task in enumerate(("db", "kg", "db")):
            t = Trajectory(episode_id=f"e{i}", group_id="g", task=task, task_id="t", split="train", group_size=1,
                           tokens=[1, 2, 3], logprobs=[0.0, -0.5, -0.1], loss_mask=[0, 1, 1], prompt_len=1,
                           turns=[TurnInfo(start=1, end=3, policy_version=0, engine_id="e")], reward=i / 2,
                           status="completed", replica_id="r")
            await rollout.jetstream().publish(subjects.traj(task), encode(t), headers={"Nats-Msg-Id": t.episode_id})
        await rollout.close()
        await admin.close()

    asyncio.run(publish())
    yield run
    server.stop()


EXPECTED = ["db e0 reward 0.00 completed turns 1", "kg e1 reward 0.50 completed turns 1",
            "db e2 reward 1.00 completed turns 1"]


@pytest.fixture(scope="module")
def context(run_dir: Path) -> tuple[Path, list[str]]:
    proc = subprocess.run([sys.executable, "-m", "jetrl.cli", "creds", "observer", "--run-dir", str(run_dir)],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    path = run_dir / "nats" / "observer.context.json"
    return path, proc.stdout.splitlines()


def test_jetrl_creds_writes_a_private_context_file_and_prints_a_url(run_dir, context) -> None:
    path, lines = context
    ctx = json.loads(path.read_text())
    password = (run_dir / "nats" / "auth" / "observer.password").read_text().strip()
    url = (run_dir / "nats.url").read_text().split()[0]
    assert ctx["user"] == "observer" and ctx["password"] == password and ctx["inbox_prefix"] == "_INBOX_observer"
    assert ctx["url"] == url and ctx["jetrl_traj_subject"].endswith(".traj.>")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert lines[0].startswith(f"context file: {path}")
    assert lines[-1] == url.replace("nats://", f"nats://observer:{password}@")

    async def refused(exc: Exception) -> None:  # the server's permission violations arrive here
        pass

    async def read_with(url_with_password: str, prefix: str) -> int:  # the printed URL works as it is
        nc = await nats.connect(url_with_password, inbox_prefix=prefix.encode(), allow_reconnect=False,
                                error_cb=refused)
        n = 0
        try:
            sub = await nc.jetstream(timeout=2.0).pull_subscribe(ctx["jetrl_traj_subject"],
                                                                 stream=ctx["jetrl_traj_stream"])
            while True:
                n += len(await sub.fetch(8, timeout=1.5))
        except (nats.errors.TimeoutError, TimeoutError):
            pass
        await nc.close()
        return n

    assert asyncio.run(read_with(lines[-1], "_INBOX_observer")) == 3
    # on the default inbox the reply to the consumer's creation never comes: why the prefix is documented
    assert asyncio.run(read_with(lines[-1], "_INBOX")) == 0


def test_the_python_example_reads_the_trajectories_as_the_observer(context) -> None:
    path, _ = context
    proc = subprocess.run([sys.executable, str(READERS / "read_trajectories.py"), str(path), "--max", "3"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == EXPECTED


def test_the_node_example_reads_the_trajectories_as_the_observer(context) -> None:
    missing = [tool for tool in ("node", "npm", "make") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"{', '.join(missing)} not installed: the Node reader cannot run")
    setup = subprocess.run(["make", "-s", "setup-readers"], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert setup.returncode == 0, f"make setup-readers failed:\n{setup.stdout}\n{setup.stderr}"
    path, _ = context
    proc = subprocess.run(["node", str(READERS / "read-trajectories.mjs"), str(path), "--max", "3"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines() == EXPECTED
