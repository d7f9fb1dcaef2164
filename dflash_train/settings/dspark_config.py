"""The dspark section: DSpark's heads and layout (dflash_train.training.dspark builds the heads)."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_common.errors import ConfigError
from dflash_common.values import check_choice, is_int, is_real

MARKOV_HEAD_TYPES = ("vanilla", "gated", "rnn")
CONFIDENCE_TARGETS = ("alpha", "greedy")
DRAFTER_KINDS = ("dflash", "dspark", "dflash2", "lilicorr")
ARCHITECTURE = "DSparkDraftModel"
MAX_MARKOV_RANK = 4096
"""Largest Markov rank: 16x the reference's 256; W1 and W2 are vocabulary x rank each."""


@dataclass(frozen=True)
class DSparkConfig:
    """DSpark's heads and layout (used when model.kind is "dspark"); exported in config.json."""

    markov_rank: int = 256
    """Rank r of the Markov logit bias B = W1 W2 (W1: target vocabulary x r, W2: r x draft
    vocabulary); 0 drops the Markov head (plain DFlash drafting in DSpark's layout). At most
    4,096 (16x the reference's; W1 and W2 are vocabulary x r each)."""

    markov_head_type: str = "vanilla"
    """Markov head variant: "vanilla" (bias from the previous token alone), "gated" (its
    embedding gated by the backbone state) or "rnn" (a recurrent state over the block). vLLM
    0.32 serves only "vanilla"."""

    enable_confidence_head: bool = True
    """Attach the confidence head: a linear head predicting each draft position's acceptance
    probability, trained with a BCE term."""

    confidence_head_with_markov: bool = True
    """Feed the confidence head the Markov previous-token embedding next to the backbone state
    (needs markov_rank > 0)."""

    confidence_head_alpha: float = 1.0
    """Weight of the confidence head's BCE term in the loss."""

    confidence_target: str = "alpha"
    """What the confidence head learns to predict per position: "alpha" (the acceptance
    probability of sampling, sum min(p, q) over the teacher's buckets, as the reference trains
    it) or "greedy" (1 when the drafter's argmax is the teacher's top-1: acceptance at
    temperature 0)."""

    sample_from_anchor: bool = True
    """The anchor slot predicts too: block_size speculative tokens per block instead of
    block_size - 1 (DSpark's default, and the layout vLLM's DSpark runs)."""

    def __post_init__(self) -> None:
        if not is_int(self.markov_rank) or self.markov_rank < 0:
            raise ConfigError(f"dspark.markov_rank {self.markov_rank!r} is not an integer >= 0 (pass e.g. 256, or 0 "
                              "for no Markov head)")
        if self.markov_rank > MAX_MARKOV_RANK:
            raise ConfigError(f"dspark.markov_rank {self.markov_rank:,} is more than {MAX_MARKOV_RANK:,}, 16x the "
                              "reference's 256 (W1 and W2 are vocabulary x rank); pass a smaller one")
        check_choice("dspark.markov_head_type", self.markov_head_type, MARKOV_HEAD_TYPES)
        for name in ("enable_confidence_head", "confidence_head_with_markov", "sample_from_anchor"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"dspark.{name} {getattr(self, name)!r} is not true or false")
        if self.enable_confidence_head and self.confidence_head_with_markov and self.markov_rank == 0:
            raise ConfigError("dspark.confidence_head_with_markov needs a Markov head but markov_rank is 0; set "
                              "confidence_head_with_markov false or markov_rank > 0")
        if not is_real(self.confidence_head_alpha, finite=True) or self.confidence_head_alpha < 0:
            raise ConfigError(f"dspark.confidence_head_alpha {self.confidence_head_alpha!r} is not a number >= 0 "
                              "(pass e.g. 1.0)")
        check_choice("dspark.confidence_target", self.confidence_target, CONFIDENCE_TARGETS)

    def export_fields(self) -> dict:
        """The config.json keys DSpark loaders read at the top level (vLLM, speculators)."""
        return {
            "sample_from_anchor": self.sample_from_anchor,
            "markov_rank": self.markov_rank,
            "markov_head_type": self.markov_head_type,
            "enable_confidence_head": self.enable_confidence_head,
            "confidence_head_with_markov": self.confidence_head_with_markov,
            "confidence_head_alpha": self.confidence_head_alpha,
            "confidence_target": self.confidence_target,
        }

    @classmethod
    def from_export(cls, config: dict) -> "DSparkConfig":
        """Read export_fields back; a missing key takes the reference default."""
        defaults = cls()
        return cls(**{name: config.get(name, getattr(defaults, name)) for name in defaults.export_fields()})
