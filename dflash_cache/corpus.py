"""Stage 1 input: find corpus files, stream their rows, turn each row into tokens and a loss mask.

Formats: JSON Lines (`.jsonl`, or `.json` with one object per line), Parquet, Arrow IPC (file
or stream format), a folder or glob of those, and a Hugging Face `datasets` folder written by
`save_to_disk`. Files are streamed, never loaded whole.

A row is a chat (`messages` of {role, content}, or ShareGPT `conversations` of {from, value})
or plain `text`. Chats are rendered with the tokenizer's chat template and learn only the
assistant turns; plain text learns every token.

Limits that keep one bad row from taking the build down (each is a bad row naming file, row and
problem, so `--on-bad-row skip` skips and counts it):

- Nesting: a row may nest lists and objects at most MAX_ROW_DEPTH (100) levels deep, the row
  object itself being level 1. Real chat rows (messages, content parts, tool calls and their
  JSON-schema arguments) stay far below; a deeper row is almost surely generated garbage, and
  parsing or hashing it would recurse until Python's RecursionError. JSON Lines rows are
  measured on the raw line before parsing; Parquet and Arrow rows by their file's schema (Arrow
  itself refuses schemas much deeper than 64 levels).
- Size: a row may be at most row_byte_limit(max_length) bytes: the larger of 64 MiB and 64 bytes
  per token of max_length. That is hundreds of times what a row that fills max_length needs (a
  200k-token conversation is a few MB of JSON), so only absurd rows hit it; those are never held
  in memory whole (a JSON line over the limit is streamed past, not read). Measured as the JSON
  line's bytes, or the row's Arrow data for Parquet and Arrow.
- Overlong rows: only the start of a long text is tokenized, so the tokenizer's memory follows
  max_length, not the row's size (see _encode_prefix); the kept tokens are those the whole
  text's tokenization would give.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from dflash_cache.chat import Render, end_of_turn_text
from dflash_common.errors import BadRowError, ConfigError
from dflash_common.values import is_int

JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
ARROW_SUFFIXES = (".arrow",)
SUPPORTED_SUFFIXES = JSONL_SUFFIXES + PARQUET_SUFFIXES + ARROW_SUFFIXES

OVERLONG_POLICIES = ("truncate", "drop")
BAD_ROW_POLICIES = ("fail", "skip")

# Rows are converted from Arrow to Python in slices this long, so one huge record batch never
# becomes a huge list of dicts.
_ROWS_PER_SLICE = 1024
_MIB = 1 << 20
_FINGERPRINT_VERSION = b"dflash-corpus-fingerprint-v1"

MAX_ROW_DEPTH = 100
"""Deepest nesting of lists and objects in a row (the row object is level 1); deeper is a bad row."""
MIN_ROW_BYTE_LIMIT = 64 * _MIB
"""The row size limit never goes below this many bytes (see row_byte_limit)."""
ROW_BYTES_PER_TOKEN = 64
"""Bytes of row allowed per token of max_length (see row_byte_limit)."""
# JSON Lines files are read in pieces this long, so a huge line is never read whole unless kept.
_READ_CHUNK = _MIB

ROLE_ALIASES = {
    "system": "system",
    "user": "user",
    "human": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bot": "assistant",
    "model": "assistant",
    "tool": "tool",
}


@dataclass(frozen=True)
class CorpusConfig:
    """Where the corpus is and how its rows become training sequences."""

    data: str
    """A corpus file, a folder of files (searched recursively), or a glob pattern."""
    max_length: int = 4096
    """Longest sequence kept, in tokens. It also sets the row size limit, row_byte_limit(max_length)
    bytes (64 MiB up to max_length 1M), and bounds how much of a long row is tokenized."""
    overlong: str = "truncate"
    """What to do with a row longer than max_length: "truncate" (keep the first max_length
    tokens) or "drop" (skip the row)."""
    min_length: int = 2
    """Rows shorter than this many tokens (after truncation) are skipped."""
    on_bad_row: str = "fail"
    """What the build does with an unusable row: "fail" (stop with its file and row) or
    "skip" (count it and go on)."""
    chat_template_kwargs: dict | None = None
    """Extra variables for the chat template (e.g. {"enable_thinking": false}), the same ones the
    corpus was regenerated with and the drafter will be served with; recorded in the manifest."""

    def __post_init__(self):
        if not isinstance(self.data, str) or not self.data.strip():
            raise ConfigError(f"corpus data={self.data!r} is empty; pass a file, folder or glob")
        if not is_int(self.max_length) or self.max_length < 1:
            raise ConfigError(f"--max-length {self.max_length!r} must be a positive integer; e.g. 4096")
        check_template_kwargs(self.chat_template_kwargs)
        if self.overlong not in OVERLONG_POLICIES:
            raise ConfigError(f"overlong={self.overlong!r} is unknown; use 'truncate' or 'drop'")
        if not is_int(self.min_length) or not 1 <= self.min_length <= self.max_length:
            raise ConfigError(
                f"min_length={self.min_length!r} must be an integer in 1..max_length "
                f"({self.max_length}); e.g. 2"
            )
        if self.on_bad_row not in BAD_ROW_POLICIES:
            raise ConfigError(f"on_bad_row={self.on_bad_row!r} is unknown; use 'fail' or 'skip'")


def row_byte_limit(max_length: int) -> int:
    """The largest row accepted, in bytes: max(MIN_ROW_BYTE_LIMIT, ROW_BYTES_PER_TOKEN * max_length).

    64 MiB for any max_length up to 1M tokens. A row that fills max_length takes a few bytes of
    JSON per token (up to ~20 for escaped CJK or emoji), so real conversations, however long, fit
    with a wide margin, while a row of hundreds of MB, which costs a multiple of its size to
    parse and render, is refused. Longer rows within the limit are truncated as usual.
    """
    return max(MIN_ROW_BYTE_LIMIT, ROW_BYTES_PER_TOKEN * max_length)


def _size_problem(size: int, limit: int) -> str:
    return f"{size:,} bytes long (limit {limit:,} bytes)"


def _depth_problem(depth: int) -> str | None:
    return f"nested {depth:,} levels deep (limit {MAX_ROW_DEPTH})" if depth > MAX_ROW_DEPTH else None


# ---------------------------------------------------------------------------------------------
# Finding files


def _is_saved_dataset(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, "state.json")) and os.path.isfile(
        os.path.join(folder, "dataset_info.json")
    )


def _reject_dataset_dict(folder: str) -> None:
    marker = os.path.join(folder, "dataset_dict.json")
    if not os.path.isfile(marker):
        return
    try:
        with open(marker, encoding="utf-8") as f:
            splits = json.load(f).get("splits", [])
    except (OSError, ValueError, AttributeError):
        splits = []
    example = os.path.join(folder, splits[0]) if splits else os.path.join(folder, "<split>")
    raise ConfigError(
        f"corpus folder {folder} is a datasets DatasetDict with splits {', '.join(splits) or '?'}; "
        f"point the corpus at one split folder, e.g. {example}"
    )


def _reject_json_array(path: str) -> None:
    # A `.json` file holding one big array would otherwise surface as thousands of bad rows.
    if not path.endswith(".json"):
        return
    with open(path, "rb") as f:
        head = f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n")
    if head.startswith(b"["):
        raise ConfigError(
            f"corpus file {path} holds a JSON array, not one JSON object per line; "
            f"convert it to JSON Lines (e.g. jq -c '.[]' {path} > corpus.jsonl)"
        )


def _walk_folder(folder: str) -> list[str]:
    """Supported files and save_to_disk folders under `folder`, skipping hidden entries."""
    _reject_dataset_dict(folder)
    if _is_saved_dataset(folder):
        return [folder]
    found = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        kept_dirs = []
        for d in dirs:
            sub = os.path.join(root, d)
            _reject_dataset_dict(sub)
            if _is_saved_dataset(sub):
                found.append(sub)
            else:
                kept_dirs.append(d)
        dirs[:] = kept_dirs
        found.extend(
            os.path.join(root, name)
            for name in files
            if not name.startswith(".") and name.endswith(SUPPORTED_SUFFIXES)
        )
    return found


def list_corpus_files(data: str) -> list[str]:
    """The corpus entries `data` names, sorted by path: files, or save_to_disk folders.

    `data` is a supported file, a folder (searched recursively; hidden entries skipped; a
    save_to_disk folder counts as one entry), or a glob (`*`, `?`, `[`, `**` recursive).
    """
    data = os.path.expanduser(data)
    if any(ch in data for ch in "*?["):
        entries = []
        for match in glob.glob(data, recursive=True):
            if os.path.isdir(match):
                entries.extend(_walk_folder(match))
            elif match.endswith(SUPPORTED_SUFFIXES):
                entries.append(match)
    elif os.path.isdir(data):
        entries = _walk_folder(data)
    elif os.path.isfile(data):
        if not data.endswith(SUPPORTED_SUFFIXES):
            raise ConfigError(
                f"corpus file {data} has an unsupported extension; use "
                f"{', '.join(SUPPORTED_SUFFIXES)} or a datasets save_to_disk folder"
            )
        entries = [data]
    else:
        raise ConfigError(f"corpus path {data} does not exist; check the path")
    entries = sorted(set(entries))
    if not entries:
        raise ConfigError(
            f"no corpus files found at {data} (looked for {', '.join(SUPPORTED_SUFFIXES)} files "
            f"and datasets save_to_disk folders); check the path or pattern"
        )
    for entry in entries:
        if os.path.isfile(entry):
            _reject_json_array(entry)
    return entries


def _saved_dataset_files(folder: str) -> list[str]:
    with open(os.path.join(folder, "state.json"), encoding="utf-8") as f:
        state = json.load(f)
    return [os.path.join(folder, item["filename"]) for item in state.get("_data_files", [])]


def _sample_digest(path: str, size: int) -> tuple[str, str]:
    """xxh64 of the first MiB and of the last MiB (empty when the file is one MiB or less)."""
    with open(path, "rb") as f:
        head = xxhash.xxh64_hexdigest(f.read(_MIB))
        tail = ""
        if size > _MIB:
            f.seek(max(_MIB, size - _MIB))
            tail = xxhash.xxh64_hexdigest(f.read(_MIB))
    return head, tail


def corpus_fingerprint(files: Sequence[str]) -> str:
    """A stable hex fingerprint of the corpus `files` (as listed by list_corpus_files).

    It hashes each data file's name relative to the files' common folder, its size, and an
    xxh64 of its first and last MiB. This is a cheap fingerprint, not a full content hash:
    an edit in the middle of a large file that keeps its size goes unnoticed. Moving the
    corpus to another folder keeps the fingerprint.
    """
    data_files = []
    for entry in files:
        data_files.extend(_saved_dataset_files(entry) if os.path.isdir(entry) else [entry])
    if not data_files:
        raise ConfigError("corpus_fingerprint got no files; list them with list_corpus_files")
    root = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in data_files])
    digest = hashlib.sha256(_FINGERPRINT_VERSION)
    for path in data_files:
        size = os.path.getsize(path)
        head, tail = _sample_digest(path, size)
        name = os.path.relpath(os.path.abspath(path), root).replace(os.sep, "/")
        digest.update(f"\n{name}\0{size}\0{head}\0{tail}".encode())
    return digest.hexdigest()[:32]


# ---------------------------------------------------------------------------------------------
# Streaming rows


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

# A JSON string (the unrolled form of "(?:[^"\\]|\\.)*", linear and fast), and every byte but
# brackets: what is left of a line without them is its nesting structure.
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth(line: bytes) -> int:
    """How deeply the JSON text `line` nests arrays and objects (`{}` is 1, `{"a": [1]}` is 2).

    Counted on the raw bytes without parsing (strings removed, then a running count of the
    brackets left), so it is linear and safe on any input; for invalid JSON it is a best guess.
    """
    brackets = _JSON_STRING.sub(b"", line).translate(None, _NOT_BRACKETS)
    if not brackets:
        return 0
    codes = np.frombuffer(brackets, dtype=np.uint8)
    steps = np.where((codes == ord("[")) | (codes == ord("{")), np.int32(1), np.int32(-1))
    return int(np.cumsum(steps, dtype=np.int64).max(initial=0))


def parse_json_line(line: bytes) -> tuple[dict | None, str | None]:
    """Parse one JSON Lines line into (object, None) or (None, problem).

    A line nested more than MAX_ROW_DEPTH levels is a problem, found before parsing (so a
    RecursionError from the parser cannot happen; one would still become a problem).
    """
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as err:
        return None, f"not valid UTF-8 at byte {err.start + 1}"
    if line.count(b"[") + line.count(b"{") > MAX_ROW_DEPTH:  # else it cannot nest that deep
        problem = _depth_problem(json_depth(line))
        if problem:
            return None, problem
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        return None, f"invalid JSON: {err.msg} at column {err.colno}"
    except RecursionError:
        return None, f"nested too deeply to parse (limit {MAX_ROW_DEPTH})"
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
            yield number, None, _size_problem(line, max_bytes)
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
    problem = _depth_problem(_schema_depth(batch.schema))
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
                yield None, _size_problem(oversize[i], max_bytes)
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

    dataset = datasets.load_from_disk(folder)  # memory-maps the Arrow files
    if not isinstance(dataset, datasets.Dataset):
        raise ConfigError(f"corpus folder {folder} is not a single datasets split; point at one split")
    return dataset


def _iter_saved_dataset(folder: str, skip: int, max_bytes: int) -> Iterator[tuple[int, dict | None, str | None]]:
    dataset = _load_saved_dataset(folder)
    problem = _depth_problem(_schema_depth(dataset.data.schema))
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
                    yield start + offset + 1, None, _size_problem(oversize[offset], max_bytes)
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


def _iter_entry(entry: str, skip: int, max_bytes: int) -> Iterator[tuple[int, dict | None, str | None]]:
    if os.path.isdir(entry):
        return _iter_saved_dataset(entry, skip, max_bytes)
    if entry.endswith(JSONL_SUFFIXES):
        return _iter_jsonl(entry, skip, max_bytes)
    if entry.endswith(PARQUET_SUFFIXES):
        return _iter_parquet(entry, skip, max_bytes)
    return _iter_batches(_arrow_batches(entry), skip, max_bytes)


def iter_rows(cfg: CorpusConfig, start_row: int = 0) -> Iterator[CorpusRow]:
    """Stream every corpus row in order, starting at global row index `start_row`.

    Rows before `start_row` are counted, not parsed, so a resumed build restarts cheaply.
    Blank JSON Lines lines are not rows. Unreadable rows come back with `problem` set, and so
    do rows nested more than MAX_ROW_DEPTH levels deep or larger than
    row_byte_limit(cfg.max_length) bytes (those are never parsed or converted).
    """
    if not is_int(start_row) or start_row < 0:
        raise ConfigError(f"start_row={start_row!r} must be a non-negative integer")
    skip = start_row
    index = 0
    max_bytes = row_byte_limit(cfg.max_length)
    for entry in list_corpus_files(cfg.data):
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


# ---------------------------------------------------------------------------------------------
# Rows -> messages


def row_id(data: dict) -> str:
    """The row's stable id: its `id` field (str or int) if present, else a content hash.

    The hash is "h" + xxh64 (16 hex digits) of the row's canonical JSON (sorted keys, top-level
    None values dropped, so a Parquet row padded with nulls hashes like its JSON Lines twin).
    """
    value = data.get("id")
    if isinstance(value, str) and value:
        return value
    if is_int(value):
        return str(value)
    present = {key: val for key, val in data.items() if val is not None}
    canonical = json.dumps(present, sort_keys=True, ensure_ascii=False, separators=(",", ":"), default=str)
    return "h" + xxhash.xxh64_hexdigest(canonical.encode("utf-8"))


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {dict: "object", list: "list", str: "string", bool: "boolean"}.get(type(value), type(value).__name__)


def _normalise_chat(field: str, messages: Any) -> list[dict]:
    """[{role, content}] with canonical roles; raises ValueError(problem) on a malformed chat."""
    if not isinstance(messages, (list, tuple)):
        raise ValueError(f"'{field}' must be a list of messages, got {_type_name(messages)}")
    if not messages:
        raise ValueError(f"empty conversation in '{field}'")
    normalised = []
    for i, message in enumerate(messages):
        where = f"{field}[{i}]"
        if not isinstance(message, dict):
            raise ValueError(f"{where} must be an object, got {_type_name(message)}")
        raw_role = message.get("role", message.get("from"))
        content = message.get("content", message.get("value"))
        if not isinstance(raw_role, str):
            raise ValueError(f"{where} has no role (expected 'role' or 'from', got {_type_name(raw_role)})")
        role = ROLE_ALIASES.get(raw_role.strip().lower())
        if role is None:
            known = ", ".join(sorted(ROLE_ALIASES))
            raise ValueError(f"{where} has unknown role {raw_role!r} (known roles: {known})")
        if not isinstance(content, str):
            raise ValueError(f"{where} content must be a string, got {_type_name(content)}")
        entry = {"role": role, "content": content}
        reasoning = message.get("reasoning_content")
        if role == "assistant" and reasoning is not None:
            # kept (regenerate --reasoning keep): the chat template renders it the teacher's way
            if not isinstance(reasoning, str):
                raise ValueError(f"{where} reasoning_content must be a string, got {_type_name(reasoning)}")
            entry["reasoning_content"] = reasoning
        normalised.append(entry)
    if not any(m["role"] == "assistant" for m in normalised):
        raise ValueError(f"conversation in '{field}' has no assistant turn (nothing to learn)")
    return normalised


def parse_messages(row: CorpusRow) -> list[dict] | str:
    """The row's chat as [{role, content}] (roles system/user/assistant/tool; an assistant turn's
    reasoning_content is kept), or its text.

    Reads `messages` ({role, content}), else ShareGPT `conversations` ({from, value}; human ->
    user, gpt/chatgpt/bot/model -> assistant), else `text`. A field holding None counts as
    absent (Parquet and Arrow pad missing columns with nulls). Raises BadRowError naming the
    file, row and problem.
    """
    if row.problem is not None or row.data is None:
        raise BadRowError(row.path, row.row, row.problem or "row has no data")
    data = row.data
    try:
        for field in ("messages", "conversations"):
            if data.get(field) is not None:
                return _normalise_chat(field, data[field])
        text = data.get("text")
        if text is not None:
            if not isinstance(text, str):
                raise ValueError(f"'text' must be a string, got {_type_name(text)}")
            if not text.strip():
                raise ValueError("empty text")
            return text
    except ValueError as err:
        raise BadRowError(row.path, row.row, str(err)) from None
    keys = ", ".join(sorted(map(str, data))) or "none"
    raise BadRowError(row.path, row.row, f"no 'messages', 'conversations' or 'text' field (keys: {keys})")


# ---------------------------------------------------------------------------------------------
# Messages -> tokens and loss mask


@dataclass(frozen=True, eq=False)
class TokenizedSequence:
    """One training sequence, ready for the teacher forward."""

    id: str
    """Stable sequence id (see row_id)."""
    input_ids: np.ndarray
    """Token ids, int32 [T]."""
    loss_mask: np.ndarray
    """1 where the drafter learns the token (assistant turns; all of plain text), uint8 [T]."""
    truncated: bool
    """True when the row was longer than max_length and cut to its first max_length tokens."""


def _find_assistant_text(text: str, content: str, start: int) -> tuple[int, int] | None:
    """Where the assistant `content`, possibly reformatted by the template, occurs from `start`.

    Templates commonly strip reasoning (`<think>...</think>`) or surrounding whitespace from
    earlier turns, so those forms are tried after the literal content.
    """
    candidates = [content]
    if "</think>" in content:
        candidates.append(content.split("</think>")[-1].lstrip("\n"))
    candidates.append(content.strip())
    for candidate in candidates:
        if not candidate:
            continue
        found = text.find(candidate, start)
        if found >= 0:
            return found, found + len(candidate)
    return None


def _search_start(messages: list[dict], i: int, text: str, render: Render, cursor: int) -> int:
    """Where to look for turn i's content: after the rendered earlier messages when those are a
    prefix of `text` (so an identical earlier user message is not taken), else at `cursor`."""
    if i == 0:
        return cursor
    try:
        before = render(messages[:i], False)
    except Exception:  # noqa: BLE001 - a template may refuse partial chats
        return cursor
    return max(cursor, len(before)) if text.startswith(before) else cursor


def assistant_char_spans(
    messages: list[dict], text: str, render: Render, end_of_turn: Callable[[], str], stop_at: int | None = None
) -> list[tuple[int, int]]:
    """Character spans [start, end) of `text` (the rendered chat) written by the assistant.

    A span runs from just after the assistant header to the end of the turn, including what
    the template adds inside the turn (an empty think block) and its end-of-turn text. For each
    assistant turn i, `render(messages[:i], True)` (with the generation prompt) and
    `render(messages[:i+1], False)` bound the span when both are prefixes of `text`. Templates
    that rewrite earlier turns (Qwen3 strips old reasoning) break that; then the turn's content
    is located in `text` and extended by `end_of_turn()` when that text follows it. Raises
    ValueError when a turn cannot be located.

    With `stop_at`, only spans starting before that character are wanted (a long chat is
    tokenized only that far): the search ends at the first turn found to start at or after it.
    """
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if stop_at is not None and cursor >= stop_at:
            break
        # With no earlier message there is no generation prompt to measure the header by.
        prefix = None
        if i:
            try:
                prefix = render(messages[:i], True)
            except Exception:  # noqa: BLE001 - a template may refuse partial chats; fall back below
                prefix = None
        start = len(prefix) if prefix is not None and text.startswith(prefix) else None
        if start is not None and start < cursor:
            start = None
        if stop_at is not None and start is not None and start >= stop_at:
            break
        try:
            through = render(messages[: i + 1], False)
        except Exception:  # noqa: BLE001
            through = None
        if start is not None and through is not None and through.startswith(prefix) and text.startswith(through):
            end = len(through)
        else:
            anchor = start if start is not None else _search_start(messages, i, text, render, cursor)
            found = _find_assistant_text(text, message["content"], anchor)
            if found is None:
                if message["content"].strip():
                    raise ValueError(f"cannot locate assistant turn messages[{i}] in the rendered chat")
                # An empty reply: the turn is just its end-of-turn text.
                marker = end_of_turn()
                hit = text.find(marker, anchor) if marker else -1
                if hit < 0:
                    continue
                found = (hit, hit)
            end = found[1]
            marker = end_of_turn()
            if marker and text.startswith(marker, end):
                end += len(marker)
            if start is None:
                start = found[0]
            if stop_at is not None and start >= stop_at:
                break
        if end > start:
            spans.append((start, end))
        cursor = max(cursor, end)
    return spans


def token_mask_from_spans(offsets: np.ndarray, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """uint8 mask over tokens: 1 where the token's characters overlap any span.

    `offsets` is [T, 2] (start, end) character offsets. A token straddling a span boundary
    counts as inside, so a merged boundary token is learned rather than lost.
    """
    starts, ends = offsets[:, 0], offsets[:, 1]
    mask = np.zeros(len(offsets), dtype=bool)
    for start, end in spans:
        mask |= (starts < end) & (ends > start)
    return mask.astype(np.uint8)


_end_of_turn_cache: dict[tuple[str, str], str] = {}


def _end_of_turn_text(render: Render, key: tuple[str, str]) -> str:
    """The template's end-of-turn text (chat.end_of_turn_text), once per template and kwargs."""
    if key not in _end_of_turn_cache:
        _end_of_turn_cache[key] = end_of_turn_text(render)
    return _end_of_turn_cache[key]


