"""Packed batches (data.layout = packed, issue 27): the sequences of a batch end to end in one
row give the padded batch's loss, gradients, noise, evaluation and exact resume."""

from __future__ import annotations

import shutil

import numpy as np
import pytest
import safetensors.torch
import torch
from typer.testing import CliRunner

from cli.train import app
from dflash_cache import open_cache
from dflash_cache.reader import SequenceRecord
from dflash_common.errors import ConfigError
from dflash_train.measuring.replay import greedy_replay
from dflash_train.settings.data_config import PACKED, PADDED, DataConfig
from dflash_train.settings.dflash2_config import DFlash2Config
from dflash_train.settings.drafter_config import FULL_ATTENTION, SLIDING_ATTENTION, DrafterConfig
from dflash_train.settings.dspark_config import DSparkConfig
from dflash_train.settings.loss_config import LOSS_KINDS, WEIGHTINGS, LossConfig
from dflash_train.settings.noise_config import NoiseConfig
from dflash_train.settings.train_config import TrainConfig
from dflash_train.training.batch import collate, hidden_buffer, load_batch
from dflash_train.training.batch_objective import block_targets
from dflash_train.training.data import LoaderState, train_loader
from dflash_train.training.distributed import DistInfo
from dflash_train.training.epoch_plan import EpochPlan
from dflash_train.training.heldout import evaluate_heldout
from dflash_train.training.layout import padding_fraction, sequence_starts, slots, token_positions
from dflash_train.training.model import DFlashDrafter
from dflash_train.training.train_step import micro_step, on_device

VOCAB, HIDDEN, K, LAYERS = 61, 32, 5, 2
LENGTHS = (23, 9, 31, 14, 27)


# --- the layout's index arithmetic -----------------------------------------------------------------


def test_layout_index_arithmetic_hand_values():
    lengths = torch.tensor([3, 1, 2])
    assert slots([3, 1, 2], PADDED) == ((3, 3), [(0, 0), (1, 0), (2, 0)])
    assert slots([3, 1, 2], PACKED) == ((1, 6), [(0, 0), (0, 3), (0, 4)])
    assert sequence_starts(lengths, PADDED, 3).tolist() == [0, 3, 6]
    assert sequence_starts(lengths, PACKED, 6).tolist() == [0, 3, 4]
    assert token_positions(lengths).tolist() == [0, 1, 2, 0, 0, 1]
    assert padding_fraction([[3, 1, 2], [4]]) == pytest.approx(1 - 10 / 13)
    assert padding_fraction([[5]]) == 0.0


def test_layout_is_validated_where_configured():
    with pytest.raises(ConfigError, match="--batch-layout 'ragged' is unknown; use one of packed, padded"):
        DataConfig(layout="ragged")


# --- one batch in both layouts -----------------------------------------------------------------------


def records(lengths=LENGTHS, seed=1) -> tuple[list[SequenceRecord], list[np.ndarray], list[np.ndarray]]:
    """Sequences of uneven lengths, loss masks and anchor counts (one with none): records, their
    hidden states and anchors."""
    gen = torch.Generator().manual_seed(seed)
    out, hiddens, anchors = [], [], []
    for i, t in enumerate(lengths):
        logprobs, ids = (torch.randn(t, VOCAB, generator=gen) * 2).log_softmax(-1).topk(K, dim=-1)
        mask = (torch.rand(t, generator=gen) < 0.8).numpy().astype(np.uint8)
        out.append(SequenceRecord(id=f"s{i}", input_ids=torch.randint(0, VOCAB - 1, (t,), generator=gen).numpy(),
                                  loss_mask=mask, hidden=np.empty(0), topk_ids=ids.numpy(),
                                  topk_logprobs=logprobs.numpy()))
        hiddens.append(torch.randn(t, LAYERS, HIDDEN, generator=gen).numpy())
        count = 0 if i == 1 else 3 + i % 2
        anchors.append(np.sort(torch.randperm(t - 2, generator=gen)[:count].numpy()).astype(np.int64))
    return out, hiddens, anchors


