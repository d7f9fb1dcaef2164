"""The lilicorr section: LiLiCorr's candidate-lattice correlator (dflash_train.training.lilicorr
builds it). The exported fields are the `lilicorr_*` keys vLLM 0.32's LiLiCorrDraftModel reads from
config.json's dflash_config (docs/design.md, "LiLiCorr")."""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_common.errors import ConfigError
from dflash_common.values import check_choice, is_int, is_real
from dflash_train.settings.dflash2_config import WALK_TARGETS

ARCHITECTURE = "LiLiCorrDraftModel"

# vLLM's LiLiCorrHead refuses any other candidate count
MAX_CANDIDATES = 16
# Far above any correlator (the paper's is a few layers narrower than the drafter): the lattice's
# attention is (slots x candidates)^2 per block and per layer.
MAX_LIMITS = {"num_layers": (64, "a correlator has a few layers"),
              "num_heads": (256, "a correlator's width divides into a few heads"),
              "factor_dim": (4096, "the transition factors are a few hundred wide"),
              "hidden_size": (65536, "wider than any drafter")}


@dataclass(frozen=True)
class LiLiCorrConfig:
    """LiLiCorr's correlator (used when model.kind is "lilicorr"): for each draft position, the
    backbone's top-k candidates; a small transformer over the block's whole lattice of candidates
    scores every transition from a candidate of one position to one of the next (and from the
    context anchor into the first), and the walk takes the best path. Exported in config.json's
    dflash_config as vLLM's lilicorr_* keys."""

    candidate_topk: int = field(default=8, metadata={"name": "lilicorr_candidates"})
    """Candidates per draft position: the top-k of the backbone's logits (a power of two, at most
    16, as vLLM requires)."""

    hidden_size: int = field(default=0, metadata={"name": "lilicorr_hidden_size"})
    """Width of the correlator's states; 0 is the drafter's hidden size (then the candidates' token
    embeddings enter without a projection)."""

    num_layers: int = field(default=2, metadata={"name": "lilicorr_layers"})
    """Transformer layers over the lattice (attention with a learned relative-position bias, then
    an MLP)."""

    num_heads: int = field(default=4, metadata={"name": "lilicorr_heads"})
    """Attention heads of the lattice layers; divides the correlator's width."""

    mlp_ratio: float = field(default=2.0, metadata={"name": "lilicorr_mlp_ratio"})
    """MLP width of the lattice layers as a multiple of the correlator's width."""

    factor_dim: int = field(default=64, metadata={"name": "lilicorr_factor_dim"})
    """Width of the outgoing and incoming factor vectors whose normalised dot product scores a
    transition."""

    logit_scale: float = field(default=16.0, metadata={"name": "lilicorr_logit_scale"})
    """Factor on the transition scores (cosines in [-1, 1]): the walk's logits. It bounds how sure
    the walk can be: the largest probability over k candidates is at most
    1 / (1 + (k - 1) * exp(-2 * scale))."""

    vector_eps: float = field(default=1e-6, metadata={"name": "lilicorr_vector_eps"})
    """Epsilon of the factor vectors' normalisation."""

    conv: bool = field(default=False, metadata={"name": "lilicorr_conv"})
    """The backbone's layers get DFlash2's grouped dynamic convolutions ("LiLiCorr + conv"), shaped
    by the dflash2 section's conv_kernel_size and conv_group_size."""

    target: str = field(default="teacher", metadata={"name": "lilicorr_target"})
    """What the walk's scores are trained toward: "teacher" (the teacher's distribution over the
    candidates: right at T=1 and greedy) or "top1" (the teacher's top-1 only)."""

    loss_alpha: float = field(default=1.0, metadata={"name": "lilicorr_loss_alpha"})
    """Weight of the correlator's cross-entropy in the loss (training only; not exported)."""

    def __post_init__(self) -> None:
        k = self.candidate_topk
        if not is_int(k) or not 1 <= k <= MAX_CANDIDATES or k & (k - 1):
            raise ConfigError(f"lilicorr.candidate_topk {k!r} is not a power of two from 1 to {MAX_CANDIDATES}, "
                              "which vLLM's LiLiCorr requires; pass 4, 8 or 16")
        for name in ("num_layers", "num_heads", "factor_dim", "hidden_size"):
            value = getattr(self, name)
            low = 0 if name == "hidden_size" else 1
            if not is_int(value) or value < low:
                raise ConfigError(f"lilicorr.{name} {value!r} is not an integer >= {low} (default "
                                  f"{getattr(LiLiCorrConfig, name)})")
            limit, why = MAX_LIMITS[name]
            if value > limit:
                raise ConfigError(f"lilicorr.{name} {value:,} is more than {limit:,}, {why}; pass a smaller one "
                                  f"(default {getattr(LiLiCorrConfig, name)})")
        for name in ("mlp_ratio", "logit_scale", "vector_eps", "loss_alpha"):
            value = getattr(self, name)
            if not is_real(value, finite=True) or value < 0 or (name != "loss_alpha" and value == 0):
                bound = ">= 0" if name == "loss_alpha" else "> 0"
                raise ConfigError(f"lilicorr.{name} {value!r} is not a number {bound} (default "
                                  f"{getattr(LiLiCorrConfig, name)})")
        if not isinstance(self.conv, bool):
            raise ConfigError(f"lilicorr.conv {self.conv!r} is not true or false")
        check_choice("lilicorr.target", self.target, WALK_TARGETS)

    def check_fits(self, hidden_size: int, vocab_size: int, convolutions: bool) -> None:
        """Refuse a correlator a drafter of this width and vocabulary cannot have, or a conv flag
        that disagrees with the drafter's convolutions."""
        if self.conv != convolutions:
            raise ConfigError(f"lilicorr.conv is {self.conv} but the drafter {'lacks' if self.conv else 'has'} "
                              "DFlash2's convolutions; pass dflash2 (its conv_kernel_size and conv_group_size) exactly "
                              "when lilicorr.conv is true")
        if self.width(hidden_size) % self.num_heads:
            raise ConfigError(f"lilicorr.num_heads {self.num_heads} does not divide the correlator's width "
                              f"{self.width(hidden_size)}; pick a divisor (4 is the default)")
        if self.candidate_topk > vocab_size:
            raise ConfigError(f"lilicorr.candidate_topk {self.candidate_topk} exceeds the vocabulary's {vocab_size} "
                              "tokens; pick fewer candidates (8 is the default)")

    def width(self, drafter_hidden: int) -> int:
        """The correlator's width for a drafter of width drafter_hidden."""
        return self.hidden_size or drafter_hidden

    def export_fields(self) -> dict:
        """The lilicorr_* keys of dflash_config vLLM's LiLiCorrHead reads."""
        return {"lilicorr_enabled": True, "lilicorr_candidate_topk": self.candidate_topk,
                "lilicorr_hidden_size": self.hidden_size or None, "lilicorr_num_layers": self.num_layers,
                "lilicorr_num_heads": self.num_heads, "lilicorr_mlp_ratio": self.mlp_ratio,
                "lilicorr_factor_dim": self.factor_dim, "lilicorr_logit_scale": self.logit_scale,
                "lilicorr_vector_eps": self.vector_eps}

    @classmethod
    def from_export(cls, dflash_config: dict) -> "LiLiCorrConfig":
        """Read export_fields back (conv from the presence of a convolution); training-only fields
        take their defaults."""
        defaults = cls()
        read = {name: dflash_config.get(f"lilicorr_{key}", getattr(defaults, name))
                for name, key in (("candidate_topk", "candidate_topk"), ("num_layers", "num_layers"),
                                  ("num_heads", "num_heads"), ("mlp_ratio", "mlp_ratio"), ("factor_dim", "factor_dim"),
                                  ("logit_scale", "logit_scale"), ("vector_eps", "vector_eps"))}
        return cls(**read, hidden_size=dflash_config.get("lilicorr_hidden_size") or 0,
                   conv=bool(dflash_config.get("conv_kernel_size")))
