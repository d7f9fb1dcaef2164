"""The noise section: which tapped layers get noise on load, how much and from which distribution
(dflash_train.training.noise draws it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_common.errors import ConfigError
from dflash_common.values import is_int, is_real

SCHEDULES = ("off", "constant", "linear", "cosine")
DISTRIBUTIONS = ("uniform", "gaussian")
_UINT64_LIMIT = 2**64


MAX_SCALE = 1e6
"""The largest noise scale taken: dflash_cache.health's MAX_RMS, above which the build refuses a
shard's states as no model's (the noise is added to the states as they are, not relative to them)."""


@dataclass(frozen=True)
class NoiseConfig:
    """Which tapped layers get noise, how much at each step, and from which distribution."""

    schedule: str = field(default="off", metadata={"name": "noise"})
    """How the scale moves over training: "off" (0), "constant" (start), "linear" (start to end
    over the run, then end), "cosine" (start to end along half a cosine, then end). Off by
    default: in the recipe study (benchmarks/RESULTS.md) neither constant 0.05 nor cosine 0.1 to
    0.01 changed held-out or real acceptance on either cache."""

    distribution: str = field(default="uniform", metadata={"name": "noise_distribution"})
    """"uniform" draws U(-scale, scale); "gaussian" draws N(0, scale^2)."""

    start: float = field(default=0.1, metadata={"name": "noise_start"})
    """Scale at step 0 (and the whole run for "constant"); in [0, 1e6]."""

    end: float = field(default=0.01, metadata={"name": "noise_end"})
    """Scale from the last step on, for "linear" and "cosine"; in [0, 1e6]."""

    layers: tuple[int, ...] | None = field(default=None, metadata={"name": "noise_layers"})
    """Indices into the cache's tapped layers (0 = first tapped layer) to noise; None = every
    tapped layer except the last."""

    seed: int = field(default=0, metadata={"name": "noise_seed"})
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
            if not is_real(value, finite=True) or value < 0:
                raise ConfigError(f"noise {name} {value!r} is not a finite number >= 0 (pass e.g. 0.1)")
            if value > MAX_SCALE:
                raise ConfigError(f"--noise-{name} {value:g} is above {MAX_SCALE:g}, the largest RMS a model's hidden "
                                  "states have (the build refuses larger ones): the noise would drown every state and "
                                  "the run would train on noise; pass a scale below the states' own (e.g. 0.1)")
        if self.layers is not None:
            layers = tuple(self.layers)
            if any(not is_int(i) or i < 0 for i in layers) or len(set(layers)) != len(layers):
                raise ConfigError(
                    f"noise layers {self.layers!r} are not distinct tapped-layer indices >= 0 "
                    "(pass e.g. (0, 1, 2), or None for all but the last)"
                )
            object.__setattr__(self, "layers", layers)
        if not is_int(self.seed) or not 0 <= self.seed < _UINT64_LIMIT:
            raise ConfigError(f"noise seed {self.seed!r} is not an integer in [0, 2**64) (pass e.g. 0)")
