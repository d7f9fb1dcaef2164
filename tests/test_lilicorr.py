"""LiLiCorr (model.kind = lilicorr, with and without DFlash2's convolutions): the correlator's start,
its teacher-forced training lattice and objective, training with exact resume, export, lossless
decoding with vLLM's walk over the correlator's scores."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
import safetensors.torch
import torch
from helpers import train_and_resume
from test_speculative import (
    LAYER_IDS,
    RUN_MASK,
    SAMPLE_PROMPT,
    SAMPLE_VOCAB,
    chi_square_pvalue,
    exact_outcome_probs,
    one_thread,  # noqa: F401 (the fixture: one thread for tiny models)
    run_teacher,
    sampling_teacher,
)
from typer.testing import CliRunner

from cli.train import app
from dflash_common.errors import ConfigError
from dflash_train.measuring.serving import serve_commands
from dflash_train.measuring.speculative import speculative_generate, teacher_generate
from dflash_train.settings.dflash2_config import DFlash2Config
from dflash_train.settings.drafter_config import DrafterConfig
from dflash_train.settings.lilicorr_config import LiLiCorrConfig
from dflash_train.settings.spec_config import SpecConfig
from dflash_train.training.dflash2 import candidate_teacher_probs, walk_terms
from dflash_train.training.export import export_drafter, load_drafter, read_export_config
from dflash_train.training.lilicorr import candidate_features, path_rows
from dflash_train.training.model import DFlashDrafter

SMALL = dict(candidate_topk=4, hidden_size=32, num_heads=2, factor_dim=16)


def _drafter(teacher, block_size: int = 5, num_layers: int = 1, conv: bool = False, **lattice) -> DFlashDrafter:
    cfg = DrafterConfig.from_teacher(teacher.config.to_dict(), LAYER_IDS, RUN_MASK, block_size=block_size,
                                     num_hidden_layers=num_layers, lilicorr=LiLiCorrConfig(**{**SMALL, **lattice}, conv=conv),
                                     dflash2=DFlash2Config(conv_group_size=8) if conv else None)
    torch.manual_seed(0)
    return DFlashDrafter(cfg, teacher.get_input_embeddings().weight, teacher.get_output_embeddings().weight).eval()


def _stir(drafter: DFlashDrafter, scale: float = 0.5) -> None:
    """Every correlator (and convolution) weight well away from its start, as training leaves them."""
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if name.startswith("lilicorr.") or "conv" in name:
                param.add_(scale * torch.randn(param.shape, generator=gen))


@pytest.mark.parametrize("overrides", [
    dict(candidate_topk=6), dict(candidate_topk=32), dict(candidate_topk=0), dict(num_layers=0), dict(num_heads=2.5),
    dict(hidden_size=-1), dict(mlp_ratio=0.0), dict(logit_scale=float("inf")), dict(loss_alpha=-1.0),
    dict(conv="yes"), dict(target="sampled"), dict(factor_dim=10**6),
])
def test_lilicorr_config_refuses_bad_values(overrides):
    with pytest.raises(ConfigError, match=r"lilicorr\.") as err:
        LiLiCorrConfig(**overrides)
    assert "\n" not in str(err.value)


def test_drafter_config_refuses_a_correlator_that_does_not_fit():
    teacher = run_teacher("qwen3", 0.1)
    with pytest.raises(ConfigError, match="does not divide the correlator's width 32"):
        _drafter(teacher, num_heads=3)
    small = sampling_teacher()  # fewer than 16 tokens
    with pytest.raises(ConfigError, match="candidate_topk 16 exceeds the vocabulary's"):
        DrafterConfig.from_teacher(small.config.to_dict(), (0,), SAMPLE_VOCAB - 1, block_size=3, num_hidden_layers=1,
                                   lilicorr=LiLiCorrConfig(**{**SMALL, "candidate_topk": 16}))


def test_a_fresh_correlator_walks_the_backbones_top1_path():
    """The start: whatever the states and the anchor, every slot's best-scored candidate after
    any predecessor is the backbone's top-1, by a wide margin."""
    drafter = _drafter(run_teacher("qwen3", 0.1), block_size=6)
    torch.manual_seed(3)
    candidates, scores = drafter.walk(torch.randn(8, 5, 64), torch.randn(8, 64))
    assert scores.shape == (8, 5, 4, 4) and candidates.shape == (8, 5, 4)
    assert (scores.argmax(-1) == 0).all()
    assert (scores[..., 0] - scores[..., 1:].max(-1).values).min() > 5.0
    assert torch.equal(scores[:, 0, 0], scores[:, 0, 3])  # the anchor's row repeats for every predecessor


