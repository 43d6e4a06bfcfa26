"""The compose path, linted here (no Docker engine on this machine): the compose file against the
compose-spec JSON schema, every service command an existing entry point, every JETRL__ variable a
real config key, every COPY source of the Dockerfile present."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import yaml

from shared.config import load_config

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "compose" / "docker-compose.yml"
DOCKERFILE = REPO / "compose" / "Dockerfile"


def test_compose_file_matches_the_compose_spec() -> None:
    proc = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                           str(COMPOSE)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_compose_services_use_real_entry_points_and_config_keys() -> None:
    spec = yaml.safe_load(COMPOSE.read_text())
    services = spec["services"]
    assert {"nats", "controller", "trainer", "rollout", "env-db"} <= set(services)
    assert "-js" in services["nats"]["command"]  # JetStream on
    for name, svc in services.items():
        if name == "nats":
            continue
        command = svc["command"]
        if command[0] == "torch.distributed.run":  # torchrun starts several ranks of the module after -m
            assert "--nproc_per_node" in " ".join(command) and svc["environment"]["JETRL__TRAINER__BACKEND"] == "deepspeed"
            command = command[command.index("-m") + 1:]
        module = command[0]
        assert importlib.util.find_spec(module) is not None, f"{name}: no module {module}"
        assert (REPO / module.replace(".", "/") / "__main__.py").is_file()
        env = {k: str(v) for k, v in svc["environment"].items()}
        load_config(None, environ=env)  # raises on an unknown or mistyped JETRL__ key
        config_file = command[command.index("--config") + 1]
        assert (REPO / config_file.removeprefix("/app/")).is_file()
        assert "ports" not in svc or name == "controller"  # rollout must scale: no fixed host ports
    # max_payload of the broker (its config file: nats-server has no such flag) must admit the codec's largest
    # message; the shipped file is the generated one (python -m shared.auth)
    from shared.messages import MAX_MESSAGE_BYTES

    assert "./nats-server.conf:/etc/nats/jetrl.conf:ro" in services["nats"]["volumes"]
    conf = (REPO / "compose" / "nats-server.conf").read_text()
    assert int(re.search(r"max_payload:\s*(\d+)", conf).group(1)) >= MAX_MESSAGE_BYTES


def test_dockerfile_copies_what_exists_and_runs_as_non_root() -> None:
    text = DOCKERFILE.read_text()
    for src in re.findall(r"^COPY\s+(\S+(?:\s+\S+)*?)\s+\S+$", text, flags=re.M):
        if "--from=" in src:  # from an earlier build stage, not the context
            continue
        for path in src.split():
            assert (REPO / path).exists(), f"COPY source {path} missing"
    assert re.search(r"^USER\s+(?!root)\S+", text, flags=re.M)
    assert 'ENTRYPOINT ["python", "-m"]' in text
    assert "torch==" in text  # pinned before anything that depends on it


def test_compose_healthchecks_dashboard_port_and_scalable_services() -> None:
    """Every JetRL service has a healthcheck that runs a real module; the controller publishes the
    dashboard's port and checks its HTTP API; rollout and env-* scale with --scale (no fixed host port,
    no container_name), as docs/operations/compose.md documents."""
    spec = yaml.safe_load(COMPOSE.read_text())
    services = spec["services"]
    for name, svc in services.items():
        check = svc.get("healthcheck")
        assert check and check.get("test"), f"{name}: no healthcheck"
        if name == "nats":
            continue
        test = check["test"]
        assert test[:3] == ["CMD", "python", "-m"] and importlib.util.find_spec(test[3]) is not None, f"{name}: {test}"
    controller = services["controller"]
    port = str(controller["environment"]["JETRL__CONTROLLER__HTTP_PORT"])
    assert any(str(p).split(":")[-1] == port for p in controller["ports"])
    assert f"http://localhost:{port}/status" in controller["healthcheck"]["test"]
    scalable = ["rollout"] + [n for n in services if n.startswith("env-")]
    assert "env-db" in scalable
    for name in scalable:
        assert "ports" not in services[name] and "container_name" not in services[name], name
    guide = (REPO / "docs" / "operations" / "compose.md").read_text()
    assert "--scale rollout=" in guide and "--scale env-db=" in guide


def test_local_profile_puts_every_service_on_the_host_network_off_the_host_nats_ports() -> None:
    """compose/docker-compose.local.yml (make test-compose runs it for real): every service of the main file
    on host networking, no published ports, NATS and the status API off 4222/8222 (a host NATS may hold them)."""
    class Loader(yaml.SafeLoader):
        pass

    Loader.add_constructor("!reset", lambda loader, node: None)  # compose's reset tag
    local = yaml.load((REPO / "compose" / "docker-compose.local.yml").read_text(), Loader=Loader)
    main = yaml.safe_load(COMPOSE.read_text())
    assert set(local["services"]) == set(main["services"])
    text = (REPO / "compose" / "docker-compose.local.yml").read_text()
    for name, svc in local["services"].items():
        assert svc["network_mode"] == "host", name
        assert svc.get("ports") is None, name
    ports = dict(re.findall(r"\$\{(JETRL_LOCAL_\w*PORT):-(\d+)\}", text))
    assert set(ports) == {"JETRL_LOCAL_NATS_PORT", "JETRL_LOCAL_NATS_MONITOR_PORT", "JETRL_LOCAL_HTTP_PORT"}
    assert not set(ports.values()) & {"4222", "8222"}, ports
    # the controller's healthcheck asks the status API on the port this profile moved it to
    controller = local["services"]["controller"]
    http = controller["environment"]["JETRL__CONTROLLER__HTTP_PORT"]
    assert f"http://127.0.0.1:{http}/status" in controller["healthcheck"]["test"], controller["healthcheck"]
    for spec in (local, main):  # max_payload is a config-file setting, not a flag; users come from the conf
        nats = " ".join(spec["services"]["nats"]["command"])
        assert "-js" in nats and "--max_payload" not in nats and "-c /etc/nats/jetrl.conf" in nats, nats
    conf = (REPO / "compose" / "nats-server.conf").read_text()
    from shared.messages import MAX_MESSAGE_BYTES

    assert int(re.search(r"max_payload:\s*(\d+)", conf).group(1)) >= MAX_MESSAGE_BYTES


def test_cluster_profile_runs_three_authenticated_nats_nodes_with_r3_streams(tmp_path: Path) -> None:
    """compose/docker-compose.cluster.yml: three nats-server nodes routed into one JetStream cluster (each its
    own store, the generated per-role conf, routes that need `jetrl secrets`' cluster password), and every JetRL
    service of the main file connecting to all three with R3 streams. tests/system/test_cluster.py runs the same
    topology on loopback and kills a node."""
    from jetrl.cli import main as jetrl_main
    from shared.auth import CLUSTER_PASSWORD_ENV

    path = REPO / "compose" / "docker-compose.cluster.yml"
    proc = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                           str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cluster = yaml.safe_load(path.read_text())
    main = yaml.safe_load(COMPOSE.read_text())
    nodes = {name: svc for name, svc in cluster["services"].items() if name.startswith("nats")}
    assert set(nodes) == {"nats", "nats-2", "nats-3"}
    names, stores = set(), set()
    for name, svc in nodes.items():
        cmd = svc["command"]
        flags = dict(zip(cmd, cmd[1:], strict=False))  # each flag -> the word after it
        assert "-js" in cmd and flags["-c"] == "/etc/nats/jetrl.conf" and flags["--cluster_name"] == "jetrl", name
        assert "./nats-server.conf:/etc/nats/jetrl.conf:ro" in svc["volumes"], name  # the generated users
        assert f"route:${{{CLUSTER_PASSWORD_ENV}:?" in flags["--cluster"], name  # routes must authenticate
        routes = flags["--routes"].split(",")
        assert [r.rsplit("@", 1)[1] for r in routes] == ["nats:6222", "nats-2:6222", "nats-3:6222"], name
        assert all(r.startswith(f"nats://route:${{{CLUSTER_PASSWORD_ENV}}}@") for r in routes), name
        assert "ports" not in svc or name == "nats", name  # only the main file's node publishes 4222
        names.add(flags["--server_name"])
        stores |= {v.split(":")[0] for v in svc["volumes"] if v.endswith(":/data")}
    assert len(names) == len(stores) == 3
    jetrl_services = set(main["services"]) - {"nats"}
    assert set(cluster["services"]) - set(nodes) == jetrl_services
    for name in jetrl_services:
        overlay = cluster["services"][name]
        assert set(overlay["depends_on"]) == set(nodes), name
        env = {**{k: str(v) for k, v in main["services"][name]["environment"].items()},
               **{k: str(v) for k, v in overlay["environment"].items()}}
        cfg = load_config(None, environ=env)
        assert cfg.nats.stream_replicas == 3, name
        assert cfg.nats.url.split(",") == ["nats://nats:4222", "nats://nats-2:4222", "nats://nats-3:4222"], name
    env_file = tmp_path / ".env"
    assert jetrl_main(["secrets", "--env", str(env_file)]) == 0
    assert f"\n{CLUSTER_PASSWORD_ENV}=" in env_file.read_text()
    written = dict(line.split("=", 1) for line in env_file.read_text().splitlines() if "=" in line)
    from shared.messages import RunControl
    from shared.signing import Signer, Verifier
    signed = Signer(written["JETRL_CONTROLLER_SIGNING_KEY"], "jetrl").sign(RunControl(event="started"))
    assert Verifier(written["JETRL_CONTROLLER_PUBLIC_KEY"], "jetrl", "controller").check(signed) == signed


def test_cluster_local_profile_gives_each_node_its_own_loopback_ports() -> None:
    """compose/docker-compose.cluster-local.yml (make test-compose runs it and kills a node): the cluster file's
    three nodes on the host network, each with its own client, monitoring and route port (none of them a host
    NATS's 4222/6222/8222), routed to each other on loopback with the cluster password; every JetRL service of
    the main file connecting to the three client ports with R3 streams."""
    from shared.auth import CLUSTER_PASSWORD_ENV

    path = REPO / "compose" / "docker-compose.cluster-local.yml"
    proc = subprocess.run([sys.executable, "-m", "check_jsonschema", "--builtin-schema", "vendor.compose-spec",
                           str(path)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = path.read_text()
    overlay = yaml.safe_load(text)
    main = yaml.safe_load(COMPOSE.read_text())
    cluster = yaml.safe_load((REPO / "compose" / "docker-compose.cluster.yml").read_text())
    assert set(overlay["services"]) == set(cluster["services"])
    defaults = dict(re.findall(r"\$\{(JETRL_LOCAL_\w*PORT\w*):-(\d+)\}", text))
    assert not set(defaults.values()) & {"4222", "6222", "8222"}, defaults
    assert len(set(defaults.values())) == len(defaults) == 9, defaults  # three ports per node, all distinct

    def port(word: str) -> str:  # "nats://127.0.0.1:${JETRL_LOCAL_NATS_PORT_2:-14223}" -> "14223"
        return defaults[re.findall(r"\$\{(JETRL_LOCAL_\w+):-\d+\}", word)[-1]]

    clients, routes = [], None
    for name in ("nats", "nats-2", "nats-3"):
        svc = overlay["services"][name]
        cmd = svc["command"]
        flags = dict(zip(cmd, cmd[1:], strict=False))
        assert "-js" in cmd and flags["-c"] == "/etc/nats/jetrl.conf" and flags["-a"] == "127.0.0.1", name
        assert flags["--server_name"] == dict(zip(cluster["services"][name]["command"],
                                                   cluster["services"][name]["command"][1:], strict=False))["--server_name"]
        assert f"route:${{{CLUSTER_PASSWORD_ENV}" in flags["--cluster"] and "@127.0.0.1:" in flags["--cluster"], name
        assert routes in (None, flags["--routes"]), name  # every node dials the same three routes
        routes = flags["--routes"]
        own_route = port(flags["--cluster"])
        assert [port(r) for r in routes.split(",")].count(own_route) == 1, name
        assert all(r.startswith(f"nats://route:${{{CLUSTER_PASSWORD_ENV}") for r in routes.split(",")), name
        assert port(flags["-m"]) in " ".join(svc["healthcheck"]["test"]), name  # its own /healthz
        assert "js-enabled-only" not in " ".join(svc["healthcheck"]["test"]), name  # healthy = current in the cluster
        assert name == "nats" or svc["network_mode"] == "host", name  # nats: host network from the local file
        clients.append(port(flags["-p"]))
    for name in set(main["services"]) - {"nats"}:
        env = {**{k: str(v) for k, v in main["services"][name]["environment"].items()},
               **{k: str(v) for k, v in overlay["services"][name]["environment"].items()}}
        cfg = load_config(None, environ=env)
        assert cfg.nats.stream_replicas == 3, name
        assert [port(u) for u in cfg.nats.url.split(",")] == clients, name


def test_secrets_make_a_user_per_replica_of_each_scalable_service_that_the_server_takes(tmp_path: Path) -> None:
    """`jetrl secrets` writes compose/.env and, beside it, the users file compose/nats-server.conf includes: every
    role's user and, for each scalable service of the compose file (rollout, env-<task>), one user per replica
    (`--replicas SERVICE=N`, else the default), both 0600. nats-server takes the pair (`-t`); an unknown
    service is refused; an existing env file is kept."""
    import shutil
    import stat

    from jetrl.cli import main as jetrl_main
    from jetrl.compose_secrets import DEFAULT_REPLICA_USERS, USERS_FILE_ENV, replica_passwords
    from shared.natsd import find_nats_server

    env_file = tmp_path / ".env"
    assert jetrl_main(["secrets", "--env", str(env_file), "--replicas", "rollout=3", "--replicas", "env-db=2"]) == 0
    users_file = tmp_path / "nats-users.conf"
    assert stat.S_IMODE(env_file.stat().st_mode) == stat.S_IMODE(users_file.stat().st_mode) == 0o600
    secrets = dict(line.split("=", 1) for line in env_file.read_text().splitlines() if "=" in line)
    assert secrets[USERS_FILE_ENV] == str(users_file.resolve())  # not beside the compose files: absolute
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    scalable = [name for name in services if name == "rollout" or name.startswith("env-")]
    counts = {name: len(replica_passwords(secrets, name)) for name in scalable}
    assert counts == {name: {"rollout": 3, "env-db": 2}.get(name, DEFAULT_REPLICA_USERS) for name in scalable}
    users = users_file.read_text()
    for name in scalable:
        for user, password in replica_passwords(secrets, name).items():
            assert f'{{user: "{user}", password: "{password}"' in users
    assert 'user: "rollout-3"' not in users and 'user: "observer"' in users
    etc = tmp_path / "etc"
    etc.mkdir()
    shutil.copy(REPO / "compose" / "nats-server.conf", etc / "jetrl.conf")
    shutil.copy(users_file, etc / "users.conf")
    proc = subprocess.run([find_nats_server(), "-c", str(etc / "jetrl.conf"), "-t"], capture_output=True, text=True)
    assert proc.returncode == 0 and "is valid" in proc.stdout + proc.stderr, proc.stdout + proc.stderr

    before = env_file.read_text()
    assert jetrl_main(["secrets", "--env", str(env_file)]) == 0 and env_file.read_text() == before
    assert jetrl_main(["secrets", "--env", str(tmp_path / "other" / ".env"), "--replicas", "trainer=2"]) == 2
    assert not (tmp_path / "other").exists()  # refused before anything is written
