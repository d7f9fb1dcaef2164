"""Export a drafter as a Hugging Face style folder that DFlash inference code, vLLM and SGLang load.

The folder holds `config.json` (`DrafterConfig.to_hf_config()` plus the dtype) and
`model.safetensors` with exactly the drafter's `state_dict()` names; the teacher's embedding and
LM head are never written (inference engines take them from the target model). An export
replaces only an earlier export: a folder holding anything else is refused (check_export_folder).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import Tensor

from dflash_common.errors import ConfigError, DFlashError, DiskFullError
from dflash_common.files import (
    disk_full_stops,
    foreign_entries,
    give_plain_mode,
    holds,
    is_disk_full,
    refuse_links,
    regular_file_inside,
    remove_tree,
)
from dflash_common.settings_files import load_settings_file
from dflash_train.settings.drafter_config import EXPORT_ARCHITECTURES, DrafterConfig
from dflash_train.training.model import DFlashDrafter

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
# All an export folder holds; anything else there is someone else's and stops an export into it.
EXPORT_FILES = (CONFIG_FILE, WEIGHTS_FILE)


class ExportError(DFlashError):
    """A drafter export folder is missing, incomplete or does not match its config."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _is_export_config(path: Path) -> bool:
    """Whether `path` is a config.json an export wrote: a DFlash or DSpark drafter's, not a model's."""
    if path.is_symlink() or not path.is_file():  # a FIFO there would block the read
        return False
    try:
        values = load_settings_file(str(path))
    except (OSError, DFlashError):
        return False
    return (isinstance(values, dict) and values.get("architectures") in [[a] for a in EXPORT_ARCHITECTURES]
            and isinstance(values.get("dflash_config"), dict))


def check_export_folder(out_dir: str | os.PathLike[str]) -> None:
    """Refuse an export folder that is not ours to replace: a file, or a non-empty folder other
    than an earlier export (our config.json, model.safetensors and nothing else), since an export
    replaces the whole folder and everything in it would be lost."""
    out_dir = Path(out_dir)
    # the folder is replaced whole (renamed away and deleted): a link there, or at a file in it,
    # would be replaced or followed, not the folder it names
    refuse_links(out_dir)
    for name in EXPORT_FILES:
        refuse_links(out_dir / name)
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"{out_dir} is a file, not a folder; choose a new or empty folder for the export")
    config = out_dir / CONFIG_FILE
    ours = _is_export_config(config)
    foreign = foreign_entries(out_dir, lambda entry: ours and entry.name in EXPORT_FILES
                              and entry.is_file(follow_symlinks=False))
    if not foreign:
        return
    # a model folder (a teacher's, a copy from the hub) has a config.json too: say it is not ours
    others = [name for name in foreign if name != CONFIG_FILE]
    held = ([f"a {CONFIG_FILE} that is not an export's"] if CONFIG_FILE in foreign else []) + ([holds(others)] if others else [])
    raise ConfigError(f"{out_dir} is a non-empty folder that is not a drafter export (it holds {', '.join(held)}); "
                      "choose a new or empty folder for the export (it replaces the whole folder)")


