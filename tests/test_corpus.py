"""Corpus reading (dflash_corpus), a row's tokens and loss mask (dflash_build.tokens) and the shared test helpers."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import xxhash
from helpers import english_like_sentences, write_jsonl
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_build.tokens import TokenizedSequence, assistant_char_spans, token_mask_from_spans, tokenize_row
from dflash_common.errors import BadRowError, ConfigError, DFlashError
from dflash_corpus import (
    CorpusConfig,
    CorpusRow,
    corpus_fingerprint,
    count_rows,
    iter_rows,
    list_corpus_files,
    parse_messages,
    row_id,
)

END = "<|im_end|>\n"


# ---------------------------------------------------------------------------------------------
# Sample corpora


def sample_rows(count: int = 41) -> list[dict]:
    """Chat, ShareGPT and plain-text rows, some with ids, all with one schema per column."""
    words = english_like_sentences(4 * count, seed=3)
    rows = []
    for i in range(count):
        a, b, c, d = words[4 * i : 4 * i + 4]
        if i % 3 == 0:
            rows.append(
                {
                    "id": f"chat-{i}",
                    "messages": [
                        {"role": "system", "content": a},
                        {"role": "user", "content": b},
                        {"role": "assistant", "content": c},
                    ],
                }
            )
        elif i % 3 == 1:
            rows.append({"conversations": [{"from": "human", "value": a}, {"from": "gpt", "value": b + " " + c}]})
        else:
            rows.append({"text": f"{a} {b} {c} {d}"})
    return rows


def present(data: dict) -> dict:
    """A row without the null columns that Parquet/Arrow add for keys a row does not have."""
    return {key: value for key, value in data.items() if value is not None}


def summary(rows) -> list[tuple]:
    return [(r.index, r.row, present(r.data), r.problem) for r in rows]


def to_table(rows: list[dict]) -> pa.Table:
    """Rows as an Arrow table with a column per key of any row (from_pylist reads only row 0's)."""
    keys = list(dict.fromkeys(key for row in rows for key in row))
    return pa.Table.from_pydict({key: [row.get(key) for row in rows] for key in keys})


def write_arrow(path, table: pa.Table, stream: bool, batch_rows: int = 5) -> str:
    writer_factory = pa.ipc.new_stream if stream else pa.ipc.new_file
    with writer_factory(str(path), table.schema) as writer:
        for batch in table.to_batches(max_chunksize=batch_rows):
            writer.write_batch(batch)
    return str(path)


@pytest.fixture(scope="module")
def corpora(tmp_path_factory) -> dict[str, str]:
    """The same rows in every supported format; name -> `data` argument."""
    import datasets

    datasets.disable_progress_bars()
    root = tmp_path_factory.mktemp("corpora")
    rows = sample_rows()
    table = to_table(rows)
    out = {"jsonl": write_jsonl(root / "c.jsonl", rows), "json": write_jsonl(root / "c.json", rows)}
    pq.write_table(table, root / "c.parquet", row_group_size=8)
    out["parquet"] = str(root / "c.parquet")
    out["arrow_file"] = write_arrow(root / "c_file.arrow", table, stream=False)
    out["arrow_stream"] = write_arrow(root / "c_stream.arrow", table, stream=True)

    folder = root / "folder"
    (folder / "sub").mkdir(parents=True)
    write_jsonl(folder / "part-a.jsonl", rows[:17])
    pq.write_table(to_table(rows[17:]), folder / "sub" / "part-b.parquet", row_group_size=6)
    (folder / "README.md").write_text("not a corpus file")
    write_jsonl(folder / ".hidden.jsonl", [{"text": "ignored"}])
    out["folder"] = str(folder)
    out["glob"] = str(folder / "**" / "part-*")

    saved = root / "saved"
    datasets.Dataset.from_dict(table.to_pydict()).save_to_disk(str(saved), num_shards=2)
    out["save_to_disk"] = str(saved)
    return out


# ---------------------------------------------------------------------------------------------
# Finding files and streaming rows


def test_every_format_yields_the_same_rows(corpora):
    expected = [(i, i + 1, row, None) for i, row in enumerate(sample_rows())]
    for name, data in corpora.items():
        got = summary(iter_rows(CorpusConfig(data=data)))
        if name in ("folder", "glob"):  # two files: row numbers restart in the second
            got = [(index, None, d, p) for index, _, d, p in got]
            assert got == [(i, None, d, p) for i, _, d, p in expected], name
        else:
            assert got == expected, name


def test_count_rows_matches_iteration(corpora, tmp_path):
    for name, data in corpora.items():
        assert count_rows(list_corpus_files(data)) == 41, name
    path = write_jsonl(tmp_path / "blank.jsonl", [{"text": "a"}])
    with open(path, "a") as f:
        f.write("\n  \nnot json\n")
    assert count_rows([path]) == len(list(iter_rows(CorpusConfig(data=path)))) == 2


def test_folder_and_glob_list_supported_files_sorted(corpora):
    folder = corpora["folder"]
    expected = [os.path.join(folder, "part-a.jsonl"), os.path.join(folder, "sub", "part-b.parquet")]
    assert list_corpus_files(folder) == expected
    assert list_corpus_files(corpora["glob"]) == expected
    assert list_corpus_files(corpora["save_to_disk"]) == [corpora["save_to_disk"]]
    rows = list(iter_rows(CorpusConfig(data=folder)))
    assert [r.path for r in rows] == [expected[0]] * 17 + [expected[1]] * 24
    assert [r.row for r in rows[15:19]] == [16, 17, 1, 2]


@pytest.mark.parametrize("name", ["jsonl", "parquet", "arrow_file", "arrow_stream", "folder", "save_to_disk"])
def test_start_row_resumes_exactly(corpora, name):
    cfg = CorpusConfig(data=corpora[name])
    full = summary(iter_rows(cfg))
    # Batch and row-group edges (5, 8), the folder's file edge (17), the last row, past the end.
    for start in (0, 1, 5, 8, 16, 17, 18, 40, 41, 100):
        assert summary(iter_rows(cfg, start_row=start)) == full[start:], (name, start)


def test_start_row_must_be_non_negative(corpora):
    with pytest.raises(ConfigError, match="start_row"):
        next(iter_rows(CorpusConfig(data=corpora["jsonl"]), start_row=-1))


def test_jsonl_bad_lines_become_problem_rows(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_bytes(
        b'{"text": "fine"}\n'
        b"\n"
        b'{"text": "a" "b"}\n'
        b"   \n"
        b'["an", "array"]\n'
        b'{"text": "caf\xe9"}\n'
        b"42\n"
        b'{"text": "last", "note": "line\xe2\x80\xa8separator"}'
    )
    rows = list(iter_rows(CorpusConfig(data=str(path))))
    assert [(r.index, r.row) for r in rows] == [(0, 1), (1, 3), (2, 5), (3, 6), (4, 7), (5, 8)]
    assert rows[0].data == {"text": "fine"} and rows[0].problem is None
    assert rows[1].data is None and rows[1].problem == "invalid JSON: Expecting ',' delimiter at column 14"
    assert rows[2].problem == "not a JSON object (got a JSON array)"
    assert rows[3].problem == "not valid UTF-8 at byte 14"
    assert rows[4].problem == "not a JSON object (got a JSON number)"
    assert rows[5].data["note"] == "line\u2028separator"
    with pytest.raises(BadRowError) as err:
        parse_messages(rows[3])
    assert str(path) in str(err.value) and "row 6" in str(err.value) and "not valid UTF-8" in str(err.value)
    assert [r.row for r in iter_rows(CorpusConfig(data=str(path)), start_row=2)] == [5, 6, 7, 8]


def test_jsonl_with_byte_order_mark_and_crlf(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"text": "one"}\r\n{"text": "two"}\r\n')
    assert [r.data for r in iter_rows(CorpusConfig(data=str(path)))] == [{"text": "one"}, {"text": "two"}]


def test_listing_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(ConfigError, match="nope.jsonl"):
        list_corpus_files(str(missing))
    with pytest.raises(ConfigError, match=r"no corpus files found at .*\*\.parquet"):
        list_corpus_files(str(tmp_path / "*.parquet"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="empty"):
        list_corpus_files(str(tmp_path / "empty"))
    csv = tmp_path / "rows.csv"
    csv.write_text("a,b\n")
    with pytest.raises(ConfigError, match="rows.csv has an unsupported extension"):
        list_corpus_files(str(csv))
    array = tmp_path / "array.json"
    array.write_text('[\n  {"text": "a"}\n]\n')
    with pytest.raises(ConfigError, match="array.json holds a JSON array"):
        list_corpus_files(str(array))


def test_dataset_dict_folder_asks_for_one_split(tmp_path):
    import datasets

    datasets.disable_progress_bars()
    split = datasets.Dataset.from_dict({"text": ["a b", "c d"]})
    datasets.DatasetDict({"train": split, "test": split}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(ConfigError, match=r"splits train, test.*dd/train"):
        list_corpus_files(str(tmp_path / "dd"))
    assert [r.data for r in iter_rows(CorpusConfig(data=str(tmp_path / "dd" / "train")))] == [
        {"text": "a b"},
        {"text": "c d"},
    ]


def test_truncated_parquet_is_a_config_error(tmp_path):
    path = tmp_path / "cut.parquet"
    pq.write_table(pa.Table.from_pylist([{"text": "x" * 100}] * 10), path)
    path.write_bytes(path.read_bytes()[:-20])
    with pytest.raises(ConfigError, match="cannot read corpus file .*cut.parquet"):
        list(iter_rows(CorpusConfig(data=str(path))))


def test_fingerprint_is_stable_and_sensitive(tmp_path, corpora):
    files = list_corpus_files(corpora["folder"])
    first = corpus_fingerprint(files)
    assert first == corpus_fingerprint(list_corpus_files(corpora["folder"]))
    assert len(first) == 32 and int(first, 16) >= 0
    # Moving the corpus keeps the fingerprint: names are relative.
    moved = tmp_path / "moved"
    shutil.copytree(corpora["folder"], moved)
    assert corpus_fingerprint(list_corpus_files(str(moved))) == first
    # Same size, different first bytes.
    target = moved / "part-a.jsonl"
    raw = bytearray(target.read_bytes())
    raw[10:13] = b"ZZZ" if raw[10:13] != b"ZZZ" else b"YYY"
    target.write_bytes(bytes(raw))
    assert corpus_fingerprint(list_corpus_files(str(moved))) != first
    # A renamed file changes it too.
    os.rename(target, moved / "part-c.jsonl")
    assert corpus_fingerprint(list_corpus_files(str(moved))) not in (first,)
    saved = corpus_fingerprint(list_corpus_files(corpora["save_to_disk"]))
    assert saved == corpus_fingerprint([corpora["save_to_disk"]]) and saved != first


def test_fingerprint_sees_the_tail_of_large_files(tmp_path):
    path = tmp_path / "big.jsonl"
    line = json.dumps({"text": "y" * 1000}) + "\n"
    path.write_text(line * 3000)  # ~3 MiB
    before = corpus_fingerprint([str(path)])
    raw = bytearray(path.read_bytes())
    raw[-10] = ord("z")
    path.write_bytes(bytes(raw))
    assert corpus_fingerprint([str(path)]) != before


# ---------------------------------------------------------------------------------------------
# Config


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"data": ""}, "data"),
        ({"max_length": 0}, "--max-length 0"),
        ({"max_length": True}, "--max-length True"),
        ({"overlong": "cut"}, "overlong='cut'"),
        ({"min_length": 0}, "min_length=0"),
        ({"min_length": 10, "max_length": 5}, "min_length=10"),
        ({"on_bad_row": "ignore"}, "on_bad_row='ignore'"),
    ],
)
def test_config_validation(kwargs, fragment):
    kwargs = {"data": "corpus.jsonl", **kwargs}
    with pytest.raises(ConfigError) as err:
        CorpusConfig(**kwargs)
    assert fragment in str(err.value) and "\n" not in str(err.value)
    assert isinstance(err.value, DFlashError)


