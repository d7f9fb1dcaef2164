"""A cache received from someone else, round five (issue 60): the teacher files it carries are read
only as bounded regular files inside it, a build resumed over an edited manifest names the field
it cannot use, and `info` fails on a manifest it can only partly describe. Real caches written by
the real build, the real commands through typer's runner (a subprocess with a timeout where a hang
would be the failure)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import qa_rows
from test_untrusted_index import RUN, _copy, _one_line_error
from typer.testing import CliRunner

from cli.cache import app as cache_app


@pytest.fixture(scope="module")
def built(tiny_cache) -> Path:
    return Path(tiny_cache(rows=qa_rows(40, seed=8, prefix="ix-"), format_version=2, shard_bytes=30_000))


ROOT = Path(__file__).resolve().parents[1]


def _command(*args: str, app: str = "cli.cache", timeout: float = 300) -> subprocess.CompletedProcess:
    """A command in its own process: a FIFO that blocked a read shows as a timeout, a MemoryError
    as what the process prints, and a read of gigabytes costs this process nothing."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-c", f"from {app} import main; main()", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _command_train(*args: str) -> subprocess.CompletedProcess:
    return _command(*args, app="cli.train")


def _edit_manifest(cache: Path, edit) -> None:
    manifest = json.loads((cache / "manifest.json").read_text())
    edit(manifest)
    (cache / "manifest.json").write_text(json.dumps(manifest))


# --- info on a manifest it can only partly describe -------------------------------------------

INFO_DAMAGE = {
    "totals.tokens a string": (lambda m: m["totals"].update(tokens="12"), "field 'totals.tokens' is '12', not a count"),
    "totals a string": (lambda m: m.update(totals="many"), "field 'totals' is 'many', not an object"),
    "totals.skipped a list": (lambda m: m["totals"].update(skipped=[1]), "field 'totals.skipped' is [1]"),
    "teacher without a name": (lambda m: m["teacher"].pop("name"), "field 'teacher.name' is missing"),
    "teacher vocab_size a string": (lambda m: m["teacher"].update(vocab_size="big"),
                                    "field 'teacher.vocab_size' is 'big', not a count"),
    "complete a string": (lambda m: m.update(complete="yes"), "field 'complete' is 'yes', not true or false"),
}


@pytest.mark.parametrize("damage", INFO_DAMAGE)
def test_info_fails_on_a_manifest_it_can_only_partly_describe(built, tmp_path, damage):
    """info printed such a manifest with "?" and 0 in place of the values and exited 0."""
    edit, said = INFO_DAMAGE[damage]
    cache = _copy(built, tmp_path)
    _edit_manifest(cache, edit)
    for args in (["info", str(cache)], ["info", str(cache), "--json"]):
        result = CliRunner().invoke(cache_app, args)
        assert result.exit_code == 1, (args, result.output)
        line = _one_line_error(result.output)
        assert said in line and "manifest.json" in line and "rebuild" in line, line


def test_info_still_exits_0_on_a_sound_manifest_and_one_without_totals(built, tmp_path):
    cache = _copy(built, tmp_path)
    assert CliRunner().invoke(cache_app, ["info", str(cache)]).exit_code == 0
    _edit_manifest(cache, lambda m: m.pop("totals"))  # an older manifest: the reader sums the index
    result = CliRunner().invoke(cache_app, ["info", str(cache)])
    assert result.exit_code == 0 and "sequences    40" in result.output, result.output


# --- a build resumed over an edited manifest ---------------------------------------------------

def _files(cache: Path) -> dict[str, tuple[int, int]]:
    """Every file of ``cache``: (size, mtime), to show that a refused build touched nothing."""
    return {str(p.relative_to(cache)): (p.stat().st_size, p.stat().st_mtime_ns) for p in cache.rglob("*") if p.is_file()}


def _rerun_build(cache: Path):
    """The build command that made ``cache``, run again on it (a resume)."""
    build = json.loads((cache / "manifest.json").read_text())["build"]
    return CliRunner().invoke(cache_app, [
        "build", "--teacher", build["teacher"]["name_or_path"], "--data", build["corpus"]["data"], "--out", str(cache),
        "--dtype", "float32", "--layers", "0,2", "--top-k", "6", "--shard-size", "30000", "--format-version", "2",
        "--quiet"])


