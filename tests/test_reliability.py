"""Bad input, corruption and crashes lose nothing: real processes killed at precise moments
(dflash_common.faults), a real file system that runs out of space, damaged shards in training, and
cached values that no longer match the teacher. docs/reliability.md lists what each test proves."""

from __future__ import annotations

import errno
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import fsspec
import numpy as np
import pytest
import safetensors.torch
import torch
from fsspec.implementations.local import LocalFileSystem
from helpers import assert_same_content, build_teacher, cache_content, chat_rows, qa_rows, replace_shard_records, write_jsonl
from typer.testing import CliRunner

from cli.cache import app as cache_app
from cli.train import app as train_app
from dflash_build.deep_verify import deep_sample, topk_mismatches
from dflash_cache import format as fmt
from dflash_cache import open_cache
from dflash_cache.format.integrity import size_problems
from dflash_common.errors import ConfigError
from dflash_common.faults import parse_faults

ROOT = Path(__file__).resolve().parents[1]


def _records(out: Path) -> list[str]:
    """The shards with a commit record (shards/<name>.json in format 1, shards/r<rank>/<name>.json in 2)."""
    return sorted(p.name[:-5] for p in (out / "shards").rglob("shard-*.json")) if (out / "shards").exists() else []


def _listed(out: Path | str) -> list[str]:
    """The shards a reader sees (format 1: the manifest's records; 2: its index)."""
    return [s.name for s in open_cache(str(out)).shards]


def _shard_records(url: str) -> list[tuple]:
    """What makes two caches equal shard for shard: names, row spans, checksums, file sizes."""
    return [(r["name"], r["rows"], r["checksums"], r["files"]) for r in (s.record for s in open_cache(url).shards)]


