"""The drafter's building blocks: rotary embeddings, RMSNorm, the SwiGLU MLP, and the attention
and decoder layers that dflash_train.training.model stacks (docs/design.md, "The drafter").

Attention takes its kernel as an `AttendFn`, so one layer serves the many-block training pass
(a block mask) and one-block decoding alike; the masks live with the drafter in model.py.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_train.settings.drafter_config import DrafterConfig
from dflash_train.training.dflash2 import GroupedConv


def rotary_cos_sin(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin [..., S, head_dim] in fp32 for integer positions [..., S] (half-split layout)."""
    exponents = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    angles = positions.float().unsqueeze(-1) * inv_freq
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [N, heads, S, D] by cos/sin [N, S, D] (computed in fp32, applied in x's dtype)."""
    cos = cos.unsqueeze(1).to(x.dtype)
    sin = sin.unsqueeze(1).to(x.dtype)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32 (Qwen3 numerics), scaled by a learned weight."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class SwiGLU(nn.Module):
    """The Qwen3 MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


AttendFn = Callable[[Tensor, Tensor, Tensor], Tensor]


class DrafterAttention(nn.Module):
    """Queries from the block; keys/values from [context features ; block]; per-head q/k RMSNorm."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_key_value_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def _heads(self, x: Tensor, num_heads: int) -> Tensor:
        return x.view(*x.shape[:-1], num_heads, self.head_dim).transpose(1, 2)

    def keys_values(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        """Rotated, normed keys and values [N, kv_heads, S, D] of states x [N, S, H]."""
        keys = apply_rotary(self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)), cos, sin)
        values = self._heads(self.v_proj(x), self.num_kv_heads)
        return keys, values

    def forward(self, x: Tensor, context_kv: tuple[Tensor, Tensor], cos: Tensor, sin: Tensor,
                attend: AttendFn) -> Tensor:
        queries = apply_rotary(self.q_norm(self._heads(self.q_proj(x), self.num_heads)), cos, sin)
        block_keys, block_values = self.keys_values(x, cos, sin)
        keys = torch.cat((context_kv[0], block_keys), dim=2)
        values = torch.cat((context_kv[1], block_values), dim=2)
        # Under bf16 autocast the projections are bf16 but the fp32 q/k norms return fp32: SDPA
        # casts them itself, flex_attention refuses mixed dtypes. Both get v's dtype here.
        out = attend(queries.to(values.dtype), keys.to(values.dtype), values)
        return self.o_proj(out.transpose(1, 2).reshape(*x.shape[:-1], self.num_heads * self.head_dim))


class DrafterLayer(nn.Module):
    """Pre-norm residual block: attention, then SwiGLU MLP; for DFlash2 each of the two wrapped in
    its grouped dynamic convolution along the block (dflash_train.training.dflash2)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DrafterAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)
        conv = cfg.dflash2
        if conv is not None:
            shape = (cfg.hidden_size, conv.conv_kernel_size, conv.conv_group_size, cfg.block_size)
            self.attention_conv, self.mlp_conv = GroupedConv(*shape), GroupedConv(*shape)

    def forward(self, x: Tensor, context_kv: tuple[Tensor, Tensor], cos: Tensor, sin: Tensor,
                attend: AttendFn) -> Tensor:
        """x [N, S, H]: S is whole blocks of block_size positions, one after another."""
        if not hasattr(self, "attention_conv"):
            x = x + self.self_attn(self.input_layernorm(x), context_kv, cos, sin, attend)
            return x + self.mlp(self.post_attention_layernorm(x))
        h, delta = self.attention_conv.prepare(self.input_layernorm(x))
        x = x + self.attention_conv.finish(self.self_attn(h, context_kv, cos, sin, attend), delta)
        h, delta = self.mlp_conv.prepare(self.post_attention_layernorm(x))
        return x + self.mlp_conv.finish(self.mlp(h), delta)
