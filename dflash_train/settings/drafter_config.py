"""A drafter's shape (DrafterConfig) and its Hugging Face config dicts: derived from the teacher's
config, written as the export's config.json (what the reference DFlash code, vLLM and SGLang read),
and read back. dflash_train.training.model builds the drafter from it."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from dflash_common.errors import ConfigError
from dflash_common.values import is_int
from dflash_train.settings.dflash2_config import ARCHITECTURE as DFLASH2_ARCHITECTURE
from dflash_train.settings.dflash2_config import DFlash2Config
from dflash_train.settings.dspark_config import ARCHITECTURE as DSPARK_ARCHITECTURE
from dflash_train.settings.dspark_config import DSparkConfig
from dflash_train.settings.export_types import check_export_types
from dflash_train.settings.lilicorr_config import ARCHITECTURE as LILICORR_ARCHITECTURE
from dflash_train.settings.lilicorr_config import LiLiCorrConfig

FULL_ATTENTION = "full_attention"
SLIDING_ATTENTION = "sliding_attention"
LAYER_TYPES = (FULL_ATTENTION, SLIDING_ATTENTION)
ATTENTION_BACKENDS = ("sdpa", "flex")
ATTENTION_CHOICES = ("auto", *ATTENTION_BACKENDS)
# Tokens per block at most: far above the 16 that drafters use; the training attention mask grows
# with it (a block size of 100,000 asked for 640 GB).
MAX_BLOCK_SIZE = 256

# Bounds on the sizes a user types, each far above every real model, so that a slip (an extra
# zero, 1e9) is refused when the config is built instead of allocating for minutes. The widest
# and deepest teachers known: Llama 3.1 405B (126 layers, 128 heads, MLP 53,248), Nemotron-4 340B
# (MLP 73,728), Gemma (head_dim 256); drafters have 1 to 8 layers.
MAX_DRAFTER_LAYERS = 256
"""Most drafter layers: twice the deepest known teacher (126); drafters have 1 to 8."""
MAX_HEADS = 1024
"""Most attention (or key/value) heads: 8x the most of any known model (128)."""
MAX_HEAD_DIM = 1024
"""Widest attention head: 4x the widest of any known model (256)."""
MAX_INTERMEDIATE_SIZE = 1 << 18
"""Widest MLP (262,144): over 3x the widest known (Nemotron-4 340B's 73,728)."""
MAX_BLOCK_TOKENS = 1 << 16
"""Most block tokens of one sequence in one forward, block_size x num_anchors (65,536): the
attention mask and the block states grow with it (256 x 1,000 asked for a 13.7 GB mask); 8x
16 x 512, the most anchors known in use."""
MAX_DRAFTER_PARAMETERS = 32 * 10**9
"""Most weights a drafter may have: 10x a 5-layer drafter at DeepSeek-V3's width (~3 billion);
its training state is 16 bytes a weight, so more fits no node."""


def check_block_tokens(block_size: int, num_anchors: int) -> None:
    """Refuse block_size x num_anchors above MAX_BLOCK_TOKENS (the blocks of one sequence run in
    one forward, and its attention mask grows with their square)."""
    if is_int(block_size) and is_int(num_anchors) and block_size * num_anchors > MAX_BLOCK_TOKENS:
        raise ConfigError(f"--block-size {block_size} x --num-anchors {num_anchors:,} is {block_size * num_anchors:,} "
                          f"block tokens per sequence in one forward, more than {MAX_BLOCK_TOKENS:,} (8x the most in "
                          "use; the attention mask grows with its square); pass fewer --num-anchors")


def check_at_most(option: str, value: object, limit: int, why: str) -> None:
    """Refuse a whole number above `limit` in one line naming the option, the value, the limit
    and why there is one (the caller checks the lower bound)."""
    if is_int(value) and value > limit:
        raise ConfigError(f"{option} {value:,} is more than {limit:,}, {why}; pass a smaller one")


@dataclass(frozen=True)
class DrafterConfig:
    """Shape and wiring of a DFlash drafter; `to_hf_config()` is its export config.json."""

    hidden_size: int
    """Width of the residual stream; equal to the teacher's hidden size."""
    num_attention_heads: int
    """Query heads per layer."""
    num_key_value_heads: int
    """Key/value heads per layer (grouped-query attention); divides num_attention_heads."""
    head_dim: int
    """Width of one attention head; even, because rotary embeddings rotate pairs."""
    intermediate_size: int
    """Width of the SwiGLU MLP."""
    vocab_size: int
    """Rows of the teacher's embedding / LM head."""
    mask_token_id: int
    """Token id that fills the not-yet-known positions of a block."""
    target_layer_ids: tuple[int, ...]
    """0-based teacher decoder layers whose outputs are concatenated into the context features."""
    num_target_layers: int
    """Number of decoder layers of the teacher."""
    num_hidden_layers: int = 5
    """Number of drafter decoder layers."""
    block_size: int = 16
    """Tokens per drafted block: the anchor token plus block_size - 1 predictions."""
    rms_norm_eps: float = 1e-6
    """Epsilon of every RMSNorm."""
    rope_theta: float = 1_000_000.0
    """Base of the rotary embedding frequencies."""
    max_position_embeddings: int = 40960
    """Longest position the drafter is meant to serve (recorded for inference engines)."""
    layer_types: tuple[str, ...] | None = None
    """Per layer, "full_attention" or "sliding_attention"; None means all full attention."""
    sliding_window: int | None = None
    """Key window of sliding layers: a key at position p is seen by a query at q when p > q - window."""
    mask_token: str | None = None
    """The tokenizer's token at mask_token_id (e.g. "<|MASK|>"), None when that id is a spare embedding row;
    exported as dflash_config.mask_token, which SGLang checks against the tokenizer."""
    dspark: DSparkConfig | None = None
    """DSpark's heads and layout; None is a DFlash (or DFlash2) drafter."""
    dflash2: DFlash2Config | None = None
    """DFlash2's convolutions and candidate selector; with lilicorr, the backbone's convolutions
    only (LiLiCorr + conv); None is a drafter without convolutions."""
    lilicorr: LiLiCorrConfig | None = None
    """LiLiCorr's lattice correlator; None is a drafter without one."""
    causal: bool = False
    """Causal attention inside the block on every layer (JetSpec's): exported as
    dflash_config.causal = true, which vLLM's DFlash, DSpark and DFlash2 layers read."""

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "intermediate_size", "vocab_size", "num_target_layers", "num_hidden_layers",
                     "max_position_embeddings"):
            _require_positive_int(name, getattr(self, name))
        _require_positive_int("block_size", self.block_size)
        if self.block_size < 2:
            raise ConfigError(f"block_size={self.block_size} drafts nothing; use 2 or more (16 is typical)")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}; pick a divisor")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} is odd; rotary embeddings need an even head_dim")
        if not self.rms_norm_eps > 0:
            raise ConfigError(f"rms_norm_eps={self.rms_norm_eps} must be > 0")
        if not self.rope_theta > 0:
            raise ConfigError(f"rope_theta={self.rope_theta} must be > 0")
        _require_int("mask_token_id", self.mask_token_id)
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(
                f"mask_token_id={self.mask_token_id} is outside the vocabulary [0, {self.vocab_size}); "
                "pass an id the teacher's embedding has a row for")

        layer_ids = tuple(self.target_layer_ids)
        if not layer_ids:
            raise ConfigError("target_layer_ids is empty; list the teacher layers to tap, e.g. 1,16,31,46,61")
        for layer_id in layer_ids:
            _require_int("target_layer_ids entry", layer_id)
            if not 0 <= layer_id < self.num_target_layers:
                raise ConfigError(
                    f"target layer id {layer_id} is outside the teacher's {self.num_target_layers} layers; "
                    f"use ids in [0, {self.num_target_layers})")
        if len(set(layer_ids)) != len(layer_ids):
            raise ConfigError(f"target_layer_ids={list(layer_ids)} repeats a layer; list each layer once")
        object.__setattr__(self, "target_layer_ids", layer_ids)

        types = (FULL_ATTENTION,) * self.num_hidden_layers if self.layer_types is None else tuple(self.layer_types)
        if len(types) != self.num_hidden_layers:
            raise ConfigError(
                f"layer_types has {len(types)} entries for num_hidden_layers={self.num_hidden_layers}; "
                "give one per layer")
        bad = [t for t in types if t not in LAYER_TYPES]
        if bad:
            raise ConfigError(f"layer type {bad[0]!r} is unknown; use one of {list(LAYER_TYPES)}")
        object.__setattr__(self, "layer_types", types)
        self._check_variants()

        self._check_size()
        if self.any_sliding:
            if self.sliding_window is None:
                raise ConfigError("a layer is sliding_attention but sliding_window is None; set a window")
            _require_positive_int("sliding_window", self.sliding_window)
        elif self.sliding_window is not None:
            raise ConfigError(
                f"sliding_window={self.sliding_window} is set but no layer is sliding_attention; "
                "choose sliding layers or drop the window")

    def _check_size(self) -> None:
        """Refuse a drafter whose weights would not fit any node (see MAX_DRAFTER_PARAMETERS)."""
        h, heads, kv = self.hidden_size, self.num_attention_heads, self.num_key_value_heads
        layer = h * self.head_dim * (2 * heads + 2 * kv) + 3 * h * self.intermediate_size
        total = self.num_hidden_layers * layer + h * h * self.num_context_layers
        if total > MAX_DRAFTER_PARAMETERS:
            raise ConfigError(f"the drafter would have {total:,} weights ({self.num_hidden_layers} layers of width "
                              f"{h:,}, MLP {self.intermediate_size:,}), more than {MAX_DRAFTER_PARAMETERS:,} (10x the "
                              "largest real drafter); pass fewer layers or a narrower MLP or heads")

    def _check_variants(self) -> None:
        """Refuse a DSpark, DFlash2 or causal setting of the wrong type, or a DFlash2 that does not fit."""
        if self.dspark is not None and not isinstance(self.dspark, DSparkConfig):
            raise ConfigError(f"dspark is a {type(self.dspark).__name__}, not a DSparkConfig; pass DSparkConfig(...) or None")
        if self.dflash2 is not None:
            self._check_dflash2()
        if self.lilicorr is not None:
            self._check_lilicorr()
        if not isinstance(self.causal, bool):
            raise ConfigError(f"causal={self.causal!r} is not a bool; pass True or False")

    def _check_dflash2(self) -> None:
        if not isinstance(self.dflash2, DFlash2Config):
            raise ConfigError(f"dflash2 is a {type(self.dflash2).__name__}, not a DFlash2Config; pass DFlash2Config(...) "
                              "or None")
        if self.dspark is not None:
            raise ConfigError("a drafter is DSpark or DFlash2, not both; pass dspark or dflash2")
        self.dflash2.check_fits(self.hidden_size, self.block_size, self.vocab_size, selects=self.lilicorr is None)

    def _check_lilicorr(self) -> None:
        if not isinstance(self.lilicorr, LiLiCorrConfig):
            raise ConfigError(f"lilicorr is a {type(self.lilicorr).__name__}, not a LiLiCorrConfig; pass "
                              "LiLiCorrConfig(...) or None")
        if self.dspark is not None:
            raise ConfigError("a drafter is DSpark or LiLiCorr, not both; pass dspark or lilicorr")
        self.lilicorr.check_fits(self.hidden_size, self.vocab_size, convolutions=self.dflash2 is not None)

    @property
    def selector(self) -> DFlash2Config | None:
        """DFlash2's settings when its candidate selector is the walk's scorer (a DFlash2 drafter;
        LiLiCorr + conv has DFlash2's convolutions but scores with its correlator)."""
        return self.dflash2 if self.lilicorr is None else None

    @property
    def any_sliding(self) -> bool:
        """Whether at least one layer uses sliding-window attention."""
        return SLIDING_ATTENTION in self.layer_types

    @property
    def num_draft_positions(self) -> int:
        """P, the tokens one block drafts: block_size with DSpark's sample_from_anchor (the
        anchor slot predicts too), else block_size - 1."""
        return self.block_size - 1 + self.first_slot_predicts

    @property
    def first_slot_predicts(self) -> int:
        """1 when the anchor slot predicts (draft position j comes from slot j - 1), else 0 (slot j)."""
        return int(self.dspark is not None and self.dspark.sample_from_anchor)

    @property
    def num_context_layers(self) -> int:
        """How many teacher layers are concatenated per position."""
        return len(self.target_layer_ids)

    def layer_window(self, layer_index: int) -> int | None:
        """The sliding window of one layer, None for full attention."""
        return self.sliding_window if self.layer_types[layer_index] == SLIDING_ATTENTION else None

    @classmethod
    def from_teacher(cls, teacher_config: Mapping[str, Any], target_layer_ids: Sequence[int], mask_token_id: int,
                     **options: Any) -> "DrafterConfig":
        """Derive a drafter config from a teacher's HF config dict (see drafter_config_from_teacher below)."""
        return drafter_config_from_teacher(teacher_config, target_layer_ids, mask_token_id, **options)

    def to_hf_config(self) -> dict[str, Any]:
        """The export config.json (see export_config below)."""
        return export_config(self)

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any]) -> "DrafterConfig":
        """Read an export config.json back (see drafter_config_from_export below)."""
        return drafter_config_from_export(config)


