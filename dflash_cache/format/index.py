"""The index of a format-2 cache: a columnar shard table and a sequence table (Arrow IPC files),
encoded and decoded here, side by side.

- ``shards.arrow``: one row per committed shard, in order (rank, then index): its name, rank,
  index, corpus rows, counts, bytes, per-file sizes, checksums, hidden shape, inner-chunk length,
  skipped rows and capture health per tapped layer. Under a kilobyte a shard at any chunk size.
- ``sequences.arrow``: one row per sequence, grouped by shard in the shard table's order: id, the
  shard's position in the shard table, offset and length in the shard, corpus row. A reader
  plans from these lengths without opening a shard.

Each rank writes its own part (``index/rRRRRR/``), checkpointed while it builds (the per-shard
commit records after the checkpoint are the truth on resume); the finalize step merges one part
per rank into ``index/shards.arrow`` and ``index/sequences.arrow``. manifest.json points at the
index (``index`` entry: path and row count of each table, plus size and xxh64 once complete).
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dflash_cache.format import cache_layout as layout
from dflash_cache.format.store import CacheStore
from dflash_cache.format.token_tables import ipc_bytes
from dflash_common.errors import CacheError, quoted

SHARDS = "shards"
SEQUENCES = "sequences"


def shard_schema() -> pa.Schema:
    return pa.schema([
        ("name", pa.string()), ("rank", pa.int32()), ("index", pa.int32()),
        ("row_start", pa.int64()), ("row_end", pa.int64()),
        ("sequences", pa.int64()), ("tokens", pa.int64()), ("loss_tokens", pa.int64()), ("bytes", pa.int64()),
        ("file_bytes", pa.list_(pa.int64(), len(layout.V2_FILES))),
        ("hidden_shape", pa.list_(pa.int64(), 3)), ("chunk_tokens", pa.int64()),
        ("checksum_hidden", pa.string()), ("checksum_tokens", pa.string()), ("checksum_sequences", pa.string()),
        ("skipped", pa.string()),
        ("rms", pa.list_(pa.float64())), ("zero_fraction", pa.list_(pa.float64())), ("nonfinite", pa.list_(pa.int64())),
    ])


def sequence_schema() -> pa.Schema:
    return pa.schema([("id", pa.string()), ("shard", pa.int32()), ("offset", pa.int64()), ("length", pa.int32()),
                      ("row", pa.int64())])


def shard_table(records: list[dict]) -> pa.Table:
    """The shard table of these commit records (format 2), in their order."""
    def files(r):
        return [int(r.get("files", {}).get(name, -1)) for name in layout.V2_FILES]

    health = [r.get("health") or {} for r in records]
    columns = {
        "name": [r["name"] for r in records], "rank": [r["rank"] for r in records], "index": [r["index"] for r in records],
        "row_start": [r["rows"][0] for r in records], "row_end": [r["rows"][1] for r in records],
        "sequences": [r["sequences"] for r in records], "tokens": [r["tokens"] for r in records],
        "loss_tokens": [r["loss_tokens"] for r in records], "bytes": [r["bytes"] for r in records],
        "file_bytes": [files(r) for r in records], "hidden_shape": [r["hidden_shape"] for r in records],
        "chunk_tokens": [r["chunk_tokens"] for r in records],
        "checksum_hidden": [r["checksums"]["hidden"] for r in records],
        "checksum_tokens": [r["checksums"][layout.TOKENS] for r in records],
        "checksum_sequences": [r["checksums"][layout.SEQUENCES] for r in records],
        "skipped": [json.dumps(r.get("skipped") or {}, sort_keys=True) for r in records],
        "rms": [h.get("rms", []) for h in health], "zero_fraction": [h.get("zero_fraction", []) for h in health],
        "nonfinite": [h.get("nonfinite", []) for h in health],
    }
    return pa.table(columns, schema=shard_schema())


def sequence_rows(sequences: pa.Table, shard: int) -> pa.Table:
    """A shard's sequences.arrow as rows of the sequence table, the shard at position ``shard``."""
    n = sequences.num_rows
    return pa.table({"id": sequences.column("id"), "shard": pa.array(np.full(n, shard, np.int32)),
                     "offset": sequences.column("offset"), "length": sequences.column("length"),
                     "row": sequences.column("row")}, schema=sequence_schema())


