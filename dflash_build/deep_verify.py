"""`dflash-cache verify --deep`: re-run the teacher on a sample of cached sequences and compare its
hidden states and top-k with the stored ones (checksums prove the bytes are the ones written; this
proves they are the teacher's outputs for these tokens)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np

from dflash_cache import format as fmt
from dflash_cache.format import fp8
from dflash_cache.format.integrity import problem_text
from dflash_cache.reader import Cache
from dflash_cache.verify import MAX_NAMED
from dflash_common.errors import shown
from dflash_common.progress import Progress

# Largest accepted difference, by the cache's dtype. Hidden states: |stored - fresh| relative to
# |fresh| plus the layer's RMS (so near-zero values and outlier features are both judged fairly).
# Log-probs: absolute, scaled by 1 + |log-prob|. float32 reruns differ only by summation order
# (~1e-6); bfloat16 reruns in other batches round differently by a few units of bf16's 2^-8
# relative precision, which grow a little through the layers. A cache holding another teacher's
# outputs, other layers or shifted positions is off by O(1), far above both.
DEEP_TOLERANCE = {"float32": {"hidden": 1e-4, "logprobs": 1e-4},
                  "bfloat16": {"hidden": 2 ** -4, "logprobs": 2 ** -4}}
# fp8 rounds each value to 4 significant bits: within 2^-4 of |value| on top of the rerun's own
# difference in the build dtype (log-probs are stored in float32 either way).
FP8_HIDDEN_TOLERANCE = {"float32": 2 ** -4 + 1e-4, "bfloat16": 2 ** -3}


@dataclass
class DeepReport:
    """What `verify --deep` found: the sequences whose stored values a fresh teacher run disowns."""

    teacher: str
    checked: int = 0
    mismatches: dict[str, str] = field(default_factory=dict)  # "id (shard)" -> what differs

    @property
    def ok(self) -> bool:
        return not self.mismatches


def mismatch_lines(report: DeepReport) -> list[str]:
    """What `verify --deep` prints of the sequences that differ: the first MAX_NAMED, then a count."""
    lines = [f"MISMATCH {shown(seq)}: {problem_text(problem)}"
             for seq, problem in itertools.islice(report.mismatches.items(), MAX_NAMED)]
    if len(report.mismatches) > MAX_NAMED:
        lines.append(f"MISMATCH and {len(report.mismatches) - MAX_NAMED:,} more sequence(s)")
    return lines


def deep_sample(sizes: list[int], n: int, seed: int = 0) -> list[tuple[int, int]]:
    """Up to n (shard, sequence) pairs: a seeded round robin over shards, so any n >= number of
    shards reaches every shard (a shard rewritten wholesale is the likely corruption)."""
    rng = np.random.default_rng(seed)
    orders = [rng.permutation(k) for k in sizes]
    shard_order = rng.permutation(len(sizes))
    picked: list[tuple[int, int]] = []
    depth = 0
    while len(picked) < n and depth < max(sizes, default=0):
        for s in shard_order:
            if depth < sizes[s] and len(picked) < n:
                picked.append((int(s), int(orders[s][depth])))
        depth += 1
    return picked


ERROR_BLOCK_ROWS = 1024
"""Token rows compared at a time: the float32 copies and temporaries stay a block's, not a whole
sequence's (a 32k-token sequence at production width would need ~8x its bf16 bytes at once)."""


def hidden_error(stored: np.ndarray, fresh: np.ndarray) -> np.ndarray:
    """[n_layers] max over the sequence of |stored - fresh| / (|fresh| + RMS of the layer), in
    blocks of ERROR_BLOCK_ROWS token rows (the RMS from a first pass over all of them)."""
    n, layers = stored.shape[0], stored.shape[1]
    if not n:
        return np.zeros(layers)
    squares = np.zeros(layers, np.float64)
    for lo in range(0, n, ERROR_BLOCK_ROWS):
        b = np.asarray(fresh[lo:lo + ERROR_BLOCK_ROWS], np.float32)
        squares += np.square(b).sum(axis=(0, 2), dtype=np.float64)
    rms = (np.sqrt(squares / (n * fresh.shape[2])) + 1e-12).astype(np.float32)[None, :, None]
    worst = np.zeros(layers, np.float32)
    for lo in range(0, n, ERROR_BLOCK_ROWS):
        a = np.asarray(stored[lo:lo + ERROR_BLOCK_ROWS], np.float32)
        b = np.asarray(fresh[lo:lo + ERROR_BLOCK_ROWS], np.float32)
        worst = np.maximum(worst, (np.abs(a - b) / (np.abs(b) + rms)).max(axis=(0, 2)))
    return worst


