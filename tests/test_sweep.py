"""`dflash-train sweep`: grid parsing and names, a 2x2 sweep on a tiny cache, resume, refusals,
and parallel sweeps (one process per run) that equal the serial one and survive a failed run."""

from __future__ import annotations

import csv
import json
import shutil
import struct
from pathlib import Path

import pytest
import safetensors.torch
import torch
from typer.testing import CliRunner

from cli.train import app
from dflash_common.errors import ConfigError
from dflash_train.config import config_differences
from dflash_train.options import train_knobs
from dflash_train.settings.train_config import TrainConfig
from dflash_train.sweep import (
    GridAxis,
    Slot,
    SweepConfig,
    alpha_columns,
    assign_runs,
    device_slots,
    expand_grid,
    failure_reason,
    is_finished,
    parse_grid,
    parse_metrics,
    plan_runs,
    run_name,
    run_overrides,
    run_sweep,
    sweep_config,
)

# ----------------------------------------------------------------------------- pure functions


def test_grid_parsing_short_keys_paths_and_json_values():
    axes = parse_grid(["loss=ce,kl", "loss.streak_smoothing=0.3,0.7", "noise=off,cosine", "gamma=null,7",
                       "model.sliding_layers=[0,1],[1]", "loss.streak_decay=true,false", "optim.betas=[0.9,0.99]"])
    got = {a.key: (a.path, a.values) for a in axes}
    assert got["loss"] == (("loss", "kind"), ("ce", "kl"))
    # a dotted path with a short name is shown by its short name, so run names do not depend on the spelling
    assert got["streak_smoothing"] == (("loss", "streak_smoothing"), (0.3, 0.7))
    assert got["noise"] == (("noise", "schedule"), ("off", "cosine"))
    assert got["gamma"] == (("loss", "gamma"), (None, 7))
    assert got["sliding_layers"] == (("model", "sliding_layers"), ((0, 1), (1,)))
    assert got["streak_decay"][1] == (True, False)
    assert got["betas"] == (("optim", "betas"), ((0.9, 0.99),))
    assert len({k.name for k in train_knobs()}) == len(train_knobs()), "one short name per config field"


@pytest.mark.parametrize("items, message", [
    (["bogus=1,2"], "unknown grid key 'bogus'; use a short key (loss, "),
    (["loss.nope=1"], "unknown grid key 'loss.nope'"),
    (["eval_sequences=8,16"], "cannot vary in a sweep"),
    (["data.heldout_fraction=0.1,0.2"], "same held-out split"),
    (["loss=ce,kl", "loss.kind=mix"], "given twice"),
    (["loss=ce,ce"], "repeats value(s) ['ce']"),
    (["lr=1e-4,0.0001"], "repeats value(s) ['0.0001']"),
    (["loss=ce,,kl"], "empty value"),
    (["loss"], "--grid takes key=value1,value2"),
])
def test_grid_parsing_refusals(items, message):
    with pytest.raises(ConfigError) as err:
        parse_grid(items)
    assert message in str(err.value) and "\n" not in str(err.value)
    if "bogus" in items[0]:  # the error names what is known
        assert "weighting" in str(err.value) and "loss.streak_smoothing" in str(err.value)


def test_run_names_are_stable_safe_and_distinct():
    assert run_name([("loss", "kl"), ("weighting", "streak"), ("noise", "cosine")]) == "loss-kl_weighting-streak_noise-cosine"
    assert run_name([("lr", 1e-4), ("streak_smoothing", 0.3)]) == "lr-0.0001_streak_smoothing-0.3"
    assert run_name([("gamma", None), ("streak_decay", True)]) == "gamma-null_streak_decay-true"
    odd = [run_name([("model.sliding_layers", v)]) for v in ((0, 1), (1,), "a/b", "a b", "../x")]
    assert len(set(odd)) == len(odd)
    for name in odd:
        assert all(c.isalnum() or c in "._+-" for c in name) and "/" not in name and not name.startswith(".")
    assert odd == [run_name([("model.sliding_layers", v)]) for v in ((0, 1), (1,), "a/b", "a b", "../x")]
    long = run_name([(f"key{i}", "x" * 30) for i in range(10)])
    assert len(long) <= 120 and long != run_name([(f"key{i}", "x" * 30) for i in range(9)] + [("key9", "y" * 30)])


