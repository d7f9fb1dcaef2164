"""`dflash-cache verify`: checksums, shapes, dtypes and finiteness of every committed shard."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dflash_cache import format as fmt
from dflash_cache.progress import Progress
from dflash_cache.reader import Cache, _open_ipc


@dataclass
class VerifyReport:
    """What verify found: one entry per bad shard, plus leftovers that are not part of the cache."""

    shards_checked: int = 0
    bad_shards: dict[str, list[str]] = field(default_factory=dict)
    uncommitted: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.bad_shards


def _nonfinite_bf16(bits: np.ndarray) -> int:
    """Count NaN/Inf in bf16 stored as uint16: all exponent bits set."""
    return int(np.count_nonzero((bits & 0x7F80) == 0x7F80))


def check_shard(cache: Cache, record: dict) -> list[str]:
    """Problems of one shard (empty when it is intact)."""
    fs, problems = cache.fs, []
    shard_dir = fmt.join(cache.root, fmt.SHARDS_DIR, record["name"])
    record_path = f"{shard_dir}.json"
    if not fs.exists(record_path):
        problems.append("commit record missing")
    elif fmt.read_json(fs, record_path) != record:
        problems.append("commit record differs from the manifest")
    if not fs.exists(shard_dir):
        return problems + ["shard folder missing"]
    found = {p[len(shard_dir) + 1:]: int(i["size"]) for p, i in fs.find(shard_dir, detail=True).items()}
    for name, size in record["files"].items():
        if name not in found:
            problems.append(f"file {name} missing")
        elif found[name] != size:
            problems.append(f"file {name} is {found[name]} bytes, expected {size}")
    if problems:
        return problems

    for name in (fmt.TOKENS, fmt.SEQUENCES):
        data = fs.cat_file(fmt.join(shard_dir, name))
        if fmt.checksum(data) != record["checksums"][name]:
            problems.append(f"{name} checksum mismatch")
    if problems:
        return problems
    try:
        tokens = _open_ipc(fs, fmt.join(shard_dir, fmt.TOKENS))
        sequences = _open_ipc(fs, fmt.join(shard_dir, fmt.SEQUENCES))
        n_tokens = record["tokens"]
        if tokens.num_rows != n_tokens or sequences.num_rows != record["sequences"]:
            problems.append(f"row counts {tokens.num_rows}/{sequences.num_rows} differ from the record")
        lengths = sequences.column("length").to_numpy()
        offsets = sequences.column("offset").to_numpy()
        if len(lengths) and (offsets[0] != 0 or np.any(offsets[1:] != np.cumsum(lengths)[:-1]) or lengths.sum() != n_tokens):
            problems.append("sequence offsets and lengths are inconsistent")
        logprobs = tokens.column("topk_logprobs").combine_chunks().values.to_numpy()
        if not np.isfinite(logprobs).all():
            problems.append("top-k log-probs contain NaN/Inf")
        shard = next(s for s in cache.shards if s.name == record["name"])
        array = shard.hidden_array
        expected_shape = tuple(record["hidden_shape"])
        if tuple(array.shape) != expected_shape:
            problems.append(f"hidden shape {tuple(array.shape)} differs from {expected_shape}")
        elif array.dtype != fmt.HIDDEN_STORAGE[cache.hidden_dtype]:
            problems.append(f"hidden dtype {array.dtype} differs from the manifest's {cache.hidden_dtype}")
        else:
            stored = array[:]
            if fmt.checksum(stored) != record["checksums"]["hidden"]:
                problems.append("hidden states checksum mismatch")
            bad = _nonfinite_bf16(stored) if cache.hidden_dtype == "bfloat16" else int((~np.isfinite(stored)).sum())
            if bad:
                problems.append(f"hidden states contain {bad} NaN/Inf values")
    except Exception as err:  # a damaged file can fail in any decoder; name it, do not crash
        problems.append(f"unreadable: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
    return problems


def verify_cache(cache: Cache, progress: Progress | None = None) -> VerifyReport:
    progress = progress or Progress()
    report = VerifyReport()
    progress.start(len(cache.shards), "verifying", "shard")
    for shard in cache.shards:
        problems = check_shard(cache, shard.record)
        if problems:
            report.bad_shards[shard.name] = problems
        report.shards_checked += 1
        progress.advance(1)
    progress.close()
    listed = {s.name for s in cache.shards}
    shards_dir = fmt.join(cache.root, fmt.SHARDS_DIR)
    if cache.fs.exists(shards_dir):
        for path in cache.fs.ls(shards_dir, detail=False):
            name = path.rstrip("/").rsplit("/", 1)[-1]
            if not name.endswith(".json") and name not in listed:
                report.uncommitted.append(name)
    return report
