"""The train config: one small dataclass per component, composed, saved next to every output."""

from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_cache.errors import ConfigError
from dflash_train.data import DataConfig
from dflash_train.distributed import STRATEGIES
from dflash_train.loss import LossConfig
from dflash_train.noise import NoiseConfig


@dataclass(frozen=True)
class ModelOptions:
    """Drafter shape; unset fields are derived from the teacher config saved in the cache."""

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

    def __post_init__(self):
        if self.num_layers < 1:
            raise ConfigError(f"--num-layers must be at least 1, got {self.num_layers}")
        if self.block_size < 2:
            raise ConfigError(f"--block-size must be at least 2, got {self.block_size}")

    def overrides(self) -> dict:
        names = ("num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}


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

    model: ModelOptions = field(default_factory=ModelOptions)
    loss: LossConfig = field(default_factory=LossConfig)
    noise: NoiseConfig = field(default_factory=NoiseConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)

    log_every: int = 10
    """Steps between metric lines."""

    save_every: int = 500
    """Steps between checkpoints (and one at the end)."""

    keep_checkpoints: int = 3
    """How many of the newest checkpoints to keep."""

    eval_sequences: int = 256
    """Held-out sequences evaluated before and after training (0 skips evaluation)."""

    device: str = "auto"
    """'auto' (CUDA when present), 'cpu' or 'cuda[:N]'."""

    strategy: str = "ddp"
    """Data parallelism under torchrun: 'ddp' (every rank holds the whole drafter and optimizer)
    or 'fsdp' (FSDP2: parameters, gradients and optimizer state sharded across ranks). One
    process trains unwrapped either way; checkpoints are the same for both."""

    seed: int = 0
    """Seed of the drafter's initial weights."""

    tensorboard: bool = False
    """Also write TensorBoard event files (needs the tensorboard package)."""

    storage_options: dict[str, Any] | None = None
    """fsspec options for the cache URL."""

    def __post_init__(self):
        if self.steps is not None and self.epochs is not None:
            raise ConfigError("give --steps or --epochs, not both")
        if self.steps is not None and self.steps < 1:
            raise ConfigError(f"--steps must be at least 1, got {self.steps}")
        if self.epochs is not None and self.epochs <= 0:
            raise ConfigError(f"--epochs must be positive, got {self.epochs}")
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"--strategy must be one of {', '.join(STRATEGIES)}, got {self.strategy!r}; use ddp, or fsdp for drafters too large to replicate on every rank")
        if self.log_every < 1 or self.save_every < 1:
            raise ConfigError(f"--log-every and --save-every must be at least 1, got {self.log_every}, {self.save_every}")

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.pop("storage_options")  # may hold credentials
        return out


_SECTIONS = {"model": ModelOptions, "loss": LossConfig, "noise": NoiseConfig, "data": DataConfig, "optim": OptimConfig}


def _build(cls, values: dict, where: str):
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ConfigError(f"unknown {where} option(s) {unknown}; known: {sorted(known)}")
    fixed = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return cls(**fixed)


def config_from_dict(values: dict) -> TrainConfig:
    """A TrainConfig from nested plain values (a config file, or a saved config.json)."""
    values = dict(values)
    sections = {name: _build(cls, values.pop(name, {}) or {}, name) for name, cls in _SECTIONS.items()}
    return _build(TrainConfig, {**values, **sections}, "train")


def read_config_file(path: str) -> dict:
    """Plain nested values from a .toml or .json config file."""
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"config file {path} does not exist")
    try:
        return tomllib.loads(p.read_text()) if p.suffix == ".toml" else json.loads(p.read_text())
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"config file {path} cannot be parsed: {err}") from None


def merge(base: dict, overrides: dict) -> dict:
    """Nested update: overrides win, sections merge key by key."""
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out
