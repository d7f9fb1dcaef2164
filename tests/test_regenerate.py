"""`dflash-cache regenerate`: the teacher's own answers, exactly, resumably, for any world size."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import english_like_sentences, write_jsonl
from transformers import AutoModelForCausalLM, AutoTokenizer
from typer.testing import CliRunner

from cli.cache import app
from dflash_build import BuildConfig, build_cache
from dflash_cache import open_cache
from dflash_common.environment import rank_and_world
from dflash_common.errors import ConfigError
from dflash_corpus import CorpusConfig
from dflash_regenerate import (
    RegenerateConfig,
    RowSampler,
    load_generator,
    merge_parts,
    parts_dir,
    plan_turns,
    regenerate,
    sample_seed,
)
from dflash_teacher.sampling import top_p_filter
from dflash_teacher.teacher import TeacherConfig

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def one_thread():
    """Two cores shared with other processes: spinning OpenMP threads make a tiny model's
    generate about ten times slower. Results are compared within one thread count."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def stopping_teacher(teacher_dir, tmp_path_factory):
    """The tiny qwen3 teacher with its end-of-turn row in the LM head tied to twice a common
    token's row, so greedy answers sometimes end before max_new_tokens (random weights alone
    never pick <|im_end|>)."""
    src = teacher_dir("qwen3")
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "The cat sees the answer."}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        ids = model.generate(**prompt, do_sample=False, max_new_tokens=8)[0, prompt["input_ids"].shape[1]:]
        common = int(torch.mode(ids).values)
        model.lm_head.weight[tokenizer.eos_token_id] = 2 * model.lm_head.weight[common]
    path = tmp_path_factory.mktemp("stopping_teacher")
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def chat_rows(n: int, seed: int = 0, user_turns: int = 1) -> list[dict]:
    sentences = english_like_sentences(2 * n * user_turns + n, seed=seed)
    rows, k = [], 0
    for i in range(n):
        messages = [{"role": "system", "content": "Be brief."}] if i % 3 == 0 else []
        for _ in range(user_turns):
            # prompts of different lengths, so batches are left-padded
            messages.append({"role": "user", "content": " ".join(sentences[k: k + 1 + i % 3])})
            messages.append({"role": "assistant", "content": sentences[k + 1] + " (written by another model)"})
            k += 2
        rows.append({"id": f"chat-{i:03d}", "messages": messages})
    return rows


def make_config(data, out, teacher, **kw) -> RegenerateConfig:
    options = dict(max_new_tokens=10, batch_size=4, rows_per_part=3)
    options.update(kw)
    return RegenerateConfig(data=str(data), out=str(out), teacher=TeacherConfig(teacher, dtype="float32"), **options)


def read_jsonl(path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


class Reference:
    """The teacher answering one prompt alone: `model.generate(do_sample=False)`, unbatched."""

    def __init__(self, teacher: str):
        self.model = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(teacher)

    def answer(self, messages: list[dict], max_new_tokens: int) -> tuple[str, bool]:
        prompt = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt",
                                                    return_dict=True)
        with torch.no_grad():
            out = self.model.generate(**prompt, do_sample=False, max_new_tokens=max_new_tokens)
        ids = out[0, prompt["input_ids"].shape[1]:].tolist()
        stopped = self.tokenizer.eos_token_id in ids
        if stopped:
            ids = ids[: ids.index(self.tokenizer.eos_token_id)]
        return self.tokenizer.decode(ids, skip_special_tokens=True), stopped


# ---------------------------------------------------------------------------------------------
# Exactness


