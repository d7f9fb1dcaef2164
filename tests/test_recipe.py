"""The recipe study: seeds in sweeps, the summary's statistics on known numbers, the preset's
design, and `examples/recipe.py --tiny` end to end (2 steps a run, both caches)."""

from __future__ import annotations

import csv
import json
import math
import struct
import sys
from pathlib import Path

import pytest
import safetensors.torch
from helpers import qa_rows
from typer.testing import CliRunner

from cli.train import app
from dflash_common.errors import ConfigError
from dflash_train.measuring.summary_statistics import (
    interpolate,
    paired_difference,
    spearman,
    t_interval,
    t_quantile,
    tokens_by_step,
    tokens_to_reach,
)
from dflash_train.settings.measure_config import MeasureConfig
from dflash_train.settings.train_config import TrainConfig
from dflash_train.sweep import (
    FULL_RECIPE,
    PAPER_RECIPE,
    PRESETS,
    SweepConfig,
    one_factor_neighbours,
    parse_grid,
    plan_runs,
    planned_combinations,
)
from dflash_train.sweep.recipe import RunOutcome, summarize, summary_markdown, tau_at_budget

ROOT = Path(__file__).resolve().parent.parent

# ----------------------------------------------------------------------------- statistics on known numbers


def test_t_interval_of_known_numbers():
    iv = t_interval([1.0, 2.0, 3.0])  # mean 2, s = 1, t_{0.975,2} = 4.3027
    assert iv.mean == 2.0 and iv.n == 3
    assert iv.half_width == pytest.approx(4.3027 / math.sqrt(3), abs=1e-9)
    assert (iv.low, iv.high) == pytest.approx((2 - 2.48416, 2 + 2.48416), abs=1e-4)
    two = t_interval([4.0, 6.0])  # s = sqrt(2), t_{0.975,1} = 12.7062
    assert two.half_width == pytest.approx(12.7062 * math.sqrt(2) / math.sqrt(2))
    one = t_interval([5.0])
    assert (one.mean, one.low, one.high, one.n) == (5.0, 5.0, 5.0, 1) and one.text() == "5.000 (n=1)"
    assert t_quantile(4) == 2.7764 and t_quantile(30) == 2.0423
    assert t_quantile(60) == pytest.approx(2.0003, abs=2e-4) and t_quantile(10_000) == pytest.approx(1.96, abs=1e-3)
    with pytest.raises(ConfigError, match="no values"):
        t_interval([])


def test_paired_difference_pairs_by_seed():
    config = {0: 3.0, 1: 4.0, 2: 8.0}
    reference = {0: 2.0, 1: 2.0, 2: 6.0, 3: 100.0}  # seed 3 has no partner and is left out
    iv = paired_difference(config, reference)
    # differences 1, 2, 2: mean 5/3, s = sqrt(1/3)
    assert iv.n == 3 and iv.mean == pytest.approx(5 / 3)
    assert iv.half_width == pytest.approx(4.3027 * math.sqrt(1 / 3) / math.sqrt(3))
    # an unpaired interval of the same numbers would be far wider: pairing removes the seed effect
    assert iv.half_width < t_interval(list(config.values())).half_width
    assert paired_difference({5: 1.0}, {6: 1.0}) is None


def test_curves_budgets_and_tokens_to_reach():
    curve = [(0, 1.0), (100, 2.0), (200, 3.0), (400, 3.5)]
    assert interpolate(curve, 50) == 1.5 and interpolate(curve, 300) == 3.25 and interpolate(curve, 999) == 3.5
    assert tokens_to_reach(curve, 2.5) == 150 and tokens_to_reach(curve, 3.5) == 400
    assert tokens_to_reach(curve, 3.6) is None and tokens_to_reach(curve, 0.5) == 0
    assert tokens_by_step([10, 20, 30], grad_accum=1, steps=4) == [10, 30, 60, 70]
    assert tokens_by_step([10, 20, 30], grad_accum=2, steps=2) == [30, 70]
    outcomes = [RunOutcome("c", 0, {}, {"curve": [{"step": 0, "tokens": 0, "tau": 1.0}, {"step": 2, "tokens": 400, "tau": 3.0}]}),
                RunOutcome("c", 1, {}, {"curve": [{"step": 0, "tokens": 0, "tau": 1.0}, {"step": 2, "tokens": 200, "tau": 2.0}]})]
    # 25% of each seed's own tokens: 1.5 and 1.25
    assert tau_at_budget(outcomes, 0.25).mean == pytest.approx(1.375)
    assert spearman({"a": 1, "b": 2, "c": 3}, {"a": 10, "b": 20, "c": 30}) == pytest.approx(1.0)
    assert spearman({"a": 1, "b": 2, "c": 3}, {"a": 30, "b": 20, "c": 10}) == pytest.approx(-1.0)
    assert spearman({"a": 1, "b": 2}, {"a": 1, "b": 2}) is None


