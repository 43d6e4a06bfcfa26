"""Start a run on this machine (``jetrl up``, ``sft``, ``eval``, ``probe``; ``jetrl quickstart`` runs them in
turn): an embedded nats-server, its users and topology, every service under the supervisor, the progress
lines until the run ends."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
from pathlib import Path

from jetrl.access import close_status_api
from jetrl.errors import CliError
from jetrl.preflight import preflight
from jetrl.run_progress import follow_progress, print_eval
from jetrl.rundir import keep_earlier_run
from jetrl.sft_data import describe_dataset, follow_with_dataset
from jetrl.supervisor import Supervisor, spawn_env, trainer_command
from shared.auth import generate_passwords, replica_user, run_users, server_authorization
from shared.bus import connect, declare_topology
from shared.config import JetRLConfig, load_config, save_config
from shared.consumers import declare_durables
from shared.natsd import EmbeddedNats, StoreInUse, check_store_free
from shared.signing import generate_signing_keys
from shared.subjects import Subjects
from shared.tasks import find_task

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
        out.append(f"rollout.openai.base_url={args.base_url}")
    if getattr(args, "model", None):
        out.append(f"rollout.openai.model={args.model}")
    if getattr(args, "suite", None):
        out.append('run.tasks={"' + args.suite + '": 1.0}')
    return out


async def declare_as_admin(cfg: JetRLConfig) -> None:
    """Streams, buckets and the run's durable consumers, as the admin: no service role may create them."""
    nc = await connect(cfg.nats, "jetrl-up-admin", role="admin")
    try:
        js, subjects = nc.jetstream(), Subjects(cfg.nats.prefix)
        await declare_topology(js, subjects, cfg.nats, role="admin")
        await declare_durables(js, subjects, cfg)
    finally:
        await nc.close()


def launch(args: argparse.Namespace, overrides: list[str], mode: str = "up") -> int:
    cfg = load_config(args.config, MODE_DEFAULTS[mode] + eval_overrides(args) + overrides)
    data = getattr(args, "data", None)  # jetrl sft --data: demonstrations from a file, no env or rollout
    preflight(cfg, serving=data is not None)  # before anything starts: a mistake in one line now, not a crash loop
    if data is not None:
        print(f"jetrl sft: {describe_dataset(data, cfg)}", flush=True)
    trainer_command(getattr(args, "trainer_ranks", 1), cfg.trainer.torch_threads)  # a bad --trainer-ranks: say so first
    sources = {task: find_task(task, cfg.env) for task, share in cfg.run.tasks.items() if share > 0}
    command_dir = str(Path(args.config).resolve().parent) if args.config else os.getcwd()
    run_dir = Path(cfg.run.dir).resolve()
    try:  # a run still running there (or its orphaned nats-server): neither renamed nor served twice
        check_store_free(run_dir / "nats")
    except StoreInUse as exc:
        raise CliError(str(exc)) from None
    if not getattr(args, "resume", False):
        keep_earlier_run(run_dir, mode)
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
            users = run_users([replica_user(name) for name in replica_services(cfg, args)])
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
            asyncio.run(declare_as_admin(cfg))
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
        sup.replica_users = {name: replica_user(name) for name in replica_services(cfg, args)}
    (run_dir / "controller.url").unlink(missing_ok=True)  # an earlier run's; the new controller writes its own
    (run_dir / "eval.partial.json").unlink(missing_ok=True)  # an earlier stopped eval's
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
                return await follow_progress(cfg, cfg.nats.url, sup, stop, main_role)
            return await follow_with_dataset(follow_progress(cfg, cfg.nats.url, sup, stop, main_role), cfg, data)

        rc = asyncio.run(main())
        if stop.is_set():
            print(f"jetrl {mode}: interrupted, stopping services", flush=True)
            rc = 130
        elif evaluating and rc == 0 and (run_dir / "eval.json").exists():
            print_eval(json.loads((run_dir / "eval.json").read_text()))
        elif evaluating and rc == 0:  # the controller was stopped on its own before the end
            rc = 1
        elif mode == "sft" and rc == 0:
            print(f"jetrl sft: warm-start model in {run_dir / 'model'} (use --model.name={run_dir / 'model'})")
    finally:
        sup.stop_all()
        if server is not None:
            server.stop()
    partial = run_dir / "eval.partial.json"
    if evaluating and rc != 0 and partial.exists():  # the controller's report of what finished before the stop
        print_eval(json.loads(partial.read_text()))
        print(f"\njetrl {mode}: stopped before the end; what finished is in {partial}", flush=True)
    return rc


def replica_services(cfg: JetRLConfig, args: argparse.Namespace) -> list[str]:
    """The services `jetrl up` may start several of: each gets a NATS user of its own (shared.auth.replica_user),
    so no replica reads another's replies or writes another's registry key."""
    envs = [f"env-{task}-{i}" for task, share in cfg.run.tasks.items() if share > 0
            for i in range(getattr(args, "env_replicas", 1))]
    return [*envs, *(f"rollout-{i}" for i in range(getattr(args, "rollouts", 1))),
            *(f"stale-{i}" for i in range(getattr(args, "stale_engines", 0)))]
