"""The types and sizes of an export's config.json, checked before anything is built from it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dflash_common.errors import ConfigError
from dflash_common.values import is_int, is_real

MAX_EXPORT_INT = 1 << 24
"""Largest size an export's config.json may give (vocabularies and widths are far below it)."""
MAX_EXPORT_LAYERS = 1024
"""Most drafter or teacher layers (and tapped layer ids) an export's config.json may list."""


def check_export_types(config: Mapping[str, Any], dflash: Mapping[str, Any]) -> None:
    """Refuse an export config.json whose values have the wrong type or an absurd size before
    anything is built from them (an edited num_hidden_layers of 10**9 would build a tuple of
    gigabytes, "abc" a traceback): one line naming the key, the value and the fix."""
    def refuse(key: str, value: Any, wanted: str) -> None:
        shown = repr(value) if len(repr(value)) <= 80 else repr(value)[:77] + "..."
        raise ConfigError(f"drafter config {key} {shown} is not {wanted}; the file is damaged or edited: export the "
                          "drafter again")

    def whole(key: str, value: Any, top: int, optional: bool = False) -> None:
        if optional and value is None:
            return
        if not is_int(value) or not 0 <= value <= top:
            refuse(key, value, f"a whole number from 0 to {top:,}")

    for key in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
        whole(key, config.get(key), MAX_EXPORT_INT)
    for key in ("num_key_value_heads", "head_dim", "max_position_embeddings", "sliding_window"):
        whole(key, config.get(key), MAX_EXPORT_INT if key != "max_position_embeddings" else 1 << 40, optional=True)
    for key in ("num_hidden_layers", "num_target_layers"):
        whole(key, config.get(key), MAX_EXPORT_LAYERS)
    whole("dflash_config.mask_token_id", dflash.get("mask_token_id"), MAX_EXPORT_INT)
    if not isinstance(dflash.get("causal", False), bool):
        refuse("dflash_config.causal", dflash["causal"], "true or false")
    ids = dflash.get("target_layer_ids")
    if not isinstance(ids, (list, tuple)) or len(ids) > MAX_EXPORT_LAYERS or not all(is_int(i) for i in ids):
        refuse("dflash_config.target_layer_ids", ids, f"a list of at most {MAX_EXPORT_LAYERS} layer ids")
    types = config.get("layer_types")
    if types is not None and (not isinstance(types, (list, tuple)) or len(types) > MAX_EXPORT_LAYERS
                              or not all(isinstance(t, str) for t in types)):
        refuse("layer_types", types, "a list of layer type names")
    for key, value in (("rope_theta", config.get("rope_theta")), ("rms_norm_eps", config.get("rms_norm_eps"))):
        if value is not None and not is_real(value, finite=True):
            refuse(key, value, "a finite number")
    for key in ("rope_parameters", "rope_scaling"):
        params = config.get(key)
        if isinstance(params, Mapping) and params.get("rope_theta") is not None \
                and not is_real(params["rope_theta"], finite=True):
            refuse(f"{key}.rope_theta", params["rope_theta"], "a finite number")