def _outcome(config: str, seed: int, tau: float, accepted: float, curve: list[tuple[int, float]]) -> RunOutcome:
    points = [{"step": i, "tokens": t, "tau": v} for i, (t, v) in enumerate(curve)]
    return RunOutcome(config, seed, {"tau": tau, "tau_greedy": tau - 0.5, "loss": 1.0},
                      {"curve": points, "decoding": {"accepted_length": accepted, "matched_teacher": True}})


def test_summary_intervals_come_from_the_per_seed_values():
    ref, new = "loss=ce", "loss=kl"
    outcomes = [_outcome(ref, 0, 2.0, 1.5, [(0, 1.0), (100, 1.5), (200, 2.0)]),
                _outcome(ref, 1, 3.0, 1.7, [(0, 1.0), (100, 2.5), (200, 3.0)]),
                _outcome(new, 0, 2.5, 1.4, [(0, 1.0), (100, 2.5), (200, 2.5)]),
                _outcome(new, 1, 3.7, 1.8, [(0, 1.0), (100, 3.0), (200, 3.7)])]
    summary = summarize(outcomes, ref)
    rows = {r["configuration"]: r for r in summary.rows}
    assert rows[ref]["reference"] and rows[ref]["tau_vs_reference"] is None
    assert rows[new]["tau"].mean == pytest.approx(3.1) and rows[new]["tau"].half_width == pytest.approx(
        12.7062 * math.sqrt(0.72) / math.sqrt(2))
    diff = rows[new]["tau_vs_reference"]  # paired: 0.5 and 0.7
    assert diff.mean == pytest.approx(0.6) and diff.half_width == pytest.approx(12.7062 * math.sqrt(0.02) / math.sqrt(2))
    assert rows[new]["accepted_length_vs_reference"].mean == pytest.approx(0.0)
    # mean curves: reference ends at 2.5; the new one is at 2.75 by 100 tokens -> reaches 2.5 at 100 * 1.5/1.75
    assert rows[new]["tokens_to_reference_tau"] == pytest.approx(100 * 1.5 / 1.75)
    assert rows[ref]["tokens_to_reference_tau"] == pytest.approx(200)
    assert rows[new]["tau_at_50pct"].mean == pytest.approx(2.75)
    assert rows[new]["matched_teacher"] is True
    assert "too few configurations" in summary.ranking_note
    three = summarize(outcomes + [_outcome("loss=mix", 0, 1.0, 1.0, [(0, 1.0), (200, 1.0)])], ref)
    # offline tau 2.5, 3.1, 1.0 and real 1.6, 1.6, 1.0 (a tie): Spearman of (2, 3, 1) and (2.5, 2.5, 1)
    assert "Spearman rank correlation of offline tau (sampling estimate) and the real accepted length over 3 " \
           "configurations: 0.87" in three.ranking_note


# ----------------------------------------------------------------------------- the preset's design


def test_recipe_preset_grid_and_one_at_a_time_design():
    grid = PRESETS["recipe"].grid
    base = TrainConfig(cache="c", out="o", steps=8)
    full = SweepConfig(out="sw", base=base, grid=grid, seeds=3, reference=PAPER_RECIPE)
    runs = plan_runs(full)
    assert len(runs) == 3 * 2 * 3 * 3
    assert runs[0].name == "loss-ce_weighting-decay_noise-off_seed-0" and runs[2].seed == 2
    for run in runs:  # the seed sets init, anchors and noise together
        assert run.config.seed == run.config.data.seed == run.config.noise.seed == run.seed
    constant = next(r for r in runs if dict(r.values)["noise"] == "constant")
    cosine = next(r for r in runs if dict(r.values)["noise"] == "cosine")
    assert (constant.config.noise.distribution, constant.config.noise.start) == ("uniform", 0.05)
    assert (cosine.config.noise.start, cosine.config.noise.end) == (0.1, 0.01)
    oat = SweepConfig(out="sw", base=base, grid=grid, seeds=3, design="one-at-a-time", reference=PAPER_RECIPE,
                      centers=(PAPER_RECIPE,), include=(FULL_RECIPE,))
    combos = planned_combinations(oat)
    # the paper recipe, its 5 one-part changes and the full recipe, in grid order
    assert combos[0] == PAPER_RECIPE and len(combos) == 7 and FULL_RECIPE in combos
    assert (("loss", "kl"), ("weighting", "streak"), ("noise", "off")) not in combos  # two changes
    both = SweepConfig(out="sw", base=base, grid=grid, design="one-at-a-time", centers=(PAPER_RECIPE, FULL_RECIPE))
    assert len(planned_combinations(both)) == 12
    assert one_factor_neighbours([(("a", 1), ("b", 1)), (("a", 2), ("b", 2))], [(("a", 1), ("b", 1))]) == [(("a", 1), ("b", 1))]
    curve = SweepConfig(out="sw", base=base, grid=grid, measure=MeasureConfig(curve_points=3))
    assert {(r.config.save_every, r.config.keep_checkpoints) for r in plan_runs(curve)} == {(2, 5)}


