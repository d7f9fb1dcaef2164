"""Which teacher a build runs and how (dflash_teacher.teacher runs it)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_common.errors import ConfigError

TEACHER_DTYPES = ("bfloat16", "float32")
"""Compute and storage dtypes of the hidden states (dflash_teacher.teacher maps them to torch's)."""


@dataclass(frozen=True)
class TeacherConfig:
    """Which teacher to run and how."""

    name_or_path: str = field(metadata={"name": "teacher"})
    """A local folder or a Hugging Face hub name of a transformers causal LM (tested: Qwen3, hybrid
    Qwen3.5 `qwen3_5`, Llama)."""

    revision: str | None = None
    """Hub revision (branch, tag or commit) when name_or_path is a hub name."""

    dtype: str = "bfloat16"
    """Compute and storage dtype of the hidden states: 'bfloat16' or 'float32'."""

    device: str = "auto"
    """'auto' (CUDA when present, else CPU), 'cpu', 'cuda' or 'cuda:N'."""

    device_map: str | None = None
    """transformers device_map ("auto", "balanced", ...) to spread a teacher too large for one GPU
    over the GPUs of a node; use one process per node then. Overrides device."""

    layers: tuple[int, ...] | None = None
    """0-based decoder layers to tap, e.g. 1,16,31,46,61 for a 64-layer teacher; never the last one
    (vLLM and SGLang cannot serve it). None spreads num_tapped_layers of them as round(1 + i (L-4)/(n-1)),
    never layer 0 or the last."""

    num_tapped_layers: int = field(default=5, metadata={"name": "tapped_layers", "aliases": ("drafter_layers",)})
    """How many teacher layers the default layer choice taps (the drafter's context inputs; not
    the drafter's own layer count)."""

    top_k: int = 64
    """How many of the teacher's most likely next tokens to keep per position."""

    batch_tokens: int = 8192
    """Padded tokens per teacher forward (batch size x longest sequence in the batch)."""

    logits_chunk: int = 2048
    """Positions per LM-head chunk: bounds the fp32 logits to logits_chunk x vocab."""

    trust_remote_code: bool = False
    """Run modeling or tokenizer code that the teacher's folder ships (transformers' auto_map).
    Off unless the user asks (--trust-remote-code); never taken from a cache's manifest."""

    def __post_init__(self):
        if self.dtype not in TEACHER_DTYPES:
            raise ConfigError(f"unknown dtype {self.dtype!r}; use bfloat16 or float32")
        if self.top_k < 1:
            raise ConfigError(f"--top-k must be at least 1, got {self.top_k}")
        if self.batch_tokens < 1 or self.logits_chunk < 1:
            raise ConfigError(f"batch tokens and logits chunk must be positive, got {self.batch_tokens}, {self.logits_chunk}")
        if self.layers is not None and (not self.layers or min(self.layers) < 0):
            raise ConfigError(f"--layers must list 0-based decoder layer ids, got {self.layers}")
        if self.num_tapped_layers < 1:
            raise ConfigError(f"--tapped-layers must be at least 1, got {self.num_tapped_layers}")
