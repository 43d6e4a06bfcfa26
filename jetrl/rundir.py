"""A run's directory: its saved config, and an earlier run kept under a new name when a fresh one starts."""

from __future__ import annotations

import time
from pathlib import Path

from shared.config import JetRLConfig, load_config


def run_config(run_dir: str | None) -> JetRLConfig:
    """The run's saved config (its NATS credentials, the status API's token), else (no run directory, or
    none saved there) the defaults with the ``JETRL__`` environment applied."""
    path = Path(run_dir) / "config.toml" if run_dir else None
    return load_config(path if path is not None and path.is_file() else None)


def keep_earlier_run(run_dir: Path, command: str, *, resumable: bool = True) -> Path | None:
    """A fresh run starts fresh: an earlier run's directory (its checkpoints, which the trainer would
    resume from, and its JetStream store, whose jobs would be played again) is renamed, not reused; to
    ``<name>-<its last change, local time>``, ``.1``, ``.2`` ... where that is taken. Returns the new name,
    None where there was no earlier run (an empty directory, or one without a run, is used as it is).
    ``resumable``: the command has ``--resume``, and the message says so."""
    earlier = ("config.toml", "checkpoints", "nats", "metrics.jsonl")
    if not (run_dir.is_dir() and any((run_dir / name).exists() for name in earlier)):
        return None
    changed = time.strftime("%Y%m%d-%H%M%S", time.localtime(run_dir.stat().st_mtime))
    kept = run_dir.with_name(f"{run_dir.name}-{changed}")
    n = 1
    while kept.exists():
        kept, n = kept.with_name(f"{kept.name.split('.')[0]}.{n}"), n + 1
    run_dir.rename(kept)
    hint = " (--resume continues it instead)" if resumable else ""
    print(f"jetrl {command}: the earlier run in {run_dir} is kept as {kept}{hint}", flush=True)
    return kept
