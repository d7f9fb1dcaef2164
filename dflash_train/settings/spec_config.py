"""How to generate with a drafter: length, sampling and stopping (dflash_train.measuring.speculative decodes)."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_common.errors import ConfigError
from dflash_common.values import is_int, is_real


@dataclass(frozen=True)
class SpecConfig:
    """How to generate: length, sampling and stopping."""

    max_new_tokens: int = 256
    """Tokens to generate per prompt at most (the prompt is not counted)."""
    temperature: float = 0.0
    """0 for greedy decoding; > 0 samples from softmax(logits / temperature)."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of most likely tokens holding this much mass; 1 keeps all.
    Applied to the teacher and the drafter alike; ignored when temperature is 0."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end the generation; the stop token is kept as the last output token."""
    seed: int = 0
    """Seed of the sampling generator (drafts, acceptance draws, corrections)."""
    confidence_threshold: float = 0.0
    """DSpark drafters with a confidence head: end a block before the first position whose
    cumulative predicted acceptance (the product of the head's estimates so far) is below this;
    0 never stops early (the default). A drafter without a confidence head refuses any other value."""

    def __post_init__(self) -> None:
        if not is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens={self.max_new_tokens!r} must be an integer >= 1")
        if not is_real(self.temperature, finite=True) or self.temperature < 0:
            raise ConfigError(f"temperature={self.temperature!r} must be a finite number >= 0 (0 is greedy)")
        if not is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ConfigError(f"top_p={self.top_p!r} must be in (0, 1]; use 1 to keep every token")
        stops = tuple(self.stop_token_ids)
        for token in stops:
            if not is_int(token) or token < 0:
                raise ConfigError(f"stop token id {token!r} is not a non-negative integer; pass token ids")
        object.__setattr__(self, "stop_token_ids", stops)
        if not is_int(self.seed) or self.seed < 0:
            raise ConfigError(f"seed={self.seed!r} must be a non-negative integer")
        if not is_real(self.confidence_threshold) or not 0 <= self.confidence_threshold <= 1:
            raise ConfigError(f"confidence_threshold={self.confidence_threshold!r} must be in [0, 1]; 0 never stops a "
                              "block early")

    @property
    def greedy(self) -> bool:
        """Whether decoding takes the argmax instead of sampling."""
        return self.temperature == 0
