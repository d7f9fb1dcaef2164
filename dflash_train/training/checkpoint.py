"""Checkpoints: `step-NNNNNN/` folders written whole under a temporary name, then renamed.

A folder holds `model.safetensors` (drafter weights), `trainer.pt` (optimizer, scheduler,
loader and RNG state, step: tensors and plain values only, loaded with `weights_only=True` on the
CPU), `config.json` (the full train config) and `COMPLETE`, written last
before the rename. Only folders with `COMPLETE` count, so a crash during a save leaves the
previous checkpoint as the newest.

Model and optimizer state are always stored whole, in the layout of one unwrapped process
(torch.optim's parameter numbering), whatever the world size and strategy that wrote them, so
any run can resume any checkpoint and export needs no torch.distributed.
"""

from __future__ import annotations

import json
import os
import pickle
import uuid
from pathlib import Path

import safetensors.torch
import torch
from safetensors import SafetensorError
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from dflash_common.errors import DFlashError
from dflash_common.faults import maybe_fault
from dflash_common.files import (
    disk_full_at,
    disk_full_stops,
    fsync_path,
    give_plain_mode,
    is_disk_full,
    refuse_links,
    regular_file_inside,
    remove_tree,
    write_new_file,
)
from dflash_common.settings_files import load_settings_file
from dflash_train.training.distributed import is_sharded

COMPLETE = "COMPLETE"
# What trainer.pt holds: trainer_state writes exactly these, load refuses a file without them.
TRAINER_KEYS = ("step", "optimizer", "scheduler", "loader", "rng", "drafter")


def trainer_state(step: int, optimizer_state: dict, scheduler_state: dict, loader_state: dict,
                  drafter_config: dict) -> dict:
    """trainer.pt's content: everything but the weights that a resume restores, plus the
    drafter's export config (so a checkpoint exports without the cache). Plain values and
    tensors only, so it loads with weights_only=True."""
    return {"step": step, "optimizer": optimizer_state, "scheduler": scheduler_state, "loader": loader_state,
            "rng": {"torch": torch.get_rng_state()}, "drafter": drafter_config}


