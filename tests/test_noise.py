"""Tests for dflash_train.training.noise: schedules (hand values), the counter-based generator against a
pure-Python reference, determinism, distributions, layers, batches."""

import math
import struct
from dataclasses import replace

import numpy as np
import pytest
import torch
import xxhash

from dflash_common.errors import ConfigError
from dflash_train.settings.noise_config import NoiseConfig
from dflash_train.training import noise as noise_module
from dflash_train.training.noise import add_noise_, apply_noise, mix32, noise_for, noise_scale, noised_layers

S = 100
# The schedule these tests were written for (the default until the recipe study): explicit, so
# they test the generator and the schedules whatever the defaults are.
COSINE = NoiseConfig(schedule="cosine", distribution="uniform", start=0.1, end=0.01)


@pytest.mark.parametrize(
    ("step", "expected"),
    [
        (0, 0.1),
        (25, 0.0868198),  # 0.01 + 0.09 * (1 + cos(pi/4)) / 2
        (50, 0.055),  # halfway: 0.01 + 0.09 / 2
        (100, 0.01),
        (150, 0.01),  # past the end stays at end
    ],
)
def test_cosine_scale(step, expected):
    assert noise_scale(COSINE, step, S) == pytest.approx(expected, abs=1e-7)


@pytest.mark.parametrize(("step", "expected"), [(0, 0.1), (25, 0.0775), (50, 0.055), (100, 0.01), (400, 0.01)])
def test_linear_scale(step, expected):
    assert noise_scale(NoiseConfig(schedule="linear", start=0.1, end=0.01), step, S) == pytest.approx(expected, abs=1e-12)


def test_constant_and_off_scale():
    for step in (0, 50, 1000):
        assert noise_scale(NoiseConfig(schedule="constant", start=0.3), step, S) == 0.3
        assert noise_scale(NoiseConfig(schedule="off"), step, S) == 0.0


def test_same_key_gives_identical_draw_regardless_of_prior_draws():
    cfg = replace(COSINE, seed=7)
    first = noise_for(cfg, 12, S, "seq-a", (5, 8))
    # Unrelated draws in between (other ids, steps, layers) must not change it.
    noise_for(cfg, 12, S, "seq-b", (50, 8))
    noise_for(cfg, 13, S, "seq-a", (5, 8))
    np.random.default_rng(0).random(1000)
    again = noise_for(cfg, 12, S, "seq-a", (5, 8))
    assert first.dtype == torch.float32 and first.shape == (5, 8)
    np.testing.assert_array_equal(first, again)
    assert first.abs().max() > 0


def test_draw_is_a_prefix_of_a_longer_draw():
    cfg = COSINE
    short = noise_for(cfg, 3, S, "seq", (4, 8))
    long = noise_for(cfg, 3, S, "seq", (10, 8))
    np.testing.assert_array_equal(short, long[:4])


def test_different_step_id_seed_or_layer_gives_different_draw():
    base = noise_for(replace(COSINE, seed=1), 5, S, "seq-a", (16, 16))
    others = [
        noise_for(replace(COSINE, seed=1), 6, S, "seq-a", (16, 16)),
        noise_for(replace(COSINE, seed=1), 5, S, "seq-b", (16, 16)),
        noise_for(replace(COSINE, seed=2), 5, S, "seq-a", (16, 16)),
        noise_for(replace(COSINE, seed=1), 5, S, "seq-a", (16, 16), layer=1),
    ]
    for other in others:
        # Same step keeps the scale; the values themselves must be unrelated.
        assert not np.array_equal(base, other)
        assert abs(np.corrcoef(base.ravel(), other.ravel())[0, 1]) < 0.2


def test_uniform_is_bounded_by_scale_and_fills_the_range():
    cfg = NoiseConfig(schedule="constant", start=0.25)
    draw = noise_for(cfg, 0, S, "seq", (2000, 64)).numpy()
    assert draw.min() >= -0.25 and draw.max() <= 0.25
    assert draw.min() < -0.24 and draw.max() > 0.24
    assert abs(draw.mean()) < 0.005
    # Uniform(-a, a) has std a / sqrt(3).
    assert draw.std() == pytest.approx(0.25 / np.sqrt(3), rel=0.01)


def test_gaussian_std_is_scale():
    cfg = NoiseConfig(schedule="constant", start=0.2, distribution="gaussian")
    draw = noise_for(cfg, 0, S, "seq", (2000, 64)).numpy()
    assert draw.dtype == np.float32
    assert draw.std() == pytest.approx(0.2, rel=0.01)
    assert abs(draw.mean()) < 0.005
    assert np.abs(draw).max() > 0.2 * 3  # unbounded tails, unlike uniform