def _one_line_error(output: str) -> str:
    lines = [line for line in output.strip().splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "Traceback" not in output, output
    return lines[0]


# --- pure pieces -----------------------------------------------------------------------------


def test_fault_spec_parsing():
    assert parse_faults("") == {}
    assert parse_faults("after_shard_files:3, checkpoint_before_rename:1") == {"after_shard_files": 3, "checkpoint_before_rename": 1}
    for bad in ("after_shard_files", "after_shard_files:0", "nowhere:2", "after_commit_record:x"):
        with pytest.raises(ConfigError, match="POINT:N"):
            parse_faults(bad)


def test_size_problems_and_deep_sample():
    expected = {"tokens.arrow": 10, "hidden.zarr/zarr.json": 5}
    assert size_problems(expected, {"tokens.arrow": 10, "hidden.zarr/zarr.json": 5}) == []
    assert size_problems(expected, {"tokens.arrow": 4}) == ["file tokens.arrow is 4 bytes, expected 10", "file hidden.zarr/zarr.json missing"]
    assert size_problems(expected, None) == ["shard folder missing"]
    picked = deep_sample([5, 0, 3, 7], 3)
    assert len(picked) == 3 and {s for s, _ in picked} == {0, 2, 3}  # every non-empty shard reached
    everything = deep_sample([5, 0, 3, 7], 100)
    assert sorted(everything) == [(s, i) for s, n in enumerate([5, 0, 3, 7]) for i in range(n)]
    assert deep_sample([5, 0, 3, 7], 6) == deep_sample([5, 0, 3, 7], 6)


def test_topk_comparison_allows_near_ties_only():
    ids = np.array([[5, 7, 9, 2]])
    lp = np.array([[-0.5, -1.5, -3.0, -3.00001]], np.float32)
    assert topk_mismatches(ids, lp, ids, lp, 1e-4) == 0
    swapped = np.array([[5, 7, 2, 9]])  # a near-tie in another order
    assert topk_mismatches(ids, lp, swapped, lp[:, [0, 1, 3, 2]], 1e-4) == 0
    traded = np.array([[5, 7, 9, 4]])  # the k-th place goes to another id at the same log-prob
    assert topk_mismatches(ids, lp, traded, lp, 1e-4) == 0
    assert topk_mismatches(ids, lp, ids, lp + np.float32(0.01), 1e-4) == 1
    other = np.array([[7, 5, 9, 2]])  # a real change of the most likely token
    assert topk_mismatches(ids, lp, other, lp, 1e-4) == 1


# --- builds killed at precise moments --------------------------------------------------------


@pytest.fixture(scope="module")
def build_cases(tmp_path_factory, teacher_dir):
    """``build_cases(version)``: a tiny corpus, the build arguments, and a clean build of it in
    cache format ``version`` to compare against (made once per version)."""
    made = {}

    def get(version: int = 2) -> dict:
        if version not in made:
            root = tmp_path_factory.mktemp(f"fault_build_v{version}")
            data = write_jsonl(root / "chat.jsonl", chat_rows(16, seed=5))
            args = ["build", "--teacher", teacher_dir("qwen3"), "--data", data, "--dtype", "float32", "--layers", "0,2",
                    "--top-k", "4", "--batch-tokens", "128", "--shard-size", "40kB", "--format-version", str(version),
                    "--quiet"]
            clean = root / "clean"
            result = CliRunner().invoke(cache_app, args + ["--out", str(clean)])
            assert result.exit_code == 0, result.output
            assert len(_records(clean)) >= 6
            made[version] = {"root": root, "args": args, "clean": clean, "content": cache_content(clean),
                             "shards": _shard_records(str(clean)), "version": version}
        return made[version]

    return get


@pytest.fixture(scope="module")
def build_case(build_cases) -> dict:
    return build_cases(2)


_SLOW = pytest.mark.slow  # the same points later in the build, and format 1: make test-slow


@pytest.mark.parametrize("version,point,count", [
    (2, "after_shard_files", 1), (2, "after_commit_record", -1),  # -1: the last shard
    (2, "during_manifest_write", 1),
    pytest.param(2, "after_shard_files", 3, marks=_SLOW), pytest.param(2, "after_commit_record", 2, marks=_SLOW),
    pytest.param(2, "during_manifest_write", 4, marks=_SLOW),
    pytest.param(1, "after_shard_files", 3, marks=_SLOW), pytest.param(1, "after_commit_record", -1, marks=_SLOW),
    pytest.param(1, "during_manifest_write", 4, marks=_SLOW),
])
@pytest.mark.fast_cases(1)
def test_build_killed_at_fault_point_resumes_to_clean_build(build_cases, version, point, count):
    build_case = build_cases(version)
    total = len(build_case["shards"])
    count = total if count < 0 else count
    out = build_case["root"] / f"{point}-{count}"
    proc = subprocess.run([sys.executable, "-m", "cli.cache", *build_case["args"], "--out", str(out)], cwd=ROOT,
                          env={**os.environ, "DFLASH_FAULT": f"{point}:{count}"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr  # the fault fired: SIGKILL, no cleanup ran

    records = _records(out)
    if point == "after_shard_files":  # the N-th shard's files are in place, its record is not
        assert len(records) == count - 1 and Path(fmt.shard_path(str(out), f"shard-r00000-{count - 1:06d}", version)).is_dir()
    elif point == "after_commit_record":  # committed, but the manifest does not list it yet
        assert len(records) == count and _listed(out) == records[:-1]
    else:  # manifest write N follows shard N-1's commit; the temporary manifest was never renamed
        assert len(records) == count - 1 and list(out.glob("manifest.json.tmp-*"))
    if (out / "manifest.json").exists():
        # readers see only shards the manifest lists, all of them committed and intact
        assert set(_listed(out)) <= set(records) and not open_cache(str(out)).complete
        verified = CliRunner().invoke(cache_app, ["verify", str(out), "--quiet"])
        assert verified.exit_code == 0, verified.output
    else:
        assert count == 1 and point == "during_manifest_write" and not records

    rerun = CliRunner().invoke(cache_app, build_case["args"] + ["--out", str(out)])
    assert rerun.exit_code == 0, rerun.output
    assert open_cache(str(out)).complete
    assert _shard_records(str(out)) == build_case["shards"]
    assert_same_content(build_case["content"], cache_content(out))
    leftovers = [str(p) for p in out.rglob("*") if ".tmp" in p.name]
    assert not leftovers


def test_unknown_format_version_is_refused_everywhere(build_case, tmp_path):
    future = tmp_path / "future"
    shutil.copytree(build_case["clean"], future)
    manifest = json.loads((future / "manifest.json").read_text())
    (future / "manifest.json").write_text(json.dumps({**manifest, "format_version": 3}))
    for command in (["verify", str(future)], ["info", str(future)]):
        result = CliRunner().invoke(cache_app, command)
        assert result.exit_code == 1
        assert "cache format version 3 is not supported by this dflash (reads versions 1, 2)" in _one_line_error(result.output)
    rebuilt = CliRunner().invoke(cache_app, build_case["args"] + ["--out", str(future)])
    assert rebuilt.exit_code == 1 and "format version differs" in _one_line_error(rebuilt.output)
    trained = CliRunner().invoke(train_app, ["run", "--cache", str(future), "--out", str(tmp_path / "run"), "--quiet"])
    assert trained.exit_code == 1 and "format version 3" in _one_line_error(trained.output)


# --- the disk fills up during a build --------------------------------------------------------


class FullFS(LocalFileSystem):
    """Local files behind a `fullfs://` URL, on a "disk" that holds `limit` bytes in all.

    Not a local file system to dflash (no rename), so the build takes its object-store path and
    every byte, Zarr chunks included (zarr wraps it in fsspec's AsyncFileSystemWrapper), goes
    through `pipe_file`. A write that does not fit fails whole with ENOSPC, as a PUT does.
    """

    protocol = ("fullfs",)
    limit: int | None = None
    written = 0
    log: list[tuple[str, int]] = []

    def __init__(self, *args, **kwargs):
        kwargs.pop("asynchronous", None)  # zarr asks for it; the wrapper provides it
        super().__init__(*args, auto_mkdir=True, **kwargs)

    @classmethod
    def _strip_protocol(cls, path):
        path = fsspec.utils.stringify_path(path)
        return super()._strip_protocol(path[len("fullfs://"):] if path.startswith("fullfs://") else path)

    def unstrip_protocol(self, name):
        return f"fullfs://{self._strip_protocol(name)}"

    def pipe_file(self, path, value, mode="overwrite", **kwargs):
        cls = type(self)
        if cls.limit is not None and cls.written + len(value) > cls.limit:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), self._strip_protocol(path))
        cls.written += len(value)
        cls.log.append((self._strip_protocol(path), len(value)))
        return super().pipe_file(path, value, mode=mode, **kwargs)


fsspec.register_implementation("fullfs", FullFS, clobber=True)


def _disk(limit: int | None) -> None:
    FullFS.limit, FullFS.written, FullFS.log = limit, 0, []


@pytest.fixture(scope="module")
def full_case(tmp_path_factory, teacher_dir):
    """A clean build through fullfs:// (unlimited), with the log of every write it made."""
    root = tmp_path_factory.mktemp("diskfull")
    data = write_jsonl(root / "chat.jsonl", chat_rows(12, seed=7))
    target = root / "cache"
    args = ["build", "--teacher", teacher_dir("qwen3"), "--data", data, "--dtype", "float32", "--layers", "0,2",
            "--top-k", "4", "--shard-size", "40kB", "--quiet", "--out", f"fullfs://{target}"]
    _disk(None)
    result = CliRunner().invoke(cache_app, args)
    assert result.exit_code == 0, result.output
    log = list(FullFS.log)
    case = {"target": target, "args": args, "log": log, "content": cache_content(f"fullfs://{target}"),
            "shards": _shard_records(f"fullfs://{target}")}
    shutil.rmtree(target)
    return case


def _bytes_before(log: list[tuple[str, int]], suffix: str) -> int:
    """Bytes written before the first write whose path ends with suffix."""
    for i, (path, _) in enumerate(log):
        if path.endswith(suffix):
            return sum(n for _, n in log[:i])
    raise AssertionError(f"no write of {suffix}")


@pytest.mark.parametrize("failing_write,committed,message", [
    ("teacher/head.safetensors", 0, "while writing the teacher files of fullfs://"),
    # a Zarr chunk, through zarr's async wrapper
    ("shard-r00000-000001/hidden.zarr/c/0/0/0", 1, "while writing shard shard-r00000-000001 of fullfs://"),
    ("shard-r00000-000002/tokens.arrow", 2, "while writing shard shard-r00000-000002 of fullfs://"),  # an Arrow file
    ("/shard-r00000-000003.json", 3, "while writing shard shard-r00000-000003 of fullfs://"),  # the commit record itself
])
def test_disk_full_stops_cleanly_and_the_same_command_resumes(full_case, failing_write, committed, message):
    url = f"fullfs://{full_case['target']}"
    shutil.rmtree(full_case["target"], ignore_errors=True)  # whatever an earlier failing case left
    written = [path for path, _ in full_case["log"]]  # all bytes go through fullfs:
    assert all(any(p.endswith(f"/shard-r00000-000000/{f}") for p in written) for f in ("hidden.zarr/c/0/0/0", "tokens.arrow"))

    _disk(_bytes_before(full_case["log"], failing_write))  # that write is the first that does not fit
    failed = CliRunner().invoke(cache_app, full_case["args"])
    assert failed.exit_code == 1
    line = _one_line_error(failed.output)
    assert line.startswith("error: no space left on the disk ") and message in line, line
    assert line.endswith("then rerun the same command to resume")
    if committed:  # the line says how many shards are safe
        assert f"the {committed} shard(s) of this rank committed before it are intact" in line
    # what was committed before the disk filled up is intact; the half-written shard is not listed
    assert _listed(full_case["target"]) == [s[0] for s in full_case["shards"][:committed]]
    verified = CliRunner().invoke(cache_app, ["verify", url, "--quiet"])
    assert verified.exit_code == 0, verified.output

    _disk(None)  # space is back
    resumed = CliRunner().invoke(cache_app, full_case["args"])
    assert resumed.exit_code == 0, resumed.output
    assert ("resuming: " in resumed.output) == (committed > 0)
    assert _shard_records(url) == full_case["shards"]
    assert_same_content(full_case["content"], cache_content(url))
    shutil.rmtree(full_case["target"])


# --- training: killed while saving a checkpoint; damaged shards -----------------------------



@pytest.fixture(scope="module")
def train_cache(tiny_cache):
    return tiny_cache(rows=qa_rows(48, seed=2, prefix="r2-"))


TRAIN_ARGS = ["--steps", "8", "--num-layers", "1", "--block-size", "4", "--batch-tokens", "300",
              "--heldout-fraction", "0.05", "--save-every", "2", "--log-every", "1", "--eval-sequences", "0",
              "--noise", "cosine", "--noise-start", "0.3", "--quiet"]


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, train_cache):
    out = tmp_path_factory.mktemp("straight") / "run"
    result = CliRunner().invoke(train_app, ["run", "--cache", train_cache, "--out", str(out), *TRAIN_ARGS])
    assert result.exit_code == 0, result.output
    return out


