"""Long conversations from a chat corpus, for issue 59's study of anchors on production-length
sequences: the repository's teachers answer in tens to a few hundred tokens, so a sequence of
~2,000 is made the way multi-turn data is, by consecutive chats joined into one conversation.

`conversations` joins a corpus's chats in order, each conversation as long as its tokens under
the teacher's chat template allow (at most `limit`), every assistant turn kept (each a
loss-masked span of the cache), the first chat's system message its only one. `long_prompts`
gives every held-out prompt a context of the same length, made of chats kept out of the
conversations (`reserve`), so the real decoder drafts at the positions training saw.

    python examples/long_chat.py DATA PROMPTS TEACHER OUT_DATA OUT_PROMPTS [--limit 2000] [--reserve 0.1]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable
from pathlib import Path

Count = Callable[[list[dict], bool], int]
"""Tokens of a chat under the teacher's template (the second argument: with a generation prompt)."""


def _turns(row: dict) -> list[dict]:
    return [m for m in row["messages"] if m["role"] != "system"]


def _system(row: dict) -> list[dict]:
    return [m for m in row["messages"][:1] if m["role"] == "system"]


def conversations(rows: Iterable[dict], count: Count, limit: int) -> list[dict]:
    """Consecutive rows joined while the conversation stays within `limit` tokens; a row that
    alone is longer is left out. Ids name the rows joined (first..last)."""
    out, messages, ids = [], [], []

    def close():
        if ids:
            out.append({"id": f"long-{ids[0]}..{ids[-1]}", "messages": messages})

    for row in rows:
        trial = (messages or _system(row)) + _turns(row)
        if count(trial, False) > limit:
            close()
            trial, ids = _system(row) + _turns(row), []
            if count(trial, False) > limit:
                messages = []
                continue
        messages, ids = trial, ids + [row["id"]]
    close()
    return out


def long_prompts(prompts: Iterable[dict], context: list[dict], count: Count, limit: int) -> list[dict]:
    """Each prompt's last user turn after its own system message and as many context chats (taken
    in turn, round robin across prompts) as keep the prompt, with its generation prompt, within
    `limit` tokens."""
    out, at = [], 0
    for prompt in prompts:
        head, question = _system(prompt), prompt["messages"][-1:]
        messages = head
        for _ in range(len(context)):
            trial = messages + _turns(context[at % len(context)])
            if count(trial + question, True) > limit:
                break
            messages, at = trial, at + 1
        out.append({**prompt, "messages": messages + question})
    return out


def token_counter(teacher: str | Path) -> Count:
    """Count with the teacher's tokenizer and chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(teacher))

    def count(messages: list[dict], generation: bool) -> int:
        return len(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation,
                                                 return_dict=False))

    return count


def _read(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _write(rows: list[dict], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    tmp.replace(path)


def write_long(data: Path, prompts: Path, teacher: str | Path, out_data: Path, out_prompts: Path,
               limit: int = 2000, reserve: float = 0.1, prompt_limit: int | None = None) -> tuple[Path, Path]:
    """The long corpus and its held-out prompts: the last `reserve` of data's rows are the
    prompts' context only (never in a conversation); prompts within prompt_limit tokens (default
    limit - 64, room for the answer the decoder generates). Reused when both files exist."""
    if out_data.exists() and out_prompts.exists():
        return out_data, out_prompts
    rows, count = _read(data), token_counter(teacher)
    kept = len(rows) - max(1, int(len(rows) * reserve))
    _write(long_prompts(_read(prompts), rows[kept:], count, prompt_limit or limit - 64), out_prompts)
    _write(conversations(rows[:kept], count, limit), out_data)
    return out_data, out_prompts


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name in ("data", "prompts", "teacher", "out_data", "out_prompts"):
        ap.add_argument(name, type=Path)
    ap.add_argument("--limit", type=int, default=2000, help="most tokens of a conversation (default 2000)")
    ap.add_argument("--reserve", type=float, default=0.1, help="share of rows kept for the prompts' context")
    args = ap.parse_args(argv)
    data, prompts = write_long(args.data, args.prompts, args.teacher, args.out_data, args.out_prompts, args.limit,
                               args.reserve)
    print(f"{data}: {sum(1 for _ in data.open())} conversations; {prompts}: {sum(1 for _ in prompts.open())} prompts")


if __name__ == "__main__":
    main()
