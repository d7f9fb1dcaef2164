"""Stage 1 input: find corpus files, stream their rows, turn each row into tokens and a loss mask.

Formats: JSON Lines (`.jsonl`, or `.json` with one object per line), Parquet, Arrow IPC (file
or stream format), a folder or glob of those, and a Hugging Face `datasets` folder written by
`save_to_disk`. Files are streamed, never loaded whole.

A row is a chat (`messages` of {role, content}, or ShareGPT `conversations` of {from, value})
or plain `text`. Chats are rendered with the tokenizer's chat template and learn only the
assistant turns; plain text learns every token.

Each step is a module (CorpusConfig and the formats read are in dflash_cache.settings.corpus_config): ``files`` (finding the
files, the corpus fingerprint), ``rows`` (streaming rows), ``messages`` (a row's id and its
chat), ``tokens`` (tokens and the loss mask) and ``limits`` (how large and how deep one row may
be, so one bad row cannot take the build down: it becomes a bad row naming file, row and
problem).
"""

from dflash_cache.corpus.limits import MAX_ROW_DEPTH, row_byte_limit
from dflash_cache.corpus.listing import corpus_fingerprint, list_corpus_files
from dflash_cache.corpus.messages import parse_messages, row_id
from dflash_cache.corpus.rows import CorpusRow, count_rows, iter_rows, parse_json_line, require_rows
from dflash_cache.corpus.tokens import TokenizedSequence, assistant_char_spans, token_mask_from_spans, tokenize_row
from dflash_cache.settings.corpus_config import BAD_ROW_POLICIES, OVERLONG_POLICIES, SUPPORTED_SUFFIXES, CorpusConfig

__all__ = ["BAD_ROW_POLICIES", "OVERLONG_POLICIES", "SUPPORTED_SUFFIXES", "CorpusConfig", "corpus_fingerprint",
           "list_corpus_files", "MAX_ROW_DEPTH", "row_byte_limit", "parse_messages", "row_id", "CorpusRow", "count_rows",
           "iter_rows", "parse_json_line", "require_rows", "TokenizedSequence", "assistant_char_spans", "token_mask_from_spans",
           "tokenize_row"]
