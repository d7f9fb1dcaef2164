"""A disk that fills up under `dflash-train run`, `export`, `eval` and `dflash-cache build`: one
line naming the file and what is intact, nothing committed lost, and the same command (with
--resume for a run) going on once there is space.

The disk is a real one: a tmpfs of a few hundred kilobytes mounted by the test (root only; the
tests skip where mounting is not allowed). tests/test_reliability.py fills an fsspec store instead.
"""

from __future__ import annotations

import errno
import os
import re
import subprocess
import uuid
from pathlib import Path

import pytest
from helpers import qa_rows, write_jsonl
from typer.testing import CliRunner

from cli.cache import app as cache_app
from cli.train import app as train_app
from dflash_common.errors import DiskFullError
from dflash_common.files import is_disk_full, write_new_file
from dflash_train.training.checkpoint import CheckpointManager

RUN_ARGS = ["--num-layers", "1", "--block-size", "4", "--batch-tokens", "300", "--heldout-fraction", "0.05",
            "--save-every", "2", "--keep-checkpoints", "10", "--log-every", "1", "--eval-sequences", "0", "--quiet"]


class SmallDisk:
    """A tmpfs of `size` bytes at `path`; `grow(size)` frees space as a user would."""

    def __init__(self, path: Path, size: int):
        self.path = path
        path.mkdir(parents=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here ({done.stderr.decode().strip() or done.returncode}); "
                        "the disk-full tests need root")

    def grow(self, size: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={size}", str(self.path)], check=True)

    def fill(self) -> None:
        """Take every byte left, as another program would."""
        with open(self.path / "filler", "wb", buffering=0) as f:
            try:
                while f.write(b"\0" * 4096):
                    pass
            except OSError as err:
                assert err.errno == errno.ENOSPC

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], check=False)


@pytest.fixture
def small_disk(tmp_path):
    disks: list[SmallDisk] = []

    def make(size: int) -> SmallDisk:
        disks.append(SmallDisk(tmp_path / f"disk-{uuid.uuid4().hex[:6]}", size))
        return disks[-1]

    yield make
    for disk in disks:
        disk.unmount()


