"""The drafter's shape section of a train run (model)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_common.errors import ConfigError
from dflash_common.values import check_choice
from dflash_train.settings.drafter_config import ATTENTION_CHOICES, MAX_BLOCK_SIZE
from dflash_train.settings.dspark_config import DRAFTER_KINDS


@dataclass(frozen=True)
class ModelConfig:
    """Drafter shape; unset fields are derived from the teacher config saved in the cache."""

    kind: str = field(default="dflash", metadata={"name": "model_kind"})
    """Drafter kind: "dflash" (the block-parallel drafter), "dspark" (DFlash's backbone plus
    a Markov logit-bias head and a confidence head, set up by the dspark section) or "dflash2"
    (DFlash with grouped dynamic convolutions in each layer and a candidate selector over the
    top-k, set up by the dflash2 section)."""

    num_layers: int = 5
    """Drafter decoder layers."""

    block_size: int = 16
    """Tokens per block: the anchor plus block_size - 1 predicted positions."""

    mask_token_id: int | None = None
    """Token id of MASK; default: the tokenizer's <|MASK|>, else the first spare embedding row."""

    sliding_window: int | None = None
    """Window of the sliding-attention layers (None: no sliding layers)."""

    sliding_layers: tuple[int, ...] = ()
    """Drafter layers that use the sliding window."""

    num_attention_heads: int | None = None
    """Query heads (default: the teacher's)."""

    num_key_value_heads: int | None = None
    """Key/value heads (default: the teacher's)."""

    head_dim: int | None = None
    """Per-head width (default: the teacher's)."""

    intermediate_size: int | None = None
    """MLP width (default: the teacher's)."""

    attention_backend: str = "auto"
    """Attention kernel of training: "sdpa" (dense boolean mask), "flex" (flex_attention with a
    block mask; CUDA only for training) or "auto" (flex on CUDA, sdpa elsewhere). Both compute the
    same attention; export and serving do not depend on it."""

    def __post_init__(self):
        check_choice("model.kind", self.kind, DRAFTER_KINDS)
        if self.num_layers < 1:
            raise ConfigError(f"--num-layers must be at least 1, got {self.num_layers}")
        if self.block_size < 2:
            raise ConfigError(f"--block-size must be at least 2, got {self.block_size}")
        if self.block_size > MAX_BLOCK_SIZE:  # the attention mask grows with it: 100,000 asked for 640 GB
            raise ConfigError(f"--block-size {self.block_size} is larger than {MAX_BLOCK_SIZE}; a block is one draft "
                              "step (16 is typical), pass a smaller one")
        check_choice("model.attention_backend", self.attention_backend, ATTENTION_CHOICES)

    def overrides(self) -> dict:
        names = ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


# How a run computes, not what it learns: a resumed run may change these.
MODEL_OPERATIONAL = ("attention_backend",)
