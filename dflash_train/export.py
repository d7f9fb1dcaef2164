"""Export a drafter as a Hugging Face style folder that DFlash inference code, vLLM and SGLang load.

The folder holds `config.json` (`DrafterConfig.to_hf_config()` plus the dtype) and
`model.safetensors` with exactly the drafter's `state_dict()` names; the teacher's embedding and
LM head are never written (inference engines take them from the target model).
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

from dflash_common.errors import DFlashError
from dflash_train.model import DFlashDrafter, DrafterConfig

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


class ExportError(DFlashError):
    """A drafter export folder is missing, incomplete or does not match its config."""


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def export_drafter(model: DFlashDrafter, out_dir: str | os.PathLike[str],
                   dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write config.json and model.safetensors to `out_dir`, replacing an earlier export there."""
    return export_weights(model.cfg, model.state_dict(), out_dir, dtype)


def export_weights(cfg: DrafterConfig, state_dict: dict[str, Tensor], out_dir: str | os.PathLike[str],
                   dtype: torch.dtype = torch.bfloat16) -> Path:
    """Export a drafter from its config and trainable weights (e.g. straight from a checkpoint).

    The files are written into a temporary sibling folder that is then renamed, so a crash never
    leaves a half-written export under `out_dir`. Returns the export folder.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not (out_dir / CONFIG_FILE).exists():
        raise ExportError(
            f"{out_dir} exists and is not a drafter export (no {CONFIG_FILE}); choose an empty or new folder")
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    staging = out_dir.parent / f".{out_dir.name}.tmp-{tag}"
    staging.mkdir()
    try:
        tensors = {name: value.detach().to(device="cpu", dtype=dtype).contiguous()
                   for name, value in state_dict.items()}
        save_file(tensors, str(staging / WEIGHTS_FILE), metadata={"format": "pt"})
        config = cfg.to_hf_config()
        # transformers 5 reads "dtype", older readers "torch_dtype".
        config["dtype"] = config["torch_dtype"] = _dtype_name(dtype)
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        if out_dir.exists():
            retired = out_dir.parent / f".{out_dir.name}.old-{tag}"
            out_dir.rename(retired)
            staging.rename(out_dir)
            shutil.rmtree(retired)
        else:
            staging.rename(out_dir)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out_dir


def read_export_config(export_dir: str | os.PathLike[str]) -> DrafterConfig:
    """The DrafterConfig of an export folder."""
    path = Path(export_dir) / CONFIG_FILE
    if not path.is_file():
        raise ExportError(f"{path} is missing; pass a folder written by export_drafter")
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ExportError(f"{path} is not readable JSON ({err}); export the drafter again") from err
    if not isinstance(raw, dict):
        raise ExportError(f"{path} holds a {type(raw).__name__}, not a JSON object; export the drafter again")
    try:
        return DrafterConfig.from_hf_config(raw)
    except DFlashError as err:
        raise ExportError(f"{path}: {err}") from err


def _check_tensors(path: Path, loaded: dict[str, Tensor], expected: dict[str, Tensor]) -> None:
    missing = sorted(set(expected) - set(loaded))
    if missing:
        raise ExportError(f"{path} lacks tensor {missing[0]!r} ({len(missing)} missing); export the drafter again")
    extra = sorted(set(loaded) - set(expected))
    if extra:
        raise ExportError(
            f"{path} has unexpected tensor {extra[0]!r} ({len(extra)} extra); it does not match config.json")
    for name, tensor in loaded.items():
        want = tuple(expected[name].shape)
        if tuple(tensor.shape) != want:
            raise ExportError(
                f"{path} tensor {name!r} has shape {tuple(tensor.shape)}, config.json implies {want}; "
                "export the drafter again")


def load_drafter(export_dir: str | os.PathLike[str], embed_weight: Tensor, lm_head_weight: Tensor,
                 dtype: torch.dtype = torch.bfloat16) -> DFlashDrafter:
    """Load an export folder into a DFlashDrafter around the teacher's embedding and LM head."""
    cfg = read_export_config(export_dir)
    path = Path(export_dir) / WEIGHTS_FILE
    if not path.is_file():
        raise ExportError(f"{path} is missing; pass a folder written by export_drafter")
    try:
        loaded = load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise ExportError(f"{path} is not a readable safetensors file ({err}); export the drafter again") from err
    with torch.device("meta"):
        expected = DFlashDrafter(cfg, embed_weight.to("meta"), lm_head_weight.to("meta")).state_dict()
    _check_tensors(path, loaded, expected)
    return DFlashDrafter.build(cfg, embed_weight, lm_head_weight, embed_weight.device, state=loaded).to(dtype)
