"""Who may publish and subscribe to what: one NATS user per role, its subject permissions derived from
``shared.subjects`` (the contract), defined here once for the embedded server (``jetrl up``), the
shipped compose config (``compose/nats-server.conf``) and the tests.

Roles and what they may do (JetStream API, KV and object-store internals included):

* ``trainer``: pulls TRAJ through its durable consumer; the only writer of the weights object store,
  the policy KV and ``weights.published`` / ``trainer.finished``.
* ``controller``: the only publisher of jobs and ``run.control``; pulls TRAJ through its own durable,
  reads the trainer durable's backlog, stored episodes (the dashboard), the live registry writes, metrics and
  announcements.
* ``rollout``: pulls JOBS through the rollouts' durables (one shared, or one per task lane); publishes actions,
  observations and trajectories; calls env and generation-pool endpoints, serves the pool; reads the weights
  (a named ephemeral consumer on one object's chunks) and the policy KV (a get, and its writes' subject).
* ``env``: serves the env endpoints (NATS micro), answers only the requests it receives.
* ``observer`` (``jetrl watch``, any stream reader): reads TRAJ, EPISODES, DLQ (ephemeral consumers it names,
  never a service's durable), metrics and announcements; publishes nothing else.
* ``admin``: everything; declares the topology (streams, buckets and every durable consumer) before the
  services start, since creating or updating a stream can redirect messages (``republish``, subject
  transforms) past every other permission, and a consumer's settings decide what its service receives.

No service role creates a durable consumer, and none reads back (consumer, direct get) a stream it writes
(see the table's comment). Every user but admin gets its own inbox prefix (``_INBOX_<user>``): a role's
user, and under ``jetrl up`` and compose one user per replica (``rollout-0``, ``env-sql-1``: ``replica_user``,
``replica_users``), so no role or replica can read another's replies; ``allow_responses`` lets responders answer only requests they
received. Every service user may write its role's registry keys (a replica's user: its own key alone) and
publish dead letters.
"""

from __future__ import annotations

import json
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from shared.config import ControllerConfig, NatsConfig
from shared.subjects import Subjects

ROLES = ("admin", "trainer", "controller", "rollout", "env", "observer")
SERVICE_ROLES = ("trainer", "controller", "rollout", "env")
API = "$JS.API"


class AuthError(RuntimeError):
    pass


@dataclass(frozen=True)
class Permissions:
    """One user's allow and deny lists (NATS subjects with wildcards); deny wins over allow."""

    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    deny_publish: tuple[str, ...] = ()
    deny_subscribe: tuple[str, ...] = ()
    allow_responses: bool = True
    """May publish the one reply to a request it received (NATS ``allow_responses``)."""


@dataclass(frozen=True)
class Credentials:
    user: str = ""
    password: str = field(default="", repr=False)
    creds_file: str = ""
    inbox_prefix: str = "_INBOX"


def user_role(user: str) -> str | None:
    """The role of a NATS user: a role's own user (``rollout``) or one replica's (``rollout-0``, ``env-sql-1``:
    the role, a dash, the replica); None for a user of some other scheme (an operator's own)."""
    head = user.split("-", 1)[0]
    return head if head in ROLES else None


def inbox_prefix(user: str) -> str:
    """Replies to a user's requests arrive under this prefix; only that user may subscribe to it, so one
    replica cannot read another's replies (nor the deliveries of its consumers)."""
    return "_INBOX" if user == "admin" or user_role(user) is None else f"_INBOX_{user}"


def replica_user(service: str) -> str:
    """The NATS user ``jetrl up`` gives one service it starts, named as the service (``rollout-0``,
    ``env-sql-1``, ``trainer``); a stale engine (``stale-0``) is a rollout replica (``rollout-stale-0``)."""
    user = f"rollout-{service}" if service.startswith("stale-") else service
    if user_role(user) is None:
        raise AuthError(f"service {service!r} has no role (its name must start with one of {', '.join(ROLES)})")
    return user


