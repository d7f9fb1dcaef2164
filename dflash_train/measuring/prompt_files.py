"""Prompt files as the field distributes them, read into one list of prompts with a category each.

Each row is recognised by its fields (pure functions, no tokenizer):

| format | fields read | category |
| --- | --- | --- |
| our chat JSONL | `messages` (system/user turns; trailing assistant turns dropped), `id` | `category`, else the file's name |
| plain prompts | `prompt`, `id` | `category`, else the file's name |
| HumanEval (`HumanEval.jsonl[.gz]`) | `prompt`, `task_id` | the file's name |
| MT-Bench (`question.jsonl`) | `turns` (the first turn), `question_id`, `category` | `category` |
| SPEED-Bench (its parquet, or the same rows as JSONL) | `turns` (the first), `question_id`, `category` | `category` |
| GSM8K (`test.jsonl`) | `question` | the file's name |

Multi-turn sets (MT-Bench, SPEED-Bench) are decoded on their first turn: the second turn needs the
model's own first answer in the prompt. A row that fits none of these, or a file that cannot be
read, is refused in one line naming the file, the line, the problem and the fix. So is a file past
the bounds below (its bytes, rows, nesting, a prompt's length) and a category name that is
reserved, long or not printable (categories.category_problem): a prompts file may come from anywhere.
"""

from __future__ import annotations

import gzip
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

from dflash_common.errors import ConfigError, quoted
from dflash_common.files import file_kind
from dflash_common.settings_files import read_bounded
from dflash_common.values import MAX_OPTION_DEPTH, nesting_depth, text_problem
from dflash_train.measuring.categories import category_problem

PROMPTS_BYTES = 64 << 20
"""A prompts file's bound (uncompressed): ~100,000 long prompts, far more than an eval needs."""
PROMPT_ROWS = 100_000
"""The most rows a prompts file may hold (each becomes a prompt decoded twice); benchmarks hold hundreds to thousands."""
PROMPT_CHARS = 1_000_000
"""The longest prompt, in characters: four times the longest context the field serves (262,144
tokens) at about four characters a token. A longer one cannot fit a teacher, and tokenizing a
60 MB prompt took the tokenizer past its memory."""
PROMPT_DEPTH = MAX_OPTION_DEPTH
"""The deepest nesting of lists and objects a row may hold (benchmarks' rows nest 3 levels)."""

FORMATS = ("chat", "prompt", "humaneval", "mt_bench", "speed_bench", "gsm8k")
FIELDS_HINT = ("give 'messages' (chat), 'prompt' (plain text or HumanEval), 'turns' (MT-Bench, SPEED-Bench) or "
               "'question' (GSM8K)")


@dataclass(frozen=True)
class PromptRow:
    """One prompt of a prompts file, before tokenization."""

    id: str
    """The row's id (`id`, `question_id`, `task_id`), else FILE-LINE."""
    category: str
    """The row's `category`, else the file's name without its suffixes."""
    messages: tuple[dict, ...]
    """The chat to answer: system and user turns, ending with a user turn."""
    format: str
    """Which of FORMATS the row was read as."""


def file_category(path: str) -> str:
    """A file's name as a category: HumanEval.jsonl.gz -> HumanEval, gsm8k_test.jsonl -> gsm8k_test."""
    name = Path(path).name
    for suffix in (".gz", ".jsonl", ".json", ".parquet"):
        name = name.removesuffix(suffix)
    return name or Path(path).name


def _problem(path: str, where: str, problem: str, fix: str = FIELDS_HINT) -> ConfigError:
    return ConfigError(f"{path} {where}: {problem}; {fix}")


def _text(value, name: str) -> str | None:
    """The problem with a field that must be non-empty text, or None."""
    if not isinstance(value, str):
        return f"'{name}' is {type(value).__name__} {quoted(value, 40)}, not text"
    if not value.strip():
        return f"'{name}' is empty"
    if len(value) > PROMPT_CHARS:
        return f"'{name}' is {len(value):,} characters long, more than the {PROMPT_CHARS:,} a prompt may hold"
    return text_problem(value)


