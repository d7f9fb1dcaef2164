"""A batch of blocks' loss (docs/design.md, "The objective"): ``block_loss`` assembles the
per-position terms of dflash_train.training.objectives into the weighted loss, the acceptance
sums the logs keep, DSpark's confidence BCE and DFlash2's selector term.

Every function here is a pure tensor function over one batch of blocks laid out per draft
position: column `p` of an `[M, P]` input is draft position `k = p + 1`, `P = block_size - 1`
(DFlash) or `block_size` (DSpark's sample_from_anchor, where the anchor slot predicts too).
The caller (dflash_train.training.batch_objective) gathers, for every block and column, the
drafter's final-norm output state of the slot that predicts `x_{a+k}`, that target token, the
teacher's top-k at `t = a + k - 1`, and whether the position is valid; for DSpark also the Markov
features and confidence logits (`DraftHeads`). The position weights are
dflash_train.training.weighting's.

Full-vocabulary logits are the memory hazard (production: vocab 248,320), so they only ever
exist for one chunk of valid positions at a time, and each chunk runs under activation
checkpointing so backward recomputes the chunk instead of keeping every chunk's logits alive.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dflash_train.settings.dflash2_config import DFlash2Config
from dflash_train.settings.lilicorr_config import LiLiCorrConfig
from dflash_train.settings.loss_config import LossConfig
from dflash_train.training.calibration import BIN_SUMS, bin_sums
from dflash_train.training.dflash2 import walk_terms
from dflash_train.training.objectives import chain_term, chunk_terms, onpolicy_split
from dflash_train.training.weighting import position_weights

CONFIDENCE_SUMS = ("loss_confidence", "predicted", "measured", *BIN_SUMS)
"""The names of LossOutput.confidence_sums, in the order meters keep them: the BCE, the predicted
and the trained-on acceptance, then the same by bin of the predicted value (the calibration's)."""

SELECTOR_SUMS = ("loss_selector", "selector_recall", "selector_hit", "selector_changed")
"""The names of LossOutput.selector_sums (DFlash2), in the order meters keep them: the selector's
cross-entropy, whether the teacher's top-1 was among the drafter's top-k, whether the selector
(teacher-forced) chose it from there, whether its choice differs from the drafter's top-1."""


@dataclass
class DraftHeads:
    """DSpark's additions to block_loss's inputs, all on the same [M, P] grid."""

    features: torch.Tensor | None = None
    """[M, P, r] Markov features; the logits get the bias `features @ bias_weight.T`."""

    bias_weight: torch.Tensor | None = None
    """[V, r] the Markov head's W2."""

    confidence: torch.Tensor | None = None
    """[M, P] confidence head logits of each position's acceptance."""

    confidence_alpha: float = 1.0
    """Weight of the confidence BCE in the loss."""

    confidence_target: str = "alpha"
    """"alpha" (sampling acceptance) or "greedy" (argmax equals the teacher's top-1)."""

    selector_context: torch.Tensor | None = None
    """[M, P, r] DFlash2's selector context P[prev] * W h of each position (teacher-forced prev)."""

    successor_codebook: torch.Tensor | None = None
    """[V, r] the selector's successor codebook S."""

    selector: DFlash2Config | None = None
    """DFlash2's settings: top-k, the unary scores' scale and cap, the selector loss's weight."""

    lattice_scores: torch.Tensor | None = None
    """[M, P, k] LiLiCorr's walk scores of each position's candidates along the teacher-forced path."""

    lattice_ids: torch.Tensor | None = None
    """[M, P, k] LiLiCorr's candidates of each position."""

    lattice: LiLiCorrConfig | None = None
    """LiLiCorr's settings: the correlator loss's target and weight."""

    @property
    def walk_alpha(self) -> float | None:
        """The weight of the candidate walk's loss (DFlash2's selector, LiLiCorr's correlator), None without one."""
        if self.selector is not None:
            return self.selector.selector_loss_alpha
        return None if self.lattice is None else self.lattice.loss_alpha


@dataclass
class LossOutput:
    """One batch's loss plus detached per-block-position sums, so logs can aggregate across
    steps (divide a sum by `count` for a mean). Column `p` is block position `k = p + 1`."""

    loss: torch.Tensor
    """Scalar loss with a gradient path: sum(w * loss) / number of valid positions."""

    alpha_sum: torch.Tensor
    """[P] float32: sum over valid positions of the sampling acceptance estimate alpha."""

    greedy_sum: torch.Tensor
    """[P] float32: number of valid positions whose drafter argmax is the teacher's top-1."""

    count: torch.Tensor
    """[P] int64: number of valid positions."""

    loss_sum: torch.Tensor
    """[P] float32: sum over valid positions of the unweighted per-position loss."""

    term_sums: dict[str, torch.Tensor] = field(default_factory=dict)
    """[P] float32 sums of each term's unweighted value, when the loss has several terms."""

    confidence_sums: dict[str, torch.Tensor] = field(default_factory=dict)
    """With a confidence head, [P] float32 sums of its BCE ("loss_confidence"), its predicted
    acceptance ("predicted"), the acceptance it is trained on ("measured") and both by bin of the
    predicted value (dflash_train.training.calibration.BIN_SUMS)."""

    selector_sums: dict[str, torch.Tensor] = field(default_factory=dict)
    """With DFlash2's selector, [P] float32 sums named by SELECTOR_SUMS."""

    @staticmethod
    def tau_from_alpha(alpha_mean: torch.Tensor | Sequence[float]) -> float:
        """Expected acceptance length from per-position mean acceptance; see tau_from_alpha."""
        return tau_from_alpha(alpha_mean)


def tau_from_alpha(alpha_mean: torch.Tensor | Sequence[float]) -> float:
    """Expected accepted length `1 + sum_k prod_{j<=k} alpha_j` for per-position mean
    acceptance `alpha_mean[k - 1]`: position k is accepted only if every position before it
    was, and the anchor's verified token always counts as one."""
    alpha = torch.as_tensor(alpha_mean, dtype=torch.float64).reshape(-1)
    return float(1.0 + torch.cumprod(alpha, dim=0).sum())


def _check_inputs(states: torch.Tensor, lm_head_weight: torch.Tensor, targets: torch.Tensor, topk_ids: torch.Tensor,
                  topk_logprobs: torch.Tensor, valid: torch.Tensor, block_size: int, heads: DraftHeads) -> None:
    """Shapes of block_loss's inputs, each refused with the shape it should have."""
    if states.dim() != 3:
        raise ValueError(f"states must be [M, P, H], got shape {tuple(states.shape)}")
    num_blocks, num_positions, hidden = states.shape
    if num_positions not in (block_size - 1, block_size):
        raise ValueError(
            f"states has {num_positions} draft positions, block_size {block_size} needs {block_size - 1} "
            f"(or {block_size} when the anchor slot predicts)"
        )
    if lm_head_weight.dim() != 2 or lm_head_weight.shape[1] != hidden:
        raise ValueError(f"lm_head_weight must be [V, {hidden}], got shape {tuple(lm_head_weight.shape)}")
    grid = (num_blocks, num_positions)
    for name, tensor in (("targets", targets), ("valid", valid)):
        if tuple(tensor.shape) != grid:
            raise ValueError(f"{name} must be [M, P] = {list(grid)}, got shape {tuple(tensor.shape)}")
    if topk_ids.dim() != 3 or tuple(topk_ids.shape[:2]) != grid or topk_ids.shape[2] < 1:
        raise ValueError(
            f"topk_ids must be [M, P, k] with M, P = {list(grid)}, got shape {tuple(topk_ids.shape)}"
        )
    if tuple(topk_logprobs.shape) != tuple(topk_ids.shape):
        raise ValueError(
            f"topk_logprobs shape {tuple(topk_logprobs.shape)} differs from "
            f"topk_ids shape {tuple(topk_ids.shape)}"
        )
    if (heads.features is None) != (heads.bias_weight is None):
        raise ValueError("DraftHeads needs features and bias_weight together, or neither")
    if heads.features is not None and (tuple(heads.features.shape[:2]) != grid
                                       or heads.bias_weight.shape != (lm_head_weight.shape[0], heads.features.shape[2])):
        raise ValueError(f"Markov features must be [M, P, r] with M, P = {list(grid)} and bias_weight [V, r], got "
                         f"{tuple(heads.features.shape)} and {tuple(heads.bias_weight.shape)}")
    if heads.confidence is not None and tuple(heads.confidence.shape) != grid:
        raise ValueError(f"confidence logits must be [M, P] = {list(grid)}, got {tuple(heads.confidence.shape)}")


def block_loss(
    states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    valid: torch.Tensor,
    cfg: LossConfig,
    block_size: int,
    heads: DraftHeads | None = None,
    rows: torch.Tensor | None = None,
) -> LossOutput:
    """Weighted training loss of a batch of blocks.

    states [M, P, H]: drafter outputs after its final norm; lm_head_weight [V, H]: the
    teacher's frozen LM head (keep it fp32 to avoid a per-chunk upcast); targets [M, P]:
    x_{a+k}; topk_ids / topk_logprobs [M, P, k]: the teacher's distinct top-k ids and
    log-probs at t = a+k-1; valid [M, P] bool. Values at invalid positions are never read, so
    they may hold padding. P is block_size - 1, or block_size when the anchor slot predicts.
    `heads` adds DSpark's Markov bias to the logits and its confidence BCE (weighted by
    confidence_alpha, a mean over valid positions) to the loss. `rows`: valid's flat indices as the
    trainer found them on the host (Batch.valid_rows); else found here, a host wait.
    """
    heads = heads or DraftHeads()
    _check_inputs(states, lm_head_weight, targets, topk_ids, topk_logprobs, valid, block_size, heads)
    num_blocks, num_positions, _ = states.shape
    valid = valid.bool()
    rows = valid.reshape(-1).nonzero().squeeze(1) if rows is None else rows
    if (num_valid := int(rows.numel())) == 0:  # the shape: known to the host either way
        return _empty_output(states, heads, cfg, num_positions)

    weights_by_term = cfg.term_weights()
    names = _computed_terms(weights_by_term)
    per_term, alpha, greedy, confidence, selector = _valid_position_terms(
        states, lm_head_weight, targets, topk_ids, topk_logprobs, rows, heads, cfg, names)
    grid = (num_blocks, num_positions)
    terms = _block_terms(dict(zip(names, per_term)), weights_by_term, greedy, rows, valid, cfg)
    # the chain is its own weighting (a product along the block): the position weights skip it
    weighted = sum(weight * terms[name] for name, weight in weights_by_term.items() if name != "chain")
    unweighted = weights_by_term["chain"] * terms["chain"] if "chain" in weights_by_term else 0.0

    weights = position_weights(_on_grid(alpha, rows, grid), valid, cfg, block_size, _on_grid(confidence, rows, grid))
    loss = (weights.reshape(-1).index_select(0, rows) * weighted + unweighted).sum() / num_valid

    columns = rows % num_positions
    extras, confidence_sums, selector_sums = _head_terms(heads, rows, columns, num_positions, alpha, greedy,
                                                         weights.reshape(-1).index_select(0, rows), selector)
    for extra in extras:
        loss = loss + extra / num_valid
    return LossOutput(
        loss=loss,
        alpha_sum=_sum_per_column(alpha, columns, num_positions),
        greedy_sum=_sum_per_column(greedy, columns, num_positions),
        count=_count_per_column(columns, num_positions),
        loss_sum=_sum_per_column(weighted + unweighted, columns, num_positions),
        term_sums={name: _sum_per_column(terms[name], columns, num_positions) for name in weights_by_term}
        if len(weights_by_term) > 1 else {},
        confidence_sums=confidence_sums,
        selector_sums=selector_sums,
    )


def _count_per_column(columns: torch.Tensor, num_positions: int) -> torch.Tensor:
    """Valid positions per block column. Not bincount: on CUDA it reads its input's maximum back
    to size its output."""
    return torch.zeros(num_positions, dtype=torch.long, device=columns.device).index_add_(0, columns, torch.ones_like(columns))


def _head_terms(heads: DraftHeads, rows: torch.Tensor, columns: torch.Tensor, num_positions: int, alpha: torch.Tensor,
                greedy: torch.Tensor, weights: torch.Tensor,
                selector: torch.Tensor) -> tuple[list[torch.Tensor], dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """What the heads add to block_loss: sums over valid positions (block_loss divides each by
    their count) of DSpark's weighted confidence BCE and DFlash2's weighted selector term, and
    their per-column sums (empty without the head). ``weights``: the valid positions' weights."""
    extras = []
    confidence_sums, selector_sums = {}, {}
    if heads.confidence is not None:
        bce, predicted, measured = _confidence_bce(heads, rows, alpha, greedy)
        extras.append(heads.confidence_alpha * bce.sum())
        confidence_sums = {name: _sum_per_column(value, columns, num_positions) for name, value in
                           zip(CONFIDENCE_SUMS, (bce, predicted, measured))}
        confidence_sums.update(bin_sums(predicted, measured, columns, num_positions))
    if heads.walk_alpha is not None:
        # weighted per position as the backbone's loss, as speculators weights its selector term
        extras.append(heads.walk_alpha * (weights * selector[0]).sum())
        selector_sums = {name: _sum_per_column(value, columns, num_positions)
                         for name, value in zip(SELECTOR_SUMS, selector)}
    return extras, confidence_sums, selector_sums


def _empty_output(states: torch.Tensor, heads: DraftHeads, cfg: LossConfig, num_positions: int) -> LossOutput:
    """block_loss of a batch without a valid position: zero sums and a zero loss."""
    zeros = torch.zeros(num_positions, dtype=torch.float32, device=states.device)
    connected = [t for t in (states, heads.features, heads.confidence, heads.selector_context, heads.bias_weight,
                             heads.successor_codebook, heads.lattice_scores) if t is not None]
    return LossOutput(
        # An empty sum keeps the graph connected, so backward still reaches every parameter, the
        # weights only the loss reads (bias_weight, successor_codebook) too: under DDP or FSDP2
        # the other ranks' gradient reduction waits for them
        loss=sum(t.reshape(-1)[:0].float().sum() for t in connected),
        alpha_sum=zeros,
        greedy_sum=zeros.clone(),
        count=torch.zeros(num_positions, dtype=torch.long, device=states.device),
        loss_sum=zeros.clone(),
        term_sums={name: zeros.clone() for name in cfg.term_weights()} if len(cfg.term_weights()) > 1 else {},
        confidence_sums={name: zeros.clone() for name in CONFIDENCE_SUMS} if heads.confidence is not None else {},
        selector_sums={name: zeros.clone() for name in SELECTOR_SUMS} if heads.walk_alpha is not None else {},
    )


def _valid_position_terms(
    states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    targets: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    rows: torch.Tensor,
    heads: DraftHeads,
    cfg: LossConfig,
    names: tuple[str, ...],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """chunk_terms over the valid positions (flat indices `rows` of the [M, P] grid), one chunk of
    full-vocabulary logits at a time: ([T, n] terms, alpha, greedy, confidence, [4 or 0, T]
    selector values: DFlash2's from the logits, LiLiCorr's from its scores), alpha and confidence
    detached."""
    num_blocks, num_positions, hidden = states.shape
    valid_states = states.reshape(-1, hidden).index_select(0, rows)
    valid_targets = targets.reshape(-1).index_select(0, rows).long()
    valid_ids = topk_ids.reshape(num_blocks * num_positions, -1).index_select(0, rows).long()
    valid_logprobs = topk_logprobs.reshape(num_blocks * num_positions, -1).index_select(0, rows)
    valid_features = (None if heads.features is None
                      else heads.features.reshape(num_blocks * num_positions, -1).index_select(0, rows))
    valid_context = (None if heads.selector_context is None
                     else heads.selector_context.reshape(num_blocks * num_positions, -1).index_select(0, rows))
    # With k >= V the top-k is the whole vocabulary and there is no tail bucket to compare.
    has_tail = valid_ids.shape[1] < lm_head_weight.shape[0]
    recompute = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (states, lm_head_weight, valid_features, valid_context,
                                                     heads.successor_codebook))

    parts: list[tuple[torch.Tensor, ...]] = []
    step = cfg.positions_per_chunk(lm_head_weight.shape[0])
    for start in range(0, int(rows.numel()), step):
        piece = slice(start, start + step)
        args = (valid_states[piece], lm_head_weight, None if valid_features is None else valid_features[piece],
                heads.bias_weight, valid_targets[piece], valid_ids[piece], valid_logprobs[piece], names,
                float(cfg.lk_eta), has_tail, cfg.head_matmul, None if valid_context is None else valid_context[piece],
                heads.successor_codebook, heads.selector, float(cfg.temperature))
        parts.append(checkpoint(chunk_terms, *args, use_reentrant=False) if recompute else chunk_terms(*args))
    per_term, alpha, greedy, confidence, selector = (torch.cat(piece, dim=-1) for piece in zip(*parts))
    if heads.lattice is not None:  # LiLiCorr's walk values, from its scores along the path
        selector = walk_terms(*(t.reshape(num_blocks * num_positions, -1).index_select(0, rows)
                                for t in (heads.lattice_scores, heads.lattice_ids)),
                              valid_ids, valid_logprobs, lm_head_weight.shape[0], heads.lattice.target)
    return per_term, alpha.detach(), greedy, confidence.detach(), selector


def _block_terms(terms: dict[str, torch.Tensor], weights_by_term: dict[str, float], greedy: torch.Tensor,
                 rows: torch.Tensor, valid: torch.Tensor, cfg: LossConfig) -> dict[str, torch.Tensor]:
    """The per-valid-position terms with those that need whole blocks joined from chunk_terms'
    parts: onpolicy_kl from its kl and rkl halves, chain from its per-position alphas."""
    if "onpolicy_kl" in weights_by_term:
        terms["onpolicy_kl"] = _onpolicy_kl(terms, greedy, rows, valid, cfg.onpolicy_decay)
    if "chain" in weights_by_term:
        alpha = _on_grid(terms["chain"], rows, tuple(valid.shape), detach=False)
        terms["chain"] = chain_term(alpha, valid).reshape(-1).index_select(0, rows)
    return terms


def _onpolicy_kl(terms: dict[str, torch.Tensor], greedy: torch.Tensor, rows: torch.Tensor, valid: torch.Tensor,
                 decay: float) -> torch.Tensor:
    """Per-valid-position onpolicy_kl from its kl and rkl halves: forward KL where the drafter's own
    greedy block is accepted, decayed reverse KL after its first rejection (see onpolicy_split)."""
    hits = _on_grid(greedy, rows, tuple(valid.shape)).bool()
    accepted, factor = (t.reshape(-1).index_select(0, rows) for t in onpolicy_split(hits, valid, decay))
    return torch.where(accepted, terms["kl"], factor * terms["rkl"])


def _confidence_bce(heads: DraftHeads, rows: torch.Tensor, alpha: torch.Tensor,
                    greedy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-valid-position (BCE of the confidence head, its predicted acceptance, the acceptance it
    is trained on: alpha or the greedy hit, per heads.confidence_target)."""
    logit = heads.confidence.reshape(-1).index_select(0, rows).float()
    measured = alpha if heads.confidence_target == "alpha" else greedy.detach()
    bce = F.binary_cross_entropy_with_logits(logit, measured, reduction="none")
    return bce, torch.sigmoid(logit), measured


def _computed_terms(weights_by_term: dict[str, float]) -> tuple[str, ...]:
    """The terms chunk_terms computes: the loss's own, onpolicy_kl as its kl and rkl halves."""
    names = set(weights_by_term) - {"onpolicy_kl"}
    if "onpolicy_kl" in weights_by_term:
        names |= {"kl", "rkl"}
    return tuple(sorted(names))


def _on_grid(values: torch.Tensor, rows: torch.Tensor, grid: tuple[int, int], detach: bool = True) -> torch.Tensor:
    """[M, P] float32 grid holding per-valid-position values at their rows, 0 elsewhere (with their
    gradient when not detach)."""
    flat = torch.zeros(grid[0] * grid[1], dtype=torch.float32, device=values.device)
    return flat.index_copy(0, rows, (values.detach() if detach else values).float()).view(grid)


def _sum_per_column(values: torch.Tensor, columns: torch.Tensor, num_positions: int) -> torch.Tensor:
    """[P] detached float32 sums of per-valid-position values by block column."""
    totals = torch.zeros(num_positions, dtype=torch.float32, device=values.device)
    return totals.index_add(0, columns, values.detach().float())


# --- the objective of one batch: the drafter's forward, then the loss above ---------------------------
