"""One optimizer step's gradients: its micro-batches onto the device with their noise, each loss
scaled by its share of its global batch's valid positions, the forwards and backwards (an idle
rank's zero loss included); and the training metrics summed over the ranks."""

from __future__ import annotations

import torch

from dflash_train.settings.drafter_config import DrafterConfig
from dflash_train.settings.train_config import TrainConfig
from dflash_train.training.batch import Batch
from dflash_train.training.batch_objective import batch_loss, block_targets
from dflash_train.training.data import LoaderState
from dflash_train.training.distributed import DistInfo, global_min, global_sum_on_device, global_sum_tensor, gradient_sync
from dflash_train.training.epoch_plan import micro_batches_per_step
from dflash_train.training.heldout import AcceptanceMeter
from dflash_train.training.loss import LossOutput
from dflash_train.training.model import DFlashDrafter
from dflash_train.training.noise import add_noise_
from dflash_train.training.session import Session


def on_device(batch: Batch, device: torch.device, cfg: TrainConfig, step: int, steps: int) -> Batch:
    """The batch on the training device in float32, with step `step`'s noise drawn there: the
    draws are the same on any device, and the loader is left only the reading."""
    if not batch.ids:
        return batch
    lengths = batch.lengths.tolist()
    batch = batch.to(device)
    add_noise_(batch.hidden, batch.ids, lengths, cfg.noise, step, steps, packed=batch.packed_lengths is not None)
    return batch


def valid_rows(batch: Batch, drafter_cfg: DrafterConfig) -> torch.Tensor:
    """The flat indices of the batch's valid draft positions (block_targets' valid grid; their
    number is its LossOutput.count summed), found on the host from the loader's CPU batch before
    it moves to the device, so neither the scales nor the loss read the device back."""
    if not batch.ids:
        return torch.zeros(0, dtype=torch.long)
    valid = block_targets(batch, drafter_cfg.block_size, drafter_cfg.num_draft_positions)["valid"]
    return valid.reshape(-1).nonzero().squeeze(1)


def loss_scales(counts: list[int], info: DistInfo, device: torch.device) -> list[torch.Tensor | float]:
    """Each micro-batch's loss multiplier within one global batch: its valid positions over the
    global batch's (every rank's micro-batches), times the world size (DDP and FSDP average the
    ranks' gradients), so the summed gradients equal those of the loss's mean over the whole global
    batch, as one merged batch gave. The ranks' total is all-reduced on the device and stays there."""
    if not info.active:
        return [count / max(sum(counts), 1) for count in counts]
    total = global_sum_on_device(float(sum(counts)), info, device)
    factor = (info.world_size / total.clamp(min=1.0)).float()
    return [factor * count for count in counts]


def micro_step(model: DFlashDrafter, forward, batch: Batch, cfg: TrainConfig, info: DistInfo,
               device: torch.device, autocast, scale: torch.Tensor | float | None = None) -> LossOutput | None:
    """Forward and backward of one micro-batch, its loss multiplied by ``scale`` (loss_scales: its
    share of its global batch's valid positions) and divided by grad_accum. Without ``scale`` the
    batch is a global batch's only micro-batch on this rank: its share is counted after the forward
    (from the batch's valid_rows on the host, else read back from the device; with several ranks
    an all-reduce every rank makes after its forward)."""
    with autocast:
        out = batch_loss(model, batch, cfg.loss, forward) if batch.ids else None
        idle = idle_loss(model, forward, device) if out is None else None
    if scale is None and info.active:
        count = 0 if out is None else len(batch.valid_rows) if batch.valid_rows is not None else int(out.count.sum())
        scale = loss_scales([count], info, device)[0]
    loss = (out.loss if scale is None else out.loss * scale) if out is not None else idle
    (loss / cfg.optim.grad_accum).backward()
    return out


