"""The data section: how a run's sequences are split, ordered, batched and laid out (dflash_train.training.data
reads them; dflash_train.training.layout places the tokens of each layout)."""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_common.errors import ConfigError
from dflash_common.values import check_choice
from dflash_train.settings.drafter_config import MAX_BLOCK_TOKENS, check_at_most

PACKED, PADDED = "packed", "padded"
COVER, RANDOM = "cover", "random"
ANCHOR_CHOICES = (COVER, RANDOM)
RANDOM_ANCHORS = 8
"""data.num_anchors with random anchors when none is given (the seed recipe's)."""
MAX_BATCH_TOKENS = 1 << 20
MAX_PARTITIONS = 1 << 20
MAX_LOADER_THREADS = 256
LAYOUTS = (PACKED, PADDED)


@dataclass(frozen=True)
class DataConfig:
    """How sequences are split, ordered, batched and sampled."""

    batch_tokens: int = 8192
    """Sequence tokens per rank per micro-batch (sum of lengths; a longer sequence forms a batch
    alone): a per-rank budget, so the global batch is world size x batch_tokens (x grad_accum)
    and every rank gets whole sequences at any world size. Precisely it is the budget of one plan
    partition (data.partitions, one per rank by default). Growing the world k-fold grows the
    global batch k-fold: keep the learning rate by lowering this (or grad_accum) k-fold, or raise
    --lr about sqrt(k)-fold for AdamW (linear scaling overshoots) and keep the warmup. At most
    1,048,576 (51 GB of hidden states at production width, more than any GPU holds)."""

    partitions: int = field(default=0, metadata={"name": "data_partitions"})
    """Partitions each epoch is planned over (0: the world size of the run's first session). An
    epoch's shards are cut into this many disjoint spans of equal tokens; global step s is batch s
    of every partition, and each rank reads only its own block of them (1/world of the cache per
    epoch). A resume keeps the run's partitions, so on any world size up to it (a divisor gives
    equal shares; each rank then takes partitions/world batches a step) no sequence of the epoch is
    lost or repeated and the global batches stay the same. Set it above the world size to leave
    room to resume on more ranks, or on one process to reproduce a multi-rank run's batches. At
    most 1,048,576 (the plan holds a list per partition)."""

    anchors: str = COVER
    """How each sequence's blocks are chosen every epoch: "cover" tiles every loss-masked position
    with non-overlapping blocks (each predicted once an epoch, at a block slot that moves from
    epoch to epoch; a sequence gets as many blocks as its answer needs), "random" draws
    data.num_anchors anchors at random (the seed recipe's: on ~1k-token answers an epoch trained
    13% of the masked positions, at 4k about 3%). A run saved before this setting existed used
    "random"."""

    num_anchors: int | None = None
    """Blocks drawn per sequence with data.anchors "random" (fewer when a sequence has fewer
    eligible anchors; none given: 8); "cover" refuses it, since it sizes the blocks to the
    sequence. model.block_size x num_anchors is at most 65,536 block tokens (8x 16 x 512)."""

    block_tokens: int = 0
    """Most block tokens (blocks x model.block_size) one forward trains (0: 1.25 x
    data.batch_tokens, which holds the cover of a micro-batch of wholly masked sequences at block
    size 5 or more: block_size / (block_size - 1) block tokens a masked position).
    A micro-batch whose blocks exceed it, or whose blocks' attention (block tokens x the keys
    before their last anchor) exceeds block_tokens x (batch_tokens + block_tokens), runs as
    several forwards and backwards over consecutive blocks, each attending only to the context
    before its own last anchor: memory stays set by the budgets, whatever a sequence's length."""

    heldout_fraction: float = 0.02
    """Fraction of sequences (chosen by a hash of the id) kept out of training for evaluation."""

    seed: int = field(default=0, metadata={"name": "data_seed"})
    """Seed of the epoch order and of anchor sampling."""

    num_workers: int = 0
    """DataLoader worker processes reading shards (0 = in the training process); the batch stream is the same
    for any count. At most 256 (each is a process holding its own read-ahead)."""

    read_ahead_bytes: int = 2**30
    """Hidden-state bytes each loader process reads ahead of the batch it is building, on
    background threads: the prefetch from object stores, and locally the reads that overlap the
    training step. 1 GiB holds two default batches at production width (51 KB a token); never
    more than four batches are read ahead. Memory per loader process grows by about this much;
    0 reads each sequence when it is needed."""

    read_threads: int = 4
    """Threads per loader process that read ahead (more help on high-latency object stores); at most 256."""

    layout: str = field(default=PACKED, metadata={"name": "batch_layout"})
    """How a batch lays out its sequences: "packed" (end to end in one row: the drafter's context
    projections skip the padding, each block still sees only its own sequence) or "padded" (one
    right-padded row each). The same loss to float tolerance; packed measured 1.02x padded's
    tokens/s at the quickstart's shape and 1.09x at production width on CPU (benchmarks/RESULTS.md,
    "Packed batches"). Like model.attention_backend a resume may change it (then equal to float
    rounding, not bit for bit)."""

    skip_shards: tuple[str, ...] = ()
    """Shards (by name) left out of training and evaluation, e.g. damaged ones a rebuild cannot
    fix yet. It changes the data, so a run resumes only with the same list."""

    def __post_init__(self):
        if self.batch_tokens < 1:
            raise ConfigError(f"batch tokens must be positive, got {self.batch_tokens}; pass e.g. --batch-tokens 8192")
        if self.partitions < 0:
            raise ConfigError(f"--data-partitions must be >= 0 (0: the world size), got {self.partitions}")
        if self.block_tokens < 0:
            raise ConfigError(f"--block-tokens must be >= 0 (0: 1.25 x --batch-tokens), got {self.block_tokens}; pass e.g. 8192")
        check_choice("--anchors", self.anchors, ANCHOR_CHOICES)
        if self.anchors == COVER and self.num_anchors is not None:
            raise ConfigError(f"--num-anchors {self.num_anchors} applies to --anchors random, but anchors are cover (every "
                              "loss position tiled with blocks, as many as each sequence needs); pass --anchors random "
                              "with it, or drop it")
        if self.anchors == RANDOM and self.num_anchors is None:
            object.__setattr__(self, "num_anchors", RANDOM_ANCHORS)
        if self.anchors == RANDOM and self.num_anchors < 1:
            raise ConfigError(f"--num-anchors must be at least 1, got {self.num_anchors}")
        if not 0 <= self.heldout_fraction < 1:
            raise ConfigError(f"--heldout-fraction must be in [0, 1), got {self.heldout_fraction}")
        if self.num_workers < 0:
            raise ConfigError(f"--num-workers must be >= 0, got {self.num_workers}")
        if self.read_ahead_bytes < 0:
            raise ConfigError(f"data.read_ahead_bytes must be >= 0, got {self.read_ahead_bytes}; pass e.g. 1073741824 (1 GiB)")
        if self.read_threads < 1:
            raise ConfigError(f"data.read_threads must be >= 1, got {self.read_threads}; pass e.g. 4")
        for option, value, limit, why in (
                ("--batch-tokens", self.batch_tokens, MAX_BATCH_TOKENS, "51 GB of hidden states at production width"),
                ("--data-partitions", self.partitions, MAX_PARTITIONS, "a million ranks"),
                ("--num-anchors", self.num_anchors, MAX_BLOCK_TOKENS // 2, "the block tokens one forward may hold at "
                                                                           "block size 2"),
                ("--block-tokens", self.block_tokens, MAX_BATCH_TOKENS, "the most a batch holds"),
                ("--num-workers", self.num_workers, MAX_LOADER_THREADS, "each is a process with its own read-ahead"),
                ("data.read_threads", self.read_threads, MAX_LOADER_THREADS, "far more than any storage needs")):
            check_at_most(option, value, limit, why)
        check_choice("--batch-layout", self.layout, LAYOUTS)
        if not all(isinstance(n, str) and n for n in self.skip_shards):
            raise ConfigError(f"--skip-shards takes shard names such as shard-r00000-000003, got {list(self.skip_shards)}")


    @property
    def forward_tokens(self) -> int:
        """The block tokens one forward may train: block_tokens, or 1.25 x batch_tokens for 0."""
        return self.block_tokens or self.batch_tokens + self.batch_tokens // 4


# Settings that change how the stream is read, not which batches it holds: a run may resume with
# other values of these.
OPERATIONAL_FIELDS = ("num_workers", "read_ahead_bytes", "read_threads", "layout")