def test_training_sees_the_decoding_blocks_slots_anchor_and_lattice():
    """The states the loss and the correlator train on are the ones decoding drafts from (slots
    1..P of the block, not 0..P-1), the anchor is the normed context feature before the block, and
    the training lattice's scores along a path the top-k holds are the walk's."""
    from dflash_train.training.lilicorr import path_rows

    teacher = run_teacher("qwen3", 0.1)
    drafter = _drafter(teacher, block_size=5)
    _stir(drafter)
    torch.manual_seed(2)
    hidden, ids = torch.randn(1, 12, len(LAYER_IDS), 64), torch.randint(0, RUN_MASK, (1, 12))
    a = 6
    with torch.no_grad():
        block = torch.cat((ids[0, a:a + 1], torch.full((4,), RUN_MASK)))
        decoding = drafter.draft_slots(drafter.forward_block(hidden[:, :a], block.unsqueeze(0)))
        anchor = drafter.context_features(hidden[:, a - 1:a])[0]
        walk_ids, scores = drafter.walk(decoding, anchor)
        # the sequence continues with each slot's second candidate: on the lattice, nothing put in
        ids[0, a + 1:a + 5] = walk_ids[0, :, 1]
        positions, rows, candidates = drafter(hidden, ids, torch.tensor([[a]]), heads=True)
    torch.testing.assert_close(positions, decoding)
    assert torch.equal(candidates, walk_ids)
    torch.testing.assert_close(rows, path_rows(scores, torch.ones(1, 4, dtype=torch.long)), atol=1e-5, rtol=1e-5)


def test_candidate_features_and_path_rows():
    features = candidate_features(torch.log(torch.tensor([[0.5, 0.3, 0.2]])))
    expected = [[math.log(0.5), 0.5, 0.0, 0.0, 1.0], [math.log(0.3), 0.3, math.log(0.6), 0.5, 0.0],
                [math.log(0.2), 0.2, math.log(0.4), 1.0, 0.0]]
    torch.testing.assert_close(features[0], torch.tensor(expected))
    scores = torch.arange(2 * 3 * 2 * 2, dtype=torch.float32).view(2, 3, 2, 2)
    path = torch.tensor([[1, 0, 1], [0, 1, 1]])
    rows = path_rows(scores, path)
    # slot 0: the anchor row (predecessor 0); slot s: the row of the path's candidate at s - 1
    assert torch.equal(rows[0], torch.stack([scores[0, 0, 0], scores[0, 1, 1], scores[0, 2, 0]]))
    assert torch.equal(rows[1], torch.stack([scores[1, 0, 0], scores[1, 1, 0], scores[1, 2, 1]]))