def forwards(group: list[Batch], s: Session) -> list[tuple[Batch, tuple[int, int] | None]]:
    """The step's forwards of one global batch on this rank: each micro-batch's parts (its blocks
    in as many forwards as its budgets need, Batch.parts), then empty ones up to the most any rank
    runs, so every rank's collectives match (one small all-reduce a global batch, with several ranks)."""
    dense = s.model.attention_backend != "flex"
    pieces = [(batch, span) for batch in group for span in batch.parts(s.model.cfg.block_size, s.cfg.data, dense)]
    most = -global_min(-len(pieces), s.info, s.device)
    return pieces + [(Batch.empty(), None)] * (most - len(pieces))


def step_gradients(s: Session, batches, autocast, meter: AcceptanceMeter,
                   first_bad: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """One optimizer step's gradients: grad_accum global batches, each as this rank's
    micro-batches (one per partition it owns, so a forward never exceeds batch_tokens) in their
    forwards (``forwards``), the gradients crossing the ranks once, in the step's last backward
    (gradient_sync). Returns the tokens trained, the largest micro-batch's tokens, and first_bad
    (the first step with a non-finite loss) updated."""
    cfg, micro = s.cfg, micro_batches_per_step(s.loader_state.partitions, s.info.world_size)
    tokens = largest = 0
    for index in range(cfg.optim.grad_accum):
        group = [next(batches) for _ in range(micro)]
        s.loader_state = LoaderState(**group[-1].state_after)
        pieces = forwards(group, s)
        rows = [valid_rows(batch.columns(span), s.model.cfg) for batch, span in pieces]
        scales = loss_scales([len(r) for r in rows], s.info, s.device)
        moved: dict[int, Batch] = {}  # each micro-batch goes to the device once, for all its parts
        for j, ((batch, span), part_rows, scale) in enumerate(zip(pieces, rows, scales)):
            if id(batch) not in moved:
                moved[id(batch)] = on_device(batch, s.device, cfg, s.step, s.steps)
                if batch.ids:
                    tokens, largest = tokens + batch.num_tokens, max(largest, batch.num_tokens)
            with gradient_sync(s.forward, s.model, sync=index == cfg.optim.grad_accum - 1 and j == len(pieces) - 1):
                result = micro_step(s.model, s.forward, moved[id(batch)].columns(span, part_rows), cfg, s.info,
                                    s.device, autocast, scale)
            if result is not None:
                meter.add(result)
                first_bad = torch.where(torch.isfinite(result.loss.detach()), first_bad, first_bad.clamp(max=s.step + 1))
    return tokens, largest, first_bad


def global_train_metrics(meter: AcceptanceMeter, tokens: int, largest: int, seconds: float, drafter_cfg: DrafterConfig,
                         rows: tuple[str, ...], info: DistInfo, device: torch.device) -> tuple[dict, float]:
    """Loss, acceptance and tau since the last log over every rank's share of the batches, the
    largest micro-batch any rank trained on since then (``micro_batch_tokens``), and the session's
    tokens/s over all ranks. Every rank calls this at the same steps."""
    stats = torch.cat([meter.stacked(drafter_cfg.num_draft_positions, rows).flatten(), torch.tensor([float(tokens)], dtype=torch.float64)])
    stats = global_sum_tensor(stats, info, device)
    summary = AcceptanceMeter.from_stacked(stats[:-1].view(len(rows), -1), rows).summary()
    summary["micro_batch_tokens"] = -global_min(-largest, info, device)
    return summary, float(stats[-1]) / max(seconds, 1e-9)


def idle_loss(model: DFlashDrafter, forward, device: torch.device) -> torch.Tensor:
    """A zero loss through a whole forward, for a rank whose share of a global batch is empty: its
    backward joins the other ranks' collectives (DDP's all-reduce, FSDP's gathers and
    reduce-scatters) in the same order, with zero gradients, for every trained weight: the
    forward's and those only the loss reads (model.loss_weights, read after the forward as the
    loss reads them: under FSDP2 the root unit's gathered copies)."""
    drafter_cfg = model.cfg
    hidden = torch.zeros(1, 1, drafter_cfg.num_context_layers, drafter_cfg.hidden_size, device=device)
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    outputs = forward(hidden, ids, torch.full((1, 1), -1, device=device), heads=True, last_anchor=-1)
    return (sum(out.sum() for out in outputs if out is not None) + sum(w.sum() for w in model.loss_weights)) * 0.0
