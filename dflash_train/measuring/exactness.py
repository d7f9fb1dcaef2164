"""Whether greedy speculative decoding gave the teacher's own output, and where not, why.

Exact equality (`matched_teacher`) is the claim of a lossless decoder, and in fp32 on the CPU it
holds. In bf16 on a GPU it can fail for a correct decoder: the verify forward runs a block of
tokens and the teacher alone one token at a time, so every layer's matmuls reduce in another
order and round differently, and where the teacher's top two logits are within that rounding the
argmax can flip. From there on the two outputs are different continuations, so only the first
divergence says anything. It is named a near-tie flip when the teacher's own margin there (top-1
minus top-2 logit, from its one-token generation) is at most NEAR_TIE_ULPS steps of the logits'
dtype at the top-1 logit's magnitude and the speculative token is the teacher's runner-up;
anything else is a real mismatch, which a decoding bug gives (a wrong cache position, a wrong
rollback) at margins far above rounding.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch

from dflash_train.measuring.speculative import TeacherChoice

NEAR_TIE_ULPS = 8
"""A margin of at most this many steps of the logits' dtype at the top-1 logit's magnitude is a
near tie: 1.0 at |logit| 16-32 in bf16 (steps of 0.125, the granularity the teacher's bf16 LM head
writes its logits in), ~2e-6 at |logit| 2-4 in fp32. A block forward and a one-token forward
differ by the rounding of every layer before the head, a few of those steps at the logits; a
real decoding error is not bounded by them."""


def resolution(value: float, dtype: torch.dtype) -> float:
    """The spacing of dtype's numbers at |value| (its ulp there): 0.125 for bf16 at 16-32."""
    info = torch.finfo(dtype)
    magnitude = max(abs(value), info.tiny)
    return info.eps * 2.0 ** math.floor(math.log2(magnitude))


def first_divergence(output: Sequence[int], reference: Sequence[int], choices: Sequence[TeacherChoice],
                     dtype: torch.dtype) -> dict | None:
    """Where a greedy output first leaves the teacher's own (reference, with the teacher's choice
    for each of its tokens), and whether that is a near-tie flip; None when the two are equal.
    `position` counts new tokens; a missing token (one output ended first) is None."""
    if list(output) == list(reference):
        return None
    position = next((i for i, (a, b) in enumerate(zip(output, reference)) if a != b), min(len(output), len(reference)))
    token = int(output[position]) if position < len(output) else None
    found = {"position": position, "token": token,
             "teacher_token": int(reference[position]) if position < len(reference) else None,
             "teacher_runner_up": None, "teacher_margin": None, "margin_ulps": None, "near_tie": False}
    if position >= len(choices):  # the teacher ended here: no margin to judge by
        return found
    choice = choices[position]
    ulps = choice.margin / resolution(choice.top_logit, dtype)
    found.update(teacher_runner_up=choice.runner_up, teacher_margin=choice.margin, margin_ulps=ulps,
                 near_tie=token == choice.runner_up and ulps <= NEAR_TIE_ULPS)
    return found


def exactness_summary(divergences: Sequence[dict | None], dtype: torch.dtype) -> dict:
    """The report's count of the prompts whose output left the teacher's: at a near tie
    (`near_tie_flips`) or not (`mismatches`), with the threshold they were judged by."""
    diverged = [d for d in divergences if d is not None]
    flips = sum(bool(d["near_tie"]) for d in diverged)
    return {"mismatches": len(diverged) - flips, "near_tie_flips": flips, "near_tie_ulps": NEAR_TIE_ULPS,
            "logits_dtype": str(dtype).removeprefix("torch.")}


def exactness_text(rows: Sequence[dict]) -> str:
    """The printed verdict over per-prompt report rows (their `id` and `divergence`): "yes", a
    named near-tie flip, or "NO" with the first real mismatch."""
    diverged = [r for r in rows if r.get("divergence") is not None]
    if not diverged:
        return "yes"
    real = [r for r in diverged if not r["divergence"]["near_tie"]]
    if real:
        return f"NO: {len(real)} of {len(rows)} prompts leave it where the teacher was clear (first: {_where(real[0])})"
    return (f"no, near-tie flips only: {len(diverged)} of {len(rows)} prompts take the teacher's runner-up where its "
            f"top two logits are within {NEAR_TIE_ULPS} steps of its dtype (first: {_where(diverged[0])})")


def _where(row: dict) -> str:
    d = row["divergence"]
    at = f"prompt {row['id']!r} at new token {d['position']}"
    if d["teacher_margin"] is None:
        return f"{at}, past the teacher's end"
    return f"{at}, teacher margin {d['teacher_margin']:.4g} = {d['margin_ulps']:.3g} steps"
