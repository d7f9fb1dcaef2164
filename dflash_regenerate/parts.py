"""Parts on disk: written whole and renamed, then a commit record; merged in order into the output."""

from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Iterable

import xxhash

from dflash_common.errors import ConfigError
from dflash_common.files import remove_file, write_atomic, write_file_atomic
from dflash_common.progress import Progress
from dflash_common.settings_files import load_settings_file
from dflash_regenerate.generation import PartOutcome
from dflash_regenerate.outputs import SETTINGS, RegenerateResult
from dflash_regenerate.part_plan import part_name, part_rows, record_name
from dflash_regenerate.settings.regenerate_config import output_root, parts_dir


def read_json(path: str) -> dict | None:
    """A settings file or commit record of OUT.parts (None when absent), through the bounded reader."""
    try:
        return load_settings_file(path, fix="it is damaged: delete it or rerun with --overwrite")
    except FileNotFoundError:
        return None


def _rows_bytes(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode("utf-8")


def commit_part(folder: str, index: int, rows_span: tuple[int, int], outcome: PartOutcome) -> dict:
    """Write part `index` whole, then its record (the commit); returns the record."""
    data = _rows_bytes(outcome.rows)
    root = output_root(folder)
    write_file_atomic(os.path.join(folder, part_name(index)), data, root)
    record = {"index": index, "rows": list(rows_span), "written": len(outcome.rows), "skipped": dict(outcome.skipped),
              "tokens": outcome.tokens, "truncated": outcome.truncated, "empty": outcome.empty, "bytes": len(data),
              "checksum": xxhash.xxh64_hexdigest(data)}
    write_file_atomic(os.path.join(folder, record_name(index)), (json.dumps(record) + "\n").encode(), root)
    return record


def committed_parts(folder: str, num_parts: int) -> dict[int, dict]:
    """Records of the committed parts, by index; a part counts once its record and file exist."""
    committed = {}
    for index in range(num_parts):
        record = read_json(os.path.join(folder, record_name(index)))
        if record is not None and os.path.exists(os.path.join(folder, part_name(index))):
            committed[index] = record
    return committed


def sum_records(records: Iterable[dict]) -> tuple[int, Counter, int, int, int]:
    rows, skipped, tokens, truncated, empty = 0, Counter(), 0, 0, 0
    for record in records:
        rows += record["written"]
        skipped.update(record["skipped"])
        tokens += record["tokens"]
        truncated += record["truncated"]
        empty += record.get("empty", 0)  # records written before it was counted
    return rows, skipped, tokens, truncated, empty


def merge_parts(out: str, progress: Progress | None = None) -> RegenerateResult:
    """Concatenate the committed parts in row order into `out` (atomic rename), then delete
    them. Refuses, naming the first gap, when a part is missing. Safe to run by several ranks
    at once: each writes identical bytes, and one that finds the parts gone reports the
    merge another rank finished."""
    progress = progress or Progress()
    folder = parts_dir(out)
    settings = read_json(os.path.join(folder, SETTINGS))
    if settings is None:
        raise ConfigError(f"{folder} holds no regeneration to merge (no {SETTINGS}); run `dflash-cache regenerate` first")
    if settings.get("merged") is not None and os.path.exists(out):
        return complete_result(out, settings["merged"])
    total_rows, per_part = settings["corpus"]["rows"], settings["rows_per_part"]
    num_parts = math.ceil(total_rows / per_part)
    records = committed_parts(folder, num_parts)
    missing = [i for i in range(num_parts) if i not in records]
    if missing:
        first = part_rows(missing[0], per_part, total_rows)
        raise ConfigError(f"cannot merge {out}: {len(missing)} of {num_parts} part(s) are not written yet (first: "
                          f"{part_name(missing[0])}, source rows {first[0]}..{first[1] - 1}); finish every rank, "
                          f"or rerun the command to generate them")
    def concatenate(dst) -> None:
        for index in range(num_parts):
            with open(os.path.join(folder, part_name(index)), "rb") as src:
                data = src.read()
            if xxhash.xxh64_hexdigest(data) != records[index]["checksum"]:
                raise ConfigError(f"{os.path.join(folder, part_name(index))} does not match its record (changed "
                                  f"after it was written); delete it and {record_name(index)} and rerun to redo it")
            dst.write(data)

    try:
        write_atomic(os.path.abspath(out), concatenate)
    except FileNotFoundError:
        # Another rank merged first and deleted the parts.
        settings = read_json(os.path.join(folder, SETTINGS)) or {}
        if settings.get("merged") is not None and os.path.exists(out):
            return complete_result(out, settings["merged"])
        raise
    rows, skipped, tokens, truncated, empty = sum_records(records.values())
    merged = {"rows": rows, "skipped": dict(skipped), "tokens": tokens, "truncated": truncated, "empty": empty,
              "checksum": file_checksum(out)}
    write_file_atomic(os.path.join(folder, SETTINGS), (json.dumps(dict(settings, merged=merged), indent=1) + "\n").encode(),
                      output_root(out))
    for index in range(num_parts):  # the merged file holds it all now; keep only the settings
        for name in (record_name(index), part_name(index)):
            remove_file(os.path.join(folder, name), output_root(out), missing_ok=True)
    result = complete_result(out, merged)
    progress.message(f"wrote {rows:,} rows to {out}" + _summary(result))
    return result


def file_checksum(path: str) -> str:
    digest = xxhash.xxh64()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def complete_result(out: str, merged: dict) -> RegenerateResult:
    return RegenerateResult(out=out, complete=True, rows=merged["rows"], skipped=dict(merged["skipped"]),
                            tokens=merged["tokens"], truncated=merged["truncated"], empty=merged.get("empty", 0))


def _summary(result: RegenerateResult) -> str:
    parts = []
    if result.skipped:
        parts.append("skipped " + ", ".join(f"{k}: {v}" for k, v in sorted(result.skipped.items())))
    if result.truncated:
        parts.append(f"{result.truncated:,} answer(s) cut at --max-new-tokens")
    if result.empty:
        parts.append(f"{result.empty:,} empty answer(s)")
    return ("; " + "; ".join(parts)) if parts else ""


