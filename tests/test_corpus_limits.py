"""Corpus row limits: nesting depth, row size, and bounded tokenization of overlong rows.

Every test here writes real corpus files; the CLI tests go through `dflash-cache build`.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
import textwrap
import time
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers import english_like_sentences, peak_rss_kib, qa_rows, write_jsonl
from tokenizers import processors
from transformers import AutoTokenizer
from typer.testing import CliRunner

import dflash_corpus as corpus
from cli.cache import app
from dflash_build.tokens import TokenizedSequence, tokenize_row
from dflash_cache import open_cache
from dflash_common.errors import BadRowError
from dflash_corpus import (
    CorpusConfig,
    count_rows,
    iter_rows,
    limits,
    parse_json_line,
    row_byte_limit,
)

ROOT = Path(__file__).resolve().parents[1]


def build_args(teacher: str, data, *extra: str) -> list[str]:
    return ["build", "--teacher", teacher, "--data", str(data), "--dtype", "float32", "--layers", "0,2",
            "--top-k", "4", "--quiet", *extra]


def nested(levels: int) -> str:
    """A row nested `levels` deep: the row object, then lists and objects inside `meta`."""
    inner = levels - 1
    opens = "".join("[" if i % 2 == 0 else '{"k": ' for i in range(inner))
    closes = "".join("]" if i % 2 == 0 else "}" for i in reversed(range(inner)))
    return '{"id": "deep", "text": "a deep row", "meta": ' + opens + "1" + closes + "}"


# ---------------------------------------------------------------------------------------------
# Nesting depth


def test_depth_limit_is_exact_and_ignores_brackets_in_strings():
    assert corpus.MAX_ROW_DEPTH == 100
    data, problem = parse_json_line(nested(100).encode())
    assert problem is None and data["id"] == "deep"
    assert parse_json_line(nested(101).encode()) == (None, "nested 101 levels deep (limit 100)")
    # json.loads alone would recurse out at ~1,000 levels; the check comes first.
    assert parse_json_line(nested(100_000).encode()) == (None, "nested 100,000 levels deep (limit 100)")
    # Brackets inside strings, escaped quotes included, are text, not nesting.
    text = json.dumps({"text": "[" * 500 + '\\"{{' + "{" * 500, "note": ['"]]]']})
    data, problem = parse_json_line(text.encode())
    assert problem is None and data["text"].startswith("[[[")
    # A truncated or otherwise invalid line is still reported as invalid JSON.
    assert parse_json_line(b"[" * 50 + b'{"a": 1')[1].startswith("invalid JSON")


def test_deep_row_is_one_bad_row_line_or_skipped_and_counted(tmp_path, teacher_dir):
    """5,000 levels used to escape as a RecursionError traceback naming no file, even with skip."""
    teacher = teacher_dir("qwen3")
    good = [json.dumps(row) for row in qa_rows(4, seed=1, prefix="q")]
    path = tmp_path / "deep.jsonl"
    path.write_text("\n".join([good[0], nested(5_000), good[1], nested(150), good[2], good[3]]) + "\n")
    runner = CliRunner()
    for out, extra in (("fail", []), ("fail-dry", ["--dry-run"])):
        failed = runner.invoke(app, build_args(teacher, path, "--out", str(tmp_path / out), *extra))
        assert failed.exit_code == 1, failed.output
        assert "Traceback" not in failed.output and not isinstance(failed.exception, RecursionError)
        assert failed.output.strip().splitlines() == [
            f"error: {path} row 2: nested 5,000 levels deep (limit 100) (fix the row, or pass --on-bad-row skip)"]
    assert not (tmp_path / "fail-dry").exists()

    dry = runner.invoke(app, build_args(teacher, path, "--out", str(tmp_path / "dry"), "--on-bad-row", "skip",
                                        "--dry-run"))
    assert dry.exit_code == 0, dry.output
    assert "rows 6  sequences 4" in dry.output and "skipped {'bad_row': 2}" in dry.output
    assert not (tmp_path / "dry").exists()

    built = runner.invoke(app, build_args(teacher, path, "--out", str(tmp_path / "skip"), "--on-bad-row", "skip"))
    assert built.exit_code == 0, built.output
    cache = open_cache(str(tmp_path / "skip"))
    assert sorted(r.id for r in cache.sequences()) == ["q000", "q001", "q002", "q003"]
    assert cache.manifest["totals"]["skipped"] == {"bad_row": 2}


def parquet_file(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def arrow_file(path, rows):
    table = pa.Table.from_pylist(rows)
    with pa.ipc.new_file(str(path), table.schema) as writer:
        writer.write_table(table)
    return str(path)


def saved_dataset(path, rows):
    import datasets

    datasets.disable_progress_bars()
    datasets.Dataset.from_dict(pa.Table.from_pylist(rows).to_pydict()).save_to_disk(str(path))
    return str(path)


WRITERS = {"parquet": (parquet_file, ".parquet"), "arrow": (arrow_file, ".arrow"), "save_to_disk": (saved_dataset, "")}


@pytest.mark.parametrize("fmt", list(WRITERS))
def test_arrow_rows_are_held_to_the_depth_limit_by_their_schema(tmp_path, monkeypatch, fmt):
    # Arrow refuses schemas much deeper than 64 levels, so the real limit (100) cannot be reached
    # by a Parquet or Arrow file; a lowered limit shows the guard sits in front of to_pylist.
    monkeypatch.setattr(limits, "MAX_ROW_DEPTH", 3)
    write, suffix = WRITERS[fmt]
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    shallow = write(tmp_path / f"chat{suffix}", [{"messages": chat}] * 3)  # row, list, struct: 3
    assert [r.problem for r in iter_rows(CorpusConfig(data=shallow))] == [None] * 3
    deep = write(tmp_path / f"deep{suffix}", [{"text": "a", "meta": [[[1]]]}, {"text": "b", "meta": None}])
    rows = list(iter_rows(CorpusConfig(data=deep)))
    assert [(r.row, r.data, r.problem) for r in rows] == [(1, None, "nested 4 levels deep (limit 3)"),
                                                           (2, None, "nested 4 levels deep (limit 3)")]
    with pytest.raises(BadRowError, match=r"deep\S* row 2: nested 4 levels deep \(limit 3\)"):
        corpus.parse_messages(rows[1])


# ---------------------------------------------------------------------------------------------
# Row size


def test_a_row_over_the_real_limit_is_a_bad_row_and_never_held_in_memory(tmp_path):
    # 64 MiB up to max_length 1M, then 64 bytes per token.
    assert row_byte_limit(4096) == row_byte_limit(1) == row_byte_limit(1 << 20) == 64 * 2**20
    assert row_byte_limit(2_000_000) == 128_000_000
    limit = row_byte_limit(4096)
    path = tmp_path / "huge.jsonl"
    with open(path, "wb") as f:
        f.write(b'{"text": "before"}\n')
        head = b'{"text": "'
        f.write(head + b"y" * (limit - len(head) - 1) + b'"}\n')  # limit + 1 bytes of JSON
        f.write(b'{"text": "after"}\n')
    assert count_rows([str(path)]) == 3
    tracemalloc.start()
    try:
        rows = list(iter_rows(CorpusConfig(data=str(path))))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert [(r.row, r.data, r.problem) for r in rows] == [
        (1, {"text": "before"}, None),
        (2, None, f"{limit + 1:,} bytes long (limit {limit:,} bytes)"),
        (3, {"text": "after"}, None),
    ]
    assert peak < 8 * 2**20, f"reading past a {limit + 1:,}-byte row held {peak:,} bytes"


def test_jsonl_size_limit_is_exact_and_skippable_via_the_cli(tmp_path, teacher_dir, monkeypatch):
    monkeypatch.setattr(limits, "MIN_ROW_BYTE_LIMIT", 3000)
    monkeypatch.setattr(limits, "ROW_BYTES_PER_TOKEN", 1)
    assert row_byte_limit(4096) == 4096 and row_byte_limit(100) == 3000
    teacher = teacher_dir("qwen3")

    def row_of(size: int, tag: str) -> bytes:
        head = b'{"id": "' + tag.encode() + b'", "text": "'
        return head + b"z " * ((size - len(head) - 2) // 2) + b"z" * ((size - len(head) - 2) % 2) + b'"}'

    good = [json.dumps(row).encode() for row in qa_rows(3, seed=2, prefix="g")]
    exact, over = row_of(4096, "exact"), row_of(4097, "over")
    assert len(exact) == 4096 and len(over) == 4097
    path = tmp_path / "big.jsonl"
    path.write_bytes(b"\n".join([good[0], exact, over, good[1], b"", over + b"\r", good[2]]) + b"\r\n")
    rows = list(iter_rows(CorpusConfig(data=str(path))))
    assert [r.row for r in rows] == [1, 2, 3, 4, 6, 7] and count_rows([str(path)]) == 6
    assert rows[1].data["id"] == "exact" and rows[1].problem is None
    assert rows[2].problem == rows[4].problem == "4,097 bytes long (limit 4,096 bytes)"
    assert [r.row for r in iter_rows(CorpusConfig(data=str(path)), start_row=2)] == [3, 4, 6, 7]

    runner = CliRunner()
    failed = runner.invoke(app, build_args(teacher, path, "--out", str(tmp_path / "fail")))
    assert failed.exit_code == 1
    assert failed.output.strip().splitlines() == [
        f"error: {path} row 3: 4,097 bytes long (limit 4,096 bytes) (fix the row, or pass --on-bad-row skip)"]
    built = runner.invoke(app, build_args(teacher, path, "--out", str(tmp_path / "skip"), "--on-bad-row", "skip"))
    assert built.exit_code == 0, built.output
    cache = open_cache(str(tmp_path / "skip"))
    assert len(cache) == 4 and cache.manifest["totals"]["skipped"] == {"bad_row": 2}


@pytest.mark.parametrize("fmt", list(WRITERS))
def test_arrow_rows_over_the_size_limit_are_bad_rows(tmp_path, monkeypatch, fmt):
    monkeypatch.setattr(limits, "MIN_ROW_BYTE_LIMIT", 2000)
    write, suffix = WRITERS[fmt]
    rows = [{"text": f"row {i} " + "w" * (5000 if i in (1, 3) else 10)} for i in range(5)]
    data = write(tmp_path / f"big{suffix}", rows)
    got = list(iter_rows(CorpusConfig(data=data, max_length=8)))
    assert [r.row for r in got] == [1, 2, 3, 4, 5]
    assert [r.data for r in got[::2]] == rows[::2]
    for r in (got[1], got[3]):
        assert r.data is None and r.problem.endswith("bytes long (limit 2,000 bytes)")
        assert 5000 < int(r.problem.split()[0].replace(",", "")) < 5100


# ---------------------------------------------------------------------------------------------
# Overlong rows: only their start is tokenized, with the same tokens


class TokenizerSpy:
    """Passes every call to the tokenizer and remembers the longest text it was given."""

    def __init__(self, tokenizer):
        self.tokenizer, self.longest = tokenizer, 0

    def __call__(self, text, **kwargs):
        self.longest = max(self.longest, len(text))
        return self.tokenizer(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def bos_eos_tokenizer(tokenizer_dir):
    """The same tokenizer, adding a special token before and after plain text (as many do)."""
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    specials = [(t, tok.convert_tokens_to_ids(t)) for t in ("<|endoftext|>", "<|im_end|>")]
    tok.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A <|im_end|>", special_tokens=specials)
    assert tok("a b")["input_ids"][0] == specials[0][1] and tok("a b")["input_ids"][-1] == specials[1][1]
    return tok


def whole_then_cut(tok, row, max_length: int):
    """What tokenize_row gives when the whole row is tokenized, then cut to max_length."""
    full = tokenize_row(row, tok, CorpusConfig(data="x", max_length=10**9, min_length=1))
    ids, mask = full.input_ids[:max_length], full.loss_mask[:max_length]
    return ids, mask, len(full.input_ids) > max_length


THINK_TEMPLATE = (  # like Qwen3's: assistant turns before the last user turn lose their reasoning
    "{%- set ns = namespace(last_user=-1) %}"
    "{%- for m in messages %}{%- if m['role'] == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}"
    "{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in m['content'] %}"
    "{{- '<|im_start|>assistant\\n' + m['content'].split('</think>')[-1].lstrip('\\n') + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def long_rows() -> dict[str, dict]:
    prose = " ".join(english_like_sentences(800, seed=5))  # ~30k characters
    few_mb = " ".join([prose] * 70)  # ~2 MB
    turns = []
    for i, sentence in enumerate(english_like_sentences(300, seed=6)):
        turns.append({"role": "user" if i % 2 == 0 else "assistant", "content": (sentence + " ") * 20})
    return {
        "text_few_mb": {"text": few_mb},
        "text_odd": {"text": "x" * 60_000 + "123456789" * 8000 + ("tab\t\t  \n\n" * 6000) + "中文😀🎉" * 9000
                             + "a<|im_end|>b" * 5000},
        "chat_long_answer": {"messages": [{"role": "user", "content": "Summarise the book."},
                                          {"role": "assistant", "content": prose * 4}]},
        "chat_long_prompt": {"messages": [{"role": "system", "content": prose * 4},
                                          {"role": "assistant", "content": "Short."}]},
        "chat_many_turns": {"messages": turns},
        "chat_reasoning": {"messages": [
            {"role": "user", "content": "Think hard."},
            {"role": "assistant", "content": "<think>\n" + prose * 3 + "\n</think>\n\nThe answer."},
            {"role": "user", "content": "Again?"},
            {"role": "assistant", "content": "<think>\nquick\n</think>\n\n" + prose}]},
    }


def test_overlong_rows_keep_exactly_the_whole_rows_first_tokens(tmp_path, tokenizer, bos_eos_tokenizer):
    rows = long_rows()
    path = write_jsonl(tmp_path / "long.jsonl", rows.values())
    assert os.path.getsize(path) > 3_000_000
    think = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    think.chat_template = THINK_TEMPLATE
    tokenizers = {"text_few_mb": (tokenizer,), "text_odd": (tokenizer, bos_eos_tokenizer)}
    checked = 0
    for name, row in zip(rows, iter_rows(CorpusConfig(data=path))):
        assert row.problem is None
        for tok in tokenizers.get(name, (tokenizer, think)):
            whole = tokenize_row(row, tok, CorpusConfig(data="x", max_length=10**9, min_length=1))
            for max_length in (1, 500, 3000):
                assert len(whole.input_ids) > max_length, name
                ids, mask = whole.input_ids[:max_length], whole.loss_mask[:max_length]
                spy = TokenizerSpy(tok)
                got = tokenize_row(row, spy, CorpusConfig(data="x", max_length=max_length, min_length=1))
                # The claim: tokenizing a cut start gives the whole text's first max_length tokens.
                assert spy.longest <= 32 * max_length, (name, max_length, spy.longest)
                if not mask.any():  # nothing to learn in the kept part, because the row is long
                    assert got == "too_long", (name, max_length)
                    continue
                assert isinstance(got, TokenizedSequence) and got.truncated, (name, max_length)
                np.testing.assert_array_equal(got.input_ids, ids, err_msg=f"{name} {max_length}")
                np.testing.assert_array_equal(got.loss_mask, mask, err_msg=f"{name} {max_length}")
                drop = CorpusConfig(data="x", max_length=max_length, min_length=1, overlong="drop")
                assert tokenize_row(row, spy, drop) == "too_long", (name, max_length)
                checked += 1
    assert checked >= 20

    # Rows under the cut are tokenized whole, as before: "drop" keeps a row of exactly max_length.
    short = corpus.CorpusRow(index=0, path=path, row=1, problem=None,
                             data={"text": " ".join(english_like_sentences(200, seed=7))})
    n = len(tokenizer(short.data["text"])["input_ids"])
    exact = tokenize_row(short, tokenizer, CorpusConfig(data="x", max_length=n, overlong="drop"))
    assert isinstance(exact, TokenizedSequence) and not exact.truncated and len(exact.input_ids) == n
    assert tokenize_row(short, tokenizer, CorpusConfig(data="x", max_length=n - 1, overlong="drop")) == "too_long"


def test_long_tokens_widen_the_cut_up_to_a_bound(tokenizer_dir):
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_tokens(["=" * 100, "#" * 1000])
    cfg = CorpusConfig(data="x", max_length=100, min_length=1)

    def row(text):
        return corpus.CorpusRow(index=0, path="x.jsonl", row=1, data={"text": text}, problem=None)

    # 100-character tokens: the cut doubles until the first 101 tokens settle; same tokens.
    spy = TokenizerSpy(tok)
    got = tokenize_row(row("=" * 100 * 5000), spy, cfg)
    assert got.truncated and got.input_ids.tolist() == tok("=" * 100 * 200)["input_ids"][:100]
    assert spy.longest == 256 * 100
    # 1,000-character tokens never settle within 512 characters per token: the tokenizer stops
    # there, keeps what is settled and counts the row as overlong.
    spy = TokenizerSpy(tok)
    got = tokenize_row(row("#" * 1000 * 5000), spy, cfg)
    assert spy.longest == 512 * 100 and got.truncated and len(got.input_ids) == 25
    assert tokenize_row(row("#" * 1000 * 5000), tok, CorpusConfig(data="x", max_length=100, overlong="drop")) == "too_long"


def test_slow_tokenizers_cut_plain_text_too(tokenizer):
    class Slow(TokenizerSpy):
        is_fast = False

        def __call__(self, text, **kwargs):
            assert "return_offsets_mapping" not in kwargs
            return super().__call__(text, **kwargs)

    text = " ".join(english_like_sentences(3000, seed=8))
    row = corpus.CorpusRow(index=0, path="x.jsonl", row=1, data={"text": text}, problem=None)
    slow = Slow(tokenizer)
    got = tokenize_row(row, slow, CorpusConfig(data="x", max_length=300))
    assert got.truncated and got.input_ids.tolist() == tokenizer(text)["input_ids"][:300]
    assert slow.longest == 32 * 300


MEMORY_PROBE = textwrap.dedent(
    """
    import json, resource, sys
    from typer.testing import CliRunner
    from cli.cache import app
    teacher, small, big, out = sys.argv[1:5]
    args = ["build", "--teacher", teacher, "--dtype", "float32", "--layers", "0,2", "--top-k", "4",
            "--quiet", "--max-length", "256"]
    warm = CliRunner().invoke(app, args + ["--data", small, "--out", out + "/warm"])
    assert warm.exit_code == 0, warm.output
    before = peak_rss_kib()
    result = CliRunner().invoke(app, args + ["--data", big, "--out", out + "/big"])
    after = peak_rss_kib()
    print(json.dumps({"exit": result.exit_code, "output": result.output, "growth_kib": after - before}))
    """
)
MEMORY_PROBE = inspect.getsource(peak_rss_kib) + MEMORY_PROBE


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.mark.slow
def test_a_50_mb_row_builds_in_bounded_memory(tmp_path, teacher_dir, tokenizer):
    """Tokenizing a 50 MB row whole took 7-8 GB; now memory follows --max-length."""
    teacher = teacher_dir("qwen3")
    block = " ".join(english_like_sentences(1000, seed=9)) + "\n"
    answer = block * (50_000_000 // len(block))
    big = write_jsonl(tmp_path / "big.jsonl", [{"id": "big", "messages": [
        {"role": "user", "content": "Read this."}, {"role": "assistant", "content": answer}]}])
    del answer
    assert os.path.getsize(big) > 49_000_000
    small = write_jsonl(tmp_path / "small.jsonl", qa_rows(2, seed=3, prefix="s"))
    limit_kib = 3 * 2**20  # the probe is stopped before today's 7-8 GB can hurt the machine
    proc = subprocess.Popen([sys.executable, "-c", MEMORY_PROBE, teacher, small, big, str(tmp_path)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    peak, started = 0, time.monotonic()
    while proc.poll() is None:
        try:
            peak = max(peak, rss_kib(proc.pid))
        except (OSError, StopIteration):
            pass
        if peak > limit_kib or time.monotonic() - started > 300:
            proc.kill()
            proc.wait()
            pytest.fail(f"building from a 50 MB row took over {peak / 2**20:.1f} GiB RSS (stopped)")
        time.sleep(0.05)
    stdout, stderr = proc.communicate()
    assert proc.returncode == 0, stderr[-3000:]
    report = json.loads(stdout.strip().splitlines()[-1])
    assert report["exit"] == 0, report["output"]
    growth_mib = report["growth_kib"] / 1024
    assert growth_mib < 1024, f"peak RSS grew by {growth_mib:.0f} MiB for a 50 MB row"
    cache = open_cache(str(tmp_path / "big"))
    record = cache["big"]
    assert len(cache) == 1 and len(record.input_ids) == 256
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Read this."},
                                          {"role": "assistant", "content": block * 2}], tokenize=False)
    assert record.input_ids.tolist() == tokenizer(text, add_special_tokens=False)["input_ids"][:256]