def test_the_teacher_target_is_the_teacher_renormalised_over_the_candidates():
    """Cached top-3 of a 10-token vocabulary: candidates in it get their probability, others the
    tail's even share; the "teacher" cross-entropy is minimal where softmax(scores) equals that."""
    topk_ids = torch.tensor([[4, 7, 1]])
    topk_logprobs = torch.log(torch.tensor([[0.6, 0.2, 0.1]]))
    candidates = torch.tensor([[7, 4, 9, 2]])
    probs = candidate_teacher_probs(candidates, topk_ids, topk_logprobs, 10)
    share = 0.1 / 7
    expected = torch.tensor([[0.2, 0.6, share, share]]) / (0.8 + 2 * share)
    torch.testing.assert_close(probs, expected)
    best = walk_terms(torch.log(expected), candidates, topk_ids, topk_logprobs, 10, "teacher")
    worse = walk_terms(torch.log(expected.flip(-1)), candidates, topk_ids, topk_logprobs, 10, "teacher")
    assert best[0, 0] < worse[0, 0]
    # top1: the cross-entropy of the teacher's top-1 (token 4, the second candidate); the walk's best is it
    top1 = walk_terms(torch.log(expected), candidates, topk_ids, topk_logprobs, 10, "top1")
    torch.testing.assert_close(top1[0, 0], -torch.log_softmax(torch.log(expected), -1)[0, 1])
    assert top1[1:, 0].tolist() == [1.0, 1.0, 1.0]  # recall, hit, the best is not the first candidate


TRAIN = ["--steps", "6", "--save-every", "3", "--num-layers", "1", "--block-size", "4", "--eval-sequences", "8",
         "--heldout-fraction", "0.1", "--batch-tokens", "600", "--log-every", "3", "--quiet", "--model-kind", "lilicorr",
         "--lilicorr-candidates", "4", "--lilicorr-hidden-size", "32", "--lilicorr-heads", "2",
         "--lilicorr-factor-dim", "16"]


