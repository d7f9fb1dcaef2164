"""Deterministic epoch plans: the held-out split, each epoch's partitions, lanes and batches, and
each sequence's anchors.

Everything that decides *what* a step sees is a pure function of (the split's lengths, seed,
epoch, partitions, step): the held-out split, each epoch's cut of the sequences into partitions
and lanes, their order and their batches, and each sequence's anchors (its noise, too, but the
trainer adds that on its device: dflash_train.training.noise). The loader
(dflash_train.training.data) only executes that plan, so a run resumed from a checkpoint's loader
state sees exactly the batches an uninterrupted run would, whatever the worker count.

Each rank reads only its share (docs/design.md, "Per-rank epoch plans"): an epoch's sequences,
shard after shard in a seeded order, are cut into ``partitions`` contiguous spans of equal tokens
(whole shards, plus at most one shard split at each end), each span into lanes that the loader
workers read. Global step s is batch s of every partition; a rank owns a contiguous block of
partitions and trains on each one's batch s as its own micro-batch (``rank_batches``), so it
reads 1/W of the cache per epoch, and a run resumes on any world size that owns at least one
partition a rank with the same global batches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import xxhash

from dflash_cache import Cache
from dflash_common.errors import CacheError, ConfigError
from dflash_train.settings.data_config import DataConfig


def _unit_hash(text: str, salt: int) -> float:
    return xxhash.xxh64_intdigest(text.encode(), seed=salt) / 2.0**64


def is_heldout(seq_id: str, fraction: float) -> bool:
    """The held-out split depends on the id alone, so it is stable across rebuilds and seeds."""
    return _unit_hash(seq_id, 0x5EED) < fraction


def heldout_mask(ids: list[str], fraction: float) -> np.ndarray:
    """is_heldout of each id (no hash at all when nothing is held out)."""
    if fraction <= 0:
        return np.zeros(len(ids), dtype=bool)
    return np.fromiter((is_heldout(i, fraction) for i in ids), dtype=bool, count=len(ids))


def _generator(key0: int, key1: int, counter0: int = 0, counter1: int = 0) -> np.random.Generator:
    """A counter-based generator: draws depend only on these four numbers."""
    key = np.array([key0 % 2**64, key1 % 2**64], dtype=np.uint64)
    counter = np.array([counter0 % 2**64, counter1 % 2**64, 0, 0], dtype=np.uint64)
    return np.random.Generator(np.random.Philox(key=key, counter=counter))


def epoch_order(sizes: list[int], seed: int, epoch: int) -> list[tuple[int, int]]:
    """(shard, sequence) pairs of one epoch: shards in a seeded order, sequences shuffled within
    each shard, so reads stay local to a shard while every epoch differs."""
    rng = _generator(seed, epoch, 1)
    order = []
    for shard in rng.permutation(len(sizes)):
        order.extend((int(shard), int(i)) for i in rng.permutation(sizes[shard]))
    return order


def cut_batches(order: list[tuple[int, int]], lengths: list[np.ndarray], batch_tokens: int) -> list[list[tuple[int, int]]]:
    """Cut an ordered list of sequences into consecutive batches of at most batch_tokens tokens."""
    batches, current, tokens = [], [], 0
    for shard, i in order:
        n = int(lengths[shard][i])
        if current and tokens + n > batch_tokens:
            batches.append(current)
            current, tokens = [], 0
        current.append((shard, i))
        tokens += n
    if current:
        batches.append(current)
    return batches


def sample_anchors(loss_mask: np.ndarray, num_anchors: int, seed: int, epoch: int, seq_id: str) -> np.ndarray:
    """Up to num_anchors positions a (sorted) with 1 <= a and loss_mask[a+1] = 1, drawn without
    replacement; a pure function of (seed, epoch, sequence id)."""
    eligible = np.flatnonzero(loss_mask[2:]) + 1  # a such that a + 1 is a loss position, a >= 1
    if len(eligible) <= num_anchors:
        return eligible.astype(np.int64)
    rng = _generator(seed, xxhash.xxh64_intdigest(seq_id.encode()), epoch, 2)
    return np.sort(rng.choice(eligible, size=num_anchors, replace=False)).astype(np.int64)


def cover_anchors(loss_mask: np.ndarray, positions: int, seed: int, epoch: int, seq_id: str) -> np.ndarray:
    """Anchors (sorted) of non-overlapping blocks whose draft positions a+1..a+positions cover
    every loss position t >= 2: each masked span tiled from its first uncovered position, a block
    that runs past a span's end covering the next span's start. The first block starts up to
    positions - 1 earlier, by a shift drawn from (seed, epoch, sequence id), so a position moves
    from block slot to block slot across epochs; a pure function like sample_anchors."""
    targets = np.flatnonzero(loss_mask[2:]) + 2
    if not len(targets):
        return np.zeros(0, dtype=np.int64)
    shift = int(_generator(seed, xxhash.xxh64_intdigest(seq_id.encode()), epoch, 3).integers(0, positions))
    breaks = np.flatnonzero(np.diff(targets) > 1)
    firsts, lasts = targets[np.r_[0, breaks + 1]], targets[np.r_[breaks, len(targets) - 1]]
    spans, covered = [], 0  # covered: the last position the blocks so far predict
    for first, last in zip(firsts.tolist(), lasts.tolist()):
        first = max(first, covered + 1)
        if first > last:
            continue
        start = max(1, first - 1 - (shift if not spans else 0))
        spans.append(np.arange(start, last, positions, dtype=np.int64))
        covered = int(spans[-1][-1]) + positions
    return np.concatenate(spans)


def block_parts(anchors: np.ndarray, block_size: int, block_tokens: int, batch_tokens: int | None) -> list[tuple[int, int]]:
    """Column ranges [c0, c1) of a batch's anchors [N, A] (each row sorted, -1 after its last) that
    one forward each trains: consecutive columns while their block tokens stay within
    ``block_tokens`` and their attention area (block tokens x (keys before their last anchor + their
    own block keys)) within block_tokens x (batch_tokens + block_tokens), the dense mask's bound
    (None: no area bound, for flex, which skips masked tiles); one column at least. A batch
    within the budgets is one part, as before parts existed."""
    used = anchors >= 0
    if not used.any():
        return [(0, anchors.shape[1])]
    rows_with = used.sum(0)  # per column: rows with a block there
    reach = np.where(used, anchors, 0).max(0)  # per column: the keys before its last anchor
    area_limit = None if batch_tokens is None else block_tokens * (batch_tokens + block_tokens)
    parts, start = [], 0
    while start < anchors.shape[1] and rows_with[start]:
        end, queries, keys = start, 0, 0
        while end < anchors.shape[1] and rows_with[end]:
            q = queries + int(rows_with[end]) * block_size
            k = max(keys, int(reach[end])) + (end + 1 - start) * block_size
            if end > start and (q > block_tokens or (area_limit is not None and q * k > area_limit)):
                break
            queries, keys, end = q, max(keys, int(reach[end])), end + 1
        parts.append((start, end))
        start = end
    parts[-1] = (parts[-1][0], anchors.shape[1])  # columns no row uses ride along with the last part
    return parts


LANES = 8
"""At most this many lanes per partition: loader workers read disjoint shards when their count
divides the lanes (1, 2, 4 or 8)."""


LANE_MIN_BATCHES = 64
"""A partition is cut into more lanes only while each keeps at least this many batches: a lane's
last batch is partial, so a small cache keeps one lane and packs its batches as one stream."""


SHUFFLE_BLOCK = (2, 6)
"""Shard pieces per shuffle block (drawn per block, inclusive): sequences are shuffled across the
few consecutive shards of a block, so a batch mixes shards while reads stay local."""


def lanes_per_partition(partition_tokens: float, batch_tokens: int) -> int:
    """1, 2, 4 or 8 lanes: as many as keep LANE_MIN_BATCHES batches in each."""
    lanes = 1
    while lanes < LANES and partition_tokens >= 2 * lanes * LANE_MIN_BATCHES * batch_tokens:
        lanes *= 2
    return lanes


@dataclass(frozen=True)
class PartitionPlan:
    """One partition's batches of an epoch: batch b is sequences ``bounds[b]:bounds[b + 1]`` of
    (``shard``, ``position``): the shard's index and the sequence's position among the shard's
    planned sequences."""

    shard: np.ndarray
    position: np.ndarray
    bounds: np.ndarray

    def __len__(self) -> int:
        return len(self.bounds) - 1

    def batch(self, b: int) -> list[tuple[int, int]]:
        lo, hi = self.bounds[b], self.bounds[b + 1]
        return list(zip(self.shard[lo:hi].tolist(), self.position[lo:hi].tolist()))


def _cut_bounds(tokens: np.ndarray, batch_tokens: int) -> np.ndarray:
    """Where consecutive batches of at most batch_tokens start (cut_batches' rule: a longer
    sequence forms a batch alone), plus the end. Each sequence's furthest batch end is found at
    once; only the batch starts are walked."""
    cumulative = np.concatenate([[0], np.cumsum(tokens, dtype=np.int64)])
    reach = np.searchsorted(cumulative, cumulative[:-1] + batch_tokens, side="right") - 1
    reach = np.maximum(reach, np.arange(1, len(tokens) + 1)).tolist()
    bounds, i = [0], 0
    while i < len(tokens):
        i = reach[i]
        bounds.append(i)
    return np.array(bounds, dtype=np.int64)


def _take_in_turn(perms: list[np.ndarray], bounds: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Lanes' batches (lane l: batch k is perms[l][bounds[l][k]:bounds[l][k + 1]]) taken in turn,
    batch 0 of every lane, then batch 1, ..., skipping lanes that ran out: the sequences in that
    order and where each batch starts."""
    offsets = np.cumsum([0] + [len(p) for p in perms])[:-1]
    starts = np.concatenate([o + b[:-1] for o, b in zip(offsets, bounds)])
    sizes = np.concatenate([np.diff(b) for b in bounds])
    turn = np.concatenate([np.arange(len(b) - 1) for b in bounds]) * len(perms)
    lane = np.repeat(np.arange(len(perms)), [len(b) - 1 for b in bounds])
    order = np.argsort(turn + lane, kind="stable")
    starts, sizes = starts[order], sizes[order]
    ends = np.cumsum(sizes)
    picked = np.concatenate(perms)[np.repeat(starts - (ends - sizes), sizes) + np.arange(int(ends[-1]) if len(ends) else 0)]
    return picked, np.concatenate([[0], ends])


