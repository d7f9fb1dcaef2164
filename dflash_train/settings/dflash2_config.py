"""The dflash2 section: DFlash2's convolutions and candidate selector (dflash_train.training.dflash2
builds them). The exported fields are the keys vLLM 0.32's DFlash2DraftModel reads from
config.json's dflash_config (docs/design.md, "DFlash2")."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_common.errors import ConfigError
from dflash_common.values import check_choice, is_int, is_real

ARCHITECTURE = "DFlash2DraftModel"

WALK_TARGETS = ("top1", "teacher")
"""What a candidate walk's scores are trained toward (DFlash2's selector and LiLiCorr's correlator):
"top1", the K-way cross-entropy of the teacher's top-1 among the candidates (speculators' DFlash2
objective: right at greedy); "teacher", the cross-entropy of the teacher's distribution renormalised
over the candidates, so that the walk's softmax, which vLLM samples at T=1, is the teacher's there."""

# Read by vLLM from dflash_config; the defaults are speculators' (conv 2 taps in groups of 16,
# selector rank 256 over the top 16) and vLLM's (the three scales).
# Upper bounds, far above any DFlash2 drafter (speculators' defaults: 2 taps, rank 256, top 16):
# the codebooks are vocabulary x rank x 2 (at rank 10^9, petabytes), the selector scores
# candidates x rank per position, and a tap reaches within one block (256 tokens at most).
MAX_LIMITS = {"conv_kernel_size": (256, "the largest block size, since a tap reaches within one block"),
              "conv_group_size": (1 << 16, "wider than any model's hidden size divides into"),
              "selector_rank": (4096, "16x the default 256; the two codebooks are vocabulary x rank"),
              "selector_top_k": (1024, "64x the default 16; the selector scores candidates x rank per position")}

EXPORTED = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "input_embedding_scale",
            "output_multiplier", "final_logit_softcapping")


@dataclass(frozen=True)
class DFlash2Config:
    """DFlash2's convolutions and candidate selector (used when model.kind is "dflash2"); exported in
    config.json's dflash_config."""

    conv_kernel_size: int = 2
    """Taps of each layer's grouped dynamic convolution along the block: block position k mixes
    its own state with those of positions k-1 .. k-taps+1 of the same block (1: no mixing, a
    per-channel gate). Two convolutions per layer, around attention and around the MLP. At most
    256, the largest block size."""

    conv_group_size: int = 16
    """Channels sharing one token-dependent kernel coefficient (the dynamic part is predicted per
    group of this many channels from the state); divides the hidden size; at most 65,536."""

    selector_rank: int = 256
    """Rank r of the candidate selector: each candidate's score gains
    <predecessor_codebook[previous token] * hidden_projection(state), successor_codebook[candidate]>,
    codebooks vocabulary x r. At most 4,096 (16x the default; two codebooks of vocabulary x r)."""

    selector_top_k: int = 16
    """Candidates per draft position the selector chooses among: the top-k of the drafter's own
    logits (its unary scores). At most 1,024 (64x the default)."""

    selector_loss_alpha: float = 1.0
    """Weight of the selector's K-way cross-entropy in the loss (training only; not exported)."""

    selector_target: str = "top1"
    """What the selector's scores are trained toward (training only): "top1", the teacher's top-1
    (speculators' objective, right at greedy), or "teacher", the teacher's distribution over the
    candidates (vLLM samples the walk from the scores at T=1)."""

    input_embedding_scale: float = 1.0
    """Factor on the block's token embeddings (the anchor's and the MASK's) before the first layer."""

    output_multiplier: float = 1.0
    """Factor on the unary scores (the drafter's logits of the top-k candidates) the selector adds to."""

    final_logit_softcapping: float = 0.0
    """Soft cap c of the unary scores, c * tanh(s / c) after output_multiplier; 0 is no cap."""

    def __post_init__(self) -> None:
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ConfigError(f"dflash2.{name} {value!r} is not an integer >= 1 (default "
                                  f"{getattr(DFlash2Config, name)})")
            limit, why = MAX_LIMITS[name]
            if value > limit:
                raise ConfigError(f"dflash2.{name} {value:,} is more than {limit:,}, {why}; pass a smaller one "
                                  f"(default {getattr(DFlash2Config, name)})")
        check_choice("dflash2.selector_target", self.selector_target, WALK_TARGETS)
        for name, positive in (("selector_loss_alpha", False), ("input_embedding_scale", True),
                               ("output_multiplier", True), ("final_logit_softcapping", False)):
            value = getattr(self, name)
            if not is_real(value, finite=True) or value < 0 or (positive and value == 0):
                bound = "> 0" if positive else ">= 0"
                raise ConfigError(f"dflash2.{name} {value!r} is not a number {bound} (default "
                                  f"{getattr(DFlash2Config, name)})")

    def check_fits(self, hidden_size: int, block_size: int, vocab_size: int, selects: bool) -> None:
        """Refuse convolutions (and, when the selector scores the walk, candidates) that a drafter
        of this width, block and vocabulary cannot have."""
        if hidden_size % self.conv_group_size:
            raise ConfigError(f"dflash2.conv_group_size {self.conv_group_size} does not divide hidden_size "
                              f"{hidden_size}; pick a divisor (16 is the default)")
        if self.conv_kernel_size > block_size:
            raise ConfigError(f"dflash2.conv_kernel_size {self.conv_kernel_size} exceeds block_size {block_size}; "
                              "a tap reaches within the block only (2 is the default)")
        if selects and self.selector_top_k > vocab_size:
            raise ConfigError(f"dflash2.selector_top_k {self.selector_top_k} exceeds the vocabulary's {vocab_size} "
                              "tokens; pick fewer candidates (16 is the default)")

    def export_fields(self) -> dict:
        """The dflash_config keys vLLM's DFlash2DraftModel reads."""
        return {name: getattr(self, name) for name in EXPORTED}

    @classmethod
    def from_export(cls, dflash_config: dict) -> "DFlash2Config":
        """Read export_fields back; a missing key takes the default."""
        defaults = cls()
        return cls(**{name: dflash_config.get(name, getattr(defaults, name)) for name in EXPORTED})