def test_expansion_order_and_overrides():
    axes = parse_grid(["loss=ce,kl", "weighting=decay,streak", "steps=5"])
    combos = expand_grid(axes)
    assert [tuple(v for _, v in c) for c in combos] == [("ce", "decay", 5), ("ce", "streak", 5),
                                                        ("kl", "decay", 5), ("kl", "streak", 5)]
    # a swept steps replaces a base epochs (the two are exclusive)
    assert run_overrides(axes, combos[0]) == {"loss": {"kind": "ce", "weighting": "decay"}, "steps": 5, "epochs": None}

    base = TrainConfig(cache="c", out="ignored", epochs=2.0)
    runs = plan_runs(SweepConfig(out="sw", base=base, grid=axes))
    assert [r.name for r in runs] == ["loss-ce_weighting-decay_steps-5", "loss-ce_weighting-streak_steps-5",
                                      "loss-kl_weighting-decay_steps-5", "loss-kl_weighting-streak_steps-5"]
    assert runs[3].config.loss.kind == "kl" and runs[3].config.loss.weighting == "streak"
    assert runs[3].config.steps == 5 and runs[3].config.epochs is None
    assert runs[3].config.out == str(Path("sw") / "runs" / runs[3].name)


def test_objective_grid_values_are_json_tables_or_named_bundles_of_settings():
    (axis,) = parse_grid(['loss_terms={"ce":0.1,"tv":0.9},{"kl":1}'])
    assert axis.path == ("loss", "terms") and axis.values == ({"ce": 0.1, "tv": 0.9}, {"kl": 1})
    runs = plan_runs(SweepConfig(out="sw", base=TrainConfig(cache="c", out="x"), grid=(axis,)))
    assert runs[0].config.loss.term_weights() == {"ce": 0.1, "tv": 0.9} and len({r.name for r in runs}) == 2
    # a key that sets no field names a bundle; its values' settings come as extras
    bundle = GridAxis("objective", (), ("kl+dpace", "tv"),
                      extras=((("loss.weighting", "dpace"),), (("loss.kind", "tv"), ("loss.weighting", "decay"))))
    runs = plan_runs(SweepConfig(out="sw", base=TrainConfig(cache="c", out="x"), grid=(bundle,)))
    assert [r.name for r in runs] == ["objective-kl+dpace", "objective-tv"]
    assert (runs[0].config.loss.kind, runs[0].config.loss.weighting) == ("kl", "dpace")
    assert (runs[1].config.loss.kind, runs[1].config.loss.weighting) == ("tv", "decay")
    with pytest.raises(ConfigError, match="sets no config field"):
        GridAxis("objective", (), ("a", "b"))


def test_sweep_config_refuses_bad_combinations_before_training(tmp_path):
    base = TrainConfig(cache="c", out="o")
    with pytest.raises(ConfigError, match=r"sweep run loss-bogus: loss kind 'bogus' is unknown"):
        sweep_config(str(tmp_path / "s"), base, grid=["loss=kl,bogus"])
    built = SweepConfig(out=str(tmp_path / "s"), base=base, grid=parse_grid(["weighting=streak,decay", "streak_decay=true"]))
    with pytest.raises(ConfigError, match="streak_decay=True needs weighting 'streak'"):
        plan_runs(built)  # a config built directly is checked when planned, before anything trains
    with pytest.raises(ConfigError, match="streak_decay=True needs weighting 'streak'"):
        run_sweep(built)
    assert not (tmp_path / "s").exists()
    with pytest.raises(ConfigError, match="at least one --grid"):
        SweepConfig(out="sw", base=base, grid=())


