"""Which implementation runs a hybrid teacher's Gated DeltaNet layers (qwen3_5, qwen3_next):
transformers runs a kernel package when it imports and its torch reference otherwise, many times
slower on a GPU. The build and decoding print the line `gated_deltanet_note` makes."""

from __future__ import annotations

import importlib.util
import inspect
import sys

import torch

# The functions of transformers' Gated DeltaNet (qwen3_5, qwen3_next) that run a kernel package
# when it imports and its torch reference otherwise: (function, distribution, import name).
GATED_DELTANET_KERNELS = (("torch_chunk_gated_delta_rule", "flash-linear-attention", "fla"),
                          ("causal_conv1d_fn", "causal-conv1d", "causal_conv1d"))


def gated_deltanet_kernels(model: torch.nn.Module) -> dict[str, bool] | None:
    """For a teacher with Gated DeltaNet layers, whether each kernel package runs (True) or the
    torch fallback does; None for a teacher without them."""
    if "linear_attention" not in (getattr(model.config.get_text_config(), "layer_types", None) or ()):
        return None
    module = sys.modules.get(type(model).__module__)
    kernels = {}
    for function, distribution, import_name in GATED_DELTANET_KERNELS:
        fast = _import_decision(getattr(module, function, None))
        if fast is None:  # another transformers: the same rule, does the package import
            fast = importlib.util.find_spec(import_name) is not None
        kernels[distribution] = bool(fast)
    return kernels


def _import_decision(wrapped: object) -> bool | None:
    """transformers decides once, at import, and keeps the decision (`is_new_implementation`) in the
    wrapper's closure; since 5.2x the wrapper sits inside a hub-kernel `nn.Module` whose forward
    closes over it. None where neither shape is found."""
    for _ in range(4):  # a few layers of wrapping at most
        if isinstance(wrapped, torch.nn.Module):
            wrapped = inspect.getclosurevars(type(wrapped).forward).nonlocals.get("func")
            continue
        if not inspect.isfunction(wrapped):
            return None
        nonlocals = inspect.getclosurevars(wrapped).nonlocals
        if "is_new_implementation" in nonlocals:
            return bool(nonlocals["is_new_implementation"])
        wrapped = nonlocals.get("func")
    return None


def gated_deltanet_note(model: torch.nn.Module, device: torch.device) -> str | None:
    """One line naming the Gated DeltaNet implementation that runs (a warning for the torch
    fallback on CUDA, where it is many times slower); None without such layers."""
    kernels = gated_deltanet_kernels(model)
    if kernels is None:
        return None
    missing = [name for name, fast in kernels.items() if not fast]
    if not missing:
        return f"teacher: Gated DeltaNet layers run the fast kernels ({', '.join(kernels)})"
    line = f"teacher: Gated DeltaNet layers run transformers' torch fallback ({', '.join(missing)} not installed)"
    if device.type == "cuda":
        return f"warning: {line}; on a GPU it is much slower than the kernels: pip install {' '.join(missing)}"
    return line
