"""TrainConfig: every section of a train run composed, saved as config.json next to every output."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from dflash_common.errors import ConfigError
from dflash_train.settings.data_config import RANDOM, DataConfig
from dflash_train.settings.dflash2_config import DFlash2Config
from dflash_train.settings.drafter_config import check_block_tokens
from dflash_train.settings.dspark_config import DSparkConfig
from dflash_train.settings.lilicorr_config import LiLiCorrConfig
from dflash_train.settings.loss_config import LossConfig
from dflash_train.settings.model_config import ModelConfig
from dflash_train.settings.noise_config import NoiseConfig
from dflash_train.settings.optim_config import OptimConfig

STRATEGIES = ("ddp", "fsdp")
"""Data parallelism under torchrun (dflash_train.training.distributed carries them out)."""


REDUCE_DTYPES = ("fp32", "bf16")
"""Dtypes of the gradients' reduction across ranks (distributed.REDUCE_DTYPES maps them to torch's)."""


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
    """DFlash2's convolutions and candidate selector, used when model.kind is "dflash2" (its
    convolutions also for "lilicorr" with lilicorr.conv)."""

    lilicorr: LiLiCorrConfig = field(default_factory=LiLiCorrConfig)
    """LiLiCorr's lattice correlator, used when model.kind is "lilicorr"."""

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
    one process) or "bf16" (half the bytes: DDP's bf16 compression hook, FSDP2's bf16 reduce-scatter;
    each rank's gradient is rounded to bf16 before the sum). One reduction per optimizer step
    either way: gradient accumulation reduces only at its last batch."""

    wrap_single_rank: bool = False
    """Under torchrun with one process (--nproc-per-node 1), still join the process group (NCCL on
    CUDA) and wrap the drafter as --strategy says, as with several ranks (by default one process
    trains unwrapped): the GPU check exercises DDP, its bf16 hook, FSDP2 and the state-dict
    gathers on a one-GPU machine this way. Needs torchrun."""

    collective_timeout: float = 600.0
    """Seconds a rank waits in a collective under torchrun (a gradient reduction, an FSDP gather,
    the metrics' sums) before the run stops with an error: the process group's timeout (NCCL's
    watchdog, gloo's), 600 being torch's default. Rank 0's solo work has its own, save_timeout."""

    save_timeout: float = 7200.0
    """Seconds the other ranks wait under torchrun while rank 0 works alone: writing and fsyncing a
    checkpoint (the whole trainer state: ~22 GB at production size), the held-out evaluation under
    DDP, the export. They wait on a CPU (gloo) group of their own with this timeout, outside
    collective_timeout, so a slow file system does not stop the run."""

    seed: int = 0
    """Seed of the drafter's initial weights."""

    init_from: str | None = None
    """Start from these drafter weights instead of random ones: a checkpoint folder
    (checkpoints/step-NNNNNN) or an exported drafter folder of an earlier run, whose drafter must
    have this run's shape. Only the weights carry over: loss, weighting, schedule, steps and the
    optimizer's state are this run's own (a fine-tuning phase; --resume-from continues a run
    instead); the run says which of the drafter config's fields its options replace (block size,
    causal, ...), with a warning when causal differs."""

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
        if not (self.collective_timeout > 0 and self.save_timeout > 0):
            raise ConfigError(f"--collective-timeout and --save-timeout must be positive seconds, got "
                              f"{self.collective_timeout:g}, {self.save_timeout:g}")
        if self.eval_sequences < 0:
            raise ConfigError(f"--eval-sequences must be 0 (no held-out evaluation) or more, got {self.eval_sequences}")
        if self.data.anchors == RANDOM:
            check_block_tokens(self.model.block_size, self.data.num_anchors)

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.pop("storage_options")  # may hold credentials
        return out


SECTIONS = {"model": ModelConfig, "loss": LossConfig, "dspark": DSparkConfig, "dflash2": DFlash2Config, "lilicorr": LiLiCorrConfig, "noise": NoiseConfig, "data": DataConfig, "optim": OptimConfig}
