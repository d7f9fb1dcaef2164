"""Lossy fp8 (e4m3) storage of hidden states: pure quantise / dequantise functions.

Each row of H values (one token, one tapped layer) is stored as H float8_e4m3fn codes (uint8)
and one power-of-two scale ``2**exponent`` (int8 exponent): ``hidden = e4m3(code) * 2**exponent``.

Why powers of two: dividing by one is exact, so each value is rounded once, straight to e4m3;
and an e4m3 value (4 significant bits) times ``2**exponent`` is exactly representable in
bfloat16 (8 significant bits, same exponent range as float32) for every exponent allowed here,
so the reader returns the same bfloat16 values as a float32 dequantisation would, and consumers
of an fp8 cache see the same dtype as of a bf16 cache. An exact ``max/448`` scale puts each row's
largest values at the top of e4m3's range, where its relative spacing is finest: measured 0.0257
instead of 0.0267 relative error on the demo teacher (benchmarks/RESULTS.md, "fp8 storage"), which
is not worth losing exact bf16 decoding and a one-byte scale (a float32 scale is four). Smaller
blocks (1x32) measured no better there: e4m3 keeps its relative precision over 15 binades, so a
shared scale only hurts values more than ~2^14 below their row's maximum (subnormal codes).

Quantising runs in torch (about 7x faster than ml_dtypes' numpy casts on this machine, and it
releases the GIL, so the background shard writer overlaps the teacher), imported only then: the
results are the same codes ml_dtypes produces (round to nearest even), which tests check.
Decoding is a table lookup and a product by a power of two, in numpy where torch is not loaded,
so reading and verifying an fp8 cache loads no torch.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

import ml_dtypes
import numpy as np

from dflash_cache.settings.storage_config import FP8_E4M3
from dflash_common.errors import CacheError

if TYPE_CHECKING:
    import torch

FORMAT = FP8_E4M3
E4M3_MAX = 448.0
# Exponent range: 2**MIN_EXP times the smallest e4m3 subnormal (2**-9) is bfloat16's smallest
# subnormal (2**-133), and 448 * 2**MAX_EXP is below bfloat16's largest finite value, so every
# decoded value is exact in bfloat16. Rows outside it (max |x| < 2**-115 or > 2.9e38) lose precision
# in the tiniest values or saturate at 448 * 2**119.
MIN_EXP, MAX_EXP = -124, 119
CODE_DTYPE = np.dtype(np.uint8)
EXP_DTYPE = np.dtype(np.int8)
# e4m3fn has no infinities; its NaN is every exponent and mantissa bit set (0x7f, 0xff).
NAN_MASK = 0x7F

_PIECE_VALUES = 1 << 23  # float32 temporaries of 32 MB at most, however big the shard


def _as_torch(hidden: np.ndarray) -> torch.Tensor:
    """A zero-copy torch view of float32 or ml_dtypes.bfloat16 values."""
    import torch

    if hidden.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(hidden.view(np.int16)).view(torch.bfloat16)
    if hidden.dtype == np.float32:
        return torch.from_numpy(hidden)
    raise TypeError(f"fp8 quantisation takes float32 or bfloat16 hidden states, not {hidden.dtype}")


def scale_exponents(amax: torch.Tensor) -> torch.Tensor:
    """The smallest ``k`` with ``amax / 2**k <= 448`` per row, clamped to [MIN_EXP, MAX_EXP]; 0
    for all-zero rows. ``amax`` is float32 and finite."""
    import torch

    mantissa, exponent = torch.frexp(amax)  # amax = mantissa * 2**exponent, mantissa in [0.5, 1)
    # 448 = 0.875 * 2**9: a row fits below 2**(exponent - 9) * 448 unless its mantissa exceeds 0.875
    k = exponent - 9 + (mantissa > 0.875).to(exponent.dtype)
    k = torch.where(amax > 0, k, torch.zeros_like(k))
    return k.clamp_(MIN_EXP, MAX_EXP)


def _raise_nonfinite(x: torch.Tensor, first_row: int) -> None:
    import torch

    bad = (~torch.isfinite(x)).nonzero()[0].tolist()
    where = ", ".join(f"{name} {i}" for name, i in zip(("token", "layer", "index"), [bad[0] + first_row] + bad[1:]))
    raise CacheError(
        f"hidden states hold NaN/Inf (first at {where}), which fp8 storage cannot encode; "
        "drop non-finite sequences before writing (dflash-cache build skips them) or store them losslessly"
    )


def quantize(hidden: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """hidden ``[..., H]`` (float32 or ml_dtypes.bfloat16) -> (codes uint8 ``[..., H]``, exponents
    int8 ``[...]``) with ``hidden ~= e4m3(codes) * 2**exponents[..., None]``. Raises CacheError
    on NaN/Inf."""
    import torch

    hidden = np.ascontiguousarray(hidden)
    shape = hidden.shape
    rows_per_piece = max(1, _PIECE_VALUES // max(1, int(np.prod(shape[1:], dtype=np.int64))))
    codes = np.empty(shape, CODE_DTYPE)
    exponents = np.empty(shape[:-1], EXP_DTYPE)
    if codes.size == 0:
        exponents[...] = 0
        return codes, exponents
    codes_t, exponents_t = torch.from_numpy(codes), torch.from_numpy(exponents)
    for lo in range(0, shape[0], rows_per_piece):
        hi = min(lo + rows_per_piece, shape[0])
        # Stays in the input dtype throughout (measured ~4x faster for bf16 than going through
        # float32): the max is exact and so is the product by a power of two, so the cast to
        # e4m3 is the only rounding.
        x = _as_torch(hidden[lo:hi])
        amax = torch.maximum(x.amax(dim=-1), -x.amin(dim=-1)).float()  # NaN propagates, Inf stays
        if not torch.isfinite(amax).all():
            _raise_nonfinite(x, lo)
        k = scale_exponents(amax)
        scaled = x * torch.exp2(-k.float()).unsqueeze(-1).to(x.dtype)
        if int(k.max()) >= MAX_EXP:
            scaled.clamp_(-E4M3_MAX, E4M3_MAX)  # only rows beyond bfloat16's reach saturate
        codes_t[lo:hi] = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
        exponents_t[lo:hi] = k.to(torch.int8)
    return codes, exponents


# e4m3 code -> its value: a table lookup, as float32 and as bfloat16 bits.
_DECODE_F32 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
_DECODE_BF16 = _DECODE_F32.astype(ml_dtypes.bfloat16).view(np.int16)


def dequantize(codes: np.ndarray, exponents: np.ndarray, dtype: str = "bfloat16") -> np.ndarray:
    """``e4m3(codes) * 2**exponents[..., None]`` as ``dtype`` ('bfloat16' -> ml_dtypes.bfloat16,
    or 'float32'); exact in both for exponents in [MIN_EXP, MAX_EXP]. In a process that has torch
    loaded (training) the product runs in torch, 1.6x faster for bf16 (measured); elsewhere
    (info, verify) in numpy, which loads no torch: the float32 product by a power of two is exact
    (an e4m3 value has 4 significant bits), and so is its cast to bfloat16. The two give the same
    bits (tests/test_fp8.py)."""
    if dtype not in ("bfloat16", "float32"):
        raise TypeError(f"fp8 dequantises to bfloat16 or float32, not {dtype}")
    codes = np.asarray(codes, CODE_DTYPE)
    scale = np.ldexp(np.float32(1), np.asarray(exponents, EXP_DTYPE).astype(np.int32))[..., None]
    if "torch" in sys.modules:
        return _dequantize_torch(codes, scale, dtype)
    out = _DECODE_F32[codes]
    np.multiply(out, scale, out=out)
    return out if dtype == "float32" else out.astype(ml_dtypes.bfloat16)


def _dequantize_torch(codes: np.ndarray, scale: np.ndarray, dtype: str) -> np.ndarray:
    import torch

    scale = torch.from_numpy(scale)
    if dtype == "float32":
        return torch.from_numpy(_DECODE_F32[codes]).mul_(scale).numpy()
    # e4m3 -> bfloat16 is exact, and so is the product by a power of two (see the module docstring)
    out = torch.from_numpy(_DECODE_BF16[codes]).view(torch.bfloat16)
    return out.mul_(scale.to(torch.bfloat16)).view(torch.int16).numpy().view(ml_dtypes.bfloat16)


def relative_error(approx: np.ndarray, exact: np.ndarray, axis=(0, 2)) -> np.ndarray:
    """``||approx - exact|| / ||exact||`` over ``axis`` (default: per layer of ``[T, L, H]``)."""
    a, b = np.asarray(approx, np.float64), np.asarray(exact, np.float64)
    return np.sqrt(np.square(a - b).sum(axis=axis)) / np.maximum(np.sqrt(np.square(b).sum(axis=axis)), 1e-300)
