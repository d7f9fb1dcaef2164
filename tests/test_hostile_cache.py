"""A cache received from someone else, round four (#45): every file a command opens in it is a
regular file inside it (no link out, no FIFO that would hang a read, no device that never ends);
what is read is bounded by what the format allows before anything is allocated; the index's names
are unique and its columns whole; capture health refuses states no teacher produces. Real caches
written by the real build, the real commands through typer's runner (and a subprocess with a
timeout where a hang is the failure)."""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import google_crc32c
import numpy as np
import pytest
from helpers import qa_rows
from test_untrusted_index import _copy, _one_line_error, _refused_by_run, _rewrite_table
from typer.testing import CliRunner

from cli.cache import app as cache_app
from dflash_cache import format as fmt
from dflash_cache import open_cache

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def built(tiny_cache) -> Path:
    return Path(tiny_cache(rows=qa_rows(40, seed=8, prefix="ix-"), format_version=2, shard_bytes=30_000))


@pytest.fixture(scope="module")
def zstd(tiny_cache) -> Path:
    return Path(tiny_cache(rows=qa_rows(40, seed=8, prefix="ix-"), format_version=2, shard_bytes=30_000,
                           chunk_bytes=4_000, compression="zstd"))


def _refused_everywhere(cache: Path, *expected: str) -> None:
    """info, verify and run each end at once with one line holding ``expected``."""
    for args in (["info", str(cache)], ["verify", str(cache), "--quiet"]):
        result = CliRunner().invoke(cache_app, args)
        assert result.exit_code == 1, result.output
        line = _one_line_error(result.output)
        assert all(e in line for e in expected), line
    _refused_by_run(cache, *expected)


@pytest.mark.parametrize("name", [fmt.MANIFEST, f"{fmt.INDEX_DIR}/{fmt.SHARD_TABLE}", f"{fmt.TEACHER_DIR}/{fmt.TEACHER_HEAD}",
                                  f"{fmt.TEACHER_DIR}/config.json"])
def test_a_cache_file_linked_outside_the_cache_is_refused(built, tmp_path, name):
    """Before, only links under shards/ were checked: a manifest, an index table or the teacher's
    files linked to copies outside were read with no word (verify said ok)."""
    cache = _copy(built, tmp_path)
    outside = tmp_path / "outside" / Path(name).name
    outside.parent.mkdir()
    shutil.move(str(cache / name), outside)
    os.symlink(outside, cache / name)
    if name.startswith(fmt.TEACHER_DIR):  # read by training (verify checks the head), not by info
        if name.endswith(fmt.TEACHER_HEAD):
            verified = CliRunner().invoke(cache_app, ["verify", str(cache), "--quiet"])
            assert verified.exit_code == 1 and "outside the cache" in verified.output, verified.output
        _refused_by_run(cache, "outside the cache")
    else:
        _refused_everywhere(cache, "outside the cache")


def _command(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """A command in its own process: a FIFO that blocked a read would show as a timeout, not a hang."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", "from cli.cache import main; main()", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("name", [fmt.MANIFEST, f"{fmt.INDEX_DIR}/{fmt.SHARD_TABLE}"])
def test_a_fifo_in_place_of_the_manifest_or_the_index_ends_at_once(built, tmp_path, name):
    cache = _copy(built, tmp_path)
    (cache / name).unlink()
    os.mkfifo(cache / name)
    done = _command("info", str(cache))
    assert done.returncode == 1 and "is a FIFO (reading it would wait for a writer forever), not a regular file" in done.stderr, done.stderr


@pytest.mark.parametrize("name", [f"{fmt.HIDDEN}/zarr.json", fmt.TOKENS])
def test_a_fifo_in_a_shard_is_named_not_read(built, tmp_path, name):
    """A FIFO as hidden.zarr/zarr.json or tokens.arrow blocked `run` (verify called it missing)."""
    cache = _copy(built, tmp_path)
    shard = Path(fmt.shard_path(str(cache), open_cache(str(cache)).shard_names()[1], 2))
    (shard / name).unlink()
    os.mkfifo(shard / name)
    _refused_by_run(cache, "is a FIFO (reading it would wait for a writer forever), not a regular file")
    verified = CliRunner().invoke(cache_app, ["verify", str(cache), "--quiet"])
    assert verified.exit_code == 1 and "FIFO" in verified.output and "missing" not in verified.output, verified.output


def test_a_huge_zarr_json_is_not_read_whole(built, tmp_path):
    cache = _copy(built, tmp_path)
    shard = Path(fmt.shard_path(str(cache), open_cache(str(cache)).shard_names()[1], 2))
    with open(shard / fmt.HIDDEN / "zarr.json", "ab") as f:
        f.truncate(3 << 20)  # 3 MiB: a sparse file, as big as the attacker likes
    _refused_by_run(cache, "zarr.json is larger than 1 MiB")


def _rewrite_chunk_index(cache: Path, change) -> None:
    """Shard 1's hidden-state object with `change(index, data)` applied to its shard index (rows:
    offset, length per inner chunk) and the index's crc32c recomputed, as a sender would."""
    shard = Path(fmt.shard_path(str(cache), open_cache(str(cache)).shard_names()[1], 2))
    path = shard / fmt.HIDDEN_DATA
    data = bytearray(path.read_bytes())
    meta = json.loads((shard / fmt.HIDDEN_META).read_text())
    config = meta["codecs"][0]["configuration"]
    n = meta["chunk_grid"]["configuration"]["chunk_shape"][0] // config["chunk_shape"][0]
    index = np.frombuffer(bytes(data[-(n * 16 + 4):-4]), "<u8").reshape(n, 2).copy()
    change(index, data)
    raw = index.astype("<u8").tobytes()
    data[-(n * 16 + 4):] = raw + struct.pack("<I", google_crc32c.value(raw))
    path.write_bytes(bytes(data))


