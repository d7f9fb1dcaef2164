"""The prompt files eval and sweep read, as the field distributes them (dflash_train.measuring.prompt_files):
each format read into prompts with a category, several files at once, and a broken file refused
in one line naming the file, the line, the problem and the fix."""

from __future__ import annotations

import gzip
import json

import pytest
from helpers import write_jsonl

from dflash_common.errors import ConfigError
from dflash_train.measuring.prompt_files import file_category, read_prompt_file, read_prompt_files

# Rows shaped as the distributed files are (MT-Bench's question.jsonl, HumanEval.jsonl.gz,
# GSM8K's test.jsonl, SPEED-Bench's qualitative split), with our own text.
MT_BENCH = [{"question_id": 81, "category": "writing", "turns": ["Write a note about a fox.", "Now make it rhyme."]},
            {"question_id": 101, "category": "reasoning", "turns": ["Who is taller, Ann or Bo?", "Why?"],
             "reference": ["Ann"]}]
HUMANEVAL = [{"task_id": "HumanEval/0", "prompt": "def add(a, b):\n    \"\"\"Add two numbers.\"\"\"\n",
              "canonical_solution": "    return a + b\n", "test": "assert add(1, 2) == 3", "entry_point": "add"}]
GSM8K = [{"question": "Ann has 3 apples and buys 4 more. How many apples does she have?",
          "answer": "3 + 4 = <<3+4=7>>7\n#### 7"}]
SPEED_BENCH = [{"question_id": "sb-1", "category": "coding", "sub_category": "python", "turns": ["Sort a list."],
                "source": "ours", "src_id": "1", "difficulty": "easy", "multiturn": False}]
CHAT = [{"id": "c1", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"},
                                  {"role": "assistant", "content": "Hello."}]},
        {"prompt": "Plain text."}]


def test_each_format_is_read_with_its_category(tmp_path):
    mt = read_prompt_file(write_jsonl(tmp_path / "question.jsonl", MT_BENCH))
    assert [(p.id, p.category, p.format) for p in mt] == [("81", "writing", "mt_bench"), ("101", "reasoning", "mt_bench")]
    assert mt[0].messages == ({"role": "user", "content": "Write a note about a fox."},)  # the first turn

    path = tmp_path / "HumanEval.jsonl.gz"
    path.write_bytes(gzip.compress("".join(json.dumps(r) + "\n" for r in HUMANEVAL).encode()))
    (he,) = read_prompt_file(str(path))
    assert (he.id, he.category, he.format) == ("HumanEval/0", "HumanEval", "humaneval")
    assert he.messages[0]["content"] == HUMANEVAL[0]["prompt"]

    (gsm,) = read_prompt_file(write_jsonl(tmp_path / "gsm8k_test.jsonl", GSM8K))
    assert (gsm.id, gsm.category, gsm.format) == ("gsm8k_test-1", "gsm8k_test", "gsm8k")
    assert gsm.messages == ({"role": "user", "content": GSM8K[0]["question"]},)

    chat = read_prompt_file(write_jsonl(tmp_path / "mine.jsonl", CHAT))
    assert [(p.id, p.category, p.format) for p in chat] == [("c1", "mine", "chat"), ("mine-2", "mine", "prompt")]
    assert [m["role"] for m in chat[0].messages] == ["system", "user"]  # the answer is dropped


