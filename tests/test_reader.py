"""The reader's fast paths: chunk files read directly, read-ahead within a byte budget."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from helpers import english_like_sentences

from dflash_cache import open_cache
from dflash_cache.format.v1 import ChunkFiles
from dflash_common.errors import CacheError


@pytest.fixture(scope="module")
def caches(tiny_cache):
    sentences = english_like_sentences(120, seed=3)
    rows = [{"id": f"r{i:03d}", "messages": [{"role": "user", "content": sentences[2 * i]},
                                              {"role": "assistant", "content": sentences[2 * i + 1] * (1 + i % 4)}]}
            for i in range(60)]
    options = dict(rows=rows, layers=(0, 1, 2), top_k=4, shard_bytes=40_000, chunk_bytes=3_000)
    return {dtype: tiny_cache(dtype=dtype, **options) for dtype in ("bfloat16", "float32")} | {
        "zstd": tiny_cache(dtype="bfloat16", compression="zstd", **options)}


@pytest.mark.parametrize("kind", ["bfloat16", "float32"])
@pytest.mark.fast_cases(1)
def test_chunk_files_equal_zarr_for_any_row_range(caches, kind):
    cache = open_cache(caches[kind])
    rng = np.random.default_rng(0)
    for shard in cache.shards:
        files = shard.files.fast_hidden
        assert files is not None and files.chunk_rows < shard.hidden_array.shape[0]  # several chunks per shard
        n = shard.hidden_array.shape[0]
        ranges = [(0, n), (0, 1), (n - 1, n), (files.chunk_rows - 1, files.chunk_rows + 1)]
        ranges += [tuple(sorted(rng.integers(0, n + 1, size=2))) for _ in range(30)]
        for start, stop in ranges:
            expected = shard.hidden_array[start:stop]
            got = shard.read_stored(start, stop)
            assert got.dtype == expected.dtype and np.array_equal(got, expected), (shard.name, start, stop)


def test_compressed_shards_use_zarr_and_read_the_same(caches):
    plain, packed = open_cache(caches["bfloat16"]), open_cache(caches["zstd"])
    assert all(s.files.fast_hidden is None for s in packed.shards)
    for a, b in zip(plain.sequences(), packed.sequences()):
        assert a.id == b.id and np.array_equal(a.hidden.view(np.uint16), b.hidden.view(np.uint16))


def test_missing_or_short_chunk_file_is_named(caches, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(caches["bfloat16"], copy)
    shard = open_cache(str(copy)).shards[0]
    files = shard.files.fast_hidden
    victim = files.chunk_path(1)
    with open(victim, "r+b") as f:
        f.truncate(files.row_bytes * 2)
    with pytest.raises(CacheError, match=r"chunk file is short .* `dflash-cache verify --deep`"):
        shard.read_stored(0, files.chunk_rows * 2)
    os.remove(victim)
    with pytest.raises(CacheError, match=r"chunk file of a committed shard is missing"):
        shard.read_stored(files.chunk_rows, files.chunk_rows + 1)
    assert np.array_equal(shard.read_stored(0, 3), open_cache(caches["bfloat16"]).shards[0].read_stored(0, 3))


def test_only_the_writers_plain_layout_takes_the_fast_path(caches, tmp_path):
    import json
    import shutil

    src = Path(open_cache(caches["bfloat16"]).shards[0].path) / "hidden.zarr"
    assert ChunkFiles.open(str(src)) is not None
    for change in ({"codecs": [{"name": "bytes", "configuration": {"endian": "big"}}]},
                   {"chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [4, 1, 8]}}},
                   {"data_type": "int64"}, {"storage_transformers": [{"name": "x"}]}):
        other = tmp_path / f"z{len(list(tmp_path.iterdir()))}"
        shutil.copytree(src, other)
        meta = json.loads((other / "zarr.json").read_text())
        (other / "zarr.json").write_text(json.dumps({**meta, **change}))
        assert ChunkFiles.open(str(other)) is None, change
    assert ChunkFiles.open(str(tmp_path / "absent")) is None


def test_read_ahead_returns_records_in_order_within_the_byte_budget(caches):
    cache = open_cache(caches["bfloat16"])
    refs = [(s, i) for s in reversed(range(len(cache.shards))) for i in range(len(cache.shards[s]))][::-1]
    refs = refs[::2] + refs[1::2]
    largest = max(cache.sequence_bytes(*r) for r in refs)
    for budget, threads in ((0, 1), (largest * 3, 4), (10**12, 2)):
        ahead = cache.read_ahead(refs, max_bytes=budget, threads=threads)
        got = list(ahead)
        assert [r.id for r in got] == [cache.shards[s].ids[i] for s, i in refs]
        for record, (s, i) in zip(got, refs):
            assert np.array_equal(record.hidden.view(np.uint16), cache.shards[s][i].hidden.view(np.uint16))
        assert ahead.peak_bytes <= max(budget, largest)
    everything = sum(cache.sequence_bytes(*r) for r in refs)
    unbounded = cache.read_ahead(refs, max_bytes=10**12)
    next(unbounded)
    assert unbounded.peak_bytes == everything  # with room for all, all were requested at once
    unbounded.close()


@pytest.mark.parametrize("kind", ["bfloat16", "float32", "zstd"])
def test_reading_into_a_padded_batch_equals_a_plain_read(caches, kind):
    """The loader reads each sequence straight into its batch row; any store and codec gives the
    same values, the padding stays zero and read-ahead passes the rows along."""
    cache = open_cache(caches[kind])
    refs = [(s, i) for s in range(len(cache.shards)) for i in range(len(cache.shards[s]))][:7]
    lengths = [int(cache.shards[s].lengths[i]) for s, i in refs]
    batch = cache.padded_hidden(lengths)
    assert batch.shape == (7, max(lengths), len(cache.layer_ids), cache.hidden_size)
    rows = [(s, i, batch[row, :t]) for row, ((s, i), t) in enumerate(zip(refs, lengths))]
    records = list(cache.read_ahead(rows, max_bytes=0, threads=2))
    for row, (record, (s, i), t) in enumerate(zip(records, refs, lengths)):
        plain = cache.shards[s][i].hidden
        assert record.hidden.base is not None and np.shares_memory(record.hidden, batch)
        assert batch.dtype == plain.dtype and np.array_equal(batch[row, :t].view(np.uint8), plain.view(np.uint8))
        assert not batch[row, t:].view(np.uint8).any()
    files = cache.shards[0].files.fast_hidden
    if files is not None:
        with pytest.raises(ValueError, match="out must be C-contiguous"):
            files.read(0, 4, out=np.zeros((4, 2), dtype=files.dtype))


def _format1_cache(root: Path) -> Path:
    """A format-1 cache of two one-sequence shards, written by the writer's format-1 path."""
    from dflash_cache import format as fmt
    from dflash_cache.settings.storage_config import StorageConfig
    from dflash_cache.writer import ShardData, write_shard

    store = fmt.CacheStore.open(str(root))
    store.makedirs(store.root)
    rng = np.random.default_rng(0)
    records = []
    for index in range(2):
        bits = (rng.standard_normal((3, 2, 8)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        shard = ShardData(rank=0, index=index, row_start=index, row_end=index + 1, ids=[f"s{index}"],
                          rows=np.array([index]), lengths=np.array([3], np.int32), truncated=np.zeros(1, bool),
                          input_ids=np.arange(3, dtype=np.int32), loss_mask=np.ones(3, np.uint8), hidden=bits,
                          topk_ids=np.zeros((3, 2), np.int32), topk_logprobs=np.full((3, 2), -1.0, np.float32))
        records.append(write_shard(store, shard, StorageConfig(), "bfloat16", version=1))
    fmt.write_manifest(store, fmt.manifest_header([0, 1], 8, "bfloat16", 2, format_version=1), records, complete=True)
    return root


def test_format1_cache_opens_and_reads_locally(tmp_path):
    """The reader still opens a format-1 cache on local storage (its per-shard symlink check
    runs at open) and reads its sequences back."""
    cache = open_cache(str(_format1_cache(tmp_path / "v1")))
    assert cache.version == 1 and [s.name for s in cache.shards] == ["shard-r00000-000000", "shard-r00000-000001"]
    assert cache["s1"].hidden.shape == (3, 2, 8)


def test_format1_shard_folder_linked_outside_is_refused(tmp_path):
    root = _format1_cache(tmp_path / "v1")
    outside = tmp_path / "elsewhere"
    (root / "shards" / "shard-r00000-000001").rename(outside)
    os.symlink(outside, root / "shards" / "shard-r00000-000001")
    with pytest.raises(CacheError, match="outside the cache"):
        open_cache(str(root))


@pytest.fixture(scope="module")
def format2(tiny_cache):
    """A format-2 bf16 cache whose inner chunks each hold rows of several sequences."""
    sentences = english_like_sentences(80, seed=5)
    rows = [{"id": f"f{i:03d}", "messages": [{"role": "user", "content": sentences[2 * i]},
                                              {"role": "assistant", "content": sentences[2 * i + 1]}]}
            for i in range(40)]
    return tiny_cache(rows=rows, dtype="bfloat16", layers=(0, 1, 2), top_k=4, shard_bytes=200_000,
                      chunk_bytes=40_000, format_version=2)


def _bits(hidden: np.ndarray) -> np.ndarray:
    return hidden.view(np.uint16).copy()


def test_sequential_reads_reuse_a_buffer_only_once_no_record_holds_it(format2):
    """Cache.sequences reads each window into a buffer nothing views any more: a caller that lets
    its records go reads into the same two buffers over and over, one that keeps them keeps
    their values (each window then gets a buffer of its own)."""
    cache = open_cache(format2)
    shard = max(cache.shards, key=len)
    expected = {shard.ids[i]: _bits(shard[i].hidden) for i in range(len(shard))}
    window = 3 * int(shard.lengths.max()) * cache.hidden_bytes_per_token  # several windows in the shard
    spares: list[np.ndarray] = []
    for record in shard.records(window_bytes=window, spares=spares):
        assert np.array_equal(record.hidden.view(np.uint16), expected[record.id])
        assert any(record.hidden.base is buffer for buffer in spares)
    assert len(spares) == 2  # the window handed out and the one whose last record the caller still held
    held = list(shard.records(window_bytes=window, spares=[]))
    assert len({id(r.hidden.base) for r in held}) > 3  # more windows than SPARE_BUFFERS, none reused
    for record in held:
        assert np.array_equal(record.hidden.view(np.uint16), expected[record.id]), record.id
    every = list(cache.sequences())
    assert len(every) == len(cache) and all(np.array_equal(r.hidden.view(np.uint16), _bits(cache[r.id].hidden))
                                            for r in every)


def test_a_flipped_byte_in_a_chunk_several_sequences_share_is_refused_for_each(format2, tmp_path):
    """Each inner chunk's crc32c is checked when it is read, and a chunk that failed is never taken
    as checked: every sequence with a row in it is refused, by id, into a batch row and in order,
    while the sequences outside it still read."""
    import shutil

    from dflash_cache.format.integrity import ShardIntegrityError

    copy = tmp_path / "copy"
    shutil.copytree(format2, copy)
    cache = open_cache(str(copy))
    shard = cache.shards[0]
    files = shard.files.fast_hidden
    starts, stops = shard.offsets, shard.offsets + shard.lengths
    chunk = next(c for c in range(files.n_chunks)
                 if np.sum((starts < (c + 1) * files.chunk_rows) & (stops > c * files.chunk_rows)) >= 2)
    inside = np.flatnonzero((starts < (chunk + 1) * files.chunk_rows) & (stops > chunk * files.chunk_rows))
    _flip_byte(files.data_path, int(files._map()[2][chunk, 0]) + 7)  # one byte of the chunk's payload
    reopened = open_cache(str(copy))
    for i in inside.tolist():
        with pytest.raises(ShardIntegrityError, match=f"inner chunk {chunk} .*crc32c mismatch"):
            reopened.shards[0][i]
        row = reopened.padded_hidden([int(shard.lengths[i])])[0]
        with pytest.raises(ShardIntegrityError, match="crc32c mismatch"):
            reopened.shards[0].read(i, out=row)
    with pytest.raises(ShardIntegrityError, match="crc32c mismatch"):
        list(reopened.sequences())
    outside = [i for i in range(len(shard)) if i not in set(inside.tolist())]
    assert outside and all(len(reopened.shards[0][i]) == shard.lengths[i] for i in outside)


def test_a_read_of_many_chunks_raises_only_after_every_copy_ended(format2, tmp_path):
    """A read of several inner chunks copies them on the checker threads: when one is damaged the
    read raises, but only once every other copy has ended, so nothing writes into a caller's
    buffer after the error reached it (a recycled buffer would be overwritten behind its back)."""
    import shutil

    from dflash_cache.format.hidden import HiddenChecksumError

    copy = tmp_path / "copy"
    shutil.copytree(format2, copy)
    shard = open_cache(str(copy)).shards[0]
    files = shard.files.fast_hidden
    n = files.shape[0]
    expected = shard.hidden_array[0:n].reshape(n, -1).view(np.uint8)
    assert files.n_chunks >= 4
    _flip_byte(files.data_path, int(files._map()[2][0, 0]) + 3)  # chunk 0: its error comes before the others are copied
    damaged = open_cache(str(copy)).shards[0].files.fast_hidden
    for _ in range(20):
        out = np.zeros((n, *files.shape[1:]), dtype=files.dtype)
        with pytest.raises(HiddenChecksumError, match="inner chunk 0 .*crc32c mismatch"):
            damaged.read(0, n, out=out)
        got = out.reshape(n, -1).view(np.uint8)
        assert np.array_equal(got[files.chunk_rows:], expected[files.chunk_rows:])  # every other copy done


def _flip_byte(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))


def _read_all_bits(root: str) -> list[bytes]:
    return [record.hidden.view(np.uint16).tobytes() for record in open_cache(root).sequences()]


def test_a_forked_child_checks_chunks_with_threads_of_its_own(format2, tmp_path):
    """Chunks are checked on checker threads; a process forked after its parent started them (a
    DataLoader worker, a rank) has none of those threads, and a lock a parent's reader thread held
    at the fork would never be released there: the child must start afresh, not wait forever."""
    import multiprocessing
    import shutil

    from dflash_cache.format import hidden

    copy = tmp_path / "cold"
    shutil.copytree(format2, copy)  # chunks no process has checked yet
    expected = _read_all_bits(format2)  # the parent's checker threads exist now
    context = multiprocessing.get_context("fork")
    with hidden._VERIFIED_LOCK:  # as a parent's read-ahead thread holds it while it records a check
        pool = context.Pool(1)
    with pool:
        got = pool.apply_async(_read_all_bits, (str(copy),)).get(timeout=120)
    assert got == expected