def replica_users(service: str, count: int) -> list[str]:
    """The replica users of a service that scales under compose (``rollout``: ``rollout-0`` ... ; ``env-db``:
    ``env-db-0`` ...), named as ``jetrl up`` names the replicas it starts."""
    if user_role(service) in (None, "admin", "observer", "trainer", "controller"):
        raise AuthError(f"service {service!r} does not scale: replica users are for rollout and env-<task>")
    return [f"{service}-{i}" for i in range(count)]


def run_users(replicas: list[str] | tuple[str, ...] = ()) -> dict[str, str]:
    """User -> role: every role's own user (``jetrl watch``, ``jetrl serve`` and tools connect as these) and
    one user per replica in ``replicas`` (``replica_user`` names)."""
    users = {role: role for role in ROLES}
    for user in replicas:
        role = user_role(user)
        if role is None or role in ("admin", "observer"):
            raise AuthError(f"replica user {user!r} names no service role")
        users[user] = role
    return users


# ---------------------------------------------------------------------------- the permission table
# What nats-server does not check, and the table below therefore never grants a role on a stream it writes:
# the subject a consumer delivers to (a push consumer's deliver subject, a pull request's reply subject) and
# the reply subject of a direct get. The server sends stored messages there as they are, on the client's
# behalf and past its publish permissions, so a role that could write a stream and read it back through a
# consumer or a direct get could put any bytes on any subject. Message gets (STREAM.MSG.GET) answer in JSON,
# which no consumer of ours decodes as one of its messages.
def _lookup(streams: list[str]) -> list[str]:
    """Look streams up (declare_topology waits for them, a KV or object-store handle reads its config)."""
    return [f"{API}.INFO", f"{API}.STREAM.NAMES", *(f"{API}.STREAM.INFO.{st}" for st in streams)]


def _message_get(stream: str) -> list[str]:
    """Single messages of ``stream`` (a KV get, an object's info) as the JSON of a message get."""
    return [f"{API}.STREAM.MSG.GET.{stream}"]


def _pull(stream: str, name: str) -> list[str]:
    """Pull from and ack on an existing durable (``name`` may be ``*``: every durable of the stream); only
    the admin creates or updates durables (shared/consumers.py)."""
    return [f"{API}.CONSUMER.INFO.{stream}.{name}", f"{API}.CONSUMER.MSG.NEXT.{stream}.{name}",
            f"$JS.ACK.{stream}.{name}.>"]


def _ephemeral_reader(stream: str, filter_subject: str = ">") -> list[str]:
    """Create, pull from and delete ephemeral consumers of ``stream`` whose name and filter are in the API
    subject (``CONSUMER.CREATE.<stream>.<name>.<filter>``, the server holds the body to both), never the bare
    ``CONSUMER.CREATE.<stream>``, whose body may name, and so update, any consumer of the stream."""
    create = [f"{API}.CONSUMER.CREATE.{stream}.*.{filter_subject}"]
    if filter_subject == ">":
        create.append(f"{API}.CONSUMER.CREATE.{stream}.*")  # no filter token: the whole stream
    return [*create, f"{API}.CONSUMER.INFO.{stream}.*", f"{API}.CONSUMER.MSG.NEXT.{stream}.*",
            f"{API}.CONSUMER.DELETE.{stream}.*"]


def _not_durable(stream: str, name: str) -> list[str]:
    """What a reader of ``stream`` must never do to a service's durable consumer ``name``: create or
    update it, pull from it (stealing its messages), ack its deliveries or delete it."""
    return [f"{API}.CONSUMER.CREATE.{stream}.{name}", f"{API}.CONSUMER.CREATE.{stream}.{name}.>",
            f"{API}.CONSUMER.DELETE.{stream}.{name}", f"{API}.CONSUMER.MSG.NEXT.{stream}.{name}",
            f"$JS.ACK.{stream}.{name}.>"]


