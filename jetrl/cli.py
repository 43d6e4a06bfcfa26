"""``jetrl``: run everything on one machine, watch episodes live, ask for status.

    jetrl quickstart [--config FILE] [--fresh]   # cached warm start, then RL that improves it
    jetrl up [--config FILE] [--rollouts N] [--section.key=value ...]
    jetrl sft [--config FILE] [...]     # warm start on oracle demonstrations -> <run>/model
    jetrl sft --data FILE [...]         # warm start on a chat dataset (jetrl export's, or any) -> <run>/model
    jetrl eval [--config FILE] [...]    # test split, greedy, per-task report -> <run>/eval.json
    jetrl eval --engine openai --base-url URL --model NAME   # the same, any OpenAI-compatible server
    jetrl eval --suite TASK [...]       # one task alone (an eval-only benchmark task), per-category accuracy
    jetrl serve [--config FILE] [...]   # the policy over the OpenAI API, following weight broadcasts
    jetrl probe [--config FILE] [...]   # eval, greedy and sampled, per task / level / kind
    jetrl watch [--run-dir DIR | --url NATS_URL --prefix P] [--task T] [--events]
    jetrl status [--run-dir DIR]
    jetrl creds observer [--run-dir DIR]   # read-only NATS credentials for outside readers (context file, URL)
    jetrl export [--run-dir DIR | --url NATS_URL --prefix P] -o FILE.parquet|.jsonl [filters]   # docs/data.md
    jetrl reverify [--run-dir DIR] [--task T] [--section.key=value ...]   # grade stored episodes again
    jetrl config [--task T]   # every config key with its default and help; with a task, only
                              # what its env service reads: [env] and [env.<task>]
    jetrl config --markdown [--check]   # the config reference page, docs/reference/config.md
    jetrl env-check TASK [--config FILE]   # a task's env against the env contract: oracle, bad calls, cancel
    jetrl topology [--config FILE]   # declare streams and buckets as the NATS admin (compose)
    jetrl secrets [--env compose/.env]   # per-role NATS passwords + status API token for compose
    jetrl schema [--check]   # message schemas (docs/schemas/) and the env protocol's field tables

``up`` starts an embedded nats-server (unless ``nats.url`` is set) and every service as its own
process (``python -m services.<role>``), prints one progress line per training step, and stops
everything when the trainer is done or on Ctrl-C. A service that dies (the embedded nats-server
too) is restarted with a backoff and counted; only a crash loop ends the run (``[supervisor]``).
A run directory holding an earlier run is kept under a new name unless ``--resume``. Children get
SIGTERM if this process dies (PR_SET_PDEATHSIG), so nothing is left behind.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from jetrl.access import close_status_api, cmd_creds, dashboard_link
from jetrl.configref import add_arguments as add_configref_arguments
from jetrl.configref import run as run_configref
from jetrl.errors import CliError, run_cli
from jetrl.export import add_arguments as add_export_arguments
from jetrl.export import cmd_export
from jetrl.logfiles import RotatingLog
from jetrl.outcome import RunOutcome, WaitNotice
from jetrl.preflight import check_config
from jetrl.reverify import add_arguments as add_reverify_arguments
from jetrl.reverify import cmd_reverify
from jetrl.schema import add_arguments as add_schema_arguments
from jetrl.schema import run as run_schema
from jetrl.sft_data import describe_dataset, follow_with_dataset
from shared.auth import (
    CLUSTER_PASSWORD_ENV,
    ROLES,
    controller_token,
    credentials,
    env_password,
    generate_passwords,
    password_env_var,
    password_file,
    replica_user,
    run_users,
    server_authorization,
)
from shared.bus import connect, declare_topology
from shared.config import JetRLConfig, describe, load_config, save_config
from shared.consumers import declare_durables
from shared.log import setup_logging
from shared.messages import ActionEvent, BadMessage, MetricsReport, ObservationEvent, Trajectory, decode, encode
from shared.natsd import EmbeddedNats, StoreInUse, check_store_free, die_with_parent
from shared.progress import Progress, format_duration
from shared.signing import SIGNERS, generate_signing_keys, new_key_pair, signing_key_path, verifier_for
from shared.subjects import Subjects
from shared.tasks import ExternalEnv, TaskSource, find_task

log = structlog.get_logger()

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
        for name, p in sorted(self.procs.items(), key=lambda item: item[0].startswith("trainer")):
            grace = trainer_grace_s if name.startswith("trainer") else timeout_s
            try:
                p.wait(timeout=max(0.1, started + grace - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        until = time.monotonic() + 3.0  # a service's last lines may still be in its pipe: into its log before we go
        for copy in self.log_copies:
            copy.join(timeout=max(0.0, until - time.monotonic()))


def _bar(done: int, total: int, width: int = 24) -> str:
    filled = int(width * done / max(total, 1))
    return "[" + "#" * filled + "." * (width - filled) + f"] {done}/{total}"


async def _follow_progress(cfg: JetRLConfig, url: str, sup: Supervisor, stop: asyncio.Event,
                           main_role: str = "trainer") -> int:
    subjects = Subjects(cfg.nats.prefix)
    # admin: besides reading, `jetrl up` reports its restarts on metrics.supervisor (it made the users)
    nc = await connect(cfg.nats, "jetrl-up", url=url, role="admin")
    reports: asyncio.Queue[MetricsReport] = asyncio.Queue()

    async def on_metrics(msg: Any) -> None:
        try:
            await reports.put(decode(msg.data, MetricsReport))
        except BadMessage:
            pass

    await nc.subscribe(subjects.metrics("trainer"), cb=on_metrics)
    outcome = RunOutcome(verifier_for(cfg.nats, "controller"))
    await outcome.follow(nc, subjects)
    started, rc = time.monotonic(), 0
    evaluation = _EvalProgress(sup.run_dir, token=controller_token(cfg.controller)) if main_role == "controller" \
        else None
    url_file, announced = sup.run_dir / "controller.url", False
    waiting, stepped = WaitNotice(sup.run_dir, controller_token(cfg.controller)), False
    last_report = 0.0
    try:
        while not stop.is_set():
            if not announced and url_file.is_file():
                announced = True
                print(f"dashboard: {dashboard_link(url_file.read_text().strip(), controller_token(cfg.controller))}"
                      "  (live charts, replicas, trajectories)", flush=True)
            if evaluation is not None:
                await evaluation.poll()
            if not stepped:  # a first start may wait minutes for an env to build its data: say so
                await waiting.poll()
            try:
                r = await asyncio.wait_for(reports.get(), timeout=1.0)
                stepped = True
                tasks = sorted({k.split("/")[1] for k in r.values if k.startswith("task/") and k.endswith("/success")})
                per_task = "  ".join(f"{t}: success {r.values[f'task/{t}/success']:.2f} "
                                     f"reward {r.values[f'task/{t}/reward']:.2f}" for t in tasks)
                # with trainer.filter_flat_groups a step consumes more episodes than it trains on
                trained = int(r.values.get("train/trajectories", 0))
                seen = int(sum(r.values.get(f"task/{t}/episodes", 0) for t in tasks))
                episodes = f"episodes {seen} ({trained} trained)" if seen > trained else f"episodes {trained}"
                elapsed = time.monotonic() - started
                eta = elapsed / max(r.step, 1) * max(cfg.trainer.steps - r.step, 0)
                print(f"{_bar(r.step, cfg.trainer.steps)}  step {r.step}  {per_task}  "
                      f"loss {r.values.get('train/loss', 0.0):+.4f}  {episodes}  "
                      f"{elapsed:.0f}s  eta {format_duration(eta)}", flush=True)
            except TimeoutError:
                pass
            if outcome.failure is not None:
                print(outcome.line(sup.run_dir), file=sys.stderr, flush=True)
                rc = 1
                break
            main = sup.procs[main_role]
            if main.poll() is not None and main.returncode == 0:
                if main_role == "trainer":
                    print(f"training finished: {cfg.trainer.steps} steps in {time.monotonic() - started:.0f}s; "
                          f"run directory {sup.run_dir}", flush=True)
                break
            try:
                restarted = sup.supervise(finished=None)
            except CrashLoop as exc:
                print(f"jetrl up: run failed: {exc}", file=sys.stderr, flush=True)
                rc = 1
                break
            if (restarted or time.monotonic() - last_report > 5.0) and sup.restarts and nc.is_connected:
                last_report = time.monotonic()
                try:  # the controller shows it in /status and /metrics; lost while NATS is down, sent again later
                    await nc.publish(subjects.metrics("supervisor"), encode(sup.report()))
                except Exception as exc:
                    log.warning("supervisor_report_failed", error=repr(exc))
    finally:
        if evaluation is not None and evaluation.bar is not None:
            evaluation.bar.close()
        await nc.close()
    return rc


async def _declare_topology(cfg: JetRLConfig) -> None:
    """Streams, buckets and the run's durable consumers, as the admin: no service role may create them."""
    nc = await connect(cfg.nats, "jetrl-up-admin", role="admin")
    try:
        js, subjects = nc.jetstream(), Subjects(cfg.nats.prefix)
        await declare_topology(js, subjects, cfg.nats, cfg.controller.heartbeat_ttl_s, role="admin")
        await declare_durables(js, subjects, cfg)
    finally:
        await nc.close()


