"""Authentication and authorisation (shared/auth.py) against a real nats-server with per-role users:
who may publish weights, jobs and trajectories, who may only read; the controller ends a run only on
the trainer's own message; the status API's bearer token; and a whole `jetrl up` run (auth on by
default) that a forged weights announcement neither ends nor reaches."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client

from services.controller.controller import Controller
from shared.auth import ROLES, generate_passwords, inbox_prefix, role_permissions, run_users, server_authorization
from shared.bus import connect, declare_topology
from shared.config import JetRLConfig, NatsConfig, save_config
from shared.consumers import declare_durables
from shared.messages import MetricsReport, TrainingFinished, Trajectory, TurnInfo, WeightsAnnouncement, decode, encode
from shared.natsd import EmbeddedNats
from shared.objectread import read_object
from shared.subjects import Subjects

REPO = Path(__file__).resolve().parents[2]
PREFIX = "tauth" + uuid.uuid4().hex[:6]
HUGE = 10**9


# ---------------------------------------------------------------------------- an authenticated server
@pytest.fixture(scope="module")
def auth_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path, Path]]:
    """A nats-server with one user per role, for the namespace PREFIX: (url, auth dir, server log)."""
    root = tmp_path_factory.mktemp("authnats")
    auth_dir = root / "auth"
    users = run_users(["rollout-0", "rollout-1"])  # every role's user, and two rollout replicas' own (jetrl up)
    server = EmbeddedNats(root / "nats", authorization=server_authorization(
        Subjects(PREFIX), generate_passwords(auth_dir, list(users)), users))
    url = server.start()
    yield url, auth_dir, server.log_file
    server.stop()


def role_cfg(auth_server: tuple[str, Path, Path]) -> NatsConfig:
    url, auth_dir, _ = auth_server
    return NatsConfig(url=url, prefix=PREFIX, auth_dir=str(auth_dir), connect_timeout_s=3.0)


class Errors:
    """The asynchronous errors the server sent one client (permission violations arrive this way)."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    async def on_error(self, exc: Exception) -> None:
        self.seen.append(str(exc))

    def violations(self) -> list[str]:
        return [e for e in self.seen if "permissions violation" in e.lower()]

    def refused(self) -> set[str]:
        """The subjects refused (nats-py lower-cases the server's message)."""
        return {m for e in self.violations() for m in re.findall(r'to "([^"]+)"', e)}


async def as_role(auth_server: tuple[str, Path, Path], role: str, errors: Errors | None = None) -> Client:
    """A bare client logged in as ``role`` or one replica's user (no reconnects: a refusal is an answer here)."""
    url, auth_dir, _ = auth_server
    return await nats.connect(url, user=role, password=(auth_dir / f"{role}.password").read_text().strip(),
                              inbox_prefix=inbox_prefix(role), allow_reconnect=False, connect_timeout=3,
                              error_cb=(errors or Errors()).on_error, name=f"pytest-{role}")


@pytest.fixture
async def admin(auth_server: tuple[str, Path, Path]) -> AsyncIterator[Client]:
    """The admin declares the topology (what `jetrl up` does before any service starts)."""
    cfg = role_cfg(auth_server)
    nc = await connect(cfg, "pytest-admin", role="admin")
    await declare_topology(nc.jetstream(), Subjects(PREFIX), cfg, role="admin")
    run = JetRLConfig()
    run.nats = cfg
    await declare_durables(nc.jetstream(), Subjects(PREFIX), run)  # no service role may create them
    yield nc
    js = nc.jetstream()
    for stream in await js.streams_info():  # every test starts from empty streams and buckets
        if PREFIX in stream.config.name or stream.config.name.startswith(PREFIX.upper()):
            await js.delete_stream(stream.config.name)
    await nc.close()


def note(version: int, name: str = "policy-forged.safetensors") -> WeightsAnnouncement:
    return WeightsAnnouncement(version=version, object_name=name, digest="0" * 64, size=4, dtype="float32")


def trajectory(episode_id: str = "e1") -> Trajectory:
    return Trajectory(episode_id=episode_id, group_id="g1", task="db", task_id="t1", split="train", group_size=1,
                      tokens=[1, 2, 3], logprobs=[0.0, -0.5, -0.1], loss_mask=[0, 1, 1], prompt_len=1,
                      turns=[TurnInfo(start=1, end=3, policy_version=0, engine_id="e")], reward=1.0,
                      status="completed", replica_id="r")


