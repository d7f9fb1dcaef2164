"""benchmarks/gpu_check.sh, the device check: its parts and budgets (declared once, in gpu_check.py's
CHECK) against docs/gpu.md, the driver's stop before the budget runs out, and the dry run on CPU at
tiny sizes so it cannot rot."""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
gpu_check = importlib.import_module("gpu_check")
DOC = ROOT / "docs" / "gpu.md"


def test_the_checks_budgets_sum_to_at_most_six_minutes():
    """A lent machine has 15 minutes in all: start, install, the check and a rerun of what failed."""
    budgets = {p.name: p.budget_s for p in gpu_check.CHECK}
    assert sum(budgets.values()) <= 360, budgets
    assert all(b > 0 for b in budgets.values()) and len(budgets) == len(gpu_check.CHECK), budgets


def test_every_part_has_its_function_and_the_parts_it_needs_run_before_it():
    names = [p.name for p in gpu_check.CHECK]
    for name in (*names, *gpu_check.EXTRA):
        assert callable(gpu_check.part_function(name)), name
    for index, part in enumerate(gpu_check.CHECK):
        assert set(part.needs) <= set(names[:index]), (part.name, part.needs)


def test_docs_gpu_md_holds_the_parts_table_as_gpu_check_declares_it():
    text = DOC.read_text()
    inside = text.split(gpu_check.DOC_BEGIN, 1)[1].split(gpu_check.DOC_END, 1)[0].strip()
    assert inside == gpu_check.parts_markdown(), "stale: run `python benchmarks/gpu_check.py parts --doc docs/gpu.md`"


def test_every_part_docs_gpu_md_names_is_a_part_of_the_script():
    """'gpu_check's `x` part', '`x` and `y` parts': each name must be in CHECK or EXTRA."""
    named = set()
    for group in re.findall(r"((?:`[a-z0-9_]+`(?:, | and | or |,? and )?)+) parts?\b", DOC.read_text()):
        named |= set(re.findall(r"`([a-z0-9_]+)`", group))
    known = {p.name for p in gpu_check.CHECK} | set(gpu_check.EXTRA)
    assert {"capture", "drafter", "ddp", "eval", "walks"} <= named, named  # the pattern still finds them
    assert named <= known, sorted(named - known)


def run_check(tmp_path, **env) -> subprocess.CompletedProcess:
    full = {**os.environ, "GPU_CHECK_DEVICE": "cpu", "GPU_CHECK_OUT": str(tmp_path / "out"), "PYTHON": sys.executable,
            "OMP_NUM_THREADS": "1", **env}
    full.pop("DFLASH_VLLM_PYTHON", None)
    return subprocess.run(["bash", "benchmarks/gpu_check.sh"], cwd=ROOT, env=full, capture_output=True, text=True,
                          timeout=900)


def test_the_check_stops_before_a_part_its_time_left_cannot_hold_and_records_the_rest(tmp_path):
    """40 s in all at budgets x1: env (15 s) runs; the 90 s drafter would be cut off with nothing
    recorded, so the check stops there, says so, and the table lists every part not run."""
    done = run_check(tmp_path, GPU_CHECK_TOTAL_S="40", GPU_CHECK_TIME_SCALE="1", GPU_CHECK_PARTS="env drafter capture")
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert re.match(r"env +ok +\d+\.\d s of 15 s +cpu", next(line for line in lines if line.startswith("env ")))
    assert any(line.startswith("stopped: ") and "drafter needs 90 s" in line and "drafter, capture" in line
               for line in lines), done.stdout
    table = (tmp_path / "out" / "table.md").read_text()
    assert "| env | ok |" in table and "| drafter | not run |" in table and "| capture | not run |" in table, table
    assert not (tmp_path / "out" / "drafter.log").exists()  # never started
    record = json.loads((tmp_path / "out" / "drafter.json").read_text())
    assert record["status"] == "not run" and "needs 90 s" in record["summary"], record


@pytest.mark.slow  # ~4 minutes on 2 cores: every part builds, trains or launches torchrun
def test_gpu_check_dry_run_passes_every_part_and_prints_one_table(tmp_path):
    done = run_check(tmp_path)
    table = (tmp_path / "out" / "table.md").read_text()
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| part")]
    assert [row.split("|")[1].strip() for row in rows] == [p.name for p in gpu_check.CHECK], table
    assert all(row.split("|")[2].strip() == "ok" for row in rows), table + done.stdout[-3000:]
    # a line per part with its wall time against its budget (x6 on the CPU)
    for part in gpu_check.CHECK:
        assert re.search(rf"^{part.name} +ok +\d+\.\d s of {part.budget_s * 6} s ", done.stdout, re.M), done.stdout
    # the production-scale parts print their own tables (issue 34)
    assert "steady tok/s" in done.stdout and "graphs compiled" in done.stdout and "| bf16 |" in done.stdout, done.stdout
    assert "checksums alone" in done.stdout, done.stdout
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]


@pytest.mark.slow  # ~20 s: a build started and killed, a command that fails
def test_a_part_past_its_budget_is_killed_and_the_parts_needing_it_are_skipped(tmp_path):
    """capture at a fifth of its budget (7 s; its build takes ~30 s on CPU) is killed with its
    build, recorded TIMEOUT; eval, which needs its cache, is skipped instead of failing slowly."""
    done = run_check(tmp_path, GPU_CHECK_TIME_SCALE="0.2", GPU_CHECK_PARTS="capture eval")
    assert done.returncode == 1, done.stdout + done.stderr
    table = (tmp_path / "out" / "table.md").read_text()
    assert "| capture | TIMEOUT |" in table and "| eval | skipped |" in table, table
    assert "needs capture (TIMEOUT)" in table, table
    assert float(table.split("| capture | TIMEOUT | ")[1].split(" ")[0]) < 20, table  # killed at 7 s, not finished


@pytest.mark.slow
def test_a_failing_part_records_fail_and_its_error(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "GPU_CHECK_DEVICE": "cpu"}
    failed = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "ddp", "--out", str(out)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)  # no cache built: the ddp part fails
    assert failed.returncode == 1
    record = json.loads((out / "ddp.json").read_text())
    assert record["status"] == "FAIL" and "train run failed" in record["summary"], record
    table = subprocess.run([sys.executable, "benchmarks/gpu_check.py", "table", "--out", str(out)], cwd=ROOT,
                           capture_output=True, text=True, timeout=60).stdout
    assert "| ddp | FAIL |" in table and "| capture | not run |" in table, table