RESUME_DAMAGE = {  # what a resume reads, edited -> the field its line names
    "shards_per_generate a string": (lambda m: m["content_options"].update(shards_per_generate="2"),
                                     "'content_options.shards_per_generate' is '2'"),
    "shards_per_generate a list": (lambda m: m["content_options"].update(shards_per_generate=[2]),
                                   "'content_options.shards_per_generate' is [2]"),
    "shards_per_generate 0": (lambda m: m["content_options"].update(shards_per_generate=0),
                              "'content_options.shards_per_generate' is 0, not a whole number >= 1"),
    "content_options a string": (lambda m: m.update(content_options="x"), "'content_options' is 'x', not an object"),
    "world_size a float": (lambda m: m["content_options"].update(world_size=1.5), "'content_options.world_size' is 1.5"),
    "build.vllm a list": (lambda m: m["build"].update(vllm=[]), "'build.vllm' is [], not an object"),
    "generate_tokens a string": (lambda m: m["build"]["vllm"].update(generate_tokens="64k"),
                                 "'build.vllm.generate_tokens' is '64k'"),
    "teacher_head a string": (lambda m: m.update(teacher_head="x"), "'teacher_head' is 'x', not an object"),
    "last_run a list": (lambda m: m.update(last_run=[]), "'last_run' is [], not an object"),
    "padding_fraction a string": (lambda m: m["last_run"].update(padding_fraction="4%"),
                                  "'last_run.padding_fraction' is '4%', not a number in [0, 1]"),
}


@pytest.mark.fast_cases(4)
@pytest.mark.parametrize("damage", RESUME_DAMAGE)
def test_a_resume_over_an_edited_manifest_names_the_field_and_writes_nothing(built, tmp_path, damage):
    """Before: `unexpected ValueError/TypeError/AttributeError, a bug in dflash` (shards_per_generate a
    string or a list, content_options a string), or the edited value carried into the new manifest
    (teacher_head), or a crash once the build was done (last_run)."""
    edit, said = RESUME_DAMAGE[damage]
    cache = _copy(built, tmp_path)
    _edit_manifest(cache, edit)
    before = _files(cache)
    result = _rerun_build(cache)
    assert result.exit_code == 1, result.output
    line = _one_line_error(result.output)
    assert f"manifest.json field {said}" in line and "restore manifest.json" in line and "--overwrite" in line, line
    assert _files(cache) == before


def test_the_same_build_resumes_a_sound_manifest(built, tmp_path):
    cache = _copy(built, tmp_path)
    result = _rerun_build(cache)
    assert result.exit_code == 0 and "cache ready" in result.output, result.output


# --- the teacher files a cache carries ---------------------------------------------------------

def _teacher_file(cache: Path, name: str) -> Path:
    return cache / "teacher" / name


def _sparse(path: Path) -> None:
    path.unlink()
    with open(path, "wb") as f:
        f.truncate(3 << 30)  # 3 GiB that take no disk


def _deep(path: Path) -> None:
    path.write_text("[" * 400_000 + "]" * 400_000)


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _linked_out(path: Path) -> None:
    outside = path.parents[3] / "outside" / path.name
    outside.parent.mkdir(exist_ok=True)
    shutil.move(str(path), outside)
    os.symlink(outside, path)


TEACHER_DAMAGE = {  # (file, what is done to it, what the line says of it)
    "tokenizer 3 GiB sparse": ("tokenizer.json", _sparse, "teacher/tokenizer.json is 3,221,225,472 bytes, more than the 256 MiB"),
    "config 400k deep": ("config.json", _deep, "teacher/config.json nests 400,000 levels deep, more than the 64"),
    "tokenizer config 400k deep": ("tokenizer_config.json", _deep, "teacher/tokenizer_config.json nests 400,000 levels"),
    "tokenizer a FIFO": ("tokenizer.json", _fifo, "teacher/tokenizer.json is a FIFO"),
    "config not JSON": ("config.json", lambda p: p.write_bytes(b"\xff{"), "teacher/config.json is not UTF-8 text"),
    "tokenizer linked outside": ("tokenizer.json", _linked_out, "teacher/tokenizer.json is a symlink to"),
}


