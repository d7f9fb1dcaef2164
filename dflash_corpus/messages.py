"""A row's id, and its chat messages (or plain text) in one normal form.
"""

from __future__ import annotations

import json
from typing import Any

import xxhash

from dflash_common.errors import BadRowError
from dflash_common.values import is_int, text_problem
from dflash_corpus.rows import CorpusRow

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
        if text_problem(content):
            raise ValueError(f"{where} content {text_problem(content)}")
        entry = {"role": role, "content": content}
        reasoning = message.get("reasoning_content")
        if role == "assistant" and reasoning is not None:
            # kept (regenerate --reasoning keep): the chat template renders it the teacher's way
            if not isinstance(reasoning, str):
                raise ValueError(f"{where} reasoning_content must be a string, got {_type_name(reasoning)}")
            if text_problem(reasoning):
                raise ValueError(f"{where} reasoning_content {text_problem(reasoning)}")
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
            if text_problem(text):
                raise ValueError(f"'text' {text_problem(text)}")
            return text
    except ValueError as err:
        raise BadRowError(row.path, row.row, str(err)) from None
    keys = ", ".join(sorted(map(str, data))) or "none"
    raise BadRowError(row.path, row.row, f"no 'messages', 'conversations' or 'text' field (keys: {keys})")
