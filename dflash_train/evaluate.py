"""Offline evaluation on the held-out split: per-position acceptance and the acceptance length."""

from __future__ import annotations

import torch

from dflash_cache import Cache
from dflash_train.data import Batch, DataConfig, block_targets, heldout_batches
from dflash_train.loss import LossConfig, LossOutput, block_loss, tau_from_alpha
from dflash_train.model import DFlashDrafter


def batch_loss(model: DFlashDrafter, batch: Batch, loss_cfg: LossConfig) -> LossOutput:
    """The drafter's loss and acceptance statistics on one batch (the training objective)."""
    block_size = model.cfg.block_size
    states = model(batch.hidden, batch.input_ids, batch.anchors)  # [N, A, B, H]
    n, a, _, h = states.shape
    targets = block_targets(batch, block_size)
    return block_loss(states[:, :, 1:].reshape(n * a, block_size - 1, h), model.lm_head_weight,
                      targets["targets"], targets["topk_ids"], targets["topk_logprobs"], targets["valid"],
                      loss_cfg, block_size)


class AcceptanceMeter:
    """Sums of per-position statistics over batches, turned into means and tau."""

    def __init__(self):
        self.alpha = self.greedy = self.count = self.loss = None

    def add(self, out: LossOutput) -> None:
        parts = (out.alpha_sum, out.greedy_sum, out.count.double(), out.loss_sum)
        if self.alpha is None:
            self.alpha, self.greedy, self.count, self.loss = (p.double().clone() for p in parts)
        else:
            for total, part in zip((self.alpha, self.greedy, self.count, self.loss), parts):
                total += part.double()

    def summary(self) -> dict:
        if self.count is None or self.count.sum() == 0:
            return {}
        count = self.count.clamp(min=1)
        alpha, greedy = (self.alpha / count), (self.greedy / count)
        return {
            "loss": float(self.loss.sum() / self.count.sum()),
            "alpha": [round(float(x), 5) for x in alpha],
            "greedy": [round(float(x), 5) for x in greedy],
            "tau": tau_from_alpha(alpha),
            "positions": int(self.count.sum()),
        }


@torch.no_grad()
def evaluate(model: DFlashDrafter, cache: Cache, data_cfg: DataConfig, loss_cfg: LossConfig,
             max_sequences: int, device: torch.device) -> dict:
    """Acceptance on held-out sequences (fixed anchors, no noise): alpha_k, greedy_k, tau."""
    was_training = model.training
    model.eval()
    meter = AcceptanceMeter()
    for batch in heldout_batches(cache, data_cfg, max_sequences):
        meter.add(batch_loss(model, batch.to(device), loss_cfg))
    model.train(was_training)
    return meter.summary()
