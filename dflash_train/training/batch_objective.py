"""The training objective of one batch: its targets per draft position (``block_targets``, read
from the loader's Batch, so data flows loader -> model -> loss), the drafter's forward
(``block_states``), then the loss (dflash_train.training.loss.block_loss)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from dflash_train.settings.loss_config import LossConfig
from dflash_train.training.layout import copy_to
from dflash_train.training.loss import DraftHeads, LossOutput, block_loss

if TYPE_CHECKING:
    from dflash_train.training.batch import Batch
    from dflash_train.training.model import DFlashDrafter


def block_targets(batch: Batch, block_size: int, num_positions: int | None = None) -> dict[str, torch.Tensor]:
    """Per draft position j = 1..P of every anchor a (P = num_positions, default block_size - 1;
    block_size when the anchor slot predicts too): the token to predict (x_{a+j}), the teacher's
    distribution of it (top-k at t = a+j-1) and whether the position counts (a+j < T, loss mask
    set, anchor slot used). Shapes [N*A, P] (+ [k]), on the anchors' device (the host's lengths
    are copied there without a wait)."""
    num_positions = block_size - 1 if num_positions is None else num_positions
    n, a = batch.anchors.shape
    device = batch.anchors.device
    k_offsets = torch.arange(1, num_positions + 1, device=device)
    pos = batch.anchors.clamp(min=0).unsqueeze(-1) + k_offsets  # [N, A, P]
    in_range = (batch.anchors.unsqueeze(-1) >= 0) & (pos < copy_to(batch.lengths, device).view(n, 1, 1))
    pos = torch.where(in_range, pos, torch.zeros_like(pos))
    # both layouts: sequence i's position t is element starts[i] + t of the flattened tensors
    starts = copy_to(batch.starts, device).view(n, 1, 1)
    flat, prev = starts + pos, starts + (pos - 1).clamp(min=0)
    targets = batch.input_ids.flatten()[flat]
    valid = in_range & batch.loss_mask.flatten()[flat]
    k = batch.topk_ids.shape[-1]
    topk_ids = batch.topk_ids.reshape(-1, k)[prev]
    topk_logprobs = batch.topk_logprobs.reshape(-1, k)[prev]
    return {
        "targets": targets.view(n * a, -1),
        "valid": valid.view(n * a, -1),
        "topk_ids": topk_ids.view(n * a, num_positions, k),
        "topk_logprobs": topk_logprobs.view(n * a, num_positions, k),
    }


def block_states(model: DFlashDrafter, batch: Batch, forward=None) -> tuple[torch.Tensor, dict[str, torch.Tensor], DraftHeads]:
    """Drafter states of the draft positions 1..P of every anchor, [N*A, P, H], their targets and
    (DSpark) the heads' outputs under teacher forcing. ``forward`` is the model's wrapper when
    one must run the forward (DDP)."""
    states, features, third = (forward or model)(batch.hidden, batch.input_ids, batch.anchors, heads=True,
                                                 packed_lengths=batch.packed_lengths, last_anchor=batch.last_anchor)
    targets = block_targets(batch, model.cfg.block_size, model.cfg.num_draft_positions)
    if model.cfg.lilicorr is not None:  # the walk's scores along the path, then the candidates
        return states, targets, DraftHeads(lattice_scores=features, lattice_ids=third, lattice=model.cfg.lilicorr)
    if model.cfg.selector is not None:  # the second output is the selector's context
        return states, targets, DraftHeads(selector_context=features, selector=model.cfg.selector,
                                           successor_codebook=model.candidate_selector.successor_codebook)
    dspark = model.cfg.dspark
    heads = DraftHeads(features=features, bias_weight=model.bias_weight if features is not None else None,
                       confidence=third)
    if dspark is not None:
        heads.confidence_alpha, heads.confidence_target = dspark.confidence_head_alpha, dspark.confidence_target
    return states, targets, heads


def batch_loss(model: DFlashDrafter, batch: Batch, loss_cfg: LossConfig, forward=None) -> LossOutput:
    """The drafter's loss and acceptance statistics on one batch (the training objective), over
    the valid positions the batch carries when it does (Batch.valid_rows)."""
    states, targets, heads = block_states(model, batch, forward)
    return block_loss(states, model.lm_head_weight, targets["targets"], targets["topk_ids"],
                      targets["topk_logprobs"], targets["valid"], loss_cfg, model.cfg.block_size, heads,
                      rows=batch.valid_rows)