async def stream_count(js: nats.js.JetStreamContext, stream: str) -> int:
    return int((await js.stream_info(stream)).state.messages)


# ---------------------------------------------------------------------------- the permission table
def test_every_role_is_defined_from_the_contract() -> None:
    s = Subjects("jetrl")
    perms = {role: role_permissions(s, role) for role in ROLES}
    publishers = {role: set(p.publish) for role, p in perms.items() if role != "admin"}
    assert [r for r, pub in publishers.items() if s.weights_published in pub] == ["trainer"]
    assert [r for r, pub in publishers.items() if s.training_finished in pub] == ["trainer"]
    assert [r for r, pub in publishers.items() if f"$O.{s.weights_bucket}.>" in pub] == ["trainer"]
    assert [r for r, pub in publishers.items() if f"$KV.{s.policy_kv}.>" in pub] == ["trainer"]
    assert [r for r, pub in publishers.items() if s.jobs(">") in pub] == ["controller"]
    assert [r for r, pub in publishers.items() if s.traj(">") in pub] == ["rollout"]
    assert not any(p.startswith(s.prefix + ".") for p in publishers["observer"])  # reads only
    assert not any("STREAM.CREATE" in p or "STREAM.UPDATE" in p or "STREAM.DELETE" in p or p in (">", "$JS.API.>")
                   for pub in publishers.values() for p in pub)  # topology is the admin's
    text = server_authorization(s)
    assert "no_auth_user" not in text and all(f"$JETRL_NATS_{r.upper()}_PASSWORD" in text for r in ROLES)


def test_credentials_come_from_the_config_files_or_the_environment(tmp_path: Path) -> None:
    from shared.auth import AuthError, credentials, manages_topology
    from shared.config import load_config

    passwords = generate_passwords(tmp_path / "auth")
    assert oct((tmp_path / "auth" / "trainer.password").stat().st_mode & 0o777) == "0o600"
    assert generate_passwords(tmp_path / "auth") == passwords  # a resumed run keeps its users
    cfg = NatsConfig(auth_dir=str(tmp_path / "auth"))
    trainer = credentials(cfg, "trainer")
    assert (trainer.user, trainer.password, trainer.inbox_prefix) == ("trainer", passwords["trainer"], "_INBOX_trainer")
    assert not manages_topology(cfg, "trainer") and manages_topology(cfg, "admin")
    assert credentials(NatsConfig(), "trainer").user == "" and manages_topology(NatsConfig(), "trainer")  # open
    (tmp_path / "secret").write_text("from-a-file\n")
    env = {"JETRL__NATS__USER": "rollout", "JETRL__NATS__PASSWORD_FILE": str(tmp_path / "secret")}
    given = credentials(load_config(None, environ=env).nats, "rollout")
    assert (given.user, given.password, given.inbox_prefix) == ("rollout", "from-a-file", "_INBOX_rollout")
    env = {"JETRL__NATS__USER": "env", "JETRL__NATS__PASSWORD": "from-the-env"}
    assert credentials(load_config(None, environ=env).nats, "env").password == "from-the-env"
    with pytest.raises(AuthError, match="nats.password_file: cannot read"):
        credentials(NatsConfig(user="env", password_file=str(tmp_path / "missing")), "env")
    with pytest.raises(AuthError, match="unknown role"):
        credentials(cfg, "intruder")


def test_the_shipped_compose_config_is_the_generated_one() -> None:
    """compose/nats-server.conf is written by shared.auth (python -m shared.auth > ...): one definition; its users
    come from the file `jetrl secrets` writes (server_authorization, the same definition)."""
    from shared.auth import COMPOSE_USERS_FILE, compose_server_conf

    shipped = (REPO / "compose" / "nats-server.conf").read_text()
    assert shipped == compose_server_conf() and f"\ninclude ./{COMPOSE_USERS_FILE}\n" in shipped


ROLE_OF_SERVICE = {"topology": "admin", "controller": "controller", "trainer": "trainer", "trainer-ranks": "trainer"}


