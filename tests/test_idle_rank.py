"""A rank with nothing to train on at a step (its partitions ran out, or its batch holds no valid
position) under real gloo torchrun processes: DSpark and DFlash2 have weights that only the loss
reads, outside the forward (the Markov head's W2, the selector's successor codebook); an idle rank
must still give them a (zero) gradient, or DDP's all-reduce and FSDP2's reduce-scatter of the
other ranks wait for it forever or abort (issue 42, finding 2). LiLiCorr's correlator (with and
without convolutions) is reached by the loss alone, through its scores (issue 56)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import qa_rows

from dflash_cache import open_cache
from dflash_train.settings.data_config import DataConfig
from dflash_train.settings.loss_config import LossConfig
from dflash_train.training.batch import Batch
from dflash_train.training.batch_objective import batch_loss
from dflash_train.training.epoch_plan import EpochPlan

ROOT = Path(__file__).resolve().parents[1]
CLI = str(Path(sys.executable).with_name("dflash-train"))
# 36-58-token sequences in 60-token batches: one sequence a partition a step
ARGS = ["--steps", "3", "--num-layers", "1", "--block-size", "4", "--batch-tokens", "60",
        "--heldout-fraction", "0", "--save-every", "3", "--log-every", "1", "--eval-sequences", "0", "--quiet"]
LILICORR = ["--model-kind", "lilicorr", "--lilicorr-candidates", "4", "--lilicorr-hidden-size", "32", "--lilicorr-heads", "2"]
KINDS = {"dflash": ["--model-kind", "dflash"], "dspark": ["--model-kind", "dspark", "--markov-rank", "4"],
         "dflash2": ["--model-kind", "dflash2"],
         "lilicorr": LILICORR, "lilicorr+conv": [*LILICORR, "--lilicorr-conv", "--conv-group-size", "8"]}


@pytest.fixture(scope="module")
def caches(tiny_cache) -> dict[int, str]:
    """The cache for each world size: 3 sequences for 2 ranks, 2 for 3 ranks."""
    return {2: tiny_cache(rows=qa_rows(3, seed=1, prefix="idle-")), 3: tiny_cache(rows=qa_rows(2, seed=1, prefix="idle-"))}


def torchrun(ranks: int, *args, timeout: float = 240, program: str = CLI) -> subprocess.CompletedProcess:
    """A real torchrun launch of dflash-train (or `program`) on gloo; a hang is a failure after `timeout`."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--no-python", program, *args]
    # a session of its own, so a hang is ended with every rank (torchrun alone would leave them)
    process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        pytest.fail(f"the {ranks}-rank run hung for {timeout:.0f} s: {stderr[-2000:]}")
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def test_the_caches_leave_a_rank_idle(caches):
    """Guards the runs below against a changed fixture: over 2 ranks partitions of 1 and 2
    sequences (a rank idle at the second step), over 3 one partition empty (a rank idle always)."""
    data = DataConfig(batch_tokens=60, heldout_fraction=0)
    sizes = {n: sorted(len(p) for p in EpochPlan(open_cache(caches[n]), data).partitions(0, n)) for n in (2, 3)}
    assert sizes == {2: [1, 2], 3: [0, 1, 1]}, sizes


@pytest.mark.fast_cases(2)
@pytest.mark.parametrize(("strategy", "kind", "ranks"), [
    ("ddp", "dspark", 2), ("fsdp", "dflash2", 2), ("ddp", "dflash2", 2), ("fsdp", "dspark", 2),
    ("ddp", "dspark", 3), ("fsdp", "dflash2", 3), ("ddp", "dflash2", 3), ("fsdp", "dspark", 3),
    ("ddp", "dflash", 2), ("fsdp", "dflash", 2), ("ddp", "dflash", 3), ("fsdp", "dflash", 3),
    ("ddp", "lilicorr", 2), ("fsdp", "lilicorr", 3), ("fsdp", "lilicorr+conv", 2), ("ddp", "lilicorr+conv", 3),
])
def test_an_idle_rank_joins_the_gradient_reduction(tmp_path, caches, strategy, kind, ranks):
    out = tmp_path / "run"
    done = torchrun(ranks, "run", "--cache", caches[ranks], "--out", str(out), "--strategy", strategy,
                    "--data-partitions", str(ranks), *KINDS[kind], *ARGS)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (out / "drafter" / "model.safetensors").exists()


@pytest.mark.parametrize("kind", ["dspark", "dflash2", "lilicorr"])
def test_a_batch_without_a_valid_position_reaches_every_trained_weight(kind):
    """The other idle case, a batch whose positions all fall outside the loss mask: its zero loss
    still reaches every trained weight, those only the loss reads included."""
    from test_dflash2 import _drafter as dflash2_drafter
    from test_dspark import _drafter as dspark_drafter
    from test_lilicorr import _drafter as lilicorr_drafter
    from test_speculative import LAYER_IDS, RUN_VOCAB, run_teacher

    build = {"dspark": dspark_drafter, "dflash2": dflash2_drafter, "lilicorr": lilicorr_drafter}[kind]
    drafter = build(run_teacher("qwen3", 0.1)).train()
    torch.manual_seed(0)
    batch = Batch(ids=["a"], hidden=torch.randn(1, 12, len(LAYER_IDS), 64), input_ids=torch.randint(0, RUN_VOCAB - 1, (1, 12)),
                  loss_mask=torch.zeros(1, 12, dtype=torch.bool), lengths=torch.tensor([12]),
                  topk_ids=torch.randint(0, RUN_VOCAB - 1, (1, 12, 3)), topk_logprobs=torch.full((1, 12, 3), -2.0),
                  anchors=torch.tensor([[3, 6]]))
    out = batch_loss(drafter, batch, LossConfig())
    assert int(out.count.sum()) == 0
    out.loss.backward()
    missing = [name for name, p in drafter.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, missing
    # the weights this is about: those only the loss reads, or (LiLiCorr) a head the loss alone reaches
    assert drafter.loss_weights or drafter.lilicorr is not None