def _chat(messages) -> tuple[tuple[dict, ...] | None, str | None]:
    """A chat row's prompt turns (trailing assistant turns dropped), or the problem with it."""
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        return None, "'messages' must be a list of {'role', 'content'} objects"
    for m in messages:
        if m.get("role") not in ("system", "user", "assistant"):
            return None, f"a message's role is {quoted(m.get('role'), 30)}; use system, user or assistant"
        problem = _text(m.get("content"), "content")
        if problem:
            return None, f"a {m['role']} message's {problem}"
    length = sum(len(m["content"]) for m in messages)
    if length > PROMPT_CHARS:
        return None, f"its messages are {length:,} characters long, more than the {PROMPT_CHARS:,} a prompt may hold"
    turns = list(messages)
    while turns and turns[-1]["role"] == "assistant":
        turns.pop()
    if not turns or turns[-1]["role"] != "user":
        return None, "'messages' has no user turn to answer"
    return tuple({"role": m["role"], "content": m["content"]} for m in turns), None


def _user(text: str) -> tuple[dict, ...]:
    return ({"role": "user", "content": text},)


def row_prompt(row, path: str, where: str, number: int) -> PromptRow:
    """One row of a prompts file as a PromptRow (pure); ``where`` is "line N" or "row N"."""
    if not isinstance(row, dict):
        raise _problem(path, where, f"a JSON {type(row).__name__}, not an object")
    if nesting_depth(row) > PROMPT_DEPTH:
        raise _problem(path, where, f"nested more than {PROMPT_DEPTH} levels deep", "fix the row")
    if "messages" in row:
        messages, problem = _chat(row["messages"])
        kind = "chat"
    elif "turns" in row:
        turns = row["turns"]
        if not isinstance(turns, list) or not turns:
            problem = f"'turns' is {quoted(turns, 40)}, not a non-empty list of texts"
        else:
            problem = _text(turns[0], "turns[0]")
        messages = None if problem else _user(turns[0])
        kind = "speed_bench" if "sub_category" in row or "multiturn" in row else "mt_bench"
    elif "question" in row:
        problem = _text(row["question"], "question")
        messages, kind = (None if problem else _user(row["question"])), "gsm8k"
    elif "prompt" in row:
        problem = _text(row["prompt"], "prompt")
        messages, kind = (None if problem else _user(row["prompt"])), ("humaneval" if "task_id" in row else "prompt")
    else:
        keys = ", ".join(quoted(k, 20) for k in list(row)[:6]) or "none"
        raise _problem(path, where, f"a row with the fields {keys} is none of the formats eval reads")
    if problem:
        raise _problem(path, where, problem, "fix the row")
    category = row.get("category")
    if category is not None and (not isinstance(category, str) or not category.strip()):
        raise _problem(path, where, f"'category' is {quoted(category, 40)}, not a name", "fix the row or drop the field")
    name = (category or file_category(path)).strip()
    problem = category_problem(name)
    if problem:
        fix = "rename the category in the row" if category else "give the rows a 'category', or rename the file"
        raise _problem(path, where, f"the category {problem}", fix)
    ident = next((row[k] for k in ("id", "question_id", "task_id") if isinstance(row.get(k), (str, int))), None)
    return PromptRow(id=str(ident) if ident is not None else f"{file_category(path)}-{number}",
                     category=name, messages=messages, format=kind)


def _file_bytes(path: str) -> bytes:
    """A file's bytes within PROMPTS_BYTES, gunzipped when its name ends in .gz."""
    fix = "pass a prompts file of JSON Lines (or .jsonl.gz, .parquet), one prompt a row"
    if not os.path.exists(path):
        raise ConfigError(f"prompts file {path} does not exist; {fix}")
    if not Path(path).is_file():
        raise ConfigError(f"prompts file {path} is a {file_kind(os.stat(path).st_mode)}, not a regular file; {fix}")
    if not path.endswith(".gz"):
        return read_bounded(lambda: open(path, "rb"), f"prompts file {path}", PROMPTS_BYTES, fix=fix)
    try:
        return read_bounded(lambda: gzip.open(path, "rb"), f"prompts file {path} (uncompressed)", PROMPTS_BYTES, fix=fix)
    except (OSError, EOFError) as err:  # gzip.BadGzipFile is an OSError
        raise ConfigError(f"prompts file {path} is not a whole gzip file ({err}); pass it uncompressed or "
                          "download it again") from None


