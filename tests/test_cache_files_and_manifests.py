"""A cache received from someone else, round five (issue 60): the teacher files it carries are read
only as bounded regular files inside it, a build resumed over an edited manifest names the field
it cannot use, and `info` fails on a manifest it can only partly describe. Real caches written by
the real build, the real commands through typer's runner (a subprocess with a timeout where a hang
would be the failure)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import qa_rows
from test_untrusted_index import _copy, _one_line_error
from typer.testing import CliRunner

from cli.cache import app as cache_app


@pytest.fixture(scope="module")
def built(tiny_cache) -> Path:
    return Path(tiny_cache(rows=qa_rows(40, seed=8, prefix="ix-"), format_version=2, shard_bytes=30_000))


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