def test_compose_connects_every_service_as_its_role_or_its_own_replica_user_and_exposes_nothing_open() -> None:
    """The trainer, the controller and the topology connect as their role; each scalable service (rollout,
    env-<task>) gets its replica users' passwords (`jetrl secrets`) and no role password: each replica claims
    its own user (tests/shared/test_auth.py's claim test, make test-compose for real)."""
    import yaml

    services = yaml.safe_load((REPO / "compose" / "docker-compose.yml").read_text())["services"]
    nats_svc = services.pop("nats")
    assert nats_svc["command"][:2] == ["-c", "/etc/nats/jetrl.conf"]
    assert "./nats-server.conf:/etc/nats/jetrl.conf:ro" in nats_svc["volumes"]
    assert any(v.startswith("${JETRL_NATS_USERS_FILE:?") and v.endswith("}:/etc/nats/users.conf:ro")
               for v in nats_svc["volumes"]), nats_svc["volumes"]
    assert nats_svc["ports"] == ["4222:4222"]  # authenticated; monitoring (8222) stays inside
    assert not any("PASSWORD" in k for k in nats_svc.get("environment", {}))  # passwords in the users file only
    for name, svc in services.items():
        env = svc["environment"]
        if name == "rollout" or name.startswith("env-"):  # scales: one user per replica
            assert env["JETRL__NATS__USER"] == name, name
            var = f"JETRL_NATS_{name.upper().replace('-', '_')}_REPLICA_PASSWORDS"
            assert env["JETRL__NATS__REPLICA_PASSWORDS"].startswith(f"${{{var}:?"), name
            assert "JETRL__NATS__PASSWORD" not in env, name
            role = "rollout" if name == "rollout" else "env"
        else:
            assert env["JETRL__NATS__USER"] == ROLE_OF_SERVICE[name], name
            role = env["JETRL__NATS__USER"]
            assert env["JETRL__NATS__PASSWORD"].startswith(f"${{JETRL_NATS_{role.upper()}_PASSWORD:?"), name
        for signer in ("TRAINER", "CONTROLLER"):  # every role checks the signers' control messages
            assert env[f"JETRL__NATS__{signer}_PUBLIC_KEY"].startswith(f"${{JETRL_{signer}_PUBLIC_KEY:?"), name
        signs = role if role in ("trainer", "controller") else None  # and only a signer holds its private key
        assert env.get("JETRL__NATS__SIGNING_KEY", "").startswith(f"${{JETRL_{(signs or 'none').upper()}_SIGNING_KEY:?") \
            == bool(signs), name
    assert services["controller"]["ports"] == ["127.0.0.1:8000:8000"]
    assert services["controller"]["environment"]["JETRL__CONTROLLER__HTTP_TOKEN"].startswith("${JETRL_CONTROLLER_TOKEN:?")


def test_the_compose_server_config_runs_and_lets_in_only_its_users(tmp_path: Path) -> None:
    """The shipped config on a real nats-server, as compose mounts it: it refuses to start without the users file
    beside it, and with the one `jetrl secrets` wrote admits each role and each replica user by its own password,
    and nobody without one or with another's."""
    import shutil

    from jetrl.cli import main as jetrl_main
    from jetrl.compose_secrets import replica_passwords
    from shared.auth import password_env_var
    from shared.natsd import find_nats_server

    etc = tmp_path / "etc"
    etc.mkdir()
    shutil.copy(REPO / "compose" / "nats-server.conf", etc / "jetrl.conf")
    binary, conf = find_nats_server(), str(etc / "jetrl.conf")
    cmd = [binary, "-c", conf, "-js", "-sd", str(tmp_path / "js"), "-a", "127.0.0.1", "-p", "-1",
           "--ports_file_dir", str(tmp_path)]
    bare = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    assert bare.returncode != 0 and "users.conf" in bare.stderr + bare.stdout
    assert jetrl_main(["secrets", "--env", str(tmp_path / ".env"), "--replicas", "rollout=3"]) == 0
    shutil.copy(tmp_path / "nats-users.conf", etc / "users.conf")  # compose mounts it there
    secrets = dict(line.split("=", 1) for line in (tmp_path / ".env").read_text().splitlines() if "=" in line)
    passwords = {role: secrets[password_env_var(role)] for role in ROLES}
    replicas = replica_passwords(secrets, "rollout") | replica_passwords(secrets, "env-db")
    assert sorted(replica_passwords(secrets, "rollout")) == ["rollout-0", "rollout-1", "rollout-2"]
    assert len(replica_passwords(secrets, "env-db")) == 8  # the default for a service --replicas does not name
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while not list(tmp_path.glob("*.ports")) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.1)
        url = json.loads(next(tmp_path.glob("*.ports")).read_text())["nats"][0]

        async def check() -> None:
            for role, pw in (passwords | replicas).items():
                client = await nats.connect(url, user=role, password=pw, allow_reconnect=False, connect_timeout=3)
                await client.close()
            for kwargs in ({}, {"user": "trainer", "password": passwords["rollout"]},
                           {"user": "rollout-1", "password": replicas["rollout-0"]},
                           {"user": "rollout-3", "password": replicas["rollout-0"]}):  # no fourth replica user
                with pytest.raises(nats.errors.Error, match="Authorization Violation"):
                    await nats.connect(url, allow_reconnect=False, connect_timeout=3, **kwargs)

        asyncio.run(check())
    finally:
        proc.terminate()
        proc.wait(timeout=20)


