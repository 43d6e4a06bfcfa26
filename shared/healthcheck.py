"""A container healthcheck for every role: ``python -m shared.healthcheck [--http URL] [--config FILE]``.

Healthy when this host (the container) has a replica in the registry KV whose last heartbeat is
younger than ``nats.heartbeat_ttl_s``: the process is alive, its event loop turns, and it
reaches NATS. ``--http URL`` also needs ``GET URL`` to answer 200 (the controller's /status).
Exit status 0 = healthy, 1 = not (the reason on stderr). NATS settings come from the config file and
the ``JETRL__`` environment, as for the service itself.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import time
import urllib.request

from shared.auth import controller_token
from shared.bus import connect
from shared.config import load_config
from shared.messages import Heartbeat, decode
from shared.subjects import Subjects


async def registry_ages(config: str | None, host: str) -> dict[str, float]:
    """Heartbeat age in seconds of every serving replica registered from ``host``."""
    cfg = load_config(config)
    cfg.nats.connect_timeout_s = min(cfg.nats.connect_timeout_s, 5.0)
    subjects = Subjects(cfg.nats.prefix)
    nc = await connect(cfg.nats, "healthcheck")
    try:
        # no consumer on the registry (every service writes it, and a consumer's deliveries could be pointed
        # anywhere: shared/auth.py): its keys from the stream's subjects, each entry by a (JSON) message get
        js, stream = nc.jetstream(), f"KV_{subjects.registry_kv}"
        info = await js.stream_info(stream, subjects_filter=subjects.registry_entry_prefix + ">")
        ages = {}
        for subject in info.state.subjects or {}:
            try:
                beat = decode((await js.get_msg(stream, subject=subject)).data or b"", Heartbeat)
            except Exception:
                continue
            # an env replica still building its task data heartbeats, but does not serve yet
            if beat.host == host and beat.info.get("state") != "building":
                ages[beat.replica_id] = time.time() - beat.ts
        return ages
    finally:
        await nc.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None)
    ap.add_argument("--http", default=None, help="also GET this URL and expect 200")
    ap.add_argument("--host", default=socket.gethostname(), help="the host whose replicas count (default: this one)")
    args = ap.parse_args(argv)
    ttl = load_config(args.config).nats.heartbeat_ttl_s
    try:
        ages = asyncio.run(asyncio.wait_for(registry_ages(args.config, args.host), timeout=8.0))
    except Exception as exc:
        print(f"unhealthy: registry not readable: {exc!r}", file=sys.stderr)
        return 1
    fresh = {r: a for r, a in ages.items() if a < ttl}
    if not fresh:
        print(f"unhealthy: no replica of host {args.host} heartbeating (seen: {ages})", file=sys.stderr)
        return 1
    if args.http:
        try:
            request = urllib.request.Request(args.http)
            token = controller_token(load_config(args.config).controller)
            if token:  # the status API may want its bearer token (controller.http_token[_file])
                request.add_header("Authorization", f"Bearer {token}")
            with urllib.request.urlopen(request, timeout=5) as resp:
                if resp.status != 200:
                    raise OSError(f"HTTP {resp.status}")
        except OSError as exc:
            print(f"unhealthy: {args.http}: {exc}", file=sys.stderr)
            return 1
    print("healthy: " + ", ".join(f"{r} ({a:.1f}s)" for r, a in sorted(fresh.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