def skipped_counts(text: str, shard: str) -> dict[str, int]:
    """A shard's ``skipped`` column (JSON: corpus rows skipped, by reason) as counts; anything else
    is a CacheError naming the shard."""
    try:
        counts = json.loads(text)
        if isinstance(counts, dict) and all(isinstance(k, str) and type(n) is int and n >= 0 for k, n in counts.items()):
            return counts
    except ValueError:
        pass
    raise CacheError(f"the index's skipped counts of shard {shard} are {quoted(text, 60)}, not counts by reason; the "
                     "cache is damaged or edited: run `dflash-cache verify`, then rebuild it (or restore index/ and "
                     "manifest.json)")


class ShardTable:
    """The shard table, read: columns converted to Python or numpy once, on first use; ``record(i)``
    is row i as a commit record (the dict a format-1 manifest lists)."""

    def __init__(self, table: pa.Table):
        self.table = table
        self._lists: dict[str, list] = {}

    def __len__(self) -> int:
        return self.table.num_rows

    def column(self, name: str) -> list:
        if name not in self._lists:
            self._lists[name] = self.table.column(name).to_pylist()
        return self._lists[name]

    def numpy(self, name: str) -> np.ndarray:
        return self.table.column(name).to_numpy()

    def matrix(self, name: str, width: int) -> np.ndarray:
        """A list column as [shards, width] (float64; NaN where a row has no values)."""
        column = self.table.column(name).combine_chunks()
        out = np.full((len(self), width), np.nan)
        lengths = pc.list_value_length(column).to_numpy(zero_copy_only=False)
        full = lengths == width
        if full.any():
            out[full] = pc.list_flatten(column.filter(pa.array(full))).to_numpy(zero_copy_only=False).reshape(-1, width)
        return out

    def totals(self) -> dict:
        """The per-shard counters summed (as manifest.totals sums commit records)."""
        out = {k: int(self.numpy(k).sum()) if len(self) else 0 for k in ("sequences", "tokens", "loss_tokens", "bytes")}
        skipped: dict[str, int] = {}
        for i, text in enumerate(self.column("skipped")):
            for reason, n in skipped_counts(text, self.column("name")[i]).items():
                skipped[reason] = skipped.get(reason, 0) + n
        return dict(out, skipped=skipped, shards=len(self))

    def record(self, i: int) -> dict:
        # row i alone is converted: the first shard a rank reads of 100k cost ~0.9 s when every
        # column was converted whole for it
        row = self.table.slice(i, 1).to_pylist()[0]
        files = {name: size for name, size in zip(layout.V2_FILES, row["file_bytes"]) if size >= 0}
        health = {k: row[k] for k in ("rms", "zero_fraction", "nonfinite")}
        return {
            "name": row["name"], "rank": row["rank"], "index": row["index"], "rows": [row["row_start"], row["row_end"]],
            "sequences": row["sequences"], "tokens": row["tokens"], "loss_tokens": row["loss_tokens"],
            "bytes": row["bytes"], "hidden_shape": list(row["hidden_shape"]), "chunk_tokens": row["chunk_tokens"],
            "checksums": {"hidden": row["checksum_hidden"], layout.TOKENS: row["checksum_tokens"],
                          layout.SEQUENCES: row["checksum_sequences"]},
            "files": files, "skipped": skipped_counts(row["skipped"], row["name"]),
            **({"health": health} if health["rms"] else {}),
        }


# --- files -----------------------------------------------------------------------------------


def part_dir(rank: int) -> str:
    return f"{layout.INDEX_DIR}/{layout.rank_folder(rank)}"


def part_paths(rank: int) -> dict[str, str]:
    """Rank ``rank``'s part of the index, relative to the cache root."""
    return {SHARDS: f"{part_dir(rank)}/{layout.SHARD_TABLE}", SEQUENCES: f"{part_dir(rank)}/{layout.SEQUENCE_TABLE}"}


MERGED = {SHARDS: f"{layout.INDEX_DIR}/{layout.SHARD_TABLE}", SEQUENCES: f"{layout.INDEX_DIR}/{layout.SEQUENCE_TABLE}"}
_INDEX_PATH = re.compile(rf"^{layout.INDEX_DIR}/(r\d{{5}}/)?({re.escape(layout.SHARD_TABLE)}|{re.escape(layout.SEQUENCE_TABLE)})$")


