"""DFlash2 (model.kind = dflash2): convolutions, selector, loss, training with exact resume, export,
lossless decoding with the selector's candidate walk."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import safetensors.torch
import torch
from helpers import train_and_resume
from test_speculative import (
    LAYER_IDS,
    RUN_MASK,
    RUN_VOCAB,
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
from dflash_train.config import config_from_dict
from dflash_train.measuring.serving import serve_commands
from dflash_train.measuring.speculative import speculative_generate, teacher_generate
from dflash_train.settings.dflash2_config import DFlash2Config
from dflash_train.settings.drafter_config import DrafterConfig
from dflash_train.settings.dspark_config import DSparkConfig
from dflash_train.settings.loss_config import LossConfig
from dflash_train.settings.spec_config import SpecConfig
from dflash_train.sweep.grid import expand_grid, parse_grid, run_overrides
from dflash_train.training.dflash2 import grouped_conv, training_candidates, unary_scores
from dflash_train.training.export import export_drafter, load_drafter, read_export_config
from dflash_train.training.loss import DraftHeads, block_loss
from dflash_train.training.model import DFlashDrafter

SMALL = dict(conv_group_size=8, selector_rank=8, selector_top_k=4)


@pytest.mark.parametrize("overrides", [
    dict(conv_kernel_size=0), dict(conv_group_size=2.5), dict(selector_rank=-1), dict(selector_top_k=0),
    dict(selector_loss_alpha=-1.0), dict(input_embedding_scale=0.0), dict(output_multiplier=float("nan")),
    dict(final_logit_softcapping=-2.0),
])
def test_dflash2_config_refuses_bad_values(overrides):
    with pytest.raises(ConfigError, match="dflash2"):
        DFlash2Config(**overrides)


@pytest.mark.parametrize("dflash2,others,message", [
    (DFlash2Config(conv_group_size=7), {}, "does not divide hidden_size"),
    (DFlash2Config(conv_kernel_size=5), {}, "exceeds block_size"),
    (DFlash2Config(selector_top_k=RUN_VOCAB + 1), {}, "exceeds the vocabulary"),
    (DFlash2Config(), {"dspark": DSparkConfig()}, "not both"),
])
def test_drafter_config_refuses_a_dflash2_that_does_not_fit(dflash2, others, message):
    teacher = run_teacher("qwen3", 0.1)
    with pytest.raises(ConfigError, match=message):
        DrafterConfig.from_teacher(teacher.config.to_dict(), LAYER_IDS, RUN_MASK, block_size=4, num_hidden_layers=1,
                                   dflash2=dflash2, **others)


def _drafter(teacher, block_size=4, seed=0, num_layers=1, **dflash2) -> DFlashDrafter:
    cfg = DrafterConfig.from_teacher(teacher.config.to_dict(), LAYER_IDS, RUN_MASK, block_size=block_size,
                                     num_hidden_layers=num_layers, dflash2=DFlash2Config(**{**SMALL, **dflash2}))
    torch.manual_seed(seed)
    return DFlashDrafter(cfg, teacher.get_input_embeddings().weight, teacher.get_output_embeddings().weight).eval()


def _stir(drafter: DFlashDrafter, scale: float = 0.3, seed: int = 5) -> None:
    """Convolutions and selector away from their start, so they change what the drafter computes."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in drafter.named_parameters():
            if "conv" in name or "candidate_selector" in name:
                p.add_(scale * torch.randn(p.shape, generator=gen))