def _one_line_error(output: str) -> str:
    lines = [line for line in output.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in output and "a bug in dflash" not in output, output
    return lines[0]


def _leftovers(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if ".tmp-" in p.name)


# --- pure pieces -----------------------------------------------------------------------------


def test_disk_full_is_recognised_through_the_wrappers_libraries_use():
    enospc = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert is_disk_full(enospc) and is_disk_full(OSError(errno.EDQUOT, "Disk quota exceeded"))
    wrapped = RuntimeError("writing failed")
    wrapped.__cause__ = enospc
    assert is_disk_full(wrapped)
    # safetensors' Rust error names the errno in its text only
    assert is_disk_full(Exception("Error while serializing: I/O error: No space left on device (os error 28)"))
    assert not is_disk_full(OSError(errno.EACCES, "Permission denied")) and not is_disk_full(RuntimeError("os error 2)"))
    line = str(DiskFullError("/d/x", "step-000002 is intact", "rerun it"))
    assert line == ("no space left on the disk while writing /d/x; step-000002 is intact: free space on that disk "
                    "(or its quota), then rerun it")


def test_a_torch_save_on_a_full_disk_is_known_as_one(small_disk):
    import torch

    disk = small_disk(64 * 1024)
    with pytest.raises(RuntimeError) as plain:  # torch.save to a path: "unexpected pos N vs M", the errno lost
        torch.save({"w": torch.zeros(100_000)}, disk.path / "plain.pt")
    assert not is_disk_full(plain.value)
    os.remove(disk.path / "plain.pt")
    with pytest.raises(Exception) as whole:  # through write_new_file the ENOSPC of the write is in the chain
        write_new_file(disk.path / "whole.pt", lambda f: torch.save({"w": torch.zeros(100_000)}, f))
    assert is_disk_full(whole.value)


# --- dflash-train run, export, eval ------------------------------------------------------------


@pytest.fixture(scope="module")
def run_cache(tiny_cache):
    return tiny_cache(rows=qa_rows(48, seed=2, prefix="r2-"))


def test_a_run_whose_disk_fills_up_names_the_file_and_the_checkpoint_it_keeps(run_cache, small_disk):
    disk = small_disk(1400 * 1024)  # two of these checkpoints fit, the third does not
    out = disk.path / "run"
    failed = CliRunner().invoke(train_app, ["run", "--cache", run_cache, "--out", str(out), "--steps", "30", *RUN_ARGS])
    assert failed.exit_code == 1
    line = _one_line_error(failed.output)
    named = re.fullmatch(rf"error: no space left on the disk while writing {re.escape(str(out))}/\S+; the newest complete "
                         r"checkpoint, (\S+), is intact: free space on that disk \(or its quota\), then rerun the same "
                         r"command with --resume to continue from it", line)
    assert named, line
    kept = Path(named.group(1))
    assert kept == CheckpointManager(out / "checkpoints").latest() and kept.name != "step-000000"
    CheckpointManager.load(kept)  # whole: it loads and its weights match its config
    assert _leftovers(out) == []  # the unfinished save was removed, its space given back


@pytest.mark.slow
def test_a_run_resumed_after_freeing_space_equals_an_uninterrupted_run(run_cache, small_disk, tmp_path):
    args = ["--steps", "12", *RUN_ARGS]
    clean = CliRunner().invoke(train_app, ["run", "--cache", run_cache, "--out", str(tmp_path / "clean"), *args])
    assert clean.exit_code == 0, clean.output
    disk = small_disk(1400 * 1024)
    out = disk.path / "run"
    failed = CliRunner().invoke(train_app, ["run", "--cache", run_cache, "--out", str(out), *args])
    assert failed.exit_code == 1 and "with --resume" in _one_line_error(failed.output)
    disk.grow(32 * 1024 * 1024)
    resumed = CliRunner().invoke(train_app, ["run", "--cache", run_cache, "--out", str(out), "--resume", *args])
    assert resumed.exit_code == 0, resumed.output
    name = "drafter/model.safetensors"
    assert (out / name).read_bytes() == (tmp_path / "clean" / name).read_bytes()


@pytest.fixture(scope="module")
def checkpoint(run_cache, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("disk_full_run") / "run"
    done = CliRunner().invoke(train_app, ["run", "--cache", run_cache, "--out", str(out), "--steps", "2", *RUN_ARGS])
    assert done.exit_code == 0, done.output
    return out / "checkpoints" / "step-000002"


def test_an_export_onto_a_full_disk_is_one_line_and_leaves_nothing(checkpoint, small_disk):
    disk = small_disk(64 * 1024)  # the weights (~200 kB) do not fit
    target = disk.path / "drafter"
    failed = CliRunner().invoke(train_app, ["export", str(checkpoint), str(target)])
    assert failed.exit_code == 1
    line = _one_line_error(failed.output)
    assert line.startswith(f"error: no space left on the disk while writing {target}/model.safetensors; nothing was "
                           f"written to {target}"), line
    assert line.endswith("then rerun the same command")
    assert os.listdir(disk.path) == []  # its staging folder is gone
    CheckpointManager.load(checkpoint)


def test_eval_onto_a_full_disk_says_the_report_was_not_written(checkpoint, run_cache, small_disk):
    disk = small_disk(64 * 1024)
    disk.fill()
    report = disk.path / "eval.json"
    failed = CliRunner().invoke(train_app, ["eval", "--checkpoint", str(checkpoint), "--cache", run_cache,
                                            "--max-sequences", "2", "--out", str(report), "--quiet"])
    assert failed.exit_code == 1
    line = _one_line_error(failed.output)
    assert line.startswith(f"error: no space left on the disk while writing {report}; the report was not written"), line
    assert "run the same command again (or pass --out a file on another disk)" in line
    assert sorted(os.listdir(disk.path)) == ["filler"]


# --- dflash-cache build on a local disk ----------------------------------------------------------


def test_a_build_whose_disk_fills_up_names_the_shard_and_resumes(teacher_dir, small_disk, tmp_path):
    data = write_jsonl(tmp_path / "chat.jsonl", qa_rows(48, seed=2, prefix="r2-"))
    disk = small_disk(1400 * 1024)  # the teacher's files (~0.9 MB) and a few shards
    out = disk.path / "cache"
    args = ["build", "--teacher", teacher_dir("qwen3"), "--data", data, "--dtype", "float32", "--layers", "0,2",
            "--top-k", "4", "--shard-size", "40kB", "--quiet", "--out", str(out)]
    failed = CliRunner().invoke(cache_app, args)
    assert failed.exit_code == 1
    line = _one_line_error(failed.output)
    named = re.fullmatch(rf"error: no space left on the disk while writing shard shard-r00000-(\d+) of {re.escape(str(out))}; "
                         r"the (\d+) shard\(s\) of this rank committed before it are intact and a rerun keeps them: free "
                         r"space on that disk \(or its quota\), then rerun the same command to resume", line)
    assert named and int(named.group(1)) == int(named.group(2)) and int(named.group(1)) > 0, line
    checked = CliRunner().invoke(cache_app, ["verify", str(out), "--quiet"])  # the committed shards are whole
    assert checked.exit_code == 0, checked.output
    disk.grow(32 * 1024 * 1024)
    resumed = CliRunner().invoke(cache_app, args)
    assert resumed.exit_code == 0, resumed.output
    verified = CliRunner().invoke(cache_app, ["verify", str(out), "--quiet"])
    assert verified.exit_code == 0, verified.output
