"""The run's own traffic: weights announcements, the registry's heartbeats, metrics, dead letters, run
control and the trainer's last word."""

from __future__ import annotations

from typing import Any

import msgspec

from shared.messages.base import Message, now


class WeightsAnnouncement(Message, tag="weights", kw_only=True):
    version: int
    object_name: str
    digest: str
    size: int
    dtype: str
    ts: float = msgspec.field(default_factory=now)
    format: str = "full"
    """``full``: every weight; ``lora``: an adapter (``shared.model.lora_delta``) to add to the base weights."""
    signature: str = ""
    """The trainer's Ed25519 signature (hex) of the run's prefix and this message without it (shared/signing.py)."""


class Heartbeat(Message, tag="heartbeat", kw_only=True):
    """A replica's entry in the registry KV (key: ``<user role>.<replica id>``, e.g. ``env.<id>``), rewritten every
    few seconds."""

    role: str
    """What it is: ``trainer``, ``controller``, ``rollout``, ``env-<task>``."""
    replica_id: str
    """Its id, the same as its key's last token."""
    pid: int
    """Its process id on ``host``."""
    host: str
    """The host (container) it runs on."""
    started_at: float
    """When it started (Unix seconds)."""
    info: dict[str, Any] = msgspec.field(default_factory=dict)
    """What the role adds (an env: ``{"task": str, "max_sessions": int}``)."""
    ts: float = msgspec.field(default_factory=now)
    """When this beat was written (Unix seconds)."""


class MetricsReport(Message, tag="metrics", kw_only=True):
    role: str
    replica_id: str
    step: int
    values: dict[str, float]
    ts: float = msgspec.field(default_factory=now)


class DeadLetter(Message, tag="dead_letter", kw_only=True):
    """A message a service could not accept, kept with the reason (stream DLQ, subject ``dlq.<service>``)."""

    origin_subject: str
    """The subject it came on."""
    reason: str
    """Why it was refused (the codec's reason, with the field path)."""
    payload: bytes
    """Its bytes (up to 4 MiB)."""
    service: str
    """Who refused it (``env-<task>``, ``trainer``, ...)."""
    ts: float = msgspec.field(default_factory=now)
    """When (Unix seconds)."""


class RunControl(Message, tag="run_control", kw_only=True):
    event: str
    step: int = 0
    info: dict[str, Any] = msgspec.field(default_factory=dict)
    ts: float = msgspec.field(default_factory=now)
    signature: str = ""
    """The controller's Ed25519 signature (hex) of the run's prefix and this message without it."""


class TrainingFinished(Message, tag="training_finished", kw_only=True):
    """The trainer's word that it has done its last step (subject ``trainer.finished``, trainer only):
    the controller ends the plan on this, never on a policy version it did not expect."""

    step: int
    policy_version: int
    replica_id: str
    ts: float = msgspec.field(default_factory=now)
    signature: str = ""
    """The trainer's Ed25519 signature (hex) of the run's prefix and this message without it."""
