"""Step-indexed noise on the tapped hidden states as they are loaded (docs/design.md, "Noise on load").

Every draw is a pure function of (seed, global step, sequence id, tapped-layer index, element
index): element ``c`` of a stream is an integer hash of ``c`` keyed by a 128-bit digest of the
other four. Nothing depends on the order of draws, the batch a sequence lands in, the DataLoader
worker, the process or the device, so a run resumed at step N sees exactly the noise an
uninterrupted run would. The cache itself is never noised.

The hash runs as plain int32 tensor arithmetic, so the trainer draws the noise on its own device
after the batch arrives: the loader only reads, and ships the cache's bf16 rather than float32.
Uniform draws are bit-identical on CPU and CUDA (exact integer ops, then exact float32 ops and one
rounding by the scale); Gaussian draws go through log and cos, whose last bit may differ between
devices.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence

import numpy as np
import torch
import xxhash

from dflash_common.errors import ConfigError
from dflash_common.values import is_int
from dflash_train.settings.noise_config import NoiseConfig

# a stream's element counter is an int32 bit pattern: 2**32 draws per (sequence, layer)
MAX_DRAWS_PER_STREAM = 2**32


def _check_progress(step: int, total_steps: int) -> None:
    if not is_int(step) or step < 0:
        raise ConfigError(f"noise step {step!r} is not an integer >= 0 (pass the global training step)")
    if not is_int(total_steps) or total_steps < 1:
        raise ConfigError(
            f"noise total_steps {total_steps!r} is not an integer >= 1 (pass the run's step count)"
        )


def noise_scale(cfg: NoiseConfig, step: int, total_steps: int) -> float:
    """Noise scale at global step `step` of a `total_steps` run; past the end it stays at the
    schedule's final value."""
    _check_progress(step, total_steps)
    if cfg.schedule == "off":
        return 0.0
    if cfg.schedule == "constant":
        return float(cfg.start)
    progress = min(step, total_steps) / total_steps
    if cfg.schedule == "linear":
        return float(cfg.end + (cfg.start - cfg.end) * (1.0 - progress))
    return float(cfg.end + (cfg.start - cfg.end) * (1.0 + math.cos(math.pi * progress)) / 2.0)


def _int32(value: int) -> int:
    """A 32-bit pattern as the signed int an int32 tensor holds."""
    return value - 2**32 if value >= 2**31 else value


# lowbias32's multipliers (C. Wellons' hash-prospector), as int32 bit patterns
_M1, _M2 = _int32(0x7FEB352D), _int32(0x846CA68B)


def mix32(x: torch.Tensor) -> torch.Tensor:
    """lowbias32 on an int32 tensor read as uint32 bit patterns, in place: a bijection of 32-bit
    words in which every input bit flips about half the output bits. Right shifts are masked so
    they act as logical shifts; int32 multiplication wraps modulo 2**32 on CPU and CUDA."""
    for shift, multiplier in ((16, _M1), (15, _M2), (16, None)):
        x ^= (x >> shift) & ((1 << (32 - shift)) - 1)
        if multiplier is not None:
            x *= multiplier
    return x


def stream_keys(seed: int, step: int, sequence_id: str, layer: int) -> tuple[int, int, int, int]:
    """Four int32 keys of one (seed, step, sequence, layer) stream: xxh128 of all four."""
    digest = xxhash.xxh128_intdigest(struct.pack("<QQQ", seed, step, layer) + sequence_id.encode("utf-8"))
    return tuple(_int32((digest >> (32 * i)) & 0xFFFFFFFF) for i in range(4))


def _bits(counter: torch.Tensor, key0: int, key1: int) -> torch.Tensor:
    """Two keyed rounds, so streams are unrelated: with one round, two streams would be the same
    values at permuted positions."""
    x = mix32(counter ^ key0)
    x ^= key1
    return mix32(x)


def _draws(counter: torch.Tensor, keys: tuple[int, int, int, int], distribution: str, scale: float) -> torch.Tensor:
    """float32 draws for the element indices in ``counter`` (int32) of one stream."""
    if distribution == "uniform":
        # the top 24 bits as a signed integer in [-2**23, 2**23): exact in float32, and so is the
        # product with 2**-23, so only the final product with the scale rounds
        draws = (_bits(counter, keys[0], keys[1]) >> 8).float()
        draws *= 2.0**-23
    else:  # Box-Muller's cosine branch, one normal per element so a stream has no pairs
        u1 = ((_bits(counter, keys[0], keys[1]) >> 8) & 0xFFFFFF).float()
        u1 += 1.0
        u1 *= 2.0**-24  # (0, 1]
        u2 = ((_bits(counter, keys[2], keys[3]) >> 8) & 0xFFFFFF).float()
        u2 *= 2.0**-24 * 2.0 * math.pi
        draws = u1.log_().mul_(-2.0).sqrt_().mul_(u2.cos_())
    draws *= scale
    return draws


def _chunk_elements(device: torch.device) -> int:
    # a CPU chunk stays in cache between the ~20 elementwise ops; a GPU chunk amortises launches
    return 1 << 16 if device.type == "cpu" else 1 << 24


def _check_stream(sequence_id: object, layer: object, num_draws: int) -> None:
    if not isinstance(sequence_id, str):
        raise ConfigError(f"sequence id {sequence_id!r} is not a str (pass the cache's sequence id)")
    if not is_int(layer) or layer < 0:
        raise ConfigError(f"noise layer {layer!r} is not an integer >= 0 (pass a tapped-layer index)")
    if num_draws > MAX_DRAWS_PER_STREAM:
        raise ConfigError(f"sequence {sequence_id!r} needs {num_draws:,} noise draws per layer, more than the "
                          f"{MAX_DRAWS_PER_STREAM:,} a stream holds; split the sequence or turn noise off")


