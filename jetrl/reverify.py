"""``jetrl reverify``: grade stored episodes again, against a fresh session of their env.

Each trajectory holds its action log (``Trajectory.messages``: every assistant message as the env received
it). A replay opens a new session of the same task, split and seed (``shared.envapi.episode_seed``), sends
the same messages turn by turn, and compares what comes back with what was stored: the grade (reward and
status) and, on the way, the opening and each answer. This is the env contract's replay rule ("given the
task spec, seed and the ordered action log, a new replica rebuilds the same session state"), and how a
grader fix is checked against the episodes already played.

    jetrl reverify --run-dir runs/rl --env.<task>.levels=[1,2]  # any config change the new env should have

The command reads the run's trajectories as the observer and replays them against env services it starts
itself (``python -m services.envs <task>``, the run's config with the overrides) on a nats-server of its
own: a live run's env replicas are never touched. A task's env is started as ``jetrl up`` starts it
(``shared/tasks.py``: a built-in task, a plugin's factory, or an external program). Every result goes to
``--out`` (JSONL); the episodes whose grade differs are printed.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile
import time
import uuid
from collections.abc import AsyncIterable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from nats.aio.client import Client

from jetrl.errors import CliError
from jetrl.streams import TrajectoryStream, open_run
from jetrl.supervisor import Supervisor, spawn_env  # the way `jetrl up` starts a task's env (shared/tasks.py)
from shared.bus import connect
from shared.config import load_config, save_config
from shared.envapi import EnvClient, EnvError, episode_seed
from shared.messages import Trajectory
from shared.natsd import EmbeddedNats
from shared.subjects import Subjects
from shared.tasks import find_task

REWARD_TOLERANCE = 1e-9
ROLLOUT_ENDINGS = frozenset({"agent_context_limit", "task_limit_reached", "cancelled", "timeout"})
"""Statuses the rollout (not the env) gives an episode it stopped: a replay that ends unfinished matches them."""


@dataclass
class Regrade:
    """One stored episode graded again."""

    episode_id: str
    task: str
    task_id: str
    split: str
    stored_reward: float
    stored_status: str
    replayed_reward: float | None = None
    replayed_status: str | None = None
    turns: int = 0
    """Actions replayed (the env may end the episode before the stored log does)."""
    stored_turns: int = 0
    opening_differs: bool = False
    answers_differ: list[int] = field(default_factory=list)
    """Turns whose env answer is not the stored one."""
    error: str = ""
    """Why the episode could not be replayed (no action log, no env for its task, an env error)."""

    @property
    def changed(self) -> bool:
        """The grade differs: another reward, or another status where both come from the env."""
        if self.error or self.replayed_reward is None:
            return False
        if abs(self.replayed_reward - self.stored_reward) > REWARD_TOLERANCE:
            return True
        unfinished = self.replayed_status == "running"
        return not (unfinished and self.stored_status in ROLLOUT_ENDINGS) and self.replayed_status != self.stored_status

    def as_dict(self) -> dict[str, Any]:
        return asdict(self) | {"changed": self.changed}


def _answers(messages: list[dict[str, Any]], turns: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]],
                                                                   list[list[dict[str, Any]]]]:
    """The opening, the actions (the last ``turns`` assistant messages: an opening may hold an example
    conversation) and each action's stored answer."""
    positions = [i for i, m in enumerate(messages) if m.get("role") == "assistant"][-turns:] if turns else []
    if not positions:
        return messages, [], []
    ends = positions[1:] + [len(messages)]
    return (messages[:positions[0]], [messages[i] for i in positions],
            [messages[i + 1:end] for i, end in zip(positions, ends, strict=True)])


def _same_answer(stored: list[dict[str, Any]], replayed: list[dict[str, Any]]) -> bool:
    def text(ms: list[dict[str, Any]]) -> list[tuple[str, str]]:
        return [(str(m.get("role")), str(m.get("content"))) for m in ms]
    return text(stored) == text(replayed)


async def replay(nc: Client, subjects: Subjects, traj: Trajectory, timeout_s: float = 30.0) -> Regrade:
    """Replay one stored episode against ``subjects``' env services on ``nc``."""
    result = Regrade(episode_id=traj.episode_id, task=traj.task, task_id=traj.task_id, split=traj.split,
                     stored_reward=traj.reward, stored_status=traj.status, stored_turns=len(traj.turns))
    opening, actions, stored_answers = _answers(traj.messages, len(traj.turns))
    if not actions:
        result.error = "no action log (the env could not run the episode, or its writer did not record one)"
        return result
    env = EnvClient(nc, subjects, traj.task, timeout_s)
    session = f"reverify-{traj.episode_id}-{uuid.uuid4().hex[:8]}"
    try:
        started = await env.start(session, traj.task_id, traj.split, seed=episode_seed(traj.episode_id))
        result.opening_differs = [m.get("content") for m in started.messages] != [m.get("content") for m in opening]
        step = None
        for turn, action in enumerate(actions):
            step = await env.interact(started.replica_id, session, action, turn=turn)
            result.turns = turn + 1
            if not _same_answer(stored_answers[turn], step.messages):
                result.answers_differ.append(turn)
            if step.finish:
                break
        assert step is not None
        result.replayed_reward = step.reward
        result.replayed_status = step.status if step.finish else "running"
        if not step.finish:
            await env.cancel(started.replica_id, session, reason="reverify")
    except EnvError as exc:
        result.error = f"env error {exc.code}: {exc}"
    return result


