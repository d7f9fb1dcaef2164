"""One step's tensors: a planned batch of sequences read, anchored and laid out (padded or packed:
dflash_train.training.layout) as a ``Batch``, and its trip to the training device."""

from __future__ import annotations

from dataclasses import dataclass, field

import ml_dtypes
import numpy as np
import torch

from dflash_cache import Cache
from dflash_common.errors import ConfigError
from dflash_train.settings.data_config import COVER, PACKED, PADDED, DataConfig
from dflash_train.training.epoch_plan import block_parts, cover_anchors, sample_anchors
from dflash_train.training.layout import sequence_starts, slots


@dataclass
class Batch:
    """The tensors of one step. Per-token tensors are [R, W, ...] in ``layout`` (dflash_train.training.layout):
    [N, T_max] padded, [1, sum T] packed; ``lengths`` and ``anchors`` are per sequence either way
    (anchors in the sequence's own positions, -1 in unused slots). ``hidden`` leaves the loader in
    the cache's dtype (bf16: half the bytes to copy and pin) and is float32 after ``to(device)``.

    What the host decides from (the lengths, the anchors' reach, the valid positions' count)
    stays on the host: ``to(device)`` leaves ``lengths`` there and keeps the anchors' host copy
    in ``host_anchors``, so a training step never waits for the device to read them back."""

    ids: list[str]
    hidden: torch.Tensor  # [R, W, L, H]
    input_ids: torch.Tensor  # [R, W] long
    loss_mask: torch.Tensor  # [R, W] bool
    lengths: torch.Tensor  # [N], always on the host
    topk_ids: torch.Tensor  # [R, W, k] long
    topk_logprobs: torch.Tensor  # [R, W, k] float32
    anchors: torch.Tensor  # [N, A] long
    state_after: dict = field(default_factory=dict)
    layout: str = PADDED
    host_anchors: torch.Tensor | None = None
    """The anchors on the host once ``anchors`` went to a device (None while they are on the host)."""
    valid_rows: torch.Tensor | None = None
    """Flat indices [V] into the [N*A, P] grid of block_targets' valid positions, found on the host
    and shipped beside the anchors (``columns``), so the loss needs no ``nonzero`` on the device."""

    @property
    def starts(self) -> torch.Tensor:
        """Flat index [N] of each sequence's position 0 in the per-token tensors (flattened over
        their first two dimensions)."""
        return sequence_starts(self.lengths, self.layout, self.input_ids.shape[1])

    @property
    def packed_lengths(self) -> tuple[int, ...] | None:
        """The lengths when packed (the drafter's ``packed_lengths``), None when padded: ints, since
        FSDP2 moves a forward's tensor arguments to the GPU (a blocking copy the host then reads back)."""
        return tuple(self.lengths.tolist()) if self.layout == PACKED else None

    @property
    def anchors_on_host(self) -> torch.Tensor:
        return self.anchors if self.host_anchors is None else self.host_anchors

    @property
    def last_anchor(self) -> int:
        """The largest anchor of the batch's blocks (-1 when none), read on the host."""
        return int(self.anchors_on_host.max()) if self.anchors.numel() else -1

    def sequence(self, name: str, index: int) -> torch.Tensor:
        """Sequence `index`'s own part [T, ...] of the per-token tensor `name`."""
        start, length = int(self.starts[index]), int(self.lengths[index])
        return getattr(self, name).flatten(0, 1)[start:start + length]

    @classmethod
    def empty(cls) -> "Batch":
        """A rank's batch at a step where its partitions ran out (or never held a sequence)."""
        none = torch.zeros(0)
        return cls(ids=[], hidden=none, input_ids=none, loss_mask=none, lengths=none, topk_ids=none,
                   topk_logprobs=none, anchors=none)

    def columns(self, span: tuple[int, int] | None, valid_rows: torch.Tensor | None = None) -> "Batch":
        """The batch with only the blocks of anchor columns [c0, c1) (the same tensors; None: all),
        with ``valid_rows`` (those blocks' valid positions, made on the host) sent to the anchors' device."""
        if not self.ids:
            return self
        c0, c1 = span if span is not None else (0, self.anchors.shape[1])
        host = None if self.host_anchors is None else self.host_anchors[:, c0:c1]
        rows = None if valid_rows is None else valid_rows.to(self.anchors.device, non_blocking=True)
        return Batch(**{**self.__dict__, "anchors": self.anchors[:, c0:c1], "host_anchors": host, "valid_rows": rows})

    def parts(self, block_size: int, cfg: DataConfig, dense: bool = True) -> list[tuple[int, int] | None]:
        """The anchor column ranges the batch trains in, one forward each (epoch_plan.block_parts
        under cfg's budgets; the attention-area bound only for the ``dense`` mask path, not for
        flex), read from the host's anchors; [None] for one part of all of them."""
        if not self.ids:
            return [None]
        spans = block_parts(self.anchors_on_host.cpu().numpy(), block_size, cfg.forward_tokens, cfg.batch_tokens if dense else None)
        return [None] if len(spans) == 1 else spans

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def pin_memory(self) -> "Batch":
        """Page-locked copies of the tensors (the DataLoader calls this with pin_memory=True), so
        the copy to the GPU can overlap the step."""
        pinned = {k: (v.pin_memory() if isinstance(v, torch.Tensor) else v) for k, v in self.__dict__.items()}
        return Batch(**pinned)

    def to(self, device) -> "Batch":
        """The batch on `device`, hidden states in float32 (converted there, after the copy); the
        lengths and a copy of the anchors stay on the host."""
        host = {"lengths": self.lengths, "host_anchors": self.anchors_on_host}
        moved = {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
                 for k, v in self.__dict__.items() if k not in host}
        moved["hidden"] = moved["hidden"].float()
        return Batch(**moved, **host)


