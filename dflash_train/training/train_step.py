"""One micro-step of training: the batch onto the device with its noise, the forward and backward
(an idle rank's zero loss included), and the training metrics summed over the ranks."""

from __future__ import annotations

import torch

from dflash_train.settings.drafter_config import DrafterConfig
from dflash_train.settings.train_config import TrainConfig
from dflash_train.training.batch import Batch
from dflash_train.training.batch_objective import batch_loss
from dflash_train.training.distributed import (
    DistInfo,
    global_sum,
    global_sum_tensor,
)
from dflash_train.training.heldout import AcceptanceMeter
from dflash_train.training.loss import LossOutput
from dflash_train.training.model import DFlashDrafter
from dflash_train.training.noise import add_noise_


def on_device(batch: Batch, device: torch.device, cfg: TrainConfig, step: int, steps: int) -> Batch:
    """The batch on the training device in float32, with step `step`'s noise drawn there: the
    draws are the same on any device, and the loader is left only the reading."""
    if not batch.ids:
        return batch
    lengths = batch.lengths.tolist()
    batch = batch.to(device)
    add_noise_(batch.hidden, batch.ids, lengths, cfg.noise, step, steps, packed=batch.packed_lengths is not None)
    return batch


def micro_step(model: DFlashDrafter, forward, batch: Batch, cfg: TrainConfig, info: DistInfo,
               device: torch.device, autocast) -> LossOutput | None:
    """Forward and backward of one batch. With several ranks the loss is normalised by the valid
    positions of the whole global batch, so the ranks' gradient average equals one process's step.
    Every rank runs a forward before the position count's all-reduce: the forward's own
    collectives (FSDP's gathers, DDP's bucket sync) must come in the same order on every rank."""
    with autocast:
        out = batch_loss(model, batch, cfg.loss, forward) if batch.ids else None
        idle = idle_loss(model, forward, device) if out is None else None
    scale = 1.0
    if info.active:  # the count crosses to the host only when the ranks need it
        local = float(out.count.sum()) if out is not None else 0.0
        scale = local / max(global_sum(local, info, device), 1.0) * info.world_size
    loss = out.loss * scale if out is not None else idle
    (loss / cfg.optim.grad_accum).backward()
    return out


def global_train_metrics(meter: AcceptanceMeter, tokens: int, seconds: float, drafter_cfg: DrafterConfig,
                         rows: tuple[str, ...], info: DistInfo, device: torch.device) -> tuple[dict, float]:
    """Loss, acceptance and tau since the last log over every rank's share of the batches, and
    the session's tokens/s over all ranks. Every rank calls this at the same steps."""
    stats = torch.cat([meter.stacked(drafter_cfg.num_draft_positions, rows).flatten(), torch.tensor([float(tokens)], dtype=torch.float64)])
    stats = global_sum_tensor(stats, info, device)
    return AcceptanceMeter.from_stacked(stats[:-1].view(len(rows), -1), rows).summary(), float(stats[-1]) / max(seconds, 1e-9)


def idle_loss(model: DFlashDrafter, forward, device: torch.device) -> torch.Tensor:
    """A zero loss through a whole forward, for a rank whose share of a global batch is empty: its
    backward joins the other ranks' collectives (DDP's all-reduce, FSDP's gathers and
    reduce-scatters) in the same order, with zero gradients, for every trained weight: the
    forward's and those only the loss reads (model.loss_weights, read after the forward as the
    loss reads them: under FSDP2 the root unit's gathered copies)."""
    drafter_cfg = model.cfg
    hidden = torch.zeros(1, 1, drafter_cfg.num_context_layers, drafter_cfg.hidden_size, device=device)
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    outputs = forward(hidden, ids, torch.full((1, 1), -1, device=device), heads=True)
    return (sum(out.sum() for out in outputs if out is not None) + sum(w.sum() for w in model.loss_weights)) * 0.0