@pytest.mark.parametrize("kwargs, message", [
    ({"seeds": 0}, "--seeds must be a whole number of at least 1"),
    ({"seeds": 2, "grid": parse_grid(["seed=0,1"])}, "--seeds sets seed, data.seed, noise.seed itself"),
    ({"design": "half"}, "--design must be one of full, one-at-a-time"),
    ({"reference": (("loss", "nope"),)}, "is not a combination of the grid"),
])
def test_sweep_seed_and_design_refusals(kwargs, message):
    values = {"out": "sw", "base": TrainConfig(cache="c", out="o", steps=4), "grid": parse_grid(["loss=ce,kl"]), **kwargs}
    with pytest.raises(ConfigError) as err:
        SweepConfig(**values)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_preset_cli_refusals(tmp_path):
    for args, message in [(["--preset", "nope"], "--preset 'nope' is unknown; known: recipe"),
                          (["--preset", "recipe", "--grid", "loss=ce"], "--preset recipe sets the grid; drop --grid loss=ce"),
                          (["--preset", "recipe", "--design", "half"], "--design must be one of full, one-at-a-time"),
                          (["--preset", "recipe", "--teacher", "t"], "needs both --teacher and --prompts")]:
        result = CliRunner().invoke(app, ["sweep", "--cache", str(tmp_path / "c"), "--out", str(tmp_path / "o"), "--steps", "4",
                                          *args])
        assert result.exit_code == 1 and message in result.output and "Traceback" not in result.output, result.output
    assert not (tmp_path / "o").exists()


def test_measure_config_refusals():
    with pytest.raises(ConfigError, match="needs both --teacher and --prompts"):
        MeasureConfig(teacher="t")
    with pytest.raises(ConfigError, match="--curve-points must be 0 or more"):
        MeasureConfig(curve_points=-1)
    with pytest.raises(ConfigError, match="--sample-temperature must be a number >= 0"):
        MeasureConfig(sample_temperature=-1.0)


def test_a_sampled_decoding_asked_for_later_is_measured_then():
    greedy = {"curve": [], "decoding": {"accepted_length": 2.0}}
    sampled = {**greedy, "sampling": {"accepted_length": 1.8, "temperature": 1.0}}
    decode = dict(teacher="t", prompts="p")
    assert MeasureConfig(**decode).covers(greedy) and not MeasureConfig(**decode).covers(None)
    assert not MeasureConfig(**decode, sample_temperature=1.0).covers(greedy)
    assert MeasureConfig(**decode, sample_temperature=1.0).covers(sampled)
    assert not MeasureConfig(**decode, sample_temperature=0.7).covers(sampled)


def test_summary_pairs_the_sampled_accepted_length_by_seed_beside_greedy():
    ref, new = "objective=kl", "objective=tv"
    outcomes = []
    for config, seed, sampled in ((ref, 0, 1.5), (ref, 1, 1.9), (new, 0, 1.75), (new, 1, 2.05)):
        o = _outcome(config, seed, 2.0, 1.6, [(0, 1.0), (100, 2.0)])
        o.measure["sampling"] = {"accepted_length": sampled, "temperature": 1.0}
        outcomes.append(o)
    summary = summarize(outcomes, ref)
    row = {r["configuration"]: r for r in summary.rows}[new]
    assert summary.sample_temperature == 1.0
    assert row["accepted_length_sampled"].mean == pytest.approx(1.9)
    diff = row["accepted_length_sampled_vs_reference"]  # paired: +0.25 and +0.15
    assert diff.mean == pytest.approx(0.2) and diff.half_width == pytest.approx(12.7062 * math.sqrt(0.005) / math.sqrt(2))
    text = summary_markdown(summary)
    assert "real accepted length, T=1 | Δ T=1 vs reference" in text and "+0.200 [" in text
    # greedy-only sweeps keep their table as it was
    plain = summary_markdown(summarize([_outcome(ref, 0, 2.0, 1.6, [(0, 1.0)])], ref))
    assert "T=1" not in plain and summarize([_outcome(ref, 0, 2.0, 1.6, [(0, 1.0)])], ref).sample_temperature is None


