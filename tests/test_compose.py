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

REPO = Path(__file__).resolve().parent.parent
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
        module = svc["command"][0]
        assert importlib.util.find_spec(module) is not None, f"{name}: no module {module}"
        assert (REPO / module.replace(".", "/") / "__main__.py").is_file()
        env = {k: str(v) for k, v in svc["environment"].items()}
        load_config(None, environ=env)  # raises on an unknown or mistyped JETRL__ key
        config_file = svc["command"][svc["command"].index("--config") + 1]
        assert (REPO / config_file.removeprefix("/app/")).is_file()
        assert "ports" not in svc or name == "controller"  # rollout must scale: no fixed host ports
    # max_payload of the broker must admit the codec's largest message
    from shared.messages import MAX_MESSAGE_BYTES

    payload = int(services["nats"]["command"][services["nats"]["command"].index("--max_payload") + 1])
    assert payload >= MAX_MESSAGE_BYTES


def test_dockerfile_copies_what_exists_and_runs_as_non_root() -> None:
    text = DOCKERFILE.read_text()
    for src in re.findall(r"^COPY\s+(\S+(?:\s+\S+)*?)\s+\S+$", text, flags=re.M):
        for path in src.split():
            assert (REPO / path).exists(), f"COPY source {path} missing"
    assert re.search(r"^USER\s+(?!root)\S+", text, flags=re.M)
    assert 'ENTRYPOINT ["python", "-m"]' in text
    assert "torch==" in text  # pinned before anything that depends on it


def test_compose_healthchecks_dashboard_port_and_scalable_services() -> None:
    """Every JetRL service has a healthcheck that runs a real module; the controller publishes the
    dashboard's port and checks its HTTP API; rollout and env-* scale with --scale (no fixed host port,
    no container_name), as README documents."""
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
    readme = (REPO / "README.md").read_text()
    assert "--scale rollout=" in readme and "--scale env-db=" in readme