# ---------------------------------------------------------------------------- against the server
async def test_a_client_without_credentials_can_publish_neither_weights_nor_jobs(
        auth_server: tuple[str, Path, Path], admin: Client) -> None:
    s, js = Subjects(PREFIX), admin.jetstream()
    announcements = await admin.subscribe(s.weights_published)
    for kwargs in ({}, {"user": "trainer", "password": "not-the-password"}, {"user": "controller", "password": ""}):
        with pytest.raises(nats.errors.Error, match="Authorization Violation"):
            await nats.connect(auth_server[0], allow_reconnect=False, connect_timeout=3, **kwargs)
    with pytest.raises(nats.errors.TimeoutError):
        await announcements.next_msg(timeout=0.5)
    assert await stream_count(js, s.jobs_stream) == 0


async def test_a_rollout_cannot_publish_weights_jobs_or_write_the_weights(
        auth_server: tuple[str, Path, Path], admin: Client) -> None:
    s, js = Subjects(PREFIX), admin.jetstream()
    announcements = await admin.subscribe(s.weights_published)
    errors = Errors()
    rollout = await as_role(auth_server, "rollout", errors)
    rjs = rollout.jetstream(timeout=1.0)
    await rollout.publish(s.weights_published, encode(note(HUGE)))
    await rollout.flush()
    with pytest.raises(nats.errors.TimeoutError):
        await announcements.next_msg(timeout=0.5)
    with pytest.raises(nats.errors.TimeoutError):
        await rjs.publish(s.jobs("db"), b"forged job")
    with pytest.raises(nats.errors.TimeoutError):
        await (await rjs.key_value(s.policy_kv)).put(s.policy_version_key, encode(note(HUGE)))
    with pytest.raises(nats.errors.TimeoutError):
        await (await rjs.object_store(s.weights_bucket)).put("policy-forged.safetensors", b"\0" * 1024)
    await asyncio.sleep(0.2)
    assert {s.weights_published, s.jobs("db"), f"$kv.{s.policy_kv}.{s.policy_version_key}"} <= errors.refused()
    assert await stream_count(js, s.jobs_stream) == 0
    assert await stream_count(js, f"KV_{s.policy_kv}") == 0
    assert await stream_count(js, Subjects.object_stream(s.weights_bucket)) == 0

    # what a rollout may do: store a trajectory; read the weights the trainer (and only it) wrote
    refusals = len(errors.violations())
    await rjs.publish(s.traj("db"), encode(trajectory()), headers={"Nats-Msg-Id": "e1"})
    trainer = await as_role(auth_server, "trainer")
    tjs = trainer.jetstream(timeout=5.0)
    await (await tjs.object_store(s.weights_bucket)).put(s.weights_object(1), b"weights" * 1000)
    await (await tjs.key_value(s.policy_kv)).put(s.policy_version_key, encode(note(1, s.weights_object(1))))
    await trainer.publish(s.weights_published, encode(note(1, s.weights_object(1))))
    assert decode((await announcements.next_msg(timeout=2)).data, WeightsAnnouncement).version == 1
    assert await read_object(rjs, s.weights_bucket, s.weights_object(1)) == b"weights" * 1000
    entry = await (await rjs.key_value(s.policy_kv)).get(s.policy_version_key)
    assert decode(entry.value, WeightsAnnouncement).version == 1
    await (await tjs.object_store(s.weights_bucket)).delete(s.weights_object(1))  # pruning old versions
    await asyncio.sleep(0.2)
    assert len(errors.violations()) == refusals  # nothing refused on the way a rollout works
    await rollout.close()
    await trainer.close()