# ----------------------------------------------------------------------------- seeds in a real sweep


@pytest.fixture
def one_thread():
    """Tiny models train and decode fastest on one thread (a tiny sweep run took about a third of
    the time with one thread as with two on a loaded 2-core machine); a sweep's processes get
    their slot's count anyway."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def recipe_cache(tiny_cache):
    return tiny_cache(rows=qa_rows(30, seed=5, prefix="r5-"))


SETS = ["model.num_layers=1", "model.block_size=4", "data.batch_tokens=300", "data.anchors=random", "data.num_anchors=4",
        "data.heldout_fraction=0.2", "eval_sequences=4", "device=cpu", "noise.schedule=constant"]


def _seed_sweep(cache, out, seeds):
    args = ["sweep", "--cache", cache, "--out", str(out), "--grid", "loss=kl", "--steps", "3", "--seeds", str(seeds),
            "--quiet", *[x for item in SETS for x in ("--set", item)]]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    return result.output


def _weights(out: Path, seed: int) -> dict:
    return safetensors.torch.load_file(str(out / "runs" / f"loss-kl_seed-{seed}" / "drafter" / "model.safetensors"))


def test_seeds_change_the_weights_and_one_seed_repeats_bit_for_bit(recipe_cache, tmp_path, one_thread):
    output = _seed_sweep(recipe_cache, tmp_path / "two", 2)
    assert "Reference: **loss=kl**" in output  # the CLI prints summary.md
    _seed_sweep(recipe_cache, tmp_path / "one", 1)
    first, second, again = _weights(tmp_path / "two", 0), _weights(tmp_path / "two", 1), _weights(tmp_path / "one", 0)
    assert first.keys() == again.keys()
    assert all((first[k] == again[k]).all() and first[k].dtype == again[k].dtype for k in first), "seed 0 twice differs"
    assert any(not (first[k] == second[k]).all() for k in first), "seeds 0 and 1 gave the same weights"
    with open(tmp_path / "two" / "results.csv", newline="") as f:
        assert [r["seed"] for r in csv.DictReader(f)] == ["0", "1"]
    with open(tmp_path / "two" / "summary.csv", newline="") as f:
        (row,) = list(csv.DictReader(f))
    taus = []
    for seed in (0, 1):
        with open(tmp_path / "two" / "results.csv", newline="") as f:
            taus.append(float(next(r for r in csv.DictReader(f) if r["seed"] == str(seed))["tau"]))
    assert float(row["tau_mean"]) == pytest.approx(sum(taus) / 2)
    assert float(row["tau_high"]) - float(row["tau_low"]) == pytest.approx(2 * 12.7062 * abs(taus[0] - taus[1]) / 2, rel=1e-3)


# ----------------------------------------------------------------------------- the tiny recipe, end to end


def _png_size(path) -> tuple[int, int]:
    data = Path(path).read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return struct.unpack(">II", data[16:24])


@pytest.mark.slow
def test_tiny_recipe_yields_every_configuration_plots_and_differences(tmp_path, one_thread):
    sys.path.insert(0, str(ROOT / "examples"))
    import recipe

    settings = recipe.RecipeSettings(out=tmp_path / "recipe", manpage_teacher=tmp_path / "recipe" / "manpage_teacher",
                                     **recipe.TINY)
    results = recipe.run_recipe(settings)
    expected = {"quickstart": 7, "manpages": 7}
    for name, count in expected.items():
        folder = tmp_path / "recipe" / name
        with open(folder / "summary.csv", newline="") as f:
            rows = list(csv.DictReader(f))
        assert len(rows) == count and all(r["seeds"] == "2" for r in rows)
        assert sum(r["reference"] == "True" for r in rows) == 1
        assert rows[0]["configuration"] == "loss=ce, weighting=decay, noise=off"
        for row in rows[1:]:  # every other configuration has its paired difference and real decoding
            assert row["tau_vs_reference_mean"] != "" and row["accepted_length_vs_reference_mean"] != ""
            assert row["matched_teacher"] == "True"
        text = (folder / "summary.md").read_text()
        assert text == results[name].report.summary
        assert "### Sample efficiency" in text and "Δ tau vs reference" in text and "rank" in text.splitlines()[-1]
        for png in ("tau_vs_tokens.png", "difference_from_reference.png", "loss_curves.png"):
            width, height = _png_size(folder / png)
            assert width > 300 and height > 150
    assert (tmp_path / "recipe" / "manpage_teacher" / "model.safetensors").exists()
    # the longer check: the paper's recipe against the full recipe as one grid key, on the same cache
    longer = recipe.longer_run(settings, 3)
    with open(tmp_path / "recipe" / "manpages_long" / "summary.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [r["configuration"] for r in rows] == ["recipe=ce", "recipe=kl"] and rows[1]["tau_vs_reference_mean"] != ""
    assert "Reference: **recipe=ce**" in longer.report.summary
    runs = tmp_path / "recipe" / "manpages_long" / "runs"
    full = json.loads((runs / "recipe-kl_seed-1" / "config.json").read_text())
    assert (full["loss"]["kind"], full["loss"]["weighting"], full["noise"]["schedule"], full["steps"]) == ("kl", "streak", "cosine", 3)
    paper = json.loads((runs / "recipe-ce_seed-0" / "config.json").read_text())
    assert (paper["loss"]["weighting"], paper["noise"]["schedule"]) == ("decay", "off")


@pytest.mark.slow  # a tiny sweep of two DSpark configurations, then 12 decodings per run (~2 minutes on 2 cores)
def test_tiny_confidence_study_decodes_every_threshold_losslessly(tmp_path, one_thread):
    sys.path.insert(0, str(ROOT / "examples"))
    import confidence

    confidence.main(["--tiny", "--out", str(tmp_path), "--caches", "quickstart", "--thresholds", "0,0.5,1", "--quiet"])
    folder = tmp_path / "quickstart_confidence"
    rows = [[cell.strip() for cell in line.split("|")[1:-1]] for line in (folder / "confidence.md").read_text().splitlines()[2:]]
    assert [row[:3] for row in rows] == [[name, kind, t] for kind in ("greedy", "T=1") for name in ("dspark", "dspark-greedy")
                                         for t in ("0", "0.5", "1")]
    assert [row[-1] for row in rows] == ["yes"] * 6 + ["n/a"] * 6
    runs = sorted((folder / "runs").iterdir())
    targets = [json.loads((run / "config.json").read_text())["dspark"]["confidence_target"] for run in runs]
    assert targets == ["greedy", "greedy", "alpha", "alpha"], [run.name for run in runs]
    for record in (json.loads((run / "confidence.json").read_text()) for run in runs):
        for kind in ("greedy", "T=1"):
            # no threshold: every block verifies its B = 4 drafts (sample_from_anchor); at 1 the
            # cumulative estimate is below the threshold before the first draft: the teacher alone
            assert record[f"{kind}@0"]["drafts_per_forward"] == 4
            assert record[f"{kind}@1"]["drafts_per_forward"] == 0 and record[f"{kind}@1"]["accepted_length"] == 1
            assert 0 <= record[f"{kind}@0.5"]["drafts_per_forward"] <= 4
        assert all(record[f"greedy@{t}"]["matched_teacher"] for t in ("0", "0.5", "1"))
    assert _png_size(folder / "confidence.png")[0] > 300


def test_acceptance_by_position_from_the_rounds_histogram():
    sys.path.insert(0, str(ROOT / "examples"))
    import objectives

    # 4 rounds: one of 1 token (no draft accepted), two of 2, one of 3
    assert objectives.reached([0, 1, 2, 1]) == [0.75, 0.25]
    assert objectives.reached([0, 5]) == [0.0] and objectives.reached([]) == []


@pytest.mark.slow
def test_tiny_objectives_study_decodes_greedy_and_sampled_for_every_objective(tmp_path, one_thread):
    sys.path.insert(0, str(ROOT / "examples"))
    import objectives
    import recipe

    settings = recipe.RecipeSettings(out=tmp_path / "obj", manpage_teacher=tmp_path / "obj" / "manpage_teacher",
                                     **{**recipe.TINY, "seeds": 1, "curve_points": 0}, sample_temperature=1.0)
    result = objectives.run_study(settings, ("quickstart",))["quickstart"]
    with open(tmp_path / "obj" / "quickstart" / "summary.csv", newline="") as f:
        rows = {r["configuration"]: r for r in csv.DictReader(f)}
    assert set(rows) == {f"objective={name}" for name in objectives.OBJECTIVES}
    assert rows[f"objective={objectives.REFERENCE}"]["reference"] == "True"
    for row in rows.values():  # every objective trained and was decoded greedy (lossless) and at T=1
        assert float(row["accepted_length_mean"]) >= 1.0 and float(row["accepted_length_sampled_mean"]) >= 1.0
        assert row["matched_teacher"] == "True"
    runs = tmp_path / "obj" / "quickstart" / "runs"
    config = json.loads((runs / "objective-ce0.1+tv0.9_seed-0" / "config.json").read_text())["loss"]
    assert config["terms"] == {"ce": 0.1, "tv": 0.9}
    assert json.loads((runs / "objective-kl+dpace_seed-0" / "config.json").read_text())["loss"]["weighting"] == "dpace"
    assert "real accepted length, T=1" in result.report.summary
    # the drafters study: DFlash against DSpark, the same way
    drafters = objectives.run_study(settings, ("quickstart",), study="drafters")["quickstart"]
    assert "Reference: **drafter=dflash**" in drafters.report.summary
    dspark = json.loads((tmp_path / "obj" / "quickstart_drafters" / "runs" / "drafter-dspark_seed-0" / "drafter" /
                         "config.json").read_text())
    assert dspark["architectures"] == ["DSparkDraftModel"]
    with open(tmp_path / "obj" / "quickstart_drafters" / "summary.csv", newline="") as f:
        assert all(r["matched_teacher"] == "True" for r in csv.DictReader(f))
    table = objectives.position_table(tmp_path / "obj" / "quickstart_drafters", "drafter")
    assert "| dflash | greedy |" in table and "| dspark | T=1.0 |" in table


def test_field_study_skips_an_arm_whose_field_this_checkout_lacks():
    sys.path.insert(0, str(ROOT / "examples"))
    import objectives

    said = []
    arms = {"dflash": {"model.kind": "dflash"}, "later": {"model.no_such_field": True},
            "chain": {"loss.terms": {"kl": 1.0, "chain": 1.0}}}
    assert list(objectives.available(arms, None, "dflash", said.append)) == ["dflash", "chain"]
    assert said == ["skipping later: this checkout has no config field model.no_such_field (set the arm's settings "
                    "in examples/objectives.py once it exists)"]
    assert list(objectives.available(arms, ("chain",), "dflash", said.append)) == ["dflash", "chain"]
    with pytest.raises(SystemExit, match="'chains' is not a configuration"):
        objectives.available(arms, ("chains",), "dflash")


@pytest.mark.slow
def test_tiny_field_study_decodes_every_arm_losslessly_and_resumes(tmp_path, one_thread):
    """Issue 46's study at toy size: every arm this checkout has trains and decodes greedy (output =
    the teacher's) and at T = 1; a second call trains nothing."""
    sys.path.insert(0, str(ROOT / "examples"))
    import objectives
    import recipe

    settings = recipe.RecipeSettings(out=tmp_path / "obj", manpage_teacher=tmp_path / "obj" / "manpage_teacher",
                                     **{**recipe.TINY, "seeds": 1, "curve_points": 0}, sample_temperature=1.0)
    objectives.run_study(settings, ("quickstart",), study="field")
    kept = objectives.available(objectives.FIELD, None, "dflash", lambda _: None)
    assert {"dflash", "dspark", "dflash2", "dflash+chain", "dflash+first_error", "dflash+kl_t2"} <= set(kept)
    with open(tmp_path / "obj" / "quickstart_field" / "summary.csv", newline="") as f:
        rows = {r["configuration"]: r for r in csv.DictReader(f)}
    assert set(rows) == {f"arm={name}" for name in kept}
    for row in rows.values():
        assert row["matched_teacher"] == "True" and float(row["accepted_length_sampled_mean"]) >= 1.0
    runs = tmp_path / "obj" / "quickstart_field" / "runs"
    assert json.loads((runs / "arm-dflash+kl_t2_seed-0" / "config.json").read_text())["loss"]["temperature"] == 2.0
    before = {p: p.stat().st_mtime_ns for p in runs.glob("*/measure.json")}
    objectives.run_study(settings, ("quickstart",), study="field")
    assert {p: p.stat().st_mtime_ns for p in runs.glob("*/measure.json")} == before