def _run_config(run_dir: str | None) -> JetRLConfig:
    """The run's saved config (its NATS credentials, the status API's token), else (no run directory, or
    none saved there) the defaults with the ``JETRL__`` environment applied."""
    path = Path(run_dir) / "config.toml" if run_dir else None
    return load_config(path if path is not None and path.is_file() else None)


class _EvalProgress:
    """`jetrl eval` / `probe`: finished episodes against the controller's plan, per task, with an ETA
    (read from its /status every few seconds; a bar on a terminal, a line every 10 s otherwise)."""

    def __init__(self, run_dir: Path, every_s: float = 2.0, token: str = "") -> None:
        self.run_dir, self.every_s, self.token = run_dir, every_s, token
        self.bar: Progress | None = None
        self._last = 0.0

    async def poll(self) -> None:
        if time.monotonic() - self._last < self.every_s:
            return
        self._last = time.monotonic()
        try:
            url = (self.run_dir / "controller.url").read_text().strip()
            status = await asyncio.to_thread(_get_json, f"{url}/status", self.token)
        except (OSError, ValueError):
            return  # the controller is not up yet
        planned = status.get("eval_planned") or {}
        if not planned:
            return
        if self.bar is None:
            self.bar = Progress("jetrl eval", total=sum(planned.values()), unit="episodes")
        done = {t: min(status["tasks"].get(t, {}).get("finished", 0), n) for t, n in planned.items()}
        self.bar.set(sum(done.values()), "  ".join(f"{t} {done[t]}/{n}" for t, n in sorted(planned.items())))


