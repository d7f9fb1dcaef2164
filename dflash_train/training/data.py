"""The training loader: this rank's planned batches (dflash_train.training.epoch_plan), read
ahead from the cache and laid out (dflash_train.training.batch), step after step, epoch after epoch.

Nothing of a shard is used before its bytes match the checksums of its commit record: the plan
checks each shard's sequences.arrow, and the loader its tokens.arrow and hidden states before it
hands out the shard's first sequence (``Shard.checksum_problems``: each shard hashed once per
process, and only the shards this rank reads). A damaged shard stops the run with one line naming
it and ``--skip-shards``.
"""

from __future__ import annotations

import collections
import itertools
from dataclasses import dataclass

import numpy as np
import torch

from dflash_cache import Cache, open_cache
from dflash_common.errors import CacheError, DFlashError
from dflash_train.settings.data_config import DataConfig
from dflash_train.training.batch import Batch, hidden_buffer, load_batch, make_batch
from dflash_train.training.epoch_plan import EpochPlan, cut_batches, micro_batches_per_step


@dataclass
class LoaderState:
    """Where the loader is: saved in checkpoints so a resumed run continues exactly."""

    epoch: int = 0
    batch_in_epoch: int = 0
    batches_done: int = 0  # over all epochs: the global batch counter
    seed: int = 0
    manifest_fingerprint: str = ""
    partitions: int = 0  # the plan's partitions (0: a state from before per-rank plans)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


READ_AHEAD_BATCHES = 4


def read_ahead_budget(cfg: DataConfig, hidden_bytes_per_token: int) -> int:
    """Hidden-state bytes a loader process reads ahead: data.read_ahead_bytes, but never more
    than READ_AHEAD_BATCHES full batches. On a small cache the byte budget alone would read
    epochs ahead of the trainer, on threads that compete with it for the cores."""
    return min(cfg.read_ahead_bytes, READ_AHEAD_BATCHES * cfg.batch_tokens * hidden_bytes_per_token)


