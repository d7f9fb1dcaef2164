"""Writes one finished shard (``write_shard`` of a ``ShardData``) whole and commits it atomically,
and writes the teacher's frozen pieces once. The build (``dflash_build``) cuts the shards,
runs the teacher on them and hands each finished one here, on its writer thread.

A shard is written under a temporary name and renamed into place (local file systems), and only
counts once its commit record ``shards/<name>.json`` exists: that record is written last, in one
atomic write, so a reader or a resumed build never sees a half-written shard, on stores with or
without rename.
"""

from __future__ import annotations

import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import safetensors.torch

from dflash_cache import format as fmt
from dflash_cache import health
from dflash_cache.format import hidden
from dflash_cache.format import token_tables as tokens
from dflash_cache.format.record import commit_record
from dflash_cache.format.store import CacheStore
from dflash_cache.settings.storage_config import StorageConfig
from dflash_common.faults import maybe_fault
from dflash_common.files import fsync_tree


@dataclass
class ShardData:
    """One shard's sequences, packed back to back, ready to write. Sequences are in corpus order."""

    rank: int
    index: int
    row_start: int
    row_end: int
    ids: list[str]
    rows: np.ndarray  # int64 [S] corpus row index of each sequence
    lengths: np.ndarray  # int32 [S]
    truncated: np.ndarray  # bool [S]
    input_ids: np.ndarray  # int32 [N]
    loss_mask: np.ndarray  # uint8 [N]
    hidden: np.ndarray  # [N, L, H] the build dtype's bits (uint16 for bf16); write_shard encodes them
    topk_ids: np.ndarray  # int32 [N, k]
    topk_logprobs: np.ndarray  # float32 [N, k]
    skipped: dict[str, int] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return fmt.shard_name(self.rank, self.index)

    def drop(self, keep: np.ndarray) -> "ShardData":
        """A copy holding only the sequences where ``keep`` is true."""
        token_keep = np.repeat(keep, self.lengths)
        return ShardData(
            rank=self.rank, index=self.index, row_start=self.row_start, row_end=self.row_end,
            ids=[i for i, k in zip(self.ids, keep) if k], rows=self.rows[keep],
            lengths=self.lengths[keep], truncated=self.truncated[keep],
            input_ids=self.input_ids[token_keep], loss_mask=self.loss_mask[token_keep],
            hidden=self.hidden[token_keep], topk_ids=self.topk_ids[token_keep],
            topk_logprobs=self.topk_logprobs[token_keep], skipped=dict(self.skipped),
        )


def sequences_table(shard: ShardData) -> pa.Table:
    """The shard's sequences.arrow table (dflash_cache.format.token_tables encodes it)."""
    return tokens.encode_sequences(shard.ids, shard.lengths, shard.rows, shard.truncated)


def _hidden_shape(shard: ShardData) -> tuple[int, int, int]:
    return shard.hidden.shape if shard.hidden.ndim == 3 else (0, 0, 0)


def _move_into_place(store: CacheStore, work_dir: str, final_dir: str) -> None:
    """Make the shard's files final: durable and renamed (local), or visible to the store's file
    system (object stores)."""
    if store.local:
        # Page-cache data is lost on a power cut: the commit record must never outlive the data it
        # commits, so make the data durable before the rename and the record.
        fsync_tree(work_dir)
        if store.exists(final_dir):  # left by a crash between rename and record: never committed
            store.rm(final_dir, recursive=True)
        store.mv(work_dir, final_dir, recursive=True)
    else:
        store.forget(final_dir)  # the Zarr objects went through the async twin, unseen by the store's fs


def work_folder(root: str, rank: int) -> str:
    """Where a format-2 rank writes shards before renaming them into place (local storage): one
    folder per rank, so a resume deletes its leftovers without listing the shards."""
    return fmt.layout_for(2).work_folder(root, rank)


def capture_health(shard: ShardData, hidden_dtype: str, layer_ids: list[int] | None) -> dict:
    """Per tapped layer: RMS, share of exact zeros, non-finite count of what the shard writes;
    refuses a layer all zeros or constant over the shard (health.CaptureError)."""
    stats = health.layer_stats(fmt.from_storage(shard.hidden, hidden_dtype))
    layers = list(layer_ids) if layer_ids is not None else list(range(shard.hidden.shape[1]))
    health.check_capture(stats, layers, shard.name, int(shard.hidden.shape[0]))
    return health.stored_health(stats)


