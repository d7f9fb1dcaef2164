"""Capture health: per tapped layer, what the hidden states a shard holds look like (RMS, share of
exact zeros, non-finite count), computed by the writer from what it writes and kept in the index.

A capture that broke (a layer hooked wrong, weights not loaded, embeddings zeroed) writes states
that are all zeros or one constant: the build stops on such a shard before committing it
(``check_capture``). ``info`` and ``verify`` show the per-layer figures over the cache and flag a
layer, or a shard's layer, far from the median (``flags``)."""

from __future__ import annotations

import numpy as np

from dflash_common.errors import TeacherError

BLOCK_ROWS = 4096  # token rows converted to float32 at a time (bounded memory at production width)

FAR = 1000.0
"""A layer whose RMS is more than this factor away from the median layer's (or a shard's layer
from that layer's median over shards) is flagged. Real decoder layers differ by ~10-100x between
early and late layers; a broken capture is 0 or off by orders of magnitude."""

ZERO_SHARE = 0.5
"""A layer with more than this share of exact zeros is flagged (real activations are almost never 0)."""

MAX_RMS = 1e6
"""A layer whose RMS is above this is broken: trained models' hidden states stay orders of magnitude
below (Qwen's massive activations peak near 1e4 in single channels, layer RMS in the tens)."""

MIN_SPREAD = 1e-4
"""A layer whose tokens' states differ from their mean by less than this share of their RMS holds one
vector for every token: the states do not depend on the input (a capture of a constant)."""


class CaptureError(TeacherError):
    """The teacher's hidden states at a tapped layer are unusable (all zeros or constant over a shard)."""


def layer_stats(values: np.ndarray) -> dict[str, list]:
    """Per layer of ``values`` [N, L, H] (true dtype: float32 or ml_dtypes.bfloat16): ``rms``,
    ``zero_fraction``, ``nonfinite``, and (not stored) ``min``/``max`` of the finite values."""
    n, layers = values.shape[0], values.shape[1]
    squares = np.zeros(layers, np.float64)
    sums = np.zeros(values.shape[1:], np.float64)  # per layer and feature: the tokens' mean, for the spread
    zeros = np.zeros(layers, np.int64)
    nonfinite = np.zeros(layers, np.int64)
    low = np.full(layers, np.inf)
    high = np.full(layers, -np.inf)
    for lo in range(0, n, BLOCK_ROWS):
        block = np.asarray(values[lo:lo + BLOCK_ROWS], dtype=np.float32)
        finite = np.isfinite(block)
        nonfinite += (~finite).sum(axis=(0, 2))
        clean = np.where(finite, block, 0.0)
        squares += np.einsum("nlh,nlh->l", clean, clean, dtype=np.float64)
        sums += clean.sum(axis=0, dtype=np.float64)
        zeros += (block == 0).sum(axis=(0, 2))
        low = np.minimum(low, np.where(finite, block, np.inf).min(axis=(0, 2)))
        high = np.maximum(high, np.where(finite, block, -np.inf).max(axis=(0, 2)))
    count = max(1, n * (values.shape[2] if values.ndim == 3 else 1))
    # the tokens' spread around their mean vector: sum of squares less n times the mean's squares
    spread = np.sqrt(np.maximum(squares - np.einsum("lh,lh->l", sums, sums) / max(n, 1), 0.0) / count)
    rms = np.sqrt(squares / count)
    return {"rms": [float(x) for x in rms], "zero_fraction": [float(x) for x in zeros / count],
            "nonfinite": [int(x) for x in nonfinite], "min": low.tolist(), "max": high.tolist(),
            "spread": [float(x) for x in spread / np.maximum(rms, 1e-30)]}


def check_capture(stats: dict, layer_ids: list[int], shard: str, n_tokens: int) -> None:
    """Refuse a shard whose tapped layer is all zeros, one constant value, one vector for every token
    (states that do not depend on the input) or of a magnitude no model produces."""
    if n_tokens == 0:
        return
    for i, layer in enumerate(layer_ids):
        if stats["zero_fraction"][i] >= 1.0:
            what = "all zeros"
        elif stats["min"][i] == stats["max"][i] and stats["nonfinite"][i] == 0:
            what = f"the constant {stats['min'][i]:g}"
        elif stats["rms"][i] > MAX_RMS:
            what = f"of RMS {stats['rms'][i]:.3g}, far above any model's hidden states (at most {MAX_RMS:g} here),"
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
