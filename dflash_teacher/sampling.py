"""Nucleus (top-p) filtering of next-token probabilities: one definition for stage 0's regeneration
and stage 2's speculative sampling, which must agree on it."""

from __future__ import annotations

import torch


def top_p_filter(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Zero every token outside the smallest set (most likely first) holding `top_p` of the
    probability: a token stays when the mass strictly before it is below top_p, so the most
    likely token always stays. probs [..., V], rows summing to 1; not renormalised."""
    if top_p >= 1:
        return probs
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(before >= top_p, 0.0)
    return torch.zeros_like(probs).scatter(-1, order, sorted_probs)
