"""Stage 1 input: find corpus files, stream their rows, turn each row into tokens and a loss mask.

Formats: JSON Lines (`.jsonl`, or `.json` with one object per line), Parquet, Arrow IPC (file
or stream format), a folder or glob of those, and a Hugging Face `datasets` folder written by
`save_to_disk`. Files are streamed, never loaded whole.

A row is a chat (`messages` of {role, content}, or ShareGPT `conversations` of {from, value})
or plain `text`. Chats are rendered with the tokenizer's chat template and learn only the
assistant turns; plain text learns every token.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import xxhash

from dflash_cache.errors import BadRowError, ConfigError

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
    """Longest sequence kept, in tokens."""
    overlong: str = "truncate"
    """What to do with a row longer than max_length: "truncate" (keep the first max_length
    tokens) or "drop" (skip the row)."""
    min_length: int = 2
    """Rows shorter than this many tokens (after truncation) are skipped."""
    on_bad_row: str = "fail"
    """What the build does with an unusable row: "fail" (stop with its file and row) or
    "skip" (count it and go on)."""

    def __post_init__(self):
        if not isinstance(self.data, str) or not self.data.strip():
            raise ConfigError(f"corpus data={self.data!r} is empty; pass a file, folder or glob")
        if not _is_int(self.max_length) or self.max_length < 1:
            raise ConfigError(f"max_length={self.max_length!r} must be a positive integer; e.g. 4096")
        if self.overlong not in OVERLONG_POLICIES:
            raise ConfigError(f"overlong={self.overlong!r} is unknown; use 'truncate' or 'drop'")
        if not _is_int(self.min_length) or not 1 <= self.min_length <= self.max_length:
            raise ConfigError(
                f"min_length={self.min_length!r} must be an integer in 1..max_length "
                f"({self.max_length}); e.g. 2"
            )
        if self.on_bad_row not in BAD_ROW_POLICIES:
            raise ConfigError(f"on_bad_row={self.on_bad_row!r} is unknown; use 'fail' or 'skip'")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
    """Why the row could not be read (invalid JSON, not an object, not UTF-8), else None."""


_JSON_TYPE_NAMES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}


def parse_json_line(line: bytes) -> tuple[dict | None, str | None]:
    """Parse one JSON Lines line into (object, None) or (None, problem)."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as err:
        return None, f"not valid UTF-8 at byte {err.start + 1}"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        return None, f"invalid JSON: {err.msg} at column {err.colno}"
    if not isinstance(value, dict):
        kind = "null" if value is None else _JSON_TYPE_NAMES.get(type(value), type(value).__name__)
        return None, f"not a JSON object (got a JSON {kind})"
    return value, None


def _jsonl_lines(path: str) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, line bytes) of every non-blank line."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, start=1):
            if number == 1 and line.startswith(b"\xef\xbb\xbf"):
                line = line[3:]
            if line.strip():
                yield number, line


def _count_jsonl(path: str) -> int:
    return sum(1 for _ in _jsonl_lines(path))


def _iter_jsonl(path: str, skip: int) -> Iterator[tuple[int, dict | None, str | None]]:
    for position, (number, line) in enumerate(_jsonl_lines(path)):
        if position < skip:
            continue
        data, problem = parse_json_line(line)
        yield number, data, problem


def _rows_of_batch(batch, skip: int) -> Iterator[dict]:
    for start in range(skip, batch.num_rows, _ROWS_PER_SLICE):
        yield from batch.slice(start, _ROWS_PER_SLICE).to_pylist()


def _iter_batches(batches, skip: int) -> Iterator[tuple[int, dict | None, str | None]]:
    """Rows of consecutive record batches, skipping the first `skip` without converting them."""
    number = 0
    for batch in batches:
        if skip >= batch.num_rows:
            skip -= batch.num_rows
            number += batch.num_rows
            continue
        number += skip
        for data in _rows_of_batch(batch, skip):
            number += 1
            yield number, data, None
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


def _iter_parquet(path: str, skip: int) -> Iterator[tuple[int, dict | None, str | None]]:
    parquet = _parquet_file(path)
    groups = [parquet.metadata.row_group(i).num_rows for i in range(parquet.num_row_groups)]
    first, skipped = 0, 0
    while first < len(groups) and skipped + groups[first] <= skip:
        skipped += groups[first]
        first += 1
    if first == len(groups):
        return
    batches = parquet.iter_batches(batch_size=_ROWS_PER_SLICE, row_groups=range(first, len(groups)))
    for number, data, problem in _iter_batches(batches, skip - skipped):
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


def _iter_saved_dataset(folder: str, skip: int) -> Iterator[tuple[int, dict | None, str | None]]:
    dataset = _load_saved_dataset(folder)
    for start in range(skip, len(dataset), _ROWS_PER_SLICE):
        columns = dataset[start : start + _ROWS_PER_SLICE]
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


def _iter_entry(entry: str, skip: int) -> Iterator[tuple[int, dict | None, str | None]]:
    if os.path.isdir(entry):
        return _iter_saved_dataset(entry, skip)
    if entry.endswith(JSONL_SUFFIXES):
        return _iter_jsonl(entry, skip)
    if entry.endswith(PARQUET_SUFFIXES):
        return _iter_parquet(entry, skip)
    return _iter_batches(_arrow_batches(entry), skip)


