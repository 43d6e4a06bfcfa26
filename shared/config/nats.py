"""[nats]: how every role reaches the broker, and the bounds of what the run keeps there."""

from __future__ import annotations

from dataclasses import dataclass

from shared.config.fields import opt


@dataclass
class NatsConfig:
    url: str = opt("", "nats:// URL of a running server (a cluster's members comma-separated); empty = start "
                       "an embedded nats-server")
    prefix: str = opt("jetrl", "namespace for every subject, stream and bucket of this run")
    creds_file: str = opt("", "NATS credentials file (JWT + nkey), if the server wants one")
    user: str = opt("", "user name, for servers with plain user/password auth")
    password: str = opt("", "password for `user`")
    tls_ca: str = opt("", "CA bundle to verify the server's TLS certificate")
    tls_cert: str = opt("", "client certificate for mutual TLS")
    tls_key: str = opt("", "client key for mutual TLS")
    connect_timeout_s: float = opt(5.0, "seconds to wait for one connection attempt", gt=0)
    heartbeat_ttl_s: float = opt(10.0, "a replica missing heartbeats this long is dropped from the registry (the "
                                       "registry bucket's TTL: every role heartbeats into it)", gt=0)
    stream_replicas: int = opt(1, "JetStream replicas per stream and bucket (3 on a 3-node cluster: one node may "
                                  "die without losing a message)", ge=1)
    password_file: str = opt("", "file holding the password for `user` (a Docker secret), instead of `password`")
    replica_passwords: list[str] = opt([], "passwords of the replica users <user>-0, <user>-1, ... (compose: "
                                           "`jetrl secrets` makes them, one list per scalable service): the "
                                           "service takes the first no live replica holds and is that replica "
                                           "(its registry key, its inbox); `password` stays empty")
    auth_dir: str = opt("", "directory of per-role passwords (<role>.password, as jetrl up writes them): each "
                            "service connects as the user named after its role (shared/auth.py)")
    embedded_auth: bool = opt(True, "jetrl up's embedded nats-server has one user per role with subject "
                                    "permissions (shared/auth.py); false = an open server")
    trainer_public_key: str = opt("", "the trainer's Ed25519 public key (hex; jetrl up and jetrl secrets make it): "
                                      "weights announcements, policy-KV entries and TrainingFinished not signed "
                                      "with it are refused (shared/signing.py); empty = nothing checked")
    controller_public_key: str = opt("", "the controller's Ed25519 public key (hex): run.control messages not "
                                         "signed with it are refused; empty = nothing checked")
    signing_key_file: str = opt("", "this service's Ed25519 private key (hex, 0600; the trainer's or the "
                                    "controller's), which signs its control messages")
    signing_key: str = opt("", "the same key given as a value (compose: from the environment)")
    # bounds of the streams that grow with the run: the oldest messages go first
    traj_max_age_s: float = opt(7 * 86400.0, "TRAJ keeps trajectories this long")
    traj_max_bytes: int = opt(4 * 1024**3, "TRAJ holds at most this many bytes (-1 = no bound)")
    episodes_max_age_s: float = opt(7 * 86400.0, "EPISODES keeps action/observation events this long")
    episodes_max_bytes: int = opt(4 * 1024**3, "EPISODES holds at most this many bytes (-1 = no bound)")
    dlq_max_bytes: int = opt(1024**3, "DLQ holds at most this many bytes (-1 = no bound)")
    dlq_max_per_origin: int = opt(1000, "DLQ keeps at most this many letters of each service (dlq.<service>, the "
                                        "oldest go first): a flood of refusals from one service never pushes out "
                                        "another's letters (each letter's payload is cut at 64 KiB, so 16 "
                                        "services fit in the default dlq_max_bytes)", ge=1)
    max_consumers: int = opt(512, "most consumers one stream or bucket may have (a client that asks for more is "
                                  "refused): every consumer costs the server memory and work", ge=1)