def _curve(run: Path, after: int) -> dict:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: (r["loss"], r["lr"]) for r in lines if r.get("kind") == "train" and r["step"] > after}


@pytest.mark.parametrize("point,count,latest", [("checkpoint_after_files", 2, 2), ("checkpoint_before_rename", 3, 4)])
@pytest.mark.fast_cases(1)
def test_training_killed_while_saving_resumes_bit_identical(tmp_path, train_cache, straight_run, point, count, latest):
    killed = tmp_path / "killed"
    proc = subprocess.run([sys.executable, "-m", "cli.train", "run", "--cache", train_cache, "--out", str(killed), *TRAIN_ARGS],
                          cwd=ROOT, env={**os.environ, "DFLASH_FAULT": f"{point}:{count}"}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr
    checkpoints = killed / "checkpoints"
    complete = sorted(p.name for p in checkpoints.glob("step-*") if (p / "COMPLETE").exists())
    assert complete[-1] == f"step-{latest:06d}" and not (checkpoints / f"step-{2 * count:06d}").exists()
    (partial,) = checkpoints.glob(f".tmp-step-{2 * count:06d}-*")  # the save the kill interrupted
    assert (partial / "model.safetensors").exists() and (partial / "COMPLETE").exists() == (point == "checkpoint_before_rename")

    resumed = CliRunner().invoke(train_app, ["run", "--cache", train_cache, "--out", str(killed), "--resume", *TRAIN_ARGS])
    assert resumed.exit_code == 0, resumed.output
    assert f"(step {latest})" in resumed.output
    a = safetensors.torch.load_file(str(straight_run / "checkpoints" / "step-000008" / "model.safetensors"))
    b = safetensors.torch.load_file(str(checkpoints / "step-000008" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bit-identical on CPU
    assert _curve(straight_run, latest) == _curve(killed, latest)
    assert not list(checkpoints.glob(".tmp-*"))


def test_training_refuses_damaged_shards_and_can_skip_them(tmp_path, train_cache):
    cache = tmp_path / "cache"
    shutil.copytree(train_cache, cache)
    shards = open_cache(str(cache)).shards
    truncated, deleted = shards[1], shards[3]
    with open(cache / "shards" / truncated.name / "tokens.arrow", "r+b") as f:
        f.truncate(100)
    shutil.rmtree(cache / "shards" / deleted.name)

    run = ["run", "--cache", str(cache), "--steps", "2", "--num-layers", "1", "--block-size", "4", "--batch-tokens", "300",
           "--eval-sequences", "4", "--heldout-fraction", "0.1", "--quiet"]
    refused = CliRunner().invoke(train_app, run + ["--out", str(tmp_path / "refused")])
    assert refused.exit_code == 1
    line = _one_line_error(refused.output)
    assert f"{truncated.name} (file tokens.arrow is 100 bytes, expected" in line and f"{deleted.name} (shard folder missing)" in line
    assert f"--skip-shards {truncated.name},{deleted.name}" in line and "dflash-cache verify" in line
    assert not (tmp_path / "refused" / "checkpoints").exists()

    out = tmp_path / "skipping"
    skip = f"{truncated.name},{deleted.name}"
    trained = CliRunner().invoke(train_app, run + ["--out", str(out), "--skip-shards", skip])
    assert trained.exit_code == 0, trained.output
    left_out = len(truncated) + len(deleted)
    assert f"skipping 2 shard(s) (--skip-shards): {left_out} sequences left out" in trained.output
    data = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"kind": "data"' in x]
    assert data == [{"kind": "data", "skipped_shards": [truncated.name, deleted.name], "skipped_sequences": left_out}]
    assert json.loads((out / "config.json").read_text())["data"]["skip_shards"] == [truncated.name, deleted.name]

    # the skip list is part of what a resumed run must keep
    changed = CliRunner().invoke(train_app, run + ["--out", str(out), "--resume", "--steps", "3", "--skip-shards", f"{skip},{shards[5].name}"])
    assert changed.exit_code == 1 and "data fields differ" in _one_line_error(changed.output)
    unknown = CliRunner().invoke(train_app, run + ["--out", str(tmp_path / "u"), "--skip-shards", f"{skip},shard-r00000-999999"])
    assert unknown.exit_code == 1 and "shard-r00000-999999" in _one_line_error(unknown.output)


# --- cached values that checksums cannot catch: verify --deep ---------------------------------


def test_deep_verify_finds_a_shard_holding_another_teachers_outputs(tmp_path, teacher_dir, tokenizer_dir):
    teacher = teacher_dir("qwen3")
    other = build_teacher(tmp_path / "other_teacher", "qwen3", tokenizer_dir, seed=1)  # same shape, other weights
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(8, seed=11))
    base = ["--data", data, "--dtype", "float32", "--layers", "0,2", "--top-k", "4", "--shard-size", "40kB", "--quiet"]
    for name, model in (("cache", teacher), ("foreign", other)):
        result = CliRunner().invoke(cache_app, ["build", "--teacher", model, "--out", str(tmp_path / name), *base])
        assert result.exit_code == 0, result.output
    cache = tmp_path / "cache"
    clean = CliRunner().invoke(cache_app, ["verify", str(cache), "--deep", "--sample", "100", "--device", "cpu", "--quiet"])
    assert clean.exit_code == 0 and "deep: 8 sequences re-run" in clean.output, clean.output

    # shard 1 replaced, record and index too: every checksum matches the new bytes
    victim = open_cache(str(cache)).shards[1].name
    folder = Path(fmt.shard_path(str(cache), victim, 2))
    shutil.rmtree(folder)
    shutil.copytree(fmt.shard_path(str(tmp_path / "foreign"), victim, 2), folder)
    replace_shard_records(cache, {1: open_cache(str(tmp_path / "foreign")).shards[1].record})
    assert CliRunner().invoke(cache_app, ["verify", str(cache), "--quiet"]).exit_code == 0  # checksums cannot tell

    deep = CliRunner().invoke(cache_app, ["verify", str(cache), "--deep", "--sample", "100", "--device", "cpu", "--quiet"])
    assert deep.exit_code == 1
    named = [line for line in deep.output.splitlines() if line.startswith("MISMATCH ")]
    ids = open_cache(str(cache)).shards[1].ids
    assert len(named) == len(ids) >= 1 and all(f"({victim}): hidden states of layer" in line for line in named)
    assert {line.split()[1] for line in named} == set(ids)
    assert f"{len(ids)} of 8 re-run sequences differ" in _one_line_error(deep.output)

    wrong = CliRunner().invoke(cache_app, ["verify", str(cache), "--deep", "--teacher", other, "--device", "cpu", "--quiet"])
    assert wrong.exit_code == 1 and "is not the one" in _one_line_error(wrong.output) and "--teacher" in wrong.output


def test_deep_verify_passes_a_bfloat16_cache_within_rounding(tmp_path, teacher_dir):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(6, seed=12))
    built = CliRunner().invoke(cache_app, ["build", "--teacher", teacher_dir("qwen3", torch.bfloat16), "--data", data,
                                           "--out", str(tmp_path / "cache"), "--layers", "0,2", "--top-k", "4",
                                           "--batch-tokens", "1000", "--shard-size", "20kB", "--quiet"])
    assert built.exit_code == 0, built.output
    # the build batched each shard's sequences, the rerun batches the sample across shards: bf16
    # rounds differently there, and the difference must stay within the tolerance
    deep = CliRunner().invoke(cache_app, ["verify", str(tmp_path / "cache"), "--deep", "--device", "cpu", "--quiet"])
    assert deep.exit_code == 0 and "deep: 6 sequences" in deep.output, deep.output


@pytest.mark.parametrize("damage", ["model.safetensors:garbage", "model.safetensors:truncate",
                                    "trainer.pt:garbage", "trainer.pt:truncate", "config.json:garbage"])
def test_damaged_checkpoint_file_is_one_typed_error(tmp_path, damage):
    from dflash_train.settings.drafter_config import DrafterConfig
    from dflash_train.training.checkpoint import CheckpointError, CheckpointManager
    from dflash_train.training.model import DFlashDrafter

    manager = CheckpointManager(tmp_path / "checkpoints")
    drafter = DrafterConfig(hidden_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8, intermediate_size=32,
                            vocab_size=40, mask_token_id=0, target_layer_ids=(1,), num_target_layers=3, num_hidden_layers=1)
    head = torch.zeros(40, 16)
    weights = DFlashDrafter.build(drafter, head, head, "cpu").state_dict()  # load checks them against the config
    trainer = {"step": 3, "optimizer": {}, "scheduler": {}, "loader": {}, "rng": {"torch": torch.get_rng_state()},
               "drafter": drafter.to_hf_config()}
    path = manager.save(3, weights, trainer, {"steps": 9})
    assert CheckpointManager.load(path)["trainer"]["step"] == 3
    name, how = damage.split(":")
    target = path / name
    if how == "garbage":
        target.write_bytes(b"\x80not a checkpoint file" * 7)
    else:
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 2])
    # the fix never names a folder without checkpoints (issue 45): this one has no other
    with pytest.raises(CheckpointError, match=r"(cannot be read|is not UTF-8 text).*; there is no other complete "
                                              r"checkpoint beside it in .*: use a checkpoint dflash-train wrote"):
        CheckpointManager.load(path)