def check_template_kwargs(kwargs) -> None:
    """Refuse chat-template variables that are not a JSON object of plain values."""
    if kwargs is None:
        return
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ConfigError(f"chat template kwargs {kwargs!r} must be a JSON object, e.g. '{{\"enable_thinking\": false}}'")
    try:
        json.dumps(kwargs)
    except (TypeError, ValueError):
        raise ConfigError(f"chat template kwargs {kwargs!r} must hold plain JSON values") from None


def render_chat(tokenizer, messages: list[dict], add_generation_prompt: bool,
                chat_template_kwargs: dict | None = None) -> str:
    """The chat as text through the tokenizer's template: the one rendering build, regenerate,
    eval and generate share, so the drafter is trained and measured on the prompts it is served."""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **(chat_template_kwargs or {}))


def _chat_renderer(tokenizer, chat_template_kwargs: dict | None = None) -> Render:
    def render(messages: list[dict], add_generation_prompt: bool) -> str:
        return render_chat(tokenizer, messages, add_generation_prompt, chat_template_kwargs)

    return render


# A long text is first cut at this many characters per token of max_length, and at most at
# _MAX_CUT_CHARS_PER_TOKEN (see _encode_prefix).
_CUT_CHARS_PER_TOKEN = 32
_MAX_CUT_CHARS_PER_TOKEN = 512

