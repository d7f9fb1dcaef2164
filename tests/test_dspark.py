"""DSpark (model.kind = dspark): heads, loss, training with exact resume, export, lossless decoding."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import train_and_resume
from test_speculative import LAYER_IDS, RUN_MASK, RUN_VOCAB, run_teacher
from typer.testing import CliRunner

from cli.train import app
from dflash_common.errors import ConfigError
from dflash_train.config import config_from_dict
from dflash_train.measuring.speculative import speculative_generate, teacher_generate
from dflash_train.settings.drafter_config import DrafterConfig
from dflash_train.settings.dspark_config import DSparkConfig
from dflash_train.settings.loss_config import LossConfig
from dflash_train.settings.spec_config import SpecConfig
from dflash_train.sweep.grid import expand_grid, parse_grid, run_overrides
from dflash_train.training.export import load_drafter, read_export_config
from dflash_train.training.loss import DraftHeads, block_loss
from dflash_train.training.model import DFlashDrafter
from dflash_train.training.objectives import bucket_alpha


@pytest.mark.parametrize("overrides", [
    dict(markov_rank=-1), dict(markov_rank=2.5), dict(markov_head_type="lstm"), dict(confidence_head_alpha=-1.0),
    dict(confidence_target="loss"), dict(markov_rank=0), dict(sample_from_anchor="yes"),
])
def test_dspark_config_refuses_bad_values(overrides):
    with pytest.raises(ConfigError):
        DSparkConfig(**overrides)


def test_plain_dflash_in_dspark_layout_is_allowed():
    cfg = DSparkConfig(markov_rank=0, confidence_head_with_markov=False)
    assert cfg.markov_rank == 0


def _drafter(teacher, block_size=4, seed=0, **dspark) -> DFlashDrafter:
    cfg = DrafterConfig.from_teacher(teacher.config.to_dict(), LAYER_IDS, RUN_MASK, block_size=block_size,
                                     num_hidden_layers=1, dspark=DSparkConfig(**{"markov_rank": 8, **dspark}))
    torch.manual_seed(seed)
    return DFlashDrafter(cfg, teacher.get_input_embeddings().weight, teacher.get_output_embeddings().weight).eval()


@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_teacher_forced_heads_are_the_decoding_steps(head_type):
    """forward(heads=True) gives, for draft position j, slot j-1's state (sample_from_anchor), the
    Markov feature of x_{a+j-1} computed by the same step the decoder runs, and the confidence of it."""
    teacher = run_teacher("qwen3", 0.1)
    drafter = _drafter(teacher, markov_head_type=head_type)
    assert drafter.cfg.num_draft_positions == 4
    torch.manual_seed(1)
    hidden = torch.randn(1, 12, len(LAYER_IDS), 64)
    ids = torch.randint(0, RUN_VOCAB - 1, (1, 12))
    anchors = torch.tensor([[3, 6]])
    with torch.no_grad():
        states = drafter(hidden, ids, anchors)
        positions, features, confidence = drafter(hidden, ids, anchors, heads=True)
        assert torch.equal(positions, states.view(2, 4, -1))
        for block, a in enumerate(anchors[0].tolist()):
            state = None
            for j in range(4):
                prev = drafter.markov_head.embed(ids[0, a + j])
                feature, state = drafter.markov_head.step(prev, positions[block, j], state)
                torch.testing.assert_close(features[block, j], feature)
                torch.testing.assert_close(confidence[block, j], drafter.confidence_head(positions[block, j], prev))
    if head_type == "vanilla":  # the bias is W2 W1[prev]
        bias = drafter.logits(positions, features) - drafter.logits(positions)
        w1, w2 = drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight
        prev_ids = torch.stack([ids[0, a:a + 4] for a in anchors[0].tolist()])
        torch.testing.assert_close(bias, (w1[prev_ids] @ w2.T).detach(), atol=1e-5, rtol=1e-4)


def test_loss_uses_the_biased_logits_and_adds_the_confidence_bce():
    torch.manual_seed(0)
    m, p, h, v, r, k = 3, 4, 8, 20, 2, 5
    states, lm_head = torch.randn(m, p, h), torch.randn(v, h)
    features, w2 = torch.randn(m, p, r), torch.randn(v, r)
    targets = torch.randint(0, v, (m, p))
    topk_ids = torch.stack([torch.randperm(v)[:k] for _ in range(m * p)]).view(m, p, k)
    topk_logprobs = torch.log_softmax(torch.randn(m, p, v), -1).gather(-1, topk_ids)
    valid = torch.ones(m, p, dtype=torch.bool)
    valid[0, 3] = False
    logit = torch.randn(m, p)
    cfg = LossConfig(weighting="none")
    plain = block_loss(states, lm_head, targets, topk_ids, topk_logprobs, valid, cfg, p)
    heads = DraftHeads(features=features, bias_weight=w2, confidence=logit, confidence_alpha=0.5)
    out = block_loss(states, lm_head, targets, topk_ids, topk_logprobs, valid, cfg, p, heads)
    # alpha from the full biased logits by hand
    q = torch.softmax(states @ lm_head.T + features @ w2.T, -1)
    q_buckets = torch.cat([q.gather(-1, topk_ids), (1 - q.gather(-1, topk_ids).sum(-1, keepdim=True))], -1)
    p_topk = topk_logprobs.exp()
    p_buckets = torch.cat([p_topk, (1 - p_topk.sum(-1, keepdim=True)).clamp(min=0)], -1)
    alpha = bucket_alpha(p_buckets, q_buckets) * valid
    torch.testing.assert_close(out.alpha_sum, alpha.sum(0), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(out.alpha_sum, plain.alpha_sum)
    bce = torch.nn.functional.binary_cross_entropy_with_logits(logit, alpha, reduction="none")[valid]
    main = out.loss_sum.sum() / valid.sum()
    torch.testing.assert_close(out.loss, main + 0.5 * bce.mean(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.confidence_sums["measured"], alpha.sum(0), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.confidence_sums["predicted"], (torch.sigmoid(logit) * valid).sum(0))
    with pytest.raises(ValueError, match="draft positions"):
        block_loss(states[:, :2], lm_head, targets[:, :2], topk_ids[:, :2], topk_logprobs[:, :2], valid[:, :2], cfg, p)


def test_grid_sweeps_the_drafter_kind():
    axes = parse_grid(["model.kind=dflash,dspark"])
    kinds = []
    for assignment in expand_grid(axes):
        cfg = config_from_dict({"cache": "c", "out": "o", **run_overrides(axes, assignment)})
        kinds.append(cfg.model.kind)
    assert kinds == ["dflash", "dspark"]
    with pytest.raises(ConfigError, match="model.kind"):
        config_from_dict({"cache": "c", "out": "o", "model": {"kind": "eagle"}})


TRAIN = ["--steps", "6", "--save-every", "3", "--num-layers", "1", "--block-size", "4", "--eval-sequences", "8",
         "--heldout-fraction", "0.1", "--batch-tokens", "600", "--log-every", "3", "--quiet", "--model-kind", "dspark",
         "--markov-rank", "8", "--markov-head-type", "rnn"]


def test_dspark_trains_resumes_bit_exactly_and_exports(tmp_path, cache_url):
    """A cache built for DFlash trains a DSpark drafter unchanged; a resume from step 3 ends with
    the weights of the straight run; the export is what vLLM's DSpark loader reads."""
    straight, result, a = train_and_resume(app, cache_url, tmp_path, TRAIN)
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "markov_head.joint_proj.weight",
            "confidence_head.proj.weight", "confidence_head.proj.bias"} <= set(a)

    config = json.loads((straight / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["DSparkDraftModel"] and config["model_type"] == "qwen3"
    assert (config["sample_from_anchor"], config["markov_rank"], config["markov_head_type"]) == (True, 8, "rnn")
    assert config["enable_confidence_head"] and config["confidence_head_with_markov"]
    assert config["confidence_head_alpha"] == 1.0 and "sample_from_anchor" not in config["dflash_config"]
    assert read_export_config(straight / "drafter").dspark == DSparkConfig(markov_rank=8, markov_head_type="rnn")
    spec = json.dumps({"method": "dspark", "model": str(straight / "drafter"), "num_speculative_tokens": 4})
    assert f"vllm serve TEACHER --speculative-config '{spec}'" in result.output
    assert "only markov_head_type vanilla" in result.output

    records = [json.loads(x) for x in (straight / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert len(train[-1]["alpha"]) == 4 and "loss_confidence" in train[-1]
    evaluation = [r for r in records if r["kind"] == "eval"][-1]
    assert len(evaluation["calibration"]["predicted"]) == len(evaluation["calibration"]["measured"]) == 4
    assert all(0 <= x <= 1 for x in evaluation["calibration"]["predicted"])
    # the held-out log's calibration: ECE over the binned observations, every valid position one of them
    calibration = evaluation["calibration"]
    assert sum(calibration["reliability"]["count"]) == calibration["observations"] == evaluation["positions"]
    assert 0 <= calibration["ece"] <= 1 and calibration["calibrated"] is (calibration["ece"] <= 0.1)


def _successor_bias(drafter: DFlashDrafter, strength: float) -> None:
    """A vanilla Markov head whose bias favours token prev + 1: drafts follow the drafted chain."""
    with torch.no_grad():
        w1, w2 = drafter.markov_head.markov_w1.weight, drafter.markov_head.markov_w2.weight
        codes = torch.linalg.qr(torch.randn(RUN_VOCAB, RUN_VOCAB))[0]  # orthonormal rows: full rank
        w1.copy_(codes)
        w2.copy_(strength * codes.roll(1, dims=0))  # W2[t] W1[prev] = strength when t = prev + 1, else 0


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("head_type", ["vanilla", "gated", "rnn"])
def test_dspark_greedy_decoding_equals_the_teacher(arch, head_type):
    teacher = run_teacher(arch, 0.3)
    drafter = _drafter(teacher, block_size=5, markov_head_type=head_type)
    prompt = [3, 3, 7, 7, 7, 1]
    cfg = SpecConfig(max_new_tokens=30)
    reference = teacher_generate(teacher, prompt, cfg).tokens
    result = speculative_generate(teacher, drafter, prompt, cfg)
    assert result.tokens == reference
    assert all(len(d) == 5 for d in result.draft_tokens)  # block_size drafts: the anchor slot predicts


def test_drafts_are_semi_autoregressive_and_the_confidence_stop_is_lossless():
    teacher = run_teacher("qwen3", 0.3)
    drafter = _drafter(teacher, block_size=5, markov_rank=RUN_VOCAB)
    _successor_bias(drafter, 200.0)
    prompt = [3, 3, 7, 7, 7, 1]
    cfg = SpecConfig(max_new_tokens=20)
    reference = teacher_generate(teacher, prompt, cfg).tokens
    result = speculative_generate(teacher, drafter, prompt, cfg)
    assert result.tokens == reference
    # each draft follows the one drafted before it, starting from the anchor
    anchors = [reference[0]] + [reference[sum(result.accepted_lengths[:i + 1])] for i in range(len(result.draft_tokens) - 1)]
    for anchor, drafts in zip(anchors, result.draft_tokens):
        assert drafts == [(anchor + j) % RUN_VOCAB for j in range(1, 6)]

    with torch.no_grad():  # a confidence head that predicts acceptance 0.6 everywhere: 0.6, 0.36, 0.22 ...
        drafter.confidence_head.proj.weight.zero_()
        drafter.confidence_head.proj.bias.fill_(torch.logit(torch.tensor(0.6)).item())
    stopped = speculative_generate(teacher, drafter, prompt, SpecConfig(max_new_tokens=20, confidence_threshold=0.3))
    assert stopped.tokens == reference
    assert all(len(d) == 2 for d in stopped.draft_tokens)
    # the head's estimate of each verified draft, a list per round: what eval's calibration reads
    assert stopped.confidences == [[pytest.approx(0.6)] * 2] * len(stopped.accepted_lengths)
    assert speculative_generate(teacher, drafter, prompt, cfg).confidences[0] == [pytest.approx(0.6)] * 5
    with pytest.raises(ConfigError, match="confidence_threshold"):
        SpecConfig(confidence_threshold=1.5)


def test_sampled_dspark_decoding_runs_with_markov_drafts():
    teacher = run_teacher("qwen3", 0.3)
    drafter = _drafter(teacher, block_size=4, markov_head_type="gated")
    result = speculative_generate(teacher, drafter, [3, 3, 7], SpecConfig(max_new_tokens=16, temperature=0.8, seed=3))
    assert len(result.tokens) == 16 and all(len(d) == 4 for d in result.draft_tokens)


def test_export_round_trip_loads_the_heads(tmp_path):
    from dflash_train.training.export import export_drafter

    teacher = run_teacher("qwen3", 0.1)
    drafter = _drafter(teacher, markov_head_type="gated", sample_from_anchor=False, confidence_target="greedy")
    assert drafter.cfg.num_draft_positions == 3
    export_drafter(drafter, tmp_path / "exp", dtype=torch.float32)
    loaded = load_drafter(tmp_path / "exp", teacher.get_input_embeddings().weight,
                          teacher.get_output_embeddings().weight, dtype=torch.float32)
    assert loaded.cfg == drafter.cfg
    state = drafter.state_dict()
    assert all(torch.equal(state[n], t) for n, t in loaded.state_dict().items())


def _export_for(teacher_folder: str, out, dspark: DSparkConfig | None, acceptance: float = 0.6):
    """An export for a teacher folder; a confidence head that predicts `acceptance` everywhere."""
    from transformers import AutoModelForCausalLM

    from dflash_train.training.export import export_drafter

    teacher = AutoModelForCausalLM.from_pretrained(teacher_folder)
    cfg = DrafterConfig.from_teacher(teacher.config.to_dict(), (0, 2), teacher.config.vocab_size - 1, block_size=4,
                                     num_hidden_layers=1, dspark=dspark)
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg, teacher.get_input_embeddings().weight, teacher.get_output_embeddings().weight)
    if drafter.confidence_head is not None:
        with torch.no_grad():
            drafter.confidence_head.proj.weight.zero_()
            drafter.confidence_head.proj.bias.fill_(torch.logit(torch.tensor(acceptance)).item())
    return export_drafter(drafter, out, dtype=torch.float32)


def test_confidence_threshold_option_of_eval_and_generate(tmp_path, teacher_dir):
    """--confidence-threshold reaches the built-in decoder: at 0.3 a head predicting 0.6 everywhere
    stops every block after 2 drafts (0.6, 0.36, then 0.216 < 0.3), the output still equals the
    teacher's, and the report counts the teacher forwards; a drafter without a confidence head
    refuses the option in one line."""
    from helpers import write_jsonl

    teacher = teacher_dir("qwen3")
    dspark = _export_for(teacher, tmp_path / "dspark", DSparkConfig(markov_rank=8))
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "hello there"}, {"prompt": "what is a cat"}])
    runner = CliRunner()
    base = ["eval", "--checkpoint", str(dspark), "--teacher", teacher, "--prompts", str(tmp_path / "prompts.jsonl"),
            "--max-new-tokens", "12", "--quiet"]
    reports = {}
    for threshold in ("0", "0.3"):
        out = tmp_path / f"eval-{threshold}.json"
        result = runner.invoke(app, base + ["--confidence-threshold", threshold, "--out", str(out)])
        assert result.exit_code == 0, result.output
        reports[threshold] = json.loads(out.read_text())["decoding"]
    off, on = reports["0"], reports["0.3"]
    assert (off["confidence_threshold"], on["confidence_threshold"]) == (0.0, 0.3)
    assert off["drafts_per_forward"] == 4.0 and on["drafts_per_forward"] == 2.0
    for report in (off, on):
        assert report["matched_teacher"] is True
        new_tokens = sum(row["new_tokens"] for row in report["per_prompt"])
        assert report["teacher_alone_forwards"] == new_tokens - len(report["per_prompt"])
        assert report["teacher_forwards_saved"] == report["teacher_alone_forwards"] - report["teacher_forwards"]
    assert "teacher forwards saved" in result.output and "drafts verified per forward (confidence >= 0.3)" in result.output

    generated = runner.invoke(app, ["generate", "--checkpoint", str(dspark), "--teacher", teacher, "--prompt", "hello",
                                    "--max-new-tokens", "10", "--confidence-threshold", "0.3"])
    assert generated.exit_code == 0, generated.output
    assert "2.00 drafts verified per forward" in generated.output

    dflash = _export_for(teacher, tmp_path / "dflash", None)
    no_head = _export_for(teacher, tmp_path / "no-head", DSparkConfig(markov_rank=8, enable_confidence_head=False))
    for folder, named in ((dflash, "a DFlash drafter"), (no_head, "enable_confidence_head off")):
        for command in (["eval", "--checkpoint", str(folder), "--prompts", str(tmp_path / "prompts.jsonl")],
                        ["generate", "--checkpoint", str(folder), "--prompt", "hello"]):
            refused = runner.invoke(app, command + ["--teacher", teacher, "--confidence-threshold", "0.3"])
            lines = refused.output.strip().splitlines()
            assert refused.exit_code == 1 and len(lines) == 1, refused.output
            assert "needs a confidence head" in lines[0] and named in lines[0] and "0.3" in lines[0]
            # checked from the drafter alone, before minutes of loading a teacher: one that does not exist is never reached
            early = runner.invoke(app, command + ["--teacher", str(tmp_path / "no-teacher"), "--confidence-threshold", "0.3"])
            assert early.exit_code == 1 and "needs a confidence head" in early.output, early.output
    offline = runner.invoke(app, ["eval", "--checkpoint", str(dspark), "--cache", "unused", "--confidence-threshold", "0.3"])
    assert offline.exit_code == 1 and "built-in decoder" in offline.output


