"""Format 2 under attack: a flipped byte in any of a shard's files or in the index is named by
`verify` and refused by `run` in one line, before anything is trained on it; a shard table whose
names or sizes were edited (and its checksum in the manifest rewritten to match) is refused
everywhere. Real caches written by the real build, the real commands through typer's runner.
(Format 1's manifest and commit records: test_untrusted_cache.py.)"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from helpers import qa_rows
from typer.testing import CliRunner

from cli.cache import app as cache_app
from cli.train import app as train_app
from dflash_cache import format as fmt
from dflash_cache import open_cache

RUN = ["--steps", "2", "--num-layers", "1", "--block-size", "4", "--batch-tokens", "300", "--eval-sequences", "0",
       "--heldout-fraction", "0.05", "--quiet"]


@pytest.fixture(scope="module")
def built(tiny_cache) -> Path:
    url = tiny_cache(rows=qa_rows(40, seed=8, prefix="ix-"), format_version=2, shard_bytes=30_000)
    assert len(open_cache(url).shards) >= 3
    return Path(url)


def _copy(built: Path, tmp_path: Path) -> Path:
    cache = tmp_path / "a" / "cache"
    shutil.copytree(built, cache, symlinks=True)
    return cache


def _one_line_error(output: str) -> str:
    lines = [line for line in output.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in output, output
    return lines[0]


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x5A
    path.write_bytes(bytes(data))


def _refused_by_run(cache: Path, *expected: str) -> str:
    run = cache.parent / "run"
    result = CliRunner().invoke(train_app, ["run", "--cache", str(cache), "--out", str(run), *RUN])
    assert result.exit_code == 1, result.output
    line = _one_line_error(result.output)
    assert all(e in line for e in expected), line
    assert not (run / "checkpoints").exists() and not (run / "drafter").exists()
    return line


SHARD_FILES = {  # a file of shard 1 -> what verify says of it flipped
    "hidden.zarr/c/0/0/0": "crc32c mismatch",
    "tokens.arrow": "tokens.arrow checksum mismatch",
    "sequences.arrow": "sequences.arrow checksum mismatch",
}


@pytest.mark.parametrize("name", list(SHARD_FILES))
def test_a_flipped_byte_in_a_shard_is_named_by_verify_and_refused_by_run(built, tmp_path, name):
    """verify names every damaged file; run refuses damage in what it reads (the hidden states and
    tokens.arrow). A format-2 shard's sequences.arrow is the copy a lost index is rebuilt from:
    training reads the index's rows instead, so it neither reads nor checks that file, and trains
    on the intact index as the undamaged cache does."""
    cache = _copy(built, tmp_path)
    shard = open_cache(str(cache)).shards[1].name
    _flip(Path(fmt.shard_path(str(cache), shard, 2)) / name)
    verified = CliRunner().invoke(cache_app, ["verify", str(cache), "--quiet"])
    assert verified.exit_code == 1 and f"BAD {shard}: " in verified.output and SHARD_FILES[name] in verified.output, \
        verified.output
    if name != "sequences.arrow":
        _refused_by_run(cache, shard)
        return
    trained = CliRunner().invoke(train_app, ["run", "--cache", str(cache), "--out", str(cache.parent / "run"), *RUN])
    assert trained.exit_code == 0 and (cache.parent / "run" / "drafter").exists(), trained.output


@pytest.mark.parametrize("table", [fmt.SHARD_TABLE, fmt.SEQUENCE_TABLE])
def test_a_flipped_byte_in_the_index_is_refused_everywhere(built, tmp_path, table):
    cache = _copy(built, tmp_path)
    _flip(cache / fmt.INDEX_DIR / table)
    for app, args in ((cache_app, ["info", str(cache)]), (cache_app, ["verify", str(cache), "--quiet"])):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 1 and f"{fmt.INDEX_DIR}/{table} differs from its size or checksum" in \
            _one_line_error(result.output), result.output
    _refused_by_run(cache, f"{fmt.INDEX_DIR}/{table}", "rebuild")


@pytest.mark.parametrize("name", ["../../outside", "/etc", "shard-r00000-000001/../../x", "manifest.json"])
def test_a_shard_table_naming_a_path_is_refused_everywhere(built, tmp_path, name):
    """The attacker rewrites the table with a hostile name and the manifest's checksum of it."""
    cache = _copy(built, tmp_path)
    record = dict(open_cache(str(cache)).shards[0].record, name=name)
    (tmp_path / "outside").mkdir()
    _rewrite_table(cache, {0: record})
    for app, args in ((cache_app, ["info", str(cache)]), (cache_app, ["verify", str(cache), "--quiet"])):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 1 and "which is not a shard name" in _one_line_error(result.output), result.output
    _refused_by_run(cache, "which is not a shard name")


def _rewrite_table(cache: Path, records: dict[int, dict]) -> None:
    """The index rewritten with these records (and its checksums in the manifest), leaving the
    shards' commit records alone (a hostile name has no folder to write one in)."""
    import json

    from dflash_cache.format import index
    from dflash_cache.format.store import CacheStore

    opened = open_cache(str(cache))
    rows = [records.get(i, shard.record) for i, shard in enumerate(opened.shards)]
    sequences = opened.sequence_table().select(index.sequence_schema().names).cast(index.sequence_schema())
    manifest = json.loads((cache / fmt.MANIFEST).read_text())
    manifest["index"] = index.write_tables(CacheStore.open(str(cache)), index.MERGED, index.shard_table(rows), sequences,
                                           complete=True)
    (cache / fmt.MANIFEST).write_text(json.dumps(manifest))


def test_a_shard_folder_linked_outside_the_cache_is_refused(built, tmp_path):
    cache = _copy(built, tmp_path)
    shard = open_cache(str(cache)).shards[0].name
    folder = Path(fmt.shard_path(str(cache), shard, 2))
    outside = tmp_path / "outside"
    shutil.move(str(folder), outside)
    os.symlink(outside, folder)
    verified = CliRunner().invoke(cache_app, ["verify", str(cache), "--quiet"])
    assert verified.exit_code == 1 and shard in verified.output and "outside" in verified.output, verified.output
    _refused_by_run(cache, shard)
