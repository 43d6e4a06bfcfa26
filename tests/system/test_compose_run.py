"""`docker compose up` for real (`make test-compose`): the local-test profile (compose/docker-compose.local.yml,
host networking, free loopback ports) trains on the tiny config with two rollout replicas, each replica of a
scaled service connected as its own NATS user; every attack road of tests/system/attack_roads.py is refused while
it trains on; a third replica added mid-run takes jobs; a killed rollout container does not stop the run;
`down -v` leaves nothing. The 3-node JetStream cluster (compose/docker-compose.cluster.yml on the same profile)
loses a node mid-run and the run finishes with no episode lost or stored twice.

Runs only under `make test-compose` (JETRL_COMPOSE_TEST=1: it builds or reuses the images and takes minutes),
and skips with the reason where no Docker engine or compose v2 can run. Figures (seconds from `up`, steps,
episodes) go to runs/compose-test/figures.json for docs/benchmarks/docker.md, the cluster's to
runs/compose-test/cluster-<case>.json for docs/benchmarks/cluster.md."""

from __future__ import annotations

import asyncio
import contextlib
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

from jetrl.compose_secrets import replica_passwords
from shared.auth import password_env_var
from shared.bus import connect
from shared.config import NatsConfig
from shared.subjects import Subjects
from tests.system.attack_roads import attack, check_refused
from tests.system.test_faults import count_episodes

