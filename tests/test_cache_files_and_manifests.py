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