def test_config_defaults():
    cfg = CorpusConfig(data="x.jsonl")
    assert (cfg.max_length, cfg.overlong, cfg.min_length, cfg.on_bad_row) == (4096, "truncate", 2, "fail")


# ---------------------------------------------------------------------------------------------
# Rows -> messages


def make_row(data, path="corpus.jsonl", row=7):
    return CorpusRow(index=0, path=path, row=row, data=data, problem=None)


def test_row_id_uses_id_field_or_a_stable_content_hash():
    assert row_id({"id": "abc", "text": "x"}) == "abc"
    assert row_id({"id": 12, "text": "x"}) == "12"
    hashed = row_id({"text": "x", "meta": {"b": 1, "a": [1, 2]}})
    expected = xxhash.xxh64_hexdigest('{"meta":{"a":[1,2],"b":1},"text":"x"}'.encode())
    assert hashed == "h" + expected and len(hashed) == 17
    assert row_id({"meta": {"a": [1, 2], "b": 1}, "text": "x"}) == hashed  # key order irrelevant
    assert row_id({"text": "x", "meta": {"b": 1, "a": [1, 2]}, "messages": None}) == hashed
    assert row_id({"text": "y", "meta": {"b": 1, "a": [1, 2]}}) != hashed
    assert row_id({"id": None, "text": "x"}) == row_id({"text": "x"})


