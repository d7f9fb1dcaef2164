"""LiLiCorr: a DFlash (or DFlash2-convolution) backbone plus a correlator that scores the block's
lattice of candidates (docs/design.md, "LiLiCorr").

For each of a block's S draft positions ("slots") the candidates are the top-k tokens of the
backbone's log-softmax. Each candidate becomes a state: its token's teacher embedding (projected),
its slot's backbone state (projected), an MLP of five features of its log-probability (the value,
its exp, its gap to the slot's best, its rank as a fraction, whether it is the top-1), a slot and
a rank embedding. A few pre-norm transformer layers attend over all S x k states at once, with a
learned per-head bias by slot distance and for the same slot. Each state then gives an outgoing and
an incoming unit vector (an MLP of the state, the context anchor and their product); the score of
the transition from candidate i of slot s to candidate j of slot s + 1 is
`logit_scale * <out[s, i], in[s + 1, j]>`, and from the anchor (the normed context feature of the
position before the block) into slot 0 `logit_scale * <anchor_out, in[0, j]>`. The walk (vLLM's
DFlash2 candidate walk) starts from the anchor, takes (or samples) the best-scored candidate of
each slot given the one before it.

Parameter names are the ones vLLM 0.32's LiLiCorrForCausalLM loads under `lilicorr.`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_train.settings.lilicorr_config import LiLiCorrConfig
from dflash_train.training.dflash2 import training_candidates

NUM_FEATURES = 5
LATTICE_CHUNK = 256
"""Block positions whose full-vocabulary log-softmax the training lattice's candidates are taken from at once."""
# the top-1's mark in the residual stream at the start; above a teacher embedding's entries
TOP1_MARK = 4.0


class _Mlp(nn.Module):
    """up, SiLU, down; both with biases (vLLM's non-gated MLP of the correlator)."""

    def __init__(self, inputs: int, hidden: int, outputs: int):
        super().__init__()
        self.up_proj = nn.Linear(inputs, hidden)
        self.down_proj = nn.Linear(hidden, outputs)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.up_proj(x)))