def hidden_states(num_tokens=6, num_layers=4, width=8):
    return np.random.default_rng(3).standard_normal((num_tokens, num_layers, width)).astype(np.float32)


def test_default_noises_all_layers_but_the_last():
    hidden = hidden_states()
    original = hidden.copy()
    out = apply_noise(hidden, COSINE, 0, S, "seq")
    np.testing.assert_array_equal(hidden, original)  # input untouched
    assert out.dtype == np.float32 and out.shape == hidden.shape
    np.testing.assert_array_equal(out[:, 3], hidden[:, 3])
    for layer in range(3):
        delta = out[:, layer] - hidden[:, layer]
        assert np.abs(delta).max() > 0
        assert np.abs(delta).max() <= 0.1 + 1e-6
    # The added noise is exactly the per-layer draw.
    expected = hidden[:, 1] + noise_for(COSINE, 0, S, "seq", (6, 8), layer=1).numpy()
    np.testing.assert_array_equal(out[:, 1], expected)
    assert noised_layers(COSINE, 4) == (0, 1, 2)


def test_chosen_layers_only():
    hidden = hidden_states()
    out = apply_noise(hidden, replace(COSINE, layers=(1, 3)), 0, S, "seq")
    for layer in (0, 2):
        np.testing.assert_array_equal(out[:, layer], hidden[:, layer])
    for layer in (1, 3):
        assert not np.array_equal(out[:, layer], hidden[:, layer])
    with pytest.raises(ConfigError):
        apply_noise(hidden, replace(COSINE, layers=(4,)), 0, S, "seq")


def test_layer_noise_does_not_depend_on_which_other_layers_are_selected():
    hidden = hidden_states()
    all_but_last = apply_noise(hidden, COSINE, 9, S, "seq")
    only_two = apply_noise(hidden, replace(COSINE, layers=(2,)), 9, S, "seq")
    np.testing.assert_array_equal(all_but_last[:, 2], only_two[:, 2])


def test_off_and_zero_scale_leave_input_unchanged():
    hidden = hidden_states()
    assert apply_noise(hidden, NoiseConfig(schedule="off"), 5, S, "seq") is hidden
    zero_end = NoiseConfig(schedule="linear", start=0.1, end=0.0)
    assert apply_noise(hidden, zero_end, S, S, "seq") is hidden
    np.testing.assert_array_equal(noise_for(NoiseConfig(schedule="off"), 5, S, "seq", (3, 2)), np.zeros((3, 2)))


def test_torch_input_keeps_type_dtype_and_matches_numpy():
    hidden = hidden_states()
    out_np = apply_noise(hidden, COSINE, 4, S, "seq")
    out_t = apply_noise(torch.from_numpy(hidden.copy()), COSINE, 4, S, "seq")
    assert isinstance(out_t, torch.Tensor) and out_t.dtype == torch.float32
    np.testing.assert_array_equal(out_t.numpy(), out_np)

    bf16 = torch.from_numpy(hidden).to(torch.bfloat16)
    out_bf16 = apply_noise(bf16, COSINE, 4, S, "seq")
    assert out_bf16.dtype == torch.bfloat16
    torch.testing.assert_close(out_bf16[:, 3], bf16[:, 3], rtol=0, atol=0)
    # The sum is taken in float32 and rounded once.
    noise = noise_for(COSINE, 4, S, "seq", (6, 8), layer=0)
    expected = (bf16[:, 0].float() + noise).to(torch.bfloat16)
    torch.testing.assert_close(out_bf16[:, 0], expected, rtol=0, atol=0)
    assert not torch.equal(out_bf16[:, 0], bf16[:, 0])


@pytest.mark.parametrize(
    "kwargs",
    [
        {"schedule": "exp"},
        {"distribution": "laplace"},
        {"start": -0.1},
        {"end": float("nan")},
        {"layers": (0, 0)},
        {"layers": (-1,)},
        {"seed": -1},
        {"seed": 2**64},
    ],
)
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ConfigError):
        NoiseConfig(**kwargs)


def test_layers_list_is_stored_as_tuple_and_progress_is_checked():
    assert NoiseConfig(layers=[2, 0]).layers == (2, 0)
    with pytest.raises(ConfigError):
        noise_scale(COSINE, -1, S)
    with pytest.raises(ConfigError):
        noise_scale(COSINE, 0, 0)


# The generator's specification in plain Python integers: what any device must reproduce.
def _mix32_reference(v: int) -> int:
    v ^= v >> 16
    v = (v * 0x7FEB352D) & 0xFFFFFFFF
    v ^= v >> 15
    v = (v * 0x846CA68B) & 0xFFFFFFFF
    return v ^ (v >> 16)


