"""Streaming rows from JSON Lines, Parquet, Arrow and saved `datasets` folders, each held to the
row limits.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from dflash_common.errors import ConfigError
from dflash_common.settings_files import json_depth
from dflash_common.values import is_int
from dflash_corpus import limits
from dflash_corpus.limits import depth_problem, row_byte_limit, size_problem
from dflash_corpus.listing import list_corpus_files, saved_dataset_files
from dflash_corpus.settings.corpus_config import JSONL_SUFFIXES, PARQUET_SUFFIXES, CorpusConfig

# Rows are converted from Arrow to Python in slices this long, so one huge record batch never
# becomes a huge list of dicts.
_ROWS_PER_SLICE = 1024

# JSON Lines files are read in pieces this long, so a huge line is never read whole unless kept.
_READ_CHUNK = 1 << 20


@dataclass(frozen=True, slots=True)
class CorpusRow:
    """One corpus row, or the problem that kept it from being read."""

    index: int
    """Global 0-based row index over all corpus files in order."""
    path: str
    """The file (or save_to_disk folder) the row came from."""
    row: int
    """1-based position within its file: the line number for JSON Lines, else the row number."""
    data: dict | None
    """The parsed row; None when `problem` is set."""
    problem: str | None
    """Why the row could not be read (invalid JSON, not an object, not UTF-8, nested too deep,
    too large), else None."""


_JSON_TYPE_NAMES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}

def parse_json_line(line: bytes) -> tuple[dict | None, str | None]:
    """Parse one JSON Lines line into (object, None) or (None, problem).

    A line nested more than limits.MAX_ROW_DEPTH levels is a problem, found before parsing (so a
    RecursionError from the parser cannot happen; one would still become a problem).
    """
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as err:
        return None, f"not valid UTF-8 at byte {err.start + 1}"
    if line.count(b"[") + line.count(b"{") > limits.MAX_ROW_DEPTH:  # else it cannot nest that deep
        problem = depth_problem(json_depth(line))
        if problem:
            return None, problem
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        return None, f"invalid JSON: {err.msg} at column {err.colno}"
    except RecursionError:
        return None, f"nested too deeply to parse (limit {limits.MAX_ROW_DEPTH})"
    if not isinstance(value, dict):
        kind = "null" if value is None else _JSON_TYPE_NAMES.get(type(value), type(value).__name__)
        return None, f"not a JSON object (got a JSON {kind})"
    return value, None


def _jsonl_lines(path: str, max_bytes: int, skip: int = 0) -> Iterator[tuple[int, bytes | int]]:
    """(1-based line number, line) of every non-blank line after the first `skip` of them.

    The file is read in pieces of at most _READ_CHUNK bytes. A line longer than one piece is
    measured first and read whole only when it is at most `max_bytes` long (not counting its
    line break); a longer one comes back as its length, an int, and is never held.
    """
    with open(path, "rb") as f:
        number = position = 0
        while True:
            begin = f.tell()
            piece = f.readline(_READ_CHUNK)
            if not piece:
                return
            number += 1
            bom = 3 if number == 1 and piece.startswith(b"\xef\xbb\xbf") else 0
            first, size, blank, tail = piece, len(piece), not piece[bom:].strip(), piece[-2:]
            while not piece.endswith(b"\n"):  # a line longer than one piece: measure it
                piece = f.readline(_READ_CHUNK)
                if not piece:
                    break
                size += len(piece)
                blank = blank and not piece.strip()
                tail = piece[-2:] if len(piece) >= 2 else (tail + piece)[-2:]
            if blank:
                continue
            position += 1
            if position <= skip:
                continue
            length = size - bom - (2 if tail == b"\r\n" else 1 if tail.endswith(b"\n") else 0)
            if length > max_bytes:
                yield number, length
            elif size == len(first):
                yield number, first[bom:]
            else:
                end = f.tell()
                f.seek(begin + bom)
                line = f.read(size - bom)
                f.seek(end)
                yield number, line
                del line


def _count_jsonl(path: str) -> int:
    return sum(1 for _ in _jsonl_lines(path, max_bytes=0))


def _iter_jsonl(path: str, skip: int, max_bytes: int) -> Iterator[tuple[int, dict | None, str | None]]:
    for number, line in _jsonl_lines(path, max_bytes, skip):
        if isinstance(line, int):
            yield number, None, size_problem(line, max_bytes)
            continue
        data, problem = parse_json_line(line)
        del line  # the parsed row is all that is needed while it is tokenized
        yield number, data, problem


def _schema_depth(schema) -> int:
    """How deeply a row of the Arrow `schema` can nest (the row is level 1; a list column is 2)."""
    depth, stack = 1, [(field.type, 1) for field in schema]
    while stack:
        kind, level = stack.pop()
        if kind.num_fields:  # list, struct, map, union: one level more
            depth = max(depth, level + 1)
            stack.extend((kind.field(i).type, level + 1) for i in range(kind.num_fields))
    return depth


def _oversize_rows(part, max_bytes: int) -> dict[int, int]:
    """{offset: bytes} of the rows of an Arrow table or batch whose data is over `max_bytes`."""
    if part.nbytes <= max_bytes:
        return {}
    sizes = ((i, part.slice(i, 1).nbytes) for i in range(part.num_rows))
    return {i: size for i, size in sizes if size > max_bytes}


def _rows_of_batch(batch, skip: int, max_bytes: int) -> Iterator[tuple[dict | None, str | None]]:
    problem = depth_problem(_schema_depth(batch.schema))
    for start in range(skip, batch.num_rows, _ROWS_PER_SLICE):
        part = batch.slice(start, _ROWS_PER_SLICE)
        if problem:  # never converted: that is what would recurse
            yield from ((None, problem) for _ in range(part.num_rows))
            continue
        oversize = _oversize_rows(part, max_bytes)
        if not oversize:
            yield from ((data, None) for data in part.to_pylist())
            continue
        for i in range(part.num_rows):
            if i in oversize:
                yield None, size_problem(oversize[i], max_bytes)
            else:
                yield part.slice(i, 1).to_pylist()[0], None


def _iter_batches(batches, skip: int, max_bytes: int) -> Iterator[tuple[int, dict | None, str | None]]:
    """Rows of consecutive record batches, skipping the first `skip` without converting them."""
    number = 0
    for batch in batches:
        if skip >= batch.num_rows:
            skip -= batch.num_rows
            number += batch.num_rows
            continue
        number += skip
        for data, problem in _rows_of_batch(batch, skip, max_bytes):
            number += 1
            yield number, data, problem
        skip = 0


def _open_failure(path: str, err: Exception) -> ConfigError:
    return ConfigError(f"cannot read corpus file {path}: {err}; check that the file is complete")


def _parquet_file(path: str):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path, memory_map=True)
    except (pa.ArrowException, OSError) as err:
        raise _open_failure(path, err) from err


def _iter_parquet(path: str, skip: int, max_bytes: int) -> Iterator[tuple[int, dict | None, str | None]]:
    parquet = _parquet_file(path)
    groups = [parquet.metadata.row_group(i).num_rows for i in range(parquet.num_row_groups)]
    first, skipped = 0, 0
    while first < len(groups) and skipped + groups[first] <= skip:
        skipped += groups[first]
        first += 1
    if first == len(groups):
        return
    batches = parquet.iter_batches(batch_size=_ROWS_PER_SLICE, row_groups=range(first, len(groups)))
    for number, data, problem in _iter_batches(batches, skip - skipped, max_bytes):
        yield number + skipped, data, problem


def _arrow_batches(path: str) -> Iterator:
    import pyarrow as pa

    try:
        source = pa.memory_map(path, "r")
        is_file_format = source.read(6) == b"ARROW1"
        source.seek(0)
        if is_file_format:
            reader = pa.ipc.open_file(source)
            batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
        else:
            batches = iter(pa.ipc.open_stream(source))
    except (pa.ArrowException, OSError) as err:
        raise _open_failure(path, err) from err
    return batches


def _count_arrow(path: str) -> int:
    return sum(batch.num_rows for batch in _arrow_batches(path))


def _load_saved_dataset(folder: str):
    import datasets

    saved_dataset_files(folder)  # every file it names is a regular file inside it
    dataset = datasets.load_from_disk(folder)  # memory-maps the Arrow files
    if not isinstance(dataset, datasets.Dataset):
        raise ConfigError(f"corpus folder {folder} is not a single datasets split; point at one split")
    return dataset


def _iter_saved_dataset(folder: str, skip: int, max_bytes: int) -> Iterator[tuple[int, dict | None, str | None]]:
    dataset = _load_saved_dataset(folder)
    problem = depth_problem(_schema_depth(dataset.data.schema))
    as_arrow = dataset.with_format("arrow")
    for start in range(skip, len(dataset), _ROWS_PER_SLICE):
        stop = min(start + _ROWS_PER_SLICE, len(dataset))
        if problem:
            yield from ((number + 1, None, problem) for number in range(start, stop))
            continue
        oversize = _oversize_rows(as_arrow[start:stop], max_bytes)
        if oversize:
            for offset in range(stop - start):
                if offset in oversize:
                    yield start + offset + 1, None, size_problem(oversize[offset], max_bytes)
                else:
                    yield start + offset + 1, dataset[start + offset], None
            continue
        columns = dataset[start:stop]
        names = list(columns)
        for offset, values in enumerate(zip(*columns.values())):
            yield start + offset + 1, dict(zip(names, values)), None


def _count_rows(entry: str) -> int:
    if os.path.isdir(entry):
        return len(_load_saved_dataset(entry))
    if entry.endswith(JSONL_SUFFIXES):
        return _count_jsonl(entry)
    if entry.endswith(PARQUET_SUFFIXES):
        return _parquet_file(entry).metadata.num_rows
    return _count_arrow(entry)


def count_rows(files: Sequence[str]) -> int:
    """How many rows `iter_rows` yields over `files` (from list_corpus_files), without parsing.

    Parquet and save_to_disk counts come from metadata; JSON Lines files are scanned for
    non-blank lines; Arrow files are walked batch by batch (memory-mapped).
    """
    return sum(_count_rows(entry) for entry in files)


def require_rows(files: Sequence[str], data: str) -> int:
    """count_rows, refusing a corpus without rows: the one check `build`, `build --dry-run` and
    `regenerate` share (a dry run that passed an empty corpus promised a build that is refused)."""
    total = count_rows(files)
    if total == 0:
        raise ConfigError(f"the corpus {data!r} has no rows; point --data at a non-empty file")
    return total


def _iter_entry(entry: str, skip: int, max_bytes: int) -> Iterator[tuple[int, dict | None, str | None]]:
    if os.path.isdir(entry):
        return _iter_saved_dataset(entry, skip, max_bytes)
    if entry.endswith(JSONL_SUFFIXES):
        return _iter_jsonl(entry, skip, max_bytes)
    if entry.endswith(PARQUET_SUFFIXES):
        return _iter_parquet(entry, skip, max_bytes)
    return _iter_batches(_arrow_batches(entry), skip, max_bytes)


def iter_rows(cfg: CorpusConfig, start_row: int = 0, files: Sequence[str] | None = None) -> Iterator[CorpusRow]:
    """Stream every corpus row in order, starting at global row index `start_row`.

    `files`: the corpus entries, as list_corpus_files(cfg.data) gives them (a caller that has
    listed them passes them on, so the corpus is listed once and rows are read from what it
    fingerprinted and counted).

    Rows before `start_row` are counted, not parsed, so a resumed build restarts cheaply.
    Blank JSON Lines lines are not rows. Unreadable rows come back with `problem` set, and so
    do rows nested more than limits.MAX_ROW_DEPTH levels deep or larger than
    row_byte_limit(cfg.max_length) bytes (those are never parsed or converted).
    """
    if not is_int(start_row) or start_row < 0:
        raise ConfigError(f"start_row={start_row!r} must be a non-negative integer")
    skip = start_row
    index = 0
    max_bytes = row_byte_limit(cfg.max_length)
    for entry in list_corpus_files(cfg.data) if files is None else files:
        if skip:
            count = _count_rows(entry)
            if count <= skip:
                skip -= count
                index += count
                continue
            index += skip
        for number, data, problem in _iter_entry(entry, skip, max_bytes):
            yield CorpusRow(index=index, path=entry, row=number, data=data, problem=problem)
            index += 1
        skip = 0