def test_metrics_parsing_and_finished():
    lines = [json.dumps({"kind": "eval", "step": 0, "loss": 9.0, "alpha": [0.1]}),
             json.dumps({"kind": "train", "step": 2, "loss": 5.0}),
             json.dumps({"kind": "train", "step": 4, "loss": 4.0}),
             '{"kind": "train", "st',  # cut short by a kill
             json.dumps({"kind": "train", "step": 4, "loss": 3.9}),  # the resumed run's step 4 wins
             json.dumps({"kind": "eval", "step": 4, "loss": 3.0, "alpha": [0.5, 0.25]})]
    m = parse_metrics(lines)
    assert [r["loss"] for r in m.train] == [5.0, 3.9] and m.last_step == 4 and m.final_eval["loss"] == 3.0
    assert is_finished(True, m, expects_eval=True)
    assert not is_finished(False, m, expects_eval=True)
    unevaluated = parse_metrics(lines[:5])
    assert not is_finished(True, unevaluated, expects_eval=True) and is_finished(True, unevaluated, expects_eval=False)
    assert not is_finished(True, parse_metrics([]), expects_eval=False)


def test_config_differences_and_alpha_columns():
    saved = TrainConfig(cache="c", out="a", steps=10, device="cpu", log_every=1).to_dict()
    assert config_differences(saved, TrainConfig(cache="c", out="b", steps=10, device="cuda").to_dict()) == []
    assert config_differences(saved, TrainConfig(cache="c", out="a", steps=20).to_dict()) == [("steps", 10, 20)]
    assert alpha_columns([0.9, 0.8, 0.7]) == {"alpha_1": 0.9, "alpha_2": 0.8, "alpha_4": None, "alpha_last": 0.7}
    assert alpha_columns([0.9, 0.8, 0.7, 0.6, 0.5])["alpha_4"] == 0.6
    assert alpha_columns(None) == {"alpha_1": None, "alpha_2": None, "alpha_4": None, "alpha_last": None}


def test_device_slots_share_devices_and_cores():
    # CPU: the cores are shared out, the remainder to the first slots, never below one thread
    assert device_slots(2, (), "auto", gpus=0, cpus=2) == (Slot(0, "cpu", 1), Slot(1, "cpu", 1))
    assert [s.threads for s in device_slots(3, (), "cpu", gpus=4, cpus=8)] == [3, 3, 2]
    assert {s.device for s in device_slots(3, (), "cpu", gpus=4, cpus=8)} == {"cpu"}  # cpu asked for: no GPU
    assert [s.threads for s in device_slots(4, (), "cpu", gpus=0, cpus=2)] == [1, 1, 1, 1]
    # a CUDA machine: one slot per visible GPU, round-robin past the count
    assert [s.device for s in device_slots(4, (), "auto", gpus=2, cpus=16)] == ["cuda:0", "cuda:1", "cuda:0", "cuda:1"]
    assert [s.device for s in device_slots(2, (), "cuda", gpus=4, cpus=16)] == ["cuda:0", "cuda:1"]
    # listed devices win over the base device; an indexed base device is honoured
    assert [s.device for s in device_slots(3, ("cuda:1", "cuda:3"), "cpu", gpus=0, cpus=2)] == ["cuda:1", "cuda:3", "cuda:1"]
    assert [s.device for s in device_slots(2, (), "cuda:2", gpus=4, cpus=4)] == ["cuda:2", "cuda:2"]


def test_assign_runs_fills_free_slots_in_grid_order_spreading_over_devices():
    slots = device_slots(4, (), "auto", gpus=2, cpus=8)  # cuda:0, cuda:1, cuda:0, cuda:1
    first = assign_runs(["a", "b", "c", "d", "e"], slots, busy=())
    assert [(name, s.index, s.device) for name, s in first] == [("a", 0, "cuda:0"), ("b", 1, "cuda:1"),
                                                                ("c", 2, "cuda:0"), ("d", 3, "cuda:1")]
    assert assign_runs(["e"], slots, busy={0, 1, 2, 3}) == []
    # slot 2 (cuda:0) busy: the next run goes to idle cuda:1 (slot 1), not to slot 0 beside it
    assert [(n, s.index) for n, s in assign_runs(["e"], slots, busy={2})] == [("e", 1)]
    assert [(n, s.index) for n, s in assign_runs(["e", "f"], slots, busy={2})] == [("e", 1), ("f", 0)]
    # one device: lowest free slot first; fewer runs than slots leaves the rest idle
    cpu = device_slots(3, (), "cpu", gpus=0, cpus=3)
    assert [(n, s.index) for n, s in assign_runs(["x"], cpu, busy={0})] == [("x", 1)]
    assert assign_runs([], cpu, busy=()) == []


