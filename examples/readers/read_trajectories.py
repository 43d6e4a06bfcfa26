"""Read a JetRL run's finished trajectories from outside, as the read-only observer (Python, nats-py).

    jetrl creds observer --run-dir runs/latest          # writes runs/latest/nats/observer.context.json
    python examples/readers/read_trajectories.py runs/latest/nats/observer.context.json [--max N]

Every trajectory on ``<prefix>.traj.>`` since the run began, then the new ones as they come, through an
ephemeral pull consumer of the stream that this reader names (the observer may create no other kind) and
that asks for no acks (the observer reads, it never acks). Payloads are msgpack maps; their fields are in
docs/schemas/trajectory.json. Needs only ``pip install nats-py msgpack``.
"""

import argparse
import asyncio
import json
import time

import msgpack
import nats
from nats.js.api import AckPolicy, ConsumerConfig


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("context", help="the file `jetrl creds observer` wrote")
    ap.add_argument("--max", type=int, default=0, help="stop after this many trajectories (0 = never)")
    ap.add_argument("--idle-s", type=float, default=0, help="stop after this long without one (0 = never)")
    args = ap.parse_args()
    ctx = json.load(open(args.context))
    # the inbox prefix matters: the observer may subscribe only under it, and JetStream delivers to an inbox
    nc = await nats.connect(ctx["url"], user=ctx["user"] or None, password=ctx["password"] or None,
                            inbox_prefix=ctx["inbox_prefix"].encode())
    sub = await nc.jetstream().pull_subscribe(ctx["jetrl_traj_subject"], stream=ctx["jetrl_traj_stream"],
                                              config=ConsumerConfig(ack_policy=AckPolicy.NONE))
    seen, idle_since = 0, time.monotonic()
    while not args.max or seen < args.max:
        try:
            msgs = await sub.fetch(64 if not args.max else min(64, args.max - seen), timeout=1.0)
        except nats.errors.TimeoutError:
            if args.idle_s and time.monotonic() - idle_since > args.idle_s:
                break
            continue
        idle_since = time.monotonic()
        for msg in msgs:
            t = msgpack.unpackb(msg.data)
            seen += 1
            print(f"{t['task']} {t['episode_id']} reward {t['reward']:.2f} {t['status']} turns {len(t['turns'])}",
                  flush=True)
    await nc.close()


if __name__ == "__main__":
    asyncio.run(main())