Encode = Callable[[str, bool], tuple[np.ndarray, "np.ndarray | None"]]


def _encoder(tokenizer, add_special_tokens: bool | None) -> Encode:
    """encode(text, with_offsets) -> (int32 ids [T], int64 offsets [T, 2] or None).

    add_special_tokens None means the tokenizer's default. Offsets come only from fast
    tokenizers (None otherwise).
    """
    options = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
    fast = getattr(tokenizer, "is_fast", False)

    def encode(text: str, with_offsets: bool):
        if with_offsets and fast:
            encoding = tokenizer(text, return_offsets_mapping=True, **options)
            offsets = np.asarray(encoding["offset_mapping"], dtype=np.int64).reshape(-1, 2)
            return np.asarray(encoding["input_ids"], dtype=np.int32), offsets
        return np.asarray(tokenizer(text, **options)["input_ids"], dtype=np.int32), None

    return encode


def _settled(ids: np.ndarray, offsets: np.ndarray | None, half: int) -> int:
    """How many leading tokens of a cut text are those of the whole text: the tokens before the
    first one that ends past `half` (the cut's middle). Special tokens added at the end end at
    0, so they never count. Without offsets (slow tokenizers, plain text only) a heuristic: the
    first half of the tokens."""
    if offsets is None:
        return len(ids) // 2
    past = np.flatnonzero(offsets[:, 1] > half)
    return int(past[0]) if len(past) else 0