def test_sweep_config_parallel_and_devices():
    base, grid = TrainConfig(cache="c", out="o"), parse_grid(["loss=ce,kl"])
    assert SweepConfig(out="sw", base=base, grid=grid).parallel == 1
    assert not SweepConfig(out="sw", base=base, grid=grid).in_processes
    both = SweepConfig(out="sw", base=base, grid=grid, devices=(" cuda:0", "cuda:1"))
    assert both.parallel == 2 and both.devices == ("cuda:0", "cuda:1") and both.in_processes
    assert SweepConfig(out="sw", base=base, grid=grid, parallel=3).in_processes
    assert SweepConfig(out="sw", base=base, grid=grid, parallel=1, devices=("cuda:1",)).in_processes
    for kwargs, message in [({"parallel": 0}, "--parallel must be a whole number of at least 1, got 0"),
                            ({"parallel": 1.5}, "got 1.5"),
                            ({"devices": ("auto",)}, "--devices lists concrete devices, got 'auto'"),
                            ({"devices": ("gpu0",)}, "--devices entry 'gpu0' is not a device; use cpu, cuda or cuda:N"),
                            ({"devices": ("cuda:0", "")}, "--devices entry '' is not a device")]:
        with pytest.raises(ConfigError) as err:  # torch reads the devices when the runs are planned
            plan_runs(SweepConfig(out="sw", base=base, grid=grid, **kwargs))
        assert message in str(err.value) and "\n" not in str(err.value)


def test_failure_reason_reads_this_sessions_last_error():
    log = ("\n=== 2025-01-01 00:00:00 sweep: training r on cpu, 1 thread(s)\nerror: old problem\n"
           "\n=== 2025-01-02 00:00:00 sweep: resuming r on cpu, 1 thread(s)\n2025-01-02 00:00:01 training: 6 step(s)\n"
           "error: checkpoint x cannot be read (gone); resume from an older step-* folder\n")
    assert failure_reason(log, 1) == "checkpoint x cannot be read (gone); resume from an older step-* folder"
    crash = "\n=== t sweep: training r on cpu, 1 thread(s)\nTraceback (most recent call last):\n  File x\nValueError: bad\n"
    assert failure_reason(crash, 1) == "ValueError: bad"
    assert failure_reason("\n=== t sweep: training r\n", 1) == "no output"
    assert failure_reason("\n=== t sweep: training r\nstep 3\n", -9).startswith("killed by signal 9")
    assert len(failure_reason("\n=== t\nerror: " + "x" * 1000 + "\n", 1)) == 300


# ----------------------------------------------------------------------------- a real sweep



@pytest.fixture(scope="module")
def cache_url(tiny_cache):
    return tiny_cache()


SETS = ["model.num_layers=1", "model.block_size=4", "data.batch_tokens=400",
        "data.heldout_fraction=0.1", "eval_sequences=8", "save_every=3", "log_every=1", "device=cpu"]
GRID = ["--grid", "loss=ce,kl", "--grid", "weighting=decay,streak"]


def _sweep(cache_url, out, *extra, grid=GRID):
    args = ["sweep", "--cache", cache_url, "--out", str(out), *grid, "--steps", "6", "--quiet", *extra]
    for item in SETS:
        args += ["--set", item]
    return CliRunner().invoke(app, args)


def _csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _png_size(path) -> tuple[int, int]:
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