def _require_int(name: str, value: Any) -> None:
    if not is_int(value):
        raise ConfigError(f"{name}={value!r} is not an integer; pass a whole number")


def _require_positive_int(name: str, value: Any) -> None:
    _require_int(name, value)
    if value < 1:
        raise ConfigError(f"{name}={value} must be >= 1")


DFLASH_ARCHITECTURE = "DFlashDraftModel"
EXPORT_ARCHITECTURES = (DFLASH_ARCHITECTURE, DSPARK_ARCHITECTURE, DFLASH2_ARCHITECTURE, LILICORR_ARCHITECTURE)
"""The architectures an export of ours names: one per drafter kind."""


def drafter_config_from_teacher(
    teacher_config: Mapping[str, Any],
    target_layer_ids: Sequence[int],
    mask_token_id: int,
    block_size: int = 16,
    num_hidden_layers: int = 5,
    sliding_window: int | None = None,
    sliding_layers: Sequence[int] = (),
    **overrides: Any,
) -> DrafterConfig:
    """Derive a drafter config from a teacher's HF config dict (Qwen3, Llama, qwen3_5, ...).

    Dimensions default to the teacher's; `overrides` replaces any field by name.
    """
    text = text_config(teacher_config)
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers", "intermediate_size", "vocab_size"):
        if text.get(key) is None:
            raise ConfigError(f"teacher config has no {key!r}; pass a transformers config dict of a decoder LM")
    sliding_layers = tuple(sliding_layers)
    for index in sliding_layers:
        if not 0 <= index < num_hidden_layers:
            raise ConfigError(
                f"sliding layer {index} is outside the drafter's {num_hidden_layers} layers; "
                f"use indices in [0, {num_hidden_layers})")
    if sliding_layers and sliding_window is None:
        raise ConfigError(f"sliding_layers={list(sliding_layers)} given without sliding_window; set a window")
    if sliding_window is not None and not sliding_layers:
        raise ConfigError(f"sliding_window={sliding_window} given without sliding_layers; name the sliding layers")

    fields: dict[str, Any] = dict(
        **_layer_shape(text),
        mask_token_id=mask_token_id,
        target_layer_ids=tuple(target_layer_ids),
        num_target_layers=int(text["num_hidden_layers"]),
        num_hidden_layers=num_hidden_layers,
        block_size=block_size,
        layer_types=tuple(SLIDING_ATTENTION if i in sliding_layers else FULL_ATTENTION
                          for i in range(num_hidden_layers)),
        sliding_window=sliding_window,
    )
    known = {f.name for f in dataclasses.fields(DrafterConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ConfigError(f"unknown drafter config field {unknown[0]!r}; use one of {sorted(known)}")
    fields.update(overrides)
    return DrafterConfig(**fields)


def export_config(cfg: DrafterConfig) -> dict[str, Any]:
    """The export config.json: a Qwen3 config plus the DFlash fields."""
    config: dict[str, Any] = {
        "architectures": [DFLASH_ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size,
        "hidden_act": "silu",
        "vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        # Older readers look for rope_theta, transformers 5 for rope_parameters: write both.
        "rope_theta": cfg.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_position_embeddings,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        # Some engines read block_size from dflash_config instead of the top level.
        "dflash_config": {
            "mask_token_id": cfg.mask_token_id,
            "target_layer_ids": list(cfg.target_layer_ids),
            "block_size": cfg.block_size,
            **({"mask_token": cfg.mask_token} if cfg.mask_token is not None else {}),
            # written only when true: vLLM lets an explicit false override every layer, the sliding
            # layers' causal default too, so false would serve them bidirectionally
            **({"causal": True} if cfg.causal else {}),
        },
        "layer_types": list(cfg.layer_types),
        # transformers 4.x drops sliding_window unless use_sliding_window is true.
        "use_sliding_window": cfg.any_sliding,
    }
    if cfg.any_sliding:
        config["sliding_window"] = cfg.sliding_window
    if cfg.dspark is not None:
        # vLLM maps DSparkDraftModel with model_type qwen3 to its Qwen3DSparkModel and reads the
        # DSpark fields at the top level. sample_from_anchor stays out of dflash_config: vLLM's
        # DFlash runtime, which DSpark's extends, refuses dflash_config.sample_from_anchor = true.
        config["architectures"] = [DSPARK_ARCHITECTURE]
        config.update(cfg.dspark.export_fields())
    if cfg.dflash2 is not None:
        # vLLM maps DFlash2DraftModel to its DFlash2Qwen3ForCausalLM, which reads the convolution's,
        # the selector's and the scales' keys from dflash_config.
        config["architectures"] = [DFLASH2_ARCHITECTURE]
        fields = cfg.dflash2.export_fields()
        if cfg.lilicorr is not None:  # vLLM's LiLiCorr reads the convolution's geometry only
            fields = {name: fields[name] for name in ("conv_kernel_size", "conv_group_size")}
        config["dflash_config"].update(fields)
    if cfg.lilicorr is not None:
        # vLLM maps LiLiCorrDraftModel to its LiLiCorrForCausalLM (a DFlash backbone, DFlash2's
        # layers when conv_kernel_size is set), which reads the lilicorr_* keys of dflash_config.
        config["architectures"] = [LILICORR_ARCHITECTURE]
        config["dflash_config"].update(cfg.lilicorr.export_fields())
    return config


def drafter_config_from_export(config: Mapping[str, Any]) -> DrafterConfig:
    """Read an export config.json back (the inverse of export_config)."""
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "vocab_size", "num_target_layers", "dflash_config"):
        if config.get(key) is None:
            raise ConfigError(f"drafter config has no {key!r}; export the drafter again with export_drafter")
    dflash = config["dflash_config"]
    if not isinstance(dflash, Mapping):
        raise ConfigError(f"drafter config dflash_config is {type(dflash).__name__}, not an object; re-export it")
    for key in ("mask_token_id", "target_layer_ids"):
        if dflash.get(key) is None:
            raise ConfigError(f"drafter config dflash_config has no {key!r}; re-export the drafter")
    block_size = config.get("block_size", dflash.get("block_size"))
    if block_size is None:
        raise ConfigError("drafter config has no 'block_size'; re-export the drafter")
    # an edited 10**18 would reach the attention masks' allocation before any weight is compared
    if not is_int(block_size) or not 2 <= block_size <= MAX_BLOCK_SIZE:
        raise ConfigError(f"drafter config block_size {block_size!r} is not a whole number from 2 to {MAX_BLOCK_SIZE} "
                          "(16 is typical); the file is damaged or edited: export the drafter again")
    check_export_types(config, dflash)
    num_layers = int(config["num_hidden_layers"])
    layer_types = tuple(config.get("layer_types") or (FULL_ATTENTION,) * num_layers)
    sliding = SLIDING_ATTENTION in layer_types
    return DrafterConfig(
        **_layer_shape(config),
        mask_token_id=int(dflash["mask_token_id"]),
        target_layer_ids=tuple(int(i) for i in dflash["target_layer_ids"]),
        num_target_layers=int(config["num_target_layers"]),
        num_hidden_layers=num_layers,
        block_size=int(block_size),
        layer_types=layer_types,
        # A Qwen3 config may carry an unused window; it only matters when a layer slides.
        sliding_window=int(config["sliding_window"]) if sliding and config.get("sliding_window") else None,
        mask_token=dflash.get("mask_token"),
        causal=dflash.get("causal", False),
        dspark=DSparkConfig.from_export(config) if DSPARK_ARCHITECTURE in (config.get("architectures") or ()) else None,
        dflash2=_convolutions(config, dflash),
        lilicorr=LiLiCorrConfig.from_export(dflash) if LILICORR_ARCHITECTURE in (config.get("architectures") or ()) else None,
    )


def _convolutions(config: Mapping[str, Any], dflash: Mapping[str, Any]) -> DFlash2Config | None:
    """An export's DFlash2 settings: a DFlash2 drafter's, or a LiLiCorr + conv drafter's convolutions."""
    architectures = config.get("architectures") or ()
    if DFLASH2_ARCHITECTURE in architectures:
        return DFlash2Config.from_export(dflash)
    if LILICORR_ARCHITECTURE in architectures and dflash.get("conv_kernel_size"):
        return DFlash2Config(conv_kernel_size=dflash["conv_kernel_size"], conv_group_size=dflash["conv_group_size"])
    return None


def _layer_shape(config: Mapping[str, Any]) -> dict[str, Any]:
    """The decoder-layer shape a Qwen3-style HF config gives (the teacher's, or an export's)."""
    hidden_size, num_heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    return dict(
        hidden_size=hidden_size,
        num_attention_heads=num_heads,
        num_key_value_heads=int(config.get("num_key_value_heads") or num_heads),
        head_dim=int(config.get("head_dim") or hidden_size // num_heads),
        intermediate_size=int(config["intermediate_size"]),
        vocab_size=int(config["vocab_size"]),
        rms_norm_eps=float(config.get("rms_norm_eps") or 1e-6),
        rope_theta=rope_theta(config),
        max_position_embeddings=int(config.get("max_position_embeddings") or 40960),
    )


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language-model part of a config; multimodal wrappers (qwen3_5) nest it in text_config."""
    text = config.get("text_config")
    return text if isinstance(text, Mapping) else config


def rope_theta(config: Mapping[str, Any]) -> float:
    """Rotary base from the top level (transformers 4) or rope_parameters (transformers 5)."""
    if config.get("rope_theta") is not None:
        return float(config["rope_theta"])
    for key in ("rope_parameters", "rope_scaling"):
        params = config.get(key)
        if isinstance(params, Mapping) and params.get("rope_theta") is not None:
            return float(params["rope_theta"])
    # transformers' default base when a config names none.
    return 10000.0
