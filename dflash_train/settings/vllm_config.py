"""How vLLM runs a measurement of a drafter (the vllm section of eval)."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_common.errors import ConfigError


@dataclass(frozen=True)
class VllmConfig:
    """How to run vLLM for a measurement."""

    python: str | None = None
    """Python of an environment with vLLM; default: $DFLASH_VLLM_PYTHON, else .venv-vllm/bin/python."""
    dtype: str = "float32"
    """Teacher compute dtype in vLLM (the drafter runs in the same); float32 makes greedy exact on CPU."""
    kv_cache_gib: int = 1
    """KV cache memory in GiB of vLLM's CPU backend (VLLM_CPU_KVCACHE_SPACE, whole GiB); GPU builds size it themselves."""
    timeout_s: float = 3600.0
    """Longest the worker may run before it is stopped."""
    log: str | None = None
    """File for the worker's output (vLLM logs a lot); default: a temporary file, kept on failure."""
    cuda_visible_devices: str | None = None
    """The vLLM process's CUDA_VISIBLE_DEVICES; None: the GPUs this process sees. eval sets its
    --device's GPU, so vLLM runs where the memory share was measured."""
    gpu_memory_utilization: float | None = None
    """Share of the GPU vLLM may take (its LLM(...) option); None: vLLM's default, 0.9. eval sets it
    from the memory actually free when vLLM starts (vllm_memory_share), since this process keeps
    its CUDA context on the same GPU."""

    def __post_init__(self) -> None:
        if self.dtype not in ("float32", "bfloat16", "float16"):
            raise ConfigError(f"vLLM dtype {self.dtype!r} is not supported here; use float32, bfloat16 or float16")
        g = self.gpu_memory_utilization
        if g is not None and not (isinstance(g, float) and 0 < g <= 1):
            raise ConfigError(f"vLLM gpu_memory_utilization={g!r} must be a share in (0, 1], e.g. 0.85")
        if isinstance(self.kv_cache_gib, bool) or not isinstance(self.kv_cache_gib, int) or self.kv_cache_gib < 1 \
                or not self.timeout_s > 0:
            raise ConfigError(f"kv_cache_gib={self.kv_cache_gib!r} must be a whole number >= 1 and "
                               f"timeout_s={self.timeout_s!r} > 0")
