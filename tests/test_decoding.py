"""Real speculative decoding against the offline estimate, on teacher-generated data."""

from __future__ import annotations

import json

from helpers import english_like_sentences, write_jsonl
from typer.testing import CliRunner

from cli.cache import app as cache_app
from cli.train import app as train_app


def test_offline_replay_agrees_with_measured_accepted_length(tmp_path, teacher_dir):
    teacher = teacher_dir("qwen3")
    sentences = english_like_sentences(110, seed=11)
    prompts = [{"id": f"q{i:03d}", "messages": [{"role": "user", "content": s}]} for i, s in enumerate(sentences)]
    write_jsonl(tmp_path / "prompts.jsonl", prompts[:100])
    write_jsonl(tmp_path / "heldout.jsonl", prompts[100:])
    runner = CliRunner()
    # 1. the teacher writes the answers, 2. they are cached, 3. a drafter learns them
    regen = runner.invoke(cache_app, ["regenerate", "--teacher", teacher, "--data", str(tmp_path / "prompts.jsonl"),
                                      "--out", str(tmp_path / "regen.jsonl"), "--max-new-tokens", "20", "--dtype", "float32",
                                      "--batch-size", "32", "--quiet"])
    assert regen.exit_code == 0, regen.output
    build = runner.invoke(cache_app, ["build", "--teacher", teacher, "--data", str(tmp_path / "regen.jsonl"),
                                      "--out", str(tmp_path / "cache"), "--dtype", "float32", "--layers", "1,2",
                                      "--top-k", "8", "--quiet"])
    assert build.exit_code == 0, build.output
    run = runner.invoke(train_app, ["run", "--cache", str(tmp_path / "cache"), "--out", str(tmp_path / "run"),
                                    "--steps", "60", "--num-layers", "1", "--block-size", "4", "--batch-tokens", "2000",
                                    "--anchors", "random", "--num-anchors", "12", "--lr", "3e-3", "--noise", "off", "--heldout-fraction", "0.1",
                                    "--eval-sequences", "0", "--quiet"])
    assert run.exit_code == 0, run.output

    report_path = tmp_path / "eval.json"
    result = runner.invoke(train_app, ["eval", "--checkpoint", str(tmp_path / "run" / "drafter"), "--teacher", teacher,
                                       "--prompts", str(tmp_path / "heldout.jsonl"), "--max-new-tokens", "20",
                                       "--temperature", "0", "--temperature", "1", "--out", str(report_path), "--quiet"])
    assert result.exit_code == 0, result.output
    report = json.loads(report_path.read_text())
    decoding = report["decoding"]
    # T=0 and T=1 side by side: the sampled one has no teacher output to equal, and accepts tokens too
    greedy, sampled = report["decodings"]
    assert greedy == decoding and sampled["mode"].startswith("sampling (temperature 1.0")
    assert sampled["matched_teacher"] is None and sampled["accepted_length"] > 1.05, sampled["accepted_length"]
    assert "measured accepted length (T=0)" in result.output and "measured accepted length (T=1)" in result.output
    assert decoding["matched_teacher"] is True
    # the drafter really accepts something, so the comparison below is not 1.0 == 1.0
    assert decoding["accepted_length"] > 1.1, decoding["accepted_length"]
    # Tolerance: the replay caps the last round of each answer at the stop token, real decoding
    # counts what that round accepted before the cut; with ~24-token answers that is < 0.15.
    assert abs(decoding["offline_accepted_length"] - decoding["accepted_length"]) < 0.15
    # counted the same way (up to the stop token) the two agree closely
    assert abs(decoding["offline_accepted_length"] - decoding["kept_per_forward"]) < 0.05
    assert decoding["kept_per_forward"] <= decoding["accepted_length"]
    assert "measured accepted length" in result.output and "offline estimate, same prompts" in result.output


def test_engine_vllm_without_vllm_names_the_install(tmp_path, teacher_dir, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no .venv-vllm here
    monkeypatch.delenv("DFLASH_VLLM_PYTHON", raising=False)
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "hello"}])
    args = ["eval", "--checkpoint", str(tmp_path / "drafter"), "--teacher", teacher_dir("qwen3"),
            "--prompts", str(tmp_path / "prompts.jsonl"), "--quiet"]
    for extra in (["--engine", "vllm"], ["--engine", "both"], ["--engine", "vllm", "--vllm-python", str(tmp_path / "nope")]):
        result = CliRunner().invoke(train_app, args + extra)
        assert result.exit_code == 1, result.output
        lines = result.output.strip().splitlines()
        assert len(lines) == 1 and "make serving" in lines[0] and "Traceback" not in result.output, result.output
    unknown = CliRunner().invoke(train_app, args + ["--engine", "sglang"])
    assert unknown.exit_code == 1 and "--engine 'sglang' is unknown" in unknown.output