def role_permissions(subjects: Subjects, role: str, user: str | None = None) -> Permissions:
    """The permissions of ``role`` for the run namespace ``subjects``: the one definition. ``user``: one
    replica's user of that role (``rollout-0``), which gets its own inbox and only its own registry key."""
    s = subjects
    user = user or role
    kv_policy, kv_registry = f"KV_{s.policy_kv}", f"KV_{s.registry_kv}"
    obj_weights = Subjects.object_stream(s.weights_bucket)
    streams = [s.jobs_stream, s.episodes_stream, s.traj_stream, s.dlq_stream, kv_policy, kv_registry, obj_weights]
    inbox = f"{inbox_prefix(user)}.>"
    if role == "admin":
        return Permissions(publish=(">",), subscribe=(">",), allow_responses=False)
    if role == "observer":  # writes nothing; reads the streams through ephemeral consumers it names
        readable = [s.traj_stream, s.episodes_stream, s.dlq_stream]
        pub = [*_lookup(readable), *(p for st in readable for p in _message_get(st) + _ephemeral_reader(st))]
        deny = [*_not_durable(s.traj_stream, s.trainer_consumer), *_not_durable(s.traj_stream, s.controller_consumer)]
        sub = [inbox, s.traj(">"), *s.episode_stream_subjects, s.dead_letter(">"), s.metrics(">"), s.run_control,
               s.weights_published, s.training_finished]
        return Permissions(publish=tuple(pub), subscribe=tuple(sub), deny_publish=tuple(deny), allow_responses=False)
    if role not in SERVICE_ROLES:
        raise AuthError(f"unknown role {role!r} (known: {', '.join(ROLES)})")
    # every service: look its streams up, heartbeat under its own role's keys, dead-letter; a container's
    # healthcheck (shared/healthcheck.py) reads the registry's entries by message get
    heartbeats = s.registry_entries(role, "*" if user == role else user)  # a replica's user: its key alone
    # dead letters under the role's own service name (the DLQ's bound is per subject, nats.dlq_max_per_origin):
    # a flood from one role's credentials evicts only that role's letters. An env's name is env-<task>, which no
    # wildcard can spell: env keeps dlq.* (docs/env-protocol.md)
    letters = s.dead_letter("*") if role == "env" else s.dead_letter(role)
    pub = [*_lookup(streams), heartbeats, letters, *_message_get(kv_registry)]
    sub = [inbox]
    if role == "trainer":
        pub += [s.weights_published, s.training_finished, s.metrics("trainer"),
                f"$KV.{s.policy_kv}.>", f"$O.{s.weights_bucket}.>", f"{API}.STREAM.PURGE.{obj_weights}",
                *_message_get(kv_policy), *_message_get(obj_weights), *_pull(s.traj_stream, s.trainer_consumer)]
    elif role == "controller":
        pub += [s.jobs(">"), s.run_control, s.metrics("controller"), s.env_tasks("*"), s.env_health("*"),
                *_pull(s.traj_stream, s.controller_consumer), f"{API}.CONSUMER.INFO.{s.traj_stream}.{s.trainer_consumer}",
                *_message_get(kv_policy),
                # the dashboard's trajectory viewer reads stored episodes (services/controller/board.py)
                *_ephemeral_reader(s.episodes_stream)]
        sub += [s.action("*", "*")]  # the dashboard counts live turns and follows live episodes
        # JetStream advisories (a job out of deliveries, ...) are the server's word on our streams: read-only
        sub += [s.metrics(">"), s.weights_published, s.training_finished, s.run_control, "$JS.EVENT.ADVISORY.>",
                s.registry_entry_prefix + ">"]  # the live replicas (services/controller/sources.py)
    elif role == "rollout":
        pub += [*s.episode_stream_subjects, s.traj(">"), s.metrics("rollout"), f"{s.prefix}.env.>", f"{s.prefix}.gen.>",
                *_pull(s.jobs_stream, "*"),  # JOBS holds only the rollouts' durables (one, or one per task lane)
                *_message_get(kv_policy),  # the policy KV by get; its writes arrive on their subject
                *_message_get(obj_weights), *_ephemeral_reader(obj_weights, Subjects.object_chunks(s.weights_bucket, "*"))]
        # a job out of deliveries (the server's advisory): read it back, dead-letter it, delete it (worker.py)
        pub += [*_message_get(s.jobs_stream), f"{API}.STREAM.MSG.DELETE.{s.jobs_stream}"]
        sub += [s.weights_published, s.training_finished, s.policy_entry, f"{s.prefix}.gen.>", "$SRV.>",
                s.max_deliveries_advisory(s.jobs_stream, "*")]
    elif role == "env":
        sub += [f"{s.prefix}.env.>", "$SRV.>"]
    return Permissions(publish=tuple(pub), subscribe=tuple(sub))