def collate(records: list, anchors: list[np.ndarray], hidden: list[np.ndarray] | np.ndarray,
            layout: str = PADDED) -> Batch:
    """Lay sequences out as one batch in ``layout`` (filled in numpy, handed to torch without a
    copy). ``hidden`` is each sequence's hidden states, copied here in the first one's dtype, or
    the batch's hidden states already filled (the loader reads into it: ``hidden_buffer``)."""
    n = len(records)
    shape, where = slots([len(r) for r in records], layout)
    num_anchors = max(1, max(len(a) for a in anchors))
    k = records[0].topk_ids.shape[1]
    filled = isinstance(hidden, np.ndarray)
    out_hidden = hidden if filled else np.zeros((*shape, *hidden[0].shape[1:]), dtype=hidden[0].dtype)
    input_ids = np.zeros(shape, dtype=np.int64)
    loss_mask = np.zeros(shape, dtype=bool)
    topk_ids = np.zeros((*shape, k), dtype=np.int64)
    topk_logprobs = np.zeros((*shape, k), dtype=np.float32)
    anchor_ids = np.full((n, num_anchors), -1, dtype=np.int64)
    for i, (record, a, (row, start)) in enumerate(zip(records, anchors, where)):
        span = slice(start, start + len(record))
        if not filled:
            out_hidden[row, span] = hidden[i]
        input_ids[row, span] = record.input_ids
        loss_mask[row, span] = record.loss_mask
        topk_ids[row, span] = record.topk_ids
        topk_logprobs[row, span] = record.topk_logprobs
        anchor_ids[i, : len(a)] = a
    return Batch(ids=[r.id for r in records], hidden=_tensor(out_hidden),
                 input_ids=torch.from_numpy(input_ids), loss_mask=torch.from_numpy(loss_mask),
                 lengths=torch.tensor([len(r) for r in records]), topk_ids=torch.from_numpy(topk_ids),
                 topk_logprobs=torch.from_numpy(topk_logprobs), anchors=torch.from_numpy(anchor_ids), layout=layout)


def hidden_buffer(cache: Cache, lengths: list[int], layout: str, pinned: bool = False) -> tuple[np.ndarray, list[np.ndarray]]:
    """The zeroed hidden-state tensor of a batch of these sequence lengths in ``layout`` and each
    sequence's view into it, for the reader to fill in place (no copy after the read). A packed
    batch is ``Cache.padded_hidden`` of one row as long as all the sequences together."""
    shape, where = slots(lengths, layout)
    buffer = cache.padded_hidden([shape[1]] * shape[0], pinned=pinned)
    return buffer, [buffer[row, start:start + t] for (row, start), t in zip(where, lengths)]


def _tensor(array: np.ndarray) -> torch.Tensor:
    """torch has no numpy bfloat16: ml_dtypes' bf16 crosses as its bit pattern."""
    if array.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(array.view(np.uint16)).view(torch.bfloat16)
    return torch.from_numpy(array)


def batch_anchors(records: list, cfg: DataConfig, epoch: int, draft_positions: int | None) -> list[np.ndarray]:
    """Each record's anchors under cfg.anchors: the blocks covering its loss positions (blocks of
    ``draft_positions``, the drafter's, each) or cfg.num_anchors random ones."""
    if cfg.anchors == COVER:
        if draft_positions is None:
            raise ConfigError("data.anchors cover tiles a sequence with the drafter's blocks; pass the drafter's "
                              "draft positions (model.num_draft_positions) to the loader, or use --anchors random")
        return [cover_anchors(r.loss_mask, draft_positions, cfg.seed, epoch, r.id) for r in records]
    return [sample_anchors(r.loss_mask, cfg.num_anchors, cfg.seed, epoch, r.id) for r in records]


def make_batch(records: list, cfg: DataConfig, epoch: int, hidden: np.ndarray | None = None,
               draft_positions: int | None = None) -> Batch:
    """Anchor and lay out one planned batch of records in cfg.layout; the hidden states stay in
    the cache's dtype. ``hidden``: the batch's hidden states the records were read into, if they
    were; ``draft_positions``: the drafter's positions a block predicts (for cover anchors)."""
    anchors = batch_anchors(records, cfg, epoch, draft_positions)
    return collate(records, anchors, [r.hidden for r in records] if hidden is None else hidden, cfg.layout)


def load_batch(cache: Cache, cfg: DataConfig, refs: list[tuple[int, int]], epoch: int,
               draft_positions: int | None = None) -> Batch:
    """Read, anchor and lay out one planned batch, each sequence read straight into its place,
    once the shards it reads passed their checksums (hashed at a shard's first batch in this process)."""
    cache.ensure_intact(shards=[s for s, _ in refs])
    lengths = [int(cache.shards[s].lengths[i]) for s, i in refs]
    hidden, views = hidden_buffer(cache, lengths, cfg.layout)
    records = [cache.shards[s].read(i, view) for (s, i), view in zip(refs, views)]
    return make_batch(records, cfg, epoch, hidden, draft_positions)
