"""The token tables of a shard, encoded and decoded side by side: ``tokens.arrow`` (one row per
token: input id, loss mask, the teacher's top-k ids and log-probs, and for fp8 caches the hidden
states' scale exponents) and ``sequences.arrow`` (one row per sequence: id, offset and length in
the token table, corpus row, truncated), as Arrow IPC files."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from dflash_cache.format.cache_layout import TOKENS
from dflash_common.errors import CacheError

SCALE_COLUMN = "hidden_scale_exp"
"""fp8 caches: the column of tokens.arrow holding each token's per-layer scale exponents."""


def sequences_schema() -> pa.Schema:
    """One row per sequence; its tokens are rows offset..offset+length of the token table."""
    return pa.schema(
        [
            ("id", pa.string()),
            ("offset", pa.int64()),
            ("length", pa.int32()),
            ("row", pa.int64()),
            ("truncated", pa.bool_()),
        ]
    )


def tokens_schema(top_k: int, scale_layers: int = 0) -> pa.Schema:
    """One row per token, sequences packed back to back in shard order. fp8 caches add the
    per-layer scale exponents of the token's hidden states (``scale_layers`` = number of layers)."""
    fields = [
        ("input_ids", pa.int32()),
        ("loss_mask", pa.uint8()),
        ("topk_ids", pa.list_(pa.int32(), top_k)),
        ("topk_logprobs", pa.list_(pa.float32(), top_k)),
    ]
    if scale_layers:
        fields.append((SCALE_COLUMN, pa.list_(pa.int8(), scale_layers)))
    return pa.schema(fields)


def token_bytes_per_token(top_k: int) -> int:
    """Arrow payload per token: input id, mask, k ids and k log-probs."""
    return 4 + 1 + top_k * (4 + 4)


def ipc_bytes(table: pa.Table) -> bytes:
    """An Arrow table as the bytes of an IPC file (every Arrow file of a cache is one)."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def _fixed_list(values: np.ndarray, dtype: pa.DataType) -> pa.Array:
    k = values.shape[1]
    flat = pa.array(np.ascontiguousarray(values).reshape(-1), type=dtype)
    return pa.FixedSizeListArray.from_arrays(flat, k)


def encode_sequences(ids: list[str], lengths: np.ndarray, rows: np.ndarray, truncated: np.ndarray) -> pa.Table:
    """The sequences.arrow table of a shard whose sequences are packed back to back in this order."""
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)[:-1]]) if len(ids) else np.zeros(0, np.int64)
    return pa.table([pa.array(ids, pa.string()), pa.array(offsets, pa.int64()), pa.array(lengths, pa.int32()),
                     pa.array(rows, pa.int64()), pa.array(truncated, pa.bool_())], schema=sequences_schema())


def encode_tokens(input_ids: np.ndarray, loss_mask: np.ndarray, topk_ids: np.ndarray, topk_logprobs: np.ndarray,
                  scale_exponents: np.ndarray | None = None) -> pa.Table:
    """The tokens.arrow table: one row per token; ``scale_exponents`` [N, L] for fp8 hidden states."""
    columns = [pa.array(input_ids, pa.int32()), pa.array(loss_mask, pa.uint8()), _fixed_list(topk_ids, pa.int32()),
               _fixed_list(topk_logprobs, pa.float32())]
    if scale_exponents is not None:
        columns.append(_fixed_list(scale_exponents, pa.int8()))
    scale_layers = scale_exponents.shape[1] if scale_exponents is not None else 0
    return pa.table(columns, schema=tokens_schema(topk_ids.shape[1], scale_layers))


def list_width_problem(table: pa.Table, column: str, width: int, field: str) -> str | None:
    """Why ``column`` of a token table is not a fixed-size list of ``width`` values per token (the
    manifest's ``field``), or None."""
    kind = table.schema.field(column).type if column in table.column_names else None
    if kind is None:
        return f"{TOKENS} lacks the column {column!r}"
    if not pa.types.is_fixed_size_list(kind) or kind.list_size != width:
        return f"{TOKENS} column {column} is {kind}, not {width} values per token (the manifest's {field} = {width:,})"
    return None


def fixed_list_values(table: pa.Table, column: str, k: int, field: str, where: str) -> np.ndarray:
    problem = list_width_problem(table, column, k, field)
    if problem:
        raise CacheError(f"{where}: {problem}; the manifest or the shard is damaged or edited: run `dflash-cache verify`, "
                         "then rebuild the cache (or restore manifest.json)")
    return table.column(column).combine_chunks().values.to_numpy(zero_copy_only=True).reshape(-1, k)


def decode_tokens(table: pa.Table, top_k: int, scale_layers: int, where: str) -> dict[str, np.ndarray]:
    """A tokens.arrow table as numpy columns (zero-copy views of a memory-mapped file): input_ids,
    loss_mask, topk_ids [N, k], topk_logprobs [N, k], and for fp8 (``scale_layers`` > 0) the scale
    exponents [N, L]; a column of another width is a CacheError naming ``where``."""
    tokens = {
        "input_ids": table.column("input_ids").combine_chunks().to_numpy(zero_copy_only=True),
        "loss_mask": table.column("loss_mask").combine_chunks().to_numpy(zero_copy_only=True),
        "topk_ids": fixed_list_values(table, "topk_ids", top_k, "top_k", where),
        "topk_logprobs": fixed_list_values(table, "topk_logprobs", top_k, "top_k", where),
    }
    if scale_layers:
        tokens[SCALE_COLUMN] = fixed_list_values(table, SCALE_COLUMN, scale_layers, "layer_ids", where)
    return tokens
