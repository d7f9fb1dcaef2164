"""Sweep folders held like run folders, sweep plans bounded, and a stopped sweep stops its runs
(issue 36, items 5, 7, 8 and 10).

Refusals run the real `dflash-train` command in a child process held to 4 GiB of address space
and a time limit, so a plan that is not bounded fails its test instead of stalling the suite."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent
SETS = ["model.num_layers=1", "model.block_size=4", "data.batch_tokens=400",
        "data.heldout_fraction=0.1", "eval_sequences=0", "log_every=1", "device=cpu"]


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))


def _sweep(cache: str, out: Path, *extra: str, grid=("--grid", "loss=ce,kl"), steps: str = "2", timeout: float = 300,
           limited: bool = True) -> subprocess.CompletedProcess:
    args = [str(BIN / "dflash-train"), "sweep", "--cache", cache, "--out", str(out), *grid, "--steps", steps, "--quiet",
            *extra]
    for item in SETS:
        args += ["--set", item]
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout,
                          preexec_fn=_limit_memory if limited else None)


def _one_line(result: subprocess.CompletedProcess) -> str:
    lines = result.stderr.strip().splitlines() + result.stdout.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    return lines[0]


def _tree(folder: Path) -> dict[str, bytes | str]:
    out: dict[str, bytes | str] = {}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        out[key] = f"-> {os.readlink(path)}" if path.is_symlink() else path.read_bytes() if path.is_file() else "dir"
    return out


# ----------------------------------------------------------------------------- plans (item 10)


@pytest.mark.parametrize("extra, grid, message", [
    ([], ("--grid", "lr=" + ",".join(f"{i}e-5" for i in range(1, 1001)), "--grid", "weight_decay="
          + ",".join(f"0.{i:04d}" for i in range(1, 1001))),
     "the sweep would plan 1,000,000 runs (1,000 lr x 1,000 weight_decay), more than the 1,000 one sweep plans; "
     "give fewer --grid values or --seeds"),
    (["--seeds", "100000000"], ("--grid", "loss=ce,kl"),
     "the sweep would plan 200,000,000 runs (2 loss x 100,000,000 seeds), more than the 1,000"),
    (["--parallel", "100000000"], ("--grid", "loss=ce,kl"),
     "--parallel 100,000,000 is more than the 256 runs one sweep trains at once; pass --parallel 2 or less"),
])
def test_a_sweep_plan_too_large_is_one_line_at_once(tiny_cache, tmp_path, extra, grid, message):
    start = time.monotonic()
    result = _sweep(tiny_cache(), tmp_path / "sw", *extra, grid=grid, timeout=120)
    assert message in _one_line(result)
    assert time.monotonic() - start < 60 and not (tmp_path / "sw").exists()


# ----------------------------------------------------------------------------- folders (items 5 and 8)


@pytest.mark.parametrize("name, text", [("results.csv", "my,table\n1,2\n"), ("results.md", "# my notes\n"),
                                        ("sweep.json", '{"mine": true}\n'), ("sweep.json", "not json")])
@pytest.mark.fast_cases(1)
def test_a_foreign_file_in_the_sweep_folder_is_refused_and_kept(tiny_cache, tmp_path, name, text):
    out = tmp_path / "sw"
    out.mkdir()
    (out / name).write_text(text)
    line = _one_line(_sweep(tiny_cache(), out))
    if name == "sweep.json":
        assert f"--out {out} holds a sweep.json that is not a dflash-train sweep's; choose a new or empty folder" in line
    else:
        assert f"--out {out} is a non-empty folder that is not a dflash-train sweep (it holds '{name}')" in line
    assert (out / name).read_text() == text and sorted(p.name for p in out.iterdir()) == [name]


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_cache) -> Path:
    """A finished two-run sweep, copied by the tests that damage it."""
    out = tmp_path_factory.mktemp("sweep") / "sw"
    result = _sweep(tiny_cache(), out)
    assert result.returncode == 0, result.stderr
    return out


def _copy(finished: Path, tmp_path: Path) -> Path:
    import shutil

    out = tmp_path / "sw"
    shutil.copytree(finished, out, symlinks=True)
    return out


@pytest.mark.slow
def test_a_link_at_a_temporary_name_is_never_written_through(finished, tiny_cache, tmp_path):
    """The plots, measure.json and the teacher's outputs were written to fixed temporaries: a link
    planted at one sent the write outside. Now every temporary is a fresh name made new."""
    out = _copy(finished, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    planted = {}
    for name in (".loss_curves.png.tmp", ".acceptance_by_position.png.tmp", ".results.csv.tmp"):
        target = outside / name.strip(".")
        target.write_text("someone else's file\n")
        os.symlink(target, out / name)
        planted[name] = target
    import shutil

    shutil.rmtree(out / "runs" / "loss-kl")  # one run to train again: the report is rewritten
    result = _sweep(tiny_cache(), out)
    assert result.returncode == 0, result.stderr
    assert all(target.read_text() == "someone else's file\n" for target in planted.values())
    assert (out / "loss_curves.png").read_bytes()[:4] == b"\x89PNG" and not (out / "loss_curves.png").is_symlink()


def test_a_link_at_a_runs_log_is_refused_before_training(finished, tiny_cache, tmp_path):
    out = _copy(finished, tmp_path)
    import shutil

    shutil.rmtree(out / "runs" / "loss-kl")
    (out / "runs" / "loss-kl").mkdir()
    target = tmp_path / "outside.log"
    target.write_text("someone else's log\n")
    os.symlink(target, out / "runs" / "loss-kl" / "train.log")
    result = _sweep(tiny_cache(), out, "--parallel", "2")
    assert result.returncode == 1
    assert f"{out / 'runs' / 'loss-kl' / 'train.log'} is a symlink (to {target})" in result.stderr, result.stderr
    assert target.read_text() == "someone else's log\n"


@pytest.mark.parametrize("content, message", [
    (None, "config.json that is not a dflash-train run's"),  # a link to /dev/zero
    ("\x00garbage{", "config.json that is not a dflash-train run's"),
    ("[1, 2]", "config.json that is not a dflash-train run's"),
    ('{"cache": 1, "model": 2, "loss": 3, "optim": [' + "1," * 10_000_000 + "1]}", "config.json that is not"),
])
@pytest.mark.fast_cases(1)
def test_a_run_folders_config_json_is_read_bounded_and_garbage_is_one_line(finished, tiny_cache, tmp_path, content,
                                                                          message):
    out = _copy(finished, tmp_path)
    config = out / "runs" / "loss-kl" / "config.json"
    config.unlink()
    if content is None:
        os.symlink("/dev/zero", config)
    else:
        config.write_text(content)
    start = time.monotonic()
    line = _one_line(_sweep(tiny_cache(), out, timeout=120))
    assert message in line or "is a symlink (to /dev/zero)" in line, line
    assert time.monotonic() - start < 60


# ----------------------------------------------------------------------------- SIGTERM (item 7)


def _children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            found += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.slow  # two real training processes: make test-slow
def test_sigterm_of_a_parallel_sweep_stops_and_waits_for_its_runs(tiny_cache, tmp_path):
    out = tmp_path / "sw"
    args = [str(BIN / "dflash-train"), "sweep", "--cache", tiny_cache(), "--out", str(out), "--grid", "loss=ce,kl",
            "--steps", "100000", "--parallel", "2", "--quiet"]
    for item in SETS:
        args += ["--set", item]
    sweep = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 180
        logs = [out / "runs" / name / "metrics.jsonl" for name in ("loss-ce", "loss-kl")]
        while not all(log.exists() and log.stat().st_size for log in logs):  # both runs are training
            assert sweep.poll() is None and time.monotonic() < deadline, sweep.communicate()
            time.sleep(0.5)
        runs = _children(sweep.pid)
        assert len(runs) == 2 and all(_alive(pid) for pid in runs)
        sweep.send_signal(signal.SIGTERM)
        _, stderr = sweep.communicate(timeout=90)
    finally:
        if sweep.poll() is None:
            sweep.kill()
    assert not [pid for pid in runs if _alive(pid)], "runs still training after their sweep ended"
    assert sweep.returncode == 1 and "the sweep was stopped by signal SIGTERM" in stderr, stderr
    assert "rerun the same command" in stderr
