"""The training loader at scale: what one rank plans and reads, old global split vs per-rank plans.

Pure functions over synthetic length tables with the production shape's counts (1k, 10k and 100k
shards of 1-4 ShareGPT-like sequences, ~4.5k tokens each: a 512 MB shard at 51 KB a token holds
~10k tokens), so nothing is written to disk:

- per-rank time to its first batch plan at W = 1, 8 and 32 (simulated ranks): the old policy
  (``old_rank_batches``: today's global batches, each rank taking every W-th sequence of each, as
  ``rank_share`` did) against the new one (``plan_partitions`` over W partitions, the rank's own
  block), measured in the same run;
- per rank over an epoch at W = 2 and 8: shards and sequences touched, the bytes of the shards it
  touches, and bytes read, as ratios to 1/W of the cache: with v1's whole-shard hash before a shard's first sequence (every touched
  shard read whole, then the rank's own sequences) and with reads checked per chunk as read (v2:
  the rank's own sequences only). Bytes are counted in tokens (a fixed width per token).

Goal (issue 32): per-rank epoch reads within 10% of 1/W. Results: benchmarks/RESULTS.md, "The
cache at scale: per-rank reads".

    python benchmarks/bench_loader_scale.py [--shards 1000 10000 100000]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_train.training.epoch_plan import cut_batches, epoch_order, owned_partitions, plan_partitions  # noqa: E402

BATCH_TOKENS = 8192


def synthetic_lengths(num_shards: int, seed: int = 0) -> list[np.ndarray]:
    """Shards of 1-4 sequences of 500-8,500 tokens (mean ~4.5k)."""
    rng = np.random.default_rng(seed)
    counts = rng.integers(1, 5, size=num_shards)
    flat = rng.integers(500, 8500, size=int(counts.sum()))
    return np.split(flat, np.cumsum(counts)[:-1])


def old_rank_batches(lengths: list[np.ndarray], seed: int, epoch: int, rank: int, world: int) -> list[list[tuple[int, int]]]:
    """Today's plan before per-rank plans: one global order (shards in a seeded order, sequences
    shuffled within each), cut into global batches of BATCH_TOKENS, each rank taking every
    world-th sequence of every batch (``rank_share``)."""
    order = epoch_order([len(x) for x in lengths], seed, epoch)
    return [batch[rank::world] for batch in cut_batches(order, lengths, BATCH_TOKENS)]


def new_rank_batches(lengths: list[np.ndarray], seed: int, epoch: int, rank: int, world: int) -> list[list[tuple[int, int]]]:
    """Per-rank plans: W partitions (the default), this rank's own."""
    plans = plan_partitions([len(x) for x in lengths], np.concatenate(lengths), seed, epoch, world, BATCH_TOKENS)
    owned = [plans[p] for p in owned_partitions(world, rank, world)]
    return [[ref for part in owned if b < len(part) for ref in part.batch(b)] for b in range(max(len(p) for p in plans))]


POLICIES = {"old (global batches, every W-th)": old_rank_batches, "new (per-rank partitions)": new_rank_batches}


def first_plan_seconds(policy, lengths, world: int) -> float:
    """One rank's time from the length table to its first batch (the last rank: worst case)."""
    start = time.perf_counter()
    batches = policy(lengths, 0, 0, world - 1, world)
    next((b for b in batches if b), None)  # the old split leaves a rank at W = 8 with no sequence at all
    return time.perf_counter() - start


def epoch_reads(policy, lengths, world: int) -> dict:
    """Worst rank's shards, sequences and bytes (tokens) read over epoch 0, as ratios to 1/W."""
    shard_tokens = np.array([int(x.sum()) for x in lengths])
    total_tokens, total_seqs, total_shards = int(shard_tokens.sum()), sum(map(len, lengths)), len(lengths)
    worst = {"shards": 0.0, "sequences": 0.0, "distinct": 0.0, "v1 bytes": 0.0, "v2 bytes": 0.0}
    for rank in range(world):
        refs = [ref for batch in policy(lengths, 0, 0, rank, world) for ref in batch]
        shards = {s for s, _ in refs}
        own = sum(int(lengths[s][i]) for s, i in refs)
        hashed = int(shard_tokens[list(shards)].sum())
        got = {"shards": len(shards) / total_shards, "sequences": len(refs) / total_seqs,
               "distinct": hashed / total_tokens, "v1 bytes": (hashed + own) / total_tokens, "v2 bytes": own / total_tokens}
        for key, value in got.items():
            worst[key] = max(worst[key], value * world)
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, nargs="+", default=[1000, 10000, 100000])
    args = parser.parse_args()
    print("## per-rank time to its first batch plan (seconds; new / old in the same run)\n")
    print("| shards | sequences | W | old s | new s | new / old |")
    print("|---:|---:|---:|---:|---:|---:|")
    for num in args.shards:
        lengths = synthetic_lengths(num)
        for world in (1, 8, 32):
            old, new = (first_plan_seconds(policy, lengths, world) for policy in POLICIES.values())
            print(f"| {num:,} | {sum(map(len, lengths)):,} | {world} | {old:.2f} | {new:.2f} | {new / old:.2f} |", flush=True)
    print("\n## per rank over an epoch, worst rank, as multiples of 1/W (1.00 = exactly its share)\n")
    print("| shards | W | policy | shards touched | sequences | bytes of the shards touched | bytes read, v1 (hash, then read) "
          "| bytes read, v2 (checked as read) |")
    print("|---:|---:|---|---:|---:|---:|---:|---:|")
    for num in args.shards:
        lengths = synthetic_lengths(num)
        for world in (2, 8):
            for name, policy in POLICIES.items():
                r = epoch_reads(policy, lengths, world)
                print(f"| {num:,} | {world} | {name} | {r['shards']:.2f} | {r['sequences']:.3f} | {r['distinct']:.2f} | {r['v1 bytes']:.2f} | "
                      f"{r['v2 bytes']:.3f} |", flush=True)


if __name__ == "__main__":
    main()
