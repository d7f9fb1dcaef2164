"""Issue 59: one long sequence (32,768 tokens, at a reduced width: 4 layers x hidden 256 in bf16,
64 MiB of hidden states) written by the real writer, verified, read back equal and batched alone
(batch_tokens below its length), packed and padded; then each path's peak memory, measured in a
process of its own, held under a stated multiple of the sequence's bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import torch

from dflash_cache import format as fmt
from dflash_cache import open_cache
from dflash_cache.settings.storage_config import StorageConfig
from dflash_cache.verify import verify_cache
from dflash_cache.writer import ShardData, write_shard
from dflash_train.settings.data_config import DataConfig
from dflash_train.training.batch import load_batch

ROOT = Path(__file__).resolve().parents[1]
TOKENS, LAYERS, HIDDEN, TOP_K = 32_768, [1, 3, 5, 7], 256, 8
SEQ_BYTES = TOKENS * len(LAYERS) * HIDDEN * 2
ALLOWANCE = 48 * 2**20
"""Fixed allowance above the multiple: the token tables (ids, mask, top-k: ~2.5 MiB here, int64
in a batch), the interpreter's and the allocator's noise."""
READ_BOUND = 3
"""Peak resident growth of a read, in sequences: the sequence handed out (1) and the pages of the
memory-mapped shard it was copied from (1, page cache), with room for one more transient copy;
three more whole copies would exceed it."""
WRITE_BOUND = 4
"""The writer's peak growth, in sequences: about 2.8 today, as Zarr's sharded write encodes every
inner chunk into a buffer of its own (crc32c appended) and then joins them into the shard object
before it writes it; two more whole copies would exceed it."""


def long_shard() -> ShardData:
    rng = np.random.default_rng(59)
    hidden = rng.standard_normal((TOKENS, len(LAYERS), HIDDEN), dtype=np.float32).astype(ml_dtypes.bfloat16)
    return ShardData(rank=0, index=0, row_start=0, row_end=1, ids=["long"], rows=np.zeros(1, np.int64),
                     lengths=np.array([TOKENS], np.int32), truncated=np.zeros(1, bool),
                     input_ids=rng.integers(0, 1000, TOKENS, dtype=np.int32),
                     loss_mask=(rng.random(TOKENS) < 0.7).astype(np.uint8), hidden=hidden.view(np.uint16),
                     topk_ids=rng.integers(0, 1000, (TOKENS, TOP_K), dtype=np.int32),
                     topk_logprobs=-np.cumsum(rng.exponential(0.3, (TOKENS, TOP_K)), axis=1).astype(np.float32))


def write_cache(out: Path, shard: ShardData) -> None:
    store = fmt.CacheStore.open(str(out))
    record = write_shard(store, shard, StorageConfig(), "bfloat16", layer_ids=LAYERS)
    fmt.write_manifest(store, fmt.manifest_header(LAYERS, HIDDEN, "bfloat16", TOP_K), [record], complete=True)


# The child: each path's growth of the kernel's peak resident size (VmHWM, reset through
# /proc/self/clear_refs before it), with what the path hands out held until it is measured.
CHILD = r"""
import gc, json, sys
import numpy as np
from dflash_cache import open_cache
from dflash_train.settings.data_config import DataConfig
from dflash_train.training.batch import load_batch

def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))

url, tokens, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
peaks = {}
def measure(name, fn):
    gc.collect()
    open("/proc/self/clear_refs", "w").write("5")
    before = status("VmRSS")
    held = fn()
    peaks[name] = status("VmHWM") - before
    del held

if mode == "write":
    sys.path.insert(0, sys.argv[4])
    from test_long_sequences import long_shard, write_cache
    from pathlib import Path
    shard = long_shard()
    measure("writer", lambda: write_cache(Path(url), shard))
