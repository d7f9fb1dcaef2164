"""The drafter's shape section of a train run (model)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_common.errors import ConfigError
from dflash_common.values import check_choice
from dflash_train.settings.drafter_config import (
    ATTENTION_CHOICES,
    MAX_BLOCK_SIZE,
    MAX_DRAFTER_LAYERS,
    MAX_HEAD_DIM,
    MAX_HEADS,
    MAX_INTERMEDIATE_SIZE,
    check_at_most,
)
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
    """Drafter decoder layers (at most 256: twice the deepest known teacher's 126; drafters have
    1 to 8)."""

    block_size: int = 16
    """Tokens per block: the anchor plus block_size - 1 predicted positions."""

    mask_token_id: int | None = None
    """Token id of MASK; default: the tokenizer's <|MASK|>, else the first spare embedding row."""

    sliding_window: int | None = None
    """Window of the sliding-attention layers (None: no sliding layers)."""

    sliding_layers: tuple[int, ...] = ()
    """Drafter layers that use the sliding window."""

    num_attention_heads: int | None = None
    """Query heads (default: the teacher's; at most 1,024, 8x any known model's 128)."""

    num_key_value_heads: int | None = None
    """Key/value heads (default: the teacher's; at most 1,024)."""

    head_dim: int | None = None
    """Per-head width (default: the teacher's; at most 1,024, 4x any known model's 256)."""

    intermediate_size: int | None = None
    """MLP width (default: the teacher's; at most 262,144, over 3x the widest known, Nemotron-4
    340B's 73,728)."""

    attention_backend: str = "auto"
    """Attention kernel of training: "sdpa" (dense boolean mask), "flex" (flex_attention with a
    block mask; CUDA only for training) or "auto" (flex on CUDA, sdpa elsewhere). Both compute the
    same attention; export and serving do not depend on it."""

    causal: bool = False
    """Causal attention inside the block on every layer (JetSpec's): a block position sees the
    context and the block's positions up to its own, not the later ones; exported as
    dflash_config.causal = true, which vLLM 0.32 serves (SGLang's DFlash does not read it)."""

    def __post_init__(self):
        check_choice("model.kind", self.kind, DRAFTER_KINDS)
        if self.num_layers < 1:
            raise ConfigError(f"--num-layers must be at least 1, got {self.num_layers}")
        if self.block_size < 2:
            raise ConfigError(f"--block-size must be at least 2, got {self.block_size}")
        if self.block_size > MAX_BLOCK_SIZE:  # the attention mask grows with it: 100,000 asked for 640 GB
            raise ConfigError(f"--block-size {self.block_size} is larger than {MAX_BLOCK_SIZE}; a block is one draft "
                              "step (16 is typical), pass a smaller one")
        check_at_most("--num-layers", self.num_layers, MAX_DRAFTER_LAYERS,
                      "twice the deepest known teacher (126 layers; drafters have 1 to 8)")
        for name, limit, why in (("num_attention_heads", MAX_HEADS, "8x the most heads of any known model (128)"),
                                 ("num_key_value_heads", MAX_HEADS, "8x the most heads of any known model (128)"),
                                 ("head_dim", MAX_HEAD_DIM, "4x the widest head of any known model (256)"),
                                 ("intermediate_size", MAX_INTERMEDIATE_SIZE,
                                  "over 3x the widest MLP known (Nemotron-4 340B's 73,728)")):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ConfigError(f"--{name.replace('_', '-')} must be at least 1, got {value}")
            check_at_most(f"--{name.replace('_', '-')}", value, limit, why)
        check_choice("model.attention_backend", self.attention_backend, ATTENTION_CHOICES)
        if not isinstance(self.causal, bool):
            raise ConfigError(f"model.causal {self.causal!r} is not a bool; pass true or false")

    def overrides(self) -> dict:
        names = ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


# How a run computes, not what it learns: a resumed run may change these.
MODEL_OPERATIONAL = ("attention_backend",)