class _Clock:
    """Adds the seconds since its last lap to ``seconds[part]`` (nothing when ``seconds`` is None)."""

    def __init__(self, seconds: Counter | None):
        self.seconds, self.last = seconds, time.perf_counter()

    def lap(self, part: str) -> None:
        if self.seconds is not None:
            now = time.perf_counter()
            self.seconds[part] += now - self.last
            self.last = now


def write_shard(store: CacheStore, shard: ShardData, storage: StorageConfig, hidden_dtype: str,
                version: int = fmt.FORMAT_VERSION, layer_ids: list[int] | None = None,
                seconds: Counter | None = None) -> dict:
    """Write one shard whole and commit it (the layout of format ``version``); returns its commit
    record. The capture's health is checked first: a broken one commits nothing. ``seconds`` (when
    given) adds the time of each part: health, hidden (encode, compress, write), tables, commit."""
    name, layout = shard.name, fmt.layout_for(version)
    clock = _Clock(seconds)
    capture = capture_health(shard, hidden_dtype, layer_ids) if shard.hidden.ndim == 3 else None
    clock.lap("health")
    final_dir = layout.shard_path(store.root, name)
    work_dir = layout.work_dir(store.root, name, shard.rank) if store.local else final_dir
    store.makedirs(work_dir)

    stored, attributes, exponents = hidden.encode_hidden(shard.hidden, hidden_dtype, storage.hidden_format)
    hidden_checksum, chunk_tokens = layout.write_hidden(store, fmt.join(work_dir, fmt.HIDDEN), stored, attributes, storage,
                                                        len(layer_ids or ()))
    clock.lap("hidden")
    tokens_bytes = tokens.ipc_bytes(tokens.encode_tokens(shard.input_ids, shard.loss_mask, shard.topk_ids,
                                                         shard.topk_logprobs, exponents))
    sequences_bytes = tokens.ipc_bytes(sequences_table(shard))
    store.write_file(fmt.join(work_dir, fmt.TOKENS), tokens_bytes)
    store.write_file(fmt.join(work_dir, fmt.SEQUENCES), sequences_bytes)
    clock.lap("tables")
    _move_into_place(store, work_dir, final_dir)

    checksums = {"hidden": hidden_checksum, fmt.TOKENS: fmt.checksum(tokens_bytes), fmt.SEQUENCES: fmt.checksum(sequences_bytes)}
    record = commit_record(store, final_dir, name, shard.rank, shard.index, (shard.row_start, shard.row_end), len(shard.ids),
                           int(shard.loss_mask.sum()), _hidden_shape(shard), chunk_tokens, checksums, shard.skipped, capture)
    maybe_fault("after_shard_files")
    store.write_json_atomic(f"{final_dir}.json", record)
    maybe_fault("after_commit_record")
    clock.lap("commit")
    return record


def write_teacher_files(store: CacheStore, model, tokenizer) -> dict:
    """Save what stage 2 needs of the teacher, once: embeddings, LM head, config, tokenizer.
    Returns the head's record for the manifest (fmt.teacher_head_record)."""
    teacher_dir = store.path(fmt.TEACHER_DIR)
    head = {
        # clones: safetensors refuses tensors that share memory (teachers with tied embeddings)
        "embed_tokens.weight": model.get_input_embeddings().weight.detach().cpu().clone(),
        "lm_head.weight": model.get_output_embeddings().weight.detach().cpu().clone(),
    }
    store.makedirs(teacher_dir)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        model.config.to_json_file(str(Path(tmp) / "config.json"))
        for path in sorted(Path(tmp).iterdir()):
            if path.is_file():
                store.write_file(fmt.join(teacher_dir, path.name), path.read_bytes())
    # The head is written last: its presence marks the teacher folder complete.
    data = safetensors.torch.save(head)
    store.write_bytes_atomic(fmt.join(teacher_dir, fmt.TEACHER_HEAD), data)
    return fmt.teacher_head_record(data)