@pytest.mark.parametrize("arch", ["qwen3-stopping", "qwen3_5"])
def test_greedy_equals_unbatched_generate_and_the_build_reads_it(tmp_path, teacher_dir, stopping_teacher, arch):
    teacher = stopping_teacher if arch == "qwen3-stopping" else teacher_dir("qwen3_5")
    rows = chat_rows(7)
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    out = tmp_path / "regen.jsonl"
    result = regenerate(make_config(data, out, teacher, max_new_tokens=12, batch_size=4))
    assert result.complete and result.rows == 7 and result.parts_written == 3

    written = read_jsonl(out)
    assert [r["id"] for r in written] == [r["id"] for r in rows]
    reference = Reference(teacher)
    stops = 0
    for source, row in zip(rows, written):
        prompt = source["messages"][:-1]  # system (some rows) and the user turn, as written
        assert row["messages"][:-1] == prompt and row["messages"][-1]["role"] == "assistant"
        expected, stopped = reference.answer(prompt, 12)
        assert row["messages"][-1]["content"] == expected, row["id"]
        stops += stopped
    if arch == "qwen3-stopping":
        assert 0 < stops < 7, "some answers should end at <|im_end|> and some at max_new_tokens"
        assert result.truncated == 7 - stops

    # the regenerated corpus is what `dflash-cache build` reads
    build_cache(BuildConfig(out=str(tmp_path / "cache"), corpus=CorpusConfig(data=str(out)),
                            teacher=TeacherConfig(teacher, dtype="float32", layers=(1, 2), top_k=4)))
    cache = open_cache(str(tmp_path / "cache"))
    assert cache.complete and sorted(r.id for r in cache.sequences()) == [r["id"] for r in rows]
    assert all(r.loss_mask.any() for r in cache.sequences())


def test_bfloat16_batches_stay_greedy_within_rounding(teacher_dir):
    """In bf16 a left-padded batch rounds differently from a prompt alone, so a near-tie can
    flip (exact equality is tested in float32 above). Every token must still be the argmax up
    to bf16 rounding: judged by a float32 forward of the same weights, no chosen token's logit
    is more than 3 bf16 units in the last place (of the largest logit) below the best one.
    (Measured here: at most ~1.1 units; the median top-2 gap is ~9 units.)"""
    teacher = teacher_dir("qwen3", torch.bfloat16)
    gen = load_generator(TeacherConfig(teacher, dtype="bfloat16"))
    exact = AutoModelForCausalLM.from_pretrained(teacher, dtype=torch.float32).eval()
    prompts = sorted((gen.render(r["messages"][:-1]) for r in chat_rows(16, seed=3)), key=len, reverse=True)

    def worst_deficit_in_ulps(prompt, ids):
        with torch.no_grad():
            logits = exact(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1: len(prompt) - 1 + len(ids)]
        deficit = logits.max(-1).values - logits[torch.arange(len(ids)), torch.tensor(ids)]
        return float(deficit.max() / (2.0 ** -8 * logits.abs().max()))

    answers = gen.generate(prompts[:8], 24, None) + gen.generate(prompts[8:], 24, None)
    assert max(worst_deficit_in_ulps(p, ids) for p, (ids, _) in zip(prompts, answers)) <= 3
    sampler = RowSampler([torch.Generator().manual_seed(i) for i in range(8)], temperature=1.0, top_p=1.0)
    sampled = gen.generate(prompts[:8], 24, sampler)  # the bound tells sampled answers from greedy ones
    assert min(worst_deficit_in_ulps(p, ids) for p, (ids, _) in zip(prompts, sampled)) > 3


def test_all_turns_answer_each_turn_after_the_regenerated_earlier_ones(tmp_path, stopping_teacher):
    rows = chat_rows(4, seed=2, user_turns=3)
    rows[1]["messages"] = rows[1]["messages"][:-1]  # ends with a user turn that the source never answered
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    regenerate(make_config(data, tmp_path / "all.jsonl", stopping_teacher, keep_turns="all", rows_per_part=2))
    regenerate(make_config(data, tmp_path / "first.jsonl", stopping_teacher, keep_turns="first", rows_per_part=2))
    every, first = read_jsonl(tmp_path / "all.jsonl"), read_jsonl(tmp_path / "first.jsonl")
    reference = Reference(stopping_teacher)

    for source, row, one in zip(rows, every, first):
        kept = [m for m in source["messages"] if m["role"] != "assistant"]
        assert [m for m in row["messages"] if m["role"] != "assistant"] == kept
        assert [m["role"] for m in row["messages"]].count("assistant") == 3
        # each answer is the greedy continuation of the conversation holding the earlier regenerated answers
        for i, message in enumerate(row["messages"]):
            if message["role"] == "assistant":
                assert message["content"] == reference.answer(row["messages"][:i], 10)[0], (row["id"], i)
                assert "written by another model" not in message["content"]
        # 'first' keeps the system prompt, the first user turn and the same first answer
        first_answer = next(i for i, m in enumerate(row["messages"]) if m["role"] == "assistant")
        assert one["messages"] == row["messages"][: first_answer + 1]


