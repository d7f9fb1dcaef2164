"""The objective's per-position terms (docs/design.md, "The objective"): the full-vocabulary
logits of one chunk of valid positions through the frozen LM head, in the loss's head_matmul
precision, and from them the bucket terms (ce, kl, tv, nla, lk_hybrid, rkl, jsd), the
acceptance alpha and, for DFlash2, the selector's terms. dflash_train.training.loss assembles
these into a batch's loss.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from dflash_train.settings.dflash2_config import DFlash2Config
from dflash_train.training.dflash2 import training_candidates, unary_scores

# -log(alpha) is floored here: a drafter that puts no mass on any of the teacher's buckets would
# otherwise give an infinite loss and a NaN gradient.
_NLA_FLOOR = 1e-5


# log of a teacher bucket that holds no mass (a tail the top-k emptied), for the reverse
# divergences, whose drafter-side mass there would otherwise cost infinitely.
_LOG_EMPTY = math.log(1e-30)


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


def chunk_terms(
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


def onpolicy_split(hits: torch.Tensor, valid: torch.Tensor, decay: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The halves of onpolicy_kl on [M, P] greedy hits (drafter argmax == teacher top-1): which
    positions the drafter's own greedy block gets accepted (every valid position up to them a hit;
    invalid positions do not break the streak, as in streak_weights), and the reverse-KL weight
    decay ** j of the j-th position after the first rejection (j = 0 at the rejected position)."""
    accepted = torch.cumprod((hits | ~valid.bool()).long(), dim=1).bool()
    since = (torch.cumsum((~accepted).long(), dim=1) - 1).clamp(min=0)
    factor = torch.where(accepted, torch.zeros_like(since, dtype=torch.float32), float(decay) ** since.float())
    return accepted, factor