@pytest.mark.parametrize("conv", [False, True], ids=["lilicorr", "lilicorr+conv"])
def test_lilicorr_trains_resumes_bit_exactly_and_exports(tmp_path, cache_url, conv):
    """A cache built for DFlash trains a LiLiCorr drafter unchanged; a resume from step 3 ends with
    the weights of the straight run; the export is what vLLM's LiLiCorrDraftModel loads."""
    train = TRAIN + (["--lilicorr-conv", "--conv-group-size", "8"] if conv else [])
    straight, result, a = train_and_resume(app, cache_url, tmp_path, train)
    runner = CliRunner()

    exported = safetensors.torch.load_file(str(straight / "drafter" / "model.safetensors"))
    assert {"lilicorr.slot_embedding", "lilicorr.layers.1.attn.in_proj_weight", "lilicorr.anchor_out_head.bias",
            "lilicorr.feature_mlp.down_proj.bias", "lilicorr.token_proj.weight"} <= set(exported)
    assert exported["lilicorr.slot_embedding"].shape == (1, 1, 3, 1, 32)
    assert ("layers.0.attention_conv.base_kernel" in exported) == conv
    assert not any(name.startswith("candidate_selector.") for name in exported)
    config = json.loads((straight / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["LiLiCorrDraftModel"]
    dflash = config["dflash_config"]
    assert (dflash["lilicorr_candidate_topk"], dflash["lilicorr_hidden_size"], dflash["lilicorr_num_heads"],
            dflash["lilicorr_num_layers"], dflash["lilicorr_factor_dim"]) == (4, 32, 2, 2, 16)
    assert ("conv_kernel_size" in dflash) == conv and "selector_top_k" not in dflash
    assert "lilicorr_loss_alpha" not in dflash and "lilicorr_target" not in dflash
    assert read_export_config(straight / "drafter").lilicorr == LiLiCorrConfig(**SMALL, conv=conv)
    assert "V2 model runner" in result.output and "SGLang: not available" in result.output

    # offline eval: the greedy replay walks the correlator's choices
    report = tmp_path / "eval.json"
    evaluated = runner.invoke(app, ["eval", "--checkpoint", str(straight / "drafter"), "--cache", cache_url,
                                    "--heldout-fraction", "0.1", "--out", str(report), "--quiet"])
    assert evaluated.exit_code == 0, evaluated.output
    replay = json.loads(report.read_text())["greedy_replay"]
    assert replay["rounds"] > 0 and sum(replay["accepted_histogram"]) == replay["rounds"]

    records = [json.loads(x) for x in (straight / "metrics.jsonl").read_text().splitlines()]
    train_log = [r for r in records if r["kind"] == "train"]
    assert len(train_log[-1]["alpha"]) == 3 and train_log[-1]["loss_selector"] > 0
    evaluation = [r for r in records if r["kind"] == "eval"][-1]
    assert all(0 <= h <= r <= 1 for h, r in zip(evaluation["selector"]["hit"], evaluation["selector"]["recall"]))


@pytest.mark.parametrize("conv", [False, True], ids=["lilicorr", "lilicorr+conv"])
def test_export_round_trip(tmp_path, conv):
    teacher = run_teacher("qwen3", 0.1)
    drafter = _drafter(teacher, conv=conv)
    _stir(drafter)
    export_drafter(drafter, tmp_path / "exp", dtype=torch.float32)
    loaded = load_drafter(tmp_path / "exp", teacher.get_input_embeddings().weight,
                          teacher.get_output_embeddings().weight, dtype=torch.float32)
    assert loaded.cfg == drafter.cfg
    state = drafter.state_dict()
    assert all(torch.equal(state[n], t) for n, t in loaded.state_dict().items())


def test_serve_commands_name_the_v2_runner_and_no_sglang():
    commands = serve_commands("exp", _drafter(run_teacher("qwen3", 0.1)).cfg)
    assert commands["vllm"].startswith("VLLM_USE_V2_MODEL_RUNNER=1 vllm serve") and '"num_speculative_tokens": 4' in commands["vllm"]
    assert commands["sglang"].startswith("not available")


@pytest.mark.parametrize("arch,conv", [("qwen3", False), ("qwen3_5", False), ("qwen3", True)])
def test_lilicorr_greedy_decoding_equals_the_teacher(arch, conv):
    teacher = run_teacher(arch, 0.3)
    drafter = _drafter(teacher, block_size=5, num_layers=2, conv=conv)
    _stir(drafter, scale=1.0)
    prompt = [3, 3, 7, 7, 7, 1]
    cfg = SpecConfig(max_new_tokens=30)
    result = speculative_generate(teacher, drafter, prompt, cfg)
    assert result.tokens == teacher_generate(teacher, prompt, cfg).tokens
    assert all(len(d) == 4 for d in result.draft_tokens)
    assert any(any(row) for row in result.selector_changed)  # the stirred correlator left the top-1 somewhere


@pytest.mark.slow  # 600 generations
def test_sampled_lilicorr_decoding_keeps_the_teacher_distribution():
    """T = 1 with 4 of 8 tokens as candidates: drafts come from softmax(scores) of the walk's row
    (zero elsewhere), and rejection sampling against that q leaves the teacher's distribution."""
    teacher = sampling_teacher()
    cfg = DrafterConfig.from_teacher(teacher.config.to_dict(), (0,), SAMPLE_VOCAB - 1, block_size=3,
                                     num_hidden_layers=1, lilicorr=LiLiCorrConfig(**SMALL))
    torch.manual_seed(1)
    drafter = DFlashDrafter(cfg, teacher.get_input_embeddings().weight, teacher.get_output_embeddings().weight).eval()
    _stir(drafter, scale=1.0)
    length, samples = 3, 600
    exact = exact_outcome_probs(teacher, length, 1.0, 1.0, ())
    counts: Counter = Counter()
    rounds: Counter = Counter()
    for seed in range(samples):
        result = speculative_generate(teacher, drafter, SAMPLE_PROMPT, SpecConfig(max_new_tokens=length, temperature=1.0,
                                                                                  seed=seed))
        counts[tuple(result.tokens)] += 1
        rounds.update(result.accepted_lengths)
    assert chi_square_pvalue(counts, exact, samples) > 1e-3, counts.most_common(8)
    assert len(rounds) > 1, rounds  # some drafts accepted, some rejected
