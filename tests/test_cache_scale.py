"""A cache of thousands of shards, written by the real build: it opens without reading a shard,
trains, and a killed-and-resumed run continues it (issue #32). Slow (make test-slow): ~2,000
one-sequence shards take a few minutes to write on two cores."""

from __future__ import annotations

import json

import pytest
from helpers import qa_rows, write_jsonl
from typer.testing import CliRunner

from cli.cache import app as cache_app
from cli.train import app as train_app
from dflash_cache import open_cache

SHARDS = 2_000
RUN = ["--num-layers", "1", "--block-size", "4", "--batch-tokens", "400", "--eval-sequences", "0",
       "--heldout-fraction", "0.01", "--save-every", "2", "--quiet"]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # a teacher forward and a commit per shard: ~2-3 min on an idle 2-core machine
def test_thousands_of_shards_open_train_and_resume(tmp_path, teacher_dir):
    data = write_jsonl(tmp_path / "chat.jsonl", qa_rows(SHARDS, seed=9, prefix="k-"))
    out = tmp_path / "cache"
    built = CliRunner().invoke(cache_app, ["build", "--teacher", teacher_dir("qwen3"), "--data", data, "--out", str(out),
                                           "--dtype", "float32", "--layers", "0,2", "--top-k", "4",
                                           "--shard-size", "1", "--quiet"])  # one sequence a shard
    assert built.exit_code == 0, built.output
    cache = open_cache(str(out))
    assert cache.version == 2 and len(cache.shards) == SHARDS == len(cache)
    manifest = (out / "manifest.json").stat().st_size
    assert manifest < 16_000, manifest  # the manifest does not grow with the shards: the index does

    run = tmp_path / "run"
    first = CliRunner().invoke(train_app, ["run", "--cache", str(out), "--out", str(run), "--steps", "2", *RUN])
    assert first.exit_code == 0, first.output
    resumed = CliRunner().invoke(train_app, ["run", "--cache", str(out), "--out", str(run), "--steps", "4", "--resume", *RUN])
    assert resumed.exit_code == 0, resumed.output
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if json.loads(line).get("kind") == "train"]
    assert steps == [1, 2, 3, 4], steps
    straight = tmp_path / "straight"
    assert CliRunner().invoke(train_app, ["run", "--cache", str(out), "--out", str(straight), "--steps", "4", *RUN]).exit_code == 0
    losses = [[json.loads(line)["loss"] for line in (folder / "metrics.jsonl").read_text().splitlines()
               if json.loads(line).get("kind") == "train"] for folder in (run, straight)]
    assert losses[0] == losses[1]  # the resumed run continued the same batches, bit for bit