# ---------------------------------------------------------------------------------------------
# Resuming


def _committed(out: Path) -> list[Path]:
    return sorted(Path(parts_dir(str(out))).glob(".part-*.json"))


@pytest.mark.slow
def test_sigkill_then_rerun_equals_an_uninterrupted_run(tmp_path, teacher_dir):
    teacher = teacher_dir("qwen3")
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(60, seed=4))
    args = ["regenerate", "--teacher", teacher, "--data", data, "--dtype", "float32", "--max-new-tokens", "16",
            "--batch-size", "3", "--rows-per-part", "3", "--quiet"]
    clean = tmp_path / "clean.jsonl"
    result = CliRunner().invoke(app, args + ["--out", str(clean)])
    assert result.exit_code == 0, result.output

    killed = tmp_path / "killed.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1")  # the thread count of the clean run (see one_thread)
    proc = subprocess.Popen([sys.executable, "-m", "cli.cache", *args, "--out", str(killed)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not _committed(killed) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    committed = len(_committed(killed))
    assert 1 <= committed < 20 and not killed.exists(), "the kill must land after the first part and before the end"

    result = CliRunner().invoke(app, args + ["--out", str(killed)])
    assert result.exit_code == 0, result.output
    assert f"resuming: {committed} of 20 part(s)" in result.output
    assert killed.read_bytes() == clean.read_bytes()
    ids = [r["id"] for r in read_jsonl(killed)]
    assert ids == [f"chat-{i:03d}" for i in range(60)]  # no duplicates, no gaps, source order
    # parts and temporaries cleaned up; the writers' lock stays
    assert sorted(os.listdir(parts_dir(str(killed)))) == [".dflash.lock", ".settings.json"]

    again = CliRunner().invoke(app, args + ["--out", str(killed)])
    assert again.exit_code == 0 and "already complete" in again.output
    assert killed.read_bytes() == clean.read_bytes()


def test_changed_settings_are_refused_on_resume(tmp_path, teacher_dir, monkeypatch):
    teacher = teacher_dir("qwen3")
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(6))
    out = tmp_path / "regen.jsonl"
    # rank 0 of 2: a run left half done (parts committed, nothing merged)
    partial = regenerate(make_config(data, out, teacher, rank=0, world_size=2))
    assert not partial.complete and partial.parts_missing == 1 and not out.exists()
    for changed, problem in [(dict(max_new_tokens=11), "max_new_tokens differs"),
                             (dict(keep_turns="all"), "keep_turns differs"),
                             (dict(temperature=0.7), "sampling differs"),
                             (dict(rows_per_part=2), "rows_per_part differs")]:
        with pytest.raises(ConfigError, match=f"{problem}.*--overwrite"):
            regenerate(make_config(data, out, teacher, rank=1, world_size=2, **changed))
    with pytest.raises(ConfigError, match="teacher differs"):
        regenerate(make_config(data, out, teacher_dir("llama"), rank=1, world_size=2))
    regenerate(make_config(data, out, teacher, rank=1, world_size=2))  # the same settings finish it
    done = out.read_bytes()

    # complete outputs refuse too; greedy ignores the seed, so a new seed is the same run
    with pytest.raises(ConfigError, match="max_new_tokens differs"):
        regenerate(make_config(data, out, teacher, max_new_tokens=11))
    assert regenerate(make_config(data, out, teacher, seed=5)).complete and out.read_bytes() == done
    args = ["regenerate", "--teacher", teacher, "--data", data, "--out", str(out), "--dtype", "float32",
            "--max-new-tokens", "4", "--rows-per-part", "3", "--quiet"]
    refused = CliRunner().invoke(app, args)
    assert refused.exit_code == 1 and "max_new_tokens differs" in refused.output and "\n" not in refused.output.strip()
    assert CliRunner().invoke(app, args + ["--overwrite"]).exit_code == 0
    assert out.read_bytes() != done and len(read_jsonl(out)) == 6


def test_output_is_the_same_for_any_world_size(tmp_path, teacher_dir, monkeypatch):
    teacher = teacher_dir("qwen3")
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(11, seed=6, user_turns=2))
    args = ["regenerate", "--teacher", teacher, "--data", data, "--dtype", "float32", "--max-new-tokens", "8",
            "--rows-per-part", "3", "--keep-turns", "all", "--temperature", "1.0", "--top-p", "0.9", "--seed", "7",
            "--quiet"]
    runner = CliRunner()
    single = tmp_path / "single.jsonl"
    assert runner.invoke(app, args + ["--out", str(single)]).exit_code == 0

    split = tmp_path / "split.jsonl"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    first = runner.invoke(app, args + ["--out", str(split)])
    assert first.exit_code == 0 and "2 part(s) of other ranks are missing" in first.output and not split.exists()
    early = runner.invoke(app, args + ["--out", str(split), "--merge-only"])
    assert early.exit_code == 1 and "2 of 4 part(s) are not written yet (first: part-000000.jsonl, source rows 0..2)" in early.output
    monkeypatch.setenv("RANK", "0")
    last = runner.invoke(app, args + ["--out", str(split)])
    assert last.exit_code == 0 and "ready at" in last.output  # the last rank to finish merges
    assert split.read_bytes() == single.read_bytes()
    assert runner.invoke(app, args + ["--out", str(split), "--merge-only"]).exit_code == 0  # already merged: no-op


