"""The train config: one small dataclass per component, composed, saved next to every output."""

from __future__ import annotations

import dataclasses
import json
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_common.errors import ConfigError
from dflash_common.settings_files import load_settings_file
from dflash_common.values import check_choice
from dflash_train.settings.data import OPERATIONAL_FIELDS as DATA_OPERATIONAL
from dflash_train.settings.data import DataConfig
from dflash_train.settings.dflash2 import DFlash2Config
from dflash_train.settings.drafter import ATTENTION_CHOICES, MAX_BLOCK_SIZE
from dflash_train.settings.dspark import DRAFTER_KINDS, DSparkConfig
from dflash_train.settings.loss import OPERATIONAL_FIELDS as LOSS_OPERATIONAL
from dflash_train.settings.loss import LossConfig
from dflash_train.settings.noise import NoiseConfig


@dataclass(frozen=True)
class ModelConfig:
    """Drafter shape; unset fields are derived from the teacher config saved in the cache."""

    kind: str = field(default="dflash", metadata={"name": "model_kind"})
    """Drafter kind: "dflash" (the block-parallel drafter), "dspark" (DFlash's backbone plus
    a Markov logit-bias head and a confidence head, set up by the dspark section) or "dflash2"
    (DFlash with grouped dynamic convolutions in each layer and a candidate selector over the
    top-k, set up by the dflash2 section)."""

    num_layers: int = 5
    """Drafter decoder layers."""

    block_size: int = 16
    """Tokens per block: the anchor plus block_size - 1 predicted positions."""

    mask_token_id: int | None = None
    """Token id of MASK; default: the tokenizer's <|MASK|>, else the first spare embedding row."""

    sliding_window: int | None = None
    """Window of the sliding-attention layers (None: no sliding layers)."""

    sliding_layers: tuple[int, ...] = ()
    """Drafter layers that use the sliding window."""

    num_attention_heads: int | None = None
    """Query heads (default: the teacher's)."""

    num_key_value_heads: int | None = None
    """Key/value heads (default: the teacher's)."""

    head_dim: int | None = None
    """Per-head width (default: the teacher's)."""

    intermediate_size: int | None = None
    """MLP width (default: the teacher's)."""

    attention_backend: str = "auto"
    """Attention kernel of training: "sdpa" (dense boolean mask), "flex" (flex_attention with a
    block mask; CUDA only for training) or "auto" (flex on CUDA, sdpa elsewhere). Both compute the
    same attention; export and serving do not depend on it."""

    def __post_init__(self):
        check_choice("model.kind", self.kind, DRAFTER_KINDS)
        if self.num_layers < 1:
            raise ConfigError(f"--num-layers must be at least 1, got {self.num_layers}")
        if self.block_size < 2:
            raise ConfigError(f"--block-size must be at least 2, got {self.block_size}")
        if self.block_size > MAX_BLOCK_SIZE:  # the attention mask grows with it: 100,000 asked for 640 GB
            raise ConfigError(f"--block-size {self.block_size} is larger than {MAX_BLOCK_SIZE}; a block is one draft "
                              "step (16 is typical), pass a smaller one")
        check_choice("model.attention_backend", self.attention_backend, ATTENTION_CHOICES)

    def overrides(self) -> dict:
        names = ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


STRATEGIES = ("ddp", "fsdp")
"""Data parallelism under torchrun (dflash_train.training.distributed carries them out)."""

REDUCE_DTYPES = ("fp32", "bf16")
"""Dtypes of the gradients' reduction across ranks (distributed.REDUCE_DTYPES maps them to torch's)."""