def write_tables(store, paths: dict[str, str], shards: pa.Table, sequences: pa.Table, complete: bool) -> dict:
    """Write both tables (atomically, the sequence table first) and return the manifest's ``index``
    entry: path and rows, with size and checksum when ``complete`` (a complete cache's index never
    changes; a live part is rewritten with more rows, so readers of it take the rows the manifest
    names)."""
    entry = {}
    for key, table in ((SEQUENCES, sequences), (SHARDS, shards)):
        # one record batch: a table concatenated from one piece per shard would otherwise be written
        # (and read back) as one batch per shard, ~500 bytes of batch metadata each, and every slice
        # of a column read back walks all the batches (planning over 100k shards: quadratic)
        data = ipc_bytes(table.combine_chunks())
        store.makedirs(store.path(paths[key].rsplit("/", 1)[0]))
        store.write_bytes_atomic(store.path(paths[key]), data)
        entry[key] = {"path": paths[key], "rows": table.num_rows,
                      **({"bytes": len(data), "checksum": layout.checksum(data)} if complete else {})}
    return {SHARDS: entry[SHARDS], SEQUENCES: entry[SEQUENCES]}


def _damaged(url: str, what: str) -> CacheError:
    return CacheError(f"{url}: the index {what}; the cache is damaged or edited: run `dflash-cache verify`, then rebuild "
                      "it (or restore index/ and manifest.json)")


def read_table(store, entry: Any, key: str, schema: pa.Schema) -> pa.Table:
    """One index table as the manifest's ``index`` entry describes it: its path checked (only the
    index's own names), size and checksum compared when recorded, schema and rows checked."""
    url = store.url
    if not isinstance(entry, dict) or not isinstance(entry.get("path"), str) or not _INDEX_PATH.match(entry["path"]) \
            or not isinstance(entry.get("rows"), int) or entry["rows"] < 0:
        raise _damaged(url, f"entry {key!r} of manifest.json is {quoted(entry)}, not a table of the index")
    path = store.regular(store.path(entry["path"]))
    try:
        if "bytes" in entry and store.fs.size(path) != entry["bytes"]:  # refused before it is read
            raise _damaged(url, f"file {entry['path']} differs from its size or checksum in manifest.json")
        if store.local:
            data = pa.memory_map(path, "r").read_buffer()
        else:
            data = pa.py_buffer(store.fs.cat_file(path))
    except FileNotFoundError:
        raise _damaged(url, f"file {entry['path']} is missing") from None
    if "checksum" in entry and (data.size != entry.get("bytes") or layout.checksum(memoryview(data)) != entry["checksum"]):
        raise _damaged(url, f"file {entry['path']} differs from its size or checksum in manifest.json")
    try:
        table = pa.ipc.open_file(data).read_all()
    except (pa.ArrowInvalid, OSError) as err:
        raise _damaged(url, f"file {entry['path']} is not readable ({str(err).splitlines()[0][:100]})") from None
    if not table.schema.equals(schema):
        raise _damaged(url, f"file {entry['path']} does not have the {key} table's columns")
    if table.num_rows < entry["rows"]:
        raise _damaged(url, f"file {entry['path']} holds {table.num_rows} rows, manifest.json names {entry['rows']}")
    # one chunk a column (an index written before write_tables combined its batches has one per shard)
    return table.slice(0, entry["rows"]).combine_chunks()