def _get_json(url: str, token: str = "") -> Any:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=2) as resp:
        return json.load(resp)


MODE_DEFAULTS = {
    "up": [],
    # Demonstrations from each env's oracle, played through the same services; cross-entropy on them.
    "sft": ["rollout.engine=oracle", "trainer.mode=sft", "controller.group_size=1"],
    "eval": ["controller.mode=eval"],
    # The policy as it stands: greedy and sampled, per task, level and kind, with well-formed-call rates.
    "probe": ["controller.mode=eval", 'controller.eval_passes=["greedy", "sampled"]'],
}


def eval_overrides(args: argparse.Namespace) -> list[str]:
    """``jetrl eval``'s own flags as config overrides (flags given after them still win)."""
    out = []
    if getattr(args, "engine", None):
        out.append(f"rollout.engine={args.engine}")
    if getattr(args, "base_url", None):
        out.append(f"rollout.openai_base_url={args.base_url}")
    if getattr(args, "model", None):
        out.append(f"rollout.openai_model={args.model}")
    if getattr(args, "suite", None):
        out.append('controller.tasks={"' + args.suite + '": 1.0}')
    return out


def preflight(cfg: JetRLConfig, serving: bool = False) -> None:
    problems = check_config(cfg, serving=serving)
    if problems:
        raise CliError("\n".join(problems))


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
                       task=source.task, replica_id=name, heartbeat_ttl_s=cfg.controller.heartbeat_ttl_s)
    sup.spawn(name, [], command=list(source.command), environ=told.environ(), cwd=cwd)