# ---------------------------------------------------------------------------- server config
def password_env_var(user: str) -> str:
    """The environment variable holding ``user``'s password where the server reads it from the
    environment (compose): ``JETRL_NATS_<USER>_PASSWORD`` (``rollout-0``: ``JETRL_NATS_ROLLOUT_0_PASSWORD``)."""
    return f"JETRL_NATS_{user.upper().replace('-', '_')}_PASSWORD"


def env_password() -> str:
    """A random password for a server that reads it from the environment (``password: $JETRL_NATS_..._PASSWORD``
    in compose/nats-server.conf). nats-server parses such a variable's value as a config value, not as a string:
    a bare ``token_urlsafe`` that starts with ``-`` or a digit and a ``-`` reads as a number or a date, and the
    server refuses to start (about 2% of them; one in ten `jetrl secrets` files). A letter first keeps it a
    string; the rest is ``token_urlsafe``'s 192 random bits."""
    return secrets.choice("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ") + secrets.token_urlsafe(24)


CLUSTER_PASSWORD_ENV = "JETRL_NATS_CLUSTER_PASSWORD"
"""The password of the ``route`` user the nodes of compose's 3-node cluster (compose/docker-compose.cluster.yml)
route to each other with: a server that does not know it cannot join the cluster."""


def server_authorization(subjects: Subjects, passwords: dict[str, str] | None = None,
                         users: dict[str, str] | None = None) -> str:
    """The nats-server ``authorization`` block: one user per entry of ``users`` (user -> role; default: one
    per role of ``ROLES``). With ``passwords`` they are written in (the embedded server's config, mode 0600);
    without, each is the environment variable ``password_env_var(user)``, which nats-server resolves at
    start-up and refuses to start without. No ``no_auth_user``: a client without credentials is not let in."""
    lines = ["authorization {", "  users = ["]
    for user, role in (users or {r: r for r in ROLES}).items():
        perms = role_permissions(subjects, role, user)
        secret = json.dumps(passwords[user]) if passwords is not None else "$" + password_env_var(user)
        publish: dict[str, list[str]] = {"allow": list(perms.publish)}
        if perms.deny_publish:
            publish["deny"] = list(perms.deny_publish)
        subscribe: dict[str, list[str]] = {"allow": list(perms.subscribe)}
        if perms.deny_subscribe:
            subscribe["deny"] = list(perms.deny_subscribe)
        body = f'"publish": {json.dumps(publish)}, "subscribe": {json.dumps(subscribe)}'
        if perms.allow_responses:
            body += ', "allow_responses": true'
        lines.append(f'    {{user: "{user}", password: {secret}, permissions: {{{body}}}}}')
    lines += ["  ]", "}"]
    return "\n".join(lines) + "\n"


def generate_passwords(auth_dir: str | os.PathLike[str], users: list[str] | tuple[str, ...] = ROLES) -> dict[str, str]:
    """A fresh random password per user (default: per role), each written to ``<auth_dir>/<user>.password``
    (0600). A password written before is read back instead, so a resumed run keeps its users."""
    auth_dir = Path(auth_dir)
    auth_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(auth_dir, 0o700)
    out: dict[str, str] = {}
    for user in users:
        path = auth_dir / f"{user}.password"
        if path.is_file() and path.read_text().strip():
            out[user] = path.read_text().strip()
            continue
        out[user] = secrets.token_urlsafe(24)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(out[user] + "\n")
    return out


