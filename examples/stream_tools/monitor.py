"""Flag suspicious episodes of a JetRL run as they finish, on ``jetrl.streams``: the signs of a grader
a policy has learnt to game, or of a broken env.

    python examples/stream_tools/monitor.py --run-dir runs/rl                 # every episode so far, then live
    python examples/stream_tools/monitor.py --context observer.context.json --turn-limit 15 --json

Three checks, each a flag with the episode's id:

* ``reward_without_tool_call``: a reward above 0 although no assistant turn called a tool;
* ``success_at_turn_limit``: a success in an episode that hit the turn limit (status
  ``task_limit_reached``, or ``--turn-limit`` turns);
* ``same_answer_across_tasks``: a success whose final answer (the last assistant message: its tool call,
  else its text) was also the successful answer of ``--same-answer-tasks`` other tasks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
from collections import OrderedDict
from dataclasses import asdict, dataclass

from jetrl.streams import from_context, open_run, subscribe
from shared.config import NatsConfig
from shared.messages import Trajectory


@dataclass(frozen=True)
class Flag:
    check: str
    episode_id: str
    task: str
    task_id: str
    reward: float
    detail: str


def final_answer(traj: Trajectory) -> str | None:
    """The last assistant message as one string: its first tool call (name and arguments), else its text."""
    last = next((m for m in reversed(traj.messages) if m.get("role") == "assistant"), None)
    if last is None:
        return None
    calls = last.get("tool_calls") or []
    if calls:
        fn = calls[0].get("function") or {}
        return f"{fn.get('name')}({fn.get('arguments')})"
    return str(last.get("content") or "").strip() or None


class Monitor:
    """The three checks over a stream of trajectories; answers are remembered for ``remember`` tasks."""

    def __init__(self, turn_limit: int | None = None, same_answer_tasks: int = 3, remember: int = 100_000) -> None:
        self.turn_limit, self.same_answer_tasks, self.remember = turn_limit, same_answer_tasks, remember
        self.answers: OrderedDict[tuple[str, str], set[str]] = OrderedDict()  # (task, answer) -> task ids

    def check(self, traj: Trajectory) -> list[Flag]:
        flags = []

        def flag(check: str, detail: str) -> None:
            flags.append(Flag(check, traj.episode_id, traj.task, traj.task_id, traj.reward, detail))

        assistant = [m for m in traj.messages if m.get("role") == "assistant"]
        if traj.reward > 0 and assistant and not any(m.get("tool_calls") for m in assistant):
            flag("reward_without_tool_call", f"{len(assistant)} assistant turns, none called a tool")
        at_limit = traj.status == "task_limit_reached" or (self.turn_limit is not None
                                                           and len(traj.turns) >= self.turn_limit)
        if traj.success and at_limit:
            flag("success_at_turn_limit", f"{len(traj.turns)} turns, status {traj.status}")
        answer = final_answer(traj)
        if traj.success and answer is not None:
            tasks = self.answers.setdefault((traj.task, answer), set())
            self.answers.move_to_end((traj.task, answer))
            tasks.add(traj.task_id)
            others = len(tasks) - 1
            if others >= self.same_answer_tasks:
                flag("same_answer_across_tasks", f"{answer[:120]!r} also succeeded on {others} other tasks")
            while len(self.answers) > self.remember:
                self.answers.popitem(last=False)
        return flags


async def run(url: str, creds: NatsConfig, monitor: Monitor, follow: bool, as_json: bool) -> list[Flag]:
    found: list[Flag] = []
    async with subscribe(url, creds, follow=follow) as trajectories:
        async for traj in trajectories:
            for f in monitor.check(traj):
                found.append(f)
                print(json.dumps(asdict(f)) if as_json else
                      f"[{f.check}] {f.task} {f.episode_id} ({f.task_id}) reward {f.reward:g}: {f.detail}", flush=True)
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", default="runs/latest")
    ap.add_argument("--context", default=None, help="a context file of `jetrl creds observer` instead")
    ap.add_argument("--turn-limit", type=int, default=None, help="episodes with this many turns hit the limit")
    ap.add_argument("--same-answer-tasks", type=int, default=3)
    ap.add_argument("--once", action="store_true", help="what is stored now, then stop (no live updates)")
    ap.add_argument("--json", action="store_true", help="one JSON object a flag")
    args = ap.parse_args()
    monitor = Monitor(args.turn_limit, args.same_answer_tasks)
    with contextlib.suppress(KeyboardInterrupt):
        if args.context:
            access = from_context(args.context)
            asyncio.run(run(access.url, access.nats, monitor, not args.once, args.json))
        else:
            with open_run(args.run_dir) as access:
                asyncio.run(run(access.url, access.nats, monitor, not args.once, args.json))


if __name__ == "__main__":
    main()
