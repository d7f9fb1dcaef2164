"""DDP training under real torchrun processes: equals one process, resumes across world sizes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import safetensors.torch
import torch
from test_train import cache_url  # noqa: F401  (module fixture reused)
from typer.testing import CliRunner

from cli.train import app

ROOT = Path(__file__).resolve().parents[1]
CLI = str(Path(sys.executable).with_name("dflash-train"))
ARGS = ["--steps", "6", "--num-layers", "1", "--block-size", "4", "--batch-tokens", "500", "--num-anchors", "4",
        "--heldout-fraction", "0.05", "--save-every", "3", "--log-every", "1", "--eval-sequences", "0",
        "--noise", "cosine", "--quiet"]


def _torchrun(*args):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--no-python", CLI, *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]


def _params(run: Path, step: int) -> dict:
    return safetensors.torch.load_file(str(run / "checkpoints" / f"step-{step:06d}" / "model.safetensors"))


def _close(a: dict, b: dict):
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-6)


def test_ddp_equals_one_process_and_resumes_across_world_sizes(tmp_path, cache_url):  # noqa: F811
    single = tmp_path / "single"
    assert CliRunner().invoke(app, ["run", "--cache", cache_url, "--out", str(single), *ARGS]).exit_code == 0

    # two ranks, same global batches: the same parameters after every checkpoint
    ddp = tmp_path / "ddp"
    _torchrun("run", "--cache", cache_url, "--out", str(ddp), *ARGS)
    _close(_params(single, 3), _params(ddp, 3))
    _close(_params(single, 6), _params(ddp, 6))
    assert (ddp / "drafter" / "model.safetensors").exists()

    # a two-rank run resumed by one process continues the same global sequence order
    two_then_one = tmp_path / "two_then_one"
    shutil.copytree(ddp, two_then_one)
    shutil.rmtree(two_then_one / "checkpoints" / "step-000006")
    result = CliRunner().invoke(app, ["run", "--cache", cache_url, "--out", str(two_then_one), "--resume", *ARGS])
    assert result.exit_code == 0, result.output
    _close(_params(single, 6), _params(two_then_one, 6))

    # and the reverse: a one-process run resumed by two ranks
    one_then_two = tmp_path / "one_then_two"
    shutil.copytree(single, one_then_two)
    shutil.rmtree(one_then_two / "checkpoints" / "step-000006")
    _torchrun("run", "--cache", cache_url, "--out", str(one_then_two), "--resume", *ARGS)
    _close(_params(single, 6), _params(one_then_two, 6))
