"""``jetrl secrets``: random NATS passwords, a status API token and signing keys, as compose's env file."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from shared.auth import CLUSTER_PASSWORD_ENV, ROLES, env_password, password_env_var
from shared.signing import SIGNERS, new_key_pair


def cmd_secrets(args: argparse.Namespace) -> int:
    """Random secrets for compose: one NATS password per role (JETRL_NATS_<ROLE>_PASSWORD), the cluster's route
    password (JETRL_NATS_CLUSTER_PASSWORD), the status API's token (JETRL_CONTROLLER_TOKEN) and the trainer's and
    controller's signing keys (JETRL_<SIGNER>_SIGNING_KEY, _PUBLIC_KEY), as an env file compose reads. An existing
    file is kept."""
    import secrets

    path = Path(args.env)
    if path.exists():
        print(f"jetrl secrets: {path} exists, kept (delete it to make new secrets)")
        return 0
    # nats-server reads these from the environment: passwords it parses as strings (shared.auth.env_password)
    lines = [f"{password_env_var(role)}={env_password()}" for role in ROLES]
    lines.append(f"{CLUSTER_PASSWORD_ENV}={env_password()}")  # compose/docker-compose.cluster.yml's routes
    lines.append(f"JETRL_CONTROLLER_TOKEN={secrets.token_urlsafe(24)}")
    for signer in SIGNERS:  # the trainer's and the controller's Ed25519 keys (shared/signing.py)
        private, public = new_key_pair()
        lines += [f"JETRL_{signer.upper()}_SIGNING_KEY={private}", f"JETRL_{signer.upper()}_PUBLIC_KEY={public}"]
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write("# JetRL compose secrets (jetrl secrets): keep private, never commit\n" + "\n".join(lines) + "\n")
    print(f"jetrl secrets: wrote {path} ({len(ROLES)} NATS passwords, the cluster's route password, the status API "
          "token and the trainer's and controller's signing keys)")
    return 0