class TrainStream(torch.utils.data.IterableDataset):
    """This rank's batches from a loader state onwards, forever (epoch after epoch).

    The plan is over ``state.partitions`` partitions (the world size when the state has none);
    this rank executes its own partitions' batch of every step, one Batch (a micro-batch) per
    partition it owns, ``micro_batches_per_step`` of them every step on every rank (an empty Batch
    for a partition that ran out or a rank owning fewer; the epoch lasts as long as its longest
    partition). Worker w of W executes micro-batches w, w+W, ... of the stream; the DataLoader
    interleaves workers in order, so the stream is the same for any worker count, and with one
    partition a rank a worker count dividing the plan's lanes reads disjoint shards. A micro-batch's
    ``state_after`` is the loader state once its whole step is done (its step's start for the
    step's other micro-batches).
    """

    def __init__(self, url: str, storage_options: dict | None, cfg: DataConfig, state: LoaderState,
                 rank: int = 0, world_size: int = 1, pinned: bool = False, plan: EpochPlan | None = None,
                 draft_positions: int | None = None):
        self.url, self.storage_options, self.cfg, self.state = url, storage_options, cfg, state
        self.draft_positions = draft_positions
        self.rank, self.world_size = rank, world_size
        self.partitions = state.partitions or world_size
        # the plan this process already made (its cache's sequence tables read and checked once);
        # worker processes make their own
        self.plan = plan if cfg.num_workers == 0 else None
        # batches read in this process go straight into page-locked memory; a worker's batches
        # cross to this process through shared memory and are pinned by the DataLoader there
        self.pinned = pinned and cfg.num_workers == 0

    def _jobs(self, plan: EpochPlan, worker: int, workers: int):
        """(one micro-batch of this rank, epoch, loader state after it) of every micro-batch this
        worker executes, in order."""
        epoch, start, done = self.state.epoch, self.state.batch_in_epoch, self.state.batches_done
        micro = micro_batches_per_step(self.partitions, self.world_size)
        position = 0  # micro-batches emitted by the whole stream (all workers)
        while True:
            steps = plan.steps(epoch, self.partitions)
            for b in range(start, steps):
                if any((position + j) % workers == worker for j in range(micro)):
                    before = self._state(epoch, b, done)
                    after = self._state(epoch + 1, 0, done + 1) if b + 1 == steps else self._state(epoch, b + 1, done + 1)
                    shares = plan.rank_micro_batches(epoch, self.partitions, self.rank, self.world_size, b)
                    for j, share in enumerate(shares):
                        if (position + j) % workers == worker:
                            yield share, epoch, after if j + 1 == micro else before
                position += micro
                done += 1
            epoch, start = epoch + 1, 0

    def _state(self, epoch: int, batch_in_epoch: int, done: int) -> dict:
        return LoaderState(epoch=epoch, batch_in_epoch=batch_in_epoch, batches_done=done, seed=self.cfg.seed,
                           manifest_fingerprint=self.state.manifest_fingerprint, partitions=self.partitions).to_dict()

    def __iter__(self):
        try:
            yield from self._batches()
        except DFlashError as err:
            if torch.utils.data.get_worker_info() is None:
                raise
            # a DataLoader re-raises a worker's error with its traceback in the message: hand the
            # training process the error itself, which train_loader raises there
            yield LoaderFailure(type(err), str(err))

    def _batches(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        plan = self.plan if self.plan is not None else EpochPlan(open_cache(self.url, self.storage_options), self.cfg)
        cache = plan.cache
        # the plan says which sequences come next, so they are read ahead while a batch is built,
        # each straight into its row of the batch it belongs to
        jobs, ahead = itertools.tee(self._jobs(plan, worker, workers))
        filling: collections.deque = collections.deque()  # the batches being read into, in job order

        def rows():
            for share, *_ in ahead:
                if share:
                    for s in dict.fromkeys(s for s, _ in share):  # the rows exist before a buffer is sized for them
                        cache.shards[s].ensure_layout()
                    lengths = [plan.length(s, i) for s, i in share]
                    hidden, views = hidden_buffer(cache, lengths, self.cfg.layout, pinned=self.pinned)
                    filling.append(hidden)
                    yield from ((s, i, view) for (s, i), view in zip(share, views))

        # check: a shard's checksums are verified on the reading threads before any of it is handed
        # out, so the hashing overlaps the training step
        records = cache.read_ahead(rows(), read_ahead_budget(self.cfg, cache.hidden_bytes_per_token),
                                   self.cfg.read_threads, check=True)
        try:
            for share, epoch, after in jobs:
                shared = [next(records) for _ in share]  # a damaged shard: ShardIntegrityError, the one-line refusal
                batch = make_batch(shared, self.cfg, epoch, filling.popleft(), self.draft_positions) if share else Batch.empty()
                batch.state_after = after
                yield batch
        finally:
            records.close()


@dataclass
class LoaderFailure:
    """A typed error in a loader worker, carried to the training process as an item of the stream."""

    kind: type
    message: str

    def error(self) -> Exception:
        try:
            return self.kind(self.message)
        except TypeError:  # an error type built from other arguments
            return CacheError(self.message)


class _BatchLoader(torch.utils.data.DataLoader):
    """A DataLoader that raises a worker's typed error (LoaderFailure) as itself: one line."""

    def __iter__(self):
        for item in super().__iter__():
            if isinstance(item, LoaderFailure):
                raise item.error()
            yield item


def train_loader(url: str, storage_options: dict | None, cfg: DataConfig, state: LoaderState,
                 rank: int = 0, world_size: int = 1, pin_memory: bool = False, plan: EpochPlan | None = None,
                 draft_positions: int | None = None):
    """This rank's batch stream in a DataLoader. ``pin_memory`` (for CUDA training) hands out
    page-locked batches so ``Batch.to(device)`` copies without blocking; ``plan``: this cache's
    epoch plan if this process made it already (used when the loader reads in this process);
    ``draft_positions``: the drafter's positions a block predicts (data.anchors cover)."""
    stream = TrainStream(url, storage_options, cfg, state, rank, world_size, pinned=pin_memory, plan=plan,
                         draft_positions=draft_positions)
    return _BatchLoader(stream, batch_size=None, num_workers=cfg.num_workers, pin_memory=pin_memory,
                        persistent_workers=False, prefetch_factor=4 if cfg.num_workers else None)


def heldout_batches(cache: Cache, cfg: DataConfig, max_sequences: int | None = None,
                    draft_positions: int | None = None):
    """Batches of the held-out split in a fixed order, with fixed anchors and no noise."""
    plan = EpochPlan(cache, cfg, heldout=True)
    refs = plan.refs(np.arange(plan.num_sequences)[:max_sequences])
    lengths = [plan.lengths[plan.rows[:max_sequences]]]
    for batch in cut_batches([(0, j) for j in range(len(refs))], lengths, cfg.batch_tokens):
        yield load_batch(cache, cfg, [refs[j] for _, j in batch], epoch=0, draft_positions=draft_positions)
