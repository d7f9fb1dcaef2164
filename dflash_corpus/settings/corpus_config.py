"""CorpusConfig: where the corpus is and how its rows become sequences, and the file formats read
(its chat-template variables are checked by dflash_common.template_kwargs)."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_common.errors import ConfigError
from dflash_common.template_kwargs import check_template_kwargs
from dflash_common.values import is_int

JSONL_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)
ARROW_SUFFIXES = (".arrow",)
SUPPORTED_SUFFIXES = JSONL_SUFFIXES + PARQUET_SUFFIXES + ARROW_SUFFIXES

OVERLONG_POLICIES = ("truncate", "drop")
BAD_ROW_POLICIES = ("fail", "skip")


@dataclass(frozen=True)
class CorpusConfig:
    """Where the corpus is and how its rows become training sequences."""

    data: str
    """A corpus: JSONL, Parquet or Arrow file(s), a folder of them (searched recursively) or a glob,
    or a `datasets` save_to_disk folder. Rows: chat `messages` ([{role, content}]), ShareGPT
    `conversations` ([{from, value}]) or plain `text`; the sequence id is the `id` field or a
    stable hash of the row."""
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
    "skip" (count it in the manifest and go on). Rows nested over 100 levels or over 64 MiB are bad rows."""
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
