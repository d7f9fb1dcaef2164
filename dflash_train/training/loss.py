"""The drafter's training objective (docs/design.md, "The objective").

Every function here is a pure tensor function over one batch of blocks laid out per draft
position: column `p` of an `[M, P]` input is draft position `k = p + 1`, `P = block_size - 1`
(DFlash) or `block_size` (DSpark's sample_from_anchor, where the anchor slot predicts too).
The caller gathers, for every block and column, the drafter's final-norm output state of the
slot that predicts `x_{a+k}`, that target token, the teacher's top-k at `t = a + k - 1`, and
whether the position is valid; for DSpark also the Markov features and confidence logits
(`DraftHeads`). This module turns that into the loss, the acceptance estimates and the
confidence head's BCE term (the position weights it applies are dflash_train.training.weighting's).
`batch_loss`, at the end, is the training objective of one batch: the batch's targets
(`block_targets`, read from the loader's Batch here, so data flows loader -> model -> loss), the drafter's forward
(`block_states`) gathered into those inputs, then the loss.

Full-vocabulary logits are the memory hazard (production: vocab 248,320), so they only ever
exist for one chunk of valid positions at a time, and each chunk runs under activation
checkpointing so backward recomputes the chunk instead of keeping every chunk's logits alive.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dflash_train.settings.dflash2_config import DFlash2Config
from dflash_train.settings.loss_config import (
    LossConfig,
)
from dflash_train.training.dflash2 import training_candidates, unary_scores
from dflash_train.training.weighting import (
    position_weights,
)

if TYPE_CHECKING:
    from dflash_train.training.data import Batch
    from dflash_train.training.model import DFlashDrafter

# -log(alpha) is floored here: a drafter that puts no mass on any of the teacher's buckets would
# otherwise give an infinite loss and a NaN gradient.
_NLA_FLOOR = 1e-5
# log of a teacher bucket that holds no mass (a tail the top-k emptied), for the reverse
# divergences, whose drafter-side mass there would otherwise cost infinitely.
_LOG_EMPTY = math.log(1e-30)





CONFIDENCE_SUMS = ("loss_confidence", "predicted", "measured")
"""The names of LossOutput.confidence_sums, in the order meters keep them."""

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


def set_head_matmul(head_matmul: str, device: torch.device) -> None:
    """Let CUDA's fp32 matmuls (under bf16 autocast only the LM head in the loss) use TF32."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = head_matmul == "tf32"


