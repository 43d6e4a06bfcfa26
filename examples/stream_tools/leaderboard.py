"""A live per-task leaderboard of a JetRL run, on ``jetrl.streams``.

    python examples/stream_tools/leaderboard.py --run-dir runs/rl            # every episode so far, then live
    jetrl creds observer --run-dir runs/rl                                   # from another machine: a context file
    python examples/stream_tools/leaderboard.py --context observer.context.json --recent 200

One row per task, redrawn every ``--every-s`` seconds: episodes, success and mean reward over the whole run
and over the last ``--recent`` episodes, mean turns, and the newest policy version seen.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections import deque
from dataclasses import dataclass, field

from jetrl.streams import from_context, open_run, subscribe
from shared.config import NatsConfig
from shared.messages import Trajectory


@dataclass
class TaskRow:
    episodes: int = 0
    successes: int = 0
    reward: float = 0.0
    turns: int = 0
    newest_version: int = -1
    recent: deque[tuple[bool, float]] = field(default_factory=deque)


class Leaderboard:
    """Per-task figures over every trajectory added, and over the last ``recent`` of each task."""

    def __init__(self, recent: int = 100) -> None:
        self.recent = recent
        self.tasks: dict[str, TaskRow] = {}

    def add(self, traj: Trajectory) -> None:
        row = self.tasks.setdefault(traj.task, TaskRow(recent=deque(maxlen=self.recent)))
        row.episodes += 1
        row.successes += traj.success
        row.reward += traj.reward
        row.turns += len(traj.turns)
        row.newest_version = max([row.newest_version, *(t.policy_version for t in traj.turns)])
        row.recent.append((traj.success, traj.reward))

    def table(self) -> list[dict[str, float | int | str]]:
        """The rows, best recent success first."""
        out = []
        for task, r in self.tasks.items():
            recent = len(r.recent)
            out.append({"task": task, "episodes": r.episodes, "success": r.successes / r.episodes,
                        "reward": r.reward / r.episodes, "recent_success": sum(s for s, _ in r.recent) / recent,
                        "recent_reward": sum(x for _, x in r.recent) / recent, "turns": r.turns / r.episodes,
                        "policy_version": r.newest_version})
        return sorted(out, key=lambda row: (-float(row["recent_success"]), str(row["task"])))

    def render(self) -> str:
        lines = [f"{'task':12s} {'episodes':>8s} {'success':>8s} {'reward':>7s} {'recent':>7s} {'turns':>6s} {'v':>5s}"]
        for row in self.table():
            lines.append(f"{row['task']:12s} {row['episodes']:8d} {row['success']:8.3f} {row['reward']:7.3f} "
                         f"{row['recent_success']:7.3f} {row['turns']:6.2f} {row['policy_version']:5d}")
        return "\n".join(lines)


async def run(url: str, creds: NatsConfig, recent: int, every_s: float, follow: bool) -> Leaderboard:
    board = Leaderboard(recent)
    shown = 0.0
    async with subscribe(url, creds, follow=follow) as trajectories:
        async for traj in trajectories:
            board.add(traj)
            if time.monotonic() - shown >= every_s:
                shown = time.monotonic()
                print(f"\n{time.strftime('%H:%M:%S')}  (stream sequence {trajectories.position.sequence})\n"
                      + board.render(), flush=True)
    print(board.render(), flush=True)
    return board


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--run-dir", default="runs/latest")
    ap.add_argument("--context", default=None, help="a context file of `jetrl creds observer` instead")
    ap.add_argument("--recent", type=int, default=100, help="the recent columns cover this many episodes a task")
    ap.add_argument("--every-s", type=float, default=5.0)
    ap.add_argument("--once", action="store_true", help="what is stored now, then stop (no live updates)")
    args = ap.parse_args()
    with contextlib.suppress(KeyboardInterrupt):
        if args.context:
            access = from_context(args.context)
            asyncio.run(run(access.url, access.nats, args.recent, args.every_s, not args.once))
        else:
            with open_run(args.run_dir) as access:
                asyncio.run(run(access.url, access.nats, args.recent, args.every_s, not args.once))


if __name__ == "__main__":
    main()
