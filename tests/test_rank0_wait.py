"""Rank 0's solo work under torchrun (checkpoint saves, the held-out evaluation, the export): the
other ranks wait for it under --save-timeout, not under the collectives' timeout, so a save slower
than NCCL's 10 minutes does not stop the run (issue 42, finding 7). Real gloo processes, the save
slowed by the fault hook DFLASH_FAULT_SLEEP."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from helpers import qa_rows
from test_idle_rank import torchrun

from dflash_common.faults import SLEEP_ENV, parse_faults
from dflash_train.training.distributed import process_group_options

ARGS = ["--steps", "2", "--num-layers", "1", "--block-size", "4", "--batch-tokens", "60",
        "--heldout-fraction", "0", "--save-every", "1", "--log-every", "1", "--eval-sequences", "0", "--quiet"]


def test_the_process_group_gets_the_collective_timeout():
    assert process_group_options(torch.device("cpu"), 42.0)["timeout"] == timedelta(seconds=42)
    assert process_group_options(torch.device("cuda", 1), 7.0)["timeout"] == timedelta(seconds=7)
    assert "timeout" not in process_group_options(torch.device("cpu"))
    assert parse_faults("checkpoint_after_files:15@0", rank=0, env=SLEEP_ENV) == {"checkpoint_after_files": 15}


@pytest.mark.slow
def test_a_save_slower_than_the_collective_timeout_does_not_stop_the_run(tmp_path, tiny_cache, monkeypatch):
    cache = tiny_cache(rows=qa_rows(3, seed=1, prefix="idle-"))
    # rank 0 sleeps 15 s in each checkpoint save, after its files are written; collectives time out after 8
    monkeypatch.setenv(SLEEP_ENV, "checkpoint_after_files:15@0")
    done = torchrun(2, "run", "--cache", cache, "--out", str(tmp_path / "run"), "--collective-timeout", "8", *ARGS)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "run" / "checkpoints" / "step-000002" / "COMPLETE").exists()

    # the wait has its own limit, and running out of it is one line naming the knob
    done = torchrun(2, "run", "--cache", cache, "--out", str(tmp_path / "short"), "--collective-timeout", "8",
                    "--save-timeout", "3", *ARGS)
    assert done.returncode != 0
    assert ("error: rank 1 waited more than 3 s (--save-timeout) for rank 0 to finish saving checkpoint step 1"
            in done.stderr), done.stderr[-3000:]
