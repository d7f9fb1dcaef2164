"""The optimizer section of a train run (optim)."""

from __future__ import annotations

from dataclasses import dataclass

from dflash_common.errors import ConfigError

MIN_LR = 1e-8
"""The smallest peak learning rate taken. An AdamW step moves a weight by about lr, and an fp32
weight of 0.02 (the drafter's init scale) cannot change by less than 9.3e-10 (half its ulp, 2^-29):
below 1e-8 the steps round away, or nearly, and the run trains nothing without a word."""


@dataclass(frozen=True)
class OptimConfig:
    """AdamW with linear warmup and cosine decay."""

    lr: float = 6e-4
    """Peak learning rate, at least 1e-8 (smaller steps round away in the fp32 weights)."""

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
        if self.lr < MIN_LR:
            raise ConfigError(f"--lr {self.lr:g} is below {MIN_LR:g}: AdamW's steps of about lr would round away in the "
                              "fp32 weights and the run would train nothing; pass e.g. 6e-4 (the default)")
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
