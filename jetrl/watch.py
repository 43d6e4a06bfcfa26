"""``jetrl watch``: a run's live trajectories (and with ``--events`` every action and observation)."""

from __future__ import annotations

import argparse
import asyncio
import signal
from pathlib import Path
from typing import Any

from jetrl.errors import CliError
from jetrl.rundir import run_config
from shared.bus import connect
from shared.messages import ActionEvent, BadMessage, ObservationEvent, Trajectory, decode
from shared.subjects import Subjects


def _run_target(run_dir: str | None, url: str | None, prefix: str | None) -> tuple[str, str]:
    if url:
        return url, prefix or "jetrl"
    run_dir = run_dir or "runs/latest"
    url_file = Path(run_dir) / "nats.url"
    if not url_file.is_file():
        raise CliError(f"no run in {run_dir} (no nats.url there): start one with `jetrl up`, or give --run-dir "
                       "or --url")
    lines = url_file.read_text().split()
    return lines[0], prefix or (lines[1] if len(lines) > 1 else run_config(run_dir).nats.prefix)


def cmd_watch(args: argparse.Namespace) -> int:
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `jetrl watch | head` ends quietly
    url, prefix = _run_target(args.run_dir, args.url, args.prefix)
    subjects = Subjects(prefix)
    cfg = run_config(None if args.url else args.run_dir)
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
