"""`docker compose up` for real (`make test-compose`): the local-test profile (compose/docker-compose.local.yml,
host networking, free loopback ports) trains on the tiny config with two rollout replicas; a third replica
added mid-run takes jobs; a killed rollout container does not stop the run; `down -v` leaves nothing.

Runs only under `make test-compose` (JETRL_COMPOSE_TEST=1: it builds or reuses the images and takes minutes),
and skips with the reason where no Docker engine or compose v2 can run. Figures (seconds from `up`, steps,
episodes) go to runs/compose-test/figures.json for docs/benchmarks/docker.md."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent
FILES = ["-f", str(REPO / "compose" / "docker-compose.yml"), "-f", str(REPO / "compose" / "docker-compose.local.yml")]
# the roles the tiny config (configs/pipeline.toml: db, kg, webshop) needs; alfworld and os stay down
SERVICES = ["nats", "topology", "controller", "trainer", "rollout", "env-db", "env-kg", "env-webshop"]
ROLES = {"controller", "trainer", "rollout", "env-db", "env-kg", "env-webshop"}
FIGURES = REPO / "runs" / "compose-test" / "figures.json"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(1500),
    pytest.mark.skipif(os.environ.get("JETRL_COMPOSE_TEST") != "1",
                       reason="builds images and runs the cluster for minutes: `make test-compose` runs it"),
]


def engine_or_skip() -> None:
    if shutil.which("docker") is None:
        pytest.skip("no docker CLI (make setup-docker installs Debian's docker.io as root)")
    info = subprocess.run(["docker", "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True)
    if info.returncode != 0:
        pytest.skip(f"no Docker engine reachable (make setup-docker starts one as root): {info.stderr.strip()[:200]}")
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode != 0:
        pytest.skip("no compose v2 (`docker compose`): the local profile resets ports with !reset (compose >= 2.24)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Stack:
    project: str
    env: dict[str, str]
    http: str
    env_file: str
    token: str
    t0: float = field(default_factory=time.monotonic)
    figures: dict[str, Any] = field(default_factory=dict)

    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> str:
        proc = subprocess.run(["docker", "compose", "-p", self.project, "--env-file", self.env_file, *FILES, *args],
                              env=self.env,
                              capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"docker compose {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        return proc.stdout

    def containers(self, service: str) -> list[str]:
        return self.compose("ps", "-q", service).split()

    def status(self) -> dict[str, Any]:
        request = urllib.request.Request(f"{self.http}/status", headers={"Authorization": f"Bearer {self.token}"})
        with urllib.request.urlopen(request, timeout=5) as resp:
            return json.loads(resp.read())

    def since(self) -> float:
        return round(time.monotonic() - self.t0, 1)

    def wait(self, what: str, cond: Callable[[dict[str, Any]], bool], timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            try:
                last = self.status()
                if cond(last):
                    return last
            except OSError as exc:  # controller not listening yet
                last = repr(exc)
            time.sleep(2)
        raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}; last /status: "
                             f"{json.dumps(last)[:3000] if not isinstance(last, str) else last}")


def roles(status: dict[str, Any]) -> dict[str, int]:
    out: dict[str, int] = {}
    for replica in status["replicas"]:
        out[replica["role"]] = out.get(replica["role"], 0) + 1
    return out


def episodes_done(container: str) -> int:
    """Episodes a rollout container finished, from its JSON logs (the worker logs every one)."""
    proc = subprocess.run(["docker", "logs", container], capture_output=True, text=True, timeout=60)
    return sum('"episode_done"' in line for line in (proc.stdout + proc.stderr).splitlines())


@pytest.fixture
def stack() -> Iterator[Stack]:
    engine_or_skip()
    nats_port, monitor_port, http_port = free_port(), free_port(), free_port()
    env = {**os.environ,
           "JETRL_LOCAL_NATS_PORT": str(nats_port), "JETRL_LOCAL_NATS_MONITOR_PORT": str(monitor_port),
           "JETRL_LOCAL_HTTP_PORT": str(http_port),
           # the classic builder: its layer cache is the one `docker build` (make setup-docker) filled, and an
           # engine without the buildx plugin (Debian's docker.io) builds with it anyway
           "DOCKER_BUILDKIT": os.environ.get("DOCKER_BUILDKIT", "0"),
           # enough steps that the run is still going when the checks end; `down` stops it
           "JETRL_LOCAL_TRAINER_STEPS": os.environ.get("JETRL_LOCAL_TRAINER_STEPS", "1000")}
    # per-role NATS passwords and the status API's token, as a user makes them (`jetrl secrets`)
    secrets = Path(tempfile.mkdtemp(prefix="jetrl-compose-")) / ".env"
    subprocess.run([sys.executable, "-m", "jetrl", "secrets", "--env", str(secrets)], check=True, cwd=REPO)
    token = next(line.split("=", 1)[1] for line in secrets.read_text().splitlines()
                 if line.startswith("JETRL_CONTROLLER_TOKEN="))
    s = Stack(project=f"jetrl-test-{os.getpid()}", env=env, http=f"http://127.0.0.1:{http_port}",
              env_file=str(secrets), token=token)
    t_build = time.monotonic()
    s.compose("build", "controller", timeout=1800)  # one image for every role; cached layers make it seconds
    s.figures["build_s"] = round(time.monotonic() - t_build, 1)
    try:
        yield s
    finally:
        failed = s.figures.get("ok") is not True
        if failed:  # the last lines of every service, for the failure report
            print(s.compose("logs", "--no-color", "--tail", "40", timeout=120, check=False)[-20000:])
        t_down = time.monotonic()
        s.compose("down", "-v", "--remove-orphans", "--timeout", "10", timeout=300, check=False)
        s.figures["down_s"] = round(time.monotonic() - t_down, 1)
        left = subprocess.run(["docker", "ps", "-aq", "--filter", f"label=com.docker.compose.project={s.project}"],
                              capture_output=True, text=True).stdout.split()
        vols = subprocess.run(["docker", "volume", "ls", "-q", "--filter", f"label=com.docker.compose.project={s.project}"],
                              capture_output=True, text=True).stdout.split()
        s.figures["left_after_down"] = {"containers": len(left), "volumes": len(vols)}
        FIGURES.parent.mkdir(parents=True, exist_ok=True)
        FIGURES.write_text(json.dumps(s.figures, indent=2))
        if not failed:
            assert not left and not vols, f"down -v left containers {left} volumes {vols}"


def test_compose_trains_scales_and_survives_a_kill(stack: Stack) -> None:
    s = stack
    s.t0 = time.monotonic()
    s.compose("up", "-d", "--no-build", "--scale", "rollout=2", *SERVICES, timeout=600)
    s.figures["up_returned_s"] = s.since()

    # every role registered (two rollout replicas), then training steps advancing
    st = s.wait("every role in /status", lambda st: ROLES <= set(roles(st)) and roles(st)["rollout"] >= 2, 600)
    s.figures["all_roles_s"] = s.since()
    st = s.wait("the first training step", lambda st: st["policy_version"] >= 1, 900)
    s.figures["first_step_s"] = s.since()
    first_step = st["policy_version"]
    t_first = time.monotonic()
    st = s.wait("two more training steps", lambda st: st["policy_version"] >= first_step + 2, 600)
    s.figures["s_per_step_2_replicas"] = round((time.monotonic() - t_first) / (st["policy_version"] - first_step), 1)

    # a third rollout replica, mid-run: it registers and finishes episodes of its own
    old = set(s.containers("rollout"))
    assert len(old) == 2
    s.compose("up", "-d", "--no-build", "--no-recreate", "--scale", "rollout=3", "rollout", timeout=300)
    t_scale = time.monotonic()
    new = set(s.containers("rollout")) - old
    assert len(new) == 1, f"scale to 3 added {new}"
    (new_id,) = new
    s.wait("three rollout replicas", lambda st: roles(st).get("rollout", 0) >= 3, 300)
    deadline = time.monotonic() + 400
    while episodes_done(new_id) == 0:
        assert time.monotonic() < deadline, "the new rollout replica took no job within 400 s"
        time.sleep(3)
    s.figures["new_replica_first_episode_s"] = round(time.monotonic() - t_scale, 1)

    # kill one of the first two rollout containers (SIGKILL, mid-episode): the run goes on. Its heartbeat
    # expires (controller.heartbeat_ttl_s, 10 s) and its unacked jobs are redelivered to the others; Docker
    # may restart it (restart: unless-stopped), which is the run going on too.
    before = s.status()
    victim = sorted(old)[0]
    subprocess.run(["docker", "kill", victim], check=True, capture_output=True, timeout=60)
    t_kill = time.monotonic()
    st = s.wait("training after the kill",
                lambda st: st["policy_version"] >= before["policy_version"] + 3
                and st["episodes_finished"] >= before["episodes_finished"] + 8
                and time.monotonic() - t_kill > 15, 900)
    s.figures["three_steps_after_kill_s"] = round(time.monotonic() - t_kill, 1)
    inspect = subprocess.run(["docker", "inspect", "-f", "{{.RestartCount}} {{.State.Status}}", victim],
                             capture_output=True, text=True, timeout=60).stdout.split()
    s.figures["killed_container"] = {"restart_count": int(inspect[0]), "status": inspect[1]} if inspect else "removed"
    assert episodes_done(new_id) > 0
    s.figures.update(ok=True, final_policy_version=st["policy_version"], episodes_finished=st["episodes_finished"],
                     episodes_lost=st["episodes_lost"], duplicate_trajectories=st["duplicate_trajectories"],
                     replicas=roles(st), total_s=s.since(),
                     episodes_per_rollout={c[:12]: episodes_done(c) for c in sorted(old | new)})
