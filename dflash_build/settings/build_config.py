"""Everything `dflash-cache build` is given (dflash_build runs it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from dflash_cache.settings.storage_config import StorageConfig
from dflash_common.errors import ConfigError
from dflash_common.knobs import Knob, config_knobs
from dflash_corpus.settings.corpus_config import CorpusConfig
from dflash_teacher.settings.teacher_config import TeacherConfig
from dflash_teacher.settings.vllm_args import ENGINES, VllmArgs, parse_vllm_args, vllm_args_text


@dataclass(frozen=True)
class BuildConfig:
    """Everything `dflash-cache build` needs; saved in the manifest."""

    out: str
    """Cache URL: a local folder, file://, s3://bucket/path, gs://..."""

    corpus: CorpusConfig
    """What to read and how to tokenize it."""

    teacher: TeacherConfig
    """Which teacher to run, on which layers, with which k."""

    storage: StorageConfig = field(default_factory=StorageConfig)
    """Shard and chunk sizes, compression, hidden-state format (lossless or fp8)."""

    overwrite: bool = False
    """Delete an existing cache at `out` and build from scratch (otherwise a rerun resumes it); only
    a dflash cache, and only what a build wrote there: anything else stops it."""

    storage_options: dict[str, Any] | None = None
    """fsspec options for the cache URL (credentials, endpoint)."""

    rank: int = 0
    """This process's rank in a multi-process build: it takes corpus rows with index % world_size
    == rank and writes only its own shards (torchrun sets RANK and WORLD_SIZE)."""

    world_size: int = 1
    """Number of processes building the cache together."""

    engine: str = "transformers"
    """What runs the teacher forward: 'transformers' (here, in padded batches) or 'vllm' (vLLM's
    engine in its own environment, dflash_teacher.vllm_engine). Either writes the same cache: ids,
    masks and everything but the forward come from the same code, and a build may resume with
    the other engine when it sends one shard per generate (--vllm-args generate_tokens 1; the
    transformers engine always does)."""

    vllm: VllmArgs = field(default_factory=VllmArgs,
                           metadata={"name": "vllm_args", "parse": parse_vllm_args, "show": vllm_args_text})
    """With engine 'vllm': the engine's options as one JSON object, e.g. {"tensor_parallel_size": 2,
    "gpu_memory_utilization": 0.85}; keys tensor_parallel_size, data_parallel_size (only 1: one
    engine per process; run one build process per GPU under torchrun),
    gpu_memory_utilization (default: what the build's LM head and working set leave, at most 0.92), max_model_len (default max_length + 1), enable_prefix_caching (default
    off: the states are read from each request's own KV blocks), enforce_eager (default on: a build
    only prefills), max_num_batched_tokens, generate_tokens (default 65536: whole shards sent to the
    engine in one generate, recorded in the cache; 1: one shard per generate), and any other engine
    argument of vLLM's EngineArgs, passed through (checked against vLLM's own list when the engine
    starts), e.g. language_model_only for a vision-language teacher; refused: the ones the build sets
    (model, tokenizer, dtype, revision, trust_remote_code, seed, skip_tokenizer_init,
    speculative_config, kv_transfer_config, spec_*) and pipeline_parallel_size > 1."""

    vllm_python: str | None = None
    """With engine 'vllm': the python of an environment with vLLM; default: $DFLASH_VLLM_PYTHON, else
    .venv-vllm/bin/python. A path of this machine: not recorded in the manifest."""

    cross_check: int = 0
    """Recompute this many sampled sequences per rank with the transformers engine (one at a time,
    unpadded) and record the largest relative norm of each tapped layer's hidden states and the
    largest relative difference of the top-k log-probs in the manifest's `last_run`; 0: off. With
    --engine vllm it loads the transformers teacher as well: on a GPU node the teacher's memory a
    second time."""

    cross_check_bound: float = 0.05
    """The build stops when a cross-checked sequence differs by more than this: per tapped layer,
    the relative norm of its hidden states (||built - reference|| / ||reference|| at each position,
    averaged over the sequence: bf16 rounding is ~0.003, a tap off by one layer 0.1 or more); for
    the top-k log-probs, the largest difference relative to their largest magnitude."""

    def __post_init__(self):
        if not self.out:
            raise ConfigError("--out is empty; give the cache a folder or URL")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} is outside a world of {self.world_size} processes; set RANK in 0..WORLD_SIZE-1")
        if self.engine not in ENGINES:
            raise ConfigError(f"--engine {self.engine!r} is unknown; use {' or '.join(ENGINES)}")
        if self.engine == "vllm" and self.teacher.device_map:
            raise ConfigError("--device-map spreads a transformers teacher over GPUs; with --engine vllm pass "
                              "--vllm-args '{\"tensor_parallel_size\": N}' instead")
        if self.cross_check < 0:
            raise ConfigError(f"--cross-check {self.cross_check} is negative; give the number of sequences to recompute per rank (0: off)")
        if not self.cross_check_bound > 0:
            raise ConfigError(f"--cross-check-bound {self.cross_check_bound} must be positive; e.g. 0.05")
        if self.overwrite and self.world_size > 1:
            raise ConfigError("--overwrite cannot be used by several ranks at once (they would delete each other's work); delete the cache first, then launch the ranks")

    def to_dict(self) -> dict:
        out = asdict(self)
        out.pop("storage_options")  # may hold credentials
        out.pop("rank")  # the same cache whichever rank describes it
        out.pop("vllm_python")  # a path of the machine that built it
        return out


# Not options: torchrun (or the user launching ranks as jobs) sets them through RANK and WORLD_SIZE.
FROM_ENVIRONMENT = ("rank", "world_size")


def build_knobs() -> tuple[Knob, ...]:
    """The options of `dflash-cache build`: every field of BuildConfig and its sections."""
    return config_knobs(BuildConfig, exclude=FROM_ENVIRONMENT)