def test_serve_commands_name_no_sglang_command_for_dspark():
    """SGLang's DSPARK reads DeepSpec's layout, not our vLLM-layout export: no command is claimed,
    and the line says why; the DFlash export keeps its SGLang command."""
    import dataclasses

    from dflash_train.measuring.serving import serve_commands

    cfg = _drafter(run_teacher("qwen3", 0.1)).cfg
    dspark = serve_commands("exp", cfg)
    assert dspark["sglang"].startswith("not available") and "Qwen3DSparkModel" in dspark["sglang"]
    assert '"method": "dspark"' in dspark["vllm"]
    dflash = serve_commands("exp", dataclasses.replace(cfg, dspark=None))
    assert "--speculative-algorithm DFLASH" in dflash["sglang"]


def test_offline_replay_counts_a_whole_accepted_dspark_block():
    """`eval --teacher --prompts` of a DSpark drafter crashed (IndexError in the histogram) when a
    block was accepted whole: a DSpark block drafts block_size tokens, the replay's histogram held
    block_size + 1 rounds lengths (0..block_size). Here the teacher's top-1 is made the drafter's own
    guess at every anchor the replay visits, so every round accepts all P drafts."""
    import numpy as np

    from dflash_cache.reader import SequenceRecord
    from dflash_train.measuring.decode_report import replay_record
    from dflash_train.training.heldout import argmax_chunks

    teacher = run_teacher("qwen3", 0.1)
    drafter = _drafter(teacher)
    p = drafter.cfg.num_draft_positions
    assert p == drafter.cfg.block_size == 4
    torch.manual_seed(3)
    length, start = 24, 2
    hidden = torch.randn(1, length, len(LAYER_IDS), 64)
    ids = torch.randint(0, RUN_VOCAB - 1, (1, length))
    topk = torch.zeros(length, 1, dtype=torch.long)
    anchor = start
    with torch.no_grad():
        while anchor < length - 1:
            states, features, _ = drafter(hidden, ids, torch.tensor([[anchor]]), heads=True)
            guesses = argmax_chunks(drafter, states, features)[0]
            stop = min(anchor + p, length - 1)
            topk[anchor:stop, 0] = guesses[:stop - anchor]
            anchor += p + 1
    mask = np.zeros(length, np.uint8)
    mask[start:] = 1
    record = SequenceRecord(id="s", input_ids=ids[0].numpy().astype(np.int32), loss_mask=mask,
                            hidden=hidden[0].numpy(), topk_ids=topk.numpy().astype(np.int32),
                            topk_logprobs=np.zeros((length, 1), np.float32))
    produced, rounds = replay_record(drafter, record, torch.device("cpu"))
    # 22 tokens to produce after the first: four whole rounds of 4 drafts + 1, then the last 2
    assert (produced, rounds) == (length - 1 - start, 5)