@dataclass
class ReverifySummary:
    replayed: int = 0
    changed: int = 0
    failed: int = 0
    """Episodes that could not be replayed (see each one's ``error``)."""


async def reverify(trajectories: AsyncIterable[Trajectory], nc: Client, subjects: Subjects,
                   on_result: Callable[[Regrade], None], concurrency: int = 4,
                   timeout_s: float = 30.0) -> ReverifySummary:
    """Replay every trajectory (``concurrency`` at a time), calling ``on_result`` with each regrade."""
    summary = ReverifySummary()
    running: set[asyncio.Task[Regrade]] = set()

    def collect(done: set[asyncio.Task[Regrade]]) -> None:
        for task in done:
            regrade = task.result()
            summary.replayed += regrade.error == ""
            summary.changed += regrade.changed
            summary.failed += regrade.error != ""
            on_result(regrade)

    async for traj in trajectories:
        running.add(asyncio.create_task(replay(nc, subjects, traj, timeout_s)))
        if len(running) >= concurrency:
            done, running = await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
            collect(done)
    if running:
        done, _ = await asyncio.wait(running)
        collect(done)
    return summary


# ---------------------------------------------------------------------------- the command
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run-dir", default="runs/latest", help="the run whose episodes to grade again")
    p.add_argument("--task", action="append", default=[], help="only this task (repeatable)")
    p.add_argument("--out", default=None, help="every result as JSONL (default <run>/reverify.jsonl)")
    p.add_argument("--concurrency", type=int, default=4, help="episodes replayed at once")


def _wait_for_envs(cfg: Any, tasks: list[str], sup: Any, timeout_s: float = 180.0) -> None:
    """Until each task's env answers its health endpoint; an env that exits says so, with its log."""
    async def ready() -> None:
        nc = await connect(cfg.nats, "jetrl-reverify-wait")
        try:
            deadline = time.monotonic() + timeout_s
            for task in tasks:
                while True:
                    dead = sup.dead()
                    if dead:
                        name, rc = dead[0]
                        raise CliError(f"the env service {name} exited with {rc}:\n{sup.last_log_lines(name)}")
                    try:
                        await EnvClient(nc, Subjects(cfg.nats.prefix), task, timeout_s=2.0).health()
                        break
                    except EnvError:
                        if time.monotonic() > deadline:
                            raise CliError(f"the {task} env service did not answer within {timeout_s:.0f}s") from None
                        await asyncio.sleep(0.5)
        finally:
            await nc.close()

    asyncio.run(ready())


def cmd_reverify(args: argparse.Namespace, overrides: list[str]) -> int:
    run_dir = Path(args.run_dir)
    out = Path(args.out) if args.out else run_dir / "reverify.jsonl"
    with open_run(run_dir, overrides) as access, tempfile.TemporaryDirectory(prefix="jetrl-reverify-") as scratch:
        cfg = load_config(run_dir / "config.toml", list(overrides))  # the env services: the run's config + overrides
        tasks = [t for t, share in cfg.run.tasks.items() if share > 0 and (not args.task or t in args.task)]
        cfg.run.dir = str(out.parent / "reverify")
        if not tasks:
            raise CliError(f"no task to replay: the run's tasks are {', '.join(cfg.run.tasks)}")
        server = EmbeddedNats(Path(scratch) / "nats")  # our own: a live run's env replicas are never used
        cfg.nats.url = server.start()
        cfg.nats.user = cfg.nats.password = cfg.nats.password_file = cfg.nats.creds_file = cfg.nats.auth_dir = ""
        cfg.nats.prefix = "reverify"
        config_path = Path(scratch) / "reverify.toml"
        save_config(cfg, config_path)
        logs_dir = out.parent / "reverify"
        sup = Supervisor(cfg, config_path, logs_dir)
        try:
            for task in tasks:
                spawn_env(sup, cfg, find_task(task, cfg.env), 0, os.getcwd())
            _wait_for_envs(cfg, tasks, sup)
            summary = asyncio.run(_run(access, cfg, tasks, out, args.concurrency))
        finally:
            sup.stop_all()
            server.stop()
    print(f"jetrl reverify: {summary.replayed} episodes replayed, {summary.changed} graded differently, "
          f"{summary.failed} could not be replayed; every result in {out}")
    return 0


async def _run(access: Any, cfg: Any, tasks: list[str], out: Path, concurrency: int) -> ReverifySummary:
    stream = TrajectoryStream(access.url, access.nats, tasks=tasks, follow=False, name="jetrl-reverify")
    nc = await connect(cfg.nats, "jetrl-reverify")
    try:
        with open(out, "w", encoding="utf-8") as fh:
            def report(regrade: Regrade) -> None:
                fh.write(json.dumps(regrade.as_dict()) + "\n")
                if regrade.changed:
                    print(f"  {regrade.task} {regrade.episode_id} ({regrade.task_id}): reward {regrade.stored_reward:g} "
                          f"{regrade.stored_status} -> {regrade.replayed_reward:g} {regrade.replayed_status}", flush=True)

            async with stream:
                return await reverify(stream, nc, Subjects(cfg.nats.prefix), report, concurrency)
    finally:
        await nc.close()
