"""Capture health on the writer's thread: the zero and non-finite counts stay exact over every
element while RMS, spread, min and max come from a deterministic sample of the shard's tokens."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from dflash_cache import health

DTYPES = [np.float32, ml_dtypes.bfloat16, np.float16]


def _states(rows: int = 3000) -> np.ndarray:
    return np.random.default_rng(0).standard_normal((rows, 3, 32)).astype(np.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_zero_token_and_one_non_finite_value_outside_the_sample_are_counted_exactly(dtype):
    states = _states()
    sampled = set(health.sample_rows(len(states)).tolist())
    assert len(sampled) == health.SAMPLE_TOKENS < len(states)
    hidden_row = next(r for r in range(1, len(states)) if r not in sampled)
    states[hidden_row, 1] = 0.0
    states[hidden_row, 1, 7] = -0.0 if dtype is not np.float16 else 0.0
    states[hidden_row + 1 if hidden_row + 1 not in sampled else hidden_row - 1, 2, 3] = np.nan
    stats = health.layer_stats(states.astype(dtype))
    assert stats["nonfinite"] == [0, 0, 1]
    assert [round(z * len(states) * 32) for z in stats["zero_fraction"]] == [0, 32, 0]
    states[5, 0, 0] = np.inf
    assert health.layer_stats(states.astype(dtype))["nonfinite"] == [1, 0, 1]


def test_the_sample_is_a_rule_of_the_token_count_and_covers_both_ends():
    rows = health.sample_rows(10_000)
    assert rows[0] == 0 and rows[-1] == 9_999 and len(rows) == health.SAMPLE_TOKENS
    np.testing.assert_array_equal(rows, health.sample_rows(10_000))
    np.testing.assert_array_equal(health.sample_rows(7), np.arange(7))


def test_an_all_zero_layer_of_a_shard_larger_than_the_sample_is_refused():
    states = _states()
    states[:, 2] = 0.0
    stats = health.layer_stats(states.astype(ml_dtypes.bfloat16))
    with pytest.raises(health.CaptureError, match="tapped layer 9 is all zeros over all 3,000 tokens"):
        health.check_capture(stats, [1, 5, 9], "s", len(states))


def test_sampled_rms_is_close_to_the_rms_over_every_token():
    states = _states(20_000) * np.linspace(0.5, 2.0, 20_000, dtype=np.float32)[:, None, None]
    stats = health.layer_stats(states)
    exact = np.sqrt((states.astype(np.float64) ** 2).mean(axis=(0, 2)))
    np.testing.assert_allclose(stats["rms"], exact, rtol=0.02)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_largest_magnitude_is_exact_over_every_token_and_skips_non_finite_values(dtype):
    """Issue 60: a few huge values outside the 1,024 sampled tokens passed capture health."""
    states = _states()
    sampled = set(health.sample_rows(len(states)).tolist())
    hidden_rows = [r for r in range(len(states)) if r not in sampled][:3]
    big = 3e4 if dtype is np.float16 else 1e30  # float16 ends at 65,504
    states[hidden_rows, 1, 5] = [-big, big / 2, big / 4]
    states[7, 2, 0], states[8, 0, 1] = np.inf, np.nan
    stats = health.layer_stats(states.astype(dtype))
    exact = np.abs(np.where(np.isfinite(states), states, 0).astype(dtype).astype(np.float64)).max(axis=(0, 2))
    assert stats["max_abs"] == exact.tolist() and stats["max_abs"][1] == float(np.asarray(big, dtype=dtype))
    assert stats["nonfinite"] == [1, 0, 1]
    assert abs(stats["max"][1]) < big  # the sample never saw it


def test_a_huge_value_at_a_few_positions_stops_the_shard_naming_the_layer_and_the_value():
    states = _states()
    rows = [r for r in range(len(states)) if r not in set(health.sample_rows(len(states)).tolist())][:3]
    states[rows, 1, 4] = 1e30
    stats = health.layer_stats(states.astype(ml_dtypes.bfloat16))
    with pytest.raises(health.CaptureError, match=r"tapped layer 5 holds a value of \|x\| = 1e\+30 among its 3,000 tokens"
                                                  r".*at most 1e\+07.*rerun the same command"):
        health.check_capture(stats, [1, 5, 9], "s", len(states))
    states[rows, 1, 4] = health.MAX_ABS / 2  # large, within the bound
    health.check_capture(health.layer_stats(states), [1, 5, 9], "s", len(states))