def test_row_ids_match_across_formats(corpora):
    ids = {name: [row_id(r.data) for r in iter_rows(CorpusConfig(data=d))] for name, d in corpora.items()}
    reference = ids.pop("jsonl")
    assert len(set(reference)) == len(reference)
    assert reference[0] == "chat-0" and reference[1].startswith("h")
    for name, got in ids.items():
        assert got == reference, name


def test_parse_messages_normalises_chat_sharegpt_and_text():
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "name": "bot"}]
    assert parse_messages(make_row({"messages": chat})) == [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
    ]
    sharegpt = [
        {"from": "system", "value": "s"},
        {"from": "human", "value": "a"},
        {"from": "gpt", "value": "b"},
        {"from": "user", "value": "c"},
        {"from": "chatgpt", "value": "d"},
        {"from": "bot", "value": "e"},
        {"from": "model", "value": "f"},
        {"from": "assistant", "value": "g"},
    ]
    roles = [m["role"] for m in parse_messages(make_row({"conversations": sharegpt}))]
    assert roles == ["system", "user", "assistant", "user", "assistant", "assistant", "assistant", "assistant"]
    assert parse_messages(make_row({"text": "plain words"})) == "plain words"
    # Parquet pads absent columns with None: the present field wins.
    assert parse_messages(make_row({"messages": None, "conversations": None, "text": "t"})) == "t"