# How a run computes, not what it learns: a resumed run may change these.
MODEL_OPERATIONAL = ("attention_backend",)


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup and cosine decay."""

    lr: float = 6e-4
    """Peak learning rate."""

    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""

    warmup_steps: int | None = None
    """Linear warmup steps (default: 4% of the run)."""

    weight_decay: float = 0.0
    """AdamW weight decay."""

    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""

    grad_clip: float = 1.0
    """Max global gradient norm (0 disables clipping)."""

    grad_accum: int = 1
    """Batches accumulated per optimizer step."""

    def __post_init__(self):
        if self.lr <= 0:
            raise ConfigError(f"--lr must be positive, got {self.lr}")
        if self.grad_accum < 1:
            raise ConfigError(f"--grad-accum must be at least 1, got {self.grad_accum}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise ConfigError(f"--warmup-steps must be 0 or more (or unset for 4% of the run), got {self.warmup_steps}")
        if not self.grad_clip >= 0:
            raise ConfigError(f"--grad-clip must be 0 (off) or a positive norm, got {self.grad_clip}")
        if not all(0 <= beta < 1 for beta in self.betas):  # torch's AdamW raised it as a traceback at the first step
            raise ConfigError(f"--betas {','.join(f'{b:g}' for b in self.betas)} must each be in [0, 1), e.g. 0.9,0.95")
        if not self.weight_decay >= 0:
            raise ConfigError(f"--weight-decay must be 0 or more, got {self.weight_decay}")


@dataclass(frozen=True)
class TrainConfig:
    """Everything `dflash-train run` needs; saved as config.json in the run folder and checkpoints."""

    cache: str
    """Cache URL (from `dflash-cache build`)."""

    out: str
    """Run folder: checkpoints, metrics, the exported drafter."""

    steps: int | None = None
    """Optimizer steps to train (exclusive with epochs; default 1000)."""

    epochs: float | None = None
    """Passes over the training split, instead of steps."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The drafter's shape and attention kernel."""

    loss: LossConfig = field(default_factory=LossConfig)
    """The per-position loss and the position weights."""

    dspark: DSparkConfig = field(default_factory=DSparkConfig)
    """DSpark's heads and layout, used when model.kind is "dspark"."""

    dflash2: DFlash2Config = field(default_factory=DFlash2Config)
    """DFlash2's convolutions and candidate selector, used when model.kind is "dflash2"."""

    noise: NoiseConfig = field(default_factory=NoiseConfig)
    """Noise added to the tapped hidden states on load."""

    data: DataConfig = field(default_factory=DataConfig)
    """Splitting, ordering, batching and anchor sampling of the cache's sequences."""

    optim: OptimConfig = field(default_factory=OptimConfig)
    """AdamW with warmup and cosine decay."""

    log_every: int = 10
    """Steps between metric lines."""

    save_every: int = 500
    """Steps between checkpoints (and one at the end)."""

    keep_checkpoints: int = 3
    """How many of the newest checkpoints to keep."""

    eval_sequences: int = 256
    """Held-out sequences evaluated before and after training (0 skips evaluation)."""

    device: str = "auto"
    """"auto" (CUDA when present), "cpu", "cuda" or "cuda:N": bf16 autocast on CUDA, fp32 on CPU; "auto" and
    "cuda" take GPU LOCAL_RANK under torchrun."""

    strategy: str = "ddp"
    """Data parallelism under torchrun: 'ddp' (every rank holds the whole drafter and optimizer)
    or 'fsdp' (FSDP2: parameters, gradients and optimizer state sharded across ranks). One
    process trains unwrapped either way; checkpoints are the same for both."""

    grad_reduce_dtype: str = "fp32"
    """Dtype the gradients cross ranks in under torchrun: "fp32" (exact; a 2-process run equals
    one process) or "bf16" (half the bytes: DDP's bf16 compression hook, FSDP2's reduce_dtype;
    each rank's gradient is rounded to bf16 before the sum). One reduction per optimizer step
    either way: gradient accumulation reduces only at its last batch."""

    seed: int = 0
    """Seed of the drafter's initial weights."""

    init_from: str | None = None
    """Start from these drafter weights instead of random ones: a checkpoint folder
    (checkpoints/step-NNNNNN) or an exported drafter folder of an earlier run, whose drafter must
    have this run's shape. Only the weights carry over: loss, weighting, schedule, steps and the
    optimizer's state are this run's own (a fine-tuning phase; --resume-from continues a run
    instead)."""

    tensorboard: bool = False
    """Also write TensorBoard event files (needs the tensorboard package)."""

    storage_options: dict[str, Any] | None = None
    """fsspec options for the cache URL (credentials, endpoint_url), as a JSON object on the command line;
    never saved with the run."""

    def __post_init__(self):
        if self.steps is not None and self.epochs is not None:
            raise ConfigError("give --steps or --epochs, not both")
        if self.steps is not None and self.steps < 1:
            raise ConfigError(f"--steps must be at least 1, got {self.steps}")
        if self.epochs is not None and self.epochs <= 0:
            raise ConfigError(f"--epochs must be positive, got {self.epochs}")
        if self.grad_reduce_dtype not in REDUCE_DTYPES:
            raise ConfigError(f"--grad-reduce-dtype must be one of {', '.join(REDUCE_DTYPES)}, got {self.grad_reduce_dtype!r}")
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"--strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}; use ddp, or fsdp for drafters too large to replicate on every rank")
        if self.log_every < 1 or self.save_every < 1:
            raise ConfigError(f"--log-every and --save-every must be at least 1, got {self.log_every}, {self.save_every}")
        if self.keep_checkpoints < 1:
            raise ConfigError(f"--keep-checkpoints must be at least 1 (the newest checkpoint is what --resume needs), "
                              f"got {self.keep_checkpoints}")
        if self.eval_sequences < 0:
            raise ConfigError(f"--eval-sequences must be 0 (no held-out evaluation) or more, got {self.eval_sequences}")

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.pop("storage_options")  # may hold credentials
        return out


