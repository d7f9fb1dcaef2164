"""teacher/head.safetensors, the teacher's embedding and LM head that stage 2 trains against frozen.
It is checked like a shard: the manifest's ``teacher_head`` records its size and checksum at build
(absent in caches built before it was recorded: then it is not compared, and verify says so), and
its tensors must be floating point of ``TEACHER_HEAD_DTYPES`` with no NaN/Inf, since the drafter
uses them as they are. The checks read the safetensors layout itself (an 8-byte header length, a
JSON header, the tensors' bytes) with numpy, so verify loads no torch."""

from __future__ import annotations

import json
import struct
from typing import Any

import numpy as np

from dflash_cache.format.cache_layout import checksum
from dflash_common.errors import quoted

TEACHER_HEAD_TENSORS = ("embed_tokens.weight", "lm_head.weight")
TEACHER_HEAD_DTYPES = ("float16", "bfloat16", "float32")
# safetensors' dtype names, as torch names them in messages
DTYPE_NAMES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64", "I8": "int8", "U8": "uint8",
               "I16": "int16", "U16": "uint16", "I32": "int32", "U32": "uint32", "I64": "int64", "U64": "uint64",
               "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
HEADER_BYTES = 100 * 2**20
"""The most a safetensors header may claim (the format's own bound)."""
_BLOCK = 1 << 23  # values checked for NaN/Inf at a time: a mask of a production head at once is GBs


def teacher_head_record(data: bytes) -> dict:
    """The manifest's ``teacher_head`` entry for the head file's bytes."""
    return {"bytes": len(data), "checksum": checksum(data)}


def teacher_head_problem(data: bytes, record: Any) -> str | None:
    """What is wrong with the head's bytes against the manifest's record (None: they match, or
    no record exists: see teacher_head_checked)."""
    if not isinstance(record, dict):
        return None
    if len(data) != record.get("bytes"):
        return f"is {len(data):,} bytes, the manifest records {quoted(record.get('bytes'))}"
    if checksum(data) != record.get("checksum"):
        return "does not match the checksum the manifest records (damaged or changed since the build)"
    return None


def teacher_head_checked(manifest: dict) -> bool:
    """Whether the manifest records the head's checksum (caches built before it do not)."""
    return isinstance(manifest.get("teacher_head"), dict)


def _header(data: bytes) -> dict:
    """The safetensors header, every entry's offsets checked to lie in the file (ValueError)."""
    if len(data) < 8:
        raise ValueError(f"{len(data)} bytes, shorter than a safetensors header")
    (size,) = struct.unpack("<Q", data[:8])
    if size > min(HEADER_BYTES, len(data) - 8):
        raise ValueError(f"its header claims {size:,} bytes")
    header = json.loads(data[8:8 + size])
    if not isinstance(header, dict):
        raise ValueError("its header is not a JSON object")
    body = len(data) - 8 - size
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
                and 0 <= offsets[0] <= offsets[1] <= body and isinstance(entry.get("dtype"), str)):
            raise ValueError(f"tensor {name!r} lies outside the file or has no dtype")
        entry["start"] = 8 + size + offsets[0]
        entry["stop"] = 8 + size + offsets[1]
    return header


def _nonfinite(values: memoryview, dtype: str) -> int:
    """NaN/Inf among little-endian ``dtype`` values (bf16: all exponent bits set)."""
    if dtype == "bfloat16":
        bits = np.frombuffer(values, "<u2")
        return sum(int(np.count_nonzero((bits[i:i + _BLOCK] & 0x7F80) == 0x7F80)) for i in range(0, len(bits), _BLOCK))
    array = np.frombuffer(values, "<f2" if dtype == "float16" else "<f4")
    return sum(int(np.count_nonzero(~np.isfinite(array[i:i + _BLOCK]))) for i in range(0, len(array), _BLOCK))


def head_tensor_problem(data: bytes) -> str | None:
    """What is wrong with the head's tensors (None: both are there, floating, finite): the same
    checks whoever loads the head makes, worded as a problem of the file."""
    try:
        header = _header(data)
    except (ValueError, UnicodeDecodeError) as err:
        return f"is not a readable safetensors file ({str(err)[:120]})"
    view = memoryview(data)
    for name in TEACHER_HEAD_TENSORS:
        entry = header.get(name)
        if not isinstance(entry, dict):
            return f"lacks the tensor {name!r}"
        dtype = DTYPE_NAMES.get(entry["dtype"], entry["dtype"].lower())
        if dtype not in TEACHER_HEAD_DTYPES:
            return f"holds {name} as {dtype}; a teacher head is {', '.join(TEACHER_HEAD_DTYPES)} (the drafter uses it as it is)"
        values = view[entry["start"]:entry["stop"]]
        if len(values) % (4 if dtype == "float32" else 2):
            return f"is not a readable safetensors file ({name} is {len(values)} bytes of {dtype})"
        bad = _nonfinite(values, dtype)
        if bad:
            return f"holds {bad:,} NaN/Inf value(s) in {name}"
    return None