@pytest.mark.parametrize(
    "data, problem",
    [
        ({"prompt": "x", "answer": "y"}, "no 'messages', 'conversations' or 'text' field (keys: answer, prompt)"),
        ({"messages": "hello"}, "'messages' must be a list of messages, got string"),
        ({"messages": ["hello"]}, "messages[0] must be an object, got string"),
        ({"messages": [{"role": "user", "content": ["a"]}]}, "messages[0] content must be a string, got list"),
        ({"conversations": [{"from": "gpt", "value": None}]}, "conversations[0] content must be a string, got null"),
        ({"messages": [{"content": "x"}]}, "messages[0] has no role"),
        ({"messages": [{"role": "narrator", "content": "x"}]}, "unknown role 'narrator' (known roles: assistant, bot"),
        ({"messages": []}, "empty conversation in 'messages'"),
        ({"messages": [{"role": "user", "content": "x"}]}, "conversation in 'messages' has no assistant turn"),
        ({"text": "   "}, "empty text"),
        ({"text": 5}, "'text' must be a string, got int"),
    ],
)
def test_parse_messages_bad_rows_name_file_row_and_problem(data, problem):
    with pytest.raises(BadRowError) as err:
        parse_messages(make_row(data, path="/data/shard-3.jsonl", row=12))
    message = str(err.value)
    assert message.startswith("/data/shard-3.jsonl row 12: ")
    assert problem in message and problem in err.value.problem
    assert (err.value.path, err.value.row) == ("/data/shard-3.jsonl", 12)


