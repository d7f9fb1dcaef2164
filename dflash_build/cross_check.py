"""`--cross-check N`: recompute a few sequences of a build with the transformers engine, one at a
time and unpadded, and compare them with what the build's own engine produced.

A build writes what its engine returns; an engine that silently returns wrong states (all-zero
captures on hybrid models, a padding or batching bug) writes a cache that trains a drafter which
never gets accepted. The reference is the transformers teacher: the build's own teacher with
`--engine transformers` (then the check catches batch and padding effects), and a second, loaded
teacher with `--engine vllm` (on a GPU node it needs the teacher's memory once more, next to the
engine's share: lower `gpu_memory_utilization` accordingly).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from dflash_common.errors import TeacherError


def as_float(hidden: np.ndarray) -> np.ndarray:
    """Stored hidden states (bf16 bits as uint16, or floats) as float32."""
    if hidden.dtype == np.uint16:  # bf16: its bits are the high half of a float32's
        return (hidden.astype(np.uint32) << 16).view(np.float32)
    return hidden.astype(np.float32)


def relative_difference(built: np.ndarray, reference: np.ndarray) -> float:
    """Largest absolute difference relative to the reference's largest magnitude (a reference of
    zeros compares absolutely)."""
    if built.size == 0:
        return 0.0
    scale = float(np.abs(reference).max())
    return float(np.abs(built - reference).max()) / (scale if scale > 0 else 1.0)


def relative_norm(built: np.ndarray, reference: np.ndarray) -> float:
    """One layer's states [T, H] against the reference's: ||built_t - reference_t|| / ||reference_t||
    at each position t, averaged over the sequence (a zero reference position compares
    absolutely). Per position, because a norm or a maximum over the whole layer is the few
    massive-activation entries' (Qwen's first token holds channels in the thousands, nearly the
    same in neighbouring layers), so errors of tens of units elsewhere, or the neighbour layer's
    states, would pass under it."""
    if built.size == 0:
        return 0.0
    diff = np.linalg.norm(built - reference, axis=-1)
    scale = np.linalg.norm(reference, axis=-1)
    return float(np.mean(diff / np.where(scale > 0, scale, 1.0)))


def sequence_differences(hidden: np.ndarray, topk_logprobs: np.ndarray, reference_hidden: np.ndarray,
                         reference_logprobs: np.ndarray) -> tuple[list[float], float]:
    """Per tapped layer, the relative norm of one sequence's hidden states [T, L, H]
    (relative_norm), and the relative difference of its top-k log-probs [T, k]."""
    built, ref = as_float(hidden), as_float(reference_hidden)
    layers = [relative_norm(built[:, j], ref[:, j]) for j in range(built.shape[1])]
    return layers, relative_difference(topk_logprobs.astype(np.float32), reference_logprobs.astype(np.float32))


@dataclass
class CrossCheck:
    """Recomputes up to `count` sequences of this rank (sampled from the shards as they are
    computed) with `reference()` and keeps the largest differences; stops the build past
    `bound`."""

    count: int
    bound: float
    reference: Callable[[], object]
    """Returns the transformers teacher (loaded on first use)."""
    layer_ids: list[int]
    rank: int = 0
    checked: int = 0
    hidden: list[float] = field(default_factory=list)
    logprobs: float = 0.0
    top1_equal: int = 0
    tokens: int = 0

    def check_shard(self, index: int, shard) -> None:
        """Check a sample of `shard` (a ShardData of rank `self.rank`, number `index`)."""
        remaining = self.count - self.checked
        if remaining <= 0 or not len(shard.ids):
            return
        # the same sequences whenever this shard is computed
        rng = np.random.default_rng([self.rank, index])
        picks = np.sort(rng.choice(len(shard.ids), size=min(remaining, len(shard.ids)), replace=False))
        offsets = np.concatenate([[0], np.cumsum(shard.lengths, dtype=np.int64)])
        teacher = self.reference()
        for i in picks:
            lo, hi = offsets[i], offsets[i + 1]
            out = teacher.forward([shard.input_ids[lo:hi]])
            layers, logprobs = sequence_differences(shard.hidden[lo:hi], shard.topk_logprobs[lo:hi],
                                                    out.hidden, out.topk_logprobs)
            self.hidden = [max(a, b) for a, b in zip(self.hidden, layers)] if self.hidden else layers
            self.logprobs = max(self.logprobs, logprobs)
            self.top1_equal += int((shard.topk_ids[lo:hi, 0] == out.topk_ids[:, 0]).sum())
            self.tokens += int(hi - lo)
            self.checked += 1
            worst = int(np.argmax(layers))
            if layers[worst] > self.bound or logprobs > self.bound:
                what = (f"layer {self.layer_ids[worst]}'s hidden states differ by {layers[worst]:.3g} (relative norm)"
                        if layers[worst] >= logprobs else f"the top-k log-probs differ by {logprobs:.3g} (relative)")
                raise TeacherError(
                    f"cross-check: sequence {shard.ids[i]!r} (shard {index} of rank {self.rank}): {what} from "
                    f"the transformers engine, past --cross-check-bound {self.bound:g}; the build's engine computes "
                    f"another teacher (check its options and version), or raise the bound if the difference is expected")

    def record(self) -> dict:
        """What goes into the manifest's `last_run`."""
        return {
            "sequences": self.checked, "tokens": self.tokens, "bound": self.bound,
            "hidden_relative": {str(layer): round(d, 8) for layer, d in zip(self.layer_ids, self.hidden)},
            "logprobs_relative": round(self.logprobs, 8),
            "top1_agreement": round(self.top1_equal / self.tokens, 6) if self.tokens else None,
        }


def merge_records(records: list[dict]) -> dict:
    """Several ranks' cross-checks as one: the largest differences, the summed counts."""
    tokens = sum(r["tokens"] for r in records)
    agree = sum((r["top1_agreement"] or 0) * r["tokens"] for r in records)
    layers = sorted({k for r in records for k in r["hidden_relative"]}, key=int)
    return {
        "sequences": sum(r["sequences"] for r in records), "tokens": tokens, "bound": max(r["bound"] for r in records),
        "hidden_relative": {k: max(r["hidden_relative"].get(k, 0.0) for r in records) for k in layers},
        "logprobs_relative": max(r["logprobs_relative"] for r in records),
        "top1_agreement": round(agree / tokens, 6) if tokens else None,
    }
