"""The teacher's weights read from its safetensors files, by name: what a build needs of a teacher
that another engine runs (vLLM), and the teacher's identity for both engines.

A 27B teacher is ~54 GB of bf16 weights; the build process of a vLLM build needs only its final
norm and LM head (the top-k runs here) and, once, its input embedding and config (the frozen files
the trainer reads). Reading those tensors by name from memory-mapped files keeps the rest of the
teacher out of this process's memory, and hashing a strided sample of every tensor in the files
identifies the teacher without loading it (the same hash whichever engine runs it).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch
import xxhash

from dflash_common.errors import TeacherError

IDENTITY_SOURCE = "safetensors-sample-v2"
"""How `weights_hash` was computed (the manifest's teacher `weights_hash_of`): spread runs of the
stored bytes of every tensor of the safetensors files, with its name, shape and stored dtype. Caches without it (dflash
before this) hashed the loaded model's state_dict in the build dtype."""

BLOCKS, BLOCK_BYTES = 16, 1024
"""The identity hash reads BLOCKS runs of BLOCK_BYTES of each tensor (all of a smaller one)."""

TEXT_PREFIXES = ("model.", "model.language_model.", "language_model.model.", "")
"""Where a checkpoint keeps its text model's embedding and final norm: causal LMs under `model.`,
vision-language ones (Qwen3.5/3.6) under `model.language_model.` (older layouts
`language_model.model.`)."""

HEAD_NAMES = ("lm_head.weight", "language_model.lm_head.weight", "model.language_model.lm_head.weight")

@dataclass(frozen=True)
class StoredTensor:
    file: Path
    dtype: str
    shape: tuple[int, ...]
    start: int
    """Byte offset of the data in the file."""
    end: int


def teacher_folder(name_or_path: str, revision: str | None) -> Path:
    """The local folder of a teacher: the path given, or the hub snapshot of its weights."""
    folder = Path(name_or_path).expanduser()
    if folder.is_dir():
        return folder
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(name_or_path, revision=revision,
                                      allow_patterns=["*.safetensors", "*.safetensors.index.json", "*.json"]))
    except Exception as err:  # noqa: BLE001 (hub errors have many types; the line names it)
        raise TeacherError(f"cannot find the weight files of the teacher {name_or_path!r}: {str(err).splitlines()[0]}") from None


def _read_header(path: Path) -> dict:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise TeacherError(f"{path} is not a safetensors file (shorter than its header)")
        (size,) = struct.unpack("<Q", raw)
        if size > 100_000_000 or size > os.path.getsize(path):
            raise TeacherError(f"{path} is not a safetensors file (header of {size} bytes)")
        try:
            return json.loads(f.read(size))
        except ValueError:
            raise TeacherError(f"{path} is not a safetensors file (its header is not JSON)") from None


def stored_tensors(folder: Path) -> dict[str, StoredTensor]:
    """Every tensor of the folder's safetensors files, by name (from the files' headers only)."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        files = sorted({folder / name for name in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise TeacherError(f"the teacher folder {folder} has no safetensors files; dflash reads teacher weights "
                           "from safetensors only (save the model with save_pretrained(safe_serialization=True))")
    tensors = {}
    for path in files:
        header = _read_header(path)
        base = 8 + struct.unpack("<Q", path.open("rb").read(8))[0]
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            tensors[name] = StoredTensor(path, info["dtype"], tuple(info["shape"]), base + start, base + end)
    return tensors


def weights_hash(tensors: dict[str, StoredTensor]) -> str:
    """xxh64 over every tensor's name, shape, dtype and a sample of its stored bytes: BLOCKS
    evenly spread runs of BLOCK_BYTES, read with plain reads (no memory map: mapped pages would
    count in this process's memory). Seconds for a 27B teacher, and a few pages per tensor."""
    digest = xxhash.xxh64()
    handles: dict[Path, object] = {}
    try:
        for name in sorted(tensors):
            t = tensors[name]
            digest.update(f"{name}:{t.shape}:{t.dtype}".encode())
            f = handles.get(t.file) or handles.setdefault(t.file, open(t.file, "rb"))
            size = t.end - t.start
            if size <= BLOCKS * BLOCK_BYTES:
                starts = [t.start]
                length = size
            else:
                starts = [t.start + (size - BLOCK_BYTES) * i // (BLOCKS - 1) for i in range(BLOCKS)]
                length = BLOCK_BYTES
            for start in starts:
                digest.update(os.pread(f.fileno(), length, start))
    finally:
        for f in handles.values():
            f.close()
    return digest.hexdigest()


def read_tensor(tensors: dict[str, StoredTensor], name: str, dtype: torch.dtype,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """One tensor by name, in `dtype` on `device` (only its own bytes are read)."""
    from safetensors import safe_open

    t = tensors[name]
    with safe_open(str(t.file), framework="pt", device="cpu") as f:
        return f.get_tensor(name).to(device=device, dtype=dtype)


def text_names(tensors: dict[str, StoredTensor], tied: bool) -> dict[str, str]:
    """The names of the text model's input embedding, final norm and LM head in these files."""
    for prefix in TEXT_PREFIXES:
        embed, norm = f"{prefix}embed_tokens.weight", f"{prefix}norm.weight"
        if embed in tensors and norm in tensors:
            break
    else:
        raise TeacherError("cannot find the text model's embed_tokens.weight and norm.weight in the teacher's "
                           f"safetensors files (looked under {', '.join(repr(p) for p in TEXT_PREFIXES)}); "
                           "the checkpoint layout is not supported")
    head = next((name for name in HEAD_NAMES if name in tensors), None)
    if head is None:
        if not tied:
            raise TeacherError("the teacher's safetensors files hold no lm_head.weight and its config does not tie "
                               "word embeddings; the checkpoint is incomplete")
        head = embed
    return {"embed": embed, "norm": norm, "head": head}