def test_problem_rows_raise_bad_row_error():
    row = CorpusRow(index=3, path="f.jsonl", row=9, data=None, problem="invalid JSON: oops at column 2")
    with pytest.raises(BadRowError, match=r"f.jsonl row 9: invalid JSON: oops at column 2"):
        parse_messages(row)


# ---------------------------------------------------------------------------------------------
# Tokenization and loss masks


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def masked_runs(tokenizer, seq: TokenizedSequence) -> list[str]:
    """The decoded text of each maximal run of loss-mask-1 tokens."""
    runs, current = [], []
    for token, flag in zip(seq.input_ids.tolist(), seq.loss_mask.tolist()):
        if flag:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run, skip_special_tokens=False) for run in runs]


MULTI_TURN = [
    {"role": "system", "content": "You answer in short sentences."},
    {"role": "user", "content": "Where is the cat?"},
    {"role": "assistant", "content": "The cat sees the river.\n\nIt was 12 times!"},
    {"role": "user", "content": "And the dog?"},
    {"role": "assistant", "content": " A dog follows the long road"},
    {"role": "user", "content": "Thanks."},
    {"role": "assistant", "content": "Every student reads a new book."},
]


def test_chat_loss_mask_covers_exactly_the_assistant_turns(tokenizer):
    seq = tokenize_row(make_row({"messages": MULTI_TURN}), tokenizer, CorpusConfig(data="x"))
    assert isinstance(seq, TokenizedSequence)
    assert seq.input_ids.dtype == np.int32 and seq.loss_mask.dtype == np.uint8
    assert seq.input_ids.shape == seq.loss_mask.shape and not seq.truncated
    expected_text = tokenizer.apply_chat_template(MULTI_TURN, tokenize=False)
    assert tokenizer.decode(seq.input_ids.tolist(), skip_special_tokens=False) == expected_text
    assistants = [m["content"] + END for m in MULTI_TURN if m["role"] == "assistant"]
    assert masked_runs(tokenizer, seq) == assistants
    # Nothing doubled: the template's own tokens only, no extra special tokens at the edges.
    assert seq.input_ids[0] == tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert seq.id == row_id({"messages": MULTI_TURN})