class _LatticeAttention(nn.Module):
    """Full attention over the lattice with an additive per-head bias (no mask, no cache)."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * width, width))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * width))
        self.out_proj = nn.Linear(width, width)

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        rows, length, width = x.shape
        q, k, v = (t.view(rows, length, self.heads, -1).transpose(1, 2)
                   for t in F.linear(x, self.in_proj_weight, self.in_proj_bias).chunk(3, dim=-1))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.to(q.dtype))
        return self.out_proj(out.transpose(1, 2).reshape(rows, length, width))


class _LatticeLayer(nn.Module):
    def __init__(self, width: int, heads: int, mlp_ratio: float, eps: float):
        super().__init__()
        self.attn_norm = nn.RMSNorm(width, eps=eps)
        self.attn = _LatticeAttention(width, heads)
        self.mlp_norm = nn.RMSNorm(width, eps=eps)
        self.mlp = _Mlp(width, int(width * mlp_ratio), width)

    def forward(self, x: Tensor, bias: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), bias)
        return x + self.mlp(self.mlp_norm(x))


def candidate_features(log_probs: Tensor) -> Tensor:
    """[..., k, 5] the per-candidate features of a slot's top-k log-probabilities [..., k] (sorted,
    best first): the log-probability, the probability, the gap to the best, the rank as a fraction
    of k - 1 (0 when k = 1) and whether it is the top-1."""
    k = log_probs.shape[-1]
    rank = torch.arange(k, device=log_probs.device, dtype=torch.float32) / max(k - 1, 1)
    top1 = (torch.arange(k, device=log_probs.device) == 0).float()
    log_probs = log_probs.float()
    return torch.stack([log_probs, log_probs.exp(), log_probs - log_probs.max(dim=-1, keepdim=True).values,
                        rank.expand_as(log_probs), top1.expand_as(log_probs)], dim=-1)


class Correlator(nn.Module):
    """The lattice correlator of a block of `block_size` (slots = block_size - 1)."""

    def __init__(self, cfg: LiLiCorrConfig, drafter_hidden: int, block_size: int, eps: float):
        super().__init__()
        width, k, slots = cfg.width(drafter_hidden), cfg.candidate_topk, block_size - 1
        self.cfg, self.block_size = cfg, block_size
        self.token_proj = nn.Identity() if width == drafter_hidden else nn.Linear(drafter_hidden, width)
        self.pass_hidden_proj = nn.Linear(drafter_hidden, width)
        self.feature_norm = nn.LayerNorm(NUM_FEATURES)
        self.feature_mlp = _Mlp(NUM_FEATURES, width, width)
        self.slot_embedding = nn.Parameter(torch.empty(1, 1, slots, 1, width))
        self.rank_embedding = nn.Parameter(torch.empty(1, 1, 1, k, width))
        self.relative_slot_bias = nn.Parameter(torch.empty(cfg.num_heads, 2 * block_size - 1))
        self.same_slot_bias = nn.Parameter(torch.empty(cfg.num_heads))
        self.context_proj = nn.Linear(drafter_hidden, width)
        self.layers = nn.ModuleList(_LatticeLayer(width, cfg.num_heads, cfg.mlp_ratio, eps)
                                    for _ in range(cfg.num_layers))
        self.output_norm = nn.RMSNorm(width, eps=eps)
        self.anchor_norm = nn.RMSNorm(width, eps=eps)
        self.factor_input_proj = nn.Linear(3 * width, width)
        self.out_head = nn.Linear(width, cfg.factor_dim)
        self.in_head = nn.Linear(width, cfg.factor_dim)
        self.anchor_out_head = nn.Linear(width, cfg.factor_dim)

    def reset_parameters(self) -> None:
        """After the drafter's generic start (Linear N(0, 0.02), biases 0): the embeddings and the
        attention biases 0, the lattice attention's projection like a Linear's, the norms 1; then
        the walk's start (`_prefer_the_top1`)."""
        with torch.no_grad():
            for weight in (self.slot_embedding, self.rank_embedding, self.relative_slot_bias, self.same_slot_bias):
                weight.zero_()
            for layer in self.layers:
                nn.init.normal_(layer.attn.in_proj_weight, std=0.02)
                layer.attn.in_proj_bias.zero_()
            for norm in self.modules():
                if isinstance(norm, (nn.RMSNorm, nn.LayerNorm)):
                    norm.reset_parameters()
            self._prefer_the_top1()

    def _prefer_the_top1(self) -> None:
        """A fresh correlator walks the backbone's top-1 path, as a fresh DFlash2 selector does (its
        pairwise scores start near 0 and its unary ones are the logits): the rank embedding puts
        +TOP1_MARK into the last channel of each slot's top-1 and -TOP1_MARK into the others' (every
        other writer of that channel starts at 0, but the unprojected token embedding, whose
        entries are far smaller), factor_input_proj's last unit reads it, in_head's first
        axis reads that unit, and every outgoing vector (the anchor's too) starts on that axis, so
        the top-1's incoming vector is nearly parallel to it and the others' are not."""
        last = self.in_head.in_features - 1
        self.rank_embedding[..., last] = -TOP1_MARK
        self.rank_embedding[..., 0, last] = TOP1_MARK
        writers = [self.pass_hidden_proj, self.feature_mlp.down_proj, self.context_proj]
        writers += [self.token_proj] if isinstance(self.token_proj, nn.Linear) else []
        writers += [m for layer in self.layers for m in (layer.attn.out_proj, layer.mlp.down_proj)]
        for writer in writers:
            writer.weight[last].zero_()
        self.factor_input_proj.weight[last].zero_()
        self.factor_input_proj.weight[last, last] = 2.0
        self.in_head.weight[0].zero_()
        self.in_head.weight[0, last] = 1.0
        for head in (self.out_head, self.anchor_out_head):
            head.weight.mul_(0.1)
            head.bias[0] = 1.0

    def attention_bias(self, slots: int, device: torch.device) -> Tensor:
        """[heads, slots*k, slots*k] the lattice attention's bias: by slot distance (offset
        block_size - 1, so a shorter lattice keeps the trained distances) plus same-slot."""
        k = self.cfg.candidate_topk
        slot = torch.arange(slots, device=device).repeat_interleave(k)
        distance = slot[:, None] - slot[None, :]
        same = (distance == 0).to(self.same_slot_bias.dtype)
        return self.relative_slot_bias[:, distance + self.block_size - 1] + same * self.same_slot_bias[:, None, None]

    def forward(self, token_embeddings: Tensor, log_probs: Tensor, states: Tensor, anchor: Tensor) -> Tensor:
        """[N, S, k, k] the walk's scores of N blocks: row 0 repeats the anchor's scores into slot 0
        for every predecessor (the walk starts at predecessor 0), row s >= 1 scores candidate j of
        slot s after candidate i of slot s - 1. token_embeddings [N, S, k, H] (the candidates'
        teacher embeddings), log_probs [N, S, k] (their backbone log-probabilities, best first),
        states [N, S, H] (the slots' final-normed backbone states), anchor [N, H] (the normed
        context feature of the position before the block)."""
        n, slots, k = log_probs.shape
        dtype = self.slot_embedding.dtype
        x = self.token_proj(token_embeddings.to(dtype)) + self.pass_hidden_proj(states.to(dtype)).unsqueeze(-2)
        x = x + self.feature_mlp(self.feature_norm(candidate_features(log_probs).to(dtype)))
        x = (x + self.slot_embedding[:, 0, :slots] + self.rank_embedding[:, 0]).reshape(n, slots * k, -1)
        bias = self.attention_bias(slots, x.device).unsqueeze(0)
        for layer in self.layers:
            x = layer(x, bias)
        x = self.output_norm(x).view(n, slots, k, -1)
        context = self.anchor_norm(self.context_proj(anchor.to(dtype)))
        row = context[:, None, None, :]
        factors = F.silu(self.factor_input_proj(torch.cat((x, row.expand_as(x), x * row), dim=-1)))
        eps = self.cfg.vector_eps
        outgoing = F.normalize(self.out_head(factors), dim=-1, eps=eps)
        incoming = F.normalize(self.in_head(factors), dim=-1, eps=eps)
        anchor_out = F.normalize(self.anchor_out_head(context), dim=-1, eps=eps)
        start = (anchor_out[:, None, :] * incoming[:, 0]).sum(-1)  # [N, k]
        pairs = outgoing[:, :-1] @ incoming[:, 1:].transpose(-1, -2)  # [N, S-1, k, k]
        scale = self.cfg.logit_scale
        return torch.cat((scale * start.float()[:, None, None, :].expand(-1, 1, k, -1), scale * pairs.float()), dim=1)