def _encode_prefix(text: str, encode: Encode, max_length: int, with_offsets: bool):
    """Tokenize `text`, or only as much of its start as it takes to know its first max_length + 1
    tokens, so a huge row costs the tokenizer memory in proportion to max_length, not to its size.

    A text over 32 characters per token of max_length (8-16 times what typical tokens of 2-4
    characters need) is cut there and its start tokenized. Tokens of a text's start are the
    whole text's, except near the cut, where the last word may be split differently; so when
    the first max_length + 1 tokens all end in the first half of the cut text, the text is
    known to be longer than max_length and those are exactly its first max_length + 1 tokens.
    Otherwise (tokens averaging over 16 characters) the cut doubles, up to 512 characters per
    token, past the longest token of real vocabularies; a text still short of settled tokens
    there keeps what is settled and counts as overlong. The tokenizer never sees more than
    512 * max_length characters.

    Returns (ids, offsets or None, cut): `cut` is how much of the text was tokenized, len(text)
    when all of it was (then ids may be longer than max_length); with a shorter cut the row is
    overlong and ids has at most max_length + 1 tokens.
    """
    cut = _CUT_CHARS_PER_TOKEN * max_length
    while cut < len(text):
        ids, offsets = encode(text[:cut], True)
        settled = _settled(ids, offsets, cut // 2)
        if settled > max_length or cut >= _MAX_CUT_CHARS_PER_TOKEN * max_length:
            keep = min(settled, max_length + 1)
            return ids[:keep], None if offsets is None else offsets[:keep], cut
        cut *= 2
    ids, offsets = encode(text, with_offsets)
    return ids, offsets, len(text)


def _tokenize_chat(row: CorpusRow, messages: list[dict], tokenizer, max_length: int,
                   chat_template_kwargs: dict | None = None) -> tuple[np.ndarray, np.ndarray, bool]:
    """(input ids, loss mask, whether the chat was cut): see _encode_prefix for the cut."""
    template = tokenizer.chat_template
    if not template:
        raise ConfigError("the tokenizer has no chat template, so chat rows cannot be rendered; use a chat tokenizer")
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(f"tokenizer {type(tokenizer).__name__} is not a fast tokenizer; loss masks need offsets")
    if isinstance(template, dict):  # several named templates: apply_chat_template uses "default"
        template = json.dumps(template, sort_keys=True)
    render = _chat_renderer(tokenizer, chat_template_kwargs)
    # The template also sees the special tokens (e.g. `{{ eos_token }}`) and the kwargs, so they are part of the key.
    cache_key = (template, str(tokenizer.special_tokens_map) + json.dumps(chat_template_kwargs, sort_keys=True))
    try:
        text = render(messages, False)
    except Exception as err:  # noqa: BLE001 - template errors (e.g. unsupported roles) are per row
        raise BadRowError(row.path, row.row, f"chat template failed: {err}") from None
    input_ids, offsets, cut = _encode_prefix(text, _encoder(tokenizer, False), max_length, with_offsets=True)
    was_cut = cut < len(text)
    try:
        spans = assistant_char_spans(messages, text, render, lambda: _end_of_turn_text(render, cache_key),
                                     stop_at=cut if was_cut else None)
    except ValueError as err:
        raise BadRowError(row.path, row.row, str(err)) from None
    return input_ids, token_mask_from_spans(offsets, spans), was_cut


def tokenize_row(row: CorpusRow, tokenizer, cfg: CorpusConfig) -> TokenizedSequence | str:
    """Tokenize one row into a TokenizedSequence, or return why it is skipped.

    Returns "too_long" (longer than max_length with overlong="drop") or "too_short" (fewer
    than min_length tokens, or a chat with no assistant token left after truncation). Chats
    are rendered with the chat template and tokenized without adding special tokens again;
    plain text is tokenized with the tokenizer's defaults. Raises BadRowError for unusable rows.

    A text far longer than max_length is not tokenized whole: only its start, as far as it
    takes to know the first max_length + 1 tokens (see _encode_prefix), which are the tokens
    the whole text would give. So truncation keeps the same tokens, and "drop" drops the same
    rows, with tokenizer memory bounded by max_length.
    """
    content = parse_messages(row)
    if isinstance(content, str):
        input_ids, _, cut = _encode_prefix(content, _encoder(tokenizer, None), cfg.max_length, with_offsets=False)
        loss_mask = np.ones(len(input_ids), dtype=np.uint8)
        was_cut = cut < len(content)
    else:
        input_ids, loss_mask, was_cut = _tokenize_chat(row, content, tokenizer, cfg.max_length, cfg.chat_template_kwargs)
    truncated = was_cut or len(input_ids) > cfg.max_length
    if truncated:
        if cfg.overlong == "drop":
            return "too_long"
        input_ids, loss_mask = input_ids[: cfg.max_length], loss_mask[: cfg.max_length]
    if len(input_ids) < cfg.min_length or not loss_mask.any():
        return "too_short"
    return TokenizedSequence(id=row_id(row.data), input_ids=input_ids, loss_mask=loss_mask, truncated=truncated)
