"""benchmarks/gpu_check.sh, the device check, dry-run on CPU at tiny sizes so it cannot rot."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # ~3 minutes on 2 cores: every part builds, trains or launches torchrun
def test_gpu_check_dry_run_passes_every_part_and_prints_one_table(tmp_path):
    env = {**os.environ, "GPU_CHECK_DEVICE": "cpu", "GPU_CHECK_OUT": str(tmp_path / "out"), "PYTHON": sys.executable}
    done = subprocess.run(["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=580)
    table = (tmp_path / "out" / "table.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| part")]
    assert [row.split("|")[1].strip() for row in rows] == ["env", "drafter", "loader_width", "build", "loader", "ddp", "eval", "teacher_layers", "dflash2", "lilicorr"], table
    # the production-scale parts print their own tables (issue 34)
    assert "steady tok/s" in done.stdout and "graphs compiled" in done.stdout and "| bf16 |" in done.stdout, done.stdout
    assert "checksums alone" in done.stdout, done.stdout
    assert all(row.split("|")[2].strip() == "ok" for row in rows), table + done.stdout[-2000:]
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


@pytest.mark.slow
def test_a_failing_part_is_its_own_row_and_the_check_fails(tmp_path):
    """A part that raises records FAIL and its error; the table still lists every part."""
    out = tmp_path / "out"
    env = {**os.environ, "GPU_CHECK_DEVICE": "cpu"}
    failed = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "loader", "--out", str(out)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)  # no cache built: the loader part fails
    assert failed.returncode == 1
    ok = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "noise", "--out", str(out)], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    table = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "table", "--out", str(out)], cwd=ROOT,
                           capture_output=True, text=True, timeout=60).stdout
    assert "| loader | FAIL |" in table and "| ddp | not run |" in table, table
