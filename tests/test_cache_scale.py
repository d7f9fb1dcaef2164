"""A cache of thousands of shards, written by the real build: it opens without reading a shard,
trains, and a killed-and-resumed run continues it (issue #32). Slow (make test-slow): ~2,000
one-sequence shards take a few minutes to write on two cores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import qa_rows, write_jsonl
from typer.testing import CliRunner

from cli.cache import app as cache_app
from cli.train import app as train_app
from dflash_cache import open_cache

ROOT = Path(__file__).resolve().parents[1]
SHARDS = 2_000
RUN = ["--num-layers", "1", "--block-size", "4", "--batch-tokens", "400", "--eval-sequences", "0",
       "--heldout-fraction", "0.01", "--save-every", "2", "--log-every", "1", "--quiet"]


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

    # killed while saving its second checkpoint (step 4), resumed from step 2: the same curve as a
    # run never stopped, loss and learning rate, bit for bit
    run, straight = tmp_path / "run", tmp_path / "straight"
    args = ["run", "--cache", str(out), "--steps", "6", *RUN]
    killed = subprocess.run([sys.executable, "-m", "cli.train", *args, "--out", str(run)], cwd=ROOT, capture_output=True,
                            text=True, env={**os.environ, "DFLASH_FAULT": "checkpoint_after_files:2"}, timeout=900)
    assert killed.returncode == -9, killed.stderr[-3000:]
    resumed = CliRunner().invoke(train_app, [*args, "--out", str(run), "--resume"])
    assert resumed.exit_code == 0 and "(step 2)" in resumed.output, resumed.output
    assert CliRunner().invoke(train_app, [*args, "--out", str(straight)]).exit_code == 0
    curves = [{r["step"]: (r["loss"], r["lr"]) for r in map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())
               if r.get("kind") == "train"} for folder in (run, straight)]
    assert sorted(curves[1]) == [1, 2, 3, 4, 5, 6] and curves[0] == curves[1]