def export_drafter(model: DFlashDrafter, out_dir: str | os.PathLike[str],
                   dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write config.json and model.safetensors to `out_dir`, replacing an earlier export there."""
    return export_weights(model.cfg, model.state_dict(), out_dir, dtype)


def export_weights(cfg: DrafterConfig, state_dict: dict[str, Tensor], out_dir: str | os.PathLike[str],
                   dtype: torch.dtype = torch.bfloat16) -> Path:
    """Export a drafter from its config and trainable weights (e.g. straight from a checkpoint).

    The files are written into a temporary sibling folder that is then renamed, so a crash never
    leaves a half-written export under `out_dir`. Every export goes through here, so here
    `out_dir` is checked (check_export_folder): only an earlier export is replaced. Returns the
    export folder.
    """
    out_dir = Path(out_dir)
    check_export_folder(out_dir)
    problem = weights_problem(cfg, state_dict)
    if problem:  # an export whose config.json disagrees with its weights loads nowhere
        raise ExportError(f"the drafter's weights do not match its config, so nothing was exported to {out_dir}: "
                          f"{problem}")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    staging = out_dir.parent / f".{out_dir.name}.tmp-{tag}"
    kept = (f"the export already at {out_dir} is unchanged" if out_dir.exists() else f"nothing was written to {out_dir}") + \
        " (the unfinished one was removed)"
    try:
        staging.mkdir()
    except OSError as err:
        if is_disk_full(err):
            raise DiskFullError(staging, kept, "rerun the same command") from err
        raise
    try:
        tensors = {name: value.detach().to(device="cpu", dtype=dtype).contiguous()
                   for name, value in state_dict.items()}
        config = cfg.to_hf_config()
        # transformers 5 reads "dtype", older readers "torch_dtype".
        config["dtype"] = config["torch_dtype"] = _dtype_name(dtype)
        # the caller that knows more (a run's newest checkpoint) says so in place of `kept`
        with disk_full_stops(out_dir / CONFIG_FILE, kept, "rerun the same command"):
            (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        with disk_full_stops(out_dir / WEIGHTS_FILE, kept, "rerun the same command"):
            save_file(tensors, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
        give_plain_mode(staging / WEIGHTS_FILE)  # safetensors writes mode 600: unreadable to a server's account
        if out_dir.exists():
            retired = out_dir.parent / f".{out_dir.name}.old-{tag}"
            out_dir.rename(retired)
            staging.rename(out_dir)
            remove_tree(retired)
        else:
            staging.rename(out_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out_dir


def _export_file(export_dir: str | os.PathLike[str], name: str) -> str:
    """A file of an export folder, refused unless a regular file inside it (regular_file_inside)."""
    return regular_file_inside(export_dir, name, f"drafter export {export_dir}", ExportError,
                               "pass a folder written by dflash-train export (or export the drafter again)")


def read_export_config(export_dir: str | os.PathLike[str]) -> DrafterConfig:
    """The DrafterConfig of an export folder."""
    path = Path(_export_file(export_dir, CONFIG_FILE))
    try:
        raw = load_settings_file(str(path), error=ExportError, fix="export the drafter again")
    except OSError as err:
        raise ExportError(f"{path} is not readable ({err}); export the drafter again") from err
    if not isinstance(raw, dict):
        raise ExportError(f"{path} holds a {type(raw).__name__}, not a JSON object; export the drafter again")
    try:
        return DrafterConfig.from_hf_config(raw)
    except DFlashError as err:
        raise ExportError(f"{path}: {err}") from err


def expected_shapes(cfg: DrafterConfig) -> dict[str, tuple[int, ...]]:
    """Every trained tensor's name and shape that a drafter of `cfg` has, from the model built on
    the meta device (no memory, whatever sizes the config gives)."""
    hidden = torch.empty(cfg.vocab_size, cfg.hidden_size, device="meta")
    with torch.device("meta"):
        return {name: tuple(t.shape) for name, t in DFlashDrafter(cfg, hidden, hidden).state_dict().items()}


def weights_problem(cfg: DrafterConfig, tensors: dict[str, Tensor]) -> str | None:
    """The first way `tensors` are not the weights of a drafter of `cfg` (a missing or an extra
    name, a shape, a tensor that is not floating point), or None."""
    expected = expected_shapes(cfg)
    missing = sorted(set(expected) - set(tensors))
    if missing:
        return f"it lacks tensor {missing[0]!r} of shape {expected[missing[0]]} ({len(missing)} missing)"
    extra = sorted(set(tensors) - set(expected))
    if extra:
        return f"it has tensor {extra[0]!r}, which a drafter of that config lacks ({len(extra)} extra)"
    for name in sorted(tensors):
        shape = tuple(tensors[name].shape)
        if shape != expected[name]:
            return f"tensor {name!r} has shape {shape}, the config implies {expected[name]}"
        if not tensors[name].is_floating_point():
            return f"tensor {name!r} is {_dtype_name(tensors[name].dtype)}, not floating point"
    return None


def load_drafter(export_dir: str | os.PathLike[str], embed_weight: Tensor, lm_head_weight: Tensor,
                 dtype: torch.dtype = torch.bfloat16) -> DFlashDrafter:
    """Load an export folder into a DFlashDrafter around the teacher's embedding and LM head."""
    cfg, loaded = read_export(export_dir)
    return DFlashDrafter.build(cfg, embed_weight, lm_head_weight, embed_weight.device, state=loaded).to(dtype)


def read_export(export_dir: str | os.PathLike[str]) -> tuple[DrafterConfig, dict[str, Tensor]]:
    """An export folder's DrafterConfig and its trained tensors, checked against each other."""
    cfg = read_export_config(export_dir)
    path = Path(_export_file(export_dir, WEIGHTS_FILE))
    try:
        loaded = load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise ExportError(f"{path} is not a readable safetensors file ({err}); export the drafter again") from err
    problem = weights_problem(cfg, loaded)
    if problem:
        raise ExportError(f"{path} does not match {CONFIG_FILE} beside it: {problem}; export the drafter again")
    return cfg, loaded
