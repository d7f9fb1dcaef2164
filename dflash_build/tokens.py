"""A row's messages as token ids and a loss mask that covers the assistant turns.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from dflash_common.errors import BadRowError, ConfigError
from dflash_corpus.messages import parse_messages, row_id
from dflash_corpus.rows import CorpusRow
from dflash_corpus.settings.corpus_config import CorpusConfig
from dflash_teacher.chat_template import Render, end_of_turn_text, error_text, template_fault, tokenizer_render


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


def _rendered(render: Render, messages: list[dict], generation_prompt: bool) -> str | None:
    """The template's text of a partial chat, or None when the template refuses it (some refuse
    partial chats; the caller falls back to locating the turn's content)."""
    try:
        return render(messages, generation_prompt)
    except Exception:  # noqa: BLE001 - any template error means: no such prefix
        return None


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
        prefix = _rendered(render, messages[:i], True) if i else None
        start = len(prefix) if prefix is not None and text.startswith(prefix) else None
        if start is not None and start < cursor:
            start = None
        if stop_at is not None and start is not None and start >= stop_at:
            break
        through = _rendered(render, messages[: i + 1], False)
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
    """The template's end-of-turn text (chat_template.end_of_turn_text), once per template and kwargs."""
    if key not in _end_of_turn_cache:
        _end_of_turn_cache[key] = end_of_turn_text(render)
    return _end_of_turn_cache[key]


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
    render = tokenizer_render(tokenizer, chat_template_kwargs)
    # The template also sees the special tokens (e.g. `{{ eos_token }}`) and the kwargs, so they are part of the key.
    cache_key = (template, str(tokenizer.special_tokens_map) + json.dumps(chat_template_kwargs, sort_keys=True))
    try:
        text = render(messages, False)
    except Exception as err:  # noqa: BLE001 - template errors (e.g. unsupported roles) are per row
        fault = template_fault(render, err, getattr(tokenizer, "name_or_path", "") or "the tokenizer")
        if fault:  # not a bad row: --on-bad-row skip would skip every row and write an empty cache
            raise ConfigError(fault) from None
        raise BadRowError(row.path, row.row, f"chat template failed: {error_text(err)}") from None
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

    Returns "too_long" (longer than max_length with overlong="drop", or a chat cut at max_length
    before its first assistant token: nothing left to learn because the row is long) or
    "too_short" (fewer than min_length tokens, or a chat with no assistant token at all). Chats
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
        if not loss_mask.any():  # a 10 MB prompt is no short row: its answer lies past the cut
            return "too_long"
    if len(input_ids) < cfg.min_length or not loss_mask.any():
        return "too_short"
    return TokenizedSequence(id=row_id(row.data), input_ids=input_ids, loss_mask=loss_mask, truncated=truncated)
