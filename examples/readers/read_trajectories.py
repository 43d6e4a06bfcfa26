"""Read a JetRL run's finished trajectories from outside, as the read-only observer (Python, nats-py).

    jetrl creds observer --run-dir runs/latest          # writes runs/latest/nats/observer.context.json
    python examples/readers/read_trajectories.py runs/latest/nats/observer.context.json [--max N]

Every trajectory on ``<prefix>.traj.>`` since the run began, then the new ones as they come (an ephemeral
pull consumer: the stream from its start, in order, dropped by the server when the reader goes). nats-py names
it in the API subject (``CONSUMER.CREATE.<stream>.<name>.<filter>``), the only way the observer may create one:
its ``subscribe(..., ordered_consumer=True)`` uses the bare ``CONSUMER.CREATE.<stream>``, which is refused. Payloads are msgpack maps; their fields
are in docs/schemas/trajectory.json. Needs only ``pip install nats-py msgpack``.
"""

import argparse
import asyncio
import json

import msgpack
import nats


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
    sub = await nc.jetstream().pull_subscribe(ctx["jetrl_traj_subject"], stream=ctx["jetrl_traj_stream"])
    seen, idle = 0, 0.0
    while not args.max or seen < args.max:
        try:
            msgs = await sub.fetch(min(64, args.max - seen) if args.max else 64, timeout=1.0)
        except (nats.errors.TimeoutError, TimeoutError):
            idle += 1.0
            if args.idle_s and idle >= args.idle_s:
                break
            continue
        idle = 0.0
        for msg in msgs:
            t = msgpack.unpackb(msg.data)
            seen += 1
            print(f"{t['task']} {t['episode_id']} reward {t['reward']:.2f} {t['status']} turns {len(t['turns'])}",
                  flush=True)
    await nc.close()


if __name__ == "__main__":
    asyncio.run(main())
