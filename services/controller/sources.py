"""What the controller believes about the other services comes from where it arrived, never from what a
message says about itself: a metrics report's role is the last token of its subject (``metrics.<role>``,
which only that role's users may publish: shared/auth.py), a replica's role and id are its registry key
(``<role>.<replica_id>``, writable by that role alone; an ``env-<task>`` heartbeat is an ``env``'s), and a heartbeat's age is counted from when it
arrived. A message whose body names another source is refused and counted.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import structlog
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from shared.messages import BadMessage, Heartbeat, MetricsReport, decode
from shared.subjects import Subjects, role_family

log = structlog.get_logger()

KV_OPERATION = "KV-Operation"  # NATS ADR-8: a delete or purge of a key is a message with this header


def metrics_role(subjects: Subjects, subject: str) -> str | None:
    """The role a metrics report came from: its subject's last token (None: not a metrics subject)."""
    head = subjects.metrics("")
    return subject[len(head):] if subject.startswith(head) and "." not in subject[len(head):] else None


def checked_report(subjects: Subjects, msg: Msg) -> tuple[MetricsReport | None, str]:
    """The report, if its body names the role its subject says; else None and why."""
    role = metrics_role(subjects, msg.subject)
    if role is None:
        return None, f"not a metrics subject: {msg.subject}"
    try:
        report = decode(msg.data, MetricsReport)
    except BadMessage as exc:
        return None, exc.reason
    if report.role != role:
        return None, f"a report on {msg.subject} names role {report.role!r}"
    return report, ""


@dataclass
class Replica:
    role: str
    replica_id: str
    beat: Heartbeat
    seen_at: float  # monotonic time of the last heartbeat


class Replicas:
    """Live replicas from the registry bucket's writes, followed on their subjects (``$KV.<registry>.>``):
    no consumer of the controller's own on a bucket it writes to (shared/auth.py). A replica not heard
    from for ``ttl_s`` is gone, as its key is."""

    def __init__(self, subjects: Subjects, ttl_s: float) -> None:
        self.subjects, self.ttl_s = subjects, ttl_s
        self.live: dict[str, Replica] = {}
        self.refused = 0

    async def follow(self, nc: Client) -> Subscription:
        return await nc.subscribe(self.subjects.registry_entry_prefix + ">", cb=self.on_entry)

    async def on_entry(self, msg: Msg) -> None:
        self.take(msg.subject, msg.data, (msg.headers or {}).get(KV_OPERATION, ""))

    def take(self, subject: str, data: bytes, operation: str = "") -> None:
        head = self.subjects.registry_entry_prefix
        key = subject[len(head):] if subject.startswith(head) else ""
        role, _, replica_id = key.partition(".")
        if not role or not replica_id or "." in replica_id:
            return self._refuse(subject, "not a <role>.<replica_id> key")
        if operation in ("DEL", "PURGE"):
            self.live.pop(key, None)
            return None
        try:
            beat = decode(data, Heartbeat)
        except BadMessage as exc:
            return self._refuse(subject, exc.reason)
        if (role_family(beat.role), beat.replica_id) != (role, replica_id):
            return self._refuse(subject, f"the heartbeat names {beat.role}/{beat.replica_id}")
        self.live[key] = Replica(role=beat.role, replica_id=replica_id, beat=beat, seen_at=time.monotonic())
        return None

    def _refuse(self, subject: str, reason: str) -> None:
        self.refused += 1
        log.warning("registry_entry_refused", subject=subject, reason=reason)

    def rows(self) -> list[dict[str, Any]]:
        now = time.monotonic()
        for key in [k for k, r in self.live.items() if now - r.seen_at > self.ttl_s]:
            del self.live[key]
        out = [{"role": r.role, "replica_id": r.replica_id, "host": r.beat.host, "pid": r.beat.pid,
                "age_s": round(now - r.seen_at, 2), "info": r.beat.info} for r in self.live.values()]
        return sorted(out, key=lambda r: (r["role"], r["replica_id"]))
