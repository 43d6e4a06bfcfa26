"""The trainer's state on disk: checkpoints (``<run>/checkpoints/step_N/``) and the policy version record
(``<run>/policy_version``), which together make a restarted trainer continue, never repeat, a run.

A checkpoint is ``model.safetensors`` (every weight, or with LoRA the adapter alone) and
``trainer_state.pt`` (optimizer state, step, policy version), written last: a directory without it is
an unfinished checkpoint, passed over on resume. A backend may keep more in it (ZeRO's shards).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shared.config import TrainerConfig
from shared.model import bytes_to_weights, load_weights_into, save_checkpoint


@dataclass(frozen=True)
class Resumed:
    """What a checkpoint says about where the run stood."""

    step: int
    policy_version: int


class RunState:
    """Checkpoints and the version record of one run directory."""

    def __init__(self, run_dir: Path, cfg: TrainerConfig) -> None:
        self.run_dir, self.cfg = run_dir, cfg

    def checkpoint_due(self, step: int) -> bool:
        """Whether the step that brings the count to ``step`` ends with a checkpoint."""
        return bool(self.cfg.checkpoint_every and step % self.cfg.checkpoint_every == 0) or step == self.cfg.steps

    def checkpoint_dir(self, step: int) -> Path:
        return self.run_dir / "checkpoints" / f"step_{step:06d}"

    def write(self, weights: bytes, optimizer: Any, step: int, policy_version: int) -> None:
        """``weights`` and ``optimizer``'s state of the step just taken; then the oldest checkpoints go."""
        save_checkpoint(weights, optimizer, step, self.checkpoint_dir(step), {"policy_version": policy_version})
        self.prune()

    def latest(self, also_has: str = "") -> Path | None:
        """The newest finished checkpoint (one a crash cut short is passed over); with ``also_has``, the
        newest that also holds that entry (a backend's own part of it)."""
        finished = [p for p in sorted((self.run_dir / "checkpoints").glob("step_*"))
                    if (p / "trainer_state.pt").exists() and (not also_has or (p / also_has).exists())]
        return finished[-1] if finished else None

    def prune(self) -> None:
        """Keep the newest ``trainer.keep_checkpoints`` (0 = all): a long run does not fill the disk."""
        keep = self.cfg.keep_checkpoints
        if keep <= 0:
            return
        for old in sorted((self.run_dir / "checkpoints").glob("step_*"))[:-keep]:
            shutil.rmtree(old, ignore_errors=True)

    def resumed(self, checkpoint: Path) -> Resumed:
        """The step of ``checkpoint`` and the version to continue from: its own, or a higher one this run
        recorded (announced after that checkpoint was written)."""
        state = torch.load(checkpoint / "trainer_state.pt", weights_only=False)
        step = int(state["step"])
        return Resumed(step, max(int(state.get("policy_version", step)), self.recorded_version()))

    # ------------------------------------------------------------------ versions
    @property
    def version_file(self) -> Path:
        return self.run_dir / "policy_version"

    def recorded_version(self) -> int:
        """The highest version this run ever went to announce (0 = none)."""
        try:
            return int(self.version_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return 0

    def record_version(self, version: int) -> None:
        """Written (atomically) before version ``version`` is published."""
        tmp = self.version_file.with_suffix(".tmp")
        tmp.write_text(f"{version}\n")
        tmp.replace(self.version_file)


def load_trained_weights(model: Any, checkpoint: Path, lora: bool) -> None:
    """A checkpoint's weights into ``model``: with LoRA the adapter's tensors by name (the base weights
    are the run's model), else every weight."""
    saved = bytes_to_weights((checkpoint / "model.safetensors").read_bytes())
    if lora:
        own = dict(model.named_parameters())
        with torch.no_grad():
            for name, tensor in saved.items():
                own[name].copy_(tensor)
    else:
        load_weights_into(model, saved, allow_extra=("lm_head.weight",))


def optimizer_state(checkpoint: Path) -> dict[str, Any]:
    return torch.load(checkpoint / "trainer_state.pt", weights_only=False)["optimizer"]
