"""Writes one finished shard (``write_shard`` of a ``ShardData``) whole and commits it atomically,
and writes the teacher's frozen pieces once. The build (``dflash_cache.build``) cuts the shards,
runs the teacher on them and hands each finished one here, on its writer thread.

A shard is written under a temporary name and renamed into place (local file systems), and only
counts once its commit record ``shards/<name>.json`` exists: that record is written last, in one
atomic write, so a reader or a resumed build never sees a half-written shard, on stores with or
without rename.
"""

from __future__ import annotations

import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import safetensors.torch
import zarr
import zarr.codecs

from dflash_cache import format as fmt
from dflash_cache import fp8, health, hidden_files
from dflash_cache.index import ipc_bytes
from dflash_cache.settings.storage_config import StorageConfig
from dflash_cache.store import zarr_store
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


def _fixed_list(values: np.ndarray, dtype: pa.DataType) -> pa.Array:
    k = values.shape[1]
    flat = pa.array(np.ascontiguousarray(values).reshape(-1), type=dtype)
    return pa.FixedSizeListArray.from_arrays(flat, k)


def _encode_hidden(shard: ShardData, storage: StorageConfig, hidden_dtype: str) -> tuple[np.ndarray, dict, list]:
    """The hidden states as stored (fp8 with per-token exponents, or the build dtype's bits), the
    Zarr array's attributes, and the extra tokens.arrow columns the format adds."""
    hidden, attributes, extra_columns = shard.hidden, {"dtype": hidden_dtype}, []
    if storage.hidden_format == fp8.FORMAT:
        n_tokens, n_layers, hidden_size = _hidden_shape(shard)
        hidden, exponents = fp8.quantize(fmt.from_storage(shard.hidden, hidden_dtype).reshape(n_tokens, n_layers, hidden_size))
        attributes["format"] = fp8.FORMAT
        extra_columns.append(_fixed_list(exponents.reshape(n_tokens, n_layers), pa.int8()))
    return hidden, attributes, extra_columns


def _hidden_shape(shard: ShardData) -> tuple[int, int, int]:
    return shard.hidden.shape if shard.hidden.ndim == 3 else (0, 0, 0)


