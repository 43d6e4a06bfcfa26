"""The digest that proves a replica got the trainer's weights: ``algorithm:hex``, checked in one pass.

The trainer writes it into the ``WeightsAnnouncement`` (the policy KV only the trainer may write,
``shared.auth``); a replica hashes the object's chunks as they arrive (``shared.objectread.read_object``) and refuses
weights whose digest differs. BLAKE3 (~5 GB/s on one core here, SHA-256 ~1 GB/s with SHA-NI) keeps the check
cryptographic at a fraction of the cost; SHA-256 is still read (an older trainer's announcements, and the
digest the object store records).
"""

from __future__ import annotations

import hashlib
from typing import Any

DIGESTS = ("blake3", "sha256")
"""Digest algorithms a replica checks; the first is what the trainer writes."""


def new_hasher(algorithm: str) -> Any:
    """An incremental hasher (``update`` / ``hexdigest``) for one of ``DIGESTS``."""
    if algorithm == "blake3":
        from blake3 import blake3

        return blake3()
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown digest algorithm {algorithm!r} (known: {', '.join(DIGESTS)})")


def digest(data: bytes | bytearray | memoryview, algorithm: str = DIGESTS[0]) -> str:
    """``algorithm:hex``, as a ``WeightsAnnouncement`` carries it."""
    hasher = new_hasher(algorithm)
    hasher.update(data)
    return f"{algorithm}:{hasher.hexdigest()}"


def split_digest(text: str) -> tuple[str, str]:
    """``"blake3:ab12..."`` -> ``("blake3", "ab12...")``; an unknown algorithm is refused."""
    algorithm, _, hexdigest = text.partition(":")
    if algorithm not in DIGESTS or not hexdigest:
        raise ValueError(f"digest {text[:80]!r}: expected one of {', '.join(a + ':<hex>' for a in DIGESTS)}")
    return algorithm, hexdigest