def both_layouts(**kw):
    recs, hiddens, anchors = records(**kw)
    return collate(recs, anchors, hiddens, PADDED), collate(recs, anchors, hiddens, PACKED)


def test_collate_packs_every_sequence_end_to_end_with_the_same_targets():
    padded, packed = both_layouts()
    total = sum(LENGTHS)
    assert packed.hidden.shape == (1, total, LAYERS, HIDDEN) and packed.input_ids.shape == (1, total)
    assert padded.hidden.shape == (len(LENGTHS), max(LENGTHS), LAYERS, HIDDEN)
    assert torch.equal(packed.anchors, padded.anchors) and torch.equal(packed.lengths, padded.lengths)
    for name in ("hidden", "input_ids", "loss_mask", "topk_ids", "topk_logprobs"):
        for i in range(len(LENGTHS)):
            assert torch.equal(packed.sequence(name, i), padded.sequence(name, i)), (name, i)
    for a, b in zip(block_targets(padded, 4).values(), block_targets(packed, 4).values()):
        assert torch.equal(a, b)


def drafter(kind: str, seed=0) -> DFlashDrafter:
    sliding = kind == "sliding"
    dspark = {"dspark-rnn": DSparkConfig(markov_rank=8, markov_head_type="rnn"),
              "dspark-gated": DSparkConfig(markov_rank=8, markov_head_type="gated", sample_from_anchor=False,
                                           confidence_target="greedy"),
              "dspark-vanilla": DSparkConfig(markov_rank=8, confidence_head_with_markov=False)}.get(kind)
    cfg = DrafterConfig(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                        intermediate_size=48, vocab_size=VOCAB, mask_token_id=VOCAB - 1, target_layer_ids=(0, 2),
                        num_target_layers=3, num_hidden_layers=2, block_size=4, max_position_embeddings=128,
                        layer_types=(SLIDING_ATTENTION, FULL_ATTENTION) if sliding else None,
                        sliding_window=5 if sliding else None, dspark=dspark, causal=kind == "causal",
                        dflash2=DFlash2Config(conv_group_size=4, selector_rank=8, selector_top_k=4)
                        if kind == "dflash2" else None)
    gen = torch.Generator().manual_seed(seed)
    embed, head = torch.randn(VOCAB, HIDDEN, generator=gen), torch.randn(VOCAB, HIDDEN, generator=gen) * 0.3
    torch.manual_seed(seed)
    return DFlashDrafter.build(cfg, embed, head, "cpu")


LOSSES = [LossConfig(kind=k, weighting=w) for k in LOSS_KINDS for w in WEIGHTINGS] + [
    LossConfig(terms={"ce": 0.1, "tv": 0.9}, weighting="dpace"), LossConfig(weighting="streak", streak_decay=True),
    LossConfig(terms={"kl": 1.0, "chain": 0.5, "ce": 0.1}, temperature=2.0, weighting="first_error")]


def step(model, batch, loss: LossConfig) -> tuple[torch.Tensor, dict]:
    """The trainer's micro-step (forward, loss, backward) on one batch: the loss and the gradients."""
    model.zero_grad(set_to_none=True)
    out = micro_step(model, model, batch, TrainConfig(cache="", out="", loss=loss), DistInfo(), torch.device("cpu"),
                     torch.autocast("cpu", enabled=False))
    return out.loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


# the DSpark heads and DFlash2 run in make test-slow (~20 s each): make test stays under its 10 minutes
@pytest.mark.parametrize("kind", ["dflash", "sliding", "causal", *(pytest.param(f"dspark-{head}", marks=pytest.mark.slow)
                                                         for head in ("rnn", "gated", "vanilla")),
                                  pytest.param("dflash2", marks=pytest.mark.slow)])
