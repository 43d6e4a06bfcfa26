"""Weights out of the trainer: publishing a version for the rollout replicas (object store, policy KV,
announcement), what a checkpoint keeps, and the final export."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import structlog
from nats.aio.client import Client
from nats.js import JetStreamContext
from nats.js.api import ObjectMeta, ObjectMetaOptions

from shared.config import TrainerConfig
from shared.delivery import retrying
from shared.digest import digest
from shared.messages import WeightsAnnouncement, decode, encode
from shared.model import lora_delta_bytes, weights_to_bytes, weights_to_bytes_of
from shared.signing import Signer, Verifier
from shared.subjects import Subjects

log = structlog.get_logger()

KEEP_DIGESTS = 256  # versions whose digest a turn is checked against: far beyond any staleness bound


def trained_weights(model: Any, lora: bool) -> bytes:
    """What a checkpoint keeps of the model: every weight, or with LoRA only the adapter."""
    if lora:
        return weights_to_bytes_of({k: v for k, v in model.named_parameters() if v.requires_grad})
    return weights_to_bytes(model)


def export(model: Any, lora: bool, path: Path) -> None:
    """The final policy as a plain Hugging Face directory (LoRA merged in): ``--model.name=<path>``."""
    (model.merge_and_unload() if lora else model).save_pretrained(path)


class Publisher:
    """Publishes each new version's weights and remembers their digests, which every turn played with
    that version must name (``intake.Intake.check``)."""

    def __init__(self, nc: Client, js: JetStreamContext, subjects: Subjects, cfg: TrainerConfig) -> None:
        self.nc, self.js, self.subjects, self.cfg = nc, js, subjects, cfg
        self.signer: Signer | None = None  # signs announcements where the run has keys (shared/signing.py)
        self.digests: dict[int, str] = {}  # version -> digest we announced

    async def announced_version(self, verifier: Verifier | None) -> int:
        """The version in the policy KV (0 = none, or unreadable). A signed entry is ours: turns still
        played with it are checked against its digest."""
        try:
            kv = await self.js.key_value(self.subjects.policy_kv)
            entry = await kv.get(self.subjects.policy_version_key)
            note = decode(entry.value or b"", WeightsAnnouncement)
            announced = (verifier.check(note) if verifier else note).version
            if verifier is not None and verifier.key is not None:
                self.digests.setdefault(note.version, note.digest)
            return announced
        except Exception as exc:  # no version yet, or an unreadable entry: our own record still holds
            log.info("no_announced_version", detail=type(exc).__name__)
            return 0

    async def publish(self, model: Any, version: int) -> None:
        lora = self.cfg.lora_rank > 0
        # LoRA: only the adapter travels, as (A, scaled B) pairs; every replica adds B @ A to its base weights
        data = await asyncio.to_thread(lora_delta_bytes if lora else weights_to_bytes, model, self.cfg.broadcast_dtype)
        # the bucket lookups too (a STREAM.INFO request): on a cluster that just lost the node this client was on,
        # or the bucket's leader, the request times out until the client reconnects and a new leader is elected
        store = await retrying("weights_bucket", lambda: self.js.object_store(self.subjects.weights_bucket))
        name = self.subjects.weights_object(version)
        # 1 MiB chunks: ~1.6x the put rate and faster reads than nats-py's 128 KiB default
        # (docs/benchmarks/scale_out.md); well under the server's max_payload.
        meta = ObjectMeta(name=name, options=ObjectMetaOptions(max_chunk_size=1024 * 1024))
        # retried across a NATS restart: a put again replaces the object, the KV write and announcement repeat
        await retrying("weights_put", lambda: store.put(name, data, meta=meta))
        # BLAKE3 (shared/digest.py): each replica checks its copy against it in one pass while the chunks arrive
        note = WeightsAnnouncement(version=version, object_name=name, digest=await asyncio.to_thread(digest, data),
                                   size=len(data), dtype=self.cfg.broadcast_dtype, format="lora" if lora else "full")
        if self.signer is not None:  # the announcement vouches for the weights: their digest is in what is signed
            note = self.signer.sign(note)
        self.digests[note.version] = note.digest
        for old in sorted(self.digests)[:-KEEP_DIGESTS]:
            del self.digests[old]
        kv = await retrying("policy_kv", lambda: self.js.key_value(self.subjects.policy_kv))
        await retrying("policy_kv_put", lambda: kv.put(self.subjects.policy_version_key, encode(note)))
        await self.nc.publish(self.subjects.weights_published, encode(note))
        old = version - self.cfg.keep_weight_versions
        if old >= 1:
            try:
                await store.delete(self.subjects.weights_object(old))
            except Exception as exc:
                log.warning("old_weights_delete_failed", version=old, error=repr(exc))