class _Bf16HeadLogits(torch.autograd.Function):
    """fp32 logits of bf16 states and a bf16 head, accumulated in fp32 by cuBLAS (mm's out_dtype);
    the head is frozen, so only the states get a gradient (bf16 inputs, fp32 accumulation too)."""

    @staticmethod
    def forward(ctx, states: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
        half = states.to(torch.bfloat16)
        ctx.save_for_backward(head)
        ctx.states_dtype = states.dtype
        return torch.mm(half, head.to(torch.bfloat16).T, out_dtype=torch.float32)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (head,) = ctx.saved_tensors
        grad_states = torch.mm(grad.to(torch.bfloat16), head.to(torch.bfloat16), out_dtype=torch.float32)
        return grad_states.to(ctx.states_dtype), None


def head_logits(states: torch.Tensor, lm_head_weight: torch.Tensor, head_matmul: str = "fp32") -> torch.Tensor:
    """fp32 logits [T, V] of states [T, H] through the frozen LM head [V, H] in the loss's
    head_matmul precision (tf32 is fp32 here: set_head_matmul lets CUDA's fp32 matmuls use it).
    bf16: on CUDA a bf16 GEMM with fp32 accumulation; elsewhere the same numbers computed in
    fp32 from the bf16-rounded inputs (a product of two bf16 values is exact in fp32)."""
    if head_matmul != "bf16":
        return states.float() @ lm_head_weight.float().T
    if states.is_cuda:
        return _Bf16HeadLogits.apply(states, lm_head_weight)
    return states.to(torch.bfloat16).float() @ lm_head_weight.to(torch.bfloat16).float().T


def head_dtype(head_matmul: str, device: torch.device) -> torch.dtype:
    """The dtype the frozen LM head is held in: bf16 for head_matmul "bf16" on CUDA, else fp32."""
    return torch.bfloat16 if head_matmul == "bf16" and device.type == "cuda" else torch.float32


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
    acceptance ("predicted") and the acceptance it is trained on ("measured")."""

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


def bucket_kl(
    teacher_p: torch.Tensor,
    log_q: torch.Tensor,
    teacher_tail: torch.Tensor | None,
    log_q_tail: torch.Tensor | None,
) -> torch.Tensor:
    """[n] KL(p || q) over the k top-k buckets plus the tail bucket (omitted when None).

    teacher_p [n, k] and teacher_tail [n] are probabilities; log_q [n, k] and log_q_tail [n]
    are the drafter's log-probabilities of the same buckets. 0 * log 0 counts as 0, and the
    top-k is never renormalised: that would reward moving the tail's mass into the top-k.
    """
    kl = (torch.xlogy(teacher_p, teacher_p) - teacher_p * log_q).sum(-1)
    if teacher_tail is not None:
        kl = kl + torch.xlogy(teacher_tail, teacher_tail) - teacher_tail * log_q_tail
    return kl


def bucket_alpha(teacher_p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """[n] acceptance rate alpha = sum_b min(p_b, q_b) over buckets [n, b] (the top-k ids, then
    the tail): the one definition of alpha, which the offline tau, the position weights and the
    tv, nla and lk_hybrid terms share. Within the tail mass may overlap token by token, so this
    is a lower bound of the full-vocabulary overlap, exact when the top-k covers the vocabulary."""
    return torch.minimum(teacher_p, q).sum(-1)


def _bucket_terms(names: Sequence[str], teacher_logp: torch.Tensor, log_q: torch.Tensor, ce: torch.Tensor,
                  lk_eta: float) -> dict[str, torch.Tensor]:
    """[n] per-position values of the named terms from bucket log-probabilities [n, b] (the
    top-k buckets, then the tail bucket if any) of the teacher and the drafter."""
    p, q = teacher_logp.exp(), log_q.exp()
    out: dict[str, torch.Tensor] = {}
    alpha = bucket_alpha(p, q)
    kl = bucket_kl(p, log_q, None, None)
    for name in names:
        if name == "ce":
            out[name] = ce
        elif name == "kl":
            out[name] = kl
        elif name == "tv":
            out[name] = 1.0 - alpha
        elif name == "nla":
            out[name] = -torch.log(alpha.clamp(min=_NLA_FLOOR))
        elif name == "lk_hybrid":
            blend = torch.exp(-lk_eta * alpha.detach())
            out[name] = blend * kl + (1.0 - blend) * (1.0 - alpha)
        elif name == "rkl":
            out[name] = (q * (log_q - teacher_logp.clamp(min=_LOG_EMPTY))).sum(-1)
        elif name == "jsd":
            log_m = torch.logaddexp(teacher_logp, log_q) - math.log(2.0)
            out[name] = 0.5 * ((torch.xlogy(p, p) - p * log_m).sum(-1) + (q * (log_q - log_m)).sum(-1))
    return out


def _chunk_terms(
    states: torch.Tensor,
    lm_head_weight: torch.Tensor,
    features: torch.Tensor | None,
    bias_weight: torch.Tensor | None,
    targets: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_logprobs: torch.Tensor,
    names: tuple[str, ...],
    lk_eta: float,
    has_tail: bool,
    head_matmul: str = "fp32",
    selector_context: torch.Tensor | None = None,
    successor_codebook: torch.Tensor | None = None,
    selector: DFlash2Config | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-position ([T, n] terms in the order of `names`, alpha, greedy, confidence, selector
    values [4, T] named by SELECTOR_SUMS, or [0, T] without a selector) for n gathered valid
    positions; the only place full-vocabulary logits exist. Runs under checkpoint, so it must stay
    deterministic. onpolicy_kl needs whole blocks, so it comes back as its two halves, kl and rkl,
    which block_loss joins."""
    # Autocast would silently run the LM head in bf16; the buckets need fp32 logits.
    with torch.autocast(device_type=states.device.type, enabled=False):
        logits = head_logits(states, lm_head_weight, head_matmul)
        if features is not None:
            logits = logits + features.float() @ bias_weight.float().T
        log_norm = torch.logsumexp(logits, dim=-1)
        log_q = logits.gather(1, topk_ids) - log_norm[:, None]
        teacher_logp = topk_logprobs.float()
        if has_tail:
            teacher_tail = (1.0 - teacher_logp.exp().sum(-1)).clamp(min=0.0)
            # log(1 - sum q) cancels catastrophically when the top-k holds nearly all the mass.
            outside_topk = logits.scatter(1, topk_ids, float("-inf"))
            log_q_tail = torch.logsumexp(outside_topk, dim=-1) - log_norm
            log_q = torch.cat([log_q, log_q_tail[:, None]], dim=1)
            # log(0) = -inf is what an empty tail is; xlogy and the clamps below handle it
            teacher_logp = torch.cat([teacher_logp, torch.log(teacher_tail)[:, None]], dim=1)
        ce = log_norm - logits.gather(1, targets[:, None]).squeeze(1)
        terms = _bucket_terms(names, teacher_logp, log_q, ce, lk_eta)
        per_term = torch.stack([terms[name] for name in names])

        with torch.no_grad():
            alpha = bucket_alpha(teacher_logp.exp(), log_q.exp())
            greedy = (logits.argmax(dim=-1) == topk_ids[:, 0]).to(torch.float32)
            confidence = torch.exp(-ce)
        selected = (logits.new_zeros(0, logits.shape[0]) if selector is None
                    else selector_terms(logits, selector_context, successor_codebook, topk_ids[:, 0], selector))
    return per_term, alpha, greedy, confidence, selected


def selector_terms(logits: torch.Tensor, context: torch.Tensor, successor_codebook: torch.Tensor,
                   target_ids: torch.Tensor, selector: DFlash2Config) -> torch.Tensor:
    """DFlash2's selector objective as speculators defines it, per position [4, T] (SELECTOR_SUMS'
    order): the K-way cross-entropy of the teacher's top-1 among the drafter's top-k candidates
    (put in the last slot where the top-k misses it), scored `unary + <context, S[candidate]>`,
    then, without gradient, recall, the selector's hit and whether its choice left the top-1."""
    candidates, index, contains = training_candidates(logits.topk(selector.selector_top_k, dim=-1).indices, target_ids)
    unary = unary_scores(logits.gather(1, candidates), selector)
    scores = unary + (successor_codebook[candidates].float() * context.float().unsqueeze(1)).sum(-1)
    ce = F.cross_entropy(scores, index, reduction="none")
    with torch.no_grad():
        choice = scores.argmax(-1)
        hit = (choice == index) & contains
    return torch.stack([ce, contains.float(), hit.float(), (choice != 0).float()])


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
) -> LossOutput:
    """Weighted training loss of a batch of blocks.

    states [M, P, H]: drafter outputs after its final norm; lm_head_weight [V, H]: the
    teacher's frozen LM head (keep it fp32 to avoid a per-chunk upcast); targets [M, P]:
    x_{a+k}; topk_ids / topk_logprobs [M, P, k]: the teacher's distinct top-k ids and
    log-probs at t = a+k-1; valid [M, P] bool. Values at invalid positions are never read, so
    they may hold padding. P is block_size - 1, or block_size when the anchor slot predicts.
    `heads` adds DSpark's Markov bias to the logits and its confidence BCE (weighted by
    confidence_alpha, a mean over valid positions) to the loss.
    """
    heads = heads or DraftHeads()
    _check_inputs(states, lm_head_weight, targets, topk_ids, topk_logprobs, valid, block_size, heads)
    num_blocks, num_positions, _ = states.shape
    valid = valid.bool()
    rows = valid.reshape(-1).nonzero().squeeze(1)
    num_valid = int(rows.numel())
    if num_valid == 0:
        return _empty_output(states, heads, cfg, num_positions)

    weights_by_term = cfg.term_weights()
    names = _computed_terms(weights_by_term)
    per_term, alpha, greedy, confidence, selector = _valid_position_terms(
        states, lm_head_weight, targets, topk_ids, topk_logprobs, rows, heads, cfg, names)
    grid = (num_blocks, num_positions)
    terms = dict(zip(names, per_term))
    if "onpolicy_kl" in weights_by_term:
        terms["onpolicy_kl"] = _onpolicy_kl(terms, greedy, rows, valid, cfg.onpolicy_decay)
    per_position = sum(weight * terms[name] for name, weight in weights_by_term.items())

    weights = position_weights(_on_grid(alpha, rows, grid), valid, cfg, block_size, _on_grid(confidence, rows, grid))
    loss = (weights.reshape(-1).index_select(0, rows) * per_position).sum() / num_valid

    columns = rows % num_positions
    confidence_sums = {}
    if heads.confidence is not None:
        bce, predicted, measured = _confidence_bce(heads, rows, alpha, greedy)
        loss = loss + heads.confidence_alpha * bce.sum() / num_valid
        confidence_sums = {name: _sum_per_column(value, columns, num_positions) for name, value in
                           zip(CONFIDENCE_SUMS, (bce, predicted, measured))}
    selector_sums = {}
    if heads.selector is not None:
        # weighted per position as the backbone's loss, as speculators weights its selector term
        selected = weights.reshape(-1).index_select(0, rows) * selector[0]
        loss = loss + heads.selector.selector_loss_alpha * selected.sum() / num_valid
        selector_sums = {name: _sum_per_column(value, columns, num_positions)
                         for name, value in zip(SELECTOR_SUMS, selector)}
    return LossOutput(
        loss=loss,
        alpha_sum=_sum_per_column(alpha, columns, num_positions),
        greedy_sum=_sum_per_column(greedy, columns, num_positions),
        count=torch.bincount(columns, minlength=num_positions),
        loss_sum=_sum_per_column(per_position, columns, num_positions),
        term_sums={name: _sum_per_column(terms[name], columns, num_positions) for name in weights_by_term}
        if len(weights_by_term) > 1 else {},
        confidence_sums=confidence_sums,
        selector_sums=selector_sums,
    )