# ---------------------------------------------------------------------------- client side
def credentials(cfg: NatsConfig, role: str | None) -> Credentials:
    """What a client of ``role`` connects with: ``nats.creds_file``, else ``nats.user`` with
    ``nats.password`` or ``nats.password_file``, else user ``role`` with ``<nats.auth_dir>/<role>.password``,
    else nothing (an open server)."""
    if cfg.creds_file:
        return Credentials(creds_file=cfg.creds_file)
    if cfg.user and cfg.replica_passwords and not (cfg.password or cfg.password_file):
        # one of several replica users not claimed yet (a service claims one as it connects, shared/bus.py's
        # claim_replica_user): a client that only reads, a container's healthcheck, connects as the first
        user = replica_users(cfg.user, 1)[0]
        return Credentials(user=user, password=cfg.replica_passwords[0], inbox_prefix=inbox_prefix(user))
    if cfg.user:
        password = cfg.password
        if not password and cfg.password_file:
            password = _read_secret(cfg.password_file, "nats.password_file")
        return Credentials(user=cfg.user, password=password, inbox_prefix=inbox_prefix(cfg.user))
    if cfg.auth_dir and role:
        if role not in ROLES:
            raise AuthError(f"unknown role {role!r} (known: {', '.join(ROLES)})")
        password = _read_secret(Path(cfg.auth_dir) / f"{role}.password", "nats.auth_dir")
        return Credentials(user=role, password=password, inbox_prefix=inbox_prefix(role))
    return Credentials()


def password_file(cfg: NatsConfig, role: str) -> str:
    """The file holding ``role``'s password, for a program that reads it itself (an external env: shared/tasks.py);
    empty on an open server. A password given only inline (``nats.password``) has no file: refused."""
    if cfg.creds_file:
        raise AuthError("nats.creds_file: an external program gets a user and a password file, not a creds file")
    if cfg.user:
        if not cfg.password_file:
            raise AuthError("nats.password: an external program reads its password from a file: set "
                            "nats.password_file instead")
        return cfg.password_file
    if cfg.auth_dir:
        return str(Path(cfg.auth_dir) / f"{credentials(cfg, role).user}.password")
    return ""


def manages_topology(cfg: NatsConfig, role: str | None) -> bool:
    """Whether this client creates and updates streams and buckets: on an open server, with one shared
    user (the behaviour before roles), and as admin; a role user only waits for them to exist."""
    user = credentials(cfg, role).user
    return user_role(user) in (None, "admin")


def _read_secret(path: str | os.PathLike[str], key: str) -> str:
    try:
        value = Path(path).read_text().strip()
    except OSError as exc:
        raise AuthError(f"{key}: cannot read {path}: {exc.strerror}") from None
    if not value:
        raise AuthError(f"{key}: {path} is empty")
    return value


def controller_token(cfg: ControllerConfig) -> str:
    """The status API's bearer token: ``controller.http_token``, else ``controller.http_token_file``'s
    content, else empty (no token asked)."""
    if cfg.http_token or not cfg.http_token_file:
        return cfg.http_token
    return _read_secret(cfg.http_token_file, "controller.http_token_file")


COMPOSE_USERS_FILE = "users.conf"
"""Where compose's nats-server finds its ``authorization`` block: beside its config (/etc/nats/), mounted from
the file `jetrl secrets` writes (compose/nats-users.conf; JETRL_NATS_USERS_FILE in compose/.env)."""

COMPOSE_HEADER = f"""\
# nats-server configuration for compose/docker-compose.yml. Generated, do not edit:
# python -m shared.auth > compose/nats-server.conf
# The users come from {COMPOSE_USERS_FILE} beside this file: `jetrl secrets` writes it (compose/nats-users.conf,
# mounted there) with one user per JetRL role and one per replica of each scalable service (rollout-0, env-db-1,
# ...), their subject permissions from shared/auth.py and their passwords. The server refuses to start without
# it, and a client without credentials is not let in.
"""


def compose_server_conf() -> str:
    """compose/nats-server.conf: the server settings every compose nats-server shares; the users are included."""
    from shared.messages import MAX_MESSAGE_BYTES

    # max_payload is a config-file setting, not a nats-server flag: the codec's largest message must pass
    payload = MAX_MESSAGE_BYTES + 64 * 1024  # as shared/natsd.py: the codec's limit plus headers
    return COMPOSE_HEADER + f"max_payload: {payload}\ninclude ./{COMPOSE_USERS_FILE}\n"


if __name__ == "__main__":  # compose/nats-server.conf
    import sys

    sys.stdout.write(compose_server_conf())