SECTIONS = {"model": ModelConfig, "loss": LossConfig, "dspark": DSparkConfig, "dflash2": DFlash2Config, "noise": NoiseConfig, "data": DataConfig, "optim": OptimConfig}


def _type_problem(value: Any, hint: Any) -> str | None:
    """What is wrong with a plain config value for a field annotation, or None when it fits."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        problems = [_type_problem(value, arg) for arg in args]
        return None if any(p is None for p in problems) else next(p for p in problems if p)
    if hint is type(None):
        return None if value is None else "must be empty (null)"
    if hint is bool:
        return None if isinstance(value, bool) else "must be true or false"
    if hint is int:
        if not isinstance(value, int) or isinstance(value, bool):
            return "must be a whole number"
        # torch (seeds, sizes, steps) holds 64-bit integers; a larger one was an OverflowError deep in a run
        return None if -2**63 <= value < 2**63 else "must be a whole number below 2**63"
    if hint is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return "must be a number"
        return None if math.isfinite(value) else "must be a finite number"
    if hint is str:
        return None if isinstance(value, str) else "must be a string"
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            return "must be a list"
        element_hints = [args[0]] * len(value) if len(args) == 2 and args[1] is Ellipsis else list(args)
        if len(element_hints) != len(value):
            return f"must be a list of {len(element_hints)}"
        for element, element_hint in zip(value, element_hints):
            problem = _type_problem(element, element_hint)
            if problem:
                return f"must be a list whose entries {problem.removeprefix('must be ')}"
        return None
    if origin is dict or hint is dict:
        return None if isinstance(value, dict) else "must be a table (a JSON object)"
    return None  # Any and other annotations are the dataclass's own business


def _build(cls, values: dict, where: str):
    if not isinstance(values, dict):
        raise ConfigError(f"the {where} section is {values!r}, not a table of fields; write them as [{where}] in "
                          f"TOML or an object in JSON, e.g. {where}.{dataclasses.fields(cls)[0].name}=...")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown {where} field(s) {unknown}; known: {sorted(known)}")
    hints = typing.get_type_hints(cls)
    for name, value in values.items():
        if name in SECTIONS and cls is TrainConfig:
            continue
        problem = _type_problem(value, hints[name])
        if problem:
            prefix = "" if where == "train" else f"{where}."
            shown = repr(value) if len(repr(value)) <= 80 else f"{repr(value)[:40]}...({len(repr(value))} characters)"
            raise ConfigError(f"{prefix}{name} = {shown} {problem}; fix it in the config file or --set {prefix}{name}=...")
    fixed = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return cls(**fixed)


def config_from_dict(values: dict) -> TrainConfig:
    """A TrainConfig from nested plain values (a config file, or a saved config.json)."""
    if not isinstance(values, dict):
        raise ConfigError(f"a train config is a table of options, not {type(values).__name__} {values!r}; "
                          "write a TOML file or a JSON object")
    values = dict(values)
    sections = {name: _build(cls, values.pop(name, {}) or {}, name) for name, cls in SECTIONS.items()}
    return _build(TrainConfig, {**values, **sections}, "train")


def with_run_length(overrides: dict) -> dict:
    """Overrides in which a given steps (or epochs) also clears the other: the two exclude each other,
    so one given on the command line or by a sweep axis replaces the other one of a config file."""
    steps, epochs = overrides.get("steps"), overrides.get("epochs")
    if steps is not None and epochs is not None:
        raise ConfigError(f"--steps {steps} and --epochs {epochs} both set the run length; give one")
    if epochs is not None:
        return {**overrides, "steps": None}
    if steps is not None:
        return {**overrides, "epochs": None}
    return overrides


def read_config_file(path: str) -> dict:
    """Plain nested values from a .toml or .json config file."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file {path} does not exist")
    if p.suffix not in (".toml", ".json"):
        raise ConfigError(f"config file {path} is neither .toml nor .json; write the config as TOML or JSON "
                          "(YAML is not read)")
    if not p.is_file():
        raise ConfigError(f"config file {path} is not a regular file; pass a .toml or .json file")
    values = load_settings_file(path, f"config file {path}", fix="fix the file, or pass another --config")
    if not isinstance(values, dict):
        raise ConfigError(f"config file {path} holds a JSON {type(values).__name__}, not a table of options; write an "
                          'object such as {"optim": {"lr": 0.001}}')
    return values


