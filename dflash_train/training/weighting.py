"""The position weightings of the drafter's loss (docs/design.md, "The objective"): how much each
draft position of a block counts, per LossConfig.weighting. "decay" discounts later positions
by a fixed length gamma, "streak" by the drafter's estimated chance of reaching them, "dpace" by
how much the expected accepted length moves with them, "first_error" by the chance that the
block's first rejection falls on them; all are detached, so they steer the
gradient without being trained through.
"""

from __future__ import annotations

import torch

from dflash_common.errors import ConfigError
from dflash_common.values import is_int
from dflash_train.settings.loss_config import LossConfig

# docs/design.md's (block size, gamma) pairs; other block sizes interpolate between them.
_GAMMA_ANCHORS = ((8, 4.0), (10, 5.0), (16, 7.0))


def default_gamma(block_size: int) -> float:
    """Decay length for a block size: 4 at B=8, 5 at B=10, 7 at B=16 (docs/design.md), linear
    between those points and extended beyond them with the nearest segment's slope
    (B=4 -> 2, B=12 -> 5.67, B=32 -> 12.33), never below 1."""
    if not is_int(block_size) or block_size < 2:
        raise ConfigError(f"block_size {block_size!r} is not an integer >= 2 (pass e.g. 16)")
    middle_block_size = _GAMMA_ANCHORS[1][0]
    segment = _GAMMA_ANCHORS[:2] if block_size <= middle_block_size else _GAMMA_ANCHORS[1:]
    (b0, g0), (b1, g1) = segment
    return max(1.0, g0 + (g1 - g0) * (block_size - b0) / (b1 - b0))


def resolve_gamma(cfg: LossConfig, block_size: int) -> float:
    """The configured gamma, or the block size's default when the config leaves it None."""
    return float(cfg.gamma) if cfg.gamma is not None else default_gamma(block_size)


def decay_weights(num_positions: int, gamma: float) -> torch.Tensor:
    """[num_positions] float32 weights `exp(-(k - 1) / gamma)` for block positions k = 1..P."""
    offsets = torch.arange(num_positions, dtype=torch.float64)
    return torch.exp(-offsets / gamma).to(torch.float32)


def streak_weights(alpha: torch.Tensor, valid: torch.Tensor, smoothing: float) -> torch.Tensor:
    """[M, P] detached weights `prod_{j<k} alpha~_j`, alpha~ = s + (1 - s) * alpha.

    An invalid position counts as alpha~ = 1: it is either past the end of the sequence (so
    every later position is invalid too and the value is irrelevant) or a token the drafter is
    not trained on (loss_mask 0), for which there is no acceptance estimate. Treating it as
    neutral keeps such a gap from erasing the training signal of the valid positions after it.
    """
    smoothed = smoothing + (1.0 - smoothing) * alpha.detach().to(torch.float32)
    smoothed = torch.where(valid.bool(), smoothed, torch.ones_like(smoothed))
    reach = torch.cumprod(smoothed, dim=1)
    # Position k's weight multiplies the positions strictly before it, so shift by one.
    return torch.cat([torch.ones_like(reach[:, :1]), reach[:, :-1]], dim=1)


def dpace_weights(confidence: torch.Tensor, valid: torch.Tensor, smoothing: float) -> torch.Tensor:
    """[M, P] detached D-PACE weights `sum_{j>=k} prod_{i<=j} c~_i` over valid j, c~ = s + (1 - s) * c.

    Position k's weight is how much the expected accepted length `sum_j prod_{i<=j} c_i` moves with
    log c_k: every later position is reached only through k. As in streak_weights, an invalid
    position counts as c~ = 1 and adds nothing to the sums; its own weight is 0.
    """
    mask = valid.bool()
    smoothed = smoothing + (1.0 - smoothing) * confidence.detach().to(torch.float32)
    smoothed = torch.where(mask, smoothed, torch.ones_like(smoothed))
    reach = torch.cumprod(smoothed, dim=1) * mask
    return reach.flip(1).cumsum(1).flip(1) * mask


def first_error_weights(alpha: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[M, P] detached weights `(prod_{i<k} alpha_i) * (1 - alpha_k)`: the probability that the
    block's first rejection is at position k, so the loss concentrates where the block is first
    likely to break (our reading of arXiv 2606.11552's first-error focal weighting: the paper was
    not at hand, and it has no smoothing or exponent here; LossConfig.min_weight floors it). An
    invalid position is neutral on the way, as in streak_weights, and its own weight is 0."""
    alpha = alpha.detach().to(torch.float32)
    miss = torch.where(valid.bool(), 1.0 - alpha, torch.zeros_like(alpha))
    return streak_weights(alpha, valid, 0.0) * miss


def position_weights(
    alpha: torch.Tensor, valid: torch.Tensor, cfg: LossConfig, block_size: int,
    confidence: torch.Tensor | None = None,
) -> torch.Tensor:
    """[M, P] detached weights for every block position under cfg.weighting (values at invalid
    positions are defined but unused). confidence [M, P] is the drafter's probability of the true
    token, which dpace needs."""
    num_blocks, num_positions = valid.shape
    if cfg.weighting == "none":
        weights = torch.ones(num_blocks, num_positions, device=valid.device)
    elif cfg.weighting == "dpace":
        if confidence is None:
            raise ValueError("dpace weights need the drafter's confidence per position")
        weights = dpace_weights(confidence, valid, cfg.dpace_smoothing)
    elif cfg.weighting == "first_error":
        weights = first_error_weights(alpha, valid)
    else:
        # non_blocking: a blocking copy would make the host wait for the step queued before it
        decay = decay_weights(num_positions, resolve_gamma(cfg, block_size)).to(valid.device, non_blocking=True)
        if cfg.weighting == "decay":
            weights = decay.expand(num_blocks, num_positions).clone()
        else:
            weights = streak_weights(alpha, valid, cfg.streak_smoothing)
            weights = weights * decay if cfg.streak_decay else weights
    return weights.clamp(min=cfg.min_weight)