def test_a_zstd_chunk_pointing_past_its_file_is_refused_when_read(zstd, tmp_path):
    """Before, Zarr read such a chunk as zeros and a whole epoch trained on it (verify flagged it)."""
    cache = _copy(zstd, tmp_path)

    def past_the_end(index, data):
        index[0, 0] = len(data) + 4096

    _rewrite_chunk_index(cache, past_the_end)
    _refused_by_run(cache, "shard index entry 0 is not a compressed inner chunk inside the file")


def test_a_zstd_frame_claiming_more_than_its_chunk_is_refused_before_anything_is_allocated(zstd, tmp_path):
    """A frame declaring 64 GiB (here as much as its size field holds) was decompressed into that."""
    cache = _copy(zstd, tmp_path)

    def bomb(index, data):
        offset, length = int(index[0, 0]), int(index[0, 1])
        frame = bytearray(data[offset:offset + length - 4])
        descriptor = frame[4]
        flag, single = descriptor >> 6, (descriptor >> 5) & 1
        size = (1 if single else 0, 2, 4, 8)[flag]
        at = 5 + (0 if single else 1) + (0, 1, 2, 4)[descriptor & 3]
        assert size in (2, 4, 8), size  # the writer's frames declare their size
        frame[at:at + size] = (64 << 30 if size == 8 else 256 ** size - 1).to_bytes(size, "little")
        data[offset:offset + length] = bytes(frame) + struct.pack("<I", google_crc32c.value(bytes(frame)))

    _rewrite_chunk_index(cache, bomb)
    _refused_by_run(cache, "inner chunk 0 declares")


def test_a_shard_listed_twice_in_the_index_is_refused(built, tmp_path):
    """Before, verify counted it twice ("10 shard(s)" for 9) and an epoch trained on it twice."""
    import pyarrow as pa

    from dflash_cache.format import index
    from dflash_cache.format.store import CacheStore

    cache = _copy(built, tmp_path)
    opened = open_cache(str(cache))
    rows = [shard.record for shard in opened.shards]
    rows.append(rows[0])
    table = opened.sequence_table().select(index.sequence_schema().names).cast(index.sequence_schema())
    first = table.filter(pa.compute.equal(table.column("shard"), 0))
    again = first.set_column(1, "shard", pa.array(np.full(first.num_rows, len(rows) - 1, np.int32)))
    manifest = json.loads((cache / fmt.MANIFEST).read_text())
    manifest["index"] = index.write_tables(CacheStore.open(str(cache)), index.MERGED, index.shard_table(rows),
                                           pa.concat_tables([table, again]), complete=True)
    (cache / fmt.MANIFEST).write_text(json.dumps(manifest))
    _refused_everywhere(cache, f"lists the shard '{rows[0]['name']}' more than once")


