"""The MASK token of a drafter's blocks: the tokenizer's <|MASK|>, an override, or the first
embedding row no token uses."""

from __future__ import annotations

from typing import Any

from dflash_common.errors import ConfigError
from dflash_train.settings.drafter_config import _require_int

MASK_TOKEN = "<|MASK|>"

def mask_token_text(tokenizer: Any, mask_token_id: int) -> str | None:
    """The token the tokenizer has at mask_token_id, or None for an id beyond its vocabulary."""
    for token, token_id in tokenizer.get_vocab().items():
        if token_id == mask_token_id:
            return token
    return None


def resolve_mask_token_id(tokenizer: Any, num_embedding_rows: int, override: int | None = None) -> int:
    """Pick the MASK token: the override, the tokenizer's `<|MASK|>`, or the first unused embedding row.

    `tokenizer` is a transformers tokenizer or a `tokenizers.Tokenizer`.
    """
    if override is not None:
        _require_int("mask token id", override)
        if not 0 <= override < num_embedding_rows:
            raise ConfigError(
                f"--mask-token-id {override} is outside the teacher's {num_embedding_rows} embedding rows; "
                f"pass an id in [0, {num_embedding_rows})")
        return override
    vocab = tokenizer.get_vocab()
    mask_id = vocab.get(MASK_TOKEN)
    if mask_id is not None and mask_id < num_embedding_rows:
        return int(mask_id)
    used = len(tokenizer) if hasattr(tokenizer, "__len__") else tokenizer.get_vocab_size(with_added_tokens=True)
    # Ids need not be contiguous; the first free row is beyond the largest one in use.
    first_free = max(used, max(vocab.values(), default=-1) + 1)
    if first_free < num_embedding_rows:
        return first_free
    raise ConfigError(
        f"the tokenizer has no {MASK_TOKEN} token and uses all {num_embedding_rows} embedding rows; "
        "pass --mask-token-id with a rarely used token id")
