"""What a sweep measures of every run besides its final held-out evaluation (the measure section of a sweep)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_common.errors import ConfigError
from dflash_common.values import is_real


@dataclass(frozen=True)
class MeasureConfig:
    """What a sweep measures of every run besides its final held-out evaluation."""

    curve_points: int = 0
    """Held-out evaluations during each run, at evenly spaced steps (a checkpoint is kept at
    each and evaluated after the run), for held-out tau against training tokens; 0: none."""

    teacher: str | None = None
    """Teacher folder for real greedy decoding of held-out prompts with each run's drafter
    (None: no decoding)."""

    prompts: tuple[str, ...] = field(default=(), metadata={"repeat": True})
    """Prompt files for the decoding, repeat for several (the files `dflash-train eval --prompts`
    reads); the summary gives the accepted length per category too."""

    max_prompts: int = 24
    """Prompts decoded per run (the first ones of each file)."""

    max_new_tokens: int = 64
    """Tokens generated per prompt."""

    sample_temperature: float = 0.0
    """Also decode the prompts by speculative sampling at this temperature (e.g. 1, seeded by the
    run's seed) and report its accepted length beside greedy's; 0: greedy only."""

    def __post_init__(self):
        from dflash_train.settings.eval_config import prompt_paths

        object.__setattr__(self, "prompts", prompt_paths(self.prompts))
        if isinstance(self.curve_points, bool) or not isinstance(self.curve_points, int) or self.curve_points < 0:
            raise ConfigError(f"--curve-points must be 0 or more, got {self.curve_points!r}; e.g. --curve-points 3")
        if (self.teacher is None) != (not self.prompts):
            raise ConfigError("real decoding in a sweep needs both --teacher and --prompts (got only "
                              f"{'--teacher' if self.teacher else '--prompts'}); give both or neither")
        if not is_real(self.sample_temperature, finite=True) or self.sample_temperature < 0:
            raise ConfigError(f"--sample-temperature must be a number >= 0 (0: greedy only), got {self.sample_temperature!r}")
        if self.max_prompts < 1 or self.max_new_tokens < 2:
            raise ConfigError(f"--max-prompts must be >= 1 and --max-new-tokens >= 2, got {self.max_prompts} and "
                              f"{self.max_new_tokens}")

    @property
    def active(self) -> bool:
        return self.curve_points > 0 or self.teacher is not None

    def covers(self, record: dict | None) -> bool:
        """Whether a run's measure.json holds what these settings measure (a sampled decoding
        asked for later is measured then)."""
        if record is None:
            return False
        sampled = (record.get("sampling") or {}).get("temperature")
        return self.sample_temperature == 0 or self.teacher is None or sampled == self.sample_temperature

    def save_every(self, steps: int) -> int:
        """Checkpoint spacing that puts one checkpoint at each curve point (and the last step)."""
        return max(1, steps // (self.curve_points + 1))
