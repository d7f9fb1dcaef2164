"""Accepted length the three ways it is reported, the per-request histogram and the share below a
floor (dflash_train.measuring.acceptance), and the confidence head's calibration
(dflash_train.training.calibration), each against a case computed by hand."""

from __future__ import annotations

import pytest

from dflash_common.errors import ConfigError
from dflash_train.measuring.acceptance import (
    RequestCounts,
    acceptance_summary,
    counts_of,
    definitions,
    histogram,
    histogram_edges,
    step_observations,
)
from dflash_train.training.calibration import ECE_TOLERANCE, bin_of, observation_summary

# tokens per verify forward of four requests: A 2 steps, 2 drafts accepted (mean 2, 4 tokens);
# B 4 steps, 12 accepted (mean 4, 16 tokens); C no draft step; D 3 steps, 1 accepted (mean 4/3, 4 tokens)
A, B, C, D = [3, 1], [5, 5, 5, 1], [], [1, 1, 2]


def test_counts_of_a_requests_forwards():
    assert counts_of(A) == RequestCounts(2, 2) and counts_of(B) == RequestCounts(4, 12)
    assert counts_of(C) == RequestCounts(0, 0) and counts_of(D).tokens == 4


def test_each_definition_against_a_hand_computed_case():
    two = definitions([counts_of(A), counts_of(B)])
    assert two["per_request_mean"] == pytest.approx((2 + 4) / 2)  # 3.0
    assert two["pooled"] == pytest.approx(1 + 14 / 6)  # 3.333: all accepted over all steps
    assert two["token_weighted"] == pytest.approx((4 * 2 + 16 * 4) / 20)  # 3.6: B's 16 tokens weigh four times A's
    four = definitions([counts_of(r) for r in (A, B, C, D)])  # C has no draft step: left out of all three
    assert four["per_request_mean"] == pytest.approx((2 + 4 + 4 / 3) / 3)
    assert four["pooled"] == pytest.approx(1 + 15 / 9)
    assert four["token_weighted"] == pytest.approx((4 * 2 + 16 * 4 + 4 * 4 / 3) / 24)
    assert definitions([counts_of(C)]) == {"per_request_mean": None, "pooled": None, "token_weighted": None}


def test_histogram_and_share_below_the_floor():
    assert histogram_edges(8.0) == [1.0 + 0.5 * i for i in range(15)]  # P = 7: 1 to 8 in 14 bins
    assert histogram_edges(1.0) == [1.0, 1.5]
    assert histogram([1.0, 1.49, 1.5, 8.0, 9.0], [1.0, 1.5, 2.0]) == [2, 3]  # the last bin closed, overflow kept
    summary = acceptance_summary([counts_of(r) for r in (A, B, C, D)], max_length=8.0)
    counts = summary["histogram"]["counts"]
    assert len(counts) == 14 and sum(counts) == 3
    assert counts[0] == 1 and counts[2] == 1 and counts[6] == 1  # 4/3 in [1, 1.5), 2 in [2, 2.5), 4 in [4, 4.5)
    # a mean of exactly 2 is not below the floor of 2; 4/3 is
    assert summary["below_floor"] == {"floor": 2.0, "requests": 1, "share": pytest.approx(1 / 3)}
    assert summary["requests"] == 3 and summary["without_steps"] == 1 and summary["headline"] == "per_request_mean"
    with pytest.raises(ConfigError):
        RequestCounts(-1, 0)


def test_a_rounds_observations_end_at_its_first_rejection():
    confidences = [0.9, 0.8, 0.7, 0.6]
    assert step_observations(confidences, 2) == [(0, 0.9, 1.0), (1, 0.8, 1.0), (2, 0.7, 0.0)]
    assert step_observations(confidences, 4) == [(0, 0.9, 1.0), (1, 0.8, 1.0), (2, 0.7, 1.0), (3, 0.6, 1.0)]
    assert step_observations(confidences, 0) == [(0, 0.9, 0.0)]
    with pytest.raises(ConfigError):
        step_observations(confidences[:1], 2)