def test_packed_loss_and_gradients_equal_padded(kind):
    """For every loss kind and weighting (and a sum of terms): float32 loss and every parameter's
    gradient of one packed batch equal the padded batch's."""
    model = drafter(kind)
    padded, packed = both_layouts()
    for loss in LOSSES:
        label = f"{kind} {loss.kind}/{loss.weighting}/{loss.terms}"
        (loss_a, grads_a), (loss_b, grads_b) = step(model, padded, loss), step(model, packed, loss)
        assert loss_a > 0, label
        torch.testing.assert_close(loss_b, loss_a, rtol=1e-5, atol=1e-6, msg=lambda m: f"{label}: {m}")
        assert grads_a.keys() == grads_b.keys(), label
        for name in grads_a:
            torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"{label} {name}: {m}")


def test_a_block_sees_only_its_own_sequence():
    """Changing another sequence's tokens and features leaves a packed sequence's block states as
    they were: no block attends across the end of its sequence."""
    model = drafter("dflash").eval()
    _, packed = both_layouts()
    changed = packed.hidden.clone()
    changed[0, : LENGTHS[0]] += 5.0  # all of sequence 0
    with torch.no_grad():
        before = model(packed.hidden, packed.input_ids, packed.anchors, packed_lengths=packed.lengths)
        after = model(changed, packed.input_ids, packed.anchors, packed_lengths=packed.lengths)
    assert not torch.allclose(before[0], after[0])
    torch.testing.assert_close(after[1:], before[1:], rtol=0, atol=0)


def test_packed_forward_refuses_inconsistent_shapes():
    model = drafter("dflash")
    _, packed = both_layouts()
    with pytest.raises(ConfigError, match="a packed batch is one row of all its sequences' tokens"):
        model(packed.hidden, packed.input_ids, packed.anchors, packed_lengths=packed.lengths + 1)


def test_noise_is_the_same_per_token_in_both_layouts():
    padded, packed = both_layouts()
    cfg = TrainConfig(cache="", out="", noise=NoiseConfig(schedule="constant", start=0.5))
    a, b = on_device(padded, torch.device("cpu"), cfg, 7, 10), on_device(packed, torch.device("cpu"), cfg, 7, 10)
    recs, hiddens, anchors = records()
    clean = collate(recs, anchors, hiddens, PADDED)  # on_device noises a CPU batch in place: a fresh copy
    for i in range(len(LENGTHS)):
        assert not torch.equal(a.sequence("hidden", i), clean.sequence("hidden", i).float())
        assert torch.equal(b.sequence("hidden", i), a.sequence("hidden", i)), i


# --- the loader, evaluation and a whole run -------------------------------------------------------------


def test_loader_reads_straight_into_the_packed_batch(cache_url):
    cache = open_cache(cache_url)
    cfg = DataConfig(batch_tokens=600, anchors="random", num_anchors=4, heldout_fraction=0.0, layout=PACKED)
    refs = EpochPlan(cache, cfg).batches(0)[0]
    lengths = [int(cache.shards[s].lengths[i]) for s, i in refs]
    buffer, views = hidden_buffer(cache, lengths, PACKED)
    assert buffer.shape[:2] == (1, sum(lengths)) and all(np.shares_memory(buffer, v) for v in views)
    from dflash_train.training.batch import make_batch

    batch = make_batch([cache.shards[s].read(i, v) for (s, i), v in zip(refs, views)], cfg, 0, buffer)
    assert batch.hidden.data_ptr() == buffer.ctypes.data  # the tensor is the buffer read into
    padded = load_batch(cache, DataConfig(**{**cfg.__dict__, "layout": PADDED}), refs, epoch=0)
    for i in range(len(refs)):
        for name in ("hidden", "input_ids", "loss_mask", "topk_ids", "topk_logprobs"):
            assert torch.equal(batch.sequence(name, i), padded.sequence(name, i)), (name, i)


