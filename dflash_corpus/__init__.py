"""Corpus reading, for stage 0 (dflash_regenerate) and stage 1 (dflash_build): find corpus files,
stream their rows, and read each row's id and chat.

Formats: JSON Lines (`.jsonl`, or `.json` with one object per line), Parquet, Arrow IPC (file
or stream format), a folder or glob of those, and a Hugging Face `datasets` folder written by
`save_to_disk`. Files are streamed, never loaded whole.

A row is a chat (`messages` of {role, content}, or ShareGPT `conversations` of {from, value})
or plain `text`. The build renders chats with the tokenizer's chat template and learns only the
assistant turns; plain text learns every token (that step, through the teacher's template, is
dflash_build.tokens).

Each step is a module (CorpusConfig and the formats read are in dflash_corpus.settings.corpus_config):
``listing`` (finding the files, the corpus fingerprint), ``rows`` (streaming rows), ``messages``
(a row's id and its chat) and ``limits`` (how large and how deep one row may be, so one bad row
cannot take the build down: it becomes a bad row naming file, row and problem).
"""

from dflash_corpus.limits import MAX_ROW_DEPTH, row_byte_limit
from dflash_corpus.listing import corpus_fingerprint, list_corpus_files
from dflash_corpus.messages import parse_messages, row_id
from dflash_corpus.rows import CorpusRow, count_rows, iter_rows, parse_json_line, require_rows
from dflash_corpus.settings.corpus_config import BAD_ROW_POLICIES, OVERLONG_POLICIES, SUPPORTED_SUFFIXES, CorpusConfig

__all__ = ["BAD_ROW_POLICIES", "OVERLONG_POLICIES", "SUPPORTED_SUFFIXES", "CorpusConfig", "corpus_fingerprint",
           "list_corpus_files", "MAX_ROW_DEPTH", "row_byte_limit", "parse_messages", "row_id", "CorpusRow", "count_rows",
           "iter_rows", "parse_json_line", "require_rows"]