def test_calibration_against_a_hand_computed_case():
    # position 0: predicted 0.95 twice, accepted once; position 1: 0.15 rejected, 0.25 accepted
    summary = observation_summary([0, 0, 1, 1], [0.95, 0.95, 0.15, 0.25], [1, 0, 0, 1], num_positions=3)
    assert summary["predicted"][:2] == pytest.approx([0.95, 0.2]) and summary["measured"][:2] == pytest.approx([0.5, 0.5])
    assert summary["abs_error"][:2] == pytest.approx([0.45, 0.3]) and summary["abs_error"][2] is None
    assert summary["mean_abs_error"] == pytest.approx((2 * 0.45 + 2 * 0.3) / 4)
    # bins: 0.95 -> 9 (|0.95 - 0.5| for 2), 0.15 -> 1 (|0.15 - 0| for 1), 0.25 -> 2 (|0.25 - 1| for 1)
    assert summary["ece"] == pytest.approx((2 * 0.45 + 0.15 + 0.75) / 4)
    reliability = summary["reliability"]
    assert reliability["count"] == [0, 1, 1, 0, 0, 0, 0, 0, 0, 2] and reliability["measured"][9] == pytest.approx(0.5)
    assert reliability["predicted"][0] is None and summary["observations"] == 4
    assert summary["calibrated"] is False
    close = observation_summary([0, 0], [0.55, 0.55], [1, 0], num_positions=1)
    assert close["ece"] == pytest.approx(0.05) and close["ece"] <= ECE_TOLERANCE and close["calibrated"] is True
    assert observation_summary([], [], [], num_positions=2)["calibrated"] is None


def test_bins_of_the_predicted_value():
    import torch

    assert bin_of(torch.tensor([0.0, 0.099, 0.1, 0.55, 0.999, 1.0])).tolist() == [0, 0, 1, 5, 9, 9]


CONSTANT = 0.5
"""The planted confidence head's estimate at every position."""


def test_a_constant_confidence_head_is_reported_miscalibrated(tmp_path, teacher_dir, cache_url):
    """An untrained DSpark drafter whose confidence head says 0.5 everywhere: eval (held-out and
    real decoding) reports its calibration error, calls it miscalibrated (the tiny teacher's
    greedy drafts are almost never accepted, its near-uniform held-out alpha ~1), and writes the
    reliability plot. With one predicted value every observation falls in one bin, so
    ECE = |0.5 - the share of observed drafts accepted|."""
    import json

    from helpers import write_jsonl
    from test_dspark import _export_for
    from typer.testing import CliRunner

    from cli.train import app
    from dflash_train.settings.dspark_config import DSparkConfig

    teacher = teacher_dir("qwen3")
    drafter = _export_for(teacher, tmp_path / "dspark", DSparkConfig(markov_rank=8), acceptance=CONSTANT)
    prompts = write_jsonl(tmp_path / "prompts.jsonl", [{"prompt": "hello there"}, {"prompt": "what is a cat"}])
    out = tmp_path / "eval.json"
    result = CliRunner().invoke(app, ["eval", "--checkpoint", str(drafter), "--teacher", teacher, "--prompts", prompts,
                                      "--cache", cache_url, "--max-sequences", "8", "--max-new-tokens", "12",
                                      "--temperature", "0", "--temperature", "1", "--out", str(out), "--quiet"])
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    for decoding in report["decodings"]:
        c = decoding["calibration"]
        rows = decoding["per_prompt"]
        accepted, rounds = sum(r["accepted_drafts"] for r in rows), sum(r["verify_forwards"] for r in rows)
        # every accepted draft is observed, and one rejected draft per round that was not accepted whole
        assert rounds <= c["observations"] <= accepted + rounds
        assert c["ece"] == pytest.approx(abs(CONSTANT - accepted / c["observations"]), abs=1e-4)
        assert c["reliability"]["count"][5] == c["observations"] == sum(c["count"])  # 0.5 lies in [0.5, 0.6)
        assert all(x == pytest.approx(CONSTANT) for x in c["predicted"] if x is not None)
        assert c["calibrated"] is False and c["mean_abs_error"] >= 0.1
    greedy = report["decodings"][0]
    assert greedy["temperature"] == 0 and greedy["calibration"]["calibrated"] is False  # an untrained drafter at T=0
    held_out = report["offline"]["calibration"]  # against the training target alpha, teacher-forced
    realised = sum(m * n for m, n in zip(held_out["measured"], held_out["count"]) if n) / held_out["observations"]
    assert held_out["ece"] == pytest.approx(abs(CONSTANT - realised), abs=1e-4) and held_out["calibrated"] is False
    lines = [line for line in result.output.splitlines() if line.startswith("confidence head")]
    assert len(lines) == 3 and all("MISCALIBRATED" in line for line in lines), lines
    assert out.with_suffix(".calibration.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert str(out.with_suffix(".calibration.png")) in result.output
