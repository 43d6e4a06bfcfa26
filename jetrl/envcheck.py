"""``jetrl env-check TASK``: one task's env service against the env contract, over a real NATS server.

Without ``nats.url`` it starts what ``jetrl up`` would (an embedded nats-server with a user per role, the
task's env as ``python -m services.envs TASK`` or its ``[env.<task>] command``) and talks to it as the
rollout does (the rollout role's permissions); with ``nats.url`` it checks the env already serving there.
Each check prints one line, ``ok`` or ``FAIL``; the exit code is 1 if any failed:

* ``health``: the health endpoint answers for this task, with its session limit;
* ``tasks``: task ids in at least one split (an eval-only task has only test), the same when asked again, no id in both splits;
* ``oracle <split>``: sessions played by the env's oracle to the end, a reward in [0, 1], at least one solved
  (an env without an oracle, whose oracle answers 500 "... has no oracle", gets a ``--`` line instead);
* ``bad call: ...``: an unknown tool, wrong arguments, arguments that are not JSON and an unreadable call
  each get an error observation (or end the episode with a status), and the episode goes on: the oracle
  then finishes it;
* ``cancel``: a cancelled session ends with status cancelled, a second cancel gets the same answer, and
  the session is gone (404) afterwards;
* ``unknown ids``: an unknown task id is refused with 404; an unknown split too, or has no ids.
"""

from __future__ import annotations

import asyncio
import json
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from jetrl.launch import declare_as_admin
from jetrl.supervisor import Supervisor, spawn_env
from shared.auth import generate_passwords, server_authorization
from shared.bus import connect
from shared.config import ConfigError, JetRLConfig, load_config, save_config
from shared.envapi import EnvClient, EnvError
from shared.messages import EnvStarted, EnvStep
from shared.natsd import EmbeddedNats
from shared.subjects import Subjects
from shared.tasks import TaskSource, check_sections, find_task

SPLITS = ("train", "test")


@dataclass
class Verdicts:
    """The checks' one-line verdicts, printed as they come."""

    failed: list[str] = field(default_factory=list)
    passed: int = 0

    def record(self, name: str, ok: bool, detail: str) -> bool:
        print(f"{'ok  ' if ok else 'FAIL'}  {name:28s} {detail}", flush=True)
        if ok:
            self.passed += 1
        else:
            self.failed.append(name)
        return ok

    def note(self, name: str, detail: str) -> None:
        """A check that does not apply to this env (an eval-only task has no oracle): neither passed nor failed."""
        print(f"--    {name:28s} {detail}", flush=True)


def _call(name: str, arguments: Any) -> dict[str, Any]:
    args = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"role": "assistant", "content": "",
            "tool_calls": [{"id": "call_0", "type": "function", "function": {"name": name, "arguments": args}}]}