def _empty_output(states: torch.Tensor, heads: DraftHeads, cfg: LossConfig, num_positions: int) -> LossOutput:
    """block_loss of a batch without a valid position: zero sums and a zero loss."""
    zeros = torch.zeros(num_positions, dtype=torch.float32, device=states.device)
    connected = [t for t in (states, heads.features, heads.confidence, heads.selector_context, heads.bias_weight,
                             heads.successor_codebook) if t is not None]
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
        selector_sums={name: zeros.clone() for name in SELECTOR_SUMS} if heads.selector is not None else {},
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
    """_chunk_terms over the valid positions (flat indices `rows` of the [M, P] grid), one chunk of
    full-vocabulary logits at a time: ([T, n] terms, alpha, greedy, confidence, [4 or 0, T]
    selector values), alpha and confidence detached."""
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
                heads.successor_codebook, heads.selector)
        parts.append(checkpoint(_chunk_terms, *args, use_reentrant=False) if recompute else _chunk_terms(*args))
    per_term, alpha, greedy, confidence, selector = (torch.cat(piece, dim=-1) for piece in zip(*parts))
    return per_term, alpha.detach(), greedy, confidence.detach(), selector


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
    """The terms _chunk_terms computes: the loss's own, onpolicy_kl as its kl and rkl halves."""
    names = set(weights_by_term) - {"onpolicy_kl"}
    if "onpolicy_kl" in weights_by_term:
        names |= {"kl", "rkl"}
    return tuple(sorted(names))


