"""Step-indexed noise on the tapped hidden states as they are loaded (DESIGN.md, "Noise on load").

Every draw is a pure function of (seed, global step, sequence id, tapped-layer index): the
counter-based Philox generator is keyed by the seed and a hash of the sequence id, and its
counter starts at a value built from the step and the layer. Nothing depends on the order of
draws, the batch a sequence lands in, the DataLoader worker or the process, so a run resumed
at step N sees exactly the noise an uninterrupted run would. The cache itself is never noised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from dflash_cache.errors import ConfigError

SCHEDULES = ("off", "constant", "linear", "cosine")
DISTRIBUTIONS = ("uniform", "gaussian")
_UINT64_LIMIT = 2**64


@dataclass(frozen=True)
class NoiseConfig:
    """Which tapped layers get noise, how much at each step, and from which distribution."""

    schedule: str = "cosine"
    """How the scale moves over training: "off" (0), "constant" (start), "linear" (start to end
    over the run, then end), "cosine" (start to end along half a cosine, then end)."""

    distribution: str = "uniform"
    """"uniform" draws U(-scale, scale); "gaussian" draws N(0, scale^2)."""

    start: float = 0.1
    """Scale at step 0 (and the whole run for "constant"); >= 0."""

    end: float = 0.01
    """Scale from the last step on, for "linear" and "cosine"; >= 0."""

    layers: tuple[int, ...] | None = None
    """Indices into the cache's tapped layers (0 = first tapped layer) to noise; None = every
    tapped layer except the last."""

    seed: int = 0
    """Noise seed in [0, 2**64); changing it changes every draw."""

    def __post_init__(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ConfigError(
                f"noise schedule {self.schedule!r} is unknown (use one of {', '.join(SCHEDULES)})"
            )
        if self.distribution not in DISTRIBUTIONS:
            raise ConfigError(
                f"noise distribution {self.distribution!r} is unknown (use one of {', '.join(DISTRIBUTIONS)})"
            )
        for name in ("start", "end"):
            value = getattr(self, name)
            if not _is_real(value) or not math.isfinite(value) or value < 0:
                raise ConfigError(f"noise {name} {value!r} is not a finite number >= 0 (pass e.g. 0.1)")
        if self.layers is not None:
            layers = tuple(self.layers)
            if any(not _is_int(i) or i < 0 for i in layers) or len(set(layers)) != len(layers):
                raise ConfigError(
                    f"noise layers {self.layers!r} are not distinct tapped-layer indices >= 0 "
                    "(pass e.g. (0, 1, 2), or None for all but the last)"
                )
            object.__setattr__(self, "layers", layers)
        if not _is_int(self.seed) or not 0 <= self.seed < _UINT64_LIMIT:
            raise ConfigError(f"noise seed {self.seed!r} is not an integer in [0, 2**64) (pass e.g. 0)")


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_int(value: object) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def _check_progress(step: int, total_steps: int) -> None:
    if not _is_int(step) or step < 0:
        raise ConfigError(f"noise step {step!r} is not an integer >= 0 (pass the global training step)")
    if not _is_int(total_steps) or total_steps < 1:
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


def _generator(seed: int, step: int, sequence_id: str, layer: int) -> np.random.Generator:
    """Philox keyed by (seed, xxh64(sequence id)); step and layer sit in the counter's two high
    words, so streams never overlap (each would need 2**128 draws to reach the next)."""
    key = np.array([seed, xxhash.xxh64_intdigest(sequence_id.encode("utf-8"))], dtype=np.uint64)
    counter = np.array([0, 0, layer, step], dtype=np.uint64)
    return np.random.Generator(np.random.Philox(key=key, counter=counter))


def noise_for(
    cfg: NoiseConfig,
    step: int,
    total_steps: int,
    sequence_id: str,
    shape: tuple[int, ...],
    layer: int = 0,
    out: np.ndarray | None = None,
) -> np.ndarray:
    """float32 noise of `shape` for one sequence at one global step: U(-scale, scale) or
    N(0, scale^2). `layer` names the tapped layer the draw is for, so each layer gets its own
    stream. Draws fill `shape` in C order from a fixed stream, so a shorter shape is a prefix
    of a longer one. All zeros (and no drawing) when the scale is 0. ``out`` (float32, C order,
    of `shape`) receives the draws instead of a new array: the loader reuses one buffer, because
    freshly allocated memory costs more to touch than drawing into memory already in use."""
    scale = noise_scale(cfg, step, total_steps)
    if not isinstance(sequence_id, str):
        raise ConfigError(f"sequence id {sequence_id!r} is not a str (pass the cache's sequence id)")
    if not _is_int(layer) or layer < 0:
        raise ConfigError(f"noise layer {layer!r} is not an integer >= 0 (pass a tapped-layer index)")
    if out is not None and (out.dtype != np.float32 or out.shape != tuple(shape) or not out.flags.c_contiguous):
        raise ValueError(f"out must be a C-contiguous float32 array of shape {tuple(shape)}, got {out.dtype} {out.shape}")
    if scale == 0.0:
        if out is None:
            return np.zeros(shape, dtype=np.float32)
        out.fill(0.0)
        return out
    rng = _generator(cfg.seed, step, sequence_id, layer)
    if cfg.distribution == "gaussian":
        draw = rng.standard_normal(shape, dtype=np.float32, out=out)
        draw *= np.float32(scale)
        return draw
    draw = rng.random(shape, dtype=np.float32, out=out)
    # [0, 1) -> [-scale, scale) in place, staying float32.
    draw *= np.float32(2.0 * scale)
    draw -= np.float32(scale)
    return draw


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


def apply_noise(
    hidden: np.ndarray | torch.Tensor,
    cfg: NoiseConfig,
    step: int,
    total_steps: int,
    sequence_id: str,
) -> np.ndarray | torch.Tensor:
    """`hidden` [T, n_layers, H] plus noise on the selected tapped layers, as a new array or
    tensor of the same type, dtype and device; other layers are bit-identical copies. The sum
    is taken in float32 and cast back. When the scale is 0 (or no layer is selected) the input
    itself is returned. The input is never modified."""
    if hidden.ndim != 3:
        raise ValueError(f"hidden must be [T, n_layers, H], got shape {tuple(hidden.shape)}")
    num_tokens, num_layers, width = hidden.shape
    layers = noised_layers(cfg, num_layers)
    if not layers or noise_scale(cfg, step, total_steps) == 0.0:
        return hidden
    is_tensor = isinstance(hidden, torch.Tensor)
    noised = hidden.clone() if is_tensor else hidden.copy()
    for layer in layers:
        noise = noise_for(cfg, step, total_steps, sequence_id, (num_tokens, width), layer=layer)
        if is_tensor:
            noise_t = torch.from_numpy(noise).to(hidden.device)
            noised[:, layer, :] = (hidden[:, layer, :].float() + noise_t).to(hidden.dtype)
        else:
            noised[:, layer, :] = (hidden[:, layer, :].astype(np.float32) + noise).astype(hidden.dtype)
    return noised