@pytest.mark.fast_cases(3)
@pytest.mark.parametrize("damage", TEACHER_DAMAGE)
def test_a_teacher_file_that_cannot_be_read_safely_is_named_by_verify_and_run(built, tmp_path, damage):
    """Before: verify said ok; run ended in `unexpected MemoryError` (the sparse tokenizer), `unexpected
    RecursionError` (the deep config: transformers parses it while loading the tokenizer) or waited."""
    name, edit, said = TEACHER_DAMAGE[damage]
    cache = _copy(built, tmp_path)
    edit(_teacher_file(cache, name))
    verified = _command("verify", str(cache), "--quiet")
    assert verified.returncode == 1, verified.stderr
    assert f"BAD teacher file: {said}" in verified.stderr, verified.stderr
    assert "restore the teacher's files" in verified.stderr.strip().splitlines()[-1], verified.stderr
    run = _command_train("run", "--cache", str(cache), "--out", str(tmp_path / "run"), *RUN)
    assert run.returncode == 1, run.stderr[-3000:]
    errors = [line for line in run.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and said in errors[0] and "Traceback" not in run.stderr, run.stderr[-3000:]
    assert "rebuild the cache" in errors[0] and not (tmp_path / "run" / "checkpoints").exists()


def test_a_sound_teacher_folder_has_no_problem(built):
    from dflash_cache.format.store import CacheStore
    from dflash_cache.format.teacher_folder import teacher_file_problems

    assert teacher_file_problems(CacheStore.open(str(built))) == []


def test_the_bounds_of_one_teacher_file():
    from dflash_cache.format.teacher_folder import TEACHER_FILE_BYTES, TEACHER_JSON_DEPTH, file_problem

    assert file_problem("head.safetensors", 10 * TEACHER_FILE_BYTES) is None  # the manifest records its size
    assert "more than the 256 MiB" in file_problem("tokenizer.model", TEACHER_FILE_BYTES + 1)
    at_bound = b"[" * TEACHER_JSON_DEPTH + b"]" * TEACHER_JSON_DEPTH
    assert file_problem("config.json", len(at_bound), at_bound) is None
    deeper = b"[" + at_bound + b"]"
    assert f"nests {TEACHER_JSON_DEPTH + 1} levels deep" in file_problem("config.json", len(deeper), deeper)
    quoted = b'["' + b"[" * 1000 + b'"]'  # brackets inside a string do not nest
    assert file_problem("vocab.json", len(quoted), quoted) is None
    assert "is not valid JSON" in file_problem("config.json", 2, b"{]")


# --- rare huge values in the states -------------------------------------------------------------

def test_verify_sees_a_huge_value_at_a_few_positions_of_one_layer(tiny_cache, tmp_path):
    """A cache holding 1e30 at three positions of one layer, its checksums rewritten to match (what a
    cache from elsewhere, or from a build before the exact pass, can hold): verify said ok, from
    the recorded health of 1,024 sampled tokens. Now it reads every value's magnitude from the bits."""
    import numpy as np
    import zarr
    from helpers import replace_shard_records

    from dflash_cache import format as fmt
    from dflash_cache import open_cache

    cache = _copy(Path(tiny_cache()), tmp_path)  # format 1, float32, uncompressed
    record = open_cache(str(cache)).shards[1].record
    array = zarr.open_array(str(Path(fmt.shard_path(str(cache), record["name"], 1)) / fmt.HIDDEN), mode="r+")
    values = np.asarray(array[:])
    values[[1, 5, 9][:len(values)], 1, 3] = 1e30
    array[:] = values
    record["checksums"]["hidden"] = fmt.checksum(np.ascontiguousarray(values))
    replace_shard_records(cache, {1: record})
    verified = CliRunner().invoke(cache_app, ["verify", str(cache), "--quiet"])
    assert verified.exit_code == 1, verified.output
    assert (f"BAD {record['name']}: hidden states: tapped layer 2 holds a value of |x| = 1e+30, far above any model's "
            "hidden states (at most 1e+07 here)") in verified.output, verified.output
    assert "rebuild the cache" in verified.output.strip().splitlines()[-1]


def test_the_writer_commits_no_shard_holding_a_huge_value(tmp_path):
    """The build's stop, on the real writer: the shard's files are not committed, the line names the
    layer, the value and the fix."""
    import numpy as np

    from dflash_cache import format as fmt
    from dflash_cache.health import CaptureError
    from dflash_cache.settings.storage_config import StorageConfig
    from dflash_cache.writer import ShardData, write_shard

    values = np.random.default_rng(0).standard_normal((3000, 2, 16)).astype(np.float32)
    values[[2000, 2001], 0, 3] = 1e30  # rows no sample of 1,024 takes
    shard = ShardData(rank=0, index=0, row_start=0, row_end=1, ids=["a"], rows=np.array([0]),
                      lengths=np.array([3000], np.int32), truncated=np.zeros(1, bool),
                      input_ids=np.arange(3000, dtype=np.int32) % 50, loss_mask=np.ones(3000, np.uint8), hidden=values,
                      topk_ids=np.zeros((3000, 3), np.int32), topk_logprobs=np.zeros((3000, 3), np.float32))
    store = fmt.CacheStore.open(str(tmp_path / "cache"))
    with pytest.raises(CaptureError, match=r"tapped layer 7 holds a value of \|x\| = 1e\+30 .*the shard was not committed"):
        write_shard(store, shard, StorageConfig(), "float32", layer_ids=[7, 9])
    assert not list((tmp_path / "cache").rglob("*.json"))
