"""The vLLM engine's share of a build's GPU: what the build itself holds there beside the engine.

The build puts the teacher's LM head on the engine's first GPU before vLLM starts, and after each
generate runs the final norm and the fp32 head there. vLLM takes `gpu_memory_utilization` x the
card's total memory (vllm/v1/worker/utils.py `request_memory`: it refuses to start when less is
free, and then fills it with weights, activations and KV cache), so the share must leave the head,
the build's working set and its CUDA context outside it. vLLM 0.32's own default, 0.92, does not:
on an 80 GB card it leaves 6.4 GB, and the build needs ~9 GB at the defaults for Qwen3.6-27B.
Torch-free and pure: sizes in, a share or one line out.
"""

from __future__ import annotations

from dflash_common.errors import ConfigError

GIB = 1 << 30
GB = 1e9
BUILD_RESERVE_BYTES = GIB
"""The build process's own CUDA context and its allocator's slack (~0.5 GB of context that torch
does not count, plus fragmentation between the norm's and the head's tensors)."""
ENGINE_SHARE_CAP = 0.92
"""The largest share the build gives vLLM unasked: vLLM 0.32's own default (vllm/config/cache.py
CacheConfig.gpu_memory_utilization), so a card with room to spare runs vLLM as vLLM would."""
FP32 = 4


def head_bytes(vocab: int, hidden: int, dtype_bytes: int) -> int:
    """The LM head's weight on the GPU (vocab x hidden in the teacher's dtype)."""
    return vocab * hidden * dtype_bytes


def tokens_per_generate(generate_tokens: int, shard_tokens: int, max_length: int) -> int:
    """The most tokens one generate carries: generate_tokens // shard_tokens whole shards (at
    least one), each ending with the sequence that brings it to shard_tokens, so each may exceed
    it by up to max_length - 1 tokens (dflash_build.shard_cut)."""
    shards = max(1, generate_tokens // shard_tokens)
    return shards * (shard_tokens + max_length - 1)


def build_working_bytes(tokens: int, hidden: int, vocab: int, logits_chunk: int, top_k: int,
                        state_bytes: int) -> int:
    """The build's peak beside the head while it takes one generate of `tokens` tokens
    (VllmTeacher._receive): first the final norm over the last layer's states (the states in the
    model dtype, and two fp32 tensors of them alive at once inside the RMSNorm), then the head
    over chunks of logits_chunk positions (the normed states, one fp32 logits chunk and its
    log_softmax, and the top-k ids and log-probs of every position, twice while torch.cat joins
    the chunks')."""
    states = tokens * hidden * state_bytes
    norm = states + 2 * tokens * hidden * FP32
    head = states + 2 * logits_chunk * vocab * FP32 + 2 * tokens * top_k * (8 + FP32)
    return max(norm, head)


def engine_gpu_share(card_bytes: int, head: int, working: int, engine_weights: int | None = None,
                     requested: float | None = None) -> float:
    """vLLM's gpu_memory_utilization on a card of `card_bytes`: `requested` when given and it
    fits, else the most that leaves the head, the build's working set and BUILD_RESERVE_BYTES
    outside vLLM (at most ENGINE_SHARE_CAP), rounded down to 0.001. One line when nothing fits:
    the build alone past the card, the engine's share below the teacher's `engine_weights` (bytes
    a GPU), or `requested` past the most."""
    outside = head + working + BUILD_RESERVE_BYTES
    most = int((card_bytes - outside) / card_bytes * 1000) / 1000
    needs = (f"the build holds {outside / GB:.1f} GB of the {card_bytes / GB:.1f} GB GPU beside vLLM (LM head "
             f"{head / GB:.2f} GB, norm and logits working set {working / GB:.2f} GB, CUDA context "
             f"{BUILD_RESERVE_BYTES / GB:.2f} GB)")
    if most <= 0:
        raise ConfigError(f"{needs}: nothing is left for vLLM; lower --vllm-args generate_tokens or --logits-chunk")
    if requested is not None and requested > most:
        raise ConfigError(f"--vllm-args gpu_memory_utilization={requested} leaves too little: {needs}; use at most "
                          f"{most}, or leave it out for the build to choose")
    share = min(ENGINE_SHARE_CAP, most) if requested is None else requested
    if engine_weights is not None and share * card_bytes <= engine_weights:
        raise ConfigError(f"vLLM's share {share} of the GPU ({share * card_bytes / GB:.1f} GB) cannot hold the "
                          f"teacher's weights ({engine_weights / GB:.1f} GB a GPU) once {needs}; raise --vllm-args "
                          "tensor_parallel_size, or pass language_model_only for a vision-language teacher")
    return share


def engine_weight_bytes(shapes: dict[str, tuple[int, ...]], dtype_bytes: int, tensor_parallel_size: int,
                        language_model_only: bool) -> int:
    """The teacher's weights one GPU of the engine holds, from the stored tensors' shapes by name:
    all but the multi-token-prediction head (mtp.*, which vLLM's main model does not load) and,
    with language_model_only, the vision tower (*visual.*), split over tensor_parallel_size."""
    def loaded(name: str) -> bool:
        return not name.startswith("mtp.") and not (language_model_only and "visual." in name)

    total = 0
    for name, shape in shapes.items():
        if loaded(name):
            count = 1
            for size in shape:
                count *= size
            total += count * dtype_bytes
    return total // tensor_parallel_size