def iter_rows(cfg: CorpusConfig, start_row: int = 0) -> Iterator[CorpusRow]:
    """Stream every corpus row in order, starting at global row index `start_row`.

    Rows before `start_row` are counted, not parsed, so a resumed build restarts cheaply.
    Blank JSON Lines lines are not rows. Unreadable rows come back with `problem` set.
    """
    if not _is_int(start_row) or start_row < 0:
        raise ConfigError(f"start_row={start_row!r} must be a non-negative integer")
    skip = start_row
    index = 0
    for entry in list_corpus_files(cfg.data):
        if skip:
            count = _count_rows(entry)
            if count <= skip:
                skip -= count
                index += count
                continue
            index += skip
        for number, data, problem in _iter_entry(entry, skip):
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
    if _is_int(value):
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
        normalised.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in normalised):
        raise ValueError(f"conversation in '{field}' has no assistant turn (nothing to learn)")
    return normalised


def parse_messages(row: CorpusRow) -> list[dict] | str:
    """The row's chat as [{role, content}] (roles system/user/assistant/tool), or its text.

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


Render = Callable[[list[dict], bool], str]


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
    messages: list[dict], text: str, render: Render, end_of_turn: Callable[[], str]
) -> list[tuple[int, int]]:
    """Character spans [start, end) of `text` (the rendered chat) written by the assistant.

    A span runs from just after the assistant header to the end of the turn, including what
    the template adds inside the turn (an empty think block) and its end-of-turn text. For each
    assistant turn i, `render(messages[:i], True)` (with the generation prompt) and
    `render(messages[:i+1], False)` bound the span when both are prefixes of `text`. Templates
    that rewrite earlier turns (Qwen3 strips old reasoning) break that; then the turn's content
    is located in `text` and extended by `end_of_turn()` when that text follows it. Raises
    ValueError when a turn cannot be located.
    """
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        # With no earlier message there is no generation prompt to measure the header by.
        prefix = None
        if i:
            try:
                prefix = render(messages[:i], True)
            except Exception:  # noqa: BLE001 - a template may refuse partial chats; fall back below
                prefix = None
        try:
            through = render(messages[: i + 1], False)
        except Exception:  # noqa: BLE001
            through = None
        start = len(prefix) if prefix is not None and text.startswith(prefix) else None
        if start is not None and start < cursor:
            start = None
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


_PROBE = "dflash end-of-turn probe 7c1e"
_end_of_turn_cache: dict[tuple[str, str], str] = {}


def _end_of_turn_text(render: Render, key: tuple[str, str]) -> str:
    """The text a template writes after an assistant message (e.g. "<|im_end|>\\n"), or ""."""
    if key not in _end_of_turn_cache:
        marker = ""
        try:
            rendered = render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": _PROBE}], False)
            if _PROBE in rendered:
                marker = rendered[rendered.rindex(_PROBE) + len(_PROBE) :]
        except Exception:  # noqa: BLE001 - no marker just means spans end at the content
            pass
        _end_of_turn_cache[key] = marker
    return _end_of_turn_cache[key]


def _chat_renderer(tokenizer) -> Render:
    def render(messages: list[dict], add_generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    return render


def _tokenize_chat(row: CorpusRow, messages: list[dict], tokenizer) -> tuple[np.ndarray, np.ndarray]:
    template = tokenizer.chat_template
    if not template:
        raise ConfigError("the tokenizer has no chat template, so chat rows cannot be rendered; use a chat tokenizer")
    if not getattr(tokenizer, "is_fast", False):
        raise ConfigError(f"tokenizer {type(tokenizer).__name__} is not a fast tokenizer; loss masks need offsets")
    if isinstance(template, dict):  # several named templates: apply_chat_template uses "default"
        template = json.dumps(template, sort_keys=True)
    render = _chat_renderer(tokenizer)
    # The template also sees the special tokens (e.g. `{{ eos_token }}`), so they are part of the key.
    cache_key = (template, str(tokenizer.special_tokens_map))
    try:
        text = render(messages, False)
    except Exception as err:  # noqa: BLE001 - template errors (e.g. unsupported roles) are per row
        raise BadRowError(row.path, row.row, f"chat template failed: {err}") from None
    try:
        spans = assistant_char_spans(messages, text, render, lambda: _end_of_turn_text(render, cache_key))
    except ValueError as err:
        raise BadRowError(row.path, row.row, str(err)) from None
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = np.asarray(encoding["input_ids"], dtype=np.int32)
    offsets = np.asarray(encoding["offset_mapping"], dtype=np.int64).reshape(-1, 2)
    return input_ids, token_mask_from_spans(offsets, spans)


def tokenize_row(row: CorpusRow, tokenizer, cfg: CorpusConfig) -> TokenizedSequence | str:
    """Tokenize one row into a TokenizedSequence, or return why it is skipped.

    Returns "too_long" (longer than max_length with overlong="drop") or "too_short" (fewer
    than min_length tokens, or a chat with no assistant token left after truncation). Chats
    are rendered with the chat template and tokenized without adding special tokens again;
    plain text is tokenized with the tokenizer's defaults. Raises BadRowError for unusable rows.
    """
    content = parse_messages(row)
    if isinstance(content, str):
        input_ids = np.asarray(tokenizer(content)["input_ids"], dtype=np.int32)
        loss_mask = np.ones(len(input_ids), dtype=np.uint8)
    else:
        input_ids, loss_mask = _tokenize_chat(row, content, tokenizer)
    truncated = len(input_ids) > cfg.max_length
    if truncated:
        if cfg.overlong == "drop":
            return "too_long"
        input_ids, loss_mask = input_ids[: cfg.max_length], loss_mask[: cfg.max_length]
    if len(input_ids) < cfg.min_length or not loss_mask.any():
        return "too_short"
    return TokenizedSequence(id=row_id(row.data), input_ids=input_ids, loss_mask=loss_mask, truncated=truncated)
