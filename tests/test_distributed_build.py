"""Multi-process builds: real torchrun ranks, independent rank jobs, finalize."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import assert_same_content, cache_content, chat_rows, write_jsonl
from typer.testing import CliRunner

from cli.cache import app
from dflash_cache import format as fmt
from dflash_cache import open_cache
from dflash_cache.format.integrity import size_problems
from dflash_cache.verify import verify_cache
from dflash_common.errors import ConfigError
from dflash_common.faults import parse_faults

# real torchrun processes (~1 minute): `make test-slow`, which CI runs after `make test`
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CLI = str(Path(sys.executable).with_name("dflash-cache"))


def _args(teacher, data, out):
    return ["build", "--teacher", teacher, "--data", data, "--out", str(out), "--dtype", "float32", "--layers", "0,2",
            "--top-k", "4", "--batch-tokens", "128", "--shard-size", "10kB", "--quiet"]


def _by_id(content: dict) -> dict:
    return dict(sorted(content.items()))


def _torchrun(teacher, data, out) -> list[str]:
    # --standalone: a free rendezvous port, so concurrent test runs on one machine do not collide
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "--no-python",
            CLI, *_args(teacher, data, out)]


def _failure(done: subprocess.CompletedProcess) -> str:
    """The ranks' own error lines first (torchrun's summary at the end only says which rank failed)."""
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:") or "Error" in line.split(":")[0]]
    return "\n".join(errors[:20]) + "\n...\n" + done.stderr[-1500:]


def _clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "DFLASH_FAULT", "DFLASH_FAULT_GATE")}


@pytest.fixture(scope="module")
def corpus40(tmp_path_factory, teacher_dir):
    """40 chat rows (about 20 one-sequence shards per rank at 10kB) and their 1-process build."""
    root = tmp_path_factory.mktemp("dist_build")
    teacher = teacher_dir("qwen3")
    data = write_jsonl(root / "chat.jsonl", chat_rows(40, seed=5))
    single = root / "single"
    assert CliRunner().invoke(app, _args(teacher, data, single)).exit_code == 0
    return {"teacher": teacher, "data": data, "single": single, "content": _by_id(cache_content(single))}


def test_torchrun_two_ranks_equal_one_process(tmp_path, corpus40):
    two = tmp_path / "two"
    done = subprocess.run(_torchrun(corpus40["teacher"], corpus40["data"], two), cwd=ROOT, env=_clean_env(),
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, _failure(done)
    cache = open_cache(str(two))
    assert cache.complete and {s.record["rank"] for s in cache.shards} == {0, 1}
    assert_same_content(corpus40["content"], _by_id(cache_content(two)))
    assert cache.manifest["totals"]["sequences"] == 40


def test_fault_can_target_one_rank():
    text = "after_shard_files:2@1, during_manifest_write:1"
    assert parse_faults(text, rank=0) == {"during_manifest_write": 1}
    assert parse_faults(text, rank=1) == {"after_shard_files": 2, "during_manifest_write": 1}
    assert parse_faults("after_commit_record:3@10", rank=10) == {"after_commit_record": 3}
    for bad in ("after_shard_files:2@", "after_shard_files:2@x", "after_shard_files:2@-1", "after_shard_files@1"):
        with pytest.raises(ConfigError, match="POINT:N@RANK"):
            parse_faults(bad)


def _folder(shards: Path, name: str) -> Path:
    """A shard's folder (format 2: under its rank's folder, shards/rRRRRR/)."""
    return shards / fmt.rank_folder(fmt.rank_of(name)) / name


def _rank_state(shards: Path, rank: int) -> tuple[list[dict], list[str]]:
    """A rank's commit records (by index) and its shard entries that no record commits."""
    folder = shards / fmt.rank_folder(rank)
    records = sorted((json.loads(p.read_text()) for p in folder.glob("shard-*.json")), key=lambda r: r["index"])
    committed = {r["name"] for r in records} | {f"{r['name']}.json" for r in records}
    loose = sorted(p.name for p in folder.iterdir() if p.name.startswith("shard-") and p.name not in committed)
    return records, loose


def _stamps(shards: Path, records: list[dict]) -> dict[str, int]:
    """mtime (ns) of each record and each data file of these committed shards."""
    stamps = {}
    for r in records:
        folder = _folder(shards, r["name"])
        for path in [folder.with_name(f"{r['name']}.json"), *(folder / f for f in r["files"])]:
            stamps[str(path.relative_to(shards))] = path.stat().st_mtime_ns
    return stamps