async def test_an_observer_reads_the_trajectory_stream_but_cannot_publish_or_steal(
        auth_server: tuple[str, Path, Path], admin: Client) -> None:
    s, js = Subjects(PREFIX), admin.jetstream()
    trainer = await as_role(auth_server, "trainer")  # its durable consumer exists (the admin's), as in a run
    await trainer.jetstream().pull_subscribe_bind(durable=s.trainer_consumer, stream=s.traj_stream)
    errors = Errors()
    observer = await as_role(auth_server, "observer", errors)
    live = await observer.subscribe(s.traj(">"))
    rollout = await as_role(auth_server, "rollout")
    await rollout.jetstream().publish(s.traj("db"), encode(trajectory("e7")), headers={"Nats-Msg-Id": "e7"})

    assert decode((await live.next_msg(timeout=2)).data, Trajectory).episode_id == "e7"  # live
    ojs = observer.jetstream(timeout=1.0)
    stored = await ojs.pull_subscribe(s.traj(">"), stream=s.traj_stream)  # an ephemeral reader it names
    assert decode((await stored.fetch(1, timeout=2))[0].data, Trajectory).episode_id == "e7"
    await stored.unsubscribe()

    with pytest.raises(nats.errors.TimeoutError):
        await ojs.publish(s.traj("db"), encode(trajectory("forged")), headers={"Nats-Msg-Id": "forged"})
    await observer.publish(s.weights_published, encode(note(HUGE)))
    steal = await ojs.pull_subscribe(s.traj(">"), durable=s.trainer_consumer, stream=s.traj_stream)
    with pytest.raises(nats.errors.TimeoutError):
        await steal.fetch(1, timeout=1.0)  # the trainer's trajectories stay the trainer's
    await asyncio.sleep(0.2)
    assert await stream_count(js, s.traj_stream) == 1
    info = await js.consumer_info(s.traj_stream, s.trainer_consumer)
    assert info.num_pending == 1 and info.num_ack_pending == 0
    assert {s.traj("db"), s.weights_published, f"$js.api.consumer.msg.next.{s.traj_stream.lower()}.trainer"} <= \
        errors.refused()
    for client in (trainer, observer, rollout):
        await client.close()


async def test_replicas_of_one_service_claim_distinct_replica_users(
        auth_server: tuple[str, Path, Path], admin: Client) -> None:
    """Compose's `--scale rollout=N` gives every container the same settings: the service's replica users'
    passwords (nats.replica_passwords). Replicas starting at once each claim their own user (its registry key,
    created only where none is live); with every user held a further one is refused; a user whose key is gone
    (its replica dead, its heartbeats expired) is claimed again. A client that only reads (a healthcheck)
    connects as the first."""
    from shared.auth import credentials
    from shared.bus import claim_replica_user

    url, auth_dir, _ = auth_server
    s = Subjects(PREFIX)
    passwords = [(auth_dir / f"rollout-{i}.password").read_text().strip() for i in (0, 1)]

    def scaled() -> NatsConfig:  # what each container's environment says
        return NatsConfig(url=url, prefix=PREFIX, user="rollout", replica_passwords=list(passwords), connect_timeout_s=3)

    assert credentials(scaled(), "rollout").user == "rollout-0"  # unclaimed: the first, for reading
    configs = [scaled(), scaled()]
    claimed = await asyncio.gather(*(claim_replica_user(cfg, "rollout", s) for cfg in configs))
    assert sorted(claimed) == ["rollout-0", "rollout-1"]
    for cfg, user in zip(configs, claimed, strict=True):  # each config is now that replica's own
        assert (cfg.user, cfg.password, cfg.replica_passwords) == (user, passwords[int(user[-1])], [])
        assert credentials(cfg, "rollout").inbox_prefix == f"_INBOX_{user}"
    with pytest.raises(RuntimeError, match="no replica user free"):
        await claim_replica_user(scaled(), "rollout", s, wait_s=0.5)
    registry = await admin.jetstream().key_value(s.registry_kv)
    await registry.delete(Subjects.registry_key("rollout", "rollout-1"))  # its replica gone
    again = scaled()
    assert await claim_replica_user(again, "rollout", s, wait_s=0.5) == "rollout-1"
    nc = await connect(again, "rollout-1")  # and it connects as that user
    await nc.jetstream().publish(s.registry_entries("rollout", "rollout-1"), b"{}")
    await nc.close()