def test_sampling_is_fixed_per_seed_and_row_whatever_the_batching(tmp_path, teacher_dir):
    teacher = teacher_dir("qwen3")
    rows = chat_rows(6, seed=8)
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    reversed_data = write_jsonl(tmp_path / "reversed.jsonl", rows[::-1])

    def sample(source, name, **kw):
        regenerate(make_config(source, tmp_path / name, teacher, temperature=1.0, **kw))
        return {r["id"]: r["messages"][-1]["content"] for r in read_jsonl(tmp_path / name)}

    a = sample(data, "a.jsonl", seed=1, batch_size=6, rows_per_part=6)
    assert a == sample(data, "b.jsonl", seed=1, batch_size=1, rows_per_part=2)
    assert a == sample(reversed_data, "c.jsonl", seed=1, batch_size=4)  # other neighbours, other parts
    other_seed = sample(data, "d.jsonl", seed=2)
    assert sum(a[k] != other_seed[k] for k in a) >= 5
    greedy = {r["id"]: Reference(teacher).answer(r["messages"][:-1], 10)[0] for r in rows[:2]}
    assert any(a[k] != greedy[k] for k in greedy)


# ---------------------------------------------------------------------------------------------
# Bad input


def test_bad_rows_fail_with_one_line_or_are_skipped_and_counted(tmp_path, teacher_dir):
    teacher = teacher_dir("qwen3")
    good = chat_rows(3)
    prompt_only = {"id": "prompt-only", "conversations": [{"from": "human", "value": "The dog reads a new book."}]}
    lines = [json.dumps(good[0]), "{not json", json.dumps({"id": "t", "text": "Plain text has no prompt."}),
             json.dumps({"id": "a", "messages": [{"role": "assistant", "content": "Hello!"}]}),
             json.dumps(good[1]), json.dumps(prompt_only), json.dumps(good[2])]
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    runner = CliRunner()
    args = ["regenerate", "--teacher", teacher, "--data", str(path), "--dtype", "float32", "--max-new-tokens", "4",
            "--quiet"]

    failed = runner.invoke(app, args + ["--out", str(tmp_path / "fail.jsonl")])
    assert failed.exit_code == 1 and "Traceback" not in failed.output
    message = failed.output.strip()
    assert "\n" not in message and "bad.jsonl row 2" in message and "invalid JSON" in message
    assert "--on-bad-row skip" in message
    text_first = tmp_path / "text.jsonl"
    text_first.write_text("\n".join(lines[2:]) + "\n")
    failed = runner.invoke(app, [*args[:4], str(text_first), *args[5:], "--out", str(tmp_path / "t.jsonl")])
    assert failed.exit_code == 1 and "text.jsonl row 1: plain 'text' row has no user turn to regenerate" in failed.output

    skipped = runner.invoke(app, args + ["--out", str(tmp_path / "skip.jsonl"), "--on-bad-row", "skip"])
    assert skipped.exit_code == 0, skipped.output
    assert "skipped bad_row: 3" in skipped.output
    written = read_jsonl(tmp_path / "skip.jsonl")
    assert [r["id"] for r in written] == ["chat-000", "chat-001", "prompt-only", "chat-002"]
    assert written[2]["messages"][0] == {"role": "user", "content": "The dog reads a new book."}


