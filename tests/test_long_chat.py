"""examples/long_chat.py (issue 59's long-sequence study): chats joined into conversations within a
token limit under the real teacher's chat template, every assistant turn kept, the prompts' context
drawn only from rows kept out of the conversations."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import long_chat  # noqa: E402

TEACHER = ROOT / "examples" / "teacher"
CHATS = ROOT / "examples" / "data" / "chat.jsonl"
PROMPTS = ROOT / "examples" / "data" / "heldout_prompts.jsonl"


def _rows(path: Path, n: int) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()[:n]]


def _assistant(messages: list[dict]) -> list[str]:
    return [m["content"] for m in messages if m["role"] == "assistant"]


@pytest.fixture(scope="module")
def count():
    return long_chat.token_counter(TEACHER)


def test_conversations_join_rows_in_order_within_the_limit_keeping_every_answer(count):
    rows = _rows(CHATS, 120)
    joined = long_chat.conversations(rows, count, 600)
    assert len(joined) > 3
    assert all(count(c["messages"], False) <= 600 for c in joined)
    # every row lands whole in exactly one conversation, in order: its answers, in turn
    assert [a for c in joined for a in _assistant(c["messages"])] == [a for r in rows for a in _assistant(r["messages"])]
    for c in joined:
        assert [m["role"] for m in c["messages"][1:]].count("system") == 0  # one system message at most, first
    assert all(count(c["messages"], False) > 600 - 200 for c in joined[:-1])  # full up to about one row short
    assert joined[0]["id"].startswith("long-chat-000000..")


def test_a_row_longer_than_the_limit_is_left_out(count):
    rows = _rows(CHATS, 10)
    huge = {"id": "huge", "messages": [{"role": "user", "content": "word " * 800}, {"role": "assistant", "content": "ok"}]}
    joined = long_chat.conversations(rows[:5] + [huge] + rows[5:], count, 400)
    assert "huge" not in json.dumps(joined)
    assert [a for c in joined for a in _assistant(c["messages"])] == [a for r in rows for a in _assistant(r["messages"])]


def test_long_prompts_end_in_the_prompt_within_the_limit(count):
    prompts, context = _rows(PROMPTS, 6), _rows(CHATS, 200)[150:]
    long = long_chat.long_prompts(prompts, context, count, 500)
    for prompt, made in zip(prompts, long):
        assert made["id"] == prompt["id"] and made["messages"][-1] == prompt["messages"][-1]
        system = [m for m in prompt["messages"] if m["role"] == "system"]
        assert [m for m in made["messages"] if m["role"] == "system"] == system  # its own system message only
        assert made["messages"][:len(system)] == system
        assert 500 - 200 < count(made["messages"], True) <= 500
    # the contexts go round the reserved rows: different prompts get different chats
    assert long[0]["messages"][1:-1] != long[1]["messages"][1:-1]


def test_write_long_keeps_the_reserved_rows_out_of_the_conversations(tmp_path):
    data = tmp_path / "chats.jsonl"
    data.write_text("\n".join(CHATS.read_text().splitlines()[:100]) + "\n")
    out, prompts = long_chat.write_long(data, PROMPTS, TEACHER, tmp_path / "long.jsonl", tmp_path / "p.jsonl",
                                        limit=800, reserve=0.2)
    joined = [json.loads(x) for x in out.read_text().splitlines()]
    made = [json.loads(x) for x in prompts.read_text().splitlines()]
    rows = _rows(data, 100)
    reserved = {a for r in rows[80:] for a in _assistant(r["messages"])}
    trained = {a for c in joined for a in _assistant(c["messages"])}
    assert trained == {a for r in rows[:80] for a in _assistant(r["messages"])}
    assert len(made) == 100 and all(set(_assistant(p["messages"])) <= reserved for p in made)
    mtime = out.stat().st_mtime_ns
    long_chat.write_long(data, PROMPTS, TEACHER, out, prompts, limit=800)  # reused, not rewritten
    assert out.stat().st_mtime_ns == mtime