def test_grouped_conv_mixes_only_earlier_positions_of_the_same_block():
    torch.manual_seed(0)
    rows, hidden, groups, taps, block = 8, 6, 3, 3, 4
    x, delta, base = torch.randn(rows, hidden), torch.randn(rows, taps, groups), torch.randn(taps, hidden)
    out = grouped_conv(x, delta, base, block)
    expected = torch.zeros(rows, hidden)
    for row in range(rows):
        for tap in range(taps):
            if row % block >= tap:
                coefficient = base[tap] + delta[row, tap].repeat_interleave(hidden // groups)
                expected[row] += coefficient * x[row - tap]
    torch.testing.assert_close(out, expected)


def test_a_fresh_dflash2_drafter_computes_what_its_dflash_backbone_does():
    """The convolutions start as the identity (speculators' start): the block states equal those of a
    DFlash drafter holding the same backbone weights, until the convolutions move."""
    teacher = run_teacher("qwen3", 0.1)
    dflash2 = _drafter(teacher)
    plain = DFlashDrafter(DrafterConfig.from_teacher(teacher.config.to_dict(), LAYER_IDS, RUN_MASK, block_size=4,
                                                     num_hidden_layers=1),
                          teacher.get_input_embeddings().weight, teacher.get_output_embeddings().weight).eval()
    state = dflash2.state_dict()
    plain.load_state_dict({name: state[name] for name in plain.state_dict()})
    torch.manual_seed(1)
    hidden, ids, anchors = torch.randn(1, 12, len(LAYER_IDS), 64), torch.randint(0, RUN_VOCAB - 1, (1, 12)), torch.tensor([[3, 6]])
    with torch.no_grad():
        torch.testing.assert_close(dflash2(hidden, ids, anchors), plain(hidden, ids, anchors))
        _stir(dflash2)
        assert not torch.allclose(dflash2(hidden, ids, anchors), plain(hidden, ids, anchors))


def test_training_blocks_are_the_decoding_block_and_the_selector_context_is_teacher_forced():
    """forward's many-block pass gives each block the states forward_block gives it alone (the
    convolution stays inside its block), and the selector context of draft position j is that of
    x_{a+j-1} (the anchor for j = 1), what the decoder scores with."""
    teacher = run_teacher("qwen3", 0.1)
    drafter = _drafter(teacher, num_layers=2)
    _stir(drafter)
    torch.manual_seed(1)
    hidden, ids, anchors = torch.randn(1, 12, len(LAYER_IDS), 64), torch.randint(0, RUN_VOCAB - 1, (1, 12)), torch.tensor([[3, 6]])
    with torch.no_grad():
        states = drafter(hidden, ids, anchors)
        positions, context, confidence = drafter(hidden, ids, anchors, heads=True)
        assert confidence is None and torch.equal(positions, states[0, :, 1:])
        for block, a in enumerate(anchors[0].tolist()):
            block_ids = torch.cat((ids[0, a:a + 1], torch.full((3,), RUN_MASK)))
            alone = drafter.forward_block(hidden[:, :a], block_ids.unsqueeze(0))
            torch.testing.assert_close(states[0, block], alone[0], atol=1e-5, rtol=1e-4)
            for j in range(3):
                torch.testing.assert_close(context[block, j],
                                           drafter.candidate_selector.context(positions[block, j], ids[0, a + j]))


def test_training_candidates_put_a_missing_target_last():
    candidates = torch.tensor([[5, 2, 9], [1, 3, 4]])
    out, index, contains = training_candidates(candidates, torch.tensor([2, 7]))
    assert out.tolist() == [[5, 2, 9], [1, 3, 7]] and index.tolist() == [1, 2] and contains.tolist() == [True, False]


def test_unary_scores_scale_then_cap_as_vllm_does():
    logits = torch.tensor([1.0, -4.0, 30.0])
    cfg = DFlash2Config(output_multiplier=2.0, final_logit_softcapping=10.0)
    torch.testing.assert_close(unary_scores(logits, cfg), 10.0 * torch.tanh(2.0 * logits / 10.0))
    assert torch.equal(unary_scores(logits, DFlash2Config()), logits)


def test_loss_adds_the_weighted_selector_cross_entropy():
    """block_loss = the backbone's loss + selector_loss_alpha x the position-weighted K-way CE of the
    teacher's top-1 among the drafter's top-k (injected last where missing), by hand."""
    torch.manual_seed(0)
    m, p, h, v, r, k = 3, 4, 8, 20, 5, 6
    states, lm_head = torch.randn(m, p, h), torch.randn(v, h)
    context, successor = torch.randn(m, p, r), torch.randn(v, r)
    targets = torch.randint(0, v, (m, p))
    topk_ids = torch.stack([torch.randperm(v)[:k] for _ in range(m * p)]).view(m, p, k)
    topk_logprobs = torch.log_softmax(torch.randn(m, p, v), -1).gather(-1, topk_ids).sort(-1, descending=True).values
    valid = torch.ones(m, p, dtype=torch.bool)
    valid[0, 3] = False
    selector = DFlash2Config(selector_top_k=3, selector_loss_alpha=0.5, output_multiplier=1.5)
    cfg = LossConfig(weighting="none")
    plain = block_loss(states, lm_head, targets, topk_ids, topk_logprobs, valid, cfg, p + 1)
    out = block_loss(states, lm_head, targets, topk_ids, topk_logprobs, valid, cfg, p + 1,
                     DraftHeads(selector_context=context, successor_codebook=successor, selector=selector))
    logits = states @ lm_head.T
    ces, hits = [], 0
    for b, j in valid.nonzero().tolist():
        top = logits[b, j].topk(3).indices.tolist()
        target = int(topk_ids[b, j, 0])
        if target not in top:
            top[-1] = target
        scores = 1.5 * logits[b, j, top] + successor[top] @ context[b, j]
        ces.append(-torch.log_softmax(scores, -1)[top.index(target)])
        hits += int(scores.argmax()) == top.index(target) and target in logits[b, j].topk(3).indices.tolist()
    torch.testing.assert_close(out.loss, plain.loss + 0.5 * torch.stack(ces).mean(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out.selector_sums["loss_selector"].sum(), torch.stack(ces).sum(), atol=1e-4, rtol=1e-5)
    assert int(out.selector_sums["selector_hit"].sum()) == hits


def test_grid_sweeps_the_three_kinds():
    axes = parse_grid(["model.kind=dflash,dspark,dflash2"])
    kinds = [config_from_dict({"cache": "c", "out": "o", **run_overrides(axes, a)}).model.kind for a in expand_grid(axes)]
    assert kinds == ["dflash", "dspark", "dflash2"]


TRAIN = ["--steps", "6", "--save-every", "3", "--num-layers", "1", "--block-size", "4", "--eval-sequences", "8",
         "--heldout-fraction", "0.1", "--batch-tokens", "600", "--log-every", "3", "--quiet", "--model-kind", "dflash2",
         "--conv-group-size", "8", "--selector-rank", "8", "--selector-top-k", "4"]

VLLM_NAMES = ("attention_conv.base_kernel", "attention_conv.kernel_projection.weight", "mlp_conv.base_kernel",
              "mlp_conv.kernel_projection.weight")


def test_dflash2_trains_resumes_bit_exactly_and_exports(tmp_path, cache_url):
    """A cache built for DFlash trains a DFlash2 drafter unchanged; a resume from step 3 ends with the
    weights of the straight run; the export is what vLLM's DFlash2DraftModel loads."""
    straight, result, a = train_and_resume(app, cache_url, tmp_path, TRAIN)

    exported = safetensors.torch.load_file(str(straight / "drafter" / "model.safetensors"))
    assert {f"layers.0.{name}" for name in VLLM_NAMES} | {
        "candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook",
        "candidate_selector.hidden_projection.weight"} <= set(exported)
    assert exported["layers.0.attention_conv.base_kernel"].shape[:2] == (2, 2)
    config = json.loads((straight / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["model_type"] == "qwen3"
    dflash = config["dflash_config"]
    assert (dflash["conv_kernel_size"], dflash["conv_group_size"], dflash["selector_rank"],
            dflash["selector_top_k"]) == (2, 8, 8, 4)
    assert (dflash["input_embedding_scale"], dflash["output_multiplier"], dflash["final_logit_softcapping"]) == (1.0, 1.0, 0.0)
    assert "sample_from_anchor" not in dflash and "selector_loss_alpha" not in dflash
    assert read_export_config(straight / "drafter").dflash2 == DFlash2Config(**SMALL)
    spec = json.dumps({"method": "dflash", "model": str(straight / "drafter"), "num_speculative_tokens": 3})
    assert f"VLLM_USE_V2_MODEL_RUNNER=1 vllm serve TEACHER --speculative-config '{spec}'" in result.output
    assert "V2 model runner" in result.output

    # offline eval: the greedy replay walks the selector's choices (it once read them as Markov features)
    report = tmp_path / "eval.json"
    evaluated = CliRunner().invoke(app, ["eval", "--checkpoint", str(straight / "drafter"), "--cache", cache_url,
                                    "--heldout-fraction", "0.1", "--out", str(report), "--quiet"])
    assert evaluated.exit_code == 0, evaluated.output
    replay = json.loads(report.read_text())["greedy_replay"]
    assert replay["rounds"] > 0 and sum(replay["accepted_histogram"]) == replay["rounds"]

    records = [json.loads(x) for x in (straight / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    assert len(train[-1]["alpha"]) == 3 and train[-1]["loss_selector"] > 0
    evaluation = [r for r in records if r["kind"] == "eval"][-1]
    assert len(evaluation["selector"]["hit"]) == 3
    assert all(0 <= h <= r <= 1 for h, r in zip(evaluation["selector"]["hit"], evaluation["selector"]["recall"]))


def test_export_round_trip(tmp_path):
    teacher = run_teacher("qwen3", 0.1)
    drafter = _drafter(teacher, input_embedding_scale=2.0, final_logit_softcapping=20.0)
    _stir(drafter)
    export_drafter(drafter, tmp_path / "exp", dtype=torch.float32)
    loaded = load_drafter(tmp_path / "exp", teacher.get_input_embeddings().weight,
                          teacher.get_output_embeddings().weight, dtype=torch.float32)
    assert loaded.cfg == drafter.cfg
    state = drafter.state_dict()
    assert all(torch.equal(state[n], t) for n, t in loaded.state_dict().items())


def test_serve_commands_name_the_v2_runner():
    cfg = _drafter(run_teacher("qwen3", 0.1)).cfg
    commands = serve_commands("exp", cfg)
    assert commands["vllm"].startswith("VLLM_USE_V2_MODEL_RUNNER=1 vllm serve") and '"method": "dflash"' in commands["vllm"]
    assert "GPU" in commands["vllm"] and commands["sglang"].startswith("not checked")


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_dflash2_greedy_decoding_equals_the_teacher(arch):
    teacher = run_teacher(arch, 0.3)
    drafter = _drafter(teacher, block_size=5, num_layers=2)
    _stir(drafter, scale=1.0)
    prompt = [3, 3, 7, 7, 7, 1]
    cfg = SpecConfig(max_new_tokens=30)
    reference = teacher_generate(teacher, prompt, cfg).tokens
    result = speculative_generate(teacher, drafter, prompt, cfg)
    assert result.tokens == reference
    assert all(len(d) == 4 for d in result.draft_tokens)  # block_size - 1 drafts: DFlash's layout
    assert len(result.selector_changed) == len(result.draft_tokens)
    assert any(any(row) for row in result.selector_changed)  # the stirred selector left the top-1 somewhere


@pytest.mark.slow  # 600 generations
def test_sampled_dflash2_decoding_keeps_the_teacher_distribution():
    """T = 1 with 4 of 8 tokens as candidates: drafts come from softmax(scores) over the candidates
    (zero elsewhere), and rejection sampling against that q leaves the teacher's distribution."""
    teacher = sampling_teacher()
    cfg = DrafterConfig.from_teacher(teacher.config.to_dict(), (0,), SAMPLE_VOCAB - 1, block_size=3,
                                     num_hidden_layers=1, dflash2=DFlash2Config(conv_group_size=8, selector_rank=4,
                                                                                selector_top_k=4))
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


def test_selector_changes_count_accepted_drafts_by_round():
    from dflash_train.measuring.speculative import SpecResult, selector_changes

    # round 1: 3 drafts, 2 accepted (3 tokens); round 2: 3 drafts, none accepted
    result = SpecResult(tokens=[], accepted_lengths=[3, 1], draft_tokens=[[1, 2, 3], [4, 5, 6]],
                        selector_changed=[[True, False, True], [True, False, False]])
    assert selector_changes([result]) == {"changed": 0.5, "drafts": 6, "changed_accepted": 1 / 3,
                                          "kept_accepted": 1 / 3}
    assert selector_changes([SpecResult(tokens=[], accepted_lengths=[2], draft_tokens=[[1]])]) is None


def test_the_offline_greedy_choice_is_the_selectors():
    """argmax_chunks (held-out greedy streak, greedy replay) takes, for DFlash2, the selector's best
    among the top-k given the teacher-forced previous token, not the plain argmax."""
    from dflash_train.training.heldout import argmax_chunks

    teacher = run_teacher("qwen3", 0.1)
    drafter = _drafter(teacher)
    _stir(drafter, scale=3.0)
    torch.manual_seed(1)
    hidden, ids = torch.randn(1, 40, len(LAYER_IDS), 64), torch.randint(0, RUN_VOCAB - 1, (1, 40))
    anchors = torch.arange(2, 38, 4).view(1, -1)
    with torch.no_grad():
        positions, context, _ = drafter(hidden, ids, anchors, heads=True)
        chosen = argmax_chunks(drafter, positions, context, chunk=5)
        logits = drafter.logits(positions)
        top = logits.topk(4, dim=-1)
        by_hand = top.indices.gather(-1, drafter.candidate_selector.scores(context, top.indices, top.values)
                                     .argmax(-1, keepdim=True)).squeeze(-1)
    assert torch.equal(chosen, by_hand)
    assert not torch.equal(chosen, logits.argmax(-1))


def test_eval_reports_the_selectors_changes(tmp_path, teacher_dir):
    """eval's real decoding of a DFlash2 export: the output equals the teacher's, and the report and
    the printed table give the share of drafts where the selector left the drafter's top-1."""
    from helpers import write_jsonl
    from transformers import AutoModelForCausalLM

    teacher_folder = teacher_dir("qwen3")
    teacher = AutoModelForCausalLM.from_pretrained(teacher_folder)
    hidden = teacher.config.hidden_size
    cfg = DrafterConfig.from_teacher(teacher.config.to_dict(), (0, 2), teacher.config.vocab_size - 1, block_size=4,
                                     num_hidden_layers=1, dflash2=DFlash2Config(conv_group_size=hidden // 4,
                                                                                selector_rank=8, selector_top_k=4))
    torch.manual_seed(0)
    drafter = DFlashDrafter(cfg, teacher.get_input_embeddings().weight, teacher.get_output_embeddings().weight)
    _stir(drafter, scale=3.0)
    export_drafter(drafter, tmp_path / "exp", dtype=torch.float32)
    write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "hello there"}, {"prompt": "what is a cat"}])
    out = tmp_path / "eval.json"
    result = CliRunner().invoke(app, ["eval", "--checkpoint", str(tmp_path / "exp"), "--teacher", teacher_folder,
                                      "--prompts", str(tmp_path / "prompts.jsonl"), "--max-new-tokens", "12",
                                      "--out", str(out)])
    assert result.exit_code == 0, result.output
    decoding = json.loads(out.read_text())["decoding"]
    assert decoding["matched_teacher"] is True
    selector = decoding["selector"]
    assert selector["drafts"] == 3 * decoding["teacher_forwards"] and 0 < selector["changed"] <= 1
    assert "selector left the top-1" in result.output
