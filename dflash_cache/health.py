"""Capture health: per tapped layer, what the hidden states a shard holds look like (RMS, share of
exact zeros, non-finite count), computed by the writer from what it writes and kept in the index:
the zero and non-finite counts and the largest |x| exact, over every element, from the bits; the
RMS from a deterministic sample of the shard's tokens (``sample_rows``).

A capture that broke (a layer hooked wrong, weights not loaded, embeddings zeroed) writes states
that are all zeros or one constant: the build stops on such a shard before committing it
(``check_capture``). ``info`` and ``verify`` show the per-layer figures over the cache and flag a
layer, or a shard's layer, far from the median (``flags``)."""

from __future__ import annotations

import numpy as np

from dflash_common.errors import TeacherError

BLOCK_ROWS = 4096  # token rows counted at a time (bounded memory at production width)
SAMPLE_TOKENS = 1024
"""Token rows of a shard the RMS, spread, min and max are computed from (sample_rows); the zero and
non-finite counts read every element. ~10 float32 passes over a whole 512 MB shard took 2.5-4 s of
the writer's one thread (~45 ns an element): more than the GPU takes to produce it."""

FAR = 1000.0
"""A layer whose RMS is more than this factor away from the median layer's (or a shard's layer
from that layer's median over shards) is flagged. Real decoder layers differ by ~10-100x between
early and late layers; a broken capture is 0 or off by orders of magnitude."""

ZERO_SHARE = 0.5
"""A layer with more than this share of exact zeros is flagged (real activations are almost never 0)."""

MAX_RMS = 1e6
"""A layer whose RMS is above this is broken: trained models' hidden states stay orders of magnitude
below (Qwen's massive activations peak near 1e4 in single channels, layer RMS in the tens)."""

MAX_ABS = 1e7
"""A layer holding a value of magnitude above this anywhere is broken: three orders above the
largest single activations trained models produce (Qwen's and Llama's massive activations, ~1e4).
Taken over every element (exact_counts), since a few such values hide from any sample while the
drafter's fc layer and norm carry them into every block that sees those positions."""

MIN_SPREAD = 1e-4
"""A layer whose tokens' states differ from their mean by less than this share of their RMS holds one
vector for every token: the states do not depend on the input (a capture of a constant)."""


class CaptureError(TeacherError):
    """The teacher's hidden states at a tapped layer are unusable (all zeros or constant over a shard)."""


# Per float width: the integer view of its bits, the mask of all but the sign bit (zero: none set)
# and the exponent mask (all set: Inf or NaN).
_BITS = {4: ("int32", 0x7FFFFFFF, 0x7F800000), 2: ("int16", 0x7FFF, 0x7F80)}
_FLOAT16_EXPONENT = 0x7C00