def _write_hidden(fs, path: str, hidden: np.ndarray, attributes: dict, storage: StorageConfig) -> tuple[str, int]:
    """Write the hidden states as one Zarr array; returns their checksum and the chunk length."""
    n_tokens, n_layers, hidden_size = hidden.shape if hidden.ndim == 3 else (0, 0, 0)
    per_token = max(1, n_layers * hidden_size * hidden.dtype.itemsize)
    chunk_tokens = max(1, min(max(n_tokens, 1), storage.chunk_bytes // per_token))
    compressors = [zarr.codecs.ZstdCodec(level=1)] if storage.compression == "zstd" else None
    # xxh64 releases the GIL: hash the hidden states while Zarr writes them
    with ThreadPoolExecutor(1) as hashing:
        checksum = hashing.submit(fmt.checksum, hidden)
        zarr.create_array(
            zarr_store(fs, path, read_only=False),
            data=hidden,
            chunks=(chunk_tokens, n_layers, hidden_size),
            compressors=compressors,
            attributes=attributes,
            config={"write_empty_chunks": True},
            overwrite=True,
        )
    return checksum.result(), chunk_tokens


def sequences_table(shard: ShardData) -> pa.Table:
    """The shard's sequences.arrow table."""
    offsets = np.concatenate([[0], np.cumsum(shard.lengths, dtype=np.int64)[:-1]]) if len(shard.ids) else np.zeros(0, np.int64)
    return pa.table(
        [
            pa.array(shard.ids, pa.string()),
            pa.array(offsets, pa.int64()),
            pa.array(shard.lengths, pa.int32()),
            pa.array(shard.rows, pa.int64()),
            pa.array(shard.truncated, pa.bool_()),
        ],
        schema=fmt.sequences_schema(),
    )


def _arrow_files(shard: ShardData, extra_columns: list, n_layers: int) -> tuple[bytes, bytes]:
    """tokens.arrow and sequences.arrow of a shard, as file bytes."""
    tokens_table = pa.table(
        [
            pa.array(shard.input_ids, pa.int32()),
            pa.array(shard.loss_mask, pa.uint8()),
            _fixed_list(shard.topk_ids, pa.int32()),
            _fixed_list(shard.topk_logprobs, pa.float32()),
            *extra_columns,
        ],
        schema=fmt.tokens_schema(shard.topk_ids.shape[1], n_layers if extra_columns else 0),
    )
    return ipc_bytes(tokens_table), ipc_bytes(sequences_table(shard))


def _move_into_place(fs, work_dir: str, final_dir: str) -> None:
    """Make the shard's files final: durable and renamed (local), or visible to ``fs`` (stores)."""
    if fmt.is_local(fs):
        # Page-cache data is lost on a power cut: the commit record must never outlive the data it
        # commits, so make the data durable before the rename and the record.
        fsync_tree(work_dir)
        if fs.exists(final_dir):  # left by a crash between rename and record: never committed
            fs.rm(final_dir, recursive=True)
        fs.mv(work_dir, final_dir, recursive=True)
    else:
        fs.invalidate_cache(final_dir)  # the Zarr objects went through the async twin, unseen by fs


def _commit_record(fs, final_dir: str, shard: ShardData, chunk_tokens: int, checksums: dict,
                   capture: dict | None = None) -> dict:
    n_tokens, n_layers, hidden_size = _hidden_shape(shard)
    files = {
        path[len(final_dir) + 1:]: int(info["size"])
        for path, info in fs.find(final_dir, detail=True).items()
    }
    return {
        "name": shard.name,
        "rank": shard.rank,
        "index": shard.index,
        "rows": [shard.row_start, shard.row_end],
        "sequences": len(shard.ids),
        "tokens": int(n_tokens),
        "loss_tokens": int(shard.loss_mask.sum()),
        "bytes": sum(files.values()),
        "hidden_shape": [int(n_tokens), int(n_layers), int(hidden_size)],
        "chunk_tokens": int(chunk_tokens),
        "checksums": checksums,
        "files": dict(sorted(files.items())),
        "skipped": dict(shard.skipped),
        **({"health": capture} if capture is not None else {}),
    }


def work_folder(root: str, rank: int) -> str:
    """Where a format-2 rank writes shards before renaming them into place (local storage): one
    folder per rank, so a resume deletes its leftovers without listing the shards."""
    return fmt.join(root, fmt.SHARDS_DIR, fmt.rank_folder(rank), ".tmp")


def capture_health(shard: ShardData, hidden_dtype: str, layer_ids: list[int] | None) -> dict:
    """Per tapped layer: RMS, share of exact zeros, non-finite count of what the shard writes;
    refuses a layer all zeros or constant over the shard (health.CaptureError)."""
    stats = health.layer_stats(fmt.from_storage(shard.hidden, hidden_dtype))
    layers = list(layer_ids) if layer_ids is not None else list(range(shard.hidden.shape[1]))
    health.check_capture(stats, layers, shard.name, int(shard.hidden.shape[0]))
    return health.stored_health(stats)


def write_shard(fs, root: str, shard: ShardData, storage: StorageConfig, hidden_dtype: str,
                version: int = fmt.FORMAT_VERSION, layer_ids: list[int] | None = None) -> dict:
    """Write one shard whole and commit it (the layout of format ``version``); returns its commit
    record. The capture's health is checked first: a broken one commits nothing."""
    name = shard.name
    capture = capture_health(shard, hidden_dtype, layer_ids) if shard.hidden.ndim == 3 else None
    final_dir = fmt.shard_path(root, name, version)
    shards_dir = final_dir.rsplit("/", 1)[0]
    if not fmt.is_local(fs):
        work_dir = final_dir
    elif version == 1:
        work_dir = fmt.join(shards_dir, f".tmp-{name}-{uuid.uuid4().hex[:8]}")
    else:
        work_dir = fmt.join(work_folder(root, shard.rank), f"{name}-{uuid.uuid4().hex[:8]}")
    fs.makedirs(work_dir, exist_ok=True)

    hidden, attributes, extra_columns = _encode_hidden(shard, storage, hidden_dtype)
    if version == 1:
        hidden_checksum, chunk_tokens = _write_hidden(fs, fmt.join(work_dir, fmt.HIDDEN), hidden, attributes, storage)
    else:
        if hidden.ndim != 3:
            hidden = hidden.reshape(0, len(layer_ids or ()), 0)
        hidden_checksum, chunk_tokens = hidden_files.write_hidden(
            zarr_store(fs, fmt.join(work_dir, fmt.HIDDEN), read_only=False), hidden, attributes, storage.chunk_bytes,
            storage.compression)
    tokens_bytes, sequences_bytes = _arrow_files(shard, extra_columns, _hidden_shape(shard)[1])
    fs.pipe_file(fmt.join(work_dir, fmt.TOKENS), tokens_bytes)
    fs.pipe_file(fmt.join(work_dir, fmt.SEQUENCES), sequences_bytes)
    _move_into_place(fs, work_dir, final_dir)

    checksums = {"hidden": hidden_checksum, fmt.TOKENS: fmt.checksum(tokens_bytes), fmt.SEQUENCES: fmt.checksum(sequences_bytes)}
    record = _commit_record(fs, final_dir, shard, chunk_tokens, checksums, capture)
    maybe_fault("after_shard_files")
    fmt.write_json_atomic(fs, f"{final_dir}.json", record)
    maybe_fault("after_commit_record")
    return record


def write_teacher_files(fs, root: str, model, tokenizer) -> dict:
    """Save what stage 2 needs of the teacher, once: embeddings, LM head, config, tokenizer.
    Returns the head's record for the manifest (fmt.teacher_head_record)."""
    teacher_dir = fmt.join(root, fmt.TEACHER_DIR)
    head = {
        # clones: safetensors refuses tensors that share memory (teachers with tied embeddings)
        "embed_tokens.weight": model.get_input_embeddings().weight.detach().cpu().clone(),
        "lm_head.weight": model.get_output_embeddings().weight.detach().cpu().clone(),
    }
    fs.makedirs(teacher_dir, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        model.config.to_json_file(str(Path(tmp) / "config.json"))
        for path in sorted(Path(tmp).iterdir()):
            if path.is_file():
                fs.pipe_file(fmt.join(teacher_dir, path.name), path.read_bytes())
    # The head is written last: its presence marks the teacher folder complete.
    data = safetensors.torch.save(head)
    fmt.write_bytes_atomic(fs, fmt.join(teacher_dir, fmt.TEACHER_HEAD), data)
    return fmt.teacher_head_record(data)