def topk_mismatches(stored_ids: np.ndarray, stored_lp: np.ndarray, fresh_ids: np.ndarray, fresh_lp: np.ndarray,
                    tol: float) -> int:
    """Positions whose stored top-k disagrees with a fresh one beyond ``tol``. Near-ties may swap
    order or trade the k-th place, so: an id in both lists must have the same log-prob, and an id
    in only one list must lie within tol of the other list's k-th log-prob."""
    same = stored_ids[:, :, None] == fresh_ids[:, None, :]  # [T, k, k]
    allowed = lambda lp: tol * (1 + np.abs(lp))  # noqa: E731
    in_fresh, in_stored = same.any(2), same.any(1)
    fresh_at_stored = np.where(same, fresh_lp[:, None, :], 0).sum(2)
    bad = in_fresh & (np.abs(stored_lp - fresh_at_stored) > allowed(stored_lp))
    bad |= ~in_fresh & (stored_lp > fresh_lp[:, -1:] + allowed(fresh_lp[:, -1:]))
    bad_fresh = ~in_stored & (fresh_lp > stored_lp[:, -1:] + allowed(stored_lp[:, -1:]))
    return int((bad.any(1) | bad_fresh.any(1)).sum())


def deep_verify(cache: Cache, sample: int = 64, teacher: str | None = None, device: str = "auto",
                progress: Progress | None = None, skip: set[str] | frozenset[str] = frozenset()) -> DeepReport:
    """Re-run the teacher (the manifest's, or ``teacher``) on ``sample`` cached sequences and
    compare hidden states and top-k with what is stored. Checksums prove the bytes are the ones
    written; this proves they are the teacher's outputs for these tokens."""
    from dflash_common.errors import CacheError
    from dflash_teacher.teacher import TeacherConfig, identity_like, load_teacher, plan_batches

    progress = progress or Progress()
    built = (cache.manifest.get("build") or {}).get("teacher") or {}
    name = teacher or built.get("name_or_path") or cache.manifest["teacher"]["name"]
    cfg = TeacherConfig(name_or_path=name, revision=None if teacher else built.get("revision"),
                        dtype=cache.hidden_dtype, device=device, layers=tuple(cache.layer_ids), top_k=cache.top_k,
                        batch_tokens=int(built.get("batch_tokens", 8192)), logits_chunk=int(built.get("logits_chunk", 2048)))
    model = load_teacher(cfg)
    identity = identity_like(model, cache.manifest["teacher"])  # hashed as the cache's was
    for key in ("config_hash", "weights_hash"):
        expected = cache.manifest["teacher"].get(key)
        if expected and identity[key] != expected:
            raise CacheError(f"the teacher {name!r} is not the one {cache.url} was built with ({key} {identity[key]}, cache {expected}); pass --teacher with the original model")
    tol = dict(DEEP_TOLERANCE[cache.hidden_dtype])
    if cache.hidden_format == fp8.FORMAT:
        tol["hidden"] = FP8_HIDDEN_TOLERANCE[cache.hidden_dtype]
    sizes = [0 if s.name in skip else len(s) for s in cache.shards]
    refs = deep_sample(sizes, sample)
    report = DeepReport(teacher=name)
    records = [cache.shards[s][i] for s, i in refs]
    lengths = np.array([len(r) for r in records], dtype=np.int64)
    progress.start(len(records), "re-running the teacher", "seq")
    for batch in plan_batches(lengths, cfg.batch_tokens) if len(records) else []:
        out = model.forward([records[j].input_ids for j in batch])
        pos = 0
        for j in batch:
            rec, n = records[j], int(lengths[j])
            fresh = fmt.from_storage(out.hidden[pos:pos + n], cache.hidden_dtype)
            problems = []
            errors = hidden_error(rec.hidden, fresh)
            for layer, err in zip(cache.layer_ids, errors):
                if not err <= tol["hidden"]:
                    problems.append(f"hidden states of layer {layer} differ by {err:.3g} (tolerance {tol['hidden']:.3g})")
            wrong = topk_mismatches(rec.topk_ids, rec.topk_logprobs, out.topk_ids[pos:pos + n],
                                    out.topk_logprobs[pos:pos + n], tol["logprobs"])
            if wrong:
                problems.append(f"top-k differs at {wrong} of {n} positions")
            if problems:
                report.mismatches[f"{rec.id} ({cache.shards[refs[j][0]].name})"] = "; ".join(problems)
            report.checked += 1
            pos += n
        progress.advance(len(batch))
    progress.close()
    return report
