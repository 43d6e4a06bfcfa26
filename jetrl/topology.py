"""``jetrl topology``: declare every stream, bucket and durable consumer as the NATS admin (compose)."""

from __future__ import annotations

import argparse
import asyncio

from jetrl.errors import CliError
from jetrl.launch import declare_as_admin
from shared.config import load_config


def cmd_topology(args: argparse.Namespace, overrides: list[str]) -> int:
    """Declare every stream, bucket and durable consumer as the admin user: on an authenticated server only
    the admin may (shared/auth.py); the services wait for them. Compose runs this once as its `topology`
    service, with the run's config (the durables' lanes and ack waits come from it)."""
    cfg = load_config(args.config, overrides)
    if not cfg.nats.url:
        raise CliError("jetrl topology: set nats.url (JETRL__NATS__URL) to the server to declare on")
    asyncio.run(declare_as_admin(cfg))
    print(f"jetrl topology: streams, buckets and durables of prefix {cfg.nats.prefix} declared on {cfg.nats.url}")
    return 0
