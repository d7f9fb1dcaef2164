"""How one block's drafts are drawn from a drafter's states, kind by kind (speculative decoding's
step 2; dflash_train.measuring.speculative runs the rounds).

A DFlash drafter draws every position at once from its logits (greedy: the argmax; sampling: from
softmax(logits / T), top-p applied), and that distribution is the q rejection sampling checks.

A DSpark drafter drafts P tokens per block (B with sample_from_anchor: the anchor slot predicts
too) and drafts them semi-autoregressively: the backbone runs the block once, then position j's
logits get the Markov bias of the token drafted at j - 1 (the anchor for j = 1), left to right.
Each draft is then drawn from the distribution it was drafted from, so rejection sampling stays
exact. With `confidence_threshold` > 0 a block stops before the position where the confidence
head's cumulative acceptance estimate falls below it: fewer drafts, the same output.

A DFlash2 drafter drafts with its convolutions inside the block forward, then lets its candidate
selector choose, left to right, among the top-k tokens of each position's logits, as vLLM's V2
DFlash2 speculator walks them: position j's candidates are scored `unary + <P[prev] * W h_j,
S[candidate]>` with prev the token chosen at j - 1 (the anchor for j = 1); greedy takes the best
score, sampling draws from softmax(scores / T) over the k candidates (top-p applied), and that
distribution is the q rejection sampling checks, so the output stays the teacher's.

A LiLiCorr drafter drafts by vLLM's walk over its correlator's lattice (docs/design.md, "LiLiCorr"):
the candidates are each position's top-k of the backbone's log-softmax, row 0 of the scores is the
context anchor's, and each position's choice picks the next position's row; sampling draws from
softmax(row / T) over the k candidates, q as for DFlash2.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from dflash_teacher.sampling import top_p_filter
from dflash_train.settings.spec_config import SpecConfig
from dflash_train.training.dflash2 import unary_scores
from dflash_train.training.model import DFlashDrafter


def probs_from_logits(logits: Tensor, temperature: float, top_p: float = 1.0) -> Tensor:
    """Sampling distribution [..., V] (fp32) of logits at a temperature > 0, nucleus-filtered."""
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p >= 1:
        return probs
    probs = top_p_filter(probs, top_p)
    return probs / probs.sum(dim=-1, keepdim=True)


class Drafted(NamedTuple):
    """One block's drafts and what decoding reports of them."""

    drafts: Tensor
    """[n] the drafted tokens (n = P, fewer where the confidence threshold ended the block)."""
    q: Tensor | None
    """[n, V] the distributions they were sampled from; None when greedy."""
    changed: list[bool]
    """Per draft, whether the candidate walk (DFlash2's selector, LiLiCorr's) left the top-1; empty for other kinds."""
    confidences: list[float]
    """Per draft, DSpark's confidence head's estimate of its acceptance; empty without a head."""


def _draft(drafter: DFlashDrafter, positions: Tensor, anchor: int, cfg: SpecConfig, generator: torch.Generator,
           device: torch.device) -> Drafted:
    """One block's Drafted from its draft positions' states [P, H]. DFlash draws all positions at
    once; DSpark adds each position's Markov bias from the token drafted before it, stops at the
    confidence threshold, and reports its confidence head's estimate of each draft."""
    markov, confidence = drafter.markov_head, drafter.confidence_head
    stop_below = cfg.confidence_threshold if confidence is not None else 0.0
    if markov is None and stop_below == 0:
        logits = drafter.logits(positions).float().to(device)
        estimates = [] if confidence is None else torch.sigmoid(confidence(positions, None).float()).tolist()
        if cfg.greedy:
            return Drafted(logits.argmax(dim=-1), None, [], estimates)
        q = probs_from_logits(logits, cfg.temperature, cfg.top_p)
        return Drafted(torch.multinomial(q, 1, generator=generator).squeeze(-1), q, [], estimates)
    drafts: list[Tensor] = []
    dists: list[Tensor] = []
    kept: list[Tensor] = []  # the estimates stay on the device until the block ends: no sync per position
    prev = torch.tensor(anchor, device=positions.device)
    state, reach = None, 1.0
    for j in range(positions.shape[0]):
        prev_embed = markov.embed(prev) if markov is not None else None
        if confidence is not None:
            estimate = torch.sigmoid(confidence(positions[j], prev_embed).float())
            if stop_below > 0:
                reach *= float(estimate)
                if reach < stop_below:
                    break
            kept.append(estimate)
        features = None
        if markov is not None:
            features, state = markov.step(prev_embed, positions[j], state)
        logits = drafter.logits(positions[j], features).float().to(device)
        if cfg.greedy:
            token = logits.argmax()
        else:
            dists.append(probs_from_logits(logits, cfg.temperature, cfg.top_p))
            token = torch.multinomial(dists[-1], 1, generator=generator)[0]
        drafts.append(token)
        prev = token.to(positions.device)
    out = torch.stack(drafts) if drafts else torch.zeros(0, dtype=torch.long, device=device)
    estimates = torch.stack(kept).tolist() if kept else []
    if cfg.greedy:
        return Drafted(out, None, [], estimates)
    return Drafted(out, torch.stack(dists) if dists else torch.zeros(0, drafter.cfg.vocab_size, device=device), [],
                   estimates)