REPO = Path(__file__).resolve().parents[2]
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
    files: list[str]  # -f FILE ... of every compose command
    secrets: dict[str, str]  # `jetrl secrets`' env file
    t0: float = field(default_factory=time.monotonic)
    figures: dict[str, Any] = field(default_factory=dict)
    figures_path: Path = FIGURES

    def compose(self, *args: str, timeout: float = 600, check: bool = True) -> str:
        proc = subprocess.run(["docker", "compose", "-p", self.project, "--env-file", self.env_file, *self.files,
                               *args],
                              env=self.env,
                              capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"docker compose {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
        return proc.stdout

    def containers(self, service: str, stopped: bool = False) -> list[str]:
        """Container ids of a service: the running ones, or with ``stopped`` the exited ones too."""
        return self.compose("ps", *(["-a"] if stopped else []), "-q", service).split()

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


def container_logs(container: str) -> str:
    proc = subprocess.run(["docker", "logs", container], capture_output=True, text=True, timeout=60)
    return proc.stdout + proc.stderr


def episodes_done(container: str) -> int:
    """Episodes a rollout container finished, from its JSON logs (the worker logs every one)."""
    return sum('"episode_done"' in line for line in container_logs(container).splitlines())


def replica_ids(status: dict[str, Any], role: str) -> list[str]:
    return sorted(r["replica_id"] for r in status["replicas"] if r["role"] == role)


def connection_users(monitor_port: int) -> dict[str, str]:
    """Connection name (a service's replica id) -> the NATS user it was let in as, from the server's /connz."""
    with urllib.request.urlopen(f"http://127.0.0.1:{monitor_port}/connz?auth=true&limit=1024", timeout=5) as resp:
        conns = json.loads(resp.read())["connections"] or []
    return {c.get("name", ""): c.get("authorized_user", "") for c in conns}


def compose_password(secrets: dict[str, str]) -> Callable[[str], str]:
    """A user's password from `jetrl secrets`' env file: a role's, or one replica user's."""
    replicas = {user: pw for service in ("rollout", "env-db", "env-kg", "env-webshop")
                for user, pw in replica_passwords(secrets, service).items()}
    return lambda user: replicas[user] if user in replicas else secrets[password_env_var(user)]


@contextlib.contextmanager
def running_stack(files: list[str], project: str, env_extra: dict[str, str]) -> Iterator[Stack]:
    """Build the image, yield the stack to `up`, then print the logs on failure, `down -v` and write the figures
    (to FIGURES, or the figures path the test set on the stack)."""
    engine_or_skip()
    http_port = free_port()
    env = {**os.environ, "JETRL_LOCAL_HTTP_PORT": str(http_port),
           # the classic builder: its layer cache is the one `docker build` (make setup-docker) filled, and an
           # engine without the buildx plugin (Debian's docker.io) builds with it anyway
           "DOCKER_BUILDKIT": os.environ.get("DOCKER_BUILDKIT", "0"), **env_extra}
    # per-role NATS passwords, the cluster's route password and the status API's token, as a user makes them
    # (`jetrl secrets`)
    secrets = Path(tempfile.mkdtemp(prefix="jetrl-compose-")) / ".env"
    subprocess.run([sys.executable, "-m", "jetrl", "secrets", "--env", str(secrets)], check=True, cwd=REPO)
    values = dict(line.split("=", 1) for line in secrets.read_text().splitlines() if "=" in line)
    s = Stack(project=f"{project}-{os.getpid()}", env=env, http=f"http://127.0.0.1:{http_port}",
              env_file=str(secrets), token=values["JETRL_CONTROLLER_TOKEN"], files=files, secrets=values)
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
        s.figures_path.parent.mkdir(parents=True, exist_ok=True)
        s.figures_path.write_text(json.dumps(s.figures, indent=2))
        if not failed:
            assert not left and not vols, f"down -v left containers {left} volumes {vols}"


@pytest.fixture
def stack() -> Iterator[Stack]:
    ports = {"JETRL_LOCAL_NATS_PORT": str(free_port()), "JETRL_LOCAL_NATS_MONITOR_PORT": str(free_port()),
             # enough steps that the run is still going when the checks end; `down` stops it
             "JETRL_LOCAL_TRAINER_STEPS": os.environ.get("JETRL_LOCAL_TRAINER_STEPS", "1000")}
    with running_stack(FILES, "jetrl-test", ports) as s:
        yield s


def test_compose_trains_refuses_every_attack_scales_and_survives_a_kill(stack: Stack) -> None:
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

    # each replica of a scaled service claimed its own NATS user (`jetrl secrets`' replica users): its replica
    # id is that user, and the server let its connection in as that user
    assert replica_ids(st, "rollout") == ["rollout-0", "rollout-1"], st["replicas"]
    for task in ("db", "kg", "webshop"):
        assert replica_ids(st, f"env-{task}") == [f"env-{task}-0"], st["replicas"]
    users = connection_users(int(s.env["JETRL_LOCAL_NATS_MONITOR_PORT"]))
    for replica in [r["replica_id"] for r in st["replicas"]]:
        assert users.get(replica) == (replica if replica.startswith(("rollout-", "env-")) else replica.split("-")[0]), \
            (replica, users)

    # every attack road, one user's credentials at a time, against the running cluster: each refused, and the
    # run trains on (the controller's word and the rollouts' logs after the next step)
    subjects = Subjects("jetrl")
    before = s.status()
    t_attack = time.monotonic()
    found = asyncio.run(attack(f"nats://127.0.0.1:{s.env['JETRL_LOCAL_NATS_PORT']}", subjects,
                               compose_password(s.secrets), thief="rollout-1", victim="rollout-0"))
    during = s.status()
    s.figures["attacks_s"] = round(time.monotonic() - t_attack, 1)
    st = s.wait("a training step after the attacks", lambda st: st["policy_version"] > during["policy_version"], 600)
    assert st["state"] != "finished" and st["policy_version"] < 1000, st  # no forged end, no forged version
    check_refused(found, subjects, before, during, {c[:12]: container_logs(c) for c in s.containers("rollout")},
                  thief="rollout-1", victim="rollout-0")
    s.figures["violations_seen"] = len([e for e in found.errors if "permissions violation" in e.lower()])

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
    # expires (nats.heartbeat_ttl_s, 10 s) and its unacked jobs are redelivered to the others; Docker
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


# The 3-node JetStream cluster under compose: compose/docker-compose.cluster.yml on the local profile,
# compose/docker-compose.cluster-local.yml giving each node its own loopback ports.
CLUSTER_FILES = [arg for name in ("docker-compose.yml", "docker-compose.cluster.yml", "docker-compose.local.yml",
                                  "docker-compose.cluster-local.yml") for arg in ("-f", str(REPO / "compose" / name))]
NODE_SERVICES = {"nats-1": "nats", "nats-2": "nats-2", "nats-3": "nats-3"}  # --server_name -> compose service
# The db task only (as tests/system/test_cluster.py): the cluster is under test, not the envs, and env-kg's first start
# builds its graph for minutes. Written next to the test's env file as one more -f file.
DB_ONLY = """services:
  controller: {environment: {JETRL__RUN__TASKS: "db=1.0"}}
  trainer: {environment: {JETRL__RUN__TASKS: "db=1.0"}}
  rollout: {environment: {JETRL__RUN__TASKS: "db=1.0"}}
"""


def container_health(container: str) -> str:
    """starting | healthy | unhealthy: the state of the container's healthcheck."""
    return subprocess.run(["docker", "inspect", "-f", "{{.State.Health.Status}}", container],
                          capture_output=True, text=True, timeout=60).stdout.strip()


@dataclass
class StreamState:
    replicas: int  # configured
    leader: str  # --server_name of the node leading it
    current: list[str]  # replicas the leader sees as current


async def cluster_audit(url: str, password: str) -> tuple[dict[str, StreamState], dict[str, object]]:
    """Every stream of the run (replicas, leader) and the episode books by id (tests/system/test_faults.py's count), read
    as the admin user through the nodes in ``url``."""
    nc = await connect(NatsConfig(url=url, user="admin", password=password), "compose-cluster-audit")
    try:
        streams = {}
        for info in await nc.jetstream().streams_info():
            if info.config.name.startswith(("JETRL", "KV_jetrl", "OBJ_jetrl")):
                current = [r.name for r in (info.cluster.replicas or []) if r.current and not r.offline]
                streams[info.config.name] = StreamState(info.config.num_replicas, info.cluster.leader, current)
        return streams, await count_episodes(nc, Subjects("jetrl"))
    finally:
        await nc.close()


def trainer_node(monitor_ports: dict[str, int]) -> str | None:
    """The node (--server_name) the trainer service is connected to, from each node's /connz."""
    for server, port in monitor_ports.items():
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/connz?auth=true&limit=1024", timeout=5) as resp:
            conns = json.loads(resp.read())["connections"] or []
        # the service's own connection (named after its replica id), not its container's healthcheck
        if any(c.get("authorized_user") == "trainer" and c.get("name", "").startswith("trainer-") for c in conns):
            return server
    return None


@pytest.mark.parametrize("victim", ["traj_leader", "trainer_node"])
def test_compose_cluster_loses_a_node_mid_run_and_no_episode(victim: str) -> None:
    """Three nats-server containers routed into one cluster, R3 streams, the tiny model trained for 8 steps with
    two rollout replicas; once step 2 is done one node is `docker kill`ed (no restart policy: it stays down):
    the one leading the TRAJ stream, or the one the trainer is connected to (nats-py picks a node at random,
    so the first may move no client at all; this one makes the trainer reconnect while it publishes weights).
    The run reaches its last step on the two nodes left with no service restarted, and counted by episode id
    no episode is lost or stored twice."""
    steps, kill_at_step = 8, 2
    client_ports = [free_port() for _ in NODE_SERVICES]
    monitor_ports = {server: free_port() for server in NODE_SERVICES}
    env_extra = {"JETRL_LOCAL_TRAINER_STEPS": str(steps)}
    for i, suffix in enumerate(["", "_2", "_3"]):
        env_extra |= {f"JETRL_LOCAL_NATS_PORT{suffix}": str(client_ports[i]),
                      f"JETRL_LOCAL_NATS_MONITOR_PORT{suffix}": str(list(monitor_ports.values())[i]),
                      f"JETRL_LOCAL_NATS_CLUSTER_PORT{suffix}": str(free_port())}
    db_only = Path(tempfile.mkdtemp(prefix="jetrl-compose-")) / "db-only.yml"
    db_only.write_text(DB_ONLY)
    with running_stack([*CLUSTER_FILES, "-f", str(db_only)], "jetrl-cluster", env_extra) as s:
        s.figures_path = REPO / "runs" / "compose-test" / f"cluster-{victim}.json"
        admin = s.secrets["JETRL_NATS_ADMIN_PASSWORD"]
        urls = {server: f"nats://127.0.0.1:{port}" for server, port in zip(NODE_SERVICES, client_ports, strict=True)}
        traj_stream = Subjects("jetrl").traj_stream
        s.t0 = time.monotonic()
        s.compose("up", "-d", "--no-build", "--scale", "rollout=2", *NODE_SERVICES.values(), "topology",
                  "controller", "trainer", "rollout", "env-db", timeout=600)
        s.figures["up_returned_s"] = s.since()
        s.wait("every role in /status",
               lambda st: {"controller", "trainer", "rollout", "env-db"} <= set(roles(st)) and roles(st)["rollout"] >= 2,
               600)
        s.figures["all_roles_s"] = s.since()
        st = s.wait(f"training step {kill_at_step}", lambda st: st["policy_version"] >= kill_at_step, 900)

        before, _ = asyncio.run(cluster_audit(",".join(urls.values()), admin))
        node = before[traj_stream].leader if victim == "traj_leader" else trainer_node(monitor_ports)
        assert node, "the trainer is connected to no node"
        (container,) = s.containers(NODE_SERVICES[node])
        subprocess.run(["docker", "kill", container], check=True, capture_output=True, timeout=60)
        killed = {"victim": victim, "node": node,
                  "led": sorted(n for n, state in before.items() if state.leader == node),
                  "at_step": st["policy_version"], "at_s": s.since()}
        s.figures["killed"] = killed

        st = s.wait("the run's last step on two nodes", lambda st: st["state"] == "finished", 900)
        s.figures["run_s"] = s.since()
        (trainer,) = s.containers("trainer", stopped=True)  # it exits once its last step is published
        deadline = time.monotonic() + 120
        while (state := subprocess.run(["docker", "inspect", "-f", "{{.State.Status}} {{.State.ExitCode}}", trainer],
                                       capture_output=True, text=True, timeout=60).stdout.split())[0] == "running":
            assert time.monotonic() < deadline, "the trainer still runs 120 s after the run finished"
            time.sleep(2)
        # the containers' healthchecks (shared.healthcheck: the registry KV, read through the URL list) pass with
        # one node dead: each check connects to a live one
        running = [c for service in ("controller", "rollout", "env-db") for c in s.containers(service)]
        deadline = time.monotonic() + 90
        while (health := {c[:12]: container_health(c) for c in running}) and set(health.values()) != {"healthy"}:
            if time.monotonic() > deadline:
                break
            time.sleep(3)
        s.figures["health_after_kill"] = health
        live = ",".join(url for server, url in urls.items() if server != node)
        after, books = asyncio.run(cluster_audit(live, admin))
        # per container: clients that were on the killed node and moved to a live one (nats-py shuffles the URLs:
        # maybe none), and restarts (Docker restarts a crashed service: the run would go on, but a node's loss
        # should not crash one)
        reconnects, restarts = {}, {}
        for service in ("controller", "trainer", "rollout", "env-db"):
            for container in s.containers(service, stopped=True):
                logs = subprocess.run(["docker", "logs", container], capture_output=True, text=True, timeout=60)
                reconnects[f"{service}/{container[:12]}"] = (logs.stdout + logs.stderr).count('"nats_reconnected"')
                restarts[f"{service}/{container[:12]}"] = int(subprocess.run(
                    ["docker", "inspect", "-f", "{{.RestartCount}}", container],
                    capture_output=True, text=True, timeout=60).stdout)
        s.figures.update(
            final_policy_version=st["policy_version"], target_steps=st["target_steps"], trainer_exit=state,
            controller_episodes_lost=st["episodes_lost"], controller_duplicates=st["duplicate_trajectories"],
            client_reconnects=reconnects, restarts=restarts, books=books,
            streams_before={n: vars(v) for n, v in before.items()}, streams_after={n: vars(v) for n, v in after.items()})
        print(json.dumps({k: s.figures[k] for k in ("killed", "run_s", "books", "client_reconnects", "restarts")}))

        # R3 everywhere; after the kill every stream is led by a node still up, and the killed one is not current
        assert {v.replicas for v in before.values()} == {3} and len(before) == 7, before
        assert all(v.leader != node and node not in v.current for v in after.values()), after
        assert state == ["exited", "0"], f"trainer container: {state}"
        assert set(health.values()) == {"healthy"}, health
        assert set(restarts.values()) == {0}, restarts
        if victim == "trainer_node":  # the trainer did move to a live node
            assert sum(n for c, n in reconnects.items() if c.startswith("trainer/")) >= 1, reconnects
        assert st["policy_version"] == steps, st
        assert books["stored_twice"] == 0, books
        assert books["lost"] == 0, books
        assert books["env_error"] == 0, books
        assert books["published"] >= 2 * steps, books
        s.figures["ok"] = True
