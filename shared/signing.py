"""Ed25519 signatures on the control messages, defence in depth against whatever the bus lets through
(a message the server delivers on a client's behalf, a credential that leaked): the trainer signs every
``WeightsAnnouncement`` (the weights' digest is in it, so it also vouches for the bytes) and its
``TrainingFinished``, the controller its ``RunControl``. The signed bytes are the run's prefix and the
message encoded with an empty ``signature``: a signature holds for one message of one kind in one run.

Keys: ``generate_signing_keys`` writes a private key per signer (``<dir>/<signer>.signing.key``, 0600, read
by that service alone) and returns the public ones, which go into the config every role reads
(``nats.trainer_public_key``, ``nats.controller_public_key``). A run without public keys (an open server,
a test) neither signs nor checks; a run with them refuses what is unsigned or badly signed.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TypeVar

import msgspec
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from shared.config import NatsConfig
from shared.messages import Message, encode

SIGNERS = ("trainer", "controller")

S = TypeVar("S", bound=Message)


class SignatureError(ValueError):
    """A control message without a valid signature of the one signer that may send it."""


def _signed_bytes(prefix: str, msg: Message) -> bytes:
    return prefix.encode() + b"\0" + encode(msgspec.structs.replace(msg, signature=""))  # type: ignore[type-var]


class Signer:
    """Signs one service's control messages with its private key."""

    def __init__(self, private_key_hex: str, prefix: str) -> None:
        try:
            self.key = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(private_key_hex.strip()))
        except ValueError as exc:
            raise SignatureError(f"not an Ed25519 private key (64 hex digits): {exc}") from None
        self.prefix = prefix

    @classmethod
    def from_file(cls, path: str | os.PathLike[str], prefix: str) -> Signer:
        try:
            return cls(Path(path).read_text(), prefix)
        except OSError as exc:
            raise SignatureError(f"cannot read the signing key {path}: {exc.strerror}") from None

    def sign(self, msg: S) -> S:
        return msgspec.structs.replace(msg, signature=self.key.sign(_signed_bytes(self.prefix, msg)).hex())  # type: ignore[type-var]


class Verifier:
    """Checks one signer's messages; with no public key (an unsigned run) every message passes."""

    def __init__(self, public_key_hex: str, prefix: str, signer: str) -> None:
        self.signer, self.prefix = signer, prefix
        self.key: Ed25519PublicKey | None = None
        if public_key_hex:
            try:
                self.key = Ed25519PublicKey.from_public_bytes(bytes.fromhex(public_key_hex.strip()))
            except ValueError as exc:
                raise SignatureError(f"nats.{signer}_public_key is not an Ed25519 public key: {exc}") from None

    def check(self, msg: S) -> S:
        """``msg`` if the signer signed it; else SignatureError with why."""
        if self.key is None:
            return msg
        signature = getattr(msg, "signature", "")
        if not signature:
            raise SignatureError(f"unsigned {msg.KIND} (only the {self.signer}'s signed ones count)")
        try:
            self.key.verify(bytes.fromhex(signature), _signed_bytes(self.prefix, msg))
        except (ValueError, InvalidSignature):
            raise SignatureError(f"{msg.KIND}: not the {self.signer}'s signature") from None
        return msg


def signer_for(cfg: NatsConfig) -> Signer | None:
    """This service's signer from ``nats.signing_key`` or ``nats.signing_key_file``; None when it has no key."""
    if cfg.signing_key:
        return Signer(cfg.signing_key, cfg.prefix)
    if cfg.signing_key_file:
        return Signer.from_file(cfg.signing_key_file, cfg.prefix)
    return None


def verifier_for(cfg: NatsConfig, signer: str) -> Verifier:
    """Checks ``signer``'s messages against ``nats.<signer>_public_key`` (empty: an unsigned run, all pass)."""
    return Verifier(getattr(cfg, f"{signer}_public_key"), cfg.prefix, signer)


def generate_signing_keys(key_dir: str | os.PathLike[str]) -> dict[str, str]:
    """A private key per signer in ``<key_dir>/<signer>.signing.key`` (0600; one written before is kept, so a
    resumed run keeps its keys); returns signer -> public key (hex)."""
    key_dir = Path(key_dir)
    key_dir.mkdir(parents=True, exist_ok=True)
    public: dict[str, str] = {}
    for signer in SIGNERS:
        path = signing_key_path(key_dir, signer)
        if not (path.is_file() and path.read_text().strip()):
            private = Ed25519PrivateKey.generate().private_bytes_raw().hex()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(private + "\n")
        key = Ed25519PrivateKey.from_private_bytes(bytes.fromhex(path.read_text().strip()))
        public[signer] = key.public_key().public_bytes_raw().hex()
    return public


def signing_key_path(key_dir: str | os.PathLike[str], signer: str) -> Path:
    return Path(key_dir) / f"{signer}.signing.key"


def new_key_pair() -> tuple[str, str]:
    """(private, public) as hex: for an environment file (``jetrl secrets``)."""
    key = Ed25519PrivateKey.generate()
    return key.private_bytes_raw().hex(), key.public_key().public_bytes_raw().hex()