def bad_calls(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Assistant messages no env may run: what a policy early in training writes."""
    first = tools[0]["function"]
    props = first.get("parameters", {}).get("properties", {})
    wrong = {arg: {"not": ["what", "it", "takes"]} if spec.get("type") != "object" else "text"
             for arg, spec in props.items()} or {"no_such_argument": 1}
    return {"unknown tool": _call("no_such_tool_jetrl_check", {}),
            "wrong arguments": _call(first["name"], wrong),
            "arguments not JSON": _call(first["name"], "{not json"),
            "unreadable call": {"role": "assistant", "content": "<tool_call>{oops", "invalid_tool_call": "{oops"}}


class Session:
    """One episode driven through the client, turn numbers kept (the env deduplicates by them)."""

    def __init__(self, client: EnvClient, started: EnvStarted) -> None:
        self.client, self.started, self.turn, self.last = client, started, 0, EnvStep(finish=False, reward=0.0,
                                                                                  status="running", messages=[])

    async def send(self, message: dict[str, Any]) -> EnvStep:
        self.last = await self.client.interact(self.started.replica_id, self.started.session_id, message, self.turn)
        self.turn += 1
        return self.last


async def open_session(client: EnvClient, task_id: str, split: str, timeout_s: float) -> Session:
    started = await client.start(f"check-{uuid.uuid4().hex[:12]}", task_id, split, seed=0, timeout_s=timeout_s)
    return Session(client, started)


def _text(step: EnvStep) -> str:
    return " ".join(str(m.get("content", "")) for m in step.messages).replace("\n", " ").strip()


class NoOracle(Exception):
    """The env has no scripted expert (its oracle answers 500 "... has no oracle"): an eval-only task."""


async def oracle_move(session: Session) -> dict[str, Any]:
    try:
        return await session.client.oracle(session.started.replica_id, session.started.session_id)
    except EnvError as exc:
        if exc.code == "500" and "no oracle" in exc.description:
            raise NoOracle(exc.description) from None
        raise


async def play_oracle(session: Session, max_steps: int) -> EnvStep:
    while not session.last.finish and session.turn < max_steps:
        await session.send(await oracle_move(session))
    return session.last


async def check_tasks(client: EnvClient, verdicts: Verdicts) -> dict[str, list[str]]:
    """Task ids per split: some in at least one split (an eval-only task may have no train split), the same
    when asked again, no id in both."""
    ids = {split: await client.task_ids(split) for split in SPLITS}
    again = {split: await client.task_ids(split) for split in SPLITS}
    overlap = set(ids["train"]) & set(ids["test"])
    verdicts.record("tasks", any(ids.values()) and ids == again and not overlap,
                    ", ".join(f"{s} {len(v)}" for s, v in ids.items()) + " task ids; "
                    + ("stable" if ids == again else "CHANGED when asked again")
                    + (f"; {len(overlap)} in both splits" if overlap else ", disjoint"))
    return ids


async def check_oracle(client: EnvClient, verdicts: Verdicts, split: str, task_ids: list[str],
                       start_timeout_s: float) -> bool:
    """The oracle plays each task to the end with a reward in [0, 1], solving at least one; False: no oracle."""
    solved, rewards, turns, statuses = 0, [], [], set()
    for task_id in task_ids:
        session = await open_session(client, task_id, split, start_timeout_s)
        try:
            step = await play_oracle(session, session.started.max_turns + 2)
        except NoOracle as exc:
            await client.cancel(session.started.replica_id, session.started.session_id)
            verdicts.note(f"oracle {split}", f"none: {exc} (the bad-call checks end each episode by cancel)")
            return False
        solved += step.finish and step.reward > 0
        rewards.append(step.reward)
        turns.append(session.turn)
        statuses.add(step.status if step.finish else "unfinished")
    fine = solved > 0 and all(0.0 <= r <= 1.0 for r in rewards) and "unfinished" not in statuses
    verdicts.record(f"oracle {split}", fine, f"{solved}/{len(rewards)} solved, mean reward "
                    f"{sum(rewards) / max(len(rewards), 1):.2f}, {sum(turns) / max(len(turns), 1):.1f} turns, "
                    f"status {sorted(statuses)}")
    return True


async def check_bad_calls(client: EnvClient, verdicts: Verdicts, task_id: str, split: str, oracle: bool,
                          start_timeout_s: float) -> None:
    """Each bad call in a fresh session: an error observation and the episode goes on (the oracle, if any,
    then finishes it), or the episode ends with a status."""
    probe = await open_session(client, task_id, split, start_timeout_s)
    await client.cancel(probe.started.replica_id, probe.started.session_id)
    for name, message in bad_calls(probe.started.tools).items():
        session = await open_session(client, task_id, split, start_timeout_s)
        step = await session.send(message)
        said = _text(step)
        if step.finish:  # allowed, with a status
            verdicts.record(f"bad call: {name}", bool(step.status), f"ended: status {step.status}; observation "
                            f"{said[:60]!r}")
            continue
        if not oracle:
            end = await client.cancel(session.started.replica_id, session.started.session_id)
            verdicts.record(f"bad call: {name}", bool(said) and end.finish, f"observation {said[:60]!r}; went on")
            continue
        end = await play_oracle(session, session.turn + session.started.max_turns + 2)
        verdicts.record(f"bad call: {name}", bool(said) and end.finish and 0.0 <= end.reward <= 1.0,
                        f"observation {said[:60]!r}; went on, the oracle then finished it: reward {end.reward:.2f}")


async def check_cancel(client: EnvClient, verdicts: Verdicts, task_id: str, split: str, start_timeout_s: float) -> None:
    session = await open_session(client, task_id, split, start_timeout_s)
    first = await client.cancel(session.started.replica_id, session.started.session_id)
    second = await client.cancel(session.started.replica_id, session.started.session_id)
    try:
        await session.send(_call(session.started.tools[0]["function"]["name"], {}))
        gone = "still answers"
    except EnvError as exc:
        gone = exc.code
    verdicts.record("cancel", first.finish and first.status == "cancelled" and second == first and gone == "404",
                    f"status {first.status}, again {'the same' if second == first else 'DIFFERENT'}; "
                    f"then interact: {gone}")


async def check_unknown_ids(client: EnvClient, verdicts: Verdicts, split: str, start_timeout_s: float) -> None:
    codes = []
    for what in (client.start(f"check-{uuid.uuid4().hex[:12]}", "no-such-task-id", split, timeout_s=start_timeout_s),
                 client.task_ids("no-such-split")):
        try:
            codes.append("accepted" if await what else "no ids")
        except EnvError as exc:
            codes.append(exc.code)
    verdicts.record("unknown ids", codes[0] == "404" and codes[1] in ("404", "no ids"),
                    f"unknown task id: {codes[0]}, unknown split: {codes[1]}")


async def run_checks(client: EnvClient, verdicts: Verdicts, episodes: int, start_timeout_s: float) -> None:
    health = await client.health()
    verdicts.record("health", health.task == client.task and health.max_sessions > 0,
                    f"replica {health.replica_id}: task {health.task!r}, {health.sessions}/{health.max_sessions} sessions")
    ids = await check_tasks(client, verdicts)
    oracle = True
    for split in SPLITS:
        if ids[split] and oracle:
            oracle = await check_oracle(client, verdicts, split, ids[split][:episodes], start_timeout_s)
    split = next((s for s in SPLITS if ids[s]), None)
    if split is None:
        return
    await check_bad_calls(client, verdicts, ids[split][0], split, oracle, start_timeout_s)
    await check_cancel(client, verdicts, ids[split][0], split, start_timeout_s)
    await check_unknown_ids(client, verdicts, split, start_timeout_s)


async def wait_for_env(client: EnvClient, deadline_s: float, alive: Any) -> None:
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            await client.health()
            return
        except EnvError:
            if time.monotonic() > deadline or not alive():
                raise
            await asyncio.sleep(0.5)


async def check(cfg: JetRLConfig, task: str, episodes: int, wait_s: float, alive: Any = lambda: True) -> Verdicts:
    verdicts = Verdicts()
    nc = await connect(cfg.nats, "jetrl-env-check", role="rollout")  # the env's caller, with its permissions
    try:
        client = EnvClient(nc, Subjects(cfg.nats.prefix), task, timeout_s=cfg.rollout.env_timeout_s)
        try:
            await wait_for_env(client, wait_s, alive)
        except EnvError as exc:
            verdicts.record("health", False, f"no env answers for {task!r}: {exc}")
            return verdicts
        try:
            await run_checks(client, verdicts, episodes, cfg.rollout.env_start_timeout_s)
        except EnvError as exc:  # a check could not go on: the env's answer is the verdict
            verdicts.record("protocol", False, str(exc))
    finally:
        await nc.close()
    return verdicts


def cmd_env_check(task: str, config: str | None, overrides: list[str], episodes: int, wait_s: float) -> int:
    # bad calls must get observations, whatever the run does with them
    cfg = load_config(config, [*overrides, "env.invalid_action_ends_episode=false"])
    try:
        source = find_task(task, cfg.env)
        check_sections(cfg.env, [task])
    except ConfigError as exc:
        print(f"FAIL  {'settings':28s} {exc}")
        return 1
    print(f"ok    {'settings':28s} {task} from {source.origin}: {source.factory or list(source.command)}", flush=True)
    if cfg.nats.url:  # an env already serving on that server
        verdicts = asyncio.run(check(cfg, task, episodes, wait_s))
    else:
        with tempfile.TemporaryDirectory(prefix="jetrl-env-check-") as tmp:
            verdicts = _check_started(cfg, source, episodes, wait_s, Path(tmp), config)
    print(f"env-check {task}: {verdicts.passed + 1} passed, {len(verdicts.failed)} failed"
          + (f" ({', '.join(verdicts.failed)})" if verdicts.failed else ""))
    return 1 if verdicts.failed else 0


def _check_started(cfg: JetRLConfig, source: TaskSource, episodes: int, wait_s: float, run_dir: Path,
                   config: str | None) -> Verdicts:
    """A fresh nats-server with a user per role, the task's env started as ``jetrl up`` would, then the checks."""
    cfg.run.dir = str(run_dir)
    auth_dir = run_dir / "nats" / "auth"
    server = EmbeddedNats(run_dir / "nats", authorization=server_authorization(Subjects(cfg.nats.prefix),
                                                                               generate_passwords(auth_dir)))
    cfg.nats.auth_dir = str(auth_dir)
    cfg.nats.user = cfg.nats.password = cfg.nats.password_file = cfg.nats.creds_file = ""
    cfg.nats.url = server.start()
    sup = None
    try:
        asyncio.run(declare_as_admin(cfg))
        config_path = run_dir / "config.toml"
        save_config(cfg, config_path)
        sup = Supervisor(cfg, config_path, run_dir)
        spawn_env(sup, cfg, source, 0, str(Path(config).resolve().parent) if config else str(Path.cwd()))
        verdicts = asyncio.run(check(cfg, source.task, episodes, wait_s, alive=lambda: not sup.dead()))
        if sup.dead():
            verdicts.record("env process", False, f"exited\n{sup.last_log_lines(f'env-{source.task}-0')}")
        return verdicts
    finally:
        if sup is not None:
            sup.stop_all()
        server.stop()