def _on_grid(values: torch.Tensor, rows: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """[M, P] float32 grid holding per-valid-position values at their rows, 0 elsewhere."""
    flat = torch.zeros(grid[0] * grid[1], dtype=torch.float32, device=values.device)
    return flat.index_copy(0, rows, values.detach().float()).view(grid)


def onpolicy_split(hits: torch.Tensor, valid: torch.Tensor, decay: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The halves of onpolicy_kl on [M, P] greedy hits (drafter argmax == teacher top-1): which
    positions the drafter's own greedy block gets accepted (every valid position up to them a hit;
    invalid positions do not break the streak, as in streak_weights), and the reverse-KL weight
    decay ** j of the j-th position after the first rejection (j = 0 at the rejected position)."""
    accepted = torch.cumprod((hits | ~valid.bool()).long(), dim=1).bool()
    since = (torch.cumsum((~accepted).long(), dim=1) - 1).clamp(min=0)
    factor = torch.where(accepted, torch.zeros_like(since, dtype=torch.float32), float(decay) ** since.float())
    return accepted, factor


def _sum_per_column(values: torch.Tensor, columns: torch.Tensor, num_positions: int) -> torch.Tensor:
    """[P] detached float32 sums of per-valid-position values by block column."""
    totals = torch.zeros(num_positions, dtype=torch.float32, device=values.device)
    return totals.index_add(0, columns, values.detach().float())


# --- the objective of one batch: the drafter's forward, then the loss above ---------------------------


def block_targets(batch: Batch, block_size: int, num_positions: int | None = None) -> dict[str, torch.Tensor]:
    """Per draft position j = 1..P of every anchor a (P = num_positions, default block_size - 1;
    block_size when the anchor slot predicts too): the token to predict (x_{a+j}), the teacher's
    distribution of it (top-k at t = a+j-1) and whether the position counts (a+j < T, loss mask
    set, anchor slot used). Shapes [N*A, P] (+ [k])."""
    num_positions = block_size - 1 if num_positions is None else num_positions
    n, a = batch.anchors.shape
    k_offsets = torch.arange(1, num_positions + 1, device=batch.anchors.device)
    pos = batch.anchors.clamp(min=0).unsqueeze(-1) + k_offsets  # [N, A, P]
    in_range = (batch.anchors.unsqueeze(-1) >= 0) & (pos < batch.lengths.view(n, 1, 1))
    pos = torch.where(in_range, pos, torch.zeros_like(pos))
    # both layouts: sequence i's position t is element starts[i] + t of the flattened tensors
    starts = batch.starts.view(n, 1, 1)
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
    states, features, confidence = (forward or model)(batch.hidden, batch.input_ids, batch.anchors, heads=True,
                                                      packed_lengths=batch.packed_lengths)
    targets = block_targets(batch, model.cfg.block_size, model.cfg.num_draft_positions)
    if model.cfg.dflash2 is not None:  # the second output is the selector's context
        return states, targets, DraftHeads(selector_context=features, selector=model.cfg.dflash2,
                                           successor_codebook=model.candidate_selector.successor_codebook)
    dspark = model.cfg.dspark
    heads = DraftHeads(features=features, bias_weight=model.bias_weight if features is not None else None,
                       confidence=confidence)
    if dspark is not None:
        heads.confidence_alpha, heads.confidence_target = dspark.confidence_head_alpha, dspark.confidence_target
    return states, targets, heads


def batch_loss(model: DFlashDrafter, batch: Batch, loss_cfg: LossConfig, forward=None) -> LossOutput:
    """The drafter's loss and acceptance statistics on one batch (the training objective)."""
    states, targets, heads = block_states(model, batch, forward)
    return block_loss(states, model.lm_head_weight, targets["targets"], targets["topk_ids"],
                      targets["topk_logprobs"], targets["valid"], loss_cfg, model.cfg.block_size, heads)
