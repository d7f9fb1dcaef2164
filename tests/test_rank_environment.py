"""torchrun's environment as the commands read it (issue 36): a RANK, WORLD_SIZE or LOCAL_RANK that
is not a usable number is one line naming it, and of a build's ranks only the one that completes
the cache says "cache ready"."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import chat_rows, write_jsonl
from typer.testing import CliRunner

from cli.cache import app as cache_app
from dflash_cache import open_cache

ROOT = Path(__file__).resolve().parents[1]
TRAIN = str(Path(sys.executable).with_name("dflash-train"))
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _env(**values: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_VARIABLES}
    return {**env, **values}


@pytest.mark.parametrize("variables, named", [
    ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' is not an integer >= 1"),
    ({"RANK": "abc", "WORLD_SIZE": "2"}, "RANK='abc' is not an integer >= 0"),
    ({"LOCAL_RANK": "-1"}, "LOCAL_RANK='-1' is not an integer >= 0"),
    ({"WORLD_SIZE": "1" * 5000}, "WORLD_SIZE='1111"),
    ({"RANK": "3", "WORLD_SIZE": "2"}, "RANK=3 is outside a world of WORLD_SIZE=2 processes"),
])
@pytest.mark.fast_cases(1)
def test_a_bad_torchrun_variable_is_one_line_before_training(cache_url, tmp_path, variables, named):
    """`dflash-train run` on a real cache: each bad value stops the run in one line naming the
    variable, its value and the fix (int() of it was a traceback), and writes nothing."""
    out = tmp_path / "run"
    done = subprocess.run([TRAIN, "run", "--cache", cache_url, "--out", str(out), "--steps", "1", "--quiet"],
                          cwd=ROOT, env=_env(**variables), capture_output=True, text=True, timeout=300)
    lines = (done.stdout + done.stderr).strip().splitlines()
    assert done.returncode == 1 and len(lines) == 1, done.stdout + done.stderr[-3000:]
    assert lines[0].startswith(f"error: {named}") and ("set it to one or unset it" in lines[0]
                                                       or "set RANK in 0..WORLD_SIZE-1" in lines[0]), lines[0]
    assert len(lines[0]) < 300 and not out.exists()


def test_only_the_rank_that_completes_the_cache_says_cache_ready(tmp_path, teacher_dir):
    """Two ranks run as independent jobs (RANK/WORLD_SIZE set by hand): the first to finish says
    it finished its part, the last completes the cache and alone says "cache ready"."""
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(6, seed=3))
    out = tmp_path / "cache"
    args = ["build", "--teacher", teacher_dir("qwen3"), "--data", data, "--out", str(out), "--dtype", "float32",
            "--layers", "0,2", "--top-k", "4", "--quiet"]
    said = {}
    for rank in (1, 0):
        result = CliRunner().invoke(cache_app, args, env={"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
        assert result.exit_code == 0, result.output
        said[rank] = result.output
    assert "cache ready" not in said[1] and f"rank 1 finished its part of {out}" in said[1], said[1]
    assert f"cache ready at {out}" in said[0] and "finished its part" not in said[0], said[0]
    assert open_cache(str(out)).complete
