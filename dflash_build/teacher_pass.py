"""The teacher's pass over a cut shard: its forwards in length-bucketed batches, the outputs packed
back to back in sequence order, non-finite sequences dropped, and the cross-check run; ``BuildStats``
counts what the teacher computed."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from dflash_build.commit import ManifestKeeper
from dflash_build.cross_check import CrossCheck
from dflash_build.shard_cut import PendingShard
from dflash_cache import format as fmt
from dflash_cache.writer import ShardData
from dflash_common.progress import Progress
from dflash_teacher.teacher import Teacher


@dataclass
class BuildStats:
    """What this run of a build computed (the cache's totals come from its commit records)."""

    started: float = field(default_factory=time.perf_counter)
    tokens: int = 0
    """Sequence tokens the teacher ran on."""
    padded: int = 0
    """Tokens it computed, padding included (`tokens` for an engine that does not pad)."""
    seconds: Counter = field(default_factory=Counter)
    """Seconds of the writer's parts (writer.write_shard: health, hidden, tables, commit)."""

    def add_batch(self, lengths: np.ndarray, padded: bool) -> None:
        self.tokens += int(lengths.sum())
        self.padded += int(lengths.max()) * len(lengths) if padded else int(lengths.sum())

    def tokens_per_s(self) -> float:
        return self.tokens / max(time.perf_counter() - self.started, 1e-9)

    def last_run(self) -> dict:
        """The manifest's `last_run`."""
        return {
            "seconds": round(time.perf_counter() - self.started, 3),
            "tokens": self.tokens,
            "padding_fraction": round(1 - self.tokens / self.padded, 4) if self.padded else 0.0,
            **({"seconds_by_part": {k: round(v, 3) for k, v in sorted(self.seconds.items())}} if self.seconds else {}),
        }


def _teacher_outputs(teacher: Teacher, sequences: list, lengths: np.ndarray, on_batch):
    """Submit the teacher's forwards of one shard; the function returned waits for them and gives
    the hidden states, top-k ids and log-probs of every token (packed back to back in sequence
    order) and whether each sequence's outputs are finite; ``on_batch(lengths)`` after each batch."""
    batches = teacher.batches(lengths) if len(sequences) else []
    results = [teacher.submit([sequences[i].input_ids for i in batch]) for batch in batches]

    def collect():
        offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        n_tokens, n_layers, k = int(offsets[-1]), len(teacher.layer_ids), teacher.cfg.top_k
        hidden = np.empty((n_tokens, n_layers, teacher.hidden_size), dtype=fmt.HIDDEN_STORAGE[teacher.cfg.dtype])
        topk_ids = np.empty((n_tokens, k), dtype=np.int32)
        topk_logprobs = np.empty((n_tokens, k), dtype=np.float32)
        finite = np.ones(len(sequences), dtype=bool)
        for batch, result in zip(batches, results):
            out = result()
            pos = 0
            for i in batch:
                lo, hi, n = offsets[i], offsets[i + 1], lengths[i]
                hidden[lo:hi] = out.hidden[pos:pos + n]
                topk_ids[lo:hi] = out.topk_ids[pos:pos + n]
                topk_logprobs[lo:hi] = out.topk_logprobs[pos:pos + n]
                pos += n
            finite[batch] = out.finite
            on_batch(lengths[batch])
        return hidden, topk_ids, topk_logprobs, finite

    return collect


class TeacherPass:
    """Runs the teacher over a generate group of cut shards (bucketed batches) and packs the results
    per shard; counts what it computed in ``stats`` and shows each batch on ``progress``.
    ``start(group)`` submits the group's forwards and returns the function that waits for them and makes the
    ShardData (shard_queue.ShardQueue keeps ``in_flight`` generate groups started at once)."""

    def __init__(self, teacher: Teacher, stats: BuildStats, progress: Progress, keeper: ManifestKeeper,
                 cross_check: CrossCheck | None = None):
        self.teacher, self.stats, self.progress, self.keeper = teacher, stats, progress, keeper
        self.cross_check = cross_check
        self.in_flight = teacher.shards_in_flight

    def _batch_done(self, lengths: np.ndarray) -> None:
        self.stats.add_batch(lengths, self.teacher.pads_batches)
        self.progress.advance(len(lengths), **{"tok/s": f"{self.stats.tokens_per_s():,.0f}",
                                               "written": f"{self.keeper.bytes / 1e6:,.1f}MB"})

    def start(self, group: list[PendingShard]):
        """Submit the forwards of a generate group's shards (one plan over all their sequences);
        returns the function that waits for them and makes the ShardData of each shard that is not
        context (those committed before a resume are computed again, then dropped)."""
        sequences = [s for pending in group for s in pending.sequences]
        lengths = np.array([len(s.input_ids) for s in sequences], dtype=np.int32)
        outputs = _teacher_outputs(self.teacher, sequences, lengths, self._batch_done)

        def finish() -> list[ShardData]:
            hidden, topk_ids, topk_logprobs, finite = outputs()
            shards, seq, tok = [], 0, 0
            for pending in group:
                s_end = seq + len(pending.sequences)
                t_end = tok + int(lengths[seq:s_end].sum())
                if not pending.context:
                    shards.append(self._finish(pending, lengths[seq:s_end], hidden[tok:t_end], topk_ids[tok:t_end],
                                               topk_logprobs[tok:t_end], finite[seq:s_end]))
                seq, tok = s_end, t_end
            return shards

        return finish

    def _finish(self, pending: PendingShard, lengths: np.ndarray, hidden, topk_ids, topk_logprobs, finite) -> ShardData:
        sequences = pending.sequences
        shard = ShardData(
            rank=pending.rank, index=pending.index, row_start=pending.row_start, row_end=pending.row_end,
            ids=[s.id for s in sequences], rows=np.array(pending.rows, dtype=np.int64), lengths=lengths,
            truncated=np.array([s.truncated for s in sequences], dtype=bool),
            input_ids=np.concatenate([s.input_ids for s in sequences]) if sequences else np.zeros(0, np.int32),
            loss_mask=np.concatenate([s.loss_mask for s in sequences]) if sequences else np.zeros(0, np.uint8),
            hidden=hidden, topk_ids=topk_ids, topk_logprobs=topk_logprobs, skipped=dict(pending.skipped),
        )
        if not finite.all():
            shard = shard.drop(finite)
            shard.skipped["nonfinite"] = shard.skipped.get("nonfinite", 0) + int((~finite).sum())
            self.progress.message(f"teacher outputs were NaN/Inf for {int((~finite).sum())} sequence(s) in shard {shard.name}; not written (ids: {[s.id for s, f in zip(sequences, finite) if not f][:5]})")
        if self.cross_check is not None:
            self.cross_check.check_shard(pending.index, shard)
        return shard