def test_a_skipped_column_that_is_not_json_is_one_line(built, tmp_path):
    """It was a traceback in verify and run."""
    cache = _copy(built, tmp_path)
    record = dict(open_cache(str(cache)).shards[1].record, skipped="{not json")
    _rewrite_table(cache, {1: record})
    result = CliRunner().invoke(cache_app, ["verify", str(cache), "--quiet"])
    assert result.exit_code == 1 and "skipped counts of shard" in _one_line_error(result.output), result.output
    _refused_by_run(cache, "skipped counts of shard")


def test_a_null_sequence_id_is_one_line(built, tmp_path):
    """It was a traceback in run."""
    import pyarrow as pa

    from dflash_cache.format import index
    from dflash_cache.format.store import CacheStore

    cache = _copy(built, tmp_path)
    opened = open_cache(str(cache))
    table = opened.sequence_table().select(index.sequence_schema().names).cast(index.sequence_schema())
    ids = table.column("id").to_pylist()
    ids[3] = None
    table = table.set_column(0, "id", pa.array(ids, pa.string()))
    manifest = json.loads((cache / fmt.MANIFEST).read_text())
    manifest["index"] = index.write_tables(CacheStore.open(str(cache)), index.MERGED,
                                           index.shard_table([s.record for s in opened.shards]), table, complete=True)
    (cache / fmt.MANIFEST).write_text(json.dumps(manifest))
    _refused_everywhere(cache, "(null) values in its column 'id'")


def test_capture_health_refuses_states_that_ignore_the_input_or_no_model_produces():
    """Build and verify passed a teacher whose tapped states were one vector for every token (training
    then reported tau 7.96 at loss 1e-4) and states of RMS 1.9e28."""
    import ml_dtypes

    from dflash_cache import health

    rng = np.random.default_rng(0)
    states = rng.standard_normal((64, 3, 32)).astype(np.float32)
    stats = health.layer_stats(states.astype(ml_dtypes.bfloat16))
    health.check_capture(stats, [1, 2, 3], "fine", 64)  # real-looking states pass
    states[:, 1] = rng.standard_normal(32)
    with pytest.raises(health.CaptureError, match="tapped layer 2 is one vector for every token"):
        health.check_capture(health.layer_stats(states.astype(ml_dtypes.bfloat16)), [1, 2, 3], "s", 64)
    states[:, 1] = rng.standard_normal((64, 32)) * 1.9e28
    with pytest.raises(health.CaptureError, match="tapped layer 2 is of RMS 1.9"):
        health.check_capture(health.layer_stats(states.astype(ml_dtypes.bfloat16)), [1, 2, 3], "s", 64)
    layers, flags = health.summary(np.array([[1.0, 1.9e28, 1.0]]), np.zeros((1, 3)), np.zeros((1, 3), int),
                                   np.array([64]), [1, 2, 3])
    assert any("layer 2 RMS 1.9e+28 is above any model's hidden states" in f for f in flags), flags


def test_an_index_claiming_a_sequence_of_2_31_tokens_is_refused_before_a_buffer_is_sized(built, tmp_path):
    """Before, the loader allocated the batch (512 GiB here) before it checked the shard."""
    import pyarrow as pa

    from dflash_cache.format import index
    from dflash_cache.format.store import CacheStore

    cache = _copy(built, tmp_path)
    opened = open_cache(str(cache))
    rows = [shard.record for shard in opened.shards]
    huge = 2**31 - 1
    table = opened.sequence_table().select(index.sequence_schema().names).cast(index.sequence_schema())
    lengths, offsets = table.column("length").to_numpy().copy(), table.column("offset").to_numpy().copy()
    first = int(np.flatnonzero(table.column("shard").to_numpy() == 1)[0])  # shard 1's first sequence
    grow = huge - int(lengths[first])
    lengths[first] = huge
    later = (table.column("shard").to_numpy() == 1) & (np.arange(len(lengths)) > first)
    offsets[later] += grow
    table = table.set_column(3, "length", pa.array(lengths, pa.int32())).set_column(2, "offset", pa.array(offsets))
    rows[1] = dict(rows[1], tokens=rows[1]["tokens"] + grow, hidden_shape=[rows[1]["tokens"] + grow, *rows[1]["hidden_shape"][1:]])
    manifest = json.loads((cache / fmt.MANIFEST).read_text())
    manifest["index"] = index.write_tables(CacheStore.open(str(cache)), index.MERGED, index.shard_table(rows), table,
                                           complete=True)
    (cache / fmt.MANIFEST).write_text(json.dumps(manifest))
    _refused_by_run(cache, rows[1]["name"], "hidden shape")