def _jsonl_rows(path: str) -> Iterable[tuple[str, object]]:
    data = _file_bytes(path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ConfigError(f"prompts file {path} is not UTF-8 text (byte {err.start}); pass a JSON Lines file") from None
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise _problem(path, f"line {number}", f"not JSON ({err.msg} at column {err.colno})",
                           "each line must be one JSON object (a .json array or a CSV is not read)") from None
        except RecursionError:  # the parser recurses per level: 200,000 levels end it
            raise _problem(path, f"line {number}", f"nested too deeply to parse (more than {PROMPT_DEPTH} levels)",
                           "fix the row") from None
        yield f"line {number}", row


def _parquet_rows(path: str, limit: int | None) -> Iterable[tuple[str, object]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    size = Path(path).stat().st_size if Path(path).is_file() else 0
    if size > PROMPTS_BYTES:
        raise ConfigError(f"prompts file {path} is {size:,} bytes, over the {PROMPTS_BYTES:,} an eval reads; "
                          "pass a smaller split")
    try:
        parquet = pq.ParquetFile(path)
        rows, unpacked = parquet.metadata.num_rows, sum(parquet.metadata.row_group(i).total_byte_size
                                                         for i in range(parquet.metadata.num_row_groups))
        if rows > PROMPT_ROWS and (limit is None or limit > PROMPT_ROWS):
            raise _too_many_rows(path, rows)
        if unpacked > PROMPTS_BYTES:
            raise ConfigError(f"prompts file {path} holds {unpacked:,} bytes of data uncompressed, over the "
                              f"{PROMPTS_BYTES:,} an eval reads; pass a smaller split")
        number = 0
        # a batch at a time: a row as Python values takes many times its Arrow bytes
        for batch in parquet.iter_batches(batch_size=1024):
            for row in batch.to_pylist():
                number += 1
                yield f"row {number}", row
    except (OSError, pa.ArrowException) as err:
        raise ConfigError(f"prompts file {path} is not a Parquet file pyarrow can read ({str(err)[:120]}); pass a "
                          "JSON Lines or Parquet file") from None


def _too_many_rows(path: str, rows: int | None) -> ConfigError:
    held = f"{rows:,} rows" if rows is not None else "more rows"
    return ConfigError(f"prompts file {path} holds {held}, more than the {PROMPT_ROWS:,} an eval decodes; pass a "
                       f"smaller split, or --max-prompts {PROMPT_ROWS:,} or fewer")


def read_prompt_file(path: str, limit: int | None = None) -> list[PromptRow]:
    """The prompts of one file (JSON Lines, .jsonl.gz or .parquet), the first ``limit`` when given."""
    rows = _parquet_rows(path, limit) if path.endswith(".parquet") else _jsonl_rows(path)
    prompts: list[PromptRow] = []
    for where, row in rows:
        if len(prompts) >= PROMPT_ROWS:
            raise _too_many_rows(path, None)
        prompts.append(row_prompt(row, path, where, len(prompts) + 1))
        if limit and len(prompts) >= limit:
            break
    if not prompts:
        raise ConfigError(f"prompts file {path} holds no prompts; pass a file with at least one row")
    return prompts


def read_prompt_files(paths: Sequence[str], limit: int | None = None) -> list[PromptRow]:
    """The prompts of several files in order, the first ``limit`` of each; ids made unique per file."""
    if not paths:
        raise ConfigError("no prompts file given; pass --prompts FILE (repeat it for several files)")
    out: list[PromptRow] = []
    seen: set[str] = set()
    for path in paths:
        for p in read_prompt_file(path, limit):
            ident, n = p.id, 1
            while ident in seen:  # the same id in two files (or twice in one): named by its file, then counted
                n += 1
                ident = f"{file_category(path)}/{p.id}" + (f"-{n - 1}" if n > 2 else "")
            seen.add(ident)
            out.append(p if ident == p.id else PromptRow(ident, p.category, p.messages, p.format))
    return out