def test_chat_starting_with_the_assistant(tokenizer):
    chat = [{"role": "assistant", "content": "Hello there."}, {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": ""}]
    seq = tokenize_row(make_row({"messages": chat}), tokenizer, CorpusConfig(data="x"))
    assert masked_runs(tokenizer, seq) == ["Hello there." + END, END]


def test_sharegpt_equals_the_same_chat_as_messages(tokenizer):
    sharegpt = [{"from": {"system": "system", "user": "human", "assistant": "gpt"}[m["role"]], "value": m["content"]}
                for m in MULTI_TURN]
    cfg = CorpusConfig(data="x")
    a = tokenize_row(make_row({"id": "same", "messages": MULTI_TURN}), tokenizer, cfg)
    b = tokenize_row(make_row({"id": "same", "conversations": sharegpt}), tokenizer, cfg)
    assert a.id == b.id == "same"
    np.testing.assert_array_equal(a.input_ids, b.input_ids)
    np.testing.assert_array_equal(a.loss_mask, b.loss_mask)


def test_plain_text_uses_tokenizer_defaults_and_learns_every_token(tokenizer):
    text = "The cat likes a red apple today. The dog sees the song."
    seq = tokenize_row(make_row({"text": text}), tokenizer, CorpusConfig(data="x"))
    assert seq.input_ids.tolist() == tokenizer(text)["input_ids"]
    assert seq.loss_mask.tolist() == [1] * len(seq.input_ids)


def test_truncate_drop_and_min_length(tokenizer):
    text_row = make_row({"text": " ".join(english_like_sentences(20))})
    full = tokenize_row(text_row, tokenizer, CorpusConfig(data="x"))
    n = len(full.input_ids)
    assert n > 40
    cut = tokenize_row(text_row, tokenizer, CorpusConfig(data="x", max_length=40))
    assert cut.truncated and cut.input_ids.tolist() == full.input_ids[:40].tolist()
    assert len(cut.loss_mask) == 40
    assert tokenize_row(text_row, tokenizer, CorpusConfig(data="x", max_length=40, overlong="drop")) == "too_long"
    exact = tokenize_row(text_row, tokenizer, CorpusConfig(data="x", max_length=n, overlong="drop"))
    assert isinstance(exact, TokenizedSequence) and not exact.truncated
    assert tokenize_row(text_row, tokenizer, CorpusConfig(data="x", min_length=n + 1, max_length=4096)) == "too_short"
    assert isinstance(tokenize_row(text_row, tokenizer, CorpusConfig(data="x", min_length=n)), TokenizedSequence)

    # A chat cut before its first assistant token has nothing to learn, because it is long.
    chat_row = make_row({"messages": MULTI_TURN})
    chat = tokenize_row(chat_row, tokenizer, CorpusConfig(data="x"))
    first_learned = int(np.flatnonzero(chat.loss_mask)[0])
    short = CorpusConfig(data="x", max_length=first_learned, min_length=2)
    assert tokenize_row(chat_row, tokenizer, short) == "too_long"
    kept = tokenize_row(chat_row, tokenizer, CorpusConfig(data="x", max_length=first_learned + 1))
    assert kept.truncated and kept.loss_mask.tolist() == [0] * first_learned + [1]


def test_bad_rows_raise_from_tokenize_row(tokenizer):
    with pytest.raises(BadRowError, match="no assistant turn"):
        tokenize_row(make_row({"messages": [{"role": "user", "content": "x"}]}), tokenizer, CorpusConfig(data="x"))


def test_template_failure_is_a_bad_row(tokenizer_dir):
    strict = AutoTokenizer.from_pretrained(tokenizer_dir)
    strict.chat_template = (
        "{%- for m in messages %}{%- if m['role'] == 'system' %}"
        "{{- raise_exception('System role not supported') }}{%- endif %}"
        "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    with pytest.raises(BadRowError, match=r"row 7: chat template failed: System role not supported"):
        tokenize_row(make_row({"messages": MULTI_TURN}), strict, CorpusConfig(data="x"))
    seq = tokenize_row(make_row({"messages": MULTI_TURN[1:]}), strict, CorpusConfig(data="x"))
    assert len(masked_runs(strict, seq)) == 3


# Like Qwen3's template: earlier assistant turns lose their <think> block; turns after the
# last user message keep it (an empty one is written when the content has none).
THINK_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' %}"
    "{%- set body = m['content'] %}{%- set reasoning = '' %}"
    "{%- if '</think>' in body %}"
    "{%- set reasoning = body.split('</think>')[0].split('<think>')[-1].strip('\\n') %}"
    "{%- set body = body.split('</think>')[-1].lstrip('\\n') %}"
    "{%- endif %}"
    "{%- if loop.index0 > ns.last_user %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + body + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + body + '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def test_template_that_strips_earlier_reasoning(tokenizer_dir):
    thinking = AutoTokenizer.from_pretrained(tokenizer_dir)
    thinking.chat_template = THINK_TEMPLATE
    chat = [
        {"role": "system", "content": "Think first."},
        {"role": "user", "content": "Where is the cat?"},
        {"role": "assistant", "content": "<think>\nIt was near the house.\n</think>\n\nThe cat sees the river."},
        {"role": "user", "content": "And the dog?"},
        {"role": "assistant", "content": "<think>\nThe dog follows.\n</think>\n\nA dog takes the road."},
    ]
    seq = tokenize_row(make_row({"messages": chat}), thinking, CorpusConfig(data="x"))
    text = thinking.apply_chat_template(chat, tokenize=False)
    assert "It was near the house" not in text  # the template really rewrote the first turn
    assert masked_runs(thinking, seq) == [
        "The cat sees the river." + END,
        "<think>\nThe dog follows.\n</think>\n\nA dog takes the road." + END,
    ]
    # An earlier turn without reasoning, a final turn with the template's empty think block.
    plain = [chat[1], {"role": "assistant", "content": "Yes."}, chat[3], {"role": "assistant", "content": "No."}]
    seq = tokenize_row(make_row({"messages": plain}), thinking, CorpusConfig(data="x"))
    assert masked_runs(thinking, seq) == ["Yes." + END, "<think>\n\n</think>\n\nNo." + END]


def test_assistant_char_spans_with_a_fake_renderer():
    # A renderer whose prefixes never match forces the content-location path everywhere.
    def render(messages, add_generation_prompt):
        body = "".join(f"[{m['role']}]{m['content']}</s>" for m in messages)
        return ("#" if add_generation_prompt else "") + body

    messages = [{"role": "user", "content": "ok"}, {"role": "assistant", "content": "ok"},
                {"role": "user", "content": "more"}, {"role": "assistant", "content": "done"}]
    text = render(messages, False)
    spans = assistant_char_spans(messages, text, render, lambda: "</s>")
    assert [text[a:b] for a, b in spans] == ["ok</s>", "done</s>"]
    assert spans[0][0] > text.index("ok")  # the user's identical "ok" is not taken
    with pytest.raises(ValueError, match=r"messages\[3\]"):
        assistant_char_spans(messages, text.replace("done", "gone"), render, lambda: "</s>")


def test_token_mask_from_spans_marks_overlapping_tokens():
    offsets = np.array([[0, 3], [3, 5], [5, 9], [9, 10], [10, 14]])
    assert token_mask_from_spans(offsets, [(4, 9)]).tolist() == [0, 1, 1, 0, 0]
    assert token_mask_from_spans(offsets, [(0, 3), (10, 12)]).tolist() == [1, 0, 0, 0, 1]
    assert token_mask_from_spans(offsets, []).tolist() == [0] * 5


def test_corpus_rows_tokenize_end_to_end(corpora, tokenizer):
    cfg = CorpusConfig(data=corpora["parquet"], max_length=64)
    results = [tokenize_row(row, tokenizer, cfg) for row in iter_rows(cfg)]
    assert all(isinstance(r, TokenizedSequence) for r in results)
    assert all(len(r.input_ids) <= 64 and r.loss_mask.any() for r in results)
    for row, seq in zip(sample_rows(), results):
        if "text" in row:
            assert seq.loss_mask.all()
        else:
            assert not seq.loss_mask.all()


# ---------------------------------------------------------------------------------------------
# Test helpers


def test_tokenizer_helper_is_deterministic(tmp_path, tokenizer_dir):
    from helpers import build_tokenizer

    build_tokenizer(tmp_path / "again")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / "again" / name).read_bytes() == open(os.path.join(tokenizer_dir, name), "rb").read()
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert 450 <= len(tok) <= 520
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


@pytest.mark.parametrize("arch, model_type", [("qwen3", "qwen3"), ("qwen3_5", "qwen3_5_text"), ("llama", "llama")])
def test_teacher_helper_loads_and_runs(teacher_dir, arch, model_type):
    path = teacher_dir(arch)
    assert teacher_dir(arch) == path  # cached per arch
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    tok = AutoTokenizer.from_pretrained(path)
    config = model.config
    assert config.model_type == model_type
    assert config.vocab_size % 64 == 0 and config.vocab_size >= len(tok)
    assert (config.hidden_size, config.num_hidden_layers) == (64, 4)
    if arch == "qwen3_5":
        assert set(config.layer_types) == {"linear_attention", "full_attention"}
    ids = torch.tensor([tok("A dog sees the answer.")["input_ids"]])
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    assert out.logits.shape == (1, ids.shape[1], config.vocab_size)
    assert len(out.hidden_states) == 5 and torch.isfinite(out.logits).all()


def test_teacher_helper_dtype(teacher_dir):
    model = AutoModelForCausalLM.from_pretrained(teacher_dir("qwen3", torch.bfloat16))
    assert next(model.parameters()).dtype == torch.bfloat16
