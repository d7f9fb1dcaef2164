"""The training data plan: pure order/anchor functions, block targets, exact loader resume."""

from __future__ import annotations

import itertools
import json
import os

import numpy as np
import pytest
import torch
from helpers import english_like_sentences

from dflash_cache import open_cache
from dflash_common.errors import ConfigError
from dflash_train.settings.data_config import DataConfig
from dflash_train.settings.noise_config import NoiseConfig
from dflash_train.training.batch import Batch
from dflash_train.training.batch_objective import block_targets
from dflash_train.training.data import LoaderState, TrainStream, train_loader
from dflash_train.training.epoch_plan import (
    LANES,
    EpochPlan,
    cut_batches,
    epoch_order,
    idle_ranks_warning,
    is_heldout,
    lanes_per_partition,
    micro_batches_per_step,
    owned_partitions,
    plan_partitions,
    resolve_partitions,
    sample_anchors,
)


@pytest.fixture(scope="module")
def small_cache(tiny_cache):
    sentences = english_like_sentences(240, seed=7)
    rows = [{"id": f"s{i:03d}", "messages": [{"role": "user", "content": sentences[2 * i]},
                                              {"role": "assistant", "content": sentences[2 * i + 1] * (1 + i % 3)}]}
            for i in range(120)]
    return tiny_cache(rows=rows, dtype="bfloat16", top_k=4, shard_bytes=12_000, format_version=2)


def test_epoch_order_is_a_seeded_permutation_grouped_by_shard():
    sizes = [5, 3, 0, 7]
    a, b = epoch_order(sizes, seed=1, epoch=0), epoch_order(sizes, seed=1, epoch=0)
    assert a == b
    assert sorted(a) == [(s, i) for s in range(4) for i in range(sizes[s])]
    shards_in_order = [s for s, _ in itertools.groupby(x[0] for x in a)]
    assert len(shards_in_order) == 3  # each shard's sequences are contiguous
    assert epoch_order(sizes, seed=1, epoch=1) != a and epoch_order(sizes, seed=2, epoch=0) != a


def test_cut_batches_respects_token_budget():
    lengths = [np.array([10, 20, 30, 40, 200])]
    order = [(0, i) for i in range(5)]
    batches = cut_batches(order, lengths, 60)
    assert batches == [[(0, 0), (0, 1), (0, 2)], [(0, 3)], [(0, 4)]]


def test_sample_anchors_eligible_deterministic_and_bounded():
    mask = np.array([0, 0, 0, 1, 1, 1, 0, 0, 1, 1, 1, 1], dtype=np.uint8)
    eligible = {2, 3, 4, 7, 8, 9, 10}  # a >= 1 with mask[a + 1] = 1
    a = sample_anchors(mask, 4, seed=0, epoch=0, seq_id="x")
    assert len(a) == 4 and set(a) <= eligible and list(a) == sorted(a) and len(set(a)) == 4
    assert np.array_equal(a, sample_anchors(mask, 4, seed=0, epoch=0, seq_id="x"))
    draws = {tuple(sample_anchors(mask, 4, seed=0, epoch=e, seq_id="x")) for e in range(8)}
    assert len(draws) > 1
    assert set(sample_anchors(mask, 100, 0, 0, "x")) == eligible
    assert len(sample_anchors(np.zeros(5, np.uint8), 3, 0, 0, "x")) == 0


def test_heldout_split_is_stable_and_sized():
    ids = [f"seq-{i}" for i in range(20000)]
    held = [i for i in ids if is_heldout(i, 0.1)]
    assert 0.09 < len(held) / len(ids) < 0.11
    assert held == [i for i in ids if is_heldout(i, 0.1)]
    assert set(i for i in ids if is_heldout(i, 0.05)) <= set(held)


def test_block_targets_match_a_hand_loop():
    n, t, k, block = 2, 9, 3, 4
    g = torch.Generator().manual_seed(0)
    batch = Batch(ids=["a", "b"], hidden=torch.zeros(n, t, 1, 2), input_ids=torch.randint(0, 50, (n, t), generator=g),
                  loss_mask=torch.rand(n, t, generator=g) > 0.3, lengths=torch.tensor([9, 6]),
                  topk_ids=torch.randint(0, 50, (n, t, k), generator=g), topk_logprobs=torch.randn(n, t, k, generator=g),
                  anchors=torch.tensor([[1, 6], [3, -1]]))
    out = block_targets(batch, block)
    for row in range(n):
        for j in range(2):
            a = int(batch.anchors[row, j])
            for p in range(block - 1):
                pos = a + p + 1
                ok = a >= 0 and pos < int(batch.lengths[row]) and bool(batch.loss_mask[row, pos])
                assert bool(out["valid"][row * 2 + j, p]) == ok
                if ok:
                    assert out["targets"][row * 2 + j, p] == batch.input_ids[row, pos]
                    assert torch.equal(out["topk_ids"][row * 2 + j, p], batch.topk_ids[row, pos - 1])
                    assert torch.equal(out["topk_logprobs"][row * 2 + j, p], batch.topk_logprobs[row, pos - 1])


