"""The DFlash drafter: a few Qwen3-style layers that draft a block of tokens from teacher features.

Contract (see docs/design.md, "The drafter"): context features `c = hidden_norm(fc(concat of the tapped
layers' hidden states))`; every layer attends from the block states to keys/values
`[proj(c) ; proj(block)]`; a block anchored at `a` is `[x_a, MASK, ..., MASK]`, sits at rotary
positions `a..a+B-1`, sees context positions `< a` and its own block (bidirectionally on
full-attention layers, causally on sliding-window layers, as the serving engines run them; causally
on every layer for a `causal` drafter, as vLLM serves `dflash_config.causal = true`).

Parameter names are exactly the export names, so `state_dict()` is the exported tensor set; the
teacher's embedding and LM head are non-persistent buffers and never part of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Callable, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.utils.rnn import pad_sequence

from dflash_common.errors import ConfigError
from dflash_common.values import check_choice
from dflash_teacher.teacher import fp32_logits
from dflash_train.settings.data_config import PACKED
from dflash_train.settings.drafter_config import (
    ATTENTION_BACKENDS,
    ATTENTION_CHOICES,
    DrafterConfig,
)
from dflash_train.training.dflash2 import CandidateSelector, GroupedConv
from dflash_train.training.dspark import MARKOV_EMBED_STD, ConfidenceHead, MarkovHead
from dflash_train.training.layers import AttendFn, DrafterLayer, RMSNorm, rotary_cos_sin
from dflash_train.training.layout import copy_to, sequence_starts, token_positions
from dflash_train.training.lilicorr import Correlator, training_lattice, walk_lattice

# HF-style initialisation, the same the reference drafters start from.
INIT_STD = 0.02


def attention_backend(choice: str, device: torch.device, training: bool = True) -> str:
    """The kernel for model.attention_backend on `device`: "auto" is flex_attention on CUDA
    (compiled, it skips the fully masked tiles of the block mask) and SDPA with a dense mask
    elsewhere. flex_attention has no backward on CPU, so training there refuses it."""
    check_choice("model.attention_backend", choice, ATTENTION_CHOICES)
    if choice == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if choice == "flex" and training and device.type != "cuda":
        raise ConfigError(f"model.attention_backend flex cannot train on {device.type}: flex_attention has no "
                          "backward there; use sdpa or auto")
    return choice


# ---------------------------------------------------------------------------------------------
# Attention: who sees what, and the kernels that apply it


def _visible(query_anchor: Tensor, q_idx: Tensor, kv_idx: Tensor, seq_len: int, block_size: int,
             sliding_window: int | None, causal: bool = False) -> Tensor:
    """Whether block query `q_idx` may attend to key `kv_idx` (broadcasting elementwise predicate).

    Keys are [seq_len context positions ; the blocks' positions]; `query_anchor` is the anchor of
    the query's block (-1 for an unused slot, which then sees only its own block). Shared by the
    dense mask and the flex_attention mask_mod so both paths agree by construction. `causal`: the
    block's queries see the block's keys up to their own position only, on a full layer too (the
    context stays wholly visible), which is vLLM's causal attention over context + block.
    """
    in_context = kv_idx < seq_len
    block_offset = kv_idx - seq_len
    same_block = torch.div(block_offset, block_size, rounding_mode="floor") == torch.div(
        q_idx, block_size, rounding_mode="floor")
    visible = (in_context & (kv_idx < query_anchor)) | (~in_context & same_block)
    query_offset = q_idx % block_size
    key_offset = block_offset % block_size
    if causal or sliding_window is not None:
        # Sliding layers are causal inside the block, as vLLM, SGLang, SpecForge and speculators
        # serve them; a drafter trained bidirectionally there would be served attention it never saw.
        visible = visible & (in_context | (key_offset <= query_offset))
    if sliding_window is not None:
        query_pos = query_anchor + query_offset
        key_pos = torch.where(in_context, kv_idx, query_anchor + key_offset)
        visible = visible & (key_pos > query_pos - sliding_window)
    return visible


def block_attention_mask(anchors: Tensor, seq_len: int, block_size: int,
                         sliding_window: int | None = None, causal: bool = False) -> Tensor:
    """Boolean attention mask [N, A*B, T + A*B] (True = may attend) for many blocks per sequence.

    anchors: [N, A] long, -1 for unused slots. Block j's queries see context positions t < a_j and
    all of block j; sliding layers, and every layer when `causal`, see only the block positions up
    to their own (causal inside the block); sliding layers require key position > query position -
    sliding_window.
    """
    num_anchors = anchors.shape[1]
    num_queries = num_anchors * block_size
    device = anchors.device
    q_idx = torch.arange(num_queries, device=device).view(1, num_queries, 1)
    kv_idx = torch.arange(seq_len + num_queries, device=device).view(1, 1, -1)
    query_anchor = anchors.repeat_interleave(block_size, dim=1).unsqueeze(-1)
    return _visible(query_anchor, q_idx, kv_idx, seq_len, block_size, sliding_window, causal)


def _single_block_mask(context_len: int, block_size: int, sliding_window: int | None, causal: bool,
                       device: torch.device) -> Tensor | None:
    """Mask [B, a + B] of one block anchored right after its context, None where the layer sees it all
    (a full, non-causal layer)."""
    if sliding_window is None and not causal:
        return None
    anchor = torch.tensor([[context_len]], device=device)
    mask = block_attention_mask(anchor, context_len, block_size, sliding_window, causal)
    return mask[0]


def _sdpa_attend(mask: Tensor | None, kv_groups: int) -> AttendFn:
    """SDPA with an explicit boolean mask [N, Q, K] (or none)."""
    attn_mask = None if mask is None else mask.unsqueeze(1)

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        if kv_groups > 1:
            # Repeating keeps SDPA on its memory-efficient masked kernel; enable_gqa would not.
            k = k.repeat_interleave(kv_groups, dim=1)
            v = v.repeat_interleave(kv_groups, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)

    return attend


_compiled_flex_attention: Callable[..., Tensor] | None = None
COMPILE_FLEX_ON = {"cuda"}
"""Device types whose flex_attention is compiled (elsewhere it runs eagerly, which is only for
tests: CPU has no flex backward, and its forward compiles in tens of seconds)."""


def flex_mask_mod(anchors: Tensor, seq_len: Tensor, block_size: int, sliding_window: int | None,
                  causal: bool = False):
    """The flex_attention mask_mod of `block_attention_mask`, reading the batch from tensors
    (anchors [N, A], seq_len a 0-d tensor): compiled code guards on their shapes, not on their
    values, so batches of other lengths and anchors reuse one dynamic-shape graph instead of
    recompiling per batch (a Python int closed over was a constant, and a recompile, per value).
    block_size, the window and causal are the drafter's, the same for every batch."""

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        query_anchor = anchors[b, torch.div(q_idx, block_size, rounding_mode="floor")]
        return _visible(query_anchor, q_idx, kv_idx, seq_len, block_size, sliding_window, causal)

    return mask_mod


def _flex_attend(anchors: Tensor, seq_len: int, block_size: int, sliding_window: int | None,
                 causal: bool) -> AttendFn:
    """flex_attention with a BlockMask built from the same predicate as `block_attention_mask`.

    Compiled on CUDA (where it skips fully masked tiles), with dynamic shapes: the batch's
    sizes vary from step to step; eager elsewhere (COMPILE_FLEX_ON).
    """
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    global _compiled_flex_attention
    num_queries = anchors.shape[1] * block_size
    # filled on the device: torch.tensor(seq_len, device=...) is a blocking copy from the host
    length = torch.full((), seq_len, dtype=torch.long, device=anchors.device)
    mask_mod = flex_mask_mod(anchors, length, block_size, sliding_window, causal)
    # compiled on CUDA too: eager, it materialises the whole [B, Q, KV] mask first (0.1-2 GB
    # transient a forward at production lengths); compiled, only the block tiles
    block_mask = create_block_mask(mask_mod, anchors.shape[0], None, num_queries, seq_len + num_queries,
                                   device=anchors.device, _compile=anchors.device.type == "cuda")
    if anchors.device.type in COMPILE_FLEX_ON:
        if _compiled_flex_attention is None:
            _compiled_flex_attention = torch.compile(flex_attention, dynamic=True)
        kernel = _compiled_flex_attention
    else:
        kernel = flex_attention

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return kernel(q, k, v, block_mask=block_mask, enable_gqa=q.shape[1] != k.shape[1])

    return attend


# ---------------------------------------------------------------------------------------------
# The drafter


class DFlashDrafter(nn.Module):
    """DFlash drafter; trainable weights are named exactly as in the export."""

    def __init__(self, cfg: DrafterConfig, embed_weight: Tensor, lm_head_weight: Tensor,
                 attention_backend: str = "sdpa"):
        super().__init__()
        expected = (cfg.vocab_size, cfg.hidden_size)
        for name, weight in (("embed_weight", embed_weight), ("lm_head_weight", lm_head_weight)):
            if tuple(weight.shape) != expected:
                raise ConfigError(
                    f"{name} has shape {tuple(weight.shape)}, the drafter config expects {expected} "
                    "(vocab_size, hidden_size); use the teacher the config was derived from")
        if attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError(f"attention_backend={attention_backend!r} is unknown; use one of {ATTENTION_BACKENDS}")
        self.cfg = cfg
        self.attention_backend = attention_backend
        self.fc = nn.Linear(cfg.num_context_layers * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        heads = cfg.dspark
        self.markov_head = (MarkovHead(cfg.vocab_size, cfg.hidden_size, heads.markov_rank, heads.markov_head_type)
                            if heads is not None and heads.markov_rank > 0 else None)
        self.confidence_head = (ConfidenceHead(cfg.hidden_size, heads.markov_rank, heads.confidence_head_with_markov)
                                if heads is not None and heads.enable_confidence_head else None)
        self.candidate_selector = (CandidateSelector(cfg.vocab_size, cfg.hidden_size, cfg.selector.selector_rank)
                                   if cfg.selector is not None else None)
        self.lilicorr = (Correlator(cfg.lilicorr, cfg.hidden_size, cfg.block_size, cfg.rms_norm_eps)
                         if cfg.lilicorr is not None else None)
        # Frozen teacher pieces: buffers follow .to() but stay out of state_dict and the optimizer.
        self.register_buffer("embed_weight", embed_weight.detach(), persistent=False)
        self.register_buffer("lm_head_weight", lm_head_weight.detach(), persistent=False)
        self.reset_parameters()

    @classmethod
    def build(cls, cfg: DrafterConfig, embed_weight: Tensor, lm_head_weight: Tensor, device: torch.device | str,
              attention_backend: str = "sdpa", state: Mapping[str, Tensor] | None = None) -> "DFlashDrafter":
        """The drafter with its parameters allocated once, on `device`: built on the meta device,
        then initialised there (seeded by the global RNG) or given `state`'s tensors. A
        production drafter (1.8B parameters) built on the host and moved costs ~22 GB of host
        memory per rank and minutes of start-up; this costs the frozen head's copy only."""
        device = torch.device(device)
        with torch.device("meta"):
            model = cls(cfg, embed_weight.to("meta"), lm_head_weight.to("meta"), attention_backend)
        if state is not None:
            model.load_state_dict(state, assign=True)
        else:
            model.to_empty(device=device)
            model.reset_parameters()
        model.embed_weight = embed_weight.detach().to(device)
        model.lm_head_weight = lm_head_weight.detach().to(device)
        return model.to(device)

    def reset_parameters(self) -> None:
        """Linear weights ~ N(0, 0.02) and biases 0, norm weights 1 (the HF Qwen3 initialisation);
        the Markov embedding W1 ~ N(0, 0.01) (DSpark's); DFlash2's convolutions the identity and its
        selector N(0, 0.02) (speculators'); LiLiCorr's correlator walking the top-1 path (its own)."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=MARKOV_EMBED_STD)
        for module in self.modules():  # after their own Linear children's generic start above
            if isinstance(module, (GroupedConv, CandidateSelector, Correlator)):
                module.reset_parameters()

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    def context_features(self, context_hidden: Tensor) -> Tensor:
        """hidden_norm(fc(concat of tapped layers)): [N, T, n_layers, H] -> [N, T, H]."""
        n, t, layers, hidden = context_hidden.shape
        if (layers, hidden) != (self.cfg.num_context_layers, self.cfg.hidden_size):
            raise ConfigError(
                f"context hidden states have {layers} layers of width {hidden}, the drafter expects "
                f"{self.cfg.num_context_layers} of width {self.cfg.hidden_size}; use a cache built with "
                f"layer ids {list(self.cfg.target_layer_ids)}")
        flat = context_hidden.to(self.dtype).reshape(n, t, layers * hidden)
        return self.hidden_norm(self.fc(flat))

    def context_kv(self, context_hidden: Tensor, start: int = 0) -> list[tuple[Tensor, Tensor]]:
        """Per-layer context keys/values [N, kv_heads, T, D] at positions start..start+T-1.

        A decoder may cache these and append the keys/values of newly accepted positions
        (computed with `start` = their first position) along dim 2.
        """
        features = self.context_features(context_hidden)
        positions = torch.arange(start, start + features.shape[1], device=features.device)
        return self._keys_values(features, positions.unsqueeze(0))

    def _keys_values(self, features: Tensor, positions: Tensor) -> list[tuple[Tensor, Tensor]]:
        cos, sin = rotary_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta)
        return [layer.self_attn.keys_values(features, cos, sin) for layer in self.layers]

    def _packed_context_kv(self, context_hidden: Tensor, lengths: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Per-layer context keys/values [N, kv_heads, T_max, D] of sequences packed end to end in
        context_hidden [1, sum T, n_layers, H]: fc and the K/V projections run on the real tokens
        only (rotary positions restarting per sequence), then each sequence's keys/values are laid
        into its own zero-padded row, so every block attends to its own sequence's context alone
        under the padded layout's mask: the visibility of a document mask over the packed row,
        without scoring other sequences' keys. The rows hold exactly the padded layout's keys and
        values (a zero hidden state projects to zero keys and values); they copy 2 x kv_heads x D
        values a row position per layer, little next to the fc (n_layers x H inputs) and K/V
        projections skipped on the padding. ``lengths`` are the host's: the split and the rotary
        positions are made there."""
        features = self.context_features(context_hidden)
        split = lengths.tolist()
        positions = copy_to(token_positions(lengths), features.device)

        def rows(x: Tensor) -> Tensor:  # [1, kv_heads, sum T, D] -> [N, kv_heads, T_max, D]
            return pad_sequence(x[0].transpose(0, 1).split(split), batch_first=True).transpose(1, 2)

        return [(rows(keys), rows(values))
                for keys, values in self._keys_values(features, positions.unsqueeze(0))]

    def embed(self, token_ids: Tensor) -> Tensor:
        """Teacher input embeddings of token ids, in the model dtype (times DFlash2's input_embedding_scale)."""
        embedded = F.embedding(token_ids, self.embed_weight).to(self.dtype)
        scale = self.cfg.dflash2.input_embedding_scale if self.cfg.dflash2 is not None else 1.0
        return embedded * scale if scale != 1.0 else embedded

    def forward(self, context_hidden: Tensor, input_ids: Tensor, anchors: Tensor,
                heads: bool = False, packed_lengths: Sequence[int] | Tensor | None = None,
                last_anchor: int | None = None) -> Tensor | tuple[Tensor, Tensor | None, Tensor | None]:
        """Final-normed block states [N, A, B, H] for many anchors per sequence in one pass.

        context_hidden [N, T, n_layers, H]; input_ids [N, T] (padded); anchors [N, A] long, -1 for
        unused slots (their outputs are finite but meaningless). With `packed_lengths` [N] the
        sequences lie end to end instead (dflash_train.training.layout): context_hidden [1, sum T, n_layers,
        H], input_ids [1, sum T], anchors still in each sequence's own positions. The lengths are
        read by the host (to lay the sequences out), so pass them from the host: ints or a CPU tensor.
        ``last_anchor``: the anchors' maximum when the caller knows it on the host (the dense path
        trims the context to it); None reads it from ``anchors``, which waits for the device.

        With `heads`, the draft positions' outputs under teacher forcing instead (see
        `draft_outputs`): the heads run inside the forward so a DDP or FSDP wrapper sees them.
        """
        n, num_anchors = anchors.shape
        seq_len, context, starts, last = self._context_layout(context_hidden, input_ids, anchors, packed_lengths,
                                                              last_anchor)

        block_size = self.cfg.block_size
        safe_anchors = anchors.clamp(min=0)
        block_ids = torch.full((n, num_anchors, block_size), self.cfg.mask_token_id,
                               dtype=input_ids.dtype, device=input_ids.device)
        block_ids[:, :, 0] = _tokens_at(input_ids, starts, last, safe_anchors)
        x = self.embed(block_ids.view(n, num_anchors * block_size))

        offsets = torch.arange(block_size, device=anchors.device)
        positions = (safe_anchors.unsqueeze(-1) + offsets).view(n, num_anchors * block_size)
        cos, sin = rotary_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta)

        attend_by_window = {
            window: self._many_block_attend(anchors, seq_len, window)
            for window in {self.cfg.layer_window(i) for i in range(self.cfg.num_hidden_layers)}
        }
        for index, layer in enumerate(self.layers):
            x = layer(x, context[index], cos, sin, attend_by_window[self.cfg.layer_window(index)])
        states = self.norm(x).view(n, num_anchors, block_size, -1)
        if not heads:
            return states
        # draft position j = 1..P follows x_{a+j-1}: the anchor, then the true tokens (teacher forcing)
        prev_pos = safe_anchors.unsqueeze(-1) + torch.arange(self.cfg.num_draft_positions, device=anchors.device)
        blocks = states.view(n * num_anchors, block_size, -1)
        if self.lilicorr is not None:
            path = _tokens_at(input_ids, starts, last, prev_pos + 1).view(n * num_anchors, -1)
            anchor = self.context_features(_tokens_at(context_hidden, starts, last, (safe_anchors - 1).clamp(min=0))
                                           .view(1, n * num_anchors, *context_hidden.shape[2:]))
            positions = self.draft_slots(blocks)
            return positions, *training_lattice(self.lilicorr, self.logits, self.embed_weight, positions, path, anchor[0])
        prev_ids = _tokens_at(input_ids, starts, last, prev_pos)
        return self.draft_outputs(blocks, prev_ids.view(n * num_anchors, self.cfg.num_draft_positions))

    def _context_layout(self, context_hidden: Tensor, input_ids: Tensor, anchors: Tensor,
                        packed_lengths: Sequence[int] | Tensor | None, last_anchor: int | None
                        ) -> tuple[int, list[tuple[Tensor, Tensor]], Tensor, Tensor]:
        """(longest sequence, per-layer context keys/values, each sequence's first flat token index
        [N], its last own position [N]) of forward's batch, padded or packed, refusing inputs whose
        shapes disagree."""
        rows, width = input_ids.shape
        if packed_lengths is not None:
            packed_lengths = torch.as_tensor(packed_lengths, dtype=torch.long).cpu()
        if context_hidden.shape[:2] != (rows, width):
            raise ConfigError(
                f"context_hidden starts with {tuple(context_hidden.shape[:2])} but input_ids is "
                f"{(rows, width)}; pass the same sequences to both")
        n = anchors.shape[0]
        if packed_lengths is not None and (rows != 1 or len(packed_lengths) != n or int(packed_lengths.sum()) != width):
            raise ConfigError(
                f"a packed batch is one row of all its sequences' tokens: got {rows} row(s) of {width} tokens for "
                f"{len(packed_lengths)} lengths summing to {int(packed_lengths.sum())} and {n} rows of anchors")
        if packed_lengths is None and n != rows:
            raise ConfigError(f"anchors has {n} rows for {rows} padded sequences; pass one row of anchors per sequence")
        keys = self._context_reach(anchors, width if packed_lengths is None else int(packed_lengths.max()), last_anchor)
        if packed_lengths is None or n == 1:  # one row a sequence: its context is the row's first `keys` tokens
            starts = torch.arange(n, device=anchors.device) * width
            last = torch.full_like(anchors[:, 0], width - 1)
            return keys, self.context_kv(context_hidden[:, :keys]), starts, last
        context = [(k[:, :, :keys], v[:, :, :keys]) for k, v in self._packed_context_kv(context_hidden, packed_lengths)]
        starts, last = (copy_to(t, anchors.device) for t in (sequence_starts(packed_lengths, PACKED, width), packed_lengths - 1))
        return keys, context, starts, last

    def _context_reach(self, anchors: Tensor, seq_len: int, last_anchor: int | None = None) -> int:
        """The context keys the blocks can see: those before their last anchor (at least one key).
        The dense SDPA path trims the context to them, so the blocks of a long sequence's early
        part (Batch.parts) attend to their own prefix only; flex skips the masked tiles itself.
        Without the host's ``last_anchor`` the anchors' maximum is read back from the device."""
        if self.attention_backend == "flex" or anchors.numel() == 0:
            return seq_len
        return max(1, min(seq_len, int(anchors.max()) if last_anchor is None else last_anchor))

    def draft_outputs(self, states: Tensor, prev_ids: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """(positions [M, P, H], Markov features [M, P, r] (DSpark) or the selector's context
        [M, P, r] (DFlash2) or None, confidence logits [M, P] or None) of whole blocks' states
        [M, B, H], position j's previous token being prev_ids[:, j-1]."""
        positions = self.draft_slots(states)
        if self.candidate_selector is not None:
            return positions, self.candidate_selector.context(positions, prev_ids), None
        prev_embed = self.markov_head.embed(prev_ids) if self.markov_head is not None else None
        features = self.markov_head.features(prev_embed, positions) if self.markov_head is not None else None
        confidence = self.confidence_head(positions, prev_embed) if self.confidence_head is not None else None
        return positions, features, confidence

    def draft_slots(self, states: Tensor) -> Tensor:
        """The draft positions' states [..., P, H] of whole blocks' states [..., B, H]: slots 1..P (the
        anchor's slot 0 too with DSpark's sample_from_anchor), what decoding drafts from."""
        first = self.cfg.first_slot_predicts
        return states[..., 1 - first:1 - first + self.cfg.num_draft_positions, :]

    def walk(self, positions: Tensor, anchor: Tensor) -> tuple[Tensor, Tensor]:
        """LiLiCorr's lattice as vLLM's speculator builds it: (candidates [N, S, k], the walk's
        scores [N, S, k, k]) of S draft positions' states [N, S, H] after anchor [N, H]."""
        return walk_lattice(self.lilicorr, self.logits, self.embed_weight, positions, anchor)

    def _many_block_attend(self, anchors: Tensor, seq_len: int, window: int | None) -> AttendFn:
        if self.attention_backend == "flex":
            return _flex_attend(anchors, seq_len, self.cfg.block_size, window, self.cfg.causal)
        mask = block_attention_mask(anchors, seq_len, self.cfg.block_size, window, self.cfg.causal)
        return _sdpa_attend(mask, self.cfg.num_attention_heads // self.cfg.num_key_value_heads)

    def forward_block(self, context_hidden: Tensor | None, block_ids: Tensor,
                      context_kv: list[tuple[Tensor, Tensor]] | None = None) -> Tensor:
        """Final-normed states [N, B, H] of one block anchored right after its context.

        context_hidden [N, a, n_layers, H] holds positions 0..a-1; block_ids [N, B] is
        `[x_a, MASK, ...]` at positions a..a+B-1. Pass `context_kv` (from `context_kv()`, possibly
        cached and extended) instead of context_hidden to skip recomputing the context.
        """
        if context_kv is None:
            if context_hidden is None:
                raise ConfigError("forward_block needs context_hidden or context_kv; pass one of them")
            context_kv = self.context_kv(context_hidden)
        context_len = context_kv[0][0].shape[2]
        block_size = block_ids.shape[1]
        positions = torch.arange(context_len, context_len + block_size, device=block_ids.device)
        cos, sin = rotary_cos_sin(positions.unsqueeze(0), self.cfg.head_dim, self.cfg.rope_theta)
        kv_groups = self.cfg.num_attention_heads // self.cfg.num_key_value_heads
        x = self.embed(block_ids)
        for index, layer in enumerate(self.layers):
            mask = _single_block_mask(context_len, block_size, self.cfg.layer_window(index), self.cfg.causal,
                                      block_ids.device)
            x = layer(x, context_kv[index], cos, sin, _sdpa_attend(None if mask is None else mask.unsqueeze(0), kv_groups))
        return self.norm(x)

    def logits(self, states: Tensor, features: Tensor | None = None) -> Tensor:
        """Teacher LM head over drafter states [..., H] -> [..., V], plus the Markov bias of
        features [..., r] when given; callers chunk large inputs."""
        head = self.lm_head_weight
        if states.dtype == torch.float32 and head.dtype != torch.float32:
            # a head shared with a bf16 teacher (eval): the fp32 logits an fp32 copy would give,
            # upcast a vocabulary slice at a time so that no copy of the whole head exists
            logits = fp32_logits(states, head)
        else:
            logits = states.to(head.dtype) @ head.T
        if features is not None:
            logits = logits + self.markov_head.bias(features).to(logits.dtype)
        return logits

    @property
    def bias_weight(self) -> Tensor | None:
        """W2 [V, r] of the Markov head, None without one."""
        return None if self.markov_head is None else self.markov_head.markov_w2.weight

    @property
    def loss_weights(self) -> list[Tensor]:
        """The trained weights that only the loss reads, outside the forward: the Markov head's W2
        (DSpark, bias_weight), the selector's successor codebook (DFlash2). A rank with no valid
        position at a step must still give them a (zero) gradient: DDP's all-reduce and FSDP2's
        reduce-scatter wait for every parameter on every rank."""
        selector = self.candidate_selector
        return [w for w in (self.bias_weight, None if selector is None else selector.successor_codebook)
                if w is not None and w.requires_grad]


def _tokens_at(input_ids: Tensor, starts: Tensor, last: Tensor, pos: Tensor) -> Tensor:
    """input_ids [rows, width, ...] at each sequence's own positions pos [N, ...], clamped to its
    last token; starts and last [N] place the sequences in input_ids' flattened tokens (see
    _context_layout)."""
    shape = (pos.shape[0], *[1] * (pos.ndim - 1))
    flat = starts.view(shape) + torch.minimum(pos, last.view(shape))
    return input_ids.flatten(0, 1)[flat]
