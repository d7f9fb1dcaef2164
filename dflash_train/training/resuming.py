"""Resuming a run: the checkpoint it continues, agreed by every rank (rank 0 decides), checked
against this run, and restored into the model, optimizer and schedule."""

from __future__ import annotations

from pathlib import Path

import torch

from dflash_common.errors import CacheError, ConfigError
from dflash_common.progress import Progress
from dflash_common.resume_check import shown
from dflash_train.config import RESUME_MAY_CHANGE, config_differences
from dflash_train.training.checkpoint import (
    COMPLETE,
    CheckpointError,
    CheckpointManager,
    load_full_state,
)
from dflash_train.training.distributed import (
    DistInfo,
    every_rank,
    from_rank0,
)


def agreed_checkpoint(manager: CheckpointManager, resume: bool, resume_from: str | Path | None,
                      info: DistInfo) -> Path | None:
    """The checkpoint this run continues (None: it starts at step 0), decided by rank 0 alone and
    sent to every rank: the newest complete one in rank 0's checkpoints/ (every rank then takes
    the step folder of that name in its own --out) or `resume_from`. A rank that does not see it
    (a node-local --out on another node) would start at step 0 while rank 0 resumes and the ranks'
    collectives would stop matching (a hang), so every rank stops with the same line instead."""
    decision = None
    if info.is_main:
        latest = manager.latest()
        if not resume and latest is not None:
            decision = "refuse"
        elif resume:
            decision = str(resume_from) if resume_from is not None else (latest.name if latest else None)
    decision = from_rank0(decision, info)
    if decision == "refuse":
        raise CheckpointError(f"{manager.run} already holds checkpoints; pass --resume to continue that run or choose a new --out")
    if decision is None:
        return None
    path = Path(decision) if resume_from is not None else manager.root / decision
    missing = [rank for rank, seen in enumerate(every_rank((path / COMPLETE).is_file(), info)) if not seen]
    if missing:
        raise CheckpointError(f"rank 0 resumes from checkpoint {path}, which rank(s) {', '.join(map(str, missing))} of "
                              f"{info.world_size} cannot see (a node-local --out?); put --out on storage every node "
                              "sees, or copy that checkpoint folder to the same path on every node")
    return path


def checkpoint_to_resume(manager: CheckpointManager, fingerprint: str, current: dict, progress: Progress,
                          path: Path | None) -> tuple[Path, dict] | None:
    """The checkpoint `path` a resume continues (agreed_checkpoint) and its state, checked
    against this run (None: start at step 0)."""
    if path is None:
        progress.message(f"no complete checkpoint in {manager.root}; starting from step 0")
        return None
    state = manager.load(path)
    trainer = state["trainer"]
    saved = trainer["loader"]["manifest_fingerprint"]
    if saved != fingerprint:
        raise CacheError(f"checkpoint {path} was trained on a different cache (fingerprint {saved}, this cache {fingerprint}); pass the original --cache or use a new --out")
    differences = config_differences(state["config"], current, free=RESUME_MAY_CHANGE)
    if differences:
        key, before, after = differences[0]
        raise ConfigError(f"the {key.split('.')[0]} fields differ from checkpoint {path}: {key} differs (checkpoint: "
                          f"{shown(before)}, this run: {shown(after)}); resume with the original values or use a new --out")
    return path, state


def restore_checkpoint(checkpoint: tuple[Path, dict], model, optimizer, scheduler, progress: Progress) -> int:
    """Load a checked checkpoint's weights, optimizer, schedule and RNG; its step."""
    path, state = checkpoint
    trainer = state["trainer"]
    load_full_state(model, optimizer, state["model"], trainer["optimizer"])
    scheduler.load_state_dict(trainer["scheduler"])
    torch.set_rng_state(trainer["rng"]["torch"])
    progress.message(f"resuming from {path} (step {trainer['step']})")
    return int(trainer["step"])
