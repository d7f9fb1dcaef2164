"""DFlash2: the DFlash backbone with grouped dynamic convolutions in each layer and a low-rank
candidate selector over the top-k of its logits (docs/design.md, "DFlash2").

Convolution: around attention and around the MLP, a sublayer's input is convolved along the
block before it and its output after it. Block position k's output is
`sum_t (base[t] + delta_k[t, group]) * x_{k-t}` over taps t < taps with k - t >= 0 (positions of
the same block only), where `delta_k` [taps, groups] is predicted from the sublayer's input at k
(`kernel_projection`, one projection for both sides) and shared by the `group_size` channels of a
group. It starts as the identity (base tap 0 = 1, every other weight 0), so a fresh DFlash2
drafter computes what a DFlash drafter does.

Selector: at draft position j, the candidates are the top-k tokens of the drafter's logits, each
with its unary score `softcap(output_multiplier * logit)`; candidate c's score is
`unary(c) + <P[prev] * W h_j, S[c]>`, prev the token before position j (the anchor for j = 1; in
decoding, the candidate chosen at j - 1; in training, the true token), h_j the final-normed state,
P / S the predecessor / successor codebooks (vocabulary x r), W `hidden_projection`.

Parameter names are the ones vLLM's DFlash2DraftModel loads (`layers.N.attention_conv.base_kernel`,
`layers.N.attention_conv.kernel_projection.weight`, the same for `mlp_conv`,
`candidate_selector.{predecessor,successor}_codebook`, `candidate_selector.hidden_projection.weight`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dflash_train.settings.dflash2_config import DFlash2Config

# speculators' initialisation of the selector (its initializer_range).
SELECTOR_INIT_STD = 0.02


def grouped_conv(x: Tensor, delta: Tensor, base: Tensor, block_size: int) -> Tensor:
    """Grouped dynamic convolution along blocks: x [..., S, H] with S a whole number of blocks of
    block_size positions, delta [..., S, taps, G] the per-position dynamic coefficients, base
    [taps, H]. Output [..., S, H]; tap t never reaches across the start of a block."""
    taps, hidden = base.shape
    groups = delta.shape[-1]
    blocks = x.unflatten(-2, (-1, block_size)).unflatten(-1, (groups, hidden // groups))  # [..., n, B, G, g]
    coefficients = base.to(x.dtype).view(taps, groups, -1) + delta.to(x.dtype).unflatten(-3, (-1, block_size)).unsqueeze(-1)
    out = coefficients[..., 0, :, :] * blocks
    for tap in range(1, min(taps, block_size)):
        shifted = torch.nn.functional.pad(blocks[..., :-tap, :, :], (0, 0, 0, 0, tap, 0))
        out = out + coefficients[..., tap, :, :] * shifted
    return out.flatten(-2).flatten(-3, -2)


class GroupedConv(nn.Module):
    """The input- and output-side convolutions of one sublayer, driven by one projection of its input."""

    def __init__(self, hidden_size: int, taps: int, group_size: int, block_size: int):
        super().__init__()
        self.taps, self.groups, self.block_size = taps, hidden_size // group_size, block_size
        self.base_kernel = nn.Parameter(torch.empty(2, taps, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * taps * self.groups, bias=False)

    def reset_parameters(self) -> None:
        """The identity: base tap 0 = 1, the other taps and the projection 0 (speculators' start)."""
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """(the input side's convolution of x [..., S, H], the output side's coefficients)."""
        delta = self.kernel_projection(x).unflatten(-1, (2, self.taps, self.groups))
        return grouped_conv(x, delta[..., 0, :, :], self.base_kernel[0], self.block_size), delta[..., 1, :, :]

    def finish(self, x: Tensor, delta: Tensor) -> Tensor:
        """The output side's convolution of the sublayer's output x [..., S, H]."""
        return grouped_conv(x, delta, self.base_kernel[1], self.block_size)


class CandidateSelector(nn.Module):
    """Low-rank pairwise scores of a position's candidates given the token before it."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int):
        super().__init__()
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def reset_parameters(self) -> None:
        for weight in (self.predecessor_codebook, self.successor_codebook, self.hidden_projection.weight):
            nn.init.normal_(weight, std=SELECTOR_INIT_STD)

    def context(self, hidden: Tensor, prev_ids: Tensor) -> Tensor:
        """P[prev] * W h: hidden [..., H], prev_ids [...] -> [..., r] (what a candidate's successor
        code is scored against)."""
        projected = self.hidden_projection(hidden.to(self.hidden_projection.weight.dtype))
        return self.predecessor_codebook[prev_ids.long()] * projected

    def scores(self, context: Tensor, candidate_ids: Tensor, unary: Tensor) -> Tensor:
        """unary [..., K] plus <context [..., r], S[candidate]> for candidate_ids [..., K]."""
        pairwise = (self.successor_codebook[candidate_ids.long()] * context.unsqueeze(-2)).sum(-1)
        return unary + pairwise.to(unary.dtype)


def unary_scores(logits: Tensor, cfg: DFlash2Config) -> Tensor:
    """The selector's unary scores of drafter logits: softcap(output_multiplier * logits), as vLLM
    scales and caps its candidate values (the multiplier first, then the cap)."""
    scores = logits * cfg.output_multiplier if cfg.output_multiplier != 1.0 else logits
    cap = cfg.final_logit_softcapping
    return torch.tanh(scores / cap) * cap if cap > 0 else scores


def training_candidates(candidate_ids: Tensor, target_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(candidates [..., K] with the target put in the last slot where the top-k misses it, the
    target's index among them [...], whether the top-k held it [...]): every position gets a K-way
    label while the candidates stay the ones serving sees (speculators' training set)."""
    matches = candidate_ids == target_ids.unsqueeze(-1)
    contains = matches.any(-1)
    last = candidate_ids.shape[-1] - 1
    index = torch.where(contains, matches.long().argmax(-1), torch.full_like(target_ids, last))
    candidates = candidate_ids.clone()
    candidates[..., last] = torch.where(contains, candidates[..., last], target_ids)
    return candidates, index, contains


def candidate_teacher_probs(candidates: Tensor, topk_ids: Tensor, topk_logprobs: Tensor, vocab_size: int) -> Tensor:
    """[n, K] the teacher's distribution renormalised over each position's candidates [n, K]: a
    candidate among the teacher's cached top-k [n, k] gets its probability, any other the tail's
    mass spread evenly over the V - k uncached tokens (as tempered_teacher_buckets takes it); a
    position whose candidates hold no teacher mass gets zeros."""
    probs = topk_logprobs.float().exp()
    matches = candidates.unsqueeze(-1) == topk_ids.unsqueeze(-2)  # [n, K, k]
    cached = (matches.float() * probs.unsqueeze(-2)).sum(-1)
    others = max(vocab_size - topk_ids.shape[-1], 1)
    tail = (1.0 - probs.sum(-1, keepdim=True)).clamp(min=0.0) / others
    mass = torch.where(matches.any(-1), cached, tail.expand_as(cached))
    return mass / mass.sum(-1, keepdim=True).clamp(min=torch.finfo(torch.float32).tiny)


def walk_terms(scores: Tensor, candidates: Tensor, topk_ids: Tensor, topk_logprobs: Tensor, vocab_size: int,
               target: str, recall: Tensor | None = None) -> Tensor:
    """A candidate walk's objective per position [4, n] (SELECTOR_SUMS' order) from its scores
    [n, K] of candidates [n, K]: the cross-entropy of softmax(scores) against the teacher's top-1
    ("top1"; 0 where no candidate is it) or against the teacher's distribution over the
    candidates ("teacher": vLLM samples the walk at T=1 from softmax(scores / T), and accepts
    at most the teacher's mass on the candidates, reached when that softmax is the teacher's
    renormalised there), then, without gradient, whether the teacher's top-1 is a candidate,
    whether the walk's best is it and whether the walk's best is not the first candidate.
    `recall` [n] replaces the first of those where the candidates were given the top-1 in training."""
    matches = candidates == topk_ids[:, :1]
    contains, index = matches.any(-1), matches.long().argmax(-1)
    log_walk = torch.log_softmax(scores.float(), dim=-1)
    if target == "teacher":
        ce = -(candidate_teacher_probs(candidates, topk_ids, topk_logprobs, vocab_size) * log_walk).sum(-1)
    else:
        ce = -log_walk.gather(1, index[:, None]).squeeze(1) * contains
    with torch.no_grad():
        recall = contains if recall is None else recall
        choice = scores.argmax(-1)
        hit = (choice == index) & recall
    return torch.stack([ce, recall.float(), hit.float(), (choice != 0).float()])
