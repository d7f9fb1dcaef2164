"""`dflash-cache verify` at scale (issue 36): work per shard that does not grow with the shard count,
nothing held per shard after it is checked, and lines of bounded length however many shards are
damaged or however long a value in the cache is. Caches of many tiny shards, written by the real
writer (`write_shard`, `ManifestKeeper`) as a one-process build writes them."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from cli.cache import app
from dflash_build.commit import ManifestKeeper
from dflash_build.shard_queue import Committed
from dflash_cache import format as fmt
from dflash_cache import open_cache
from dflash_cache.verify import MAX_NAMED, verify_cache
from dflash_cache.writer import ShardData, StorageConfig, sequences_table, write_shard
from dflash_common.errors import CacheError

HIDDEN, LAYERS, TOP_K, TOKENS = 8, 2, 2, 3
LINE_BYTES = 1024


def _write_cache(root: Path, shards: int, version: int) -> Path:
    """A complete cache of ``shards`` one-sequence shards (identical shapes, so every shard costs
    verify the same work), its teacher head included."""
    store = fmt.CacheStore.open(str(root))
    store.makedirs(store.root)
    header = fmt.manifest_header(list(range(LAYERS)), HIDDEN, "bfloat16", TOP_K, format_version=version)
    keeper = ManifestKeeper(store, header, [], live=True)
    rng = np.random.default_rng(0)
    for index in range(shards):
        hidden = rng.standard_normal((TOKENS, LAYERS, HIDDEN)).astype(np.float32) + 1.0
        shard = ShardData(rank=0, index=index, row_start=index, row_end=index + 1, ids=[f"s{index:06d}"],
                          rows=np.array([index]), lengths=np.array([TOKENS], np.int32), truncated=np.zeros(1, bool),
                          input_ids=np.arange(TOKENS, dtype=np.int32), loss_mask=np.ones(TOKENS, np.uint8),
                          hidden=(hidden.view(np.uint32) >> 16).astype(np.uint16),
                          topk_ids=np.tile(np.arange(TOP_K, dtype=np.int32), (TOKENS, 1)),
                          topk_logprobs=np.tile(np.array([-0.5, -1.5], np.float32), (TOKENS, 1)))
        record = write_shard(store, shard, StorageConfig(), "bfloat16", version, list(range(LAYERS)))
        keeper.commit(record if version == 1 else Committed(record, sequences_table(shard)))
    head = _teacher_head()
    store.makedirs(store.path(fmt.TEACHER_DIR))
    store.write_file(store.path(fmt.TEACHER_DIR, fmt.TEACHER_HEAD), head)
    keeper.write(complete=True, fault=False, teacher_head=fmt.teacher_head_record(head))
    return root


def _teacher_head() -> bytes:
    import safetensors.torch
    import torch

    return safetensors.torch.save({name: torch.ones(16, HIDDEN) for name in fmt.TEACHER_HEAD_TENSORS})


@pytest.fixture(scope="module")
def caches(tmp_path_factory):
    """Per format: caches of 10, 20 and 30 shards, and one of 80."""
    root = tmp_path_factory.mktemp("verify_scale")
    return {(version, n): _write_cache(root / f"v{version}-{n}", n, version)
            for version in (1, 2) for n in (10, 20, 30, 80)}


def _steps_in_our_code(url: Path) -> int:
    """Lines of dflash's own code run during verify_cache (each pass of a loop counts), with
    sys.settrace: a count, exact for a given cache, where a time would be noise."""
    ours = str(Path(fmt.__file__).parent)
    count = 0

    def on_line(frame, event, arg):
        nonlocal count
        if event == "line":
            count += 1
        return on_line

    def on_call(frame, event, arg):
        return on_line if frame.f_code.co_filename.startswith(ours) else None

    cache = open_cache(str(url))
    sys.settrace(on_call)
    try:
        report = verify_cache(cache)
    finally:
        sys.settrace(None)
    assert report.ok, report
    return count


@pytest.mark.parametrize("version", [1, 2])
def test_verify_does_the_same_work_for_each_shard_it_adds(caches, version):
    """The counting proxy of bench_scale.py's verify timings: the lines of our code that 10 more
    shards add are the same from 10 to 20 shards as from 20 to 30. A lookup of each shard among
    all of them (the quadratic verify of issue 36: 100,000 shards took 433 s) adds lines that
    grow with the count."""
    calls = [_steps_in_our_code(caches[version, n]) for n in (10, 20, 30)]
    first, second = calls[1] - calls[0], calls[2] - calls[1]
    assert first > 0 and abs(second - first) <= 0.005 * first, calls


def _maps_under(root: Path) -> int:
    with open("/proc/self/maps") as maps:
        return sum(str(root) in line for line in maps)


@pytest.mark.parametrize("version", [1, 2])
def test_verify_holds_no_map_per_shard(caches, version):
    """Verify keeps no shard's files mapped once it checked them: it held one map per format-2
    shard, and a process gets 65,530 (vm.max_map_count), so a 100,000-shard cache would have been
    called unreadable from shard ~65,000 on. The reader's cache of chunk-file maps (64) is the
    bound."""
    url = caches[version, 80]
    cache = open_cache(str(url))
    assert verify_cache(cache).ok
    assert _maps_under(url) <= 64


def test_reading_every_shard_holds_a_bounded_number_of_maps(caches, monkeypatch):
    """Training reads shard after shard through ``cache.shards``: it kept every Shard it made, each
    with its hidden-state map, so an epoch over ~65,000 format-2 shards would run out of maps. Only
    the ``OPEN_SHARDS`` used last are kept (8 here, to show it on 80 shards)."""
    from dflash_cache.reader import ShardList

    monkeypatch.setattr(ShardList, "OPEN_SHARDS", 8)
    import gc

    url = caches[2, 80]
    gc.collect()
    before = _maps_under(url)  # what earlier tests' objects still map
    cache = open_cache(str(url))
    first = cache.shards[0]
    assert cache.shards[0] is first  # a shard in use is the same object
    del first
    for shard in cache.shards:
        assert len(shard[0].hidden) > 0
    del shard
    gc.collect()
    assert _maps_under(url) - before <= 8 + 2  # the kept shards' maps, and the two index tables'


def _damage_every_shard(url: Path) -> list[str]:
    cache = open_cache(str(url))
    names = cache.shard_names()
    for shard in cache.shards:
        (Path(shard.path) / fmt.TOKENS).write_bytes(b"not arrow")
    return names


def _lines(output: str) -> list[str]:
    return output.strip().splitlines()


def test_an_intact_cache_leaves_an_empty_damaged_list(caches, tmp_path):
    """--damaged always says the present state: a list left by an earlier verify is emptied."""
    listed = tmp_path / "damaged.txt"
    listed.write_text("shard-r00000-000001\n")
    result = CliRunner().invoke(app, ["verify", str(caches[2, 30]), "--quiet", "--damaged", str(listed)])
    assert result.exit_code == 0 and listed.read_text() == "" and "--skip-shards" not in result.output, result.output


@pytest.mark.parametrize("version", [1, 2])
def test_many_damaged_shards_are_named_in_short_lines_with_a_count(caches, tmp_path, version):
    url = tmp_path / "cache"
    shutil.copytree(caches[version, 30], url)
    names = _damage_every_shard(url)
    listed = tmp_path / "damaged.txt"
    result = CliRunner().invoke(app, ["verify", str(url), "--quiet", "--damaged", str(listed)])
    assert result.exit_code == 1
    lines = _lines(result.output)
    assert all(len(line.encode()) < LINE_BYTES for line in lines), max(map(len, lines))
    bad = [line for line in lines if line.startswith("BAD shard-")]
    assert [line.split(":")[0] for line in bad] == [f"BAD {name}" for name in names[:MAX_NAMED]]
    assert f"BAD and {30 - MAX_NAMED} more shard(s)" in result.output
    # every name, for --skip-shards, in the file --damaged names
    assert listed.read_text().strip().split(",") == names and f"--skip-shards \"$(cat {listed})\"" in result.output
    assert lines[-1].startswith("error: 30 of 30 shard(s) are damaged")

    # training's refusal of the same shards: one line, the first named, the rest counted
    with pytest.raises(CacheError) as refused:
        open_cache(str(url)).ensure_intact((fmt.TOKENS,))
    line = str(refused.value)
    assert "\n" not in line and len(line) < LINE_BYTES, line
    assert "30 shard(s) fail the integrity check" in line and "and 25 more" in line and names[0] in line
    assert names[-1] not in line  # not in a --skip-shards list of all 30 either


def _edit_manifest(url: Path, change) -> None:
    manifest = json.loads((url / fmt.MANIFEST).read_text())
    change(manifest)
    (url / fmt.MANIFEST).write_text(json.dumps(manifest))


HUGE = 10**7

# a value of 10 MB in manifest.json, and what verify's one line says of it instead of printing it
_HUGE_VALUES = {
    "a shard name of 10 M digits": (1, lambda m: m["shards"][0].update(name="shard-r00000-" + "1" * HUGE),
                                    "is not a shard name"),
    "a file name of 10 MB": (1, lambda m: m["shards"][0]["files"].update({"x" * HUGE: 1}), "commit record differs"),
    "a hidden dtype of 10 MB": (1, lambda m: m.update(hidden_dtype="b" * HUGE), "unknown hidden dtype"),
    "layer ids a list of a million": (1, lambda m: m.update(layer_ids=list(range(10**6))), "hidden_shape"),
    "an index entry of 10 MB": (2, lambda m: m["index"].update(shards="x" * HUGE), "not a table of the index"),
    "a format of 10 MB": (2, lambda m: m.update(format="f" * HUGE), "not a dflash cache manifest"),
}


@pytest.mark.parametrize("case", list(_HUGE_VALUES))
def test_a_huge_value_in_the_manifest_is_one_short_line(caches, tmp_path, case):
    version, change, said = _HUGE_VALUES[case]
    url = tmp_path / "cache"
    shutil.copytree(caches[version, 10], url)
    _edit_manifest(url, change)
    result = CliRunner().invoke(app, ["verify", str(url), "--quiet"])
    assert result.exit_code == 1 and "Traceback" not in result.output
    lines = _lines(result.output)
    assert all(len(line.encode()) < LINE_BYTES for line in lines), [len(line) for line in lines]
    assert said in result.output, result.output[:2000]


def test_info_shows_a_huge_teacher_name_cut(caches, tmp_path):
    url = tmp_path / "cache"
    shutil.copytree(caches[2, 10], url)
    _edit_manifest(url, lambda m: m["teacher"].update(name="t" * HUGE, model_type=["x"] * 10**6))
    result = CliRunner().invoke(app, ["info", str(url)])
    # a model type that is a list is a damaged manifest: described cut, then refused (issue 60)
    assert result.exit_code == 1 and "field 'teacher.model_type' is" in result.output, result.output[-2000:]
    assert all(len(line.encode()) < LINE_BYTES for line in _lines(result.output))
    assert f"({HUGE:,} characters)" in result.output and "(1,000,000 items)" in result.output


def test_redacting_a_long_error_line_ends(tmp_path):
    """cli.common.run redacts every error line before printing it; its URL-credential pattern
    scanned from every letter of a long run of letters to the run's end (quadratic: a 10 MB line
    would take over an hour; 30,000 letters took 8x 10,000's). Bounded, a 10 MB line is redacted
    at once; the 120 s limit only catches a hang, the time is not measured."""
    code = ("from dflash_common.redact import redact\n"
            "text = 'b' * 10**7 + ' http://alice:secret@host/x'\n"
            "out = redact(text)\n"
            "assert out.endswith(' http://***@host/x') and 'secret' not in out\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