def training_lattice(correlator: Correlator, logits: Callable[[Tensor], Tensor], embed_weight: Tensor,
                     positions: Tensor, path_ids: Tensor, anchor: Tensor) -> tuple[Tensor, Tensor]:
    """The teacher-forced lattice of whole blocks: (the walk's scores along the path [M, P, k], the
    candidates [M, P, k]) of draft positions' states [M, P, H] (`logits` the backbone's head), the
    path being the sequence's own tokens path_ids [M, P] (put among the candidates where the top-k
    misses them) and anchor [M, H] the normed context feature before each block. The correlator
    reads the backbone detached: its loss trains it alone, and the backbone's candidates and their
    log-probabilities carry no gradient (a full-vocabulary log-softmax kept for backward at every
    block position would double the head's memory)."""
    k = correlator.cfg.candidate_topk
    with torch.no_grad():
        flat, path = positions.reshape(-1, positions.shape[-1]), path_ids.reshape(-1)
        parts = [teacher_forced_lattice(_log_probs(logits, flat[i:i + LATTICE_CHUNK]), path[i:i + LATTICE_CHUNK], k)
                 for i in range(0, flat.shape[0], LATTICE_CHUNK)]
        candidates, log_probs, index = (torch.cat(t).view(*positions.shape[:2], *t[0].shape[1:]) for t in zip(*parts))
    scores = correlator(F.embedding(candidates, embed_weight), log_probs, positions.detach(), anchor.detach())
    return path_rows(scores, index), candidates


def walk_lattice(correlator: Correlator, logits: Callable[[Tensor], Tensor], embed_weight: Tensor, positions: Tensor,
                 anchor: Tensor) -> tuple[Tensor, Tensor]:
    """The lattice as vLLM's speculator builds it: (candidates [N, S, k], the walk's scores
    [N, S, k, k]) of S draft positions' states [N, S, H] after anchor [N, H]."""
    candidates, log_probs = lattice(_log_probs(logits, positions), correlator.cfg.candidate_topk)
    return candidates, correlator(F.embedding(candidates, embed_weight), log_probs, positions, anchor)


def _log_probs(logits: Callable[[Tensor], Tensor], states: Tensor) -> Tensor:
    """The backbone's log-softmax [..., V] of states [..., H], in fp32."""
    return torch.log_softmax(logits(states).float(), dim=-1)


def lattice(log_probs: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """(candidate ids [..., k], their log-probabilities [..., k], best first) of backbone logits'
    log-softmax [..., V]: the candidates vLLM's LiLiCorr takes (no scale, no cap)."""
    top = log_probs.topk(k, dim=-1)
    return top.indices, top.values


def path_rows(scores: Tensor, path_index: Tensor) -> Tensor:
    """[N, S, k] the rows of the walk's scores [N, S, k, k] along a path: slot 0's anchor row, then
    at slot s the row of the path's candidate path_index[:, s - 1] of slot s - 1."""
    previous = torch.cat((torch.zeros_like(path_index[:, :1]), path_index[:, :-1]), dim=1)
    return scores.gather(2, previous[:, :, None, None].expand(-1, -1, 1, scores.shape[-1])).squeeze(2)


def teacher_forced_lattice(log_probs: Tensor, path_ids: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """(candidates [N, S, k], their log-probabilities, the path's index among them [N, S]) of a
    block's log-softmax [N, S, V] with the sequence's own tokens path_ids [N, S] put in the last
    candidate where the top-k misses them (DFlash2's training candidates), so every slot has a
    predecessor on the lattice."""
    ids, _ = lattice(log_probs, k)
    candidates, index, _ = training_candidates(ids, path_ids)
    return candidates, log_probs.gather(-1, candidates), index