def check_tables(url: str, manifest: dict, shards: pa.Table, sequences: pa.Table) -> None:
    """The tables agree with each other and the manifest: plain shard names, hidden shapes of the
    manifest's width, each shard's sequences where its count says. Vectorised: O(rows) in numpy."""
    for table, key in ((shards, SHARDS), (sequences, SEQUENCES)):
        nulls = [name for name in table.column_names if table.column(name).null_count]
        if nulls:
            raise _damaged(url, f"{key} table has empty (null) values in its column {nulls[0]!r}")
    names = shards.column("name")
    if pc.count_distinct(names).as_py() != shards.num_rows:
        counts = pc.value_counts(names)
        twice = counts.filter(pc.greater(counts.field("counts"), 1))[0]["values"].as_py()
        raise _damaged(url, f"lists the shard {quoted(twice)} more than once")
    skipped = shards.column("skipped")
    for text in pc.unique(skipped).to_pylist():  # "{}" for almost every shard: one parse each
        skipped_counts(text, names[pc.index(skipped, text).as_py()].as_py())
    plain = pc.match_substring_regex(names, f"^{layout.SHARD_NAME}$")
    if shards.num_rows and not pc.all(plain).as_py():
        bad = names.filter(pc.invert(plain))[0].as_py()
        raise _damaged(url, f"names a shard {quoted(bad)}, which is not a shard name (shard-rRRRRR-IIIIII)")
    counts = shards.column("sequences").to_numpy()
    tokens = shards.column("tokens").to_numpy()
    if np.any(counts < 0) or np.any(tokens < 0):
        raise _damaged(url, "holds a negative count")
    if shards.num_rows:
        shape = np.asarray(shards.column("hidden_shape").combine_chunks().flatten()).reshape(-1, 3)
        want = np.stack([tokens, np.full_like(tokens, len(manifest["layer_ids"])), np.full_like(tokens, manifest["hidden_size"])], 1)
        wrong = np.flatnonzero(np.any(shape != want, axis=1))
        if len(wrong):
            raise _damaged(url, f"gives shard {names[int(wrong[0])].as_py()} hidden_shape {shape[wrong[0]].tolist()}, "
                                f"not [tokens, tapped layers, hidden_size] = {want[wrong[0]].tolist()}")
    if int(counts.sum()) != sequences.num_rows:
        raise _damaged(url, f"lists {sequences.num_rows} sequences, its shards hold {int(counts.sum())}")
    position = sequences.column("shard").to_numpy()
    if not np.array_equal(position, np.repeat(np.arange(len(counts), dtype=np.int32), counts)):
        raise _damaged(url, "sequence table does not follow the shard table's order")
    lengths = sequences.column("length").to_numpy().astype(np.int64)
    if np.any(lengths < 0) or not np.array_equal(np.bincount(position, weights=lengths, minlength=len(counts)), tokens):
        raise _damaged(url, "sequence lengths do not add up to their shards' tokens")
    ends = np.cumsum(lengths)
    first = np.cumsum(counts) - counts  # each shard's first sequence in the table
    group_start = np.r_[0, ends][first][position] if len(lengths) else ends
    if not np.array_equal(sequences.column("offset").to_numpy(), ends - lengths - group_start):
        raise _damaged(url, "sequence offsets are not the running sums of their shard's lengths")


def open_index(store, manifest: dict) -> tuple[ShardTable, pa.Table]:
    """The shard table and the sequence table a format-2 manifest points at (empty while a
    multi-rank build has not finalized)."""
    entry = manifest.get("index")
    if entry is None and manifest.get("complete"):
        raise _damaged(store.url, "entry of manifest.json is missing (a complete cache always has one)")
    if entry is None:
        return ShardTable(shard_schema().empty_table()), sequence_schema().empty_table()
    if not isinstance(entry, dict):
        raise _damaged(store.url, f"entry of manifest.json is {quoted(entry)}, not an object")
    shards = read_table(store, entry.get(SHARDS), SHARDS, shard_schema())
    sequences = read_table(store, entry.get(SEQUENCES), SEQUENCES, sequence_schema())
    check_tables(store.url, manifest, shards, sequences)
    return ShardTable(shards), sequences


def read_part(store, rank: int) -> tuple[list[dict], pa.Table]:
    """A rank's checkpointed part (records and sequence rows), or nothing when it has none."""
    paths = part_paths(rank)
    if not store.fs.exists(store.path(paths[SHARDS])):
        return [], sequence_schema().empty_table()
    shards = pa.ipc.open_file(pa.py_buffer(store.fs.cat_file(store.path(paths[SHARDS])))).read_all()
    sequences = pa.ipc.open_file(pa.py_buffer(store.fs.cat_file(store.path(paths[SEQUENCES])))).read_all()
    table = ShardTable(shards)
    records = [table.record(i) for i in range(len(table))]
    n = int(shards.column("sequences").to_numpy().sum()) if shards.num_rows else 0
    if sequences.num_rows < n:  # the sequence table is written first: never shorter
        raise _damaged(store.url, f"part of rank {rank} lists fewer sequences than its shards hold")
    return records, sequences.slice(0, n)


def index_records(store: CacheStore, records: list[dict]) -> dict:
    """Write the index of these committed format-2 shards (reading each one's sequences.arrow) and
    return the manifest's ``index`` entry: for caches put together shard by shard outside a build."""
    tables = []
    for position, record in enumerate(records):
        path = store.path(layout.SHARDS_DIR, layout.rank_folder(layout.rank_of(record["name"])), record["name"], layout.SEQUENCES)
        tables.append(sequence_rows(pa.ipc.open_file(pa.BufferReader(store.read_bytes(path))).read_all(), position))
    return write_tables(store, MERGED, shard_table(records), pa.concat_tables(tables), complete=True)
