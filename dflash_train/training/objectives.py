"""The objective's per-position terms (docs/design.md, "The objective"): the full-vocabulary
logits of one chunk of valid positions through the frozen LM head, in the loss's head_matmul
precision, and from them the bucket terms (ce, kl, tv, nla, lk_hybrid, rkl, jsd; chain's
per-position alpha), the acceptance alpha and, for DFlash2, the selector's terms.
dflash_train.training.loss assembles these into a batch's loss.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import nullcontext

import torch

from dflash_train.settings.dflash2_config import DFlash2Config
from dflash_train.training.dflash2 import training_candidates, unary_scores, walk_terms

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
        elif name == "top1":  # the cache's top-k is sorted, so bucket 0 is the teacher's greedy token
            out[name] = -log_q[:, 0]
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
        elif name == "chain":  # alpha itself, with its gradient: chain_term joins a block's positions
            out[name] = alpha
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
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-position ([T, n] terms in the order of `names`, alpha, greedy, confidence, selector
    values [4, T] named by SELECTOR_SUMS, or [0, T] without a selector) for n gathered valid
    positions; the only place full-vocabulary logits exist. Runs under checkpoint, so it must stay
    deterministic. onpolicy_kl needs whole blocks, so it comes back as its two halves, kl and rkl,
    which block_loss joins; chain as its per-position alpha, which block_loss chains per block.
    temperature tempers kl alone (LossConfig.temperature)."""
    # Autocast would silently run the LM head in bf16; the buckets need fp32 logits. A device
    # without autocast (meta, where tests run the step dataless) has none to turn off.
    device = states.device.type
    with torch.autocast(device_type=device, enabled=False) if torch.amp.is_autocast_available(device) else nullcontext():
        logits = head_logits(states, lm_head_weight, head_matmul)
        if features is not None:
            logits = logits + features.float() @ bias_weight.float().T
        log_norm, log_q = bucket_log_probs(logits, topk_ids, has_tail)
        teacher_logp = teacher_bucket_log_probs(topk_logprobs.float(), has_tail)
        ce = log_norm - logits.gather(1, targets[:, None]).squeeze(1)
        terms = _bucket_terms(names, teacher_logp, log_q, ce, lk_eta)
        if temperature != 1.0 and "kl" in names:
            terms["kl"] = tempered_kl(logits, topk_ids, teacher_logp, has_tail, temperature)
        per_term = torch.stack([terms[name] for name in names])

        with torch.no_grad():
            alpha = bucket_alpha(teacher_logp.exp(), log_q.exp())
            greedy = (logits.argmax(dim=-1) == topk_ids[:, 0]).to(torch.float32)
            confidence = torch.exp(-ce)
        selected = (logits.new_zeros(0, logits.shape[0]) if selector is None
                    else selector_terms(logits, selector_context, successor_codebook, topk_ids, topk_logprobs, selector))
    return per_term, alpha, greedy, confidence, selected


def bucket_log_probs(logits: torch.Tensor, topk_ids: torch.Tensor, has_tail: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-normaliser [n], log-probabilities [n, b]) of the drafter's softmax of logits [n, V] over
    the top-k buckets, then its tail bucket when has_tail."""
    log_norm = torch.logsumexp(logits, dim=-1)
    log_q = logits.gather(1, topk_ids) - log_norm[:, None]
    if has_tail:
        # log(1 - sum q) cancels catastrophically when the top-k holds nearly all the mass.
        outside_topk = logits.scatter(1, topk_ids, float("-inf"))
        log_q = torch.cat([log_q, (torch.logsumexp(outside_topk, dim=-1) - log_norm)[:, None]], dim=1)
    return log_norm, log_q


def teacher_bucket_log_probs(topk_logprobs: torch.Tensor, has_tail: bool) -> torch.Tensor:
    """[n, b] the teacher's log-probabilities of its top-k buckets, then its tail bucket (1 - the
    top-k's mass; log 0 = -inf is what an empty tail is, which xlogy and the clamps handle)."""
    if not has_tail:
        return topk_logprobs
    teacher_tail = (1.0 - topk_logprobs.exp().sum(-1)).clamp(min=0.0)
    return torch.cat([topk_logprobs, torch.log(teacher_tail)[:, None]], dim=1)


