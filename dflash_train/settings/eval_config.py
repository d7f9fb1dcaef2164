"""The settings of measuring a drafter: `dflash-train eval` (EvalConfig) and `generate`
(GenerateConfig), and the decoding settings both share (DecodingConfig), declared once here.
Their command-line options come from these fields (``eval_knobs``, ``generate_knobs``);
dflash_train.measuring.commands carries them out."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dflash_common.errors import ConfigError
from dflash_common.template_kwargs import check_template_kwargs
from dflash_common.values import check_choice, text_problem
from dflash_teacher.settings.teacher_config import TEACHER_DTYPES
from dflash_train.settings.data_config import DataConfig
from dflash_train.settings.spec_config import SpecConfig

ENGINES = ("dflash", "vllm", "both")
SPEC_OPTIONS = ("max_new_tokens", "top_p", "confidence_threshold")
"""SpecConfig's fields that the commands take; its temperature comes as DecodingConfig.temperatures,
its stop tokens from the teacher."""
DATA_OPTIONS = ("batch_tokens", "anchors", "num_anchors", "block_tokens", "heldout_fraction", "skip_shards")
"""DataConfig's fields that an offline evaluation takes."""


def prompt_paths(value) -> tuple[str, ...]:
    """Prompt files as a tuple: one path (str) or several; None or empty is none."""
    if value is None:
        return ()
    paths = (value,) if isinstance(value, str) else tuple(value)
    if not all(isinstance(p, str) and p for p in paths):
        raise ConfigError(f"--prompts takes file paths, got {paths!r}; e.g. --prompts a.jsonl --prompts b.jsonl")
    return paths


@dataclass(frozen=True)
class DecodingConfig:
    """A drafter decoding with its teacher: what eval's real mode and generate share."""

    checkpoint: str
    """A step-NNNNNN checkpoint folder or an exported drafter folder."""

    teacher: str | None = None
    """The teacher (folder or hub name) to decode with (eval: real mode, with --prompts)."""

    temperatures: tuple[float, ...] = field(default=(0.0,), metadata={"name": "temperature", "repeat": True})
    """0 = greedy (output must equal the teacher's); > 0 = speculative sampling; repeat to decode at
    several, e.g. --temperature 0 --temperature 1."""

    spec: SpecConfig = field(default_factory=SpecConfig)
    """Length, nucleus mass and confidence threshold of each decoding (its temperature is set per
    entry of temperatures, its stop tokens by the teacher)."""

    teacher_dtype: str = "auto"
    """Teacher dtype; auto = bfloat16 on CUDA, float32 on CPU."""

    device: str = "auto"
    """auto, cpu, cuda or cuda:N."""

    trust_remote_code: bool = False
    """Run modeling/tokenizer code shipped in the teacher's folder (only for code you trust)."""

    chat_template_kwargs: dict[str, Any] | None = None
    """Chat-template variables as JSON, e.g. '{"enable_thinking": false}' (default: what the
    drafter's cache was built with)."""

    allow_template_mismatch: bool = False
    """Render prompts with --chat-template-kwargs even when the cache was built with others."""

    def __post_init__(self):
        if not self.temperatures:
            raise ConfigError("give at least one --temperature (0 = greedy)")
        object.__setattr__(self, "temperatures", tuple(self.temperatures))
        self.specs()  # each temperature is checked as the decoder will take it
        if self.teacher_dtype not in ("auto", *TEACHER_DTYPES):
            raise ConfigError(f"--teacher-dtype {self.teacher_dtype!r} is unknown; use auto, {', '.join(TEACHER_DTYPES)}")
        check_template_kwargs(self.chat_template_kwargs)

    def specs(self, stop_token_ids: tuple[int, ...] = ()) -> list[SpecConfig]:
        """One decoder setting per temperature, ending at the teacher's stop tokens."""
        return [dataclasses.replace(self.spec, temperature=t, stop_token_ids=stop_token_ids) for t in self.temperatures]

    def dtype(self, device_type: str) -> str:
        """The teacher's dtype on a device of this type ("cuda", "cpu")."""
        if self.teacher_dtype != "auto":
            return self.teacher_dtype
        return "bfloat16" if device_type == "cuda" else "float32"