def test_train_stream_packed_holds_the_padded_stream(cache_url):
    streams = {}
    for layout in (PADDED, PACKED):
        cfg = DataConfig(batch_tokens=500, anchors="random", num_anchors=4, heldout_fraction=0.05, layout=layout)
        loader = iter(train_loader(cache_url, None, cfg, LoaderState(manifest_fingerprint=open_cache(cache_url).fingerprint)))
        streams[layout] = [next(loader) for _ in range(3)]
    for a, b in zip(streams[PADDED], streams[PACKED]):
        assert b.layout == PACKED and b.hidden.shape[0] == 1 and a.ids == b.ids and a.state_after == b.state_after
        assert torch.equal(a.anchors, b.anchors)
        for i in range(len(a.ids)):
            assert torch.equal(a.sequence("hidden", i), b.sequence("hidden", i))


def test_offline_evaluation_is_the_same_in_both_layouts(cache_url):
    cache = open_cache(cache_url)
    head = cache.load_teacher_head()
    cfg = DrafterConfig.from_teacher(cache.teacher_config(), tuple(cache.layer_ids), 0, block_size=4,
                                     num_hidden_layers=1, sliding_window=6, sliding_layers=(0,))
    torch.manual_seed(0)
    model = DFlashDrafter.build(cfg, head["embed_tokens.weight"].float(), head["lm_head.weight"].float(), "cpu")
    results = {}
    for layout in (PADDED, PACKED):
        data = DataConfig(batch_tokens=500, anchors="random", num_anchors=4, heldout_fraction=0.2, layout=layout)
        results[layout] = (evaluate_heldout(model, cache, data, LossConfig(), 20, torch.device("cpu")),
                           greedy_replay(model, cache, data, 20, torch.device("cpu")))
    (summary_a, replay_a), (summary_b, replay_b) = results[PADDED], results[PACKED]
    assert summary_a["positions"] == summary_b["positions"] > 0
    assert summary_b["loss"] == pytest.approx(summary_a["loss"], rel=1e-5)
    assert summary_b["alpha"] == pytest.approx(summary_a["alpha"], abs=1e-5)
    assert summary_b["greedy_streak"] == summary_a["greedy_streak"] and replay_a == replay_b


def _params(run, step: int) -> dict:
    return safetensors.torch.load_file(str(run / "checkpoints" / f"step-{step:06d}" / "model.safetensors"))


def test_a_packed_run_resumes_bit_exactly_and_tracks_the_padded_run(tmp_path, cache_url):
    args = ["run", "--cache", cache_url, "--steps", "4", "--num-layers", "1", "--block-size", "4", "--batch-tokens", "400",
            "--heldout-fraction", "0.05", "--save-every", "2", "--eval-sequences", "0",
            "--noise", "cosine", "--noise-start", "0.3", "--quiet"]
    runner = CliRunner()
    for layout in (PACKED, PADDED):
        result = runner.invoke(app, [*args, "--batch-layout", layout, "--out", str(tmp_path / layout)])
        assert result.exit_code == 0, result.output
    cut = tmp_path / "cut"
    shutil.copytree(tmp_path / PACKED, cut)
    shutil.rmtree(cut / "checkpoints" / "step-000004")
    resumed = runner.invoke(app, [*args, "--batch-layout", PACKED, "--out", str(cut), "--resume"])
    assert resumed.exit_code == 0, resumed.output
    straight, again, padded = _params(tmp_path / PACKED, 4), _params(cut, 4), _params(tmp_path / PADDED, 4)
    assert straight.keys() == again.keys() and all(torch.equal(straight[k], again[k]) for k in straight)
    # the same batches, noise and anchors: four AdamW steps apart only by float rounding
    for name in straight:
        torch.testing.assert_close(straight[name], padded[name], rtol=1e-3, atol=1e-5)
    # an operational setting, like the attention backend: a resume may switch it
    other = runner.invoke(app, [*args, "--batch-layout", PADDED, "--out", str(cut), "--resume", "--steps", "6"])
    assert other.exit_code == 0, other.output
    assert set(_params(cut, 6)) == set(straight)