class CheckpointError(DFlashError):
    """A checkpoint is missing, damaged or belongs to another run."""


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """Parameter names in the optimizer's numbering (param-group order)."""
    names = {id(p): name for name, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def optimizer_state_by_index(state: dict, names: list[str]) -> dict:
    """A name-keyed optimizer state (torch.distributed.checkpoint's) in torch.optim's own layout."""
    index = {name: i for i, name in enumerate(names)}
    return {"state": {index[name]: value for name, value in state["state"].items()},
            "param_groups": [{**g, "params": [index[name] for name in g["params"]]} for g in state["param_groups"]]}


def optimizer_state_by_name(state: dict, names: list[str]) -> dict:
    """torch.optim's numbered optimizer state keyed by parameter name (the inverse of the above)."""
    return {"state": {names[i]: value for i, value in state["state"].items()},
            "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}


def full_model_state(model: nn.Module) -> dict:
    """The drafter's whole state dict. Under FSDP this gathers the shards, so every rank must
    call it; rank 0 receives the tensors (on CPU), the other ranks an empty dict."""
    if not is_sharded(model):
        return model.state_dict()
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def full_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """The optimizer's whole state in torch.optim's layout; collective under FSDP like
    full_model_state (rank 0 receives it)."""
    if not is_sharded(model):
        return optimizer.state_dict()
    state = get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return optimizer_state_by_index(state, _param_names(model, optimizer)) if state else {}


def load_full_state(model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict, optimizer_state: dict) -> None:
    """Load whole model and optimizer state (as saved) on every rank; under FSDP each rank keeps
    its own shard of it."""
    if not is_sharded(model):
        model.load_state_dict(model_state)
        optimizer.load_state_dict(optimizer_state)
        return
    full = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=full)
    set_optimizer_state_dict(model, optimizer, optimizer_state_by_name(optimizer_state, _param_names(model, optimizer)),
                             options=full)


def step_dir_name(step: int) -> str:
    return f"step-{step:06d}"


class CheckpointManager:
    """Saves, finds and loads the checkpoints of one run folder, keeping the newest ``keep``.

    ``root`` is the run's checkpoints/ folder; it and every step folder must be real folders, not
    symlinks: pruning deletes old step folders, and through a link that would delete another
    run's checkpoints (refused with refuse_links, the run folder being the output's root)."""

    def __init__(self, root: str | Path, keep: int = 3):
        self.root, self.keep = Path(root), keep
        self.run = self.root.parent

    def complete(self) -> list[Path]:
        """Complete checkpoints, oldest first."""
        refuse_links(self.root, self.run)
        if not self.root.exists():
            return []
        found = []
        for p in self.root.glob("step-*"):
            refuse_links(p)
            if p.is_dir() and (p / COMPLETE).exists():
                found.append(p)
        return sorted(found, key=lambda p: int(p.name.split("-")[1]))

    def latest(self) -> Path | None:
        done = self.complete()
        return done[-1] if done else None

    def save(self, step: int, model_state: dict, trainer_state: dict, config: dict) -> Path:
        """Write checkpoint `step` whole (a temporary folder, COMPLETE, then the rename). A full disk
        on the way removes the temporary folder (freeing what it took) and raises DiskFullError
        naming the file and the newest complete checkpoint, which stays as it was."""
        refuse_links(self.root, self.run)
        final = self.root / step_dir_name(step)
        with disk_full_stops(final, lambda: self.kept(), "rerun the same command with --resume to continue from it"):
            self.root.mkdir(parents=True, exist_ok=True)
            tmp = self.root / f".tmp-{final.name}-{uuid.uuid4().hex[:8]}"
            tmp.mkdir()
            try:
                self._write_files(tmp, final, step, model_state, trainer_state, config)
            except BaseException as err:
                if is_disk_full(err):  # a SIGKILL leaves it for the next save's prune; this frees the space now
                    remove_tree(tmp, self.run, ignore_errors=True)
                raise
        maybe_fault("checkpoint_before_rename")
        if os.path.lexists(final):  # an older incomplete attempt at this step
            remove_tree(final, self.run)
        os.rename(tmp, final)
        fsync_path(self.root)
        self._prune()
        return final

    def kept(self) -> str:
        """What a failed save leaves intact, for its error line."""
        latest = self.latest()
        return (f"the newest complete checkpoint, {latest}, is intact (the unfinished one was removed)" if latest
                else "no checkpoint was complete yet (the unfinished one was removed)")

    @staticmethod
    def _write_files(tmp: Path, final: Path, step: int, model_state: dict, trainer_state: dict, config: dict) -> None:
        def file(name: str):
            # the file being written, named by the disk-full line (torch and safetensors name none)
            # as the checkpoint it belongs to: its temporary folder is gone by the time it is read
            return disk_full_at(final / name)

        with file("model.safetensors"):
            safetensors.torch.save_file({k: v.detach().contiguous().cpu() for k, v in model_state.items()},
                                        str(tmp / "model.safetensors"))
        give_plain_mode(tmp / "model.safetensors")  # as export does: safetensors writes mode 600
        with file("trainer.pt"):
            write_new_file(tmp / "trainer.pt", lambda f: torch.save(trainer_state, f))
        with file("config.json"):
            write_new_file(tmp / "config.json", lambda f: f.write((json.dumps(config, indent=1) + "\n").encode()))
        for path in tmp.iterdir():
            fsync_path(path)
        maybe_fault("checkpoint_after_files")
        with file(COMPLETE):
            write_new_file(tmp / COMPLETE, lambda f: f.write(f"{step}\n".encode()))
        fsync_path(tmp)

    def _prune(self) -> None:
        for old in self.complete()[: -self.keep] if self.keep > 0 else []:
            remove_tree(old, self.run, ignore_errors=True)
        for leftover in self.root.glob(".tmp-step-*"):
            remove_tree(leftover, self.run, ignore_errors=True)

    @staticmethod
    def load(path: str | Path) -> dict:
        """{'model': state_dict, 'trainer': trainer_state, 'config': dict} of a complete checkpoint,
        each file a regular one inside the folder (no link out of it, FIFO or device), config.json
        read bounded, and the weights checked against the drafter config they were saved with."""
        path = Path(path)
        if not (path / COMPLETE).exists():
            raise CheckpointError(f"{path} is not a complete checkpoint (no {COMPLETE} marker); pick another step-* folder")
        files = {name: regular_file_inside(path, name, f"checkpoint {path}", CheckpointError, _fix(path))
                 for name in CHECKPOINT_FILES}
        try:
            state = {
                "model": safetensors.torch.load_file(files["model.safetensors"]),
                # weights_only: a checkpoint is shared like any download, and unpickling arbitrary
                # objects runs code; ours holds only tensors and plain values. map_location: one
                # saved on a GPU must load on a CPU node, and under DDP not all onto cuda:0.
                # mmap: the tensors stay pages of the file (copy-on-write) until used, so the ranks
                # of a node share one copy in the page cache instead of each reading the whole
                # state (~22 GB at production size) into its own memory, and an FSDP rank reads
                # only the slices of its shards
                "trainer": torch.load(files["trainer.pt"], weights_only=True, map_location="cpu", mmap=True),
                "config": load_settings_file(files["config.json"], f"checkpoint {path}: config.json",
                                             error=CheckpointError, fix=_fix(path)),
            }
        except pickle.UnpicklingError as err:
            raise _unpickling_refusal(path, err) from None
        except (OSError, RuntimeError, ValueError, EOFError, SafetensorError) as err:
            detail = str(err).splitlines()[0] if str(err) else type(err).__name__
            if "mmap can only be used" in detail:
                detail = "trainer.pt is not in the zip format torch.save writes, which dflash-train uses"
            raise CheckpointError(f"checkpoint {path} cannot be read ({detail[:200]}); {_fix(path)}") from None
        trainer = state["trainer"]
        missing = [k for k in TRAINER_KEYS if not isinstance(trainer, dict) or k not in trainer]
        if missing:
            raise CheckpointError(f"checkpoint {path}: trainer.pt lacks {missing[0]!r} (it holds "
                                  f"{type(trainer).__name__}{' ' + str(sorted(trainer))[:120] if isinstance(trainer, dict) else ''}), "
                                  "so dflash-train did not write it; use another step-* folder")
        check_checkpoint_weights(path, trainer["drafter"], state["model"])
        return state


CHECKPOINT_FILES = ("model.safetensors", "trainer.pt", "config.json")
"""The files CheckpointManager.load reads from a step folder (COMPLETE is only looked for)."""


def _fix(path: Path) -> str:
    """What to do about a checkpoint that cannot be used: an older complete one beside it when
    there is one (named), else train again; never a folder without checkpoints."""
    others = []
    try:
        others = sorted(p for p in path.parent.glob("step-*") if p != path and not p.is_symlink()
                        and (p / COMPLETE).is_file())
    except OSError:
        pass
    if others:
        return f"use another checkpoint of that run (with --resume: --resume-from {others[-1]}) or delete {path}"
    return (f"there is no other complete checkpoint beside it in {path.parent}: use a checkpoint dflash-train wrote, "
            f"or delete {path} and train again")


def _unpickling_refusal(path: Path, err: pickle.UnpicklingError) -> CheckpointError:
    """torch's weights_only refusal in our words: what the file holds and what to do, without
    torch's advice to load it with weights_only=False (which would run its code)."""
    import re

    text = str(err)
    named = re.search(r"GLOBAL ([\w.]+)", text)
    operand = re.search(r"Unsupported operand (\d+)", text)
    what = (f"it names {named.group(1)[:120]}" if named else
            f"pickle instruction {operand.group(1)}" if operand else "objects dflash does not load")
    return CheckpointError(f"checkpoint {path}: trainer.pt holds Python objects other than tensors and plain values "
                           f"({what}), which dflash never loads since loading them could run code; it was not written "
                           f"by dflash-train or was tampered with, so it was not loaded: {_fix(path)}")


def check_checkpoint_weights(path: Path, drafter: object, model_state: dict) -> None:
    """Refuse a checkpoint whose weights are not those of the drafter config it records (a
    trainer.pt edited to another kind or size, weights swapped in), naming the first mismatch."""
    from dflash_train.settings.drafter_config import DrafterConfig
    from dflash_train.training.export import weights_problem

    if not isinstance(drafter, dict):
        raise CheckpointError(f"checkpoint {path}: trainer.pt's drafter config is a {type(drafter).__name__}, not an "
                              f"object, so dflash-train did not write it; {_fix(path)}")
    try:
        cfg = DrafterConfig.from_hf_config(drafter)
    except DFlashError as err:
        raise CheckpointError(f"checkpoint {path}: trainer.pt's {str(err).split('; ')[0]}; {_fix(path)}") from None
    problem = weights_problem(cfg, model_state)
    if problem:
        raise CheckpointError(f"checkpoint {path}: model.safetensors does not match the drafter config in trainer.pt: "
                              f"{problem}; {_fix(path)}")