def _take(url, cfg, state, n):
    return list(itertools.islice(iter(train_loader(url, None, cfg, state, draft_positions=3)), n))


def _same(a: Batch, b: Batch):
    assert a.ids == b.ids
    for name in ("hidden", "input_ids", "loss_mask", "topk_ids", "topk_logprobs", "anchors"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name
    assert a.state_after == b.state_after


def test_loader_covers_the_training_split_once_per_epoch(small_cache):
    cache = open_cache(small_cache)
    cfg = DataConfig(batch_tokens=300, heldout_fraction=0.1)
    plan = EpochPlan(cache, cfg)
    batches = plan.batches(0)
    seen = [cache.shards[s].ids[i] for b in batches for s, i in b]
    train_ids = [i for s in cache.shards for i in s.ids if not is_heldout(i, 0.1)]
    assert sorted(seen) == sorted(train_ids) and len(seen) == len(set(seen))
    assert len(cache.shards) > 2


@pytest.mark.parametrize("anchors", ["cover", "random"])
def test_loader_same_batches_for_any_worker_count_and_exact_resume(small_cache, anchors):
    cache = open_cache(small_cache)
    cfg = DataConfig(batch_tokens=400, heldout_fraction=0.1, anchors=anchors, num_anchors=3 if anchors == "random" else None)
    start = LoaderState(manifest_fingerprint=cache.fingerprint)
    per_epoch = len(EpochPlan(cache, cfg).batches(0))
    n = per_epoch + 4  # crosses an epoch boundary
    straight = _take(small_cache, cfg, start, n)
    two_workers = _take(small_cache, DataConfig(**{**cfg.__dict__, "num_workers": 2}), start, n)
    for a, b in zip(straight, two_workers):
        _same(a, b)
    # resume from the state recorded after batch m: the rest is identical
    m = per_epoch - 2
    resumed = _take(small_cache, cfg, LoaderState(**straight[m - 1].state_after), n - m)
    for a, b in zip(straight[m:], resumed):
        _same(a, b)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_loader_hands_out_the_cached_bf16_and_to_device_gives_float32(small_cache, layout):
    cache = open_cache(small_cache)
    assert cache.hidden_dtype == "bfloat16"
    cfg = DataConfig(batch_tokens=400, heldout_fraction=0.1, layout=layout)
    batch = _take(small_cache, cfg, LoaderState(manifest_fingerprint=cache.fingerprint), 1)[0]
    assert batch.hidden.dtype == torch.bfloat16
    for row, seq_id in enumerate(batch.ids):
        shard, i = next((s, s.ids.index(seq_id)) for s in cache.shards if seq_id in s.ids)
        record, t = shard[i], int(batch.lengths[row])
        stored = torch.from_numpy(np.asarray(record.hidden).view(np.uint16)).view(torch.bfloat16)
        assert torch.equal(batch.sequence("hidden", row), stored)  # bit for bit, no float32 on the way
        if layout == "padded":
            assert not batch.hidden[row, t:].any()  # padding is zero
    if layout == "packed":  # no padding at all: one row of exactly the sequences' tokens
        assert batch.hidden.shape[:2] == (1, batch.num_tokens)
    moved = batch.to("cpu")
    assert moved.hidden.dtype == torch.float32 and torch.equal(moved.hidden, batch.hidden.float())


def test_read_ahead_is_bounded_by_bytes_and_by_batches():
    from dflash_train.training.data import READ_AHEAD_BATCHES, read_ahead_budget

    production = 5 * 5120 * 2  # bytes of hidden states a token
    assert read_ahead_budget(DataConfig(), production) == 2**30  # 1 GiB: ~2.5 batches of 8,192 tokens
    quickstart = 3 * 128 * 2
    assert read_ahead_budget(DataConfig(batch_tokens=1600), quickstart) == READ_AHEAD_BATCHES * 1600 * quickstart
    assert read_ahead_budget(DataConfig(read_ahead_bytes=0), production) == 0


def _synthetic(num_shards: int, seed: int = 0, most: int = 12) -> list[np.ndarray]:
    """A length table: shards of 0..most sequences of 20..3,000 tokens."""
    rng = np.random.default_rng(seed)
    return [rng.integers(20, 3000, size=rng.integers(0, most + 1)) for _ in range(num_shards)]


def _flat(lengths: list[np.ndarray]) -> tuple[list[int], np.ndarray]:
    """plan_partitions' view of per-shard length arrays: each shard's count, then all lengths."""
    return [len(x) for x in lengths], np.concatenate(lengths) if lengths else np.zeros(0, np.int64)


def _rank_refs(plans, partitions: int, rank: int, world: int) -> list[tuple[int, int]]:
    return [ref for p in owned_partitions(partitions, rank, world) for b in range(len(plans[p])) for ref in plans[p].batch(b)]


@pytest.mark.parametrize("world", [2, 3, 8])
def test_ranks_read_disjoint_sequences_and_together_all(world):
    lengths = _synthetic(300)
    everything = {(s, i) for s, x in enumerate(lengths) for i in range(len(x))}
    total = sum(int(x.sum()) for x in lengths)
    plans = plan_partitions(*_flat(lengths), seed=3, epoch=1, partitions=world, batch_tokens=4000)
    shares = [_rank_refs(plans, world, r, world) for r in range(world)]
    assert sorted(ref for share in shares for ref in share) == sorted(everything)  # all, each once
    for share in shares:
        tokens = sum(int(lengths[s][i]) for s, i in share)
        assert abs(tokens - total / world) <= 3000  # balanced to a sequence
    # whole shards: a shard is read by two ranks only where a rank's span ends
    touched = [{s for s, _ in share} for share in shares]
    shared = {s for a, b in itertools.combinations(touched, 2) for s in a & b}
    assert len(shared) <= world - 1
    assert plan_partitions(*_flat(lengths), 3, 1, world, 4000)[0].batch(0) == plans[0].batch(0)  # a pure function
    assert plan_partitions(*_flat(lengths), 3, 2, world, 4000)[0].batch(0) != plans[0].batch(0)  # each epoch its own order


def test_each_rank_batch_holds_its_partitions_budget_and_one_process_reproduces_two():
    lengths = _synthetic(200, seed=1)
    plans = plan_partitions(*_flat(lengths), seed=0, epoch=0, partitions=2, batch_tokens=5000)
    steps = max(len(p) for p in plans)
    for rank in (0, 1):
        (p,) = owned_partitions(2, rank, 2)
        for b in range(len(plans[p])):
            batch = plans[p].batch(b)
            assert sum(int(lengths[s][i]) for s, i in batch) <= 5000 or len(batch) == 1  # a per-rank budget
    # one process planned over the two partitions takes both ranks' batches at every step
    one = [[ref for p in plans if b < len(p) for ref in p.batch(b)] for b in range(steps)]
    two = [[ref for r in (0, 1) for p in owned_partitions(2, r, 2) if b < len(plans[p]) for ref in plans[p].batch(b)]
           for b in range(steps)]
    assert one == two


def test_thousands_of_tiny_shards_plan_from_lengths_alone():
    """5,000 shards of 0-3 sequences: every sequence once, partitions balanced by tokens, and a
    rank touches its 1/W of the shards (plus at most one shard at each end of its span)."""
    lengths = _synthetic(5000, seed=2, most=3)
    num, total = sum(len(x) for x in lengths), sum(int(x.sum()) for x in lengths)
    largest = max(int(x.sum()) for x in lengths)
    for world in (1, 8, 32):
        plans = plan_partitions(*_flat(lengths), seed=0, epoch=0, partitions=world, batch_tokens=8192)
        refs = [_rank_refs(plans, world, r, world) for r in range(world)]
        assert sum(map(len, refs)) == num and len({x for share in refs for x in share}) == num
        for share in refs:  # the shards a rank opens hold its 1/W of the tokens, plus one shard at each end
            assert sum(int(lengths[s].sum()) for s in {s for s, _ in share}) <= total / world + 2 * largest


def test_loader_workers_read_disjoint_lanes():
    """Enough batches for eight lanes a partition: worker w of 2, 4 or 8 reads its own lanes' shards
    (shared only where a lane's span ends, and in the epoch's last turns where lanes run out)."""
    lengths = _synthetic(3000, seed=4, most=8)
    batch_tokens = 1000
    assert lanes_per_partition(sum(int(x.sum()) for x in lengths), batch_tokens) == LANES
    (plan,) = plan_partitions(*_flat(lengths), seed=0, epoch=0, partitions=1, batch_tokens=batch_tokens)
    for workers in (2, 4, 8):
        touched = [{s for b in range(w, len(plan), workers) for s, _ in plan.batch(b)} for w in range(workers)]
        shared = {s for a, b in itertools.combinations(touched, 2) for s in a & b}
        assert len(shared) < 0.03 * len(lengths), (workers, len(shared))


def test_partitions_resolve_from_the_run_and_refuse_too_few():
    assert resolve_partitions(0, 4) == 4 and resolve_partitions(8, 4) == 8
    assert resolve_partitions(0, 2, saved=4) == 4 and resolve_partitions(4, 3, saved=4) == 4  # a resume keeps its own
    with pytest.raises(ConfigError, match="16 ranks need at least 16 partitions, but this run was planned over 8; run on at most 8"):
        resolve_partitions(0, 16, saved=8)
    with pytest.raises(ConfigError, match="4 ranks need at least 4 partitions, but --data-partitions gives 2; run on at most 2 ranks"):
        resolve_partitions(2, 4)
    with pytest.raises(ConfigError, match="--data-partitions 6 differs from the 4 partitions"):
        resolve_partitions(6, 2, saved=4)
    with pytest.raises(ConfigError, match="--data-partitions must be >= 0"):
        DataConfig(partitions=-1)


def test_a_rank_without_sequences_is_named_in_one_line(small_cache):
    cache = open_cache(small_cache)
    plan = EpochPlan(cache, DataConfig(batch_tokens=400, heldout_fraction=0.1))
    assert idle_ranks_warning(plan, 0, 2, 2) is None
    few = plan.num_sequences
    idle = plan.idle_ranks(0, few + 2, few + 2)
    assert len(idle) >= 2  # more ranks than sequences
    line = idle_ranks_warning(plan, 0, few + 2, few + 2)
    assert line.count("\n") == 0 and line.startswith(f"warning: {len(idle)} of {few + 2} ranks get no training sequence "
                                                       f"in epoch 0 (rank(s) {', '.join(map(str, idle))})")
    assert f"the split's {few} sequences fill {few + 2 - len(idle)} of the {few + 2} partitions" in line


def _epoch_ids(url, cfg, state, world, steps=None):
    """Ids each step hands out over all `world` ranks, from `state` to the end of its epoch (or
    `steps` steps): each rank's micro-batches of a step (one per partition it owns), none over
    batch_tokens unless it is one longer sequence."""
    streams = [iter(TrainStream(url, None, cfg, state, rank, world, draft_positions=3)) for rank in range(world)]
    micro = micro_batches_per_step(state.partitions, world)
    out, after = [], state
    while after.epoch == state.epoch and (steps is None or len(out) < steps):
        batches = [[next(s) for _ in range(micro)] for s in streams]
        assert len({json.dumps(b[-1].state_after, sort_keys=True) for b in batches}) == 1  # every rank at the same step
        assert all(b.num_tokens <= cfg.batch_tokens or len(b.ids) == 1 for rank in batches for b in rank)
        out.append([i for rank in batches for b in rank for i in b.ids])
        after = LoaderState(**batches[0][-1].state_after)
    return out, after


@pytest.mark.parametrize("before,after", [(2, 1), (1, 2), (4, 3), (2, 4)])
def test_resume_mid_epoch_on_another_world_size_loses_and_repeats_nothing(small_cache, before, after):
    cache = open_cache(small_cache)
    cfg = DataConfig(batch_tokens=200, heldout_fraction=0.1)
    partitions = max(before, after)
    start = LoaderState(manifest_fingerprint=cache.fingerprint, partitions=partitions)
    whole, _ = _epoch_ids(small_cache, cfg, start, before)
    train_ids = sorted(i for s in cache.shards for i in s.ids if not is_heldout(i, 0.1))
    assert sorted(i for step in whole for i in step) == train_ids
    first, state = _epoch_ids(small_cache, cfg, start, before, steps=len(whole) // 2)
    rest, end = _epoch_ids(small_cache, cfg, state, after)
    assert first + rest == whole  # the same global batches, step for step, on the other world size
    assert end.epoch == 1 and end.batches_done == len(whole)


def test_a_ranks_epoch_reads_only_its_share_of_the_shards(small_cache):
    """Through the real loader: two ranks' epochs read disjoint sequences and together all, each
    rank opening only the shards of its own span."""
    cache = open_cache(small_cache)
    cfg = DataConfig(batch_tokens=300, heldout_fraction=0.1)
    state = LoaderState(manifest_fingerprint=cache.fingerprint, partitions=2)
    per_rank = []
    for rank in (0, 1):
        stream = TrainStream(small_cache, None, cfg, state, rank, 2, draft_positions=3)
        steps = EpochPlan(cache, cfg).steps(0, 2)
        per_rank.append([i for b in itertools.islice(iter(stream), steps) for i in b.ids])
    assert not set(per_rank[0]) & set(per_rank[1])
    assert sorted(per_rank[0] + per_rank[1]) == sorted(i for s in cache.shards for i in s.ids if not is_heldout(i, 0.1))
    where = {seq_id: s.name for s in cache.shards for seq_id in s.ids}
    shards = [{where[i] for i in ids} for ids in per_rank]
    assert len(shards[0] & shards[1]) <= 1 and len(shards[0]) < len(cache.shards)


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_training_batch_noise_equals_apply_noise_on_each_sequence(small_cache, layout):
    """The trainer noises the batch on its device, padded or packed; the values are each
    sequence's own draws at that step, padding and the last tapped layer untouched."""
    from dflash_train.settings.train_config import TrainConfig
    from dflash_train.training.batch import collate, load_batch
    from dflash_train.training.epoch_plan import sample_anchors
    from dflash_train.training.noise import apply_noise
    from dflash_train.training.train_step import on_device

    cache = open_cache(small_cache)
    cfg = TrainConfig(cache=small_cache, out="unused", noise=NoiseConfig(schedule="cosine", start=0.5, distribution="gaussian"),
                      data=DataConfig(batch_tokens=400, heldout_fraction=0.0, anchors="random", layout=layout))
    refs = EpochPlan(cache, cfg.data).batches(0)[0]
    loaded = load_batch(cache, cfg.data, refs, epoch=0)
    batch = on_device(loaded, torch.device("cpu"), cfg, step=3, steps=10)
    records = [cache.shards[s][i] for s, i in refs]
    anchors = [sample_anchors(r.loss_mask, cfg.data.num_anchors, cfg.data.seed, 0, r.id) for r in records]
    expected = collate(records, anchors, [apply_noise(np.asarray(r.hidden, np.float32), cfg.noise, 3, 10, r.id)
                                          for r in records], layout)
    assert len(refs) > 1 and torch.equal(batch.hidden, expected.hidden)
    clean = loaded.hidden.float()
    assert not torch.equal(batch.hidden[:, :, 0], clean[:, :, 0])
    assert torch.equal(batch.hidden[:, :, -1], clean[:, :, -1])  # the last tapped layer is never noised
    assert loaded.hidden.dtype == torch.bfloat16  # the loader's batch is not modified


def test_opening_and_planning_a_format_2_cache_touch_no_shard_file(small_cache):
    """Start-up costs the index, not the shard count: open_cache, the epoch plan and a rank's
    first plan read only the manifest and the index tables (every file opened is recorded)."""
    import sys

    opened: list[str] = []
    hook_on = [True]

    def audit(event, args):
        if hook_on[0] and event in ("open", "os.listdir", "os.scandir") and args and isinstance(args[0], (str, bytes)):
            opened.append(os.fsdecode(args[0]))

    sys.addaudithook(audit)
    try:
        cache = open_cache(small_cache)
        assert cache.version == 2 and len(cache.shards) > 3
        plan = EpochPlan(cache, DataConfig(batch_tokens=300, heldout_fraction=0.1))
        assert plan.steps(0, 2) > 0 and plan.num_sequences > 0
        first = plan.rank_batches(0, 2, 1, 2)
        # planned from the index's columns at once: not one Shard object made (a 100k-shard cache
        # made 100k of them, a Python step each, before its first batch)
        assert first and len(cache.shards._made) == 0
    finally:
        hook_on[0] = False
    inside = [p for p in opened if os.path.realpath(p).startswith(os.path.realpath(small_cache))]
    assert inside, "the audit hook saw no file of the cache"
    assert not [p for p in inside if "/shards/" in p or p.rstrip("/").endswith("/shards")], inside
