"""``jetrl secrets``: random NATS passwords (one user per role and one per replica of each scalable service), a
status API token and signing keys, as compose's env file and its nats-server's users file."""

from __future__ import annotations

import argparse
import os
import re
from dataclasses import dataclass
from pathlib import Path

from jetrl.errors import CliError
from shared.auth import (
    CLUSTER_PASSWORD_ENV,
    ROLES,
    env_password,
    password_env_var,
    replica_users,
    run_users,
    server_authorization,
)
from shared.signing import SIGNERS, new_key_pair
from shared.subjects import Subjects

DEFAULT_REPLICA_USERS = 8
"""Replica users per scalable service when neither ``--replicas`` nor the compose file's ``deploy.replicas`` says
more: room for ``--scale rollout=8``, or fewer replicas and restarts (a restarted container takes a free user
while its old registry key has not yet expired)."""

SHIPPED_SCALABLE = ("rollout", "env-db", "env-kg", "env-webshop", "env-alfworld", "env-os")
"""compose/docker-compose.yml's scalable services, for when no compose file is beside the env file."""

USERS_FILE_ENV = "JETRL_NATS_USERS_FILE"
"""compose/.env's path of the users file compose mounts into every nats-server (compose/nats-users.conf)."""


def replica_passwords_env_var(service: str) -> str:
    """The variable of compose/.env holding a scalable service's replica passwords, comma-separated in user order
    (``rollout``: ``JETRL_NATS_ROLLOUT_REPLICA_PASSWORDS``); compose passes it as ``JETRL__NATS__REPLICA_PASSWORDS``."""
    return f"JETRL_NATS_{service.upper().replace('-', '_')}_REPLICA_PASSWORDS"


def replica_passwords(secrets: dict[str, str], service: str) -> dict[str, str]:
    """Replica user -> password, read back from a `jetrl secrets` env file's values."""
    passwords = secrets[replica_passwords_env_var(service)].split(",")
    return dict(zip(replica_users(service, len(passwords)), passwords, strict=True))


@dataclass(frozen=True)
class ScalableService:
    name: str  # rollout, env-<task>
    replicas: int  # replica users to make


def scalable_services(compose_file: Path, asked: dict[str, int]) -> list[ScalableService]:
    """Every service of ``compose_file`` that scales (rollout and env-<task>: each replica its own user), with
    ``asked``'s count, else ``max(DEFAULT_REPLICA_USERS, deploy.replicas)``; without the file, the shipped ones."""
    scales: dict[str, int] = {}
    if compose_file.is_file():
        text = compose_file.read_text()
        try:
            import yaml
        except ImportError:  # the test extra has it; without, the names alone
            scales = {name: 1 for name in re.findall(r"^  (rollout|env-[a-z0-9-]+):\s*$", text, flags=re.M)}
        else:
            services = yaml.safe_load(text).get("services", {})
            scales = {name: int(((svc or {}).get("deploy") or {}).get("replicas", 1))
                      for name, svc in services.items() if name == "rollout" or name.startswith("env-")}
    else:
        scales = dict.fromkeys(SHIPPED_SCALABLE, 1)
    unknown = set(asked) - set(scales)
    if unknown:
        raise CliError(f"--replicas {', '.join(sorted(unknown))}: not a scalable service of {compose_file} "
                        f"(those are {', '.join(sorted(scales))})")
    return [ScalableService(name, asked.get(name, max(DEFAULT_REPLICA_USERS, scale))) for name, scale in scales.items()]


def parse_replicas(values: list[str]) -> dict[str, int]:
    out = {}
    for value in values:
        name, sep, count = value.partition("=")
        if not sep or not count.isdigit() or int(count) < 1:
            raise CliError(f"--replicas {value!r}: SERVICE=N with N >= 1 (e.g. rollout=16)")
        out[name.strip()] = int(count)
    return out


def users_file_reference(users_file: Path, compose_dir: Path) -> str:
    """The users file as compose/.env names it: relative to the compose files where it lies beside them (a
    moved checkout keeps working), else absolute."""
    if users_file.resolve().parent == compose_dir.resolve():
        return f"./{users_file.name}"
    return str(users_file.resolve())


def write_private(path: Path, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)


def cmd_secrets(args: argparse.Namespace) -> int:
    """Random secrets for compose, two files: the env file compose reads (one NATS password per role,
    JETRL_NATS_<ROLE>_PASSWORD; the replica users' passwords of each scalable service,
    JETRL_NATS_<SERVICE>_REPLICA_PASSWORDS; the cluster's route password, JETRL_NATS_CLUSTER_PASSWORD; the status
    API's token, JETRL_CONTROLLER_TOKEN; the trainer's and controller's signing keys, JETRL_<SIGNER>_SIGNING_KEY,
    _PUBLIC_KEY) and, beside it, the users file every nats-server of compose includes (nats-users.conf: each user
    with its permissions and password; JETRL_NATS_USERS_FILE names it). Existing files are kept."""
    import secrets

    path = Path(args.env)
    users_path = path.parent / "nats-users.conf"
    if path.exists():
        print(f"jetrl secrets: {path} exists, kept (delete it and {users_path.name} to make new secrets)")
        return 0
    if users_path.exists():
        raise CliError(f"jetrl secrets: {users_path} exists without {path}: delete it to make new secrets")
    compose_file = Path(args.compose) if args.compose else path.parent / "docker-compose.yml"
    if not compose_file.is_file() and (Path(__file__).resolve().parent.parent / "compose" / "docker-compose.yml").is_file():
        compose_file = Path(__file__).resolve().parent.parent / "compose" / "docker-compose.yml"  # a temp env file
    scalable = scalable_services(compose_file, parse_replicas(args.replicas or []))

    passwords = {role: env_password() for role in ROLES}
    lines = [f"{password_env_var(role)}={passwords[role]}" for role in ROLES]
    replicas: list[str] = []
    for service in scalable:  # one user per replica it may run (shared/bus.py's claim_replica_user picks one)
        users = replica_users(service.name, service.replicas)
        passwords |= {user: env_password() for user in users}
        replicas += users
        lines.append(f"{replica_passwords_env_var(service.name)}={','.join(passwords[u] for u in users)}")
    lines.append(f"{USERS_FILE_ENV}={users_file_reference(users_path, compose_file.parent)}")
    lines.append(f"{CLUSTER_PASSWORD_ENV}={env_password()}")  # compose/docker-compose.cluster.yml's routes
    lines.append(f"JETRL_CONTROLLER_TOKEN={secrets.token_urlsafe(24)}")
    for signer in SIGNERS:  # the trainer's and the controller's Ed25519 keys (shared/signing.py)
        private, public = new_key_pair()
        lines += [f"JETRL_{signer.upper()}_SIGNING_KEY={private}", f"JETRL_{signer.upper()}_PUBLIC_KEY={public}"]

    path.parent.mkdir(parents=True, exist_ok=True)
    users = server_authorization(Subjects(args.prefix), passwords, run_users(replicas))
    write_private(users_path, "# JetRL compose NATS users (jetrl secrets): keep private, never commit. Included by "
                              "compose/nats-server.conf.\n" + users)
    write_private(path, "# JetRL compose secrets (jetrl secrets): keep private, never commit\n" + "\n".join(lines) + "\n")
    per_service = ", ".join(f"{s.name} {s.replicas}" for s in scalable)
    print(f"jetrl secrets: wrote {path} and {users_path} ({len(passwords)} NATS users: one per role and per replica "
          f"({per_service}), the cluster's route password, the status API token and the trainer's and "
          "controller's signing keys)")
    return 0
