"""Anchors that cover a sequence (issue 59): every loss position trained once an epoch by default,
long sequences trained in parts whose attention is bounded by their own prefix, and a run of the
seed recipe (random anchors) still resuming as it was trained."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from helpers import english_like_sentences
from typer.testing import CliRunner

from cli.train import app
from dflash_cache import open_cache
from dflash_common.errors import ConfigError
from dflash_train.config import config_differences
from dflash_train.settings.data_config import DataConfig
from dflash_train.settings.drafter_config import DrafterConfig
from dflash_train.settings.train_config import TrainConfig
from dflash_train.training.batch import Batch, load_batch
from dflash_train.training.batch_objective import block_targets
from dflash_train.training.epoch_plan import EpochPlan, block_parts, cover_anchors, is_heldout
from dflash_train.training.model import DFlashDrafter


def _predicted(anchors: np.ndarray, positions: int) -> list[int]:
    return [int(a) + j for a in anchors for j in range(1, positions + 1)]


@pytest.mark.parametrize("positions", [1, 3, 7, 15])
def test_cover_predicts_every_loss_position_once(positions):
    rng = np.random.default_rng(positions)
    for trial in range(40):
        mask = np.zeros(int(rng.integers(2, 300)), dtype=bool)
        for _ in range(int(rng.integers(0, 4))):  # a few assistant turns, some touching position 0..2
            lo = int(rng.integers(0, len(mask)))
            mask[lo:lo + int(rng.integers(1, 120))] = True
        targets = set(np.flatnonzero(mask[2:]) + 2)
        for epoch in range(3):
            anchors = cover_anchors(mask, positions, 5, epoch, f"s{trial}")
            predicted = _predicted(anchors, positions)
            assert targets <= set(predicted), (trial, epoch)
            assert len(predicted) == len(set(predicted)), "blocks overlap"
            assert np.all(np.diff(anchors) > 0) and (len(anchors) == 0 or anchors[0] >= 1)
            assert np.all(anchors < len(mask) - 1)  # a block's first draft position lies in the sequence
            assert np.array_equal(anchors, cover_anchors(mask, positions, 5, epoch, f"s{trial}"))  # pure


def test_cover_moves_positions_across_block_slots_between_epochs():
    mask = np.zeros(400, dtype=bool)
    mask[20:380] = True
    firsts = {int(cover_anchors(mask, 15, 0, epoch, "x")[0]) for epoch in range(12)}
    assert len(firsts) > 3  # the tiling's phase changes from epoch to epoch
    assert len(cover_anchors(mask, 15, 0, 0, "x")) <= -(-359 // 15) + 1  # about one block per 15 positions


def test_block_parts_keep_each_forward_within_both_budgets():
    # one 32k-token sequence tiled by blocks of 16 (15 positions each)
    anchors = np.arange(1, 32_000, 15)[None]
    parts = block_parts(anchors, 16, 8192, 8192)
    assert parts[0][0] == 0 and parts[-1][1] == anchors.shape[1]
    assert all(a[1] == b[0] for a, b in zip(parts, parts[1:]))  # consecutive, nothing left out
    for c0, c1 in parts:
        queries = (c1 - c0) * 16
        assert queries <= 8192 and queries * (anchors[0, c1 - 1] + queries) <= 8192 * (8192 + 8192)
    # later parts see longer prefixes, so they hold fewer blocks
    sizes = [c1 - c0 for c0, c1 in parts]
    assert sizes[0] > sizes[-2] and len(parts) > 2
    # flex has no mask to bound: only the block tokens cut its parts
    flex = block_parts(anchors, 16, 8192, None)
    assert len(flex) == -(-anchors.shape[1] * 16 // 8192) < len(parts)
    # a batch within both budgets is one forward, as before
    short = np.array([[1, 9, 17, -1], [2, 10, -1, -1]])
    assert block_parts(short, 8, 8192, 8192) == [(0, 4)]
    assert block_parts(np.full((2, 3), -1), 8, 64, 64) == [(0, 3)]


def _tiny_drafter(block_size=8) -> DFlashDrafter:
    cfg = DrafterConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
                        vocab_size=50, mask_token_id=49, target_layer_ids=(0, 1), num_target_layers=3,
                        num_hidden_layers=2, block_size=block_size, layer_types=("sliding_attention", "full_attention"),
                        sliding_window=12)
    torch.manual_seed(0)
    return DFlashDrafter(cfg, torch.randn(50, 32), torch.randn(50, 32))


@pytest.mark.parametrize("packed", [False, True])
def test_parts_with_trimmed_context_equal_one_forward(packed):
    """A long sequence's blocks in parts, each attending only to the context before its last
    anchor, give the states of one forward over every block and all the context."""
    model = _tiny_drafter()
    lengths = [300, 41] if packed else [300]
    torch.manual_seed(1)
    mask = [np.ones(t, dtype=bool) for t in lengths]
    rows = [cover_anchors(m, 7, 0, 0, f"s{i}") for i, m in enumerate(mask)]
    anchors = torch.full((len(rows), max(map(len, rows))), -1, dtype=torch.long)
    for i, r in enumerate(rows):
        anchors[i, :len(r)] = torch.from_numpy(r)
    if packed:
        hidden, ids = torch.randn(1, sum(lengths), 2, 32), torch.randint(0, 49, (1, sum(lengths)))
        kwargs = {"packed_lengths": torch.tensor(lengths)}
    else:
        hidden, ids = torch.randn(1, 300, 2, 32), torch.randint(0, 49, (1, 300))
        kwargs = {}
    whole = model(hidden, ids, anchors, **kwargs)
    parts = block_parts(anchors.numpy(), 8, 64, 200)
    assert len(parts) > 3
    pieces = torch.cat([model(hidden, ids, anchors[:, c0:c1], **kwargs) for c0, c1 in parts], dim=1)
    used = anchors >= 0
    torch.testing.assert_close(pieces[used], whole[used], atol=2e-5, rtol=2e-5)


def _long_rows(n: int, sentences: int) -> list[dict]:
    text = english_like_sentences(n * (sentences + 1), seed=59)
    return [{"id": f"long-{i:02d}", "messages": [
        {"role": "user", "content": text[i * (sentences + 1)]},
        {"role": "assistant", "content": " ".join(text[i * (sentences + 1) + 1:(i + 1) * (sentences + 1)])}]}
        for i in range(n)]


def test_one_default_epoch_trains_every_masked_position_of_long_answers(tmp_path, tiny_cache):
    """The done-when of issue 59: with default settings one epoch over a long-answer cache trains
    at least 90% of its training split's loss positions (metrics.jsonl's positions against the
    cache's masked tokens); with the seed recipe's 8 random anchors far fewer. A small
    --block-tokens makes the long sequences train in several parts: the same positions."""
    url = tiny_cache(rows=_long_rows(16, 45), shard_bytes=200_000)
    cache = open_cache(url)
    data = DataConfig(batch_tokens=1200, heldout_fraction=0.1)
    plan = EpochPlan(cache, data)
    lengths = plan.lengths[plan.rows]
    assert lengths.min() > 300, lengths  # long answers, not the quickstart's
    masked = 0
    for s, i in plan.refs(np.arange(plan.num_sequences)):
        record = cache.shards[s].read(i)
        assert not is_heldout(record.id, 0.1)
        masked += int(record.loss_mask[2:].sum())

    def epoch_positions(out, *extra):
        args = ["run", "--cache", url, "--out", str(tmp_path / out), "--epochs", "1", "--num-layers", "1",
                "--block-size", "8", "--batch-tokens", "1200", "--heldout-fraction", "0.1", "--log-every", "1",
                "--eval-sequences", "0", "--quiet", *extra]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output[-2000:]
        lines = [json.loads(x) for x in (tmp_path / out / "metrics.jsonl").read_text().splitlines()]
        config = json.loads((tmp_path / out / "config.json").read_text())
        return sum(r["positions"] for r in lines if r["kind"] == "train"), config

    covered, config = epoch_positions("cover")
    assert config["data"]["anchors"] == "cover"
    assert covered >= 0.9 * masked, (covered, masked)
    assert covered <= masked  # non-overlapping: no position counted twice
    parted, _ = epoch_positions("parts", "--block-tokens", "64")
    assert parted == covered
    seed_recipe, config = epoch_positions("random", "--anchors", "random")
    assert config["data"]["anchors"] == "random" and seed_recipe < 0.5 * masked, (seed_recipe, masked)


def test_a_run_saved_before_anchors_existed_resumes_only_as_random():
    saved = TrainConfig(cache="c", out="o").to_dict()
    del saved["data"]["anchors"]  # a config.json written before the setting existed
    wanted = TrainConfig(cache="c", out="o").to_dict()
    assert ("data.anchors", "random", "cover") in config_differences(saved, wanted)
    wanted["data"]["anchors"] = "random"
    assert not [d for d in config_differences(saved, wanted) if d[0] == "data.anchors"]


def test_anchor_settings_refused_in_one_line(cache_url):
    with pytest.raises(ConfigError, match="--anchors"):
        DataConfig(anchors="dense")
    with pytest.raises(ConfigError, match="--block-tokens"):
        DataConfig(block_tokens=-1)
    cache = open_cache(cache_url)
    refs = EpochPlan(cache, DataConfig()).batches(0)[0]
    with pytest.raises(ConfigError, match="draft positions"):
        load_batch(cache, DataConfig(), refs, epoch=0)  # cover needs the drafter's block


def test_heldout_and_training_batches_count_the_same_positions_in_parts(cache_url):
    """block_targets over a batch's parts counts exactly the positions of the whole batch."""
    cache = open_cache(cache_url)
    cfg = DataConfig(batch_tokens=600, heldout_fraction=0.0, block_tokens=24)
    batch: Batch = load_batch(cache, cfg, EpochPlan(cache, cfg).batches(0)[0], epoch=0, draft_positions=3)
    spans = batch.parts(4, cfg)
    assert len(spans) > 1
    whole = int(block_targets(batch, 4)["valid"].sum())
    assert sum(int(block_targets(batch.columns(s), 4)["valid"].sum()) for s in spans) == whole
