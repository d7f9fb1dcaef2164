"""Which engine runs the teacher in a build, and the options of the vLLM one. Torch-free, so the
configs can be read and checked without the engines installed."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields

from dflash_common.errors import ConfigError
from dflash_common.values import is_int, is_real, json_object

REFUSED_ENGINE_ARGS = {
    "model": "the build runs the teacher it was given; pass --teacher",
    "tokenizer": "the build tokenizes with the teacher's tokenizer and sends token ids; pass --teacher",
    "skip_tokenizer_init": "the build sends token ids and reads states, so vLLM loads no tokenizer (set by the build)",
    "dtype": "the engine runs in the build's dtype, which the cache records; pass --dtype",
    "revision": "the engine reads the teacher's revision the build hashes; pass --revision",
    "trust_remote_code": "the engine trusts the teacher's code as the build does; pass --trust-remote-code",
    "seed": "set by the build (0); one greedy token per sequence makes it irrelevant to the states",
    "speculative_config": "the build sets it: hidden-state capture is vLLM's extract_hidden_states speculative method",
    "spec_method": "the build sets speculative_config to vLLM's extract_hidden_states method, which captures the states",
    "spec_model": "the build sets speculative_config to vLLM's extract_hidden_states method, which captures the states",
    "spec_tokens": "the build sets speculative_config to vLLM's extract_hidden_states method, which captures the states",
    "kv_transfer_config": "the build sets it: its connector (dflash_hs_connector) is what sends the captured states",
}
"""Engine arguments a build refuses, with why: the build sets them from its own options, or
hidden-state capture rests on them (extract_worker._engine). Every other key of vLLM's EngineArgs
is passed through; vLLM's own list is checked by extract_worker.py in vLLM's environment."""

ENGINES = ("transformers", "vllm")
"""transformers: the teacher runs in this process, in padded batches. vllm: vLLM's engine runs
it in its own environment and hands back the tapped layers (dflash_teacher.vllm_engine)."""


@dataclass(frozen=True)
class VllmArgs:
    """Options of the vLLM engine of `dflash-cache build --engine vllm` (--vllm-args JSON)."""

    tensor_parallel_size: int = 1
    """GPUs one engine splits the teacher over (vLLM's tensor parallelism); for a teacher larger
    than one GPU."""

    data_parallel_size: int = 1
    """Only 1: vLLM's LLM(...) runs one engine per process. For one engine per GPU (or per
    tensor_parallel_size GPUs), run one build process per engine under torchrun; each rank's engine
    takes its LOCAL_RANK GPU."""

    gpu_memory_utilization: float | None = None
    """Share of each GPU vLLM may take (weights, KV cache). The build holds its LM head (2.5 GB at
    248k x 5120 in bf16), the final norm's and fp32 logits' working set of a generate and its CUDA
    context on the engine's first GPU beside vLLM (dflash_teacher.engine_memory); None: the most that
    leaves them room, at most vLLM's default 0.92 (0.884 on an 80 GB card for Qwen3.6-27B); a
    larger share is refused in one line naming the most."""

    max_model_len: int | None = None
    """Longest sequence the engine accepts; None: --max-length + 1 (the one token it generates),
    at most the teacher's max_position_embeddings."""

    enable_prefix_caching: bool = False
    """Reuse KV blocks across sequences that share a prefix. Off: the states are read back from the
    finished request's own blocks, and a shared prefix block holds what an earlier sequence wrote;
    a build then depends on which sequences ran before (and resumes differently), for a small
    saving on a corpus of distinct conversations."""

    enforce_eager: bool = True
    """Run without CUDA graphs: the build only prefills, and graphs serve decode steps; skipping
    their capture saves minutes of start-up."""

    max_num_batched_tokens: int | None = None
    """Tokens per engine step (chunked prefill splits longer prompts); None: vLLM's default."""

    generate_tokens: int = 65536
    """Tokens of the corpus sent to the engine in one generate: whole shards, as many as fit (at
    least one); the build's states of a sequence may depend on the others in its engine steps, so
    the grouping is a rule of token counts alone and is recorded in the cache (a resume uses the
    same). Several engine steps' worth (16,384 tokens a step on an H200) keep the engine's steps
    full; a shard per generate (1) leaves part of each step empty."""

    passed_through: dict = field(default_factory=dict)
    """Any other engine argument of vLLM's EngineArgs (e.g. language_model_only: skip a
    vision-language teacher's vision tower), given at the top level of --vllm-args and passed to
    LLM(...) as given; checked against vLLM's own EngineArgs fields when the engine starts."""

    def __post_init__(self):
        if not isinstance(self.passed_through, dict):
            raise ConfigError(f"--vllm-args passed_through={self.passed_through!r} must be an object of vLLM engine "
                              "arguments; give them at the top level of --vllm-args instead")
        for key in self.passed_through:
            refuse_engine_arg(key)
        pipeline = self.passed_through.get("pipeline_parallel_size", 1)
        if pipeline != 1:
            # the connector sends from tensor-parallel rank 0 of the one stage that holds every layer
            raise ConfigError(f"--vllm-args pipeline_parallel_size={pipeline!r}: the hidden-state connector sends "
                              "from one pipeline stage holding every layer; split the teacher with "
                              "tensor_parallel_size instead")
        if not is_int(self.generate_tokens) or self.generate_tokens < 1:
            raise ConfigError(f"--vllm-args generate_tokens={self.generate_tokens!r} must be a whole number >= 1, "
                              "e.g. 65536")
        for name in ("tensor_parallel_size", "data_parallel_size"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise ConfigError(f"--vllm-args {name}={value!r} must be a whole number >= 1, e.g. 1")
        if self.data_parallel_size != 1:
            raise ConfigError(f"--vllm-args data_parallel_size={self.data_parallel_size}: vLLM runs one engine per process "
                              "(LLM(...) refuses data parallelism); run one build process per GPU instead: torchrun "
                              f"--nproc-per-node {self.data_parallel_size} --no-python dflash-cache build --engine vllm ... "
                              "(each rank's engine takes its LOCAL_RANK GPU)")
        for name in ("max_model_len", "max_num_batched_tokens"):
            value = getattr(self, name)
            if value is not None and (not is_int(value) or value < 2):
                raise ConfigError(f"--vllm-args {name}={value!r} must be a whole number >= 2 or null, e.g. 8192")
        g = self.gpu_memory_utilization
        if g is not None and not (is_real(g, finite=True) and 0 < g <= 1):
            raise ConfigError(f"--vllm-args gpu_memory_utilization={g!r} must be a share in (0, 1], e.g. 0.85")
        for name in ("enable_prefix_caching", "enforce_eager"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"--vllm-args {name}={getattr(self, name)!r} must be true or false")

    def engine_args(self, max_length: int, max_positions: int | None = None) -> dict:
        """Keyword arguments of vLLM's LLM(...) for a build of sequences up to max_length tokens of
        a teacher with max_positions positions (vLLM refuses a longer max_model_len)."""
        default = max_length + 1 if max_positions is None else min(max_length + 1, max_positions)
        args = {"tensor_parallel_size": self.tensor_parallel_size,
                "max_model_len": self.max_model_len or default,
                "enable_prefix_caching": self.enable_prefix_caching, "enforce_eager": self.enforce_eager}
        if self.gpu_memory_utilization is not None:
            args["gpu_memory_utilization"] = self.gpu_memory_utilization
        if self.max_num_batched_tokens is not None:
            args["max_num_batched_tokens"] = self.max_num_batched_tokens
        return {**args, **self.passed_through}


def refuse_engine_arg(key: str) -> None:
    """One line when a build cannot take engine argument `key` (REFUSED_ENGINE_ARGS, or one of
    VllmArgs' own fields given inside passed_through)."""
    if key in REFUSED_ENGINE_ARGS:
        raise ConfigError(f"--vllm-args key {key!r} is refused: {REFUSED_ENGINE_ARGS[key]}")
    if key in _OWN_KEYS:
        raise ConfigError(f"--vllm-args key {key!r} is the build's own option; give it at the top level of --vllm-args")


_OWN_KEYS = frozenset(f.name for f in fields(VllmArgs)) - {"passed_through"}


def parse_vllm_args(text: str | None) -> VllmArgs:
    """--vllm-args JSON -> VllmArgs: the build's own keys (VllmArgs' fields), and any other
    engine argument into passed_through unless REFUSED_ENGINE_ARGS names it. Whether vLLM knows a
    passed key (a typo would otherwise be ignored or fail deep in vLLM) is checked against vLLM's
    own EngineArgs in its environment, when the engine starts (extract_worker.py): this module
    imports no vLLM."""
    try:
        given = json_object(text, "--vllm-args") or {}
    except ConfigError as err:  # its example is another option's
        raise ConfigError(str(err).split("; pass")[0] + "; pass an object, e.g. --vllm-args "
                          "'{\"tensor_parallel_size\": 2, \"gpu_memory_utilization\": 0.85}'") from None
    if "passed_through" in given:
        raise ConfigError("--vllm-args key 'passed_through' is not an engine argument; give vLLM's engine arguments "
                          "at the top level, e.g. --vllm-args '{\"language_model_only\": true}'")
    for key in sorted(set(given) - _OWN_KEYS):
        refuse_engine_arg(key)
    return VllmArgs(**{k: v for k, v in given.items() if k in _OWN_KEYS},
                    passed_through={k: v for k, v in given.items() if k not in _OWN_KEYS})


def vllm_args_text(args: VllmArgs) -> str:
    """VllmArgs as --vllm-args would give them: the keys that differ from the defaults ("-" for none)."""
    default = VllmArgs()
    changed = {k: v for k, v in asdict(args).items() if k != "passed_through" and v != getattr(default, k)}
    changed.update(args.passed_through)  # at the top level, as given: the text parses back to the same args
    return json.dumps(changed) if changed else "-"