def cmd_up(args: argparse.Namespace, overrides: list[str], mode: str = "up") -> int:
    cfg = load_config(args.config, MODE_DEFAULTS[mode] + eval_overrides(args) + overrides)
    data = getattr(args, "data", None)  # jetrl sft --data: demonstrations from a file, no env or rollout
    preflight(cfg, serving=data is not None)  # before anything starts: a mistake in one line now, not a crash loop
    if data is not None:
        print(f"jetrl sft: {describe_dataset(data, cfg)}", flush=True)
    trainer_command(getattr(args, "trainer_ranks", 1), cfg.trainer.torch_threads)  # a bad --trainer-ranks: say so first
    sources = {task: find_task(task, cfg.env) for task, share in cfg.controller.tasks.items() if share > 0}
    command_dir = str(Path(args.config).resolve().parent) if args.config else os.getcwd()
    run_dir = Path(cfg.run.dir).resolve()
    try:  # a run still running there (or its orphaned nats-server): neither renamed nor served twice
        check_store_free(run_dir / "nats")
    except StoreInUse as exc:
        raise CliError(str(exc)) from None
    if not getattr(args, "resume", False):
        _keep_earlier_run(run_dir, mode)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.run.dir = str(run_dir)
    server = None
    if not cfg.nats.url:
        server = EmbeddedNats(run_dir / "nats")
        try:  # held from here to the end of the run, and by the server while it lives
            server.lock_store()
        except StoreInUse as exc:
            raise CliError(str(exc)) from None
        authorization = ""
        if cfg.nats.embedded_auth:  # one user per role and per replica, passwords in <run>/nats/auth (0600): shared/auth.py
            auth_dir = run_dir / "nats" / "auth"
            users = run_users([replica_user(name) for name in _replica_services(cfg, args)])
            authorization = server_authorization(Subjects(cfg.nats.prefix), generate_passwords(auth_dir, list(users)),
                                                 users)
            cfg.nats.auth_dir = str(auth_dir)
            # the trainer's and the controller's keys: every role checks their control messages (shared/signing.py)
            public = generate_signing_keys(auth_dir)
            cfg.nats.trainer_public_key, cfg.nats.controller_public_key = public["trainer"], public["controller"]
            cfg.nats.signing_key = cfg.nats.signing_key_file = ""
            cfg.nats.user = cfg.nats.password = cfg.nats.password_file = cfg.nats.creds_file = ""
        server.authorization = authorization
        cfg.nats.url = server.start()
    if cfg.nats.auth_dir:  # role users may not create streams: declare them as admin before any service starts
        try:
            asyncio.run(_declare_topology(cfg))
        except BaseException:
            if server is not None:
                server.stop()
            raise
    close_status_api(cfg, run_dir)  # a token per run, in a 0600 file: the config names the file only
    config_path = run_dir / "config.toml"
    save_config(cfg, config_path)  # before nats.url: `jetrl watch` reads the credentials' place from it
    (run_dir / "nats.url").write_text(f"{cfg.nats.url}\n{cfg.nats.prefix}\n")  # outside tools: jetrl creds observer
    print(f"jetrl {mode}: run directory {run_dir}, NATS {cfg.nats.url} (prefix {cfg.nats.prefix})", flush=True)
    print(f"jetrl {mode}: watch live episodes with `jetrl watch --run-dir {run_dir} --events`", flush=True)
    sup = Supervisor(cfg, config_path, run_dir, server)
    if cfg.nats.auth_dir and cfg.nats.embedded_auth and server is not None:
        sup.replica_users = {name: replica_user(name) for name in _replica_services(cfg, args)}
    (run_dir / "controller.url").unlink(missing_ok=True)  # an earlier run's; the new controller writes its own
    stop = asyncio.Event()
    rc = 1
    try:
        for source in sources.values() if data is None else ():
            for i in range(args.env_replicas):
                spawn_env(sup, cfg, source, i, command_dir)
        for i in range(args.rollouts if data is None else 0):
            sup.spawn(f"rollout-{i}", ["services.rollout"])
        for i in range(args.stale_engines):  # generation-only pool members on old weights (AgentRL)
            sup.spawn(f"stale-{i}", ["services.rollout"], ["--rollout.engine_kind=stale", "--rollout.serve_jobs=false"])
        evaluating = mode in ("eval", "probe")
        main_role = "controller" if evaluating else "trainer"
        if not evaluating:
            sup.spawn("trainer", *trainer_command(getattr(args, "trainer_ranks", 1), cfg.trainer.torch_threads))
        if data is None:
            sup.spawn("controller", ["services.controller"])
        print(f"jetrl {mode}: started {', '.join(sup.procs)}", flush=True)

        async def main() -> int:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, stop.set)
            if data is None:
                return await _follow_progress(cfg, cfg.nats.url, sup, stop, main_role)
            return await follow_with_dataset(_follow_progress(cfg, cfg.nats.url, sup, stop, main_role), cfg, data)

        rc = asyncio.run(main())
        if stop.is_set():
            print(f"jetrl {mode}: interrupted, stopping services", flush=True)
            rc = 130
        elif evaluating and rc == 0:
            _print_eval(json.loads((run_dir / "eval.json").read_text()))
        elif mode == "sft" and rc == 0:
            print(f"jetrl sft: warm-start model in {run_dir / 'model'} (use --model.name={run_dir / 'model'})")
    finally:
        sup.stop_all()
        if server is not None:
            server.stop()
    return rc


