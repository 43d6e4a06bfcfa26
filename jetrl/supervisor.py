"""How ``jetrl up`` starts its services and keeps them alive: the supervisor, a task's env replica,
the trainer's command line."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from jetrl.errors import CliError
from jetrl.logfiles import RotatingLog
from shared.auth import credentials, password_file
from shared.config import JetRLConfig
from shared.messages import MetricsReport
from shared.natsd import EmbeddedNats, die_with_parent
from shared.signing import signing_key_path
from shared.tasks import ExternalEnv, TaskSource


@dataclass
class Child:
    """How to (re)start one service, and its crash record."""

    module_args: list[str]
    overrides: list[str]
    command: list[str] | None = None
    """An external program (``[env.<task>] command``) run as it is, instead of ``python -m <module_args>``."""
    environ: dict[str, str] | None = None
    """Variables set for it on top of this process's environment (shared/tasks.py: ExternalEnv)."""
    cwd: str | None = None
    restarts: int = 0
    started_at: float = 0.0  # monotonic time of its latest start
    failing: int = 0  # deaths in a row, each within crash_window_s of its start
    restart_at: float | None = None  # dead, waiting for its backoff to pass
    last_rc: int | None = None


class CrashLoop(RuntimeError):
    """A service kept dying: the run ends, with this message (service, exit codes, last log lines)."""


class Supervisor:
    """Starts every service and keeps it alive: a dead service is restarted after a backoff (doubling
    with each death in a row), logged and counted (``<run>/restarts.json``,
    and the controller's /status and /metrics through a ``supervisor`` metrics report); only a crash
    loop ends the run. With an embedded nats-server, a dead server is restarted on the same port and
    store, so every client's reconnect finds it again."""

    def __init__(self, cfg: JetRLConfig, config_path: Path, run_dir: Path, nats: EmbeddedNats | None = None) -> None:
        self.cfg, self.config_path, self.run_dir = cfg, config_path, run_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.children: dict[str, Child] = {}
        self.nats = nats
        self.nats_child = Child([], [], started_at=time.monotonic())
        self.restarts: dict[str, int] = {}
        self.replica_users: dict[str, str] = {}  # service -> its own NATS user (shared.auth.replica_user)
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.logs: dict[str, RotatingLog] = {}  # a service's log file, rotated past supervisor.log_max_bytes
        self.log_copies: list[threading.Thread] = []  # one per child started: its output into its log

    def spawn(self, name: str, module_args: list[str], overrides: list[str] | None = None,
              command: list[str] | None = None, environ: dict[str, str] | None = None, cwd: str | None = None) -> None:
        child = self.children.setdefault(name, Child(module_args, list(overrides or []), command, environ, cwd))
        log = self.logs.get(name) or RotatingLog(self.run_dir / "logs" / f"{name}.log",
                                                 self.cfg.supervisor.log_max_bytes, self.cfg.supervisor.log_backups)
        self.logs[name] = log
        if child.restarts:
            log.write(f"=== jetrl up: restart {child.restarts} of {name} (last exit {child.last_rc}) ===\n".encode())
        child.started_at = time.monotonic()
        cmd = child.command or [sys.executable, "-m", *child.module_args, "--config", str(self.config_path),
                                *child.overrides]
        # the child reads the effective config the CLI wrote (JETRL__* variables already applied, flags over
        # them): the same variables again would override the flags a second time, in the child alone
        env = {k: v for k, v in os.environ.items() if not k.startswith("JETRL__")}
        env.update(PYTHONUNBUFFERED="1", **(child.environ or {}))
        signer = name if name in ("trainer", "controller") else ""
        if signer and self.cfg.nats.trainer_public_key and self.cfg.nats.auth_dir:  # its private key, for it alone
            env["JETRL__NATS__SIGNING_KEY_FILE"] = str(signing_key_path(self.cfg.nats.auth_dir, signer))
        if name in self.replica_users:  # the environment, not a flag: no command line carries where the secret is
            user = self.replica_users[name]
            env.update(JETRL__NATS__USER=user, JETRL__NATS__PASSWORD_FILE=str(Path(self.cfg.nats.auth_dir) / f"{user}.password"))
        self.procs[name] = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                                            cwd=child.cwd, start_new_session=True, preexec_fn=die_with_parent)
        self.log_copies.append(log.copy_from(self.procs[name].stdout))  # type: ignore[arg-type]

    def dead(self) -> list[tuple[str, int]]:
        return [(n, p.returncode) for n, p in self.procs.items() if p.poll() is not None]

    def supervise(self, finished: str | None = None) -> list[str]:
        """One pass: note deaths, restart those whose backoff is over. ``finished`` names a role whose
        exit is the run's end, not a death. Returns the restarts made (for the progress line); raises
        CrashLoop when a service died too often."""
        s = self.cfg.supervisor
        now = time.monotonic()
        done: list[str] = []
        if self.nats is not None and self.nats.proc is not None and self.nats.proc.poll() is not None:
            self._crashed("nats-server", self.nats_child, self.nats.proc.returncode, now)
            self.nats.port = int(self.nats.url.rsplit(":", 1)[1])  # same port: clients reconnect to their URL
            self.nats.start()
            self.nats_child.started_at = time.monotonic()
            done.append(self._count("nats-server"))
        for name, proc in self.procs.items():
            child = self.children.get(name)
            if child is None or name == finished or proc.poll() is None:
                continue
            if child.restart_at is None:  # a new death
                self._crashed(name, child, proc.returncode, now)
                child.last_rc = proc.returncode
                backoff = min(s.restart_backoff_s * 2 ** (child.failing - 1), s.restart_backoff_max_s)
                child.restart_at = now + backoff
                print(f"jetrl up: {name} exited with {proc.returncode}; restarting it in {backoff:.1f}s "
                      f"(see {self.run_dir / 'logs' / (name + '.log')})", file=sys.stderr, flush=True)
            elif now >= child.restart_at:
                child.restart_at = None
                child.restarts += 1
                self.spawn(name, child.module_args, child.overrides, child.command, child.environ, child.cwd)
                done.append(self._count(name))
        return done

    def _crashed(self, name: str, child: Child, rc: int | None, now: float) -> None:
        """A death. One that comes soon after a start (within crash_window_s: it never got going, say a
        broken config or a model that does not load) adds to a run of failures; one after a longer life
        starts a new run. Too long a run of failures is a crash loop."""
        s = self.cfg.supervisor
        child.failing = child.failing + 1 if now - child.started_at < s.crash_window_s else 1
        if child.failing > s.crash_loop_restarts:
            raise CrashLoop(f"{name} died {child.failing} times in a row, each within {s.crash_window_s:g}s of "
                            f"its start (last exit code {rc}): giving up the run.\n{self.last_log_lines(name)}")

    def _count(self, name: str) -> str:
        self.restarts[name] = self.restarts.get(name, 0) + 1
        (self.run_dir / "restarts.json").write_text(json.dumps(self.restarts, indent=2, sort_keys=True) + "\n")
        print(f"jetrl up: restarted {name} (restart {self.restarts[name]})", file=sys.stderr, flush=True)
        return name

    def last_log_lines(self, name: str, lines: int = 20) -> str:
        path = self.nats.log_file if name == "nats-server" and self.nats else self.run_dir / "logs" / f"{name}.log"
        try:
            tail = path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return f"(no log at {path})"
        return f"last {len(tail)} lines of {path}:\n" + "\n".join("  " + line for line in tail)

    def report(self) -> MetricsReport:
        """The restart counts, for the controller's /status and /metrics."""
        values = {f"restarts/{name}": float(n) for name, n in self.restarts.items()}
        values["restarts/total"] = float(sum(self.restarts.values()))
        return MetricsReport(role="supervisor", replica_id="jetrl-up", step=int(values["restarts/total"]),
                             values=values)

    def stop_all(self, timeout_s: float = 20.0, trainer_grace_s: float = 300.0) -> None:
        """SIGTERM to every role, then SIGKILL past the timeout. The trainer gets longer: it finishes the
        step it is in (tens of seconds on a CPU) and then saves ``<run>/model``, the run's result."""
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        started = time.monotonic()
        try:
            for name, p in sorted(self.procs.items(), key=lambda item: item[0].startswith("trainer")):
                grace = trainer_grace_s if name.startswith("trainer") else timeout_s
                try:
                    p.wait(timeout=max(0.1, started + grace - time.monotonic()))
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        except KeyboardInterrupt:  # Ctrl-C again while the services stop: no more waiting
            print("jetrl: interrupted again: killing the services that are still stopping", file=sys.stderr,
                  flush=True)
            for p in self.procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()
        until = time.monotonic() + 3.0  # a service's last lines may still be in its pipe: into its log before we go
        for copy in self.log_copies:
            copy.join(timeout=max(0.0, until - time.monotonic()))


