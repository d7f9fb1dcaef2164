"""A cache is data from elsewhere: nothing in its manifest or commit records is trusted as a path,
and no shard whose bytes differ from its checksums is trained or evaluated on.

Real caches on disk, edited as an attacker or a bad disk would, and the real commands
(`dflash-cache info/verify`, `dflash-train run/eval`) through typer's runner."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from helpers import qa_rows, write_jsonl
from typer.testing import CliRunner

from cli.cache import app as cache_app
from cli.train import app as train_app
from dflash_build import BuildConfig, build_cache
from dflash_cache import format as fmt
from dflash_cache import open_cache
from dflash_cache.format import integrity
from dflash_cache.settings.storage_config import StorageConfig
from dflash_common.errors import CacheError
from dflash_corpus import CorpusConfig
from dflash_teacher.teacher import TeacherConfig
from dflash_train.settings.data_config import DataConfig
from dflash_train.training.batch import load_batch
from dflash_train.training.epoch_plan import EpochPlan, is_heldout

RUN = ["--steps", "2", "--num-layers", "1", "--block-size", "4", "--batch-tokens", "300", "--eval-sequences", "0",
       "--heldout-fraction", "0.05", "--quiet"]
PLAN = DataConfig(batch_tokens=300, heldout_fraction=0.05)  # the plan `run` above follows
EVAL_FRACTION = 0.5  # eval's held-out split: large, so a chosen shard surely holds some of it


@pytest.fixture(scope="module")
def built(tmp_path_factory, teacher_dir) -> Path:
    root = tmp_path_factory.mktemp("untrusted")
    data = write_jsonl(root / "chat.jsonl", qa_rows(60, seed=5, prefix="u-"))
    cfg = BuildConfig(out=str(root / "cache"), corpus=CorpusConfig(data=data),
                      teacher=TeacherConfig(name_or_path=teacher_dir("qwen3"), dtype="float32", layers=(0, 2), top_k=4),
                      # format 1: the attacks below edit its manifest's shard records and commit records
                      # (format 2's index tables are attacked in test_untrusted_index.py)
                      storage=StorageConfig(shard_bytes=60_000, chunk_bytes=8_192, format_version=1))  # a few chunk files a shard
    build_cache(cfg)
    shards = open_cache(str(root / "cache")).shards
    assert len(shards) >= 5 and all(len(s) > 1 and s.record["hidden_shape"][0] > s.record["chunk_tokens"] for s in shards)
    return root / "cache"


@pytest.fixture(scope="module")
def drafter(built, tmp_path_factory) -> Path:
    """A drafter trained on the intact cache, to evaluate on damaged copies."""
    out = tmp_path_factory.mktemp("clean_run") / "run"
    result = CliRunner().invoke(train_app, ["run", "--cache", str(built), "--out", str(out), *RUN])
    assert result.exit_code == 0, result.output
    return out / "drafter"


def _copy(built: Path, tmp_path: Path) -> Path:
    """A private copy of the cache at tmp_path/a/cache: from its shards/, `../../../x` is tmp_path/x."""
    cache = tmp_path / "a" / "cache"
    shutil.copytree(built, cache)
    return cache


def _one_line_error(output: str) -> str:
    lines = [line for line in output.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in output, output
    return lines[0]


def _manifest(cache: Path) -> dict:
    return json.loads((cache / fmt.MANIFEST).read_text())


def _rename_shard(cache: Path, index: int, name: str, record_too: bool = True) -> dict:
    """Rewrite the manifest so shard ``index`` is called ``name`` (and its commit record, found at
    shards/<name>.json, to match, as an attacker would, so that today's verify passes)."""
    manifest = _manifest(cache)
    record = dict(manifest["shards"][index], name=name)
    manifest["shards"][index] = record
    (cache / fmt.MANIFEST).write_text(json.dumps(manifest, indent=1))
    if record_too:
        path = Path(os.path.normpath(cache / fmt.SHARDS_DIR / f"{name}.json"))
        if path.parent.is_dir() and os.access(path.parent, os.W_OK):
            path.write_text(json.dumps(record, indent=1))
    return record


def _victim(cache: Path, tmp_path: Path, index: int = 0) -> Path:
    """A copy of one of the cache's shards (folder and commit record) outside the cache."""
    shard = _manifest(cache)["shards"][index]["name"]
    victim = tmp_path / "outside" / "victim"
    shutil.copytree(cache / fmt.SHARDS_DIR / shard, victim)
    shutil.copy(cache / fmt.SHARDS_DIR / f"{shard}.json", tmp_path / "outside" / "victim.json")
    return victim


def _refused_everywhere(cache: Path, *expected: str, checkpoint: Path | None = None) -> None:
    """open_cache raises; info, verify, run and eval each stop with one line holding ``expected``."""
    with pytest.raises(CacheError) as err:
        open_cache(str(cache))
    assert all(e in str(err.value) for e in expected), str(err.value)
    for app, args in [(cache_app, ["info", str(cache)]), (cache_app, ["verify", str(cache), "--quiet"]),
                      (train_app, ["run", "--cache", str(cache), "--out", str(cache.parent / "run"), *RUN]),
                      (train_app, ["eval", "--checkpoint", str(checkpoint or cache.parent / "none"), "--cache", str(cache),
                                   "--out", str(cache.parent / "eval.json"), "--quiet"])]:
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 1, (args, result.output)
        line = _one_line_error(result.output)
        assert all(e in line for e in expected), line
    assert not (cache.parent / "run").exists() and not (cache.parent / "eval.json").exists()


# --- 1. paths from the manifest and the commit records ------------------------------------------


def test_traversal_shard_name_reaching_a_copy_outside_is_refused(built, drafter, tmp_path):
    cache = _copy(built, tmp_path)
    victim = _victim(cache, tmp_path)
    name = os.path.relpath(victim, cache / fmt.SHARDS_DIR)
    assert name == "../../../outside/victim"
    _rename_shard(cache, 0, name)
    _refused_everywhere(cache, f"manifest.json names a shard {name!r}", "has a '..' component", "not trustworthy",
                        "rebuild the cache", checkpoint=drafter)


def test_a_name_that_climbs_to_the_filesystem_root_is_refused(built, tmp_path):
    cache = _copy(built, tmp_path)
    name = "../../../../../../../../.."
    _rename_shard(cache, 1, name, record_too=False)
    _refused_everywhere(cache, repr(name), "has a '..' component", "not trustworthy")


def test_absolute_shard_name_is_refused(built, tmp_path):
    cache = _copy(built, tmp_path)
    victim = _victim(cache, tmp_path)
    _rename_shard(cache, 0, str(victim), record_too=False)
    _refused_everywhere(cache, repr(str(victim)), "is an absolute path", "not trustworthy")


@pytest.mark.parametrize("name,problem", [
    ("", "is empty"), ("s3://bucket/shard-r00000-000000", "has a URL scheme"), ("file:shard-r00000-000000", "has a URL scheme"),
    ("shard-r00000-000000/../../x", "has a '..' component"), ("shard-r00000-000000/hidden.zarr", "has a path separator"),
    ("..\\..\\x", "has a backslash"), (".", "has an empty or '.' component"), ("manifest.json", "is not a shard name"),
    (7, "is not a string (int)"),
])
def test_any_other_name_that_is_not_a_shard_name_is_refused(built, tmp_path, name, problem):
    cache = _copy(built, tmp_path)
    _rename_shard(cache, 2, name, record_too=False)
    with pytest.raises(CacheError, match="not trustworthy") as err:
        open_cache(str(cache))
    assert f"names a shard {name!r}, which {problem}" in str(err.value)
    info = CliRunner().invoke(cache_app, ["info", str(cache)])
    assert info.exit_code == 1 and problem in _one_line_error(info.output)


def test_a_file_path_in_a_shard_record_must_stay_in_the_shard(built, tmp_path):
    cache = _copy(built, tmp_path)
    manifest = _manifest(cache)
    manifest["shards"][0]["files"]["../../../../outside/passwd"] = 10
    (cache / fmt.MANIFEST).write_text(json.dumps(manifest))
    _refused_everywhere(cache, "lists a file '../../../../outside/passwd'", "has a '..' component", "not trustworthy")


def test_a_commit_record_naming_a_path_outside_is_refused_by_verify(built, tmp_path):
    cache = _copy(built, tmp_path)
    name = _manifest(cache)["shards"][3]["name"]
    path = cache / fmt.SHARDS_DIR / f"{name}.json"
    record = json.loads(path.read_text())
    path.write_text(json.dumps(dict(record, name="../../../outside/victim")))
    verified = CliRunner().invoke(cache_app, ["verify", str(cache), "--quiet"])
    assert verified.exit_code == 1
    line = _one_line_error(verified.output)
    assert f"shards/{name}.json names a shard '../../../outside/victim'" in line
    assert f"the commit record shards/{name}.json is not trustworthy" in line


def test_a_symlinked_shard_folder_pointing_outside_is_refused(built, tmp_path):
    cache = _copy(built, tmp_path)
    names = [s["name"] for s in _manifest(cache)["shards"]]
    # a link that stays inside the cache is fine
    inside = cache / "elsewhere" / names[0]
    inside.parent.mkdir()
    shutil.move(cache / fmt.SHARDS_DIR / names[0], inside)
    (cache / fmt.SHARDS_DIR / names[0]).symlink_to(inside, target_is_directory=True)
    verified = CliRunner().invoke(cache_app, ["verify", str(cache), "--quiet"])
    assert verified.exit_code == 0, verified.output
    # one that leaves it is not
    victim = _victim(cache, tmp_path, 1)
    shard = cache / fmt.SHARDS_DIR / names[1]
    shutil.rmtree(shard)
    shard.symlink_to(victim, target_is_directory=True)
    _refused_everywhere(cache, f"{shard} is a symlink to {victim}, outside the cache", "not trustworthy")


@pytest.mark.parametrize("entry", [fmt.TOKENS, fmt.HIDDEN])
def test_a_symlink_inside_a_shard_pointing_outside_is_refused(built, tmp_path, entry):
    cache = _copy(built, tmp_path)
    shard = _first_read_shard(cache)
    victim = _victim(cache, tmp_path, [s["name"] for s in _manifest(cache)["shards"]].index(shard))
    link = cache / fmt.SHARDS_DIR / shard / entry
    shutil.rmtree(link) if link.is_dir() else link.unlink()
    link.symlink_to(victim / entry, target_is_directory=link.suffix == ".zarr")
    verified = CliRunner().invoke(cache_app, ["verify", str(cache), "--quiet"])
    assert verified.exit_code == 1
    assert f"{link} is a symlink to {victim / entry}, outside the cache" in _one_line_error(verified.output)
    trained = CliRunner().invoke(train_app, ["run", "--cache", str(cache), "--out", str(tmp_path / "run"), *RUN])
    assert trained.exit_code == 1
    assert f"{link} is a symlink to {victim / entry}, outside the cache" in _one_line_error(trained.output)


# --- 2. damaged bytes are never trained or evaluated on -----------------------------------------


def _first_read_shard(cache: Path) -> str:
    """The shard `run` reads first (the first sequence of its first batch)."""
    opened = open_cache(str(cache))
    return opened.shards[EpochPlan(opened, PLAN).batches(0)[0][0][0]].name


def _flip(path: Path, count: int, at: float = 0.5) -> None:
    """Invert ``count`` bytes in the middle of a file; its size stays the same."""
    data = bytearray(path.read_bytes())
    start = int(len(data) * at)
    data[start:start + count] = bytes(b ^ 0xFF for b in data[start:start + count])
    size = path.stat().st_size
    path.write_bytes(bytes(data))
    assert path.stat().st_size == size


def _chunk_file(cache: Path, shard: str) -> Path:
    files = [p for p in (cache / fmt.SHARDS_DIR / shard / fmt.HIDDEN).rglob("*") if p.is_file() and p.name != "zarr.json"]
    return max(files, key=lambda p: p.stat().st_size)


def _assert_damaged_line(output: str, url: Path, shard: str, problem: str) -> None:
    line = _one_line_error(output)
    assert f"{url}: 1 shard(s) fail the integrity check: {shard} ({problem})" in line, line
    assert f"run `dflash-cache verify {url}`" in line and f"--skip-shards {shard}" in line, line


def test_flipped_hidden_state_bytes_stop_run_and_eval_until_the_shard_is_skipped(built, drafter, tmp_path):
    cache = _copy(built, tmp_path)
    shard = _first_read_shard(cache)
    ids = next(s.ids for s in open_cache(str(cache)).shards if s.name == shard)
    assert any(is_heldout(i, EVAL_FRACTION) for i in ids)  # eval reads it too
    _flip(_chunk_file(cache, shard), 100)

    trained = CliRunner().invoke(train_app, ["run", "--cache", str(cache), "--out", str(tmp_path / "refused"), *RUN])
    assert trained.exit_code == 1
    _assert_damaged_line(trained.output, cache, shard, "hidden states checksum mismatch")
    assert not (tmp_path / "refused" / "checkpoints").exists() and not (tmp_path / "refused" / "drafter").exists()

    evaluated = CliRunner().invoke(train_app, ["eval", "--checkpoint", str(drafter), "--cache", str(cache),
                                               "--heldout-fraction", str(EVAL_FRACTION), "--out", str(tmp_path / "e.json")])
    assert evaluated.exit_code == 1
    _assert_damaged_line(evaluated.output, cache, shard, "hidden states checksum mismatch")
    assert not (tmp_path / "e.json").exists()

    skipped = CliRunner().invoke(train_app, ["run", "--cache", str(cache), "--out", str(tmp_path / "skipping"), *RUN,
                                             "--skip-shards", shard])
    assert skipped.exit_code == 0, skipped.output
    assert (tmp_path / "skipping" / "drafter").exists()
    # the hint holds for eval too: it evaluates on the rest of the held-out split
    evaluated = CliRunner().invoke(train_app, ["eval", "--checkpoint", str(drafter), "--cache", str(cache),
                                               "--heldout-fraction", str(EVAL_FRACTION), "--out", str(tmp_path / "e.json"),
                                               "--skip-shards", shard])
    assert evaluated.exit_code == 0, evaluated.output
    assert json.loads((tmp_path / "e.json").read_text())["offline"]["positions"] > 0


def test_loader_workers_report_a_damaged_shard_in_one_line(built, tmp_path):
    cache = _copy(built, tmp_path)
    shard = _first_read_shard(cache)
    _flip(_chunk_file(cache, shard), 100)
    trained = CliRunner().invoke(train_app, ["run", "--cache", str(cache), "--out", str(tmp_path / "run"), *RUN,
                                             "--num-workers", "1"])
    assert trained.exit_code == 1
    _assert_damaged_line(trained.output, cache, shard, "hidden states checksum mismatch")


@pytest.mark.parametrize("name", [fmt.TOKENS, fmt.SEQUENCES])
def test_a_flipped_arrow_byte_stops_run(built, tmp_path, name):
    cache = _copy(built, tmp_path)
    shards = [s["name"] for s in _manifest(cache)["shards"]]
    # tokens.arrow is checked when the shard is first read; sequences.arrow of every shard when the
    # epoch is planned, so the last shard's is caught before anything is read
    shard = _first_read_shard(cache) if name == fmt.TOKENS else shards[-1]
    _flip(cache / fmt.SHARDS_DIR / shard / name, 1)
    trained = CliRunner().invoke(train_app, ["run", "--cache", str(cache), "--out", str(tmp_path / "run"), *RUN])
    assert trained.exit_code == 1
    _assert_damaged_line(trained.output, cache, shard, f"{name} checksum mismatch")
    skipped = CliRunner().invoke(train_app, ["run", "--cache", str(cache), "--out", str(tmp_path / "skip"), *RUN,
                                             "--skip-shards", shard])
    assert skipped.exit_code == 0, skipped.output


def test_eval_runs_the_same_shard_check_as_run(built, drafter, tmp_path):
    cache = _copy(built, tmp_path)
    shards = [s["name"] for s in _manifest(cache)["shards"]]
    shutil.rmtree(cache / fmt.SHARDS_DIR / shards[2])
    outputs = [CliRunner().invoke(train_app, args).output for args in (
        ["run", "--cache", str(cache), "--out", str(tmp_path / "run"), *RUN],
        ["eval", "--checkpoint", str(drafter), "--cache", str(cache), "--out", str(tmp_path / "e.json")])]
    lines = [_one_line_error(o) for o in outputs]
    assert lines[0] == lines[1] and f"{shards[2]} (shard folder missing)" in lines[0], lines
    assert f"--skip-shards {shards[2]}" in lines[0]


def test_each_shard_is_hashed_once_per_process_and_again_when_its_files_change(built, tmp_path, monkeypatch):
    cache = _copy(built, tmp_path)
    hashed = []
    real = integrity._hash_hidden
    monkeypatch.setattr(integrity, "_hash_hidden", lambda shard, expected: hashed.append(shard.name) or real(shard, expected))
    opened = open_cache(str(cache))
    refs = [(0, 0), (0, 1)]
    load_batch(opened, PLAN, refs, epoch=0, draft_positions=3)
    load_batch(opened, PLAN, refs, epoch=0, draft_positions=3)
    load_batch(open_cache(str(cache)), PLAN, refs, epoch=0, draft_positions=3)  # another open in this process: known bytes
    assert hashed == [opened.shards[0].name]

    _flip(_chunk_file(cache, opened.shards[0].name), 100)  # rewritten in place: a new identity
    with pytest.raises(CacheError, match=f"{opened.shards[0].name} \\(hidden states checksum mismatch\\)"):
        load_batch(open_cache(str(cache)), PLAN, refs, epoch=0, draft_positions=3)
    assert hashed == [opened.shards[0].name] * 2


def test_the_zarr_read_path_is_checked_the_same(built, tmp_path):
    cache = _copy(built, tmp_path)
    name = _manifest(cache)["shards"][1]["name"]
    opened = open_cache(str(cache))
    opened.shards[1].files.__dict__["fast_hidden"] = None  # as for compressed or remote shards
    assert opened.shards[1].checksum_problems() == []
    _flip(_chunk_file(cache, name), 100)
    reopened = open_cache(str(cache))
    reopened.shards[1].files.__dict__["fast_hidden"] = None
    assert reopened.shards[1].checksum_problems() == ["hidden states checksum mismatch"]
    assert reopened.shards[1].checksum_problems([fmt.TOKENS, fmt.SEQUENCES]) == []


# --- 3. the teacher head: checksummed like the shards, and checked for its dtype and values ------


def _rewrite_head(cache: Path, change, record: bool) -> None:
    """Rewrite teacher/head.safetensors with `change` applied to its tensors; with `record`, the
    manifest's checksum is made to match (so only the dtype or value checks can see it), without,
    the record is dropped as in a cache built before the head was checksummed."""
    import safetensors.torch

    path = cache / fmt.TEACHER_DIR / fmt.TEACHER_HEAD
    data = safetensors.torch.save(change(safetensors.torch.load(path.read_bytes())))
    path.write_bytes(data)
    manifest = _manifest(cache)
    if record:
        manifest["teacher_head"] = fmt.teacher_head_record(data)
    else:
        manifest.pop("teacher_head")
    (cache / fmt.MANIFEST).write_text(json.dumps(manifest, indent=1))


def _nan_row(tensors):
    tensors["lm_head.weight"][7] = float("nan")  # one row: the width, 64 values
    return tensors


def _int8(tensors):
    import torch

    tensors["lm_head.weight"] = tensors["lm_head.weight"].to(torch.int8)
    return tensors


@pytest.mark.parametrize("damage,expected", [
    ("one flipped byte", "teacher/head.safetensors does not match the checksum the manifest records"),
    ("a NaN row", "teacher/head.safetensors holds 64 NaN/Inf value(s) in lm_head.weight"),
    ("an int8 head", "teacher/head.safetensors holds lm_head.weight as int8; a teacher head is float16, bfloat16, float32"),
    ("a NaN row in a cache built before the head checksum", "holds 64 NaN/Inf value(s) in lm_head.weight"),
])
def test_a_damaged_teacher_head_stops_run_and_verify(built, tmp_path, damage, expected):
    """The head was outside the checksums: a flipped byte, a NaN row or an int8 head trained
    silently and verify said ok. Now each is one line in run and a BAD line in verify."""
    cache = _copy(built, tmp_path)
    assert _manifest(cache)["teacher_head"]["checksum"]  # recorded at build
    head = cache / fmt.TEACHER_DIR / fmt.TEACHER_HEAD
    if damage == "one flipped byte":
        _flip(head, 1, at=0.9)
    else:
        _rewrite_head(cache, _int8 if damage == "an int8 head" else _nan_row, record="before" not in damage)
    before = head.read_bytes()
    result = CliRunner().invoke(train_app, ["run", "--cache", str(cache), "--out", str(tmp_path / "run"), *RUN])
    assert result.exit_code == 1, result.output
    assert expected in _one_line_error(result.output) and "rebuild the cache" in result.output, result.output
    assert not (tmp_path / "run" / "checkpoints").exists()
    verify = CliRunner().invoke(cache_app, ["verify", str(cache), "--quiet"])
    assert verify.exit_code == 1 and f"BAD teacher head: {cache}: " in verify.output and expected in verify.output, \
        verify.output
    assert "error: the teacher head is damaged" in verify.output
    assert head.read_bytes() == before


def test_a_cache_built_before_the_head_checksum_still_trains_and_verify_says_it_was_not_compared(built, tmp_path):
    cache = _copy(built, tmp_path)
    manifest = _manifest(cache)
    del manifest["teacher_head"]
    (cache / fmt.MANIFEST).write_text(json.dumps(manifest, indent=1))
    verify = CliRunner().invoke(cache_app, ["verify", str(cache), "--quiet"])
    assert verify.exit_code == 0, verify.output
    assert "note: teacher/head.safetensors was not compared with a checksum" in verify.output
    result = CliRunner().invoke(train_app, ["run", "--cache", str(cache), "--out", str(tmp_path / "run"), *RUN])
    assert result.exit_code == 0, result.output
    assert "not compared" not in CliRunner().invoke(cache_app, ["verify", str(built), "--quiet"]).output
