"""Checkpoints: `step-NNNNNN/` folders written whole under a temporary name, then renamed.

A folder holds `model.safetensors` (drafter weights), `trainer.pt` (optimizer, scheduler,
loader and RNG state, step), `config.json` (the full train config) and `COMPLETE`, written last
before the rename. Only folders with `COMPLETE` count, so a crash during a save leaves the
previous checkpoint as the newest.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import safetensors.torch
import torch

from dflash_cache.errors import DFlashError
from dflash_cache.faults import maybe_fault

COMPLETE = "COMPLETE"


class CheckpointError(DFlashError):
    """A checkpoint is missing, damaged or belongs to another run."""


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class CheckpointManager:
    """Saves, finds and loads the checkpoints of one run folder, keeping the newest ``keep``."""

    def __init__(self, root: str | Path, keep: int = 3):
        self.root, self.keep = Path(root), keep

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        if not self.root.exists():
            return []
        found = [p for p in self.root.glob("step-*") if p.is_dir() and (p / COMPLETE).exists()]
        return sorted(found, key=lambda p: int(p.name.split("-")[1]))

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1] if done else None

    def save(self, step: int, model_state: dict, trainer_state: dict, config: dict) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / step_dir_name(step)
        tmp = self.root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir()
        safetensors.torch.save_file({k: v.detach().contiguous().cpu() for k, v in model_state.items()},
                                    str(tmp / "model.safetensors"))
        torch.save(trainer_state, tmp / "trainer.pt")
        (tmp / "config.json").write_text(json.dumps(config, indent=1) + "\n")
        for path in tmp.iterdir():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        maybe_fault("checkpoint_after_files")
        (tmp / COMPLETE).write_text(f"{step}\n")
        _fsync_dir(tmp)
        maybe_fault("checkpoint_before_rename")
        if final.exists():  # an older incomplete attempt at this step
            shutil.rmtree(final)
        os.rename(tmp, final)
        _fsync_dir(self.root)
        self._prune()
        return final

    def _prune(self) -> None:
        for old in self.complete()[: -self.keep] if self.keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
        for leftover in self.root.glob(".tmp-step-*"):
            shutil.rmtree(leftover, ignore_errors=True)

    @staticmethod
    def load(path: str | Path) -> dict:
        """{'model': state_dict, 'trainer': trainer_state, 'config': dict} of a complete checkpoint."""
        path = Path(path)
        if not (path / COMPLETE).exists():
            raise CheckpointError(f"{path} is not a complete checkpoint (no {COMPLETE} marker); pick another step-* folder")
        try:
            return {
                "model": safetensors.torch.load_file(str(path / "model.safetensors")),
                "trainer": torch.load(path / "trainer.pt", weights_only=False),
                "config": json.loads((path / "config.json").read_text()),
            }
        except (OSError, RuntimeError, ValueError) as err:
            raise CheckpointError(f"checkpoint {path} cannot be read ({err}); resume from an older step-* folder") from None