def test_torchrun_rank_sigkilled_mid_shard_then_rerun_equals_clean_build(tmp_path, corpus40):
    """Rank 1 SIGKILLs itself with its 2nd shard's files in place but no commit record, while rank 0
    stands at the same moment of its 3rd shard; torchrun then SIGTERMs rank 0. The same command
    again resumes both ranks from their commit records and ends equal to the 1-process build."""
    out, shards = tmp_path / "two", tmp_path / "two" / "shards"
    command = _torchrun(corpus40["teacher"], corpus40["data"], out)
    # Each rank holds at its fault until its gate opens. Rank 0's never does: it waits there, its
    # shard written but uncommitted, until torchrun tears it down. Rank 1's opens once rank 0 is
    # held, so the kill finds both ranks at a fixed point whichever the scheduler favoured.
    env = {**_clean_env(), "DFLASH_FAULT": "after_shard_files:2@1,after_shard_files:3@0",
           "DFLASH_FAULT_GATE": str(tmp_path / "gate-{rank}")}
    with open(tmp_path / "killed.log", "w+") as log:
        proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            deadline = time.monotonic() + 240
            while proc.poll() is None and time.monotonic() < deadline and not _folder(shards, "shard-r00000-000002").is_dir():
                time.sleep(0.05)
            (tmp_path / "gate-1").touch()
            returncode = proc.wait(timeout=240)
        finally:
            if proc.poll() is None:
                proc.terminate()  # torchrun passes it on to its workers
                proc.wait(timeout=60)
        log.seek(0)
        killed_log = log.read()

    assert returncode != 0, killed_log[-3000:]
    # torchrun's failure report: rank 1 died of SIGKILL, then rank 0, still running, got SIGTERM
    assert re.search(r"rank\s*:\s*1 \(local_rank: 1\)\s*exitcode\s*:\s*-9\b", killed_log), killed_log[-3000:]
    assert re.search(r"rank\s*:\s*0 \(local_rank: 0\)\s*exitcode\s*:\s*-15\b", killed_log), killed_log[-3000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["complete"] is False and not (out / "ranks").exists()  # neither rank finished
    assert len(open_cache(str(out)).shards) == 0  # readers see no shard before the merge
    early = CliRunner().invoke(app, ["finalize", str(out)])
    assert early.exit_code == 1 and "rank(s) [0, 1] of 2 have not finished" in early.output

    records0, loose0 = _rank_state(shards, 0)
    records1, loose1 = _rank_state(shards, 1)
    # each in-flight shard lies in its final folder with all its files, yet without a commit record
    assert [r["index"] for r in records0] == [0, 1] and loose0 == ["shard-r00000-000002"]
    assert [r["index"] for r in records1] == [0] and loose1 == ["shard-r00001-000001"]
    for r in records0 + records1:  # what was committed is whole
        folder = _folder(shards, r["name"])
        found = {str(p.relative_to(folder)): p.stat().st_size for p in folder.rglob("*") if p.is_file()}
        assert size_problems(r["files"], found) == [], r["name"]
    stamps = _stamps(shards, records0 + records1)

    rerun = subprocess.run(command, cwd=ROOT, env=_clean_env(), capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    for records in (records0, records1):
        resumed = (f"resuming: {len(records)} committed shard(s) kept, continuing at corpus row {records[-1]['rows'][1]}, "
                   "1 uncommitted shard(s) removed")
        assert resumed in rerun.stderr, rerun.stderr[-3000:]
    assert _stamps(shards, records0 + records1) == stamps  # committed shards were reused, not rewritten

    cache = open_cache(str(out))
    assert cache.complete and cache.manifest["totals"]["sequences"] == 40
    assert CliRunner().invoke(app, ["verify", str(out), "--quiet"]).exit_code == 0
    assert_same_content(corpus40["content"], _by_id(cache_content(out)))
    report = verify_cache(cache)
    assert report.ok and report.uncommitted == []
    listed = {s.name for s in cache.shards}
    assert sorted(p.name for p in shards.glob("r*/*")) == sorted(listed | {f"{n}.json" for n in listed})
    assert not [p for p in out.rglob("*") if ".tmp-" in p.name]
