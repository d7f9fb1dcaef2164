"""DSpark (arXiv 2607.05147): the DFlash block-parallel backbone plus a Markov head and a confidence head.

Contract (docs/design.md, "DSpark"): with sample_from_anchor the anchor slot and every MASK slot
predict, so a block of B slots drafts B tokens; draft position j = 1..P predicts x_{a+j} from
slot j - 1 (j with sample_from_anchor off). The Markov head adds a low-rank logit bias
`W2 f_j` to position j's backbone logits, where `f_j` is built from `W1[x_{a+j-1}]`, the
embedding of the token before it (the anchor for j = 1; in decoding, the token just drafted);
the confidence head predicts position j's acceptance from its backbone state (and `W1[x_{a+j-1}]`).

Parameter names are the ones vLLM's and speculators' DSpark loaders read
(`markov_head.markov_w1.weight`, `markov_head.markov_w2.weight`, `confidence_head.proj.*`, and
for the variants `markov_head.gate_proj.*` / `markov_head.joint_proj.*`).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

# The reference initialisation of W1: small, so the bias starts near zero and a fresh DSpark
# drafter drafts like its backbone.
MARKOV_EMBED_STD = 0.01


class MarkovHead(nn.Module):
    """Low-rank logit bias from the previous token: bias = W2 f, f an r-dim feature of W1[prev]."""

    def __init__(self, vocab_size: int, hidden_size: int, rank: int, head_type: str):
        super().__init__()
        self.head_type, self.rank = head_type, rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        if head_type == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        elif head_type == "rnn":
            # [gate; candidate; output] from [state; previous-token embedding; backbone state]
            self.joint_proj = nn.Linear(2 * rank + hidden_size, 3 * rank)

    def embed(self, prev_ids: Tensor) -> Tensor:
        """W1 rows of the previous tokens: [...] -> [..., r]."""
        return self.markov_w1(prev_ids.long())

    def step(self, prev_embed: Tensor, hidden: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """(feature f whose W2 projection is the bias, the next recurrent state) of one position
        (or, for vanilla and gated, any number of positions at once): prev_embed [..., r],
        hidden [..., H] the position's backbone state, state [..., r] (rnn only)."""
        if self.head_type == "vanilla":
            return prev_embed, state
        hidden = hidden.to(prev_embed.dtype)
        if self.head_type == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat((hidden, prev_embed), dim=-1)))
            return gate * prev_embed, state
        if state is None:
            state = prev_embed.new_zeros(prev_embed.shape)
        gate_raw, candidate, out = self.joint_proj(torch.cat((state, prev_embed, hidden), dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate_raw)
        return torch.tanh(out), gate * state + (1.0 - gate) * torch.tanh(candidate)

    def features(self, prev_embed: Tensor, hidden: Tensor) -> Tensor:
        """Features [M, P, r] of whole blocks given every position's previous token (teacher
        forcing): the rnn state runs left to right through the block, as in decoding."""
        if self.head_type != "rnn":
            return self.step(prev_embed, hidden, None)[0]
        state, out = None, []
        for j in range(prev_embed.shape[1]):
            feature, state = self.step(prev_embed[:, j], hidden[:, j], state)
            out.append(feature)
        return torch.stack(out, dim=1)

    def bias(self, features: Tensor) -> Tensor:
        """Vocabulary logit bias [..., V] of features [..., r]."""
        return self.markov_w2(features.to(self.markov_w2.weight.dtype))


class ConfidenceHead(nn.Module):
    """Acceptance logit of a draft position: a linear map of [backbone state ; W1[prev]] (or the state alone)."""

    def __init__(self, hidden_size: int, markov_rank: int, with_markov: bool):
        super().__init__()
        self.with_markov = with_markov
        self.proj = nn.Linear(hidden_size + (markov_rank if with_markov else 0), 1)

    def forward(self, hidden: Tensor, prev_embed: Tensor | None) -> Tensor:
        features = torch.cat((hidden, prev_embed.to(hidden.dtype)), dim=-1) if self.with_markov else hidden
        return self.proj(features.to(self.proj.weight.dtype)).squeeze(-1)
