"""How a build lays its shards out on storage (dflash_cache.writer writes them)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from dflash_common.errors import ConfigError

# The hidden-state encodings a manifest's hidden_format names (dflash_cache.format describes them).
LOSSLESS = "lossless"
FP8_E4M3 = "fp8_e4m3"
HIDDEN_FORMATS = (LOSSLESS, FP8_E4M3)


def parse_size(text: str | int) -> int:
    """'512MB', '2GiB', '1e9' or an int -> bytes."""
    if isinstance(text, int):
        return text
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "K": 2**10, "M": 2**20, "G": 2**30}
    s = str(text).strip().upper().replace(" ", "")
    number = s.rstrip("KMGTIB")
    unit = s[len(number):]
    try:
        value = float(number)
    except ValueError:
        value = None
    if value is None or unit not in units:
        raise ConfigError(f"cannot read the size {text!r}; write it like 512MB, 2GiB or 1000000")
    if not math.isfinite(value) or value * units[unit] < 1:
        raise ConfigError(f"the size {text!r} must be a finite number of at least one byte; write it like 512MB or 2GiB")
    return int(value * units[unit])


def format_size(size: int) -> str:
    """A byte count as parse_size reads it: the largest unit that divides it (4194304 -> '4MiB')."""
    for unit, factor in (("TiB", 2**40), ("TB", 10**12), ("GiB", 2**30), ("GB", 10**9), ("MiB", 2**20), ("MB", 10**6),
                         ("KiB", 2**10), ("KB", 10**3)):
        if size >= factor and size % factor == 0:
            return f"{size // factor}{unit}"
    return str(size)


@dataclass(frozen=True)
class StorageConfig:
    """How shards are laid out on storage."""

    # Sizes are text on the command line (512MB, 2GiB). 512MB is decimal: the command line's default
    # from the start, so a rerun without --shard-size resumes the caches it built.
    shard_bytes: int = field(default=512 * 10**6, metadata={"name": "shard_size", "parse": parse_size, "show": format_size})
    """Target hidden-state bytes per shard; a shard is cut once its sequences reach it. Sets how
    much memory the build buffers (about twice this) and the unit of commit, resume and parallel reads."""

    chunk_bytes: int = field(default=4 * 2**20, metadata={"name": "chunk_size", "parse": parse_size, "show": format_size})
    """Target bytes per Zarr chunk of hidden states. Small chunks read far slower (~6x at 51 KB)."""

    compression: str = "none"
    """'none' or 'zstd' for the hidden states. bf16 hidden states compress only ~1.2x losslessly,
    so the default spends no CPU on it."""

    hidden_format: str = "lossless"
    """'lossless' (the build dtype's exact bits) or 'fp8_e4m3': one byte per value plus one
    power-of-two scale per token per layer, about half the bytes of bf16 at ~2.7% relative error
    (dflash_cache.format.fp8); the reader decodes it back to the build dtype. Its effect on a drafter is
    in benchmarks/RESULTS.md."""

    format_version: int = 2
    """Cache format a new build writes: 2 (a small manifest, index tables and a fixed number of
    files per shard; docs/cache-format.md) or 1 (a commit record with every chunk file listed per
    shard, what dflash wrote before format 2; for tools that read only that). A resumed build
    keeps its cache's version; every dflash since format 2 reads both."""

    def __post_init__(self):
        if self.format_version not in (1, 2):
            raise ConfigError(f"unknown cache format version {self.format_version!r}; use 2 (or 1 for readers older than format 2)")
        if self.shard_bytes < 1:
            raise ConfigError(f"shard size must be positive, got {self.shard_bytes} bytes; pass e.g. --shard-size 512MB")
        if self.chunk_bytes < 1:
            raise ConfigError(f"chunk size must be positive, got {self.chunk_bytes} bytes; pass e.g. --chunk-size 4MB")
        if self.compression not in ("none", "zstd"):
            raise ConfigError(f"unknown compression {self.compression!r}; use 'none' or 'zstd'")
        if self.hidden_format not in HIDDEN_FORMATS:
            raise ConfigError(f"unknown hidden-state format {self.hidden_format!r}; use {' or '.join(HIDDEN_FORMATS)}")