def _replica_services(cfg: JetRLConfig, args: argparse.Namespace) -> list[str]:
    """The services `jetrl up` may start several of: each gets a NATS user of its own (shared.auth.replica_user),
    so no replica reads another's replies or writes another's registry key."""
    envs = [f"env-{task}-{i}" for task, share in cfg.controller.tasks.items() if share > 0
            for i in range(getattr(args, "env_replicas", 1))]
    return [*envs, *(f"rollout-{i}" for i in range(getattr(args, "rollouts", 1))),
            *(f"stale-{i}" for i in range(getattr(args, "stale_engines", 0)))]


def _keep_earlier_run(run_dir: Path, mode: str) -> None:
    """A fresh run starts fresh: an earlier run's directory (its checkpoints, which the trainer would
    resume from, and its JetStream store, whose jobs would be played again) is renamed, not reused."""
    earlier = ("config.toml", "checkpoints", "nats", "metrics.jsonl")
    if run_dir.is_dir() and any((run_dir / name).exists() for name in earlier):
        kept = run_dir.with_name(f"{run_dir.name}-{time.strftime('%Y%m%d-%H%M%S', time.localtime(run_dir.stat().st_mtime))}")
        n = 1
        while kept.exists():
            kept, n = kept.with_name(f"{kept.name.split('.')[0]}.{n}"), n + 1
        run_dir.rename(kept)
        print(f"jetrl {mode}: the earlier run in {run_dir} is kept as {kept} (--resume continues it instead)", flush=True)


def _print_eval(report: dict[str, Any]) -> None:
    """One table per pass: per task, then per level and kind within it."""
    for name, by_task in report.items():
        print(f"\n{name}: {'task':18s} {'episodes':>8s} {'success':>8s} {'95% CI':>13s} {'well-formed':>11s} "
              f"{'turns':>6s}  {'pass@k' if name == 'sampled' else ''}")
        for task, r in by_task.items():
            lo, hi = r["success_ci95"]
            pass_k = next((f"{k} {v:.3f} [{r[k + '_ci95'][0]:5.3f},{r[k + '_ci95'][1]:5.3f}]" for k, v in r.items()
                           if k.startswith("pass@") and not k.endswith("_ci95")), "")
            print(f"{'':{len(name) + 2}s}{task:18s} {r['episodes']:8d} {r['success']:8.3f} [{lo:5.3f},{hi:5.3f}] "
                  f"{r['well_formed_rate']:11.3f} {r['mean_turns']:6.2f}  {pass_k}")
            for part in ("by_level", "by_kind"):
                for key, b in r[part].items():
                    if len(r[part]) > 1:
                        label = f"  {part[3:]} {key}"
                        blo, bhi = b.get("success_ci95", (float("nan"), float("nan")))
                        print(f"{'':{len(name) + 2}s}{label:18s} {b['episodes']:8d} {b['success']:8.3f} "
                              f"[{blo:5.3f},{bhi:5.3f}] {b['well_formed_rate']:11.3f}")