def tempered_teacher_buckets(teacher_logp: torch.Tensor, has_tail: bool, vocab_size: int,
                             temperature: float) -> torch.Tensor:
    """[n, b] log p_T of the teacher's buckets at a temperature: p_T(i) prop. to p(i)^(1/T) on the top-k
    ids; the tail bucket's tokens are not cached, so its mass is taken as spread evenly over the
    V - k other tokens, whose tempered sum is tail^(1/T) * (V - k)^(1 - 1/T). Exact when the top-k
    covers the vocabulary (no tail) or the tail is uniform; renormalised to sum to 1."""
    scaled = teacher_logp / temperature
    if has_tail:
        others = vocab_size - (teacher_logp.shape[1] - 1)
        spread = torch.zeros_like(scaled)
        spread[:, -1] = (1.0 - 1.0 / temperature) * math.log(others)
        scaled = scaled + spread
    return scaled - torch.logsumexp(scaled, dim=-1, keepdim=True)


def tempered_kl(logits: torch.Tensor, topk_ids: torch.Tensor, teacher_logp: torch.Tensor, has_tail: bool,
                temperature: float) -> torch.Tensor:
    """[n] T^2 * KL(p_T || q_T) over the buckets: q_T the drafter's softmax(logits / T) read at the
    buckets (exact, from the full logits), p_T the tempered teacher (tempered_teacher_buckets); the
    T^2 keeps the gradient's scale across temperatures (Hinton et al.'s distillation)."""
    _, log_q = bucket_log_probs(logits / temperature, topk_ids, has_tail)
    log_p = tempered_teacher_buckets(teacher_logp, has_tail, logits.shape[1], temperature)
    return temperature**2 * bucket_kl(log_p.exp(), log_q, None, None)


def selector_terms(logits: torch.Tensor, context: torch.Tensor, successor_codebook: torch.Tensor,
                   topk_ids: torch.Tensor, topk_logprobs: torch.Tensor, selector: DFlash2Config) -> torch.Tensor:
    """DFlash2's selector objective per position [4, T] (SELECTOR_SUMS' order; walk_terms): the
    candidates are the drafter's top-k with the teacher's top-1 put in the last slot where the
    top-k misses it (speculators' training set), scored `unary + <context, S[candidate]>`, trained
    toward the teacher's top-1 (speculators' objective) or its distribution (selector_target);
    recall is whether the drafter's own top-k held the teacher's top-1."""
    candidates, _, contains = training_candidates(logits.topk(selector.selector_top_k, dim=-1).indices, topk_ids[:, 0])
    unary = unary_scores(logits.gather(1, candidates), selector)
    scores = unary + (successor_codebook[candidates].float() * context.float().unsqueeze(1)).sum(-1)
    return walk_terms(scores, candidates, topk_ids, topk_logprobs, logits.shape[1], selector.selector_target, contains)


def onpolicy_split(hits: torch.Tensor, valid: torch.Tensor, decay: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The halves of onpolicy_kl on [M, P] greedy hits (drafter argmax == teacher top-1): which
    positions the drafter's own greedy block gets accepted (every valid position up to them a hit;
    invalid positions do not break the streak, as in streak_weights), and the reverse-KL weight
    decay ** j of the j-th position after the first rejection (j = 0 at the rejected position)."""
    accepted = torch.cumprod((hits | ~valid.bool()).long(), dim=1).bool()
    since = (torch.cumsum((~accepted).long(), dim=1) - 1).clamp(min=0)
    factor = torch.where(accepted, torch.zeros_like(since, dtype=torch.float32), float(decay) ** since.float())
    return accepted, factor


def chain_term(alpha: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[M, P] the chain loss per position of blocks of acceptance rates alpha [M, P] (with their
    gradient): 1 - prod over i <= k of alpha_i, so that a block's sum over its valid positions is
    their number minus the expected accepted length sum_k prod_{i<=k} alpha_i. An invalid position
    ends the chain (it counts as alpha = 0: no acceptance is known through a token the drafter is
    not trained on, and past the sequence's end every later position is invalid anyway); unlike
    streak_weights, where it is neutral, since here the product is what is trained."""
    reach = torch.cumprod(torch.where(valid.bool(), alpha, torch.zeros_like(alpha)), dim=1)
    return 1.0 - reach