def trainer_command(ranks: int, torch_threads: int) -> tuple[list[str], list[str]]:
    """The trainer's module arguments and overrides: one process, or ``ranks`` data-parallel DeepSpeed
    ranks under torchrun on this host (rank 0 is the service; the cores are shared among the ranks)."""
    if ranks < 1:
        raise CliError(f"--trainer-ranks must be >= 1, got {ranks}")
    if ranks == 1:
        return ["services.trainer"], []
    if importlib.util.find_spec("deepspeed") is None:
        raise CliError("--trainer-ranks > 1 runs the DeepSpeed backend, which is not installed: "
                         "`make venv-deepspeed` (mk/vllm.mk) installs it without touching torch")
    return (["torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}", "-m", "services.trainer"],
            ["--trainer.backend=deepspeed", f"--trainer.torch_threads={max(1, torch_threads // ranks)}"])


def spawn_env(sup: Supervisor, cfg: JetRLConfig, source: TaskSource, replica: int, cwd: str) -> None:
    """One replica of a task's env: ``python -m services.envs TASK``, or the task's own program (``command``)
    with the variables of ``ExternalEnv``, started in ``cwd`` (the config's directory)."""
    name = f"env-{source.task}-{replica}"
    if not source.command:
        sup.spawn(name, ["services.envs", source.task])
        return
    user = sup.replica_users.get(name)  # its own user where jetrl up made one, else the env role's
    told = ExternalEnv(nats_url=cfg.nats.url, nats_user=user or credentials(cfg.nats, "env").user,
                       nats_password_file=str(Path(cfg.nats.auth_dir) / f"{user}.password") if user
                       else password_file(cfg.nats, "env"), nats_prefix=cfg.nats.prefix,
                       task=source.task, replica_id=name, heartbeat_ttl_s=cfg.nats.heartbeat_ttl_s)
    sup.spawn(name, [], command=list(source.command), environ=told.environ(), cwd=cwd)