def _select(drafter: DFlashDrafter, positions: Tensor, anchor: int, cfg: SpecConfig, generator: torch.Generator,
            device: torch.device) -> tuple[Tensor, Tensor | None, list[bool]]:
    """DFlash2's (drafts [P], q [P, V] or None when greedy, per draft whether the selector left the
    top-1) of one block from its draft positions' states [P, H]: vLLM's candidate walk."""
    settings, selector = drafter.cfg.selector, drafter.candidate_selector
    top = drafter.logits(positions).float().topk(settings.selector_top_k, dim=-1)
    unary = unary_scores(top.values, settings)
    prev = torch.tensor(anchor, device=positions.device)
    drafts: list[Tensor] = []
    dists: list[Tensor] = []
    changed: list[bool] = []
    for j in range(positions.shape[0]):
        scores = selector.scores(selector.context(positions[j], prev), top.indices[j], unary[j]).float()
        if cfg.greedy:
            index = scores.argmax()
        else:
            full = torch.full((drafter.cfg.vocab_size,), float("-inf"), device=scores.device)
            dists.append(probs_from_logits(full.index_copy(0, top.indices[j], scores), cfg.temperature, cfg.top_p))
            token = torch.multinomial(dists[-1].to(device), 1, generator=generator)[0].to(scores.device)
            index = (top.indices[j] == token).long().argmax()
        prev = top.indices[j][index]
        drafts.append(prev)
        changed.append(bool(index != 0))
    out = torch.stack(drafts).to(device)
    return out, None if cfg.greedy else torch.stack(dists).to(device), changed


def _walk(drafter: DFlashDrafter, positions: Tensor, context_anchor: Tensor, cfg: SpecConfig,
          generator: torch.Generator, device: torch.device) -> tuple[Tensor, Tensor | None, list[bool]]:
    """LiLiCorr's (drafts [P], q [P, V] or None when greedy, per draft whether the walk left the
    top-1) of one block from its draft positions' states [P, H] and the normed context feature
    before it [H]: vLLM's walk over the correlator's scores, from predecessor 0 (the anchor row),
    each chosen candidate the next row's predecessor; sampled from softmax(scores / T)."""
    candidates, scores = drafter.walk(positions.unsqueeze(0), context_anchor.unsqueeze(0))
    candidates, scores = candidates[0], scores[0].float()
    previous = 0
    drafts: list[Tensor] = []
    dists: list[Tensor] = []
    changed: list[bool] = []
    for j in range(positions.shape[0]):
        row = scores[j, previous]
        if cfg.greedy:
            index = int(row.argmax())
        else:
            full = torch.full((drafter.cfg.vocab_size,), float("-inf"), device=row.device)
            dists.append(probs_from_logits(full.index_copy(0, candidates[j], row), cfg.temperature, cfg.top_p))
            token = torch.multinomial(dists[-1].to(device), 1, generator=generator)[0].to(row.device)
            index = int((candidates[j] == token).long().argmax())
        drafts.append(candidates[j, index])
        changed.append(index != 0)
        previous = index
    return torch.stack(drafts).to(device), None if cfg.greedy else torch.stack(dists).to(device), changed


def draft_block(drafter: DFlashDrafter, anchor: int, mask_block: Tensor, context: list[tuple[Tensor, Tensor]],
                 cfg: SpecConfig, generator: torch.Generator, device: torch.device,
                 context_anchor: Tensor | None = None) -> Drafted:
    """The Drafted of the block `[anchor, MASK, ...]` placed right after the cached context;
    context_anchor [H] is the context's last normed feature (LiLiCorr reads it)."""
    block = torch.cat((torch.tensor([anchor], device=mask_block.device), mask_block))
    states = drafter.forward_block(None, block.unsqueeze(0), context_kv=context)
    positions = drafter.draft_slots(states[0])
    if drafter.lilicorr is not None:
        return Drafted(*_walk(drafter, positions, context_anchor, cfg, generator, device), [])
    if drafter.candidate_selector is not None:
        return Drafted(*_select(drafter, positions, anchor, cfg, generator, device), [])
    return _draft(drafter, positions, anchor, cfg, generator, device)


def last_feature(drafter: DFlashDrafter, hidden: Tensor) -> Tensor | None:
    """The normed context feature [H] of the last of the tapped states hidden [1, T, n_layers, H]
    (LiLiCorr's anchor, as vLLM's speculator takes it: the last accepted position's); None for the
    other kinds, which do not read it."""
    return None if drafter.lilicorr is None else drafter.context_features(hidden[:, -1:])[0, -1]