def merge(base: dict, overrides: dict) -> dict:
    """Nested update: overrides win, sections merge key by key."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        elif isinstance(value, dict) and out.get(key) is not None:
            raise ConfigError(f"the {key} section is {out[key]!r}, not a table of fields; write them as [{key}] "
                              "in TOML or an object in JSON")
        else:
            out[key] = value
    return out


# Settings (dotted paths) that change how a run is executed or logged, not what it learns: a
# checkpoint resumes with other values of these, and a sweep counts a finished run made with other
# values as its combination.
OPERATIONAL_PATHS = frozenset({"out", "device", "strategy", "grad_reduce_dtype", "tensorboard", "log_every", "save_every", "keep_checkpoints",
                               "storage_options", *(f"model.{name}" for name in MODEL_OPERATIONAL),
                               *(f"data.{name}" for name in DATA_OPERATIONAL),
                               *(f"loss.{name}" for name in LOSS_OPERATIONAL)})
# What a resume may change besides: the cache's URL (its fingerprint is checked), the run's
# length, its evaluation and the seed of the initial weights (the checkpoint's weights replace
# them). A sweep does compare these: a run of other length or seed is another result.
# data.partitions: 0 keeps the run's own partitions (the loader state's), any other value must equal
# them (resolve_partitions refuses it otherwise).
RESUME_MAY_CHANGE = OPERATIONAL_PATHS | {"cache", "steps", "epochs", "eval_sequences", "seed", "data.partitions"}


def flat_config(values: dict, prefix: str = "") -> dict[str, Any]:
    """A nested config as {dotted path: value} (storage_options stays one value)."""
    out = {}
    for key, value in values.items():
        if isinstance(value, dict) and key != "storage_options":
            out.update(flat_config(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def config_differences(saved: dict, wanted: dict, free: frozenset[str] = OPERATIONAL_PATHS) -> list[tuple[str, Any, Any]]:
    """(path, saved value, wanted value) of every setting outside `free` in which a saved config
    (a run's config.json, a checkpoint's) differs from the wanted one; a setting the saved config
    predates counts as its default."""
    defaults = flat_config(json.loads(json.dumps(TrainConfig(cache="", out="").to_dict())))
    a = {**defaults, **flat_config(json.loads(json.dumps(saved)))}
    b = flat_config(json.loads(json.dumps(wanted)))
    return [(k, a.get(k), b.get(k)) for k in sorted((set(a) | set(b)) - free) if a.get(k) != b.get(k)]