def _add_stream_(target: torch.Tensor, keys: tuple[int, int, int, int], distribution: str, scale: float) -> None:
    """target [T, H] (a view into float32 memory) += the stream's first T*H draws in C order."""
    tokens, width = target.shape
    per_chunk = max(1, _chunk_elements(target.device) // max(width, 1))
    for t0 in range(0, tokens, per_chunk):
        t1 = min(tokens, t0 + per_chunk)
        if t1 * width <= 2**31:
            counter = torch.arange(t0 * width, t1 * width, dtype=torch.int32, device=target.device)
        else:
            counter = _wrap_int32(torch.arange(t0 * width, t1 * width, dtype=torch.int64, device=target.device))
        target[t0:t1] += _draws(counter, keys, distribution, scale).view(t1 - t0, width)


def _wrap_int32(counter: torch.Tensor) -> torch.Tensor:
    return torch.where(counter >= 2**31, counter - 2**32, counter).to(torch.int32)


def noise_for(
    cfg: NoiseConfig,
    step: int,
    total_steps: int,
    sequence_id: str,
    shape: tuple[int, int],
    layer: int = 0,
    device: torch.device | str = "cpu",
) -> torch.Tensor:
    """float32 noise of `shape` (tokens, width) for one sequence's tapped layer `layer` at one
    global step: U(-scale, scale) or N(0, scale^2). Draws fill `shape` in C order from a fixed
    stream, so a shorter shape is a prefix of a longer one. All zeros when the scale is 0."""
    scale = noise_scale(cfg, step, total_steps)
    _check_stream(sequence_id, layer, math.prod(shape))
    out = torch.zeros(shape, dtype=torch.float32, device=device)
    if scale > 0.0:
        _add_stream_(out, stream_keys(cfg.seed, step, sequence_id, layer), cfg.distribution, scale)
    return out


def noised_layers(cfg: NoiseConfig, num_layers: int) -> tuple[int, ...]:
    """The tapped-layer indices that receive noise for a cache with `num_layers` tapped layers."""
    if cfg.layers is None:
        return tuple(range(num_layers - 1))
    out_of_range = [i for i in cfg.layers if i >= num_layers]
    if out_of_range:
        raise ConfigError(
            f"noise layers {list(out_of_range)} do not exist: the cache taps {num_layers} layers "
            f"(use indices 0..{num_layers - 1})"
        )
    return tuple(sorted(cfg.layers))


def add_noise_(
    hidden: torch.Tensor,
    sequence_ids: Sequence[str],
    lengths: Sequence[int],
    cfg: NoiseConfig,
    step: int,
    total_steps: int,
    packed: bool = False,
) -> torch.Tensor:
    """Add the step's noise in place to a padded float32 batch `hidden` [N, T, n_layers, H] on
    any device: row i gets sequence_ids[i]'s draws on its first lengths[i] positions of every
    selected layer; padding and the other layers stay as they are. With `packed` the sequences
    lie end to end in one row [1, sum T, n_layers, H] and each gets the same draws as in its
    padded row (a stream is keyed by the sequence, not by where it lies). Returns `hidden`."""
    if hidden.ndim != 4 or hidden.dtype != torch.float32:
        raise ValueError(f"hidden must be a float32 [N, T, n_layers, H] batch, got {hidden.dtype} {tuple(hidden.shape)}")
    rows = 1 if packed else len(sequence_ids)
    if len(lengths) != len(sequence_ids) or rows != hidden.shape[0] or (packed and sum(lengths) != hidden.shape[1]):
        raise ValueError(f"{len(sequence_ids)} ids and {len(lengths)} lengths for a {'packed ' if packed else ''}batch "
                         f"of {hidden.shape[0]} rows of {hidden.shape[1]} tokens")
    layers = noised_layers(cfg, hidden.shape[2])
    scale = noise_scale(cfg, step, total_steps)
    if not layers or scale == 0.0:
        return hidden
    width, start = hidden.shape[3], 0
    for row, (sequence_id, length) in enumerate(zip(sequence_ids, lengths)):
        part = hidden[0, start:start + int(length)] if packed else hidden[row, : int(length)]
        start += int(length)
        for layer in layers:
            _check_stream(sequence_id, layer, int(length) * width)
            _add_stream_(part[:, layer], stream_keys(cfg.seed, step, sequence_id, layer), cfg.distribution, scale)
    return hidden


def apply_noise(
    hidden: np.ndarray | torch.Tensor,
    cfg: NoiseConfig,
    step: int,
    total_steps: int,
    sequence_id: str,
) -> np.ndarray | torch.Tensor:
    """One sequence's `hidden` [T, n_layers, H] plus noise on the selected tapped layers, as a new
    array or tensor of the same type, dtype and device; other layers are bit-identical copies.
    The sum is taken in float32 and cast back. When the scale is 0 (or no layer is selected) the
    input itself is returned. The input is never modified."""
    if hidden.ndim != 3:
        raise ValueError(f"hidden must be [T, n_layers, H], got shape {tuple(hidden.shape)}")
    if not noised_layers(cfg, hidden.shape[1]) or noise_scale(cfg, step, total_steps) == 0.0:
        return hidden
    is_tensor = isinstance(hidden, torch.Tensor)
    source = hidden if is_tensor else torch.from_numpy(np.ascontiguousarray(hidden, dtype=np.float32))
    noised = add_noise_(source.float().clone()[None], [sequence_id], [source.shape[0]], cfg, step, total_steps)[0]
    if is_tensor:
        return noised.to(hidden.dtype)
    return noised.numpy().astype(hidden.dtype, copy=False)