def _snapshot(runs: Path) -> dict:
    return {str(p.relative_to(runs)): (p.stat().st_mtime_ns, p.read_bytes()) for p in sorted(runs.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def swept(tmp_path_factory, cache_url):
    out = tmp_path_factory.mktemp("sweep") / "sw"
    result = _sweep(cache_url, out)
    assert result.exit_code == 0, result.output
    return out, result.output


def test_two_by_two_sweep_writes_runs_tables_and_plots(swept):
    out, output = swept
    rows = _csv(out / "results.csv")
    assert len(rows) == 4
    assert {(r["loss"], r["weighting"]) for r in rows} == {("ce", "decay"), ("ce", "streak"), ("kl", "decay"), ("kl", "streak")}
    for row in rows:
        assert row["run"] == f"loss-{row['loss']}_weighting-{row['weighting']}"
        assert row["steps"] == "6" and float(row["tokens_per_s"]) > 0
        assert float(row["train_loss"]) > 0 and float(row["heldout_loss"]) > 0 and float(row["tau"]) >= 1
        assert 0 <= float(row["alpha_1"]) <= 1 and row["alpha_4"] == "" and row["alpha_last"] != ""  # B=4: 3 positions
        run = out / "runs" / row["run"]
        config = json.loads((run / "config.json").read_text())
        assert (config["loss"]["kind"], config["loss"]["weighting"]) == (row["loss"], row["weighting"])
        assert config["steps"] == 6 and config["model"]["block_size"] == 4 and config["out"] == str(run)
        assert (run / "drafter" / "model.safetensors").exists()
    # different losses make different numbers
    assert len({r["heldout_loss"] for r in rows}) == 4

    table = (out / "results.md").read_text()
    lines = table.strip().splitlines()
    assert len(lines) == 2 + 4 and lines[0].startswith("| run | loss | weighting | train_loss | heldout_loss | tau")
    assert all(f"| {r['run']} |" in table for r in rows)
    assert table in output  # the CLI prints the table

    for png in ("loss_curves.png", "acceptance_by_position.png"):
        width, height = _png_size(out / png)
        assert width > 300 and height > 200 and (out / png).stat().st_size > 10_000

    record = json.loads((out / "sweep.json").read_text())
    assert record["grid"] == [{"key": "loss", "field": "loss.kind", "values": ["ce", "kl"]},
                              {"key": "weighting", "field": "loss.weighting", "values": ["decay", "streak"]}]
    assert record["base"]["steps"] == 6 and record["base"]["data"]["heldout_fraction"] == 0.1
    assert [r["name"] for r in record["runs"]] == [r["run"] for r in rows]


def test_rerun_trains_nothing_and_rewrites_the_same_table(swept, cache_url):
    out, _ = swept
    before, csv_before, md_before = _snapshot(out / "runs"), (out / "results.csv").read_text(), (out / "results.md").read_text()
    (out / "results.md").unlink()
    (out / "loss_curves.png").unlink()
    again = _sweep(cache_url, out)
    assert again.exit_code == 0, again.output
    assert "4 finished, 0 to train" in again.output
    assert _snapshot(out / "runs") == before  # no checkpoint, metric or export was touched
    assert (out / "results.csv").read_text() == csv_before and (out / "results.md").read_text() == md_before
    assert _png_size(out / "loss_curves.png")[0] > 300

    # a changed shared setting would report old runs under new settings: refused before anything runs
    changed = CliRunner().invoke(app, ["sweep", "--cache", cache_url, "--out", str(out), *GRID, "--steps", "7", "--quiet",
                                       *[x for item in SETS for x in ("--set", item)]])
    assert changed.exit_code == 1 and "was made with other settings" in changed.output and "steps: 6 vs 7" in changed.output
    assert _snapshot(out / "runs") == before
    assert json.loads((out / "sweep.json").read_text())["base"]["steps"] == 6

    bad = CliRunner().invoke(app, ["sweep", "--cache", cache_url, "--out", str(out), "--grid", "nope=1,2"])
    assert bad.exit_code == 1 and "unknown grid key 'nope'" in bad.output and "Traceback" not in bad.output
    missing = CliRunner().invoke(app, ["sweep", "--cache", str(out / "no-cache"), "--out", str(out.parent / "new"), *GRID])
    assert missing.exit_code == 1 and "not a dflash cache" in missing.output and not (out.parent / "new").exists()


def test_interrupted_run_resumes_from_its_checkpoint(swept, cache_url, tmp_path):
    original, _ = swept
    out = tmp_path / "sw"
    shutil.copytree(original, out)
    name = "loss-kl_weighting-streak"
    run = out / "runs" / name
    final = safetensors.torch.load_file(str(run / "checkpoints" / "step-000006" / "model.safetensors"))
    # as if killed at step 5: the step-3 checkpoint is the newest, no final eval, no export
    shutil.rmtree(run / "checkpoints" / "step-000006")
    shutil.rmtree(run / "drafter")
    lines = (run / "metrics.jsonl").read_text().splitlines()
    (run / "metrics.jsonl").write_text("\n".join(x for x in lines if json.loads(x)["step"] <= 5) + "\n")
    others = {p.name: _snapshot(p) for p in (out / "runs").iterdir() if p.name != name}

    result = _sweep(cache_url, out)
    assert result.exit_code == 0, result.output
    assert "3 finished, 1 to train" in result.output and f"resuming {name}" in result.output
    assert {p.name: _snapshot(p) for p in (out / "runs").iterdir() if p.name != name} == others
    resumed = safetensors.torch.load_file(str(run / "checkpoints" / "step-000006" / "model.safetensors"))
    assert all(torch.equal(final[k], resumed[k]) for k in final)  # the same run as if never interrupted
    assert (run / "drafter" / "model.safetensors").exists()

    def numbers(path):  # tokens/s is the resumed session's own rate
        return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in _csv(path)]
    assert numbers(out / "results.csv") == numbers(original / "results.csv")


# ----------------------------------------------------------------------------- parallel sweeps


def _tensors(path) -> dict:
    return safetensors.torch.load_file(str(path))


def _same_tensors(a, b) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _without_rate(rows):  # tokens/s is each session's own measured rate
    return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows]