# ---------------------------------------------------------------------------------------------
# Small pieces


def test_plan_turns():
    sys_, u1, a1, u2, a2, u3 = ({"role": r, "content": c} for r, c in
                                [("system", "S"), ("user", "U1"), ("assistant", "A1"), ("user", "U2"),
                                 ("assistant", "A2"), ("user", "U3")])
    assert plan_turns([sys_, u1, a1, u2, a2], "all") == [[sys_, u1], [u2]]
    assert plan_turns([sys_, u1, a1, u2, a2], "first") == [[sys_, u1]]
    assert plan_turns([u1, a1, u2, a2, u3], "all") == [[u1], [u2], [u3]]  # a trailing prompt is answered too
    assert plan_turns([a1, u1, u2, a2, a1], "all") == [[u1, u2]]  # no answer without a new user turn
    with pytest.raises(ValueError, match="no user turn"):
        plan_turns([sys_, a1], "all")
    with pytest.raises(ValueError, match="tool turn"):
        plan_turns([u1, a1, {"role": "tool", "content": "42"}, a2], "all")
    assert plan_turns([u1, a1, {"role": "tool", "content": "42"}, a2], "first") == [[u1]]


def test_sampling_helpers():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.97, 0.01, 0.01, 0.01]])
    np.testing.assert_allclose(top_p_filter(probs, 0.7).numpy(), [[0.5, 0.3, 0, 0], [0.97, 0, 0, 0]])
    np.testing.assert_allclose(top_p_filter(probs, 1.0).numpy(), probs.numpy())
    assert sample_seed(0, "a", 0) == sample_seed(0, "a", 0)
    assert len({sample_seed(0, "a", 0), sample_seed(1, "a", 0), sample_seed(0, "b", 0), sample_seed(0, "a", 1)}) == 4


def test_ranks_and_config_validation(tmp_path, monkeypatch):
    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert rank_and_world() == (0, 1)
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert rank_and_world() == (3, 4)
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(ConfigError, match="WORLD_SIZE='two' is not an integer"):
        rank_and_world()
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ConfigError, match="RANK=3 is outside a world of WORLD_SIZE=3 processes"):
        rank_and_world()
    teacher = TeacherConfig("t")
    for bad, problem in [(dict(out="x.json"), "must be a .jsonl"), (dict(temperature=-1), "temperature=-1"),
                         (dict(top_p=0), "top_p=0"), (dict(keep_turns="last"), "keep_turns='last'"),
                         (dict(max_new_tokens=0), "max_new_tokens=0"), (dict(rank=2, world_size=2), "rank=2"),
                         (dict(overwrite=True, world_size=2), "overwrite with world_size=2")]:
        options = dict(data="in.jsonl", out="o.jsonl", teacher=teacher)
        options.update(bad)
        with pytest.raises(ConfigError, match=problem):
            RegenerateConfig(**options)
    with pytest.raises(ConfigError, match="no regeneration to merge"):
        merge_parts(str(tmp_path / "none.jsonl"))
    write_jsonl(tmp_path / "chat.jsonl", chat_rows(2))
    with pytest.raises(ConfigError, match="inside --data"):
        regenerate(make_config(tmp_path, tmp_path / "sub" / "out.jsonl", "unused"))