# --- one writer per output folder ------------------------------------------------------------


def _paused_at_fault(command: list[str], point: str, gate: Path, ready) -> subprocess.Popen:
    """A real process that stops at its first `point` (dflash_common.faults) and waits there for
    `gate`, holding its output folder, until `ready()` says it is there; opening the gate kills it."""
    proc = subprocess.Popen([sys.executable, "-m", *command], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "DFLASH_FAULT": f"{point}:1", "DFLASH_FAULT_GATE": str(gate)})
    deadline = time.time() + 120
    while not ready() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    assert ready() and proc.poll() is None, proc.communicate()
    return proc


def _settled(folder: Path) -> dict:
    """The folder's tree once the paused writer has stopped changing it: ready() can see a file
    the first writer is still writing (on a loaded machine it may take seconds to reach its
    fault point)."""
    before, deadline = _tree(folder), time.time() + 60
    while time.time() < deadline:
        time.sleep(0.5)
        now = _tree(folder)
        if now == before:
            return now
        before = now
    return before


def _second_writer_is_refused(command: list[str], first: subprocess.Popen, what: str, folder: Path) -> None:
    second = subprocess.run([sys.executable, "-m", *command], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert second.returncode == 1, second.stderr
    line = _one_line_error(second.stderr)
    assert line.startswith(f"error: {folder} is being written by another {what} (pid {first.pid} on "), line
    assert line.endswith("two writers would mix their files: wait for it to end (or stop it), or choose another --out"
                         + (f" than {folder}" if what == "dflash-train run" else "")), line


def _stop(proc: subprocess.Popen, gate: Path) -> None:
    gate.touch()
    proc.communicate(timeout=120)
    assert proc.returncode == -9  # its fault fired: SIGKILL, no cleanup ran


@pytest.mark.slow  # two real processes, ~30 s: make test-slow
def test_a_second_run_on_the_same_out_is_refused_while_the_first_runs(tmp_path, train_cache):
    """Two `dflash-train run --out X` started together both exited 0 with their metrics and
    checkpoints interleaved. The second now stops at once naming the first; once the first is
    gone (even SIGKILLed) the folder is free again."""
    out, gate = tmp_path / "run", tmp_path / "gate"
    command = ["cli.train", "run", "--cache", train_cache, "--out", str(out), *TRAIN_ARGS]
    first = _paused_at_fault(command, "checkpoint_after_files", gate,
                             lambda: any((p / "trainer.pt").exists() for p in out.glob("checkpoints/.tmp-step-*")))
    before = _settled(out)
    try:
        _second_writer_is_refused(command, first, "dflash-train run", out)
        assert _tree(out) == before  # not a line of metrics, not a checkpoint
    finally:
        _stop(first, gate)
    resumed = CliRunner().invoke(train_app, ["run", "--cache", train_cache, "--out", str(out), "--resume", *TRAIN_ARGS])
    assert resumed.exit_code == 0, resumed.output


@pytest.mark.slow  # two real processes, ~30 s: make test-slow
def test_a_second_build_on_the_same_out_is_refused_and_leaves_the_first_ones_shard(build_case, tmp_path):
    """The second build deleted the first's in-flight shard as a crash's leftover, and both exited 0."""
    out, gate = tmp_path / "cache", tmp_path / "gate"
    command = ["cli.cache", *build_case["args"], "--out", str(out)]
    in_flight = Path(fmt.shard_path(str(out), "shard-r00000-000000", 2))
    first = _paused_at_fault(command, "after_shard_files", gate, in_flight.is_dir)
    before = _settled(out)
    try:
        _second_writer_is_refused(command, first, "dflash-cache build", out)
        assert _tree(out) == before and in_flight.is_dir()
    finally:
        _stop(first, gate)


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}
