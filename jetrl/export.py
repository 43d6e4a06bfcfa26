"""``jetrl export``: a run's trajectories as a dataset file (Parquet or JSONL, the chat format of
``jetrl/dataset.py``), filtered, streamed from the TRAJ stream to the file with bounded memory.

    jetrl export --run-dir runs/rl -o rl.parquet --status completed --min-reward 1
    jetrl export --url nats://host:4222 --prefix jetrl --nats.user=observer \\
        --nats.password_file=observer.pw --task mytask --since 2026-12-01T00:00 -o mytask.jsonl --tokens

From a run directory the run's own server is used while the run is live; a finished run's store is
opened by a nats-server of our own (``jetrl.streams.open_run``). Progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from jetrl.dataset import FORMATS, RowWriter, encoded_size, format_of, trajectory_row
from jetrl.errors import CliError
from jetrl.streams import RunAccess, TrajectoryStream, open_run
from shared.config import load_config
from shared.messages import Trajectory
from shared.progress import Progress


@dataclass
class TrajectoryFilter:
    """Which trajectories to keep; every condition given must hold."""

    tasks: list[str] = field(default_factory=list)
    splits: list[str] = field(default_factory=list)
    statuses: list[str] = field(default_factory=list)
    min_reward: float = -math.inf
    max_reward: float = math.inf
    min_policy_version: int | None = None
    """Every turn's policy version at least this (oracle and API turns have -1)."""
    max_policy_version: int | None = None
    since: float | None = None
    """Stored at or after this unix time (the stream's timestamp)."""
    until: float | None = None

    def keep(self, traj: Trajectory, stored_at: float) -> bool:
        versions = [t.policy_version for t in traj.turns]
        return ((not self.tasks or traj.task in self.tasks) and (not self.splits or traj.split in self.splits)
                and (not self.statuses or traj.status in self.statuses)
                and self.min_reward <= traj.reward <= self.max_reward
                and (self.min_policy_version is None or min(versions, default=-1) >= self.min_policy_version)
                and (self.max_policy_version is None or max(versions, default=-1) <= self.max_policy_version)
                and (self.since is None or stored_at >= self.since)
                and (self.until is None or stored_at <= self.until))


@dataclass
class ExportResult:
    read: int
    written: int
    bad: int
    path: Path


def parse_time(text: str | None) -> float | None:
    """Unix seconds, or an ISO 8601 time (``2026-12-01T08:00``; without a zone: UTC)."""
    if not text:
        return None
    try:
        return float(text)
    except ValueError:
        pass
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise CliError(f"jetrl export: {text!r} is neither unix seconds nor an ISO 8601 time") from None
    return (when if when.tzinfo else when.replace(tzinfo=dt.UTC)).timestamp()


async def export(access: RunAccess, out: Path, fmt: str, keep: TrajectoryFilter, tokens: bool = False,
                 progress: bool = True) -> ExportResult:
    """Every stored trajectory that ``keep`` keeps, to ``out``; reads the stream once, to its end as it
    was when the export began."""
    stream = TrajectoryStream(access.url, access.nats, tasks=keep.tasks, since=keep.since, follow=False,
                              name="jetrl-export")
    writer = RowWriter(out, fmt, tokens=tokens)
    read = written = 0
    bar = None
    try:
        async with stream:
            if progress:
                bar = Progress("jetrl export", total=await stream.stored(), unit="trajectories")
            async for traj in stream:
                read += 1
                assert stream.position is not None
                if keep.until is not None and stream.position.time > keep.until:
                    break
                if keep.keep(traj, stream.position.time):
                    writer.write(trajectory_row(traj, tokens), size_hint=encoded_size(traj))
                    written += 1
                if bar is not None:
                    bar.set(read + stream.bad, f"{written} written")
    finally:
        writer.close()
        if bar is not None:
            bar.close()
    return ExportResult(read=read, written=written, bad=stream.bad, path=out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--out", required=True, help="file to write (.parquet or .jsonl)")
    p.add_argument("--format", choices=FORMATS, default=None, help="default: from the file's suffix")
    p.add_argument("--run-dir", default=None, help="the run whose stream to read (default runs/latest)")
    p.add_argument("--url", default=None, help="a NATS URL instead of a run directory (with --prefix; credentials "
                                               "as --nats.user=observer --nats.password_file=FILE or JETRL__NATS__*)")
    p.add_argument("--prefix", default=None, help="the run's prefix on --url (default jetrl)")
    p.add_argument("--task", action="append", default=[], help="only this task (repeatable)")
    p.add_argument("--split", action="append", default=[], help="only this split: train, test, ... (repeatable)")
    p.add_argument("--status", action="append", default=[], help="only this status, e.g. completed (repeatable)")
    p.add_argument("--min-reward", type=float, default=-math.inf)
    p.add_argument("--max-reward", type=float, default=math.inf)
    p.add_argument("--min-policy-version", type=int, default=None, help="every turn from this version or newer")
    p.add_argument("--max-policy-version", type=int, default=None, help="every turn from this version or older")
    p.add_argument("--since", default=None, help="stored at or after: unix seconds or ISO 8601 (UTC if no zone)")
    p.add_argument("--until", default=None, help="stored at or before (as --since)")
    p.add_argument("--tokens", action="store_true", help="also token ids, behaviour logprobs, loss mask, turn spans")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def cmd_export(args: argparse.Namespace, overrides: Sequence[str]) -> int:
    out = Path(args.out)
    try:
        fmt = format_of(out, args.format)
    except ValueError as exc:
        raise CliError(f"jetrl export: {exc}") from None
    if fmt == "parquet":
        try:
            import pyarrow  # noqa: F401
        except ImportError:
            raise CliError("jetrl export: Parquet needs pyarrow (pip install 'jetrl[data]'), or write .jsonl") from None
    keep = TrajectoryFilter(tasks=args.task, splits=args.split, statuses=args.status, min_reward=args.min_reward,
                            max_reward=args.max_reward, min_policy_version=args.min_policy_version,
                            max_policy_version=args.max_policy_version, since=parse_time(args.since),
                            until=parse_time(args.until))

    async def run(access: RunAccess) -> ExportResult:
        return await export(access, out, fmt, keep, tokens=args.tokens, progress=not args.no_progress)

    if args.url:
        cfg = load_config(None, list(overrides))
        cfg.nats.prefix = args.prefix or cfg.nats.prefix
        result = asyncio.run(run(RunAccess(args.url, cfg.nats)))
    else:
        with open_run(args.run_dir or "runs/latest", overrides) as access:
            result = asyncio.run(run(access))
    bad = f", {result.bad} undecodable skipped" if result.bad else ""
    print(f"jetrl export: {result.written} of {result.read} trajectories -> {result.path} ({fmt}){bad}",
          file=sys.stderr)
    return 0