# ---------------------------------------------------------------------------- the controller
async def test_only_the_trainers_own_message_ends_the_plan(config: JetRLConfig, nc: Client, subjects: Subjects) -> None:
    """Even on an open server: a weights announcement or a metrics step far beyond trainer.steps is a
    figure, not the end of the run; TrainingFinished is."""
    config.trainer.steps = 5
    controller = Controller(nc, nc.jetstream(), subjects, config, "controller-test")
    await controller.follow_metrics_and_weights()
    await nc.publish(subjects.weights_published, encode(note(HUGE)))
    await nc.publish(subjects.metrics("trainer"), encode(MetricsReport(role="trainer", replica_id="forged",
                                                                       step=HUGE, values={})))
    await nc.publish(subjects.training_finished, b"\x81\xa4kind\xa3bad")  # malformed: logged, ignored
    await nc.flush()
    deadline = time.monotonic() + 5
    while controller.policy_version != HUGE and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert controller.policy_version == HUGE and controller.trainer_step == HUGE
    assert not controller.training_done
    await nc.publish(subjects.training_finished, encode(TrainingFinished(step=5, policy_version=5,
                                                                         replica_id="trainer-x")))
    while not controller.training_done and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert controller.training_done and controller.trainer_finished.step == 5


def test_status_api_binds_to_localhost_and_enforces_its_bearer_token(config: JetRLConfig, tmp_path: Path) -> None:
    run_dir = Path(config.run.dir)
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    config.controller.http_token_file = str(token_file)
    cfg_path = tmp_path / "controller.toml"
    save_config(config, cfg_path)
    log = open(tmp_path / "controller.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "services.controller", "--config", str(cfg_path)], cwd=REPO,
                            stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while not (run_dir / "controller.url").is_file() and time.monotonic() < deadline:
            time.sleep(0.2)
        url = (run_dir / "controller.url").read_text().strip()
        assert url.startswith("http://127.0.0.1:")

        def get(headers: dict[str, str], path: str = "/status") -> int:
            for _ in range(100):  # the server comes up just after the url is written
                try:
                    req = urllib.request.Request(f"{url}{path}", headers=headers)
                    with urllib.request.urlopen(req, timeout=5) as resp:
                        resp.read()
                        return resp.status
                except urllib.error.HTTPError as exc:
                    return exc.code
                except OSError:
                    time.sleep(0.2)
            raise AssertionError((tmp_path / "controller.log").read_text())

        assert get({}) == 401
        assert get({"Authorization": "Bearer wrong"}) == 401
        assert get({"Authorization": "Bearer s3cret-token"}) == 200
        # every endpoint wants the token, /metrics too (401, not a 500); a browser passes it as ?token=
        # (EventSource cannot send headers); only the page's script and style are open (no data)
        for path in ("/metrics", "/dashboard", "/", "/api/dashboard", "/api/episodes", "/api/episodes/x"):
            assert get({}, path) == 401, path
        assert get({"Authorization": "Bearer s3cret-token"}, "/metrics") == 200
        assert get({}, "/static/dashboard.js") == 200 and get({}, "/dashboard?token=s3cret-token") == 200
        assert get({}, "/api/episodes?token=wrong") == 401 and get({}, "/api/dashboard?token=s3cret-token") == 200
        cli = subprocess.run([sys.executable, "-m", "jetrl.cli", "status", "--run-dir", str(run_dir)], cwd=REPO,
                             capture_output=True, text=True, timeout=60,
                             env=dict(os.environ, JETRL__CONTROLLER__HTTP_TOKEN_FILE=str(token_file)))
        assert cli.returncode == 0 and '"state"' in cli.stdout, cli.stderr
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()


# ---------------------------------------------------------------------------- a whole run
@pytest.mark.slow
def test_jetrl_up_runs_with_auth_and_a_forged_announcement_neither_ends_nor_reaches_it(tmp_path: Path) -> None:
    """`jetrl up` with its embedded server (auth on by default): every service works within its
    permissions (not one violation in the server's log but the forger's), `jetrl watch` reads as an
    observer, and a rollout-credentialed forger's announcement of version 10^9 is refused."""
    cfg = JetRLConfig()
    cfg.run.dir = str(tmp_path / "run")
    cfg.run.tasks = {"db": 1.0}
    cfg.controller.group_size = 2
    cfg.controller.max_inflight = 4
    cfg.rollout.max_new_tokens = 12
    cfg.trainer.kl_coef = 0.01  # all-zero rewards still move the weights: a real step, a real new version
    cfg.rollout.concurrency = 2
    cfg.trainer.steps = 2
    cfg.trainer.min_groups = 1
    cfg.env.num_train_tasks = 8
    cfg.env.num_test_tasks = 4
    cfg_path = tmp_path / "up.toml"
    save_config(cfg, cfg_path)
    run_dir = Path(cfg.run.dir)
    up = subprocess.Popen([sys.executable, "-m", "jetrl.cli", "up", "--config", str(cfg_path), "--rollouts", "1"],
                          cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watch = None
    try:
        deadline = time.monotonic() + 60
        while not (run_dir / "nats.url").is_file() and time.monotonic() < deadline:
            time.sleep(0.2)
        url = (run_dir / "nats.url").read_text().split()[0]
        auth = (url, run_dir / "nats" / "auth", run_dir / "nats" / "nats-server.log")
        watch = subprocess.Popen([sys.executable, "-m", "jetrl.cli", "watch", "--run-dir", str(run_dir),
                                  "--seconds", "240"], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                 text=True)

        async def forge() -> list[str]:
            with pytest.raises(nats.errors.Error, match="Authorization Violation"):
                await nats.connect(url, allow_reconnect=False, connect_timeout=3)
            errors = Errors()
            forger = await nats.connect(url, user="rollout", name="forger", allow_reconnect=False,
                                        password=(auth[1] / "rollout.password").read_text().strip(),
                                        inbox_prefix=inbox_prefix("rollout"), error_cb=errors.on_error)
            s = Subjects(cfg.nats.prefix)
            deadline = time.monotonic() + 400
            while up.poll() is None and time.monotonic() < deadline:  # all through the run
                try:
                    await forger.publish(s.weights_published, encode(note(HUGE)))
                    await forger.publish(s.training_finished, encode(TrainingFinished(
                        step=HUGE, policy_version=HUGE, replica_id="forger")))
                except nats.errors.ConnectionClosedError:  # the run is over: jetrl up stopped its server
                    break
                await asyncio.sleep(1.0)
            await forger.close()
            return errors.violations()

        refused = asyncio.run(forge())
        out, _ = up.communicate(timeout=400)
    finally:
        for proc in (up, watch):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
    logs = {p.name: p.read_text() for p in sorted((run_dir / "logs").glob("*.log"))}
    assert up.returncode == 0, out + "\n".join(f"--- {n}\n{t[-2000:]}" for n, t in logs.items())
    assert "training finished: 2 steps" in out
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert len(refused) >= 2
    assert f"policy_version={HUGE}" not in logs["rollout-0.log"] and "weights_loaded" in logs["rollout-0.log"]
    finished = [line for line in logs["controller.log"].splitlines() if "event='training_finished'" in line]
    assert len(finished) == 1 and "step=2" in finished[0] and "trainer='trainer-" in finished[0]
    violations = [line for line in auth[2].read_text().splitlines() if "Violation" in line]
    assert violations and all(":forger\"" in line for line in violations), violations[:5]
    watched = watch.stdout.read()
    assert "[trajectory] db" in watched, watched[-2000:]
