"""A DrafterConfig and Hugging Face config dicts: derived from the teacher's config, written as the
export's config.json (what the reference DFlash code, vLLM and SGLang read), and read back."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from dflash_common.errors import ConfigError
from dflash_train.dspark import ARCHITECTURE as DSPARK_ARCHITECTURE
from dflash_train.dspark import DSparkConfig
from dflash_train.model import FULL_ATTENTION, SLIDING_ATTENTION, DrafterConfig

DFLASH_ARCHITECTURE = "DFlashDraftModel"
EXPORT_ARCHITECTURES = (DFLASH_ARCHITECTURE, DSPARK_ARCHITECTURE)
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
        dspark=DSparkConfig.from_export(config) if DSPARK_ARCHITECTURE in (config.get("architectures") or ()) else None,
    )


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