def _learned(run: Path) -> list[dict]:
    return [{k: v for k, v in json.loads(line).items() if k != "tokens_per_s"}
            for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_parallel_sweep_equals_the_serial_sweep(swept, cache_url, tmp_path):
    serial, _ = swept
    out = tmp_path / "sw"
    # half the 2x2 grid: the same names and configs as the serial sweep's kl/ce x streak runs
    result = _sweep(cache_url, out, "--parallel", "2", grid=["--grid", "loss=ce,kl", "--grid", "weighting=streak"])
    assert result.exit_code == 0, result.output
    names = ["loss-ce_weighting-streak", "loss-kl_weighting-streak"]
    for name in names:
        assert f"training {name} on cpu" in result.output and f"{name} finished in" in result.output
        run, reference = out / "runs" / name, serial / "runs" / name
        log = (run / "train.log").read_text()
        assert f"run {name} on cpu with" in log and f"run {name} finished" in log and "held-out after training" in log
        assert _same_tensors(_tensors(run / "drafter" / "model.safetensors"), _tensors(reference / "drafter" / "model.safetensors"))
        assert _same_tensors(_tensors(run / "checkpoints" / "step-000006" / "model.safetensors"),
                             _tensors(reference / "checkpoints" / "step-000006" / "model.safetensors"))
        assert _learned(run) == _learned(reference)  # every loss, alpha and held-out number
    serial_rows = {r["run"]: r for r in _without_rate(_csv(serial / "results.csv"))}
    assert _without_rate(_csv(out / "results.csv")) == [serial_rows[n] for n in names]
    assert (out / "results.md").read_text() in result.output
    assert all(_png_size(out / png)[0] > 300 for png in ("loss_curves.png", "acceptance_by_position.png"))


@pytest.mark.parametrize("mode", ["parallel", "serial"])
@pytest.mark.fast_cases(1)
def test_sweep_names_a_failed_run_and_its_log_while_the_others_finish(swept, cache_url, tmp_path, mode):
    original, _ = swept
    out = tmp_path / "sw"
    shutil.copytree(original, out)
    broken, resumed = "loss-ce_weighting-decay", "loss-kl_weighting-streak"
    for name in (broken, resumed):  # both as if killed at step 5: step-3 is their newest checkpoint
        run = out / "runs" / name
        shutil.rmtree(run / "checkpoints" / "step-000006")
        shutil.rmtree(run / "drafter")
        lines = (run / "metrics.jsonl").read_text().splitlines()
        (run / "metrics.jsonl").write_text("\n".join(x for x in lines if json.loads(x)["step"] <= 5) + "\n")
    (out / "runs" / broken / "checkpoints" / "step-000003" / "model.safetensors").unlink()  # and damaged
    finished = {p.name: _snapshot(p) for p in (out / "runs").iterdir() if p.name not in (broken, resumed)}

    result = _sweep(cache_url, out, *(["--parallel", "2"] if mode == "parallel" else []))
    assert result.exit_code == 1, result.output
    assert "2 finished, 2 to train" in result.output
    assert (f"resuming {resumed} on cpu" if mode == "parallel" else f"resuming {resumed}") in result.output
    error = result.output.strip().splitlines()[-1]
    log = out / "runs" / broken / "train.log"
    assert error.startswith(f"error: 1 sweep run(s) failed: {broken} (exit 1: checkpoint ")
    assert "cannot be read" in error and f"log {log})" in error and "rerun the same command" in error
    assert resumed not in error and "Traceback" not in result.output
    assert "error: checkpoint" in log.read_text()

    # the other run resumed to the end as if never interrupted; the finished ones were not touched
    reference = original / "runs" / resumed / "checkpoints" / "step-000006" / "model.safetensors"
    assert _same_tensors(_tensors(out / "runs" / resumed / "checkpoints" / "step-000006" / "model.safetensors"),
                         _tensors(reference))
    assert (out / "runs" / resumed / "drafter" / "model.safetensors").exists()
    assert {p.name: _snapshot(p) for p in (out / "runs").iterdir() if p.name not in (broken, resumed)} == finished
    # the report was still written: the failed run's row shows how far it got
    rows = {r["run"]: r for r in _without_rate(_csv(out / "results.csv"))}
    expected = {r["run"]: r for r in _without_rate(_csv(original / "results.csv"))}
    assert all(rows[name] == expected[name] for name in expected if name != broken)
    assert rows[broken]["steps"] == "5" and rows[broken]["heldout_loss"] == ""


def test_sweep_config_takes_a_presets_design_and_the_given_fields_over_it(tmp_path):
    from dflash_train.sweep import PRESETS

    base = TrainConfig(cache=str(tmp_path / "cache"), out=str(tmp_path / "unused"), steps=12)
    cfg = sweep_config(str(tmp_path / "s"), base, preset_name="recipe", given={"seeds": 1, "measure": {"max_prompts": 3}})
    assert cfg.grid == PRESETS["recipe"].grid and cfg.reference == PRESETS["recipe"].reference
    assert cfg.seeds == 1 and cfg.measure.curve_points == PRESETS["recipe"].curve_points and cfg.measure.max_prompts == 3
    plain = sweep_config(str(tmp_path / "s"), base, grid=["loss=ce,kl"])
    assert [a.key for a in plain.grid] == ["loss"] and plain.seeds is None and plain.measure.curve_points == 0
    with pytest.raises(ConfigError, match="--preset recipe sets the grid; drop --grid loss=ce,kl"):
        sweep_config(str(tmp_path / "s"), base, grid=["loss=ce,kl"], preset_name="recipe")
    with pytest.raises(ConfigError, match="--preset 'nope' is unknown"):
        sweep_config(str(tmp_path / "s"), base, preset_name="nope")
