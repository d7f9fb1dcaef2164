"""Resuming under torchrun (issue 42, finding 6): rank 0 decides which checkpoint the run continues
and every rank checks that it sees it, so a node-local --out that only rank 0's node holds the
checkpoint in stops every rank with one line instead of a run where rank 0 resumes and the others
start at step 0 (their collectives stop matching: a hang). Real gloo processes; each rank gets its
own --out (what a node-local folder is), set from its RANK by the launched command."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from helpers import qa_rows
from test_idle_rank import torchrun

CLI = str(Path(sys.executable).with_name("dflash-train"))
ARGS = ["--num-layers", "1", "--block-size", "4", "--batch-tokens", "60",
        "--heldout-fraction", "0", "--save-every", "1", "--log-every", "1", "--eval-sequences", "0", "--quiet"]


@pytest.fixture(scope="module")
def cache(tiny_cache) -> str:
    return tiny_cache(rows=qa_rows(3, seed=1, prefix="idle-"))


def per_rank_out(base: Path, *args, timeout: float = 120):
    """A 2-rank torchrun launch of dflash-train whose rank R trains with --out BASE/node-R."""
    return torchrun(2, "-c", f'exec "$0" "$@" --out "{base}/node-$RANK"', CLI, *args, timeout=timeout, program="sh")


@pytest.mark.slow
def test_a_checkpoint_only_rank_0_sees_stops_every_rank_in_one_line(tmp_path, cache):
    first = torchrun(2, "run", "--cache", cache, "--out", str(tmp_path / "run"), "--steps", "2", *ARGS)
    assert first.returncode == 0, first.stderr[-3000:]
    # node 0's folder holds the run; node 1's only its config (a node-local --out)
    shutil.copytree(tmp_path / "run", tmp_path / "nodes" / "node-0")
    shutil.copytree(tmp_path / "run", tmp_path / "nodes" / "node-1", ignore=shutil.ignore_patterns("checkpoints"))
    done = per_rank_out(tmp_path / "nodes", "run", "--cache", cache, "--resume", "--steps", "4", *ARGS)
    assert done.returncode != 0
    line = (f"rank 0 resumes from checkpoint {tmp_path}/nodes/node-{{}}/checkpoints/step-000002, which rank(s) 1 of 2 "
            "cannot see (a node-local --out?)")
    for rank in (0, 1):  # every rank says it, each with its own path
        assert f"error: {line.format(rank)}" in done.stderr, done.stderr[-3000:]
    assert not (tmp_path / "nodes" / "node-0" / "checkpoints" / "step-000003").exists()

    # both nodes holding it: both resume, from rank 0's choice
    shutil.copytree(tmp_path / "run" / "checkpoints", tmp_path / "nodes" / "node-1" / "checkpoints")
    shutil.rmtree(tmp_path / "nodes" / "node-1" / "checkpoints" / "step-000002")  # older: rank 0 still decides
    shutil.copytree(tmp_path / "run" / "checkpoints" / "step-000002", tmp_path / "nodes" / "node-1" / "checkpoints" / "step-000002")
    done = per_rank_out(tmp_path / "nodes", "run", "--cache", cache, "--resume", "--steps", "4", *ARGS)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "nodes" / "node-0" / "checkpoints" / "step-000004" / "COMPLETE").exists()
