"""How large and how deeply nested one corpus row may be.

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

_MIB = 1 << 20

MAX_ROW_DEPTH = 100
"""Deepest nesting of lists and objects in a row (the row object is level 1); deeper is a bad row."""
MIN_ROW_BYTE_LIMIT = 64 * _MIB
"""The row size limit never goes below this many bytes (see row_byte_limit)."""
ROW_BYTES_PER_TOKEN = 64
"""Bytes of row allowed per token of max_length (see row_byte_limit)."""


def row_byte_limit(max_length: int) -> int:
    """The largest row accepted, in bytes: max(MIN_ROW_BYTE_LIMIT, ROW_BYTES_PER_TOKEN * max_length).

    64 MiB for any max_length up to 1M tokens. A row that fills max_length takes a few bytes of
    JSON per token (up to ~20 for escaped CJK or emoji), so real conversations, however long, fit
    with a wide margin, while a row of hundreds of MB, which costs a multiple of its size to
    parse and render, is refused. Longer rows within the limit are truncated as usual.
    """
    return max(MIN_ROW_BYTE_LIMIT, ROW_BYTES_PER_TOKEN * max_length)


def size_problem(size: int, limit: int) -> str:
    return f"{size:,} bytes long (limit {limit:,} bytes)"


def depth_problem(depth: int) -> str | None:
    return f"nested {depth:,} levels deep (limit {MAX_ROW_DEPTH})" if depth > MAX_ROW_DEPTH else None