@dataclass(frozen=True)
class EvalConfig:
    """`dflash-train eval`: offline acceptance on a cache's held-out split and/or real decoding."""

    decoding: DecodingConfig
    """The drafter, its teacher and how real mode decodes."""

    cache: str | None = None
    """Offline mode: a cache URL; evaluates on its held-out split."""

    prompts: tuple[str, ...] = field(default=(), metadata={"repeat": True})
    """Real mode: prompt files, repeat for several: our chat JSONL ('messages' or 'prompt'), MT-Bench's
    question.jsonl and SPEED-Bench (first turn; 'category' per row), HumanEval, GSM8K (.jsonl, .jsonl.gz,
    .parquet). Each prompt's category is its row's 'category', else its file's name."""

    split: str = "heldout"
    """Offline mode: only 'heldout' (the split training never sees)."""

    data: DataConfig = field(default_factory=DataConfig)
    """Offline mode: the batches, anchors, held-out fraction and skipped shards."""

    max_sequences: int = 512
    """Offline mode: held-out sequences to evaluate."""

    max_prompts: int | None = None
    """Real mode: use the first N prompts of each file."""

    engine: str = "dflash"
    """Real mode: dflash (the built-in decoder), vllm (vLLM's engine and DFlash proposer, greedy)
    or both side by side."""

    vllm_python: str | None = None
    """Python of an environment with vLLM (default: $DFLASH_VLLM_PYTHON, else .venv-vllm/bin/python
    from `make serving`)."""

    out: str | None = None
    """JSON report (default: eval.json next to the checkpoint); a PNG goes beside it."""

    storage_options: dict[str, Any] | None = None
    """fsspec storage options as JSON."""

    @property
    def real(self) -> bool:
        """Whether real decoding runs (a teacher and prompts are given)."""
        return bool(self.decoding.teacher and self.prompts)

    def __post_init__(self):
        object.__setattr__(self, "prompts", prompt_paths(self.prompts))
        threshold = self.decoding.spec.confidence_threshold
        if not self.cache and not self.real:
            raise ConfigError("give --cache (offline) and/or --teacher with --prompts (real decoding)")
        if threshold and (not self.real or self.engine == "vllm"):
            raise ConfigError(f"--confidence-threshold {threshold:g} is a field of the built-in decoder; give --teacher "
                              "and --prompts with --engine dflash or both, or drop it")
        if self.split != "heldout":
            raise ConfigError(f"--split {self.split!r} is not supported; use heldout")
        if self.max_sequences < 1 or (self.max_prompts is not None and self.max_prompts < 1):
            raise ConfigError(f"--max-sequences {self.max_sequences} and --max-prompts {self.max_prompts} must be at "
                              "least 1 (leave --max-prompts unset for every prompt)")
        check_choice("--engine", self.engine, ENGINES)
        if self.real and self.engine != "dflash" and 0 not in self.decoding.temperatures:
            raise ConfigError(f"--engine {self.engine} measures greedy decoding; add --temperature 0 (got "
                              f"{', '.join(f'{x:g}' for x in self.decoding.temperatures)})")


@dataclass(frozen=True)
class GenerateConfig:
    """`dflash-train generate`: one answer per temperature to one user message."""

    decoding: DecodingConfig
    """The drafter, its teacher and how to decode."""

    prompt: str
    """The user message."""

    def __post_init__(self):
        if not self.decoding.teacher:
            raise ConfigError("generate decodes with the drafter's teacher; give --teacher (a folder or hub name)")
        # a command line's bytes that are not UTF-8 arrive as lone surrogates (surrogateescape), which
        # no tokenizer can take: the tokenizer raised it as a traceback
        problem = text_problem(self.prompt)
        if problem:
            raise ConfigError(f"--prompt {problem} (bytes that are not UTF-8 on the command line arrive so); "
                              "pass the prompt as UTF-8 text")