def test_speed_bench_parquet_and_jsonl(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "qualitative.parquet"
    pq.write_table(pa.Table.from_pylist(SPEED_BENCH), path)
    (row,) = read_prompt_file(str(path))
    assert (row.id, row.category, row.format, row.messages[0]["content"]) == ("sb-1", "coding", "speed_bench", "Sort a list.")
    assert read_prompt_file(write_jsonl(tmp_path / "sb.jsonl", SPEED_BENCH)) == [row]


def test_several_files_keep_order_limit_each_and_unique_ids(tmp_path):
    a = write_jsonl(tmp_path / "a.jsonl", [{"id": "x", "prompt": f"a{i}"} if i == 0 else {"prompt": f"a{i}"}
                                           for i in range(3)])
    b = write_jsonl(tmp_path / "b.jsonl", [{"id": "x", "prompt": f"b{i}"} for i in range(3)])
    rows = read_prompt_files([a, b], limit=2)
    assert [r.messages[0]["content"] for r in rows] == ["a0", "a1", "b0", "b1"]
    assert [r.category for r in rows] == ["a", "a", "b", "b"]
    assert [r.id for r in rows] == ["x", "a-2", "b/x", "b/x-2"]
    assert file_category("data/HumanEval.jsonl.gz") == "HumanEval" and file_category("q.parquet") == "q"


BROKEN = {
    "not JSON": ('{"prompt": "a"}\n{"prompt": \n', "line 2: not JSON"),
    "unknown fields": ('{"text": "a", "label": 1}\n', "line 1: a row with the fields 'text', 'label' is none of"),
    "empty turns": ('{"question_id": 1, "category": "x", "turns": []}\n', "line 1: 'turns' is [], not a non-empty list"),
    "question not text": ('{"question": 7}\n', "line 1: 'question' is int 7, not text"),
    "empty prompt": ('{"prompt": "  "}\n', "line 1: 'prompt' is empty"),
    "category not a name": ('{"prompt": "a", "category": 3}\n', "line 1: 'category' is 3, not a name"),
    "no user turn": ('{"messages": [{"role": "system", "content": "s"}]}\n', "line 1: 'messages' has no user turn"),
    "unknown role": ('{"messages": [{"role": "bot", "content": "s"}]}\n', "line 1: a message's role is 'bot'"),
    "an array": ('["a"]\n', "line 1: a JSON list, not an object"),
    "lone surrogate": ('{"prompt": "a\\ud800"}\n', "line 1: holds a lone surrogate"),
    "nothing": ("\n\n", "holds no prompts"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_file_is_refused_in_one_line(tmp_path, case):
    text, expected = BROKEN[case]
    path = tmp_path / "broken.jsonl"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        read_prompt_files([str(path)])
    message = str(err.value)
    assert "\n" not in message and str(path) in message and expected in message and ";" in message, message


@pytest.mark.parametrize("name, data, expected", [
    ("binary.jsonl", b"\xff\xfe\x00", "is not UTF-8 text (byte 0)"),
    ("cut.jsonl.gz", gzip.compress(b'{"prompt": "a"}\n' * 50)[:30], "is not a whole gzip file"),
    ("table.parquet", b"PAR1 not really", "is not a Parquet file pyarrow can read"),
])
def test_an_unreadable_file_is_refused_in_one_line(tmp_path, name, data, expected):
    path = tmp_path / name
    path.write_bytes(data)
    with pytest.raises(ConfigError) as err:
        read_prompt_file(str(path))
    assert "\n" not in str(err.value) and str(path) in str(err.value) and expected in str(err.value), str(err.value)
    with pytest.raises(ConfigError, match="does not exist"):
        read_prompt_file(str(tmp_path / "missing.jsonl"))


# --- issue 60: a prompts file from anywhere is bounded, and so are its category names ---------------

def _one_line(err: pytest.ExceptionInfo) -> str:
    line = str(err.value)
    assert "\n" not in line, line
    return line


@pytest.mark.parametrize("row, expected", [
    ("[" * 200_000 + "]" * 200_000, "line 1: nested too deeply to parse (more than 32 levels); fix the row"),
    ('{"prompt": "x", "meta": ' + "[" * 33 + "1" + "]" * 33 + "}",
     "line 1: nested more than 32 levels deep; fix the row"),
    (json.dumps({"prompt": "x" * 1_000_001}),
     "line 1: 'prompt' is 1,000,001 characters long, more than the 1,000,000 a prompt may hold; fix the row"),
    (json.dumps({"messages": [{"role": "system", "content": "s" * 600_000}, {"role": "user", "content": "u" * 600_000}]}),
     "line 1: its messages are 1,200,000 characters long, more than the 1,000,000 a prompt may hold; fix the row"),
], ids=["200,000 levels", "33 levels", "a prompt of 1,000,001 characters", "a chat of 1,200,000 characters"])
def test_nesting_and_prompt_length_are_bounded(tmp_path, row, expected):
    path = tmp_path / "p.jsonl"
    path.write_text(row + "\n")
    with pytest.raises(ConfigError) as refused:
        read_prompt_file(str(path))
    assert _one_line(refused) == f"{path} {expected}"


@pytest.mark.parametrize("rows", [100_001, pytest.param(3_000_000, marks=pytest.mark.slow)])
def test_a_parquet_file_of_too_many_rows_is_refused_before_it_is_read(tmp_path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "many.parquet"
    pq.write_table(pa.table({"prompt": pa.array(["a"] * rows)}), path)
    with pytest.raises(ConfigError) as refused:
        read_prompt_file(str(path))
    assert _one_line(refused) == (f"prompts file {path} holds {rows:,} rows, more than the 100,000 an eval decodes; "
                                  "pass a smaller split, or --max-prompts 100,000 or fewer")
    assert [p.id for p in read_prompt_file(str(path), limit=3)] == ["many-1", "many-2", "many-3"]


def test_a_jsonl_file_of_too_many_rows_is_refused(tmp_path):
    path = tmp_path / "many.jsonl"
    path.write_text('{"prompt": "a"}\n' * 100_001)
    with pytest.raises(ConfigError) as refused:
        read_prompt_file(str(path))
    assert "holds more rows, more than the 100,000 an eval decodes" in _one_line(refused)
    assert len(read_prompt_file(str(path), limit=100_000)) == 100_000


@pytest.mark.parametrize("category, expected", [
    ("overall", "the category is 'overall', the name of the row over every prompt; rename the category in the row"),
    ("Overall", "the category is 'Overall', the name of the row over every prompt; rename the category in the row"),
    ("c" * 100_000, "the category is 100,000 characters long, more than 64; rename the category in the row"),
    ("red\x1b[31m\nline", "the category 'red\\x1b[31m\\nline' holds '\\x1b', which is not a printable character; "
                          "rename the category in the row"),
], ids=["overall", "Overall", "100,000 characters", "an ANSI escape and a newline"])
def test_a_category_name_is_a_printable_short_name_other_than_overall(tmp_path, category, expected):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi", "category": "fine"}, {"prompt": "hi", "category": category}])
    with pytest.raises(ConfigError) as refused:
        read_prompt_file(path)
    assert _one_line(refused) == f"{path} line 2: {expected}"


def test_a_file_named_overall_needs_categories_in_its_rows(tmp_path):
    path = write_jsonl(tmp_path / "overall.jsonl", [{"prompt": "hi"}])
    with pytest.raises(ConfigError) as refused:
        read_prompt_file(path)
    assert _one_line(refused).endswith("the category is 'overall', the name of the row over every prompt; give the "
                                       "rows a 'category', or rename the file")
    assert read_prompt_file(write_jsonl(tmp_path / "overall.jsonl", [{"prompt": "hi", "category": "q"}]))[0].category == "q"