def _block_order(pieces: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """A permutation of a lane's sequences (``pieces``: each one's shard piece, nondecreasing)
    shuffled within blocks of SHUFFLE_BLOCK consecutive pieces, blocks kept in order."""
    count = int(pieces[-1]) + 1 if len(pieces) else 0
    sizes = rng.integers(SHUFFLE_BLOCK[0], SHUFFLE_BLOCK[1] + 1, size=count // SHUFFLE_BLOCK[0] + 1)
    block_of_piece = np.repeat(np.arange(len(sizes)), sizes)[:count]
    key = (block_of_piece[pieces].astype(np.int64) << 32) | rng.integers(0, 2**32, size=len(pieces), dtype=np.int64)
    return np.argsort(key)


def plan_partitions(sizes: np.ndarray, tokens: np.ndarray, seed: int, epoch: int, partitions: int,
                    batch_tokens: int) -> list[PartitionPlan]:
    """The epoch's batches of every partition, a pure function of the split's shape (``sizes[s]``:
    shard s's planned sequences; ``tokens``: their lengths, shard after shard), seed, epoch,
    partition count and token budget.

    Shards in a seeded order form one line of sequences; the line is cut into ``partitions`` x
    lanes contiguous spans of equal tokens (by each sequence's token midpoint: balanced to a
    sequence; a shard is split only where a span ends). Each span (a lane) is shuffled within
    blocks of a few shard pieces, then cut into batches of at most ``batch_tokens`` tokens. A
    partition's batches take its lanes in turn (lane b mod lanes while none has run out), so
    loader worker w of a count dividing the lanes reads only its own lanes' shards. Array work
    throughout: a 100k-shard split plans without a Python step per shard."""
    sizes = np.asarray(sizes, dtype=np.int64)
    order = _generator(seed, epoch, 1).permutation(len(sizes))
    order = order[sizes[order] > 0]
    counts = sizes[order]
    total_seqs = int(counts.sum())
    if total_seqs == 0:
        return [PartitionPlan(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(1, np.int64))] * partitions
    shard = np.repeat(order, counts)
    starts = np.cumsum(counts) - counts
    position = np.arange(total_seqs) - np.repeat(starts, counts)
    first = np.cumsum(sizes) - sizes  # each shard's first sequence in ``tokens``
    tokens = np.asarray(tokens, dtype=np.int64)[first[shard] + position]
    total = int(tokens.sum())
    lanes = lanes_per_partition(total / partitions, batch_tokens)
    spans = partitions * lanes
    cumulative = np.cumsum(tokens)
    span = np.minimum((2 * cumulative - tokens) * spans // (2 * total), spans - 1)  # by each sequence's midpoint
    # a piece: a run of one shard's sequences in one span
    piece = np.concatenate([[0], np.cumsum((shard[1:] != shard[:-1]) | (span[1:] != span[:-1]))])
    edges = np.searchsorted(span, np.arange(spans + 1))
    plans = []
    for p in range(partitions):
        perms, bounds = [], []
        for j in range(p * lanes, (p + 1) * lanes):
            lo, hi = edges[j], edges[j + 1]
            perm = lo + _block_order(piece[lo:hi] - (piece[lo] if hi > lo else 0), _generator(seed, epoch, 3, j))
            perms.append(perm)
            bounds.append(_cut_bounds(tokens[perm], batch_tokens) if hi > lo else np.zeros(1, np.int64))
        picked, batch_bounds = _take_in_turn(perms, bounds)
        plans.append(PartitionPlan(shard[picked], position[picked], batch_bounds))
    return plans


def owned_partitions(partitions: int, rank: int, world_size: int) -> range:
    """The contiguous block of partitions rank ``rank`` of ``world_size`` reads (sizes differ by
    at most one when the world size does not divide the partitions)."""
    return range(rank * partitions // world_size, (rank + 1) * partitions // world_size)


def micro_batches_per_step(partitions: int, world_size: int) -> int:
    """Micro-batches every rank runs a step: the most partitions a rank owns (1 when the world
    size equals the partitions; k when a run planned over k x W partitions resumes on W ranks)."""
    return -(-partitions // world_size)


def resolve_partitions(configured: int, world_size: int, saved: int = 0) -> int:
    """The partitions a session plans over: a resumed run's own (``saved``), else data.partitions,
    else the world size. Every rank must own at least one partition (ConfigError)."""
    partitions = saved or configured or world_size
    if configured and saved and configured != saved:
        raise ConfigError(f"--data-partitions {configured} differs from the {saved} partitions this run was planned "
                          f"over; resume with --data-partitions {saved} (or 0)")
    if partitions < world_size:
        where = "this run was planned over" if saved else "--data-partitions gives"
        raise ConfigError(f"{world_size} ranks need at least {world_size} partitions, but {where} {partitions}; "
                          f"run on at most {partitions} ranks (a divisor of {partitions} gives every rank equal "
                          "shares)" + ("" if saved else f", or pass --data-partitions {world_size} or 0"))
    return partitions


class EpochPlan:
    """The training split of a cache and its batches per epoch (pure functions of the split's
    lengths), planned from the cache's sequence table at once: no object or file per shard."""

    def __init__(self, cache: Cache, cfg: DataConfig, heldout: bool = False):
        self.cache, self.cfg = cache, cfg
        # a skipped shard keeps its place (shard indices stay those of the cache) but is never
        # read: its files may be missing or damaged
        table = cache.sequence_table(skip=cfg.skip_shards)
        shard = table.column("shard").to_numpy().astype(np.int64)
        lengths = table.column("length").to_numpy().astype(np.int64)
        # rows come shard after shard, each shard's in its own order: row first[s] + i is
        # sequence i of shard s
        self.first = np.searchsorted(shard, np.arange(len(cache.shards)))
        keep = heldout_mask(table.column("id").to_pylist(), cfg.heldout_fraction) == heldout
        self.rows = np.flatnonzero(keep)  # the split's rows, shard after shard
        self.lengths = lengths  # of every row read, for the loader's buffers
        self.sizes = np.bincount(shard[self.rows], minlength=len(cache.shards))
        self.num_sequences = len(self.rows)
        if self.num_sequences == 0:
            split = "held-out" if heldout else "training"
            raise CacheError(f"the {split} split of {cache.url} is empty ({len(cache)} sequences, held-out fraction {cfg.heldout_fraction}); use a larger cache or change --heldout-fraction")
        self._shard, self._within = shard[self.rows], self.rows - self.first[shard[self.rows]]
        self._start = np.cumsum(self.sizes) - self.sizes  # each shard's first position in the split
        self._planned: tuple[tuple[int, int], list[PartitionPlan]] | None = None

    def refs(self, planned: np.ndarray) -> list[tuple[int, int]]:
        """(shard, sequence-in-shard) of the split's sequences at these positions (0 = its first)."""
        return list(zip(self._shard[planned].tolist(), self._within[planned].tolist()))

    def length(self, shard: int, i: int) -> int:
        """Tokens of sequence ``i`` of shard ``shard`` (one of the split's)."""
        return int(self.lengths[self.first[shard] + i])

    def partitions(self, epoch: int, partitions: int = 1) -> list[PartitionPlan]:
        """Each partition's batches of the epoch (positions among the planned sequences)."""
        if self._planned is None or self._planned[0] != (epoch, partitions):
            self._planned = (epoch, partitions), plan_partitions(self.sizes, self.lengths[self.rows], self.cfg.seed,
                                                                 epoch, partitions, self.cfg.batch_tokens)
        return self._planned[1]

    def steps(self, epoch: int, partitions: int = 1) -> int:
        """Steps of the epoch: its longest partition's batches (every rank runs them all)."""
        return max(len(p) for p in self.partitions(epoch, partitions))

    def rank_micro_batches(self, epoch: int, partitions: int, rank: int, world_size: int,
                           step: int) -> list[list[tuple[int, int]]]:
        """This rank's micro-batches of (shard, sequence-in-shard) at one step of the epoch: that
        batch of each partition it owns, one micro-batch per partition (so none is larger than
        batch_tokens), an empty one for a partition that ran out, and empty ones up to
        micro_batches_per_step (every rank runs as many forwards a step). Made when asked for, so an
        epoch of a million sequences starts without listing them all."""
        micro = []
        for p in owned_partitions(partitions, rank, world_size):
            part = self.partitions(epoch, partitions)[p]
            if step < len(part):
                lo, hi = part.bounds[step], part.bounds[step + 1]
                micro.append(self.refs(self._start[part.shard[lo:hi]] + part.position[lo:hi]))
            else:
                micro.append([])
        return micro + [[] for _ in range(micro_batches_per_step(partitions, world_size) - len(micro))]

    def rank_batch(self, epoch: int, partitions: int, rank: int, world_size: int, step: int) -> list[tuple[int, int]]:
        """This rank's share of one step's global batch: its micro-batches' sequences together."""
        return [ref for micro in self.rank_micro_batches(epoch, partitions, rank, world_size, step) for ref in micro]

    def rank_batches(self, epoch: int, partitions: int = 1, rank: int = 0, world_size: int = 1) -> list[list[tuple[int, int]]]:
        """rank_batch of every step of the epoch."""
        return [self.rank_batch(epoch, partitions, rank, world_size, b) for b in range(self.steps(epoch, partitions))]

    def batches(self, epoch: int, partitions: int = 1) -> list[list[tuple[int, int]]]:
        """The global batches of (shard, sequence-in-shard) for one epoch: every partition's batch
        of each step."""
        return self.rank_batches(epoch, partitions)

    def idle_ranks(self, epoch: int, partitions: int, world_size: int) -> list[int]:
        """Ranks whose partitions hold no sequence in this epoch."""
        plans = self.partitions(epoch, partitions)
        return [r for r in range(world_size)
                if not any(len(plans[p]) for p in owned_partitions(partitions, r, world_size))]


def idle_ranks_warning(plan: EpochPlan, epoch: int, partitions: int, world_size: int) -> str | None:
    """The one line that says some rank gets no training sequence this epoch (it runs idle steps)."""
    idle = plan.idle_ranks(epoch, partitions, world_size)
    if not idle:
        return None
    filled = sum(len(p) > 0 for p in plan.partitions(epoch, partitions))
    return (f"warning: {len(idle)} of {world_size} ranks get no training sequence in epoch {epoch} (rank(s) "
            f"{', '.join(map(str, idle))}): the split's {plan.num_sequences} sequences fill {filled} of the {partitions} "
            "partitions; those ranks run idle steps. Use fewer ranks or a larger cache")