def exact_counts(values: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per layer of ``values`` [N, L, H] (float32, ml_dtypes.bfloat16 or float16): the count of exact
    zeros (+0 or -0), the count of non-finite values and the largest finite magnitude |x| (float64;
    0 for a layer with none), over every element. Read from the bits (integer masks, no float32 copy
    of the states), BLOCK_ROWS token rows at a time (bounded memory): with the sign bit masked off,
    a float's bits order like its magnitude, and those at or above the all-ones exponent are Inf
    and NaN, so one integer view gives all three."""
    view, magnitude, exponent = _BITS[values.dtype.itemsize]
    if values.dtype == np.float16:
        exponent = _FLOAT16_EXPONENT
    zeros = np.zeros(values.shape[1], np.int64)
    nonfinite = np.zeros(values.shape[1], np.int64)
    largest = np.zeros(values.shape[1], np.dtype(view))
    for lo in range(0, values.shape[0], BLOCK_ROWS):
        bits = values[lo:lo + BLOCK_ROWS].view(view) & magnitude
        zeros += np.count_nonzero(bits == 0, axis=(0, 2))
        top = bits.max(axis=(0, 2), initial=0)
        if (top >= exponent).any():  # rare (the build drops non-finite sequences): mask them out
            wrong = bits >= exponent
            nonfinite += np.count_nonzero(wrong, axis=(0, 2))
            top = np.where(wrong, 0, bits).max(axis=(0, 2), initial=0)
        np.maximum(largest, top.astype(largest.dtype), out=largest)
    return zeros, nonfinite, largest.view(values.dtype).astype(np.float64)


def magnitude_problems(max_abs, layer_ids: list[int]) -> list[str]:
    """A problem per tapped layer whose largest |x| (exact_counts) is above MAX_ABS."""
    return [f"tapped layer {layer} holds a value of |x| = {value:.3g}, far above any model's hidden states (at most "
            f"{MAX_ABS:g} here)" for layer, value in zip(layer_ids, max_abs) if value > MAX_ABS]


def sample_rows(n: int, size: int = SAMPLE_TOKENS) -> np.ndarray:
    """Which of ``n`` token rows the magnitude statistics read: all of them up to ``size``, else
    ``size`` rows evenly spread over the shard (a rule of ``n`` alone: the same rows every build)."""
    if n <= size:
        return np.arange(n)
    return np.unique(np.linspace(0, n - 1, size).round().astype(np.int64))


def layer_stats(values: np.ndarray) -> dict[str, list]:
    """Per layer of ``values`` [N, L, H] (true dtype: float32 or ml_dtypes.bfloat16): ``zero_fraction``
    and ``nonfinite`` over every element (exact_counts), and ``rms``, (not stored) ``spread`` and
    ``min``/``max`` of the finite values over the token rows of ``sample_rows``: the magnitudes tell a
    broken capture (orders of magnitude off, one vector for every token) from a sample as well as
    from every row, at a bounded cost per shard."""
    n, layers = values.shape[0], values.shape[1]
    zeros, nonfinite, max_abs = exact_counts(values)
    sample = np.asarray(values[sample_rows(n)], dtype=np.float32)  # [S, L, H]
    finite = np.isfinite(sample)
    clean = np.where(finite, sample, 0.0)
    squares = np.einsum("nlh,nlh->l", clean, clean, dtype=np.float64)
    sums = clean.sum(axis=0, dtype=np.float64)  # per layer and feature: the tokens' mean, for the spread
    low = np.where(finite, sample, np.inf).min(axis=(0, 2), initial=np.inf)
    high = np.where(finite, sample, -np.inf).max(axis=(0, 2), initial=-np.inf)
    count = max(1, n * (values.shape[2] if values.ndim == 3 else 1))
    sampled = max(1, len(sample) * (values.shape[2] if values.ndim == 3 else 1))
    # the tokens' spread around their mean vector: sum of squares less n times the mean's squares
    spread = np.sqrt(np.maximum(squares - np.einsum("lh,lh->l", sums, sums) / max(len(sample), 1), 0.0) / sampled)
    rms = np.sqrt(squares / sampled)
    return {"rms": [float(x) for x in rms], "zero_fraction": [float(x) for x in zeros / count],
            "nonfinite": [int(x) for x in nonfinite], "min": low.tolist() if layers else [],
            "max": high.tolist() if layers else [], "spread": [float(x) for x in spread / np.maximum(rms, 1e-30)],
            "max_abs": [float(x) for x in max_abs]}


def check_capture(stats: dict, layer_ids: list[int], shard: str, n_tokens: int) -> None:
    """Refuse a shard whose tapped layer is all zeros, one constant value, one vector for every token
    (states that do not depend on the input), or holds a value (anywhere: exact) or an RMS of a
    magnitude no model produces."""
    if n_tokens == 0:
        return
    for i, layer in enumerate(layer_ids):
        if stats["zero_fraction"][i] >= 1.0:
            what = "all zeros"
        elif stats["min"][i] == stats["max"][i] and stats["nonfinite"][i] == 0:
            what = f"the constant {stats['min'][i]:g}"
        elif stats["rms"][i] > MAX_RMS:  # the whole layer: said before a single value of it
            what = f"of RMS {stats['rms'][i]:.3g}, far above any model's hidden states (at most {MAX_RMS:g} here),"
        elif stats["max_abs"][i] > MAX_ABS:
            raise CaptureError(
                f"shard {shard}: tapped layer {layer} holds a value of |x| = {stats['max_abs'][i]:.3g} among its "
                f"{n_tokens:,} tokens, far above any model's hidden states (at most {MAX_ABS:g} here): the teacher's "
                "capture is broken (check the teacher's weights and dtype, and --layers); the shard was not committed, "
                "so fix the teacher and rerun the same command")
        elif n_tokens > 1 and stats["nonfinite"][i] == 0 and stats["spread"][i] < MIN_SPREAD:
            what = "one vector for every token (states that do not depend on the input)"
        else:
            continue
        raise CaptureError(
            f"shard {shard}: tapped layer {layer} is {what} over all {n_tokens:,} tokens: the teacher's capture is "
            "broken (check the teacher's weights load, its embeddings are not zeroed, and --layers); the shard was "
            "not committed, so fix the teacher and rerun the same command")


def stored_health(stats: dict) -> dict:
    """The part of ``layer_stats`` the index keeps."""
    return {k: stats[k] for k in ("rms", "zero_fraction", "nonfinite")}


def summary(rms: np.ndarray, zero_fraction: np.ndarray, nonfinite: np.ndarray, tokens: np.ndarray,
            layer_ids: list[int], names: list[str] | None = None) -> tuple[list[dict], list[str]]:
    """Per-layer figures over a cache (``rms`` etc. [shards, layers]; ``tokens`` [shards]) and the
    flags: a layer far from the median layer, with exact zeros or non-finite values; a shard's
    layer far from that layer's median over shards."""
    tokens = np.asarray(tokens, np.float64)
    weight = tokens / max(tokens.sum(), 1.0)
    layers = []
    for i, layer in enumerate(layer_ids):
        layers.append({"layer": layer, "rms": float(np.sqrt((weight * rms[:, i] ** 2).sum())),
                       "zero_fraction": float((weight * zero_fraction[:, i]).sum()),
                       "nonfinite": int(nonfinite[:, i].sum())})
    flags = []
    if not len(tokens) or tokens.sum() == 0:
        return layers, flags
    median = float(np.median([x["rms"] for x in layers]))
    for x in layers:
        if x["nonfinite"]:
            flags.append(f"layer {x['layer']} holds {x['nonfinite']:,} NaN/Inf values")
        if x["zero_fraction"] > ZERO_SHARE:
            flags.append(f"layer {x['layer']} is {x['zero_fraction']:.0%} exact zeros")
        if x["rms"] > MAX_RMS:
            flags.append(f"layer {x['layer']} RMS {x['rms']:.3g} is above any model's hidden states ({MAX_RMS:g})")
        if not (median / FAR <= x["rms"] <= median * FAR):
            flags.append(f"layer {x['layer']} RMS {x['rms']:.3g} is far from the median layer's {median:.3g}")
    if names is not None:
        used = tokens > 0
        for i, layer in enumerate(layer_ids):
            per_shard = rms[used, i]
            middle = float(np.median(per_shard))
            far = np.flatnonzero(used)[(per_shard < middle / FAR) | (per_shard > middle * FAR)]
            if len(far):
                shown = ", ".join(names[j] for j in far[:3]) + (f" (+{len(far) - 3} more)" if len(far) > 3 else "")
                flags.append(f"layer {layer} RMS of shard(s) {shown} is far from its median over shards {middle:.3g}")
    return layers, flags