else:
    cache = open_cache(url)
    cache.ensure_intact()  # hashed before: the reads are measured, not the first check
    measure("cache[id]", lambda: cache["long"])
    measure("Shard.read into a buffer", lambda: cache.shards[0].read(0, out=cache.padded_hidden([tokens])[0]))
    measure("sequences()", lambda: list(cache.sequences()))
    for layout in ("packed", "padded"):
        cfg = DataConfig(batch_tokens=tokens // 4, heldout_fraction=0.0, layout=layout)
        measure(f"load_batch {layout}", lambda: load_batch(cache, cfg, [(0, 0)], epoch=0, draft_positions=15))
print(json.dumps(peaks))
"""


def peaks_in_child(url: Path, mode: str) -> dict[str, int]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-c", CHILD, str(url), str(TOKENS), mode, str(ROOT / "tests")],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def long_cache(tmp_path_factory) -> tuple[Path, ShardData]:
    shard = long_shard()
    out = tmp_path_factory.mktemp("long") / "cache"
    write_cache(out, shard)
    return out, shard


def test_a_long_sequence_verifies_reads_back_and_batches_alone(long_cache):
    out, shard = long_cache
    cache = open_cache(str(out))
    assert not verify_cache(cache).bad_shards
    record = cache["long"]
    assert len(record) == TOKENS
    assert np.array_equal(np.asarray(record.hidden).view(np.uint16), shard.hidden)
    assert np.array_equal(record.topk_logprobs, shard.topk_logprobs) and np.array_equal(record.input_ids, shard.input_ids)
    (streamed,) = list(cache.sequences())
    assert np.array_equal(np.asarray(streamed.hidden).view(np.uint16), shard.hidden)
    for layout in ("packed", "padded"):
        cfg = DataConfig(batch_tokens=TOKENS // 4, heldout_fraction=0.0, layout=layout)  # it forms a batch alone
        batch = load_batch(cache, cfg, [(0, 0)], epoch=0, draft_positions=15)
        assert batch.num_tokens == TOKENS and tuple(batch.hidden.shape) == (1, TOKENS, len(LAYERS), HIDDEN)
        assert np.array_equal(batch.hidden.view(torch.int16).numpy().view(np.uint16)[0], shard.hidden)
        assert np.array_equal(batch.topk_ids[0].numpy(), shard.topk_ids)


def test_reading_a_long_sequence_stays_within_its_memory_bound(long_cache):
    out, _ = long_cache
    peaks = peaks_in_child(out, "read")
    assert len(peaks) == 5, peaks
    for path, peak in peaks.items():
        assert peak < READ_BOUND * SEQ_BYTES + ALLOWANCE, f"{path}: peak grew {peak / SEQ_BYTES:.2f}x the sequence's bytes"


def test_writing_a_long_sequence_stays_within_its_memory_bound(tmp_path):
    peak = peaks_in_child(tmp_path / "cache", "write")["writer"]
    assert peak < WRITE_BOUND * SEQ_BYTES + ALLOWANCE, f"the writer's peak grew {peak / SEQ_BYTES:.2f}x the sequence's bytes"
    assert not verify_cache(open_cache(str(tmp_path / "cache"))).bad_shards


def test_deep_verify_compares_a_long_sequence_in_blocks_within_its_memory_bound():
    """`verify --deep`'s comparison of a long sequence equals the whole-sequence formula, and its
    peak stays a fraction of the sequence (it made float32 copies and temporaries of all of it at
    once: about 8x the bf16 bytes)."""
    from dflash_build.deep_verify import hidden_error

    rng = np.random.default_rng(1)
    fresh = rng.standard_normal((3000, 3, 64), dtype=np.float32).astype(ml_dtypes.bfloat16)
    stored = (fresh.astype(np.float32) + rng.normal(0, 0.01, fresh.shape).astype(np.float32)).astype(ml_dtypes.bfloat16)
    a, b = stored.astype(np.float32), fresh.astype(np.float32)
    rms = np.sqrt(np.mean(np.square(b), axis=(0, 2), keepdims=True)) + 1e-12
    whole = (np.abs(a - b) / (np.abs(b) + rms)).max(axis=(0, 2))
    np.testing.assert_allclose(hidden_error(stored, fresh), whole, rtol=1e-5)

    child = r"""
import gc, json
import ml_dtypes, numpy as np
from dflash_build.deep_verify import hidden_error
def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))
fresh = np.random.default_rng(0).standard_normal((%d, %d, %d), dtype=np.float32).astype(ml_dtypes.bfloat16)
stored = fresh.copy()
gc.collect()
open("/proc/self/clear_refs", "w").write("5")
before = status("VmRSS")
hidden_error(stored, fresh)
print(json.dumps(status("VmHWM") - before))
""" % (TOKENS, len(LAYERS), HIDDEN)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    peak = json.loads(done.stdout.strip().splitlines()[-1])
    assert peak < SEQ_BYTES // 2 + ALLOWANCE, f"hidden_error's peak grew {peak / SEQ_BYTES:.2f}x the sequence's bytes"
