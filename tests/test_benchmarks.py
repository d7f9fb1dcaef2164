"""The issue #6 benchmark scripts run end to end in their tiny modes and print their tables, so they
cannot silently rot. They run at once (each is mostly process start-up and imports), in `make
test-slow`: together they take about two minutes of the two cores."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
NUMBER = r"[\d,]+(?:\.\d+)?"


@pytest.fixture(scope="module")
def outputs(tmp_path_factory) -> dict[str, str]:
    tmp = tmp_path_factory.mktemp("bench")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    commands = {
        "gpu": [sys.executable, "benchmarks/bench_gpu.py", "--tiny", "--device", "cpu", "--tmp", str(tmp)],
        "trainer": [sys.executable, "benchmarks/bench_trainer.py", "--tiny"],
        "online": [sys.executable, "benchmarks/bench_online.py", "--tiny", "--device", "cpu", "--tmp", str(tmp)],
        "read": [sys.executable, "benchmarks/bench_read.py", "--quick", "--workers", "0", "--tmp", str(tmp / "read")],
        "read-long": [sys.executable, "benchmarks/bench_read.py", "--long-tokens", "8192", "--hidden", "128", "--repeat", "1",
                      "--tmp", str(tmp / "read-long")],
        "write-long": [sys.executable, "benchmarks/bench_write.py", "--long-tokens", "8192", "--hidden", "128", "--repeat",
                       "1", "--tmp", str(tmp / "write-long")],
        "packed": [sys.executable, "benchmarks/bench_packed.py", "--tiny"],
        "long": [sys.executable, "benchmarks/bench_long.py", "--quick"],
        "scale": [sys.executable, "benchmarks/bench_scale.py", "--shards", "10,20", "--written", "3", "--first-worlds", "2",
                  "--epoch-worlds", "2", "--epoch-max", "10", "--epoch-max-v1", "0", "--tmp", str(tmp)],
    }
    procs = {name: subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for name, cmd in commands.items()}
    out = {}
    for name, proc in procs.items():
        out[name], _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"bench {name} failed:\n{out[name][-3000:]}"
    assert not any(tmp.iterdir()), f"scratch data left behind: {list(tmp.iterdir())}"
    return out


def _value(line: str, column: int) -> float:
    return float(line.split()[column].replace(",", ""))


def _row(text: str, label: str) -> str:
    rows = [line for line in text.splitlines() if line.startswith(label)]
    assert rows, f"no row {label!r} in:\n{text}"
    return rows[0]


def test_gpu_script_table(outputs):
    text = outputs["gpu"]
    for label in ("drafter training (5 layers)", "loader (1 workers)", "teacher extraction (6 of 64 layers)",
                  "teacher extraction (64 layers, est.)"):
        numbers = re.findall(NUMBER, _row(text, label)[len(label):])
        best, median, ratio = (float(n.replace(",", "")) for n in numbers[:3])
        assert best > 0 and median > 0 and ratio > 0, _row(text, label)
        assert best >= median
    noise = _row(text, "noise alone (add_noise_)")
    assert "uniform on cpu == CPU: True" in noise and "gaussian max |diff| 0.0e+00" in noise, noise
    drafter = _row(text, "drafter training")
    assert float(re.findall(NUMBER, drafter[len("drafter training (5 layers)"):])[2]) == 1.0  # its own baseline
    assert re.search(r"^total wall time \d+\.\d s$", text, re.M)


def test_trainer_script_compares_naive_and_chunked(outputs):
    text = outputs["trainer"]
    naive, chunked = _row(text, "    naive"), _row(text, "  chunk32")
    # columns: variant vocab anchors positions model step-peak x-naive copies tok/s (med) x-naive loss
    for row in (naive, chunked):
        assert _value(row, 5) > 0 and _value(row, 8) > 0, row
    assert _value(naive, 3) > 32  # more valid positions than one chunk, so chunking has something to bound
    # the baseline computes the same loss, and chunking keeps the step's memory well below it
    assert _value(naive, 11) == pytest.approx(_value(chunked, 11), rel=1e-4)
    assert "WARNING" not in text
    assert _value(chunked, 5) < 0.6 * _value(naive, 5), (naive, chunked)


def test_online_script_same_data_both_paths(outputs):
    text = outputs["online"]
    offline = _row(text, "offline (cache reader + loader)")
    online = _row(text, "online (teacher forward)")
    for row in (offline, online):
        numbers = [float(n.replace(",", "")) for n in re.findall(NUMBER, row.split(")", 1)[1])]
        assert len(numbers) == 7 and all(n > 0 for n in numbers), row
    match = re.search(r"same sequences and anchors (\w+); hidden max \|diff\| (\S+);", text)
    assert match and match.group(1) == "yes", text
    assert float(match.group(2)) < 1e-3


def test_read_script_compares_the_reader_with_its_baselines(outputs):
    text = outputs["read"]
    for label in ("raw np.memmap -> batches", "torch.load per sample -> batches", "dflash load_batch, Zarr read path",
                  "dflash load_batch  ", "dflash load_batch + float32 + noise (CPU)", "dflash train_loader, 0 workers"):
        numbers = re.findall(NUMBER, _row(text, label)[len(label):])
        assert numbers and all(float(n.replace(",", "")) > 0 for n in numbers[:3]), _row(text, label)
    assert float(re.findall(NUMBER, _row(text, "raw np.memmap -> batches")[24:])[4]) == 1.0  # its own baseline
    assert re.search(r"^noise on this CPU: add_noise_ \d+\.\d+ ns a draw; numpy Philox", text, re.M), text


def _long_rows(text: str, labels: tuple[str, ...]) -> None:
    """Each long-sequence row: a positive rate, its ratio, and peak memory at least zero."""
    for label in labels:
        numbers = [float(n.replace(",", "")) for n in re.findall(NUMBER, _row(text, label)[len(label):])]
        assert numbers[0] > 0 and numbers[2] > 0 and min(numbers[4:8]) >= 0, _row(text, label)
    assert float(re.findall(NUMBER, _row(text, labels[0])[len(labels[0]):])[2]) == 1.0  # its own baseline


def test_read_script_long_sequence_row(outputs):
    _long_rows(outputs["read-long"], ("raw np.memmap -> a tensor", "cache[id]", "Shard.read into a buffer", "sequences()",
                                      "load_batch, packed", "load_batch, padded", "train_loader, packed, 0 workers, 2 batches",
                                      "dflash-cache verify (verify_cache)"))


def test_write_script_long_sequence_row(outputs):
    _long_rows(outputs["write-long"], ("raw numpy tofile + fsync, 1 file", "dflash writer, one shard"))


def test_long_script_times_each_length_in_parts_and_in_one_forward(outputs):
    text = outputs["long"]
    for length in ("512", "1,024", "2,048"):
        row = _row(text, f"{length:>7}")
        assert _value(row, 3) >= 0.9 * 2048, row  # cover anchors: nearly every one of the batch's 2,048 tokens trained
        assert _value(row, 4) > 0 and row.split()[6] != "-", row  # parts and the one-forward baseline both ran
    assert "fit: us/position" in text


def test_packed_script_compares_the_layouts_on_the_same_batches(outputs):
    text = outputs["packed"]
    synthetic = [line for line in text.splitlines() if line.startswith("synthetic log-normal") and " 8,192 " in line]
    assert synthetic and 0.5 < float(synthetic[0].split()[-2].rstrip("%")) / 100 < 0.9, text  # the default batch's padding
    padded, packed = _row(text, "production  padded"), _row(text, "production  packed")
    assert _value(padded, 2) == _value(packed, 2)  # the same real tokens
    assert _value(packed, 3) == _value(packed, 2) < _value(padded, 3)  # packed: no padded positions
    assert padded.split()[-1] == packed.split()[-1]  # the same first loss


def _table(text: str, cells: int) -> dict[tuple[str, str], list[str]]:
    """Rows of the markdown tables with ``cells`` cells whose second cell is a format, by (shards, format)."""
    return {(c[0], c[1]): c for c in ([c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()
                                       if line.startswith("|")) if len(c) == cells and c[1] in ("v1", "v2")}


def test_scale_script_compares_both_formats_at_each_size(outputs):
    text = outputs["scale"]
    rows = _table(text, 11)
    assert set(rows) == {(n, v) for n in ("10", "20") for v in ("v1", "v2")}, text
    for (shards, version), cells in rows.items():
        assert float(cells[4]) == 5.0, cells  # 3 files, the hidden object (one at any chunk count), the record
        assert int(cells[2].replace(",", "")) > 0 and float(cells[10]) >= 0, cells
        if version == "v2" and cells[7] != "None / None":
            assert cells[7] == "3 / 0" and cells[9] == "0 / 0", cells  # manifest + 2 tables; nothing listed
        if version == "v1" and cells[9] != "None / None":
            assert int(cells[9].split(" / ")[1]) > int(shards), cells  # the start-up check lists every shard folder
    # a simulated rank's start-up to its first batch, at W = 2, through the trainer's loader
    first = _table(text, 7)
    assert set(first) == set(rows), text
    for (shards, version), cells in first.items():
        assert float(cells[3]) > 0, cells
        if cells[4] != "-":  # strace present: format 1 plans from every shard's sequences.arrow, format 2 from its index
            assert cells[6].startswith("3 (" if version == "v2" else "1 ("), cells
            if version == "v1":
                assert int(cells[4]) >= int(shards), cells
    # the epoch plan against the per-shard baseline, in the same process: both plans made
    plans = _table(text, 5)
    assert set(plans) == set(rows), text
    for cells in plans.values():
        assert float(cells[2]) > 0 and float(cells[3]) > 0 and float(cells[4]) > 0, cells
    # every rank's epoch at W = 2 (10 shards, format 2): the ranks' sequences add up to the training split
    epoch = _table(text, 10)
    if "One epoch a rank" in text:
        assert set(epoch) == {("10", "v2")}, text
        for cells in epoch.values():
            assert cells[2] == "2" and cells[6] == "yes" and float(cells[3]) > 0, cells
    assert re.search(r"^Growth 20 / 10 shards", text, re.M), text
