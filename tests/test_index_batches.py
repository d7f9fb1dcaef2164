"""The format-2 index tables are one record batch each (found by benchmarks/bench_scale.py: a
sequence table concatenated from one piece per shard was written as one batch per shard, ~500
bytes of metadata each, and every column slice read back walked all of them, so planning over
10k shards took seconds and over 100k minutes)."""

from __future__ import annotations

import sys
from pathlib import Path

import pyarrow as pa

from dflash_build import finalize_cache
from dflash_cache.format import index
from dflash_cache.reader import open_cache

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_scale  # noqa: E402  (its synthetic 2-rank build through the real writer)


def test_index_tables_are_one_batch_and_read_as_one_chunk(tmp_path):
    root = tmp_path / "cache"
    bench_scale.write_cache(str(root), 40, 2, 4)  # 20 shards a rank: 4 written, 16 replicas
    for rank in range(2):  # each rank's part of the index
        for path in index.part_paths(rank).values():
            assert pa.ipc.open_file(pa.memory_map(str(root / path))).num_record_batches == 1, path
    finalize_cache(str(root))
    for path in index.MERGED.values():
        assert pa.ipc.open_file(pa.memory_map(str(root / path))).num_record_batches == 1, path
    cache = open_cache(str(root))
    assert len(cache.shards) == 40 and len(cache) == 40
    assert cache.listing.sequences.column("id").num_chunks == 1
    assert [cache.shards[j].ids for j in (0, 39)] == [["s0-0000000"], ["s1-0000019"]]