def cmd_serve(args: argparse.Namespace, overrides: list[str]) -> int:
    """One rollout replica that serves no jobs and answers /v1/chat/completions instead, following the weight
    broadcasts of the run on ``nats.url`` (a training run's config.toml names it); without one, an embedded
    nats-server, where anything may publish weights."""
    cfg = load_config(args.config, ["serve.enabled=true", "rollout.serve_jobs=false", "rollout.serve_pool=false"]
                      + overrides)
    preflight(cfg, serving=True)
    run_dir = Path(cfg.run.dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.run.dir = str(run_dir)
    server = None
    if not cfg.nats.url:
        server = EmbeddedNats(run_dir / "nats-serve")
        cfg.nats.url = server.start()
    config_path = run_dir / "serve.toml"
    save_config(cfg, config_path)
    url_file = run_dir / "serve.url"
    url_file.unlink(missing_ok=True)
    sup = Supervisor(cfg, config_path, run_dir)
    stop = {"now": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(now=True))
    rc = 0
    try:
        sup.spawn("serve", ["services.rollout"])
        announced = False
        while not stop["now"]:
            if not announced and url_file.exists():
                print(f"jetrl serve: {cfg.serve.model_name} at {url_file.read_text().strip()} (OpenAI chat "
                      f"completions; weights from NATS {cfg.nats.url}, prefix {cfg.nats.prefix}); Ctrl-C stops",
                      flush=True)
                announced = True
            if sup.dead():
                print(f"jetrl serve: the server exited; see {run_dir / 'logs' / 'serve.log'}", file=sys.stderr)
                rc = 1
                break
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        sup.stop_all()
        if server is not None:
            server.stop()
    return rc


def _run_target(run_dir: str | None, url: str | None, prefix: str | None) -> tuple[str, str]:
    if url:
        return url, prefix or "jetrl"
    run_dir = run_dir or "runs/latest"
    url_file = Path(run_dir) / "nats.url"
    if not url_file.is_file():
        raise CliError(f"no run in {run_dir} (no nats.url there): start one with `jetrl up`, or give --run-dir "
                       "or --url")
    lines = url_file.read_text().split()
    return lines[0], prefix or (lines[1] if len(lines) > 1 else _run_config(run_dir).nats.prefix)


def cmd_watch(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `jetrl watch | head` ends quietly
    url, prefix = _run_target(args.run_dir, args.url, args.prefix)
    subjects = Subjects(prefix)
    cfg = _run_config(None if args.url else args.run_dir)
    cfg.nats.prefix = prefix

    async def main() -> None:
        nc = await connect(cfg.nats, "jetrl-watch", url=url, role="observer")  # read-only (shared/auth.py)
        task = args.task or "*"

        async def on_traj(msg: Any) -> None:
            try:
                t = decode(msg.data, Trajectory)
            except BadMessage as exc:
                print(f"[bad trajectory] {exc.reason}", flush=True)
                return
            versions = sorted({turn.policy_version for turn in t.turns})
            engines = sorted({turn.engine_id for turn in t.turns})
            print(f"[trajectory] {t.task:8s} {t.episode_id}  reward {t.reward:.2f}  {t.status:18s} "
                  f"turns {len(t.turns)}  tokens {len(t.tokens)} (trained {sum(t.loss_mask)})  "
                  f"policy v{versions}  engines {engines}", flush=True)

        async def on_event(msg: Any) -> None:
            try:
                if ".act." in msg.subject:
                    a = decode(msg.data, ActionEvent)
                    calls = a.message.get("tool_calls") or []
                    what = (f"{calls[0]['function']['name']}({calls[0]['function']['arguments']})" if calls
                            else repr((a.message.get("content") or "")[:120]))
                    print(f"  [act] {a.episode_id} turn {a.turn} v{a.policy_version}: {what[:160]}", flush=True)
                else:
                    o = decode(msg.data, ObservationEvent)
                    text = " ".join(str(m.get("content", "")) for m in o.messages).replace("\n", " ")
                    print(f"  [obs] {o.episode_id} turn {o.turn} {o.status} r={o.reward:.2f}: {text[:160]}", flush=True)
            except BadMessage as exc:
                print(f"[bad event] {exc.reason}", flush=True)

        await nc.subscribe(subjects.traj(task), cb=on_traj)
        if args.events:
            await nc.subscribe(subjects.action(task, "*"), cb=on_event)
            await nc.subscribe(subjects.observation(task, "*"), cb=on_event)
        print(f"watching {subjects.traj(task)} on {url} (Ctrl-C to stop)", flush=True)
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        try:
            await asyncio.wait_for(stop.wait(), timeout=args.seconds or None)
        except TimeoutError:
            pass
        await nc.close()

    asyncio.run(main())
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    url_file = Path(args.run_dir) / "controller.url"
    if not url_file.is_file():
        raise CliError(f"no run in {args.run_dir} (no controller.url there): start one with `jetrl up`, or name "
                       f"its directory with --run-dir")
    url = url_file.read_text().strip()
    token = controller_token(_run_config(args.run_dir).controller)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{url}/status", headers=headers), timeout=5) as resp:
            status = json.load(resp)
    except urllib.error.HTTPError as exc:
        raise CliError(f"the controller of {args.run_dir} at {url} answered HTTP {exc.code} {exc.reason}") from None
    except OSError as exc:
        raise CliError(f"the controller of {args.run_dir} at {url} does not answer ({exc}): the run has ended "
                       f"or not started yet") from None
    print(json.dumps(status, indent=2))
    print(f"dashboard: {dashboard_link(url, token)}", file=sys.stderr)  # stderr: stdout stays one JSON document
    return 0


def cmd_topology(args: argparse.Namespace, overrides: list[str]) -> int:
    """Declare every stream, bucket and durable consumer as the admin user: on an authenticated server only
    the admin may (shared/auth.py); the services wait for them. Compose runs this once as its `topology`
    service, with the run's config (the durables' lanes and ack waits come from it)."""
    cfg = load_config(args.config, overrides)
    if not cfg.nats.url:
        raise CliError("jetrl topology: set nats.url (JETRL__NATS__URL) to the server to declare on")
    asyncio.run(_declare_topology(cfg))
    print(f"jetrl topology: streams, buckets and durables of prefix {cfg.nats.prefix} declared on {cfg.nats.url}")
    return 0


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


def main(argv: list[str] | None = None) -> int:
    """The ``jetrl`` command: a user's mistake is one ``jetrl: error:`` line (``--debug``: the traceback)."""
    return run_cli(_main, sys.argv[1:] if argv is None else argv)


def _main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="jetrl", description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("up", "start NATS and every service; train; stop everything"),
                       ("sft", "warm start: supervised training on each env's oracle demonstrations"),
                       ("eval", "run the test split of every task (greedy) and report per-task figures"),
                       ("probe", "eval greedy and sampled (k = controller.eval_samples): success and well-formed "
                                 "tool calls per task, level and kind")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--config", default=None)
        p.add_argument("--rollouts", type=int, default=2, help="rollout replicas")
        p.add_argument("--env-replicas", type=int, default=1, help="replicas per task env")
        p.add_argument("--stale-engines", type=int, default=0,
                       help="extra pool engines that take new weights every rollout.stale_every versions "
                            "(used when rollout.cross_policy_prob > 0)")
        p.add_argument("--trainer-ranks", type=int, default=1,
                       help="data-parallel trainer ranks on this host (DeepSpeed ZeRO under torchrun; needs "
                            "`make venv-deepspeed`); 1 = the plain one-process trainer")
        p.add_argument("--resume", action="store_true",
                       help="continue the run in run.dir (its checkpoints and streams); without it an earlier "
                            "run there is renamed and a fresh one starts")
        if name == "sft":
            p.add_argument("--data", default=None, help="demonstrations from this dataset file (.parquet / .jsonl: "
                                                        "jetrl export's, or any chat dataset with OpenAI tool calls) "
                                                        "instead of the envs' oracles")
        if name in ("eval", "probe"):
            p.add_argument("--engine", default=None, help="rollout.engine: continuous | hf | vllm | openai")
            p.add_argument("--base-url", default=None, help="openai engine: the server, e.g. http://host:8001/v1")
            p.add_argument("--model", default=None, help="openai engine: the model name the server knows")
            p.add_argument("--suite", default=None, help="one task alone instead of controller.tasks (an "
                                                          "eval-only benchmark task)")
    serve = sub.add_parser("serve", help="the policy over the OpenAI chat-completions API, following weight "
                                         "broadcasts (--config of a running training run)")
    serve.add_argument("--config", default=None)
    watch = sub.add_parser("watch", help="print live trajectories (and with --events every action/observation)")
    watch.add_argument("--run-dir", default="runs/latest")
    watch.add_argument("--url", default=None)
    watch.add_argument("--prefix", default=None)
    watch.add_argument("--task", default=None)
    watch.add_argument("--events", action="store_true")
    watch.add_argument("--seconds", type=float, default=0, help="stop after this long (0 = until Ctrl-C)")
    quick = sub.add_parser("quickstart", help="a warm start built once and cached, then RL that improves it")
    quick.add_argument("--config", default="configs/quickstart.toml")
    quick.add_argument("--rollouts", type=int, default=1, help="rollout replicas")
    quick.add_argument("--env-replicas", type=int, default=1, help="replicas per task env")
    quick.add_argument("--stale-engines", type=int, default=0, help="extra stale pool engines")
    quick.add_argument("--fresh", action="store_true", help="rebuild the warm start even if one is cached")
    creds = sub.add_parser("creds", help="read-only NATS credentials of a run for outside tools: a context file "
                                         "and a URL")
    creds.add_argument("role", choices=["observer"], help="observer: reads streams, publishes nothing")
    creds.add_argument("--run-dir", default="runs/latest")
    status = sub.add_parser("status", help="the controller's /status of a run")
    status.add_argument("--run-dir", default="runs/latest")
    config = sub.add_parser("config", help="every config key with its default and help")
    config.add_argument("--task", default=None, help="only what this task's env service reads: [env] and "
                                                     "[env.<task>] (any registered task)")
    config.add_argument("--config", default=None, help="a config whose [env.<task>] factory names the task")
    add_configref_arguments(config)
    env_check = sub.add_parser("env-check", help="check a task's env against the env contract (oracle per split, bad "
                                                 "calls, cancel, health) over a real nats-server; exit 1 on a failure")
    env_check.add_argument("task")
    env_check.add_argument("--config", default=None)
    env_check.add_argument("--episodes", type=int, default=2, help="oracle episodes per split")
    env_check.add_argument("--wait", type=float, default=600.0,
                           help="seconds to wait for the env to answer (a first start may build its task data)")
    topology = sub.add_parser("topology", help="declare every stream and bucket as the NATS admin user "
                                                "(authenticated servers: the services wait for it)")
    topology.add_argument("--config", default=None)
    secrets_cmd = sub.add_parser("secrets", help="random NATS passwords per role and a status API token, as an "
                                                 "env file for compose")
    secrets_cmd.add_argument("--env", default="compose/.env", help="env file to write (kept if it exists)")
    schema = sub.add_parser("schema", help="the message schemas (JSON Schema) and the env protocol's field "
                                           "tables, from shared/messages.py; --check: fail if out of date")
    add_schema_arguments(schema)
    add_export_arguments(sub.add_parser("export", help="a run's trajectories as a dataset file (Parquet or JSONL, "
                                                      "the Hugging Face chat format), filtered"))
    add_reverify_arguments(sub.add_parser("reverify", help="replay a run's stored episodes against fresh env "
                                                           "sessions and report where the grade differs"))
    args, rest = parser.parse_known_args(argv)
    setup_logging("cli", level="warning")  # the CLI prints its own lines; services log to their files
    if args.command in MODE_DEFAULTS:
        return cmd_up(args, rest, args.command)
    if args.command == "serve":
        return cmd_serve(args, rest)
    if args.command == "quickstart":
        from jetrl.quickstart import cmd_quickstart

        return cmd_quickstart(args, rest)
    if args.command == "topology":
        return cmd_topology(args, rest)
    if args.command == "env-check":
        from jetrl.envcheck import cmd_env_check

        return cmd_env_check(args.task, args.config, rest, args.episodes, args.wait)
    if args.command == "export":
        return cmd_export(args, rest)
    if args.command == "reverify":
        return cmd_reverify(args, rest)
    if rest:
        parser.error(f"unrecognised arguments: {rest}")
    if args.command == "secrets":
        return cmd_secrets(args)
    if args.command == "watch":
        return cmd_watch(args)
    if args.command == "status":
        return cmd_status(args)
    if args.command == "creds":
        return cmd_creds(args)
    if args.command == "schema":
        return run_schema(args)
    if args.markdown:
        return run_configref(args)
    print(describe(args.task, load_config(args.config).env))
    return 0


if __name__ == "__main__":
    sys.exit(main())