def _uniform_reference(seed: int, step: int, seq_id: str, layer: int, index: int, scale: float) -> np.float32:
    digest = xxhash.xxh128_intdigest(struct.pack("<QQQ", seed, step, layer) + seq_id.encode())
    key0, key1 = digest & 0xFFFFFFFF, (digest >> 32) & 0xFFFFFFFF
    bits = _mix32_reference(_mix32_reference(index ^ key0) ^ key1)
    top24 = (bits >> 8) - (1 << 24 if bits >> 31 else 0)  # signed, in [-2**23, 2**23)
    return np.float32(np.float32(top24 * 2.0**-23) * np.float32(scale))


def test_mix32_equals_the_uint32_reference_on_every_kind_of_word():
    rng = np.random.default_rng(0)
    words = [0, 1, 2**31 - 1, 2**31, 2**32 - 1, *range(2, 70), *rng.integers(0, 2**32, 2000).tolist()]
    as_int32 = torch.tensor([w - 2**32 if w >= 2**31 else w for w in words], dtype=torch.int32)
    got = mix32(as_int32.clone()).numpy().view(np.uint32)  # odd lengths exercise the vector tails too
    assert got.tolist() == [_mix32_reference(w) for w in words]


def test_uniform_draws_equal_the_reference_including_past_2_to_the_31():
    cfg = NoiseConfig(seed=11, schedule="constant", start=0.3)
    draw = noise_for(cfg, 5, S, "seq-x", (7, 9), layer=2).numpy().ravel()
    expected = [_uniform_reference(11, 5, "seq-x", 2, i, 0.3) for i in range(63)]
    assert draw.tolist() == expected
    # element indices beyond int32's positive range wrap to the same 32-bit patterns
    wrapped = noise_module._wrap_int32(torch.tensor([2**31, 2**31 + 5, 2**32 - 1]))
    assert wrapped.tolist() == [-2**31, -2**31 + 5, -1]
    keys = noise_module.stream_keys(11, 5, "seq-x", 2)
    far = noise_module._draws(wrapped, keys, "uniform", 0.3).tolist()
    assert far == [_uniform_reference(11, 5, "seq-x", 2, i, 0.3) for i in (2**31, 2**31 + 5, 2**32 - 1)]


@pytest.mark.parametrize("distribution", ["uniform", "gaussian"])
def test_draws_do_not_depend_on_the_chunking(monkeypatch, distribution):
    """CPU and CUDA cut a stream into different chunks; the values must not change."""
    cfg = replace(COSINE, distribution=distribution)
    whole = noise_for(cfg, 2, S, "seq", (300, 24), layer=1)
    for elements in (1, 24 * 7, 1000):
        monkeypatch.setattr(noise_module, "_chunk_elements", lambda device, n=elements: n)
        assert torch.equal(noise_for(cfg, 2, S, "seq", (300, 24), layer=1), whole)


def test_gaussian_tails_and_shape_are_normal():
    cfg = NoiseConfig(schedule="constant", start=1.0, distribution="gaussian")
    draw = noise_for(cfg, 0, S, "seq", (4000, 64)).double()
    assert float(((draw - draw.mean()) ** 4).mean() / draw.var() ** 2) == pytest.approx(3.0, abs=0.05)
    beyond_two = float((draw.abs() > 2).double().mean())
    assert beyond_two == pytest.approx(math.erfc(2 / math.sqrt(2)), rel=0.05)


def test_neighbouring_draws_are_uncorrelated():
    draw = noise_for(NoiseConfig(schedule="constant", start=1.0), 0, S, "seq", (4000, 64)).double().ravel()
    for lag in (1, 2, 64):
        assert abs(float(torch.corrcoef(torch.stack([draw[:-lag], draw[lag:]]))[0, 1])) < 0.01


def test_batch_noise_is_each_rows_stream_and_leaves_padding_alone():
    cfg = replace(COSINE, layers=(0, 2))
    ids, lengths = ["a", "b", "c"], [5, 9, 1]
    batch = torch.zeros(3, 9, 3, 4)
    add_noise_(batch, ids, lengths, cfg, 7, S)
    for row, (seq_id, t) in enumerate(zip(ids, lengths)):
        for layer in (0, 2):
            assert torch.equal(batch[row, :t, layer], noise_for(cfg, 7, S, seq_id, (t, 4), layer=layer))
        assert not batch[row, t:].any() and not batch[row, :, 1].any()
    with pytest.raises(ValueError, match="float32"):
        add_noise_(torch.zeros(1, 2, 3, 4, dtype=torch.bfloat16), ["a"], [2], cfg, 0, S)


def test_a_stream_longer_than_the_counter_is_refused():
    with pytest.raises(ConfigError, match="noise draws per layer"):
        noise_for(COSINE, 0, S, "long", (2**21, 2**12))
