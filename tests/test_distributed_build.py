"""Multi-process builds: real torchrun ranks, independent rank jobs, finalize."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from test_build import assert_same_content, cache_content, chat_rows
from helpers import write_jsonl
from typer.testing import CliRunner

from cli.cache import app
from dflash_cache import open_cache

ROOT = Path(__file__).resolve().parents[1]
CLI = str(Path(sys.executable).with_name("dflash-cache"))


def _args(teacher, data, out):
    return ["build", "--teacher", teacher, "--data", data, "--out", str(out), "--dtype", "float32", "--layers", "0,3",
            "--top-k", "4", "--batch-tokens", "128", "--shard-size", "10kB", "--quiet"]


def _by_id(content: dict) -> dict:
    return dict(sorted(content.items()))


def test_torchrun_two_ranks_equal_one_process(tmp_path, teacher_dir):
    teacher = teacher_dir("qwen3")
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(40, seed=5))
    single = tmp_path / "single"
    assert CliRunner().invoke(app, _args(teacher, data, single)).exit_code == 0

    two = tmp_path / "two"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--no-python",
                           CLI, *_args(teacher, data, two)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    cache = open_cache(str(two))
    assert cache.complete and {s.record["rank"] for s in cache.shards} == {0, 1}
    assert_same_content(_by_id(cache_content(single)), _by_id(cache_content(two)))
    assert cache.manifest["totals"]["sequences"] == 40


def test_independent_rank_jobs_resume_and_finalize(tmp_path, teacher_dir, monkeypatch):
    teacher = teacher_dir("qwen3")
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(30, seed=6))
    single = tmp_path / "single"
    assert CliRunner().invoke(app, _args(teacher, data, single)).exit_code == 0

    out = tmp_path / "jobs"
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert CliRunner().invoke(app, _args(teacher, data, out)).exit_code == 0
    assert not open_cache(str(out)).complete  # rank 0 has not run yet
    early = CliRunner().invoke(app, ["finalize", str(out)])
    assert early.exit_code == 1 and "rank(s) [0] of 2 have not finished" in early.output

    # rank 1 loses its last committed shard (as if killed before committing it) and reruns
    records = sorted((out / "shards").glob("shard-r00001-*.json"))
    records[-1].unlink()
    assert CliRunner().invoke(app, _args(teacher, data, out)).exit_code == 0
    monkeypatch.setenv("RANK", "0")
    assert CliRunner().invoke(app, _args(teacher, data, out)).exit_code == 0  # the last rank finalizes
    cache = open_cache(str(out))
    assert cache.complete
    assert_same_content(_by_id(cache_content(single)), _by_id(cache_content(out)))
    assert CliRunner().invoke(app, ["finalize", str(out)]).exit_code == 0  # idempotent
    assert CliRunner().invoke(app, ["verify", str(out), "--quiet"]).exit_code == 0
