"""Stage-1 storage benchmark: the cache writer and reader against a raw numpy file and torch.save.

Production width on synthetic data: 5 tapped layers x hidden 5120 in bf16, top-k 64, sequences of
200-2000 tokens packed into shards the way `dflash-cache build` cuts them (default StorageConfig,
512 MiB of hidden states per shard). Every method writes and reads exactly the same payload in one
process, so the ratios are fair; MB/s is always payload bytes / seconds.

    .venv/bin/python benchmarks/bench_write.py            # ~1.05 GB per measurement, 2 rounds
    .venv/bin/python benchmarks/bench_write.py --quick    # ~0.4 GB, a smoke test
    .venv/bin/python benchmarks/bench_write.py --profile  # also: where write_shard spends its time

See benchmarks/README.md for what each row means.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import gc
import json
import os
import pstats
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import ml_dtypes
import numpy as np
import torch
import zarr

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from dflash_cache import format as fmt  # noqa: E402
from dflash_cache import health, open_cache  # noqa: E402
from dflash_cache.format import token_tables as tokens_mod  # noqa: E402
from dflash_cache.settings.storage_config import StorageConfig
from dflash_cache.writer import ShardData, write_shard
from dflash_common.files import fsync_path, fsync_tree  # noqa: E402

LAYERS, HIDDEN, TOP_K, VOCAB = [1, 16, 31, 46, 61], 5120, 64, 248_320
HIDDEN_BPT = len(LAYERS) * HIDDEN * 2  # bf16 hidden bytes per token
SETTLE_S = 1.5  # see timed()
PAYLOAD_BPT = HIDDEN_BPT + fmt.token_bytes_per_token(TOP_K)  # + input id, mask, k ids, k log-probs


# --- synthetic data --------------------------------------------------------------------------


def set_width(hidden: int) -> None:
    """The hidden size of the synthetic data (5 tapped layers each), for every method of this run."""
    global HIDDEN, HIDDEN_BPT, PAYLOAD_BPT
    HIDDEN, HIDDEN_BPT = hidden, len(LAYERS) * hidden * 2
    PAYLOAD_BPT = HIDDEN_BPT + fmt.token_bytes_per_token(TOP_K)


def make_shards(tokens: int, seed: int = 0) -> list[ShardData]:
    """Sequences of 200-2000 tokens until `tokens`, cut into shards like build.py does."""
    rng = np.random.default_rng(seed)
    lengths = []
    while sum(lengths) < tokens:
        lengths.append(int(rng.integers(200, 2001)))
    shard_tokens = StorageConfig().shard_bytes // HIDDEN_BPT
    groups, current = [], []
    for n in lengths:
        current.append(n)
        if sum(current) >= shard_tokens:
            groups.append(current)
            current = []
    if current:
        groups.append(current)

    # Hidden values are Gaussian bf16 bit patterns rather than uniform random bits, so zstd sees
    # roughly the entropy of real activations (uniform bits would make zstd look useless). They are
    # copied from a 100 MB pool at random offsets, in blocks bigger than a 4 MiB chunk, so no chunk
    # holds a repeat that a compressor could exploit; generating 1.5 GB of normals would take longer
    # than the benchmark itself.
    pool = rng.standard_normal((2048, len(LAYERS), HIDDEN), dtype=np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    block = 256
    shards, row = [], 0
    for index, group in enumerate(groups):
        n = sum(group)
        hidden = np.empty((n, len(LAYERS), HIDDEN), dtype=np.uint16)
        for lo in range(0, n, block):
            m = min(block, n - lo)
            start = int(rng.integers(0, len(pool) - m))
            hidden[lo:lo + m] = pool[start:start + m]
        shards.append(ShardData(
            rank=0, index=index, row_start=row, row_end=row + len(group),
            ids=[f"seq-{row + i:08d}" for i in range(len(group))],
            rows=np.arange(row, row + len(group), dtype=np.int64),
            lengths=np.array(group, dtype=np.int32), truncated=np.zeros(len(group), dtype=bool),
            input_ids=rng.integers(0, VOCAB, n, dtype=np.int32),
            loss_mask=(rng.random(n) < 0.7).astype(np.uint8),
            hidden=hidden,
            topk_ids=rng.integers(0, VOCAB, (n, TOP_K), dtype=np.int32),
            # sorted descending, like real top-k log-probs
            topk_logprobs=-np.cumsum(rng.exponential(0.3, (n, TOP_K)), axis=1).astype(np.float32),
        ))
        row += len(group)
    return shards


def samples(shard: ShardData):
    """(sequence id, token slice) of every sequence in a shard."""
    offsets = np.concatenate([[0], np.cumsum(shard.lengths)])
    for i, seq_id in enumerate(shard.ids):
        yield seq_id, slice(int(offsets[i]), int(offsets[i + 1]))


def token_arrays(shard: ShardData) -> list[np.ndarray]:
    return [shard.input_ids, shard.loss_mask, shard.topk_ids, shard.topk_logprobs]


# --- helpers ---------------------------------------------------------------------------------


def disk_bytes(path: Path) -> tuple[int, int]:
    """(apparent bytes, allocated bytes) of every file under path."""
    apparent = allocated = 0
    for f in path.rglob("*"):
        if f.is_file():
            st = f.stat()
            apparent += st.st_size
            allocated += st.st_blocks * 512
    return apparent, allocated


def touch(a: np.ndarray) -> int:
    """Read every byte of an array (a cheap sum), so lazy memory maps pay for their page faults."""
    b = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    return int(b.view(np.uint64).sum() if b.size % 8 == 0 else b.sum())


# --- the write methods: each writes all shards under `out`, fsyncing the data when `sync` ----


def write_cache(shards, out: Path, sync: bool, compression: str, version: int = fmt.FORMAT_VERSION) -> None:
    store = fmt.CacheStore.open(str(out))
    storage = StorageConfig(compression=compression)
    for shard in shards:
        write_shard(store, shard, storage, "bfloat16", version=version)  # includes its fsynced commit record
        if sync:  # the writer fsyncs only its record; syncing the data is what a durable commit costs
            fsync_tree(Path(fmt.shard_path(str(out), shard.name, version)))


def write_raw(shards, out: Path, sync: bool) -> None:
    out.mkdir(parents=True)
    for shard in shards:
        with open(out / f"{shard.name}.bin", "wb") as f:
            for a in [shard.hidden, *token_arrays(shard)]:
                a.tofile(f)
            if sync:
                f.flush()
                os.fsync(f.fileno())


def sample_dicts(shards):
    """What a per-sample pipeline holds: one dict of tensors per sequence (views, no copies)."""
    for shard in shards:
        for seq_id, s in samples(shard):
            yield seq_id, {
                "hidden": torch.from_numpy(shard.hidden[s]).view(torch.bfloat16),
                "input_ids": torch.from_numpy(shard.input_ids[s]),
                "loss_mask": torch.from_numpy(shard.loss_mask[s]),
                "topk_ids": torch.from_numpy(shard.topk_ids[s]),
                "topk_logprobs": torch.from_numpy(shard.topk_logprobs[s]),
            }


def write_torch(items, out: Path, sync: bool) -> None:
    out.mkdir(parents=True)
    for seq_id, d in items:
        with open(out / f"{seq_id}.pt", "wb") as f:
            torch.save(d, f)
            if sync:
                f.flush()
                os.fsync(f.fileno())


def write_manifest(shards_dir_root: Path, version: int = fmt.FORMAT_VERSION) -> None:
    """The minimal manifest open_cache needs (build.py writes the full one; not timed)."""
    store = fmt.CacheStore.open(str(shards_dir_root))
    # a commit record sits next to its shard folder: shards/<name>.json (format 1) or
    # shards/r<rank>/<name>.json (format 2)
    records = [store.read_json_unchecked(str(p)) for p in sorted((shards_dir_root / fmt.SHARDS_DIR).rglob("shard-*.json"),
                                                         key=lambda p: p.name)]
    fmt.write_manifest(store, fmt.manifest_header(LAYERS, HIDDEN, "bfloat16", TOP_K, format_version=version), records,
                       complete=True)


# --- the read methods: each touches every array of every sequence; returns tokens read --------


def read_cache(out: Path) -> int:
    n = 0
    for rec in open_cache(str(out)).sequences():
        for a in (rec.hidden, rec.input_ids, rec.loss_mask, rec.topk_ids, rec.topk_logprobs):
            touch(a)
        n += len(rec)
    return n


def read_raw(shards, out: Path) -> int:
    n = 0
    for shard in shards:  # the index (lengths, array offsets) is known, as a raw format would store it
        mm = np.memmap(out / f"{shard.name}.bin", dtype=np.uint8, mode="r")
        views, pos = [], 0
        for a in [shard.hidden, *token_arrays(shard)]:
            views.append(mm[pos:pos + a.nbytes].view(a.dtype).reshape(a.shape))
            pos += a.nbytes
        for _, s in samples(shard):
            for v in views:
                touch(v[s])
            n += s.stop - s.start
    return n


def read_torch(out: Path) -> int:
    n = 0
    for path in sorted(out.glob("*.pt")):
        d = torch.load(path, weights_only=True)
        for t in d.values():
            touch(t.view(torch.uint8).numpy())
        n += len(d["input_ids"])
    return n


# --- profile: where write_shard's time goes ---------------------------------------------------


class PartTimer:
    """Wraps functions write_shard calls and charges each its exclusive time (nested calls excluded)."""

    def __init__(self):
        self.totals: dict[str, float] = {}
        self._stack: list[float] = []  # time spent in nested timed calls, per open call

    def wrap(self, name, fn):
        def timed(*args, **kwargs):
            self._stack.append(0.0)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                nested = self._stack.pop()
                self.totals[name] = self.totals.get(name, 0.0) + dt - nested
                if self._stack:
                    self._stack[-1] += dt
        return timed


@contextlib.contextmanager
def patched(obj, name, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def profile_write(shards, tmp: Path, compression: str) -> None:
    store = fmt.CacheStore.open(str(tmp / f"profile-{compression}"))
    fs = store.fs  # its calls are timed below (the store's methods call them)
    storage = StorageConfig(compression=compression)
    timer = PartTimer()
    parts = [
        (zarr, "create_array", "zarr write (encode + chunk files)"),
        (tokens_mod, "ipc_bytes", "arrow IPC serialisation"),
        (tokens_mod.pa, "table", "arrow table build"),
        (fmt, "checksum", "checksums (xxh64)"),
        (fs, "pipe_file", "arrow files write"),
        (fs, "mv", "renames (shard dir + record)"),
        (fs, "find", "listing files for the record"),
        (fmt, "write_json_atomic", "commit record (write + fsync)"),
        (fs, "makedirs", "makedirs"),
        (fs, "exists", "exists"),
    ]
    with contextlib.ExitStack() as stack:
        for obj, attr, label in parts:
            stack.enter_context(patched(obj, attr, timer.wrap(label, getattr(obj, attr))))
        total = 0.0
        for shard in shards:
            os.sync()
            t0 = time.perf_counter()
            write_shard(store, shard, storage, "bfloat16")
            total += time.perf_counter() - t0
    payload = sum(len(s.input_ids) for s in shards) * PAYLOAD_BPT
    print(f"\nwrite_shard parts, compression={compression}, {len(shards)} shard(s), "
          f"{payload / 1e9:.2f} GB, {total:.2f} s, {payload / total / 1e6:.0f} MB/s")
    for label, t in sorted(timer.totals.items(), key=lambda kv: -kv[1]):
        print(f"  {label:<36} {t:7.3f} s  {100 * t / total:5.1f}%")
    rest = total - sum(timer.totals.values())
    print(f"  {'other (arrays, offsets, dict)':<36} {rest:7.3f} s  {100 * rest / total:5.1f}%")

    # cProfile sees only the calling thread: zarr's encoding and file writes run on its own event
    # loop and thread pool, so they show up as lock waits; the part timer above is the real split.
    prof = cProfile.Profile()
    os.sync()
    shard = shards[0]
    shard_copy = ShardData(**{**shard.__dict__, "index": 10_000})
    prof.runcall(write_shard, store, shard_copy, storage, "bfloat16")
    print("\ncProfile of one write_shard (top 8 by own time, caller thread only):")
    pstats.Stats(prof, stream=sys.stdout).sort_stats("tottime").print_stats(8)


def profile_fsync(shard: ShardData, tmp: Path) -> None:
    """What making one shard's data durable would cost: its files fsynced one by one or on 8
    threads, against one fsync of a single raw file of the same bytes."""
    store = fmt.CacheStore.open(str(tmp / "profile-fsync"))
    results = []
    for index, threads in ((20_000, 1), (20_001, 8)):
        os.sync()
        record = write_shard(store, ShardData(**{**shard.__dict__, "index": index}), StorageConfig(), "bfloat16")
        files = [p for p in Path(fmt.shard_path(store.root, record["name"], fmt.FORMAT_VERSION)).rglob("*") if p.is_file()]
        t0 = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(fsync_path, files))
        results.append(f"{len(files)} files on {threads} thread(s): {time.perf_counter() - t0:.2f} s")
    os.sync()
    write_raw([shard], tmp / "profile-fsync-raw", sync=False)
    t0 = time.perf_counter()
    fsync_path(tmp / "profile-fsync-raw" / f"{shard.name}.bin")
    results.append(f"1 raw file: {time.perf_counter() - t0:.2f} s")
    print(f"\nfsync of one shard's data ({len(shard.input_ids) * PAYLOAD_BPT / 1e6:.0f} MB, dirty): " + "; ".join(results))


# --- one long sequence (issue 59): its throughput and peak memory --------------------------


def long_shard(tokens: int, seed: int = 0, index: int = 0) -> ShardData:
    """One sequence of ``tokens`` tokens at the current width (LAYERS x HIDDEN), alone in its shard:
    a build cuts a shard once it reaches its size, so a sequence longer than a shard is one. Values
    as make_shards' (blocks of a Gaussian pool); ids, rows and the top-k the same shapes."""
    rng = np.random.default_rng(seed)
    pool = rng.standard_normal((min(2048, tokens + 1), len(LAYERS), HIDDEN), dtype=np.float32)
    pool = pool.astype(ml_dtypes.bfloat16).view(np.uint16)
    hidden = np.empty((tokens, len(LAYERS), HIDDEN), dtype=np.uint16)
    block = min(256, len(pool) - 1)
    for lo in range(0, tokens, block):
        m = min(block, tokens - lo)
        start = int(rng.integers(0, len(pool) - m))
        hidden[lo:lo + m] = pool[start:start + m]
    del pool
    return ShardData(rank=0, index=index, row_start=0, row_end=1, ids=["long-00000000"], rows=np.zeros(1, np.int64),
                     lengths=np.array([tokens], np.int32), truncated=np.zeros(1, bool),
                     input_ids=rng.integers(0, VOCAB, tokens, dtype=np.int32),
                     loss_mask=(rng.random(tokens) < 0.7).astype(np.uint8), hidden=hidden,
                     topk_ids=rng.integers(0, VOCAB, (tokens, TOP_K), dtype=np.int32),
                     topk_logprobs=-np.cumsum(rng.exponential(0.3, (tokens, TOP_K)), axis=1).astype(np.float32))


def status_bytes(field: str) -> int:
    """A memory field of /proc/self/status (VmRSS, VmHWM, RssAnon, ...) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


class PeakMemory:
    """Peak memory of the block it wraps, above what the process held when it began: ``rss`` from
    the kernel's high-water mark (VmHWM, reset at the start through /proc/self/clear_refs), which
    also counts the pages of memory-mapped files a read touched (page cache, reclaimable), and
    ``anon`` the peak of anonymous memory alone (RssAnon, sampled every 2 ms on a thread: an
    allocation the size of a sequence takes far longer than that to fault in), what the process
    really costs. ``seconds`` is the block's wall time."""

    def __enter__(self) -> "PeakMemory":
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS now (Linux >= 4.0)
        self.rss0, self.anon0 = status_bytes("VmRSS"), status_bytes("RssAnon")
        self._peak, self._stop = self.anon0, threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        self._t0 = time.perf_counter()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.002):
            self._peak = max(self._peak, status_bytes("RssAnon"))

    def __exit__(self, *exc) -> None:
        self.seconds = time.perf_counter() - self._t0
        self._stop.set()
        self._thread.join()
        self.anon = max(self._peak, status_bytes("RssAnon")) - self.anon0
        self.rss = status_bytes("VmHWM") - self.rss0

    def result(self, **extra) -> dict:
        return {"seconds": self.seconds, "anon": self.anon, "rss": self.rss, **extra}


def in_child(script: str, args: list[str]) -> dict:
    """Run ``script --long-child ...`` in a fresh process (so each peak starts clean) and return
    the JSON it prints last."""
    done = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{Path(script).name} {' '.join(args)} failed:\n{done.stdout[-2000:]}{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def long_write_child(mode: str, folder: Path, tokens: int) -> dict:
    """One long sequence written in this process: ``writer`` (write_shard, which fsyncs the shard's
    data before its commit record) or ``raw`` (its arrays in one file with tofile, then one fsync:
    the baseline). The data is made first, outside the measured block."""
    shard = long_shard(tokens)
    out = folder / f"{mode}-{os.getpid()}"
    store = fmt.CacheStore.open(str(out))
    with PeakMemory() as peak:
        if mode == "writer":
            write_shard(store, shard, StorageConfig(), "bfloat16")
        else:
            write_raw([shard], out, sync=True)
    result = peak.result(bytes=int(shard.hidden.nbytes))
    shutil.rmtree(out)
    return result


def long_write_rows(tokens: int, tmp: Path, repeat: int) -> list[tuple[str, list[dict]]]:
    """The writer and the raw baseline on one sequence of ``tokens`` tokens, each in its own process,
    rounds interleaved."""
    runs: dict[str, list[dict]] = {"raw numpy tofile + fsync, 1 file": [], "dflash writer, one shard": []}
    args = ["--long-child-tokens", str(tokens), "--hidden", str(HIDDEN), "--long-dir", str(tmp)]
    for _ in range(repeat):
        for label, mode in zip(runs, ("raw", "writer")):
            os.sync()
            time.sleep(SETTLE_S)
            runs[label].append(in_child(__file__, ["--long-child", mode, *args]))
    return list(runs.items())


def print_long_table(title: str, rows: list[tuple[str, list[dict]]], payload: int, base_name: str) -> None:
    """One long sequence's rows: throughput (payload bytes / wall seconds) best and median, as a
    ratio of the first row's time, and the peak memory above the process's own before the
    measurement, anonymous and resident (VmHWM), each in GB and as a multiple of the sequence's
    hidden-state bytes."""
    seq = rows[0][1][0]["bytes"]
    base = [r["seconds"] for r in rows[0][1]]
    head = (f"{'method':<42} {'GB/s':>6} {'(med)':>6} {f'x {base_name}':>9} {'(med)':>6} {'anon GB':>7} {'x seq':>6} "
            f"{'RSS GB':>7} {'x seq':>6}  wall s per round")
    print(f"\n{title}\n{head}\n" + "-" * len(head))
    for label, runs in rows:
        walls = [r["seconds"] for r in runs]
        best, med = min(walls), float(np.median(walls))
        anon, rss = max(r["anon"] for r in runs), max(r["rss"] for r in runs)
        print(f"{label:<42} {payload / best / 1e9:6.2f} {payload / med / 1e9:6.2f} {min(base) / best:8.2f}x "
              f"{np.median(base) / med:5.2f}x {anon / 1e9:7.2f} {anon / seq:5.2f}x {rss / 1e9:7.2f} {rss / seq:5.2f}x  "
              f"{' '.join(f'{w:.2f}' for w in walls)}")
    print(f"GB/s = the sequence's {payload / 1e9:.2f} GB / wall seconds; x {base_name} = the first row's time / this "
          f"row's; anon = peak anonymous memory above the process's before (sampled), RSS = peak resident above it "
          f"(VmHWM: also the mapped file pages a read touched); x seq = / the sequence's {seq / 1e9:.2f} GB of hidden states")


# --- main ------------------------------------------------------------------------------------


def timed(fn, *args) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process, all threads) of fn(*args)."""
    os.sync()  # flush earlier methods' dirty pages first, untimed, so they do not slow this one
    # This VM hands freed guest memory back to the host within ~1 s (free page reporting), and
    # faulting it back in runs at ~0.5 GB/s against ~7 GB/s for memory freed a moment ago. Waiting
    # lets every method start equally cold instead of one inheriting the pages another just freed.
    time.sleep(SETTLE_S)
    t0, c0 = time.perf_counter(), time.process_time()
    fn(*args)
    return time.perf_counter() - t0, time.process_time() - c0


def counts_before(values: np.ndarray) -> None:
    """The writer's exact pass before issue 60 (zeros and NaN/Inf only; magnitudes from the sample):
    the baseline of --health, kept here to measure against."""
    view, magnitude, exponent = "int16", 0x7FFF, 0x7F80  # bf16
    for lo in range(0, values.shape[0], health.BLOCK_ROWS):
        bits = values[lo:lo + health.BLOCK_ROWS].view(view)
        np.count_nonzero((bits & magnitude) == 0, axis=(0, 2))
        np.count_nonzero((bits & exponent) == exponent, axis=(0, 2))


def health_rows(shards, repeat: int) -> None:
    """Capture health per shard as the writer runs it now (exact zeros, NaN/Inf and largest |x| from
    the bits, RMS from the sample) against before (the same without the exact |x|), interleaved
    rounds in this one process; the ratio is of the medians."""
    values = [fmt.from_storage(s.hidden, "bfloat16") for s in shards]
    now, before = [], []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for v in values:
            health.layer_stats(v)
        t1 = time.perf_counter()
        for v in values:
            counts_before(v)
        t2 = time.perf_counter()
        for v in values:
            health.exact_counts(v)
        t3 = time.perf_counter()
        now.append(t1 - t0)
        before.append((t1 - t0) - (t3 - t2) + (t2 - t1))  # the sampled part is the same code both times
    elements = sum(v.size for v in values)
    a, b = float(np.median(now)), float(np.median(before))
    print(f"capture health of {len(values)} shard(s), {elements / 1e6:,.0f} M bf16 values: exact |x| (now) {a:.3f} s "
          f"({a / elements * 1e9:.2f} ns/value), sampled |x| (before) {b:.3f} s ({b / elements * 1e9:.2f} ns/value): "
          f"{a / b:.2f}x; rounds now {' '.join(f'{x:.3f}' for x in now)}")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=20_000, help="tokens per measurement (51.7 KB each; default ~1.05 GB)")
    ap.add_argument("--quick", action="store_true", help="8,000 tokens (~0.4 GB), one round, no fsync rows: a smoke test")
    ap.add_argument("--fsync", choices=["none", "data", "both"], default="both",
                    help="none: no method fsyncs its data (the writer still fsyncs its tiny record); "
                         "data: every method fsyncs every data file; both: one row set each (default)")
    ap.add_argument("--repeat", type=int, default=2, help="interleaved rounds; the table shows the best and the median")
    ap.add_argument("--profile", action="store_true", help="also time each part of write_shard and cProfile it")
    ap.add_argument("--tmp", default=str(Path(__file__).resolve().parents[1] / ".bench-tmp"),
                    help="scratch folder on the disk to measure; deleted at the end")
    ap.add_argument("--long-tokens", type=int, default=0,
                    help="instead: one sequence of this many tokens (issue 59: 32768), the writer against a raw file, "
                         "each write in its own process, with its peak memory")
    ap.add_argument("--hidden", type=int, default=HIDDEN, help="hidden size of the 5 tapped layers (a small one for a "
                                                               "quick long-sequence row)")
    ap.add_argument("--health", action="store_true", help="instead: the writer's capture health, exact |x| against "
                                                             "the sampled magnitudes before issue 60")
    ap.add_argument("--long-child", choices=["writer", "raw"], help=argparse.SUPPRESS)  # one measurement, in a child
    ap.add_argument("--long-child-tokens", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--long-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    set_width(args.hidden)
    if args.long_child:
        print(json.dumps(long_write_child(args.long_child, Path(args.long_dir), args.long_child_tokens)))
        return
    tokens = 8_000 if args.quick else args.tokens
    if args.quick:
        args.repeat = 1
    modes = {"none": [False], "data": [True], "both": [False, True]}["none" if args.quick else args.fsync]

    tmp = Path(args.tmp) / f"run-{os.getpid()}"
    tmp.mkdir(parents=True)
    try:
        if args.long_tokens:
            payload = args.long_tokens * PAYLOAD_BPT
            print(f"one sequence of {args.long_tokens:,} tokens, {len(LAYERS)} layers x hidden {HIDDEN}: payload "
                  f"{payload / 1e9:.2f} GB ({PAYLOAD_BPT} B/token); load average {os.getloadavg()[0]:.2f}")
            print_long_table("one long sequence written, each write in a process of its own", long_write_rows(
                args.long_tokens, tmp, args.repeat), payload, "raw")
            print(f"load average at the end {os.getloadavg()[0]:.2f}")
            return
        t0 = time.perf_counter()
        shards = make_shards(tokens)
        if args.health:
            health_rows(shards, max(args.repeat, 3))
            return
        n_tokens = sum(len(s.input_ids) for s in shards)
        payload = n_tokens * PAYLOAD_BPT
        print(f"data: {n_tokens:,} tokens, {sum(len(s.ids) for s in shards)} sequences, {len(shards)} shard(s), "
              f"payload {payload / 1e9:.2f} GB ({PAYLOAD_BPT} B/token); generated in {time.perf_counter() - t0:.1f} s; "
              f"load average {os.getloadavg()[0]:.2f}")

        methods = [
            ("dflash writer (default, no compression)", "cache", lambda out, sync: write_cache(shards, out, sync, "none")),
            ("dflash writer (zstd level 1)", "cache-zstd", lambda out, sync: write_cache(shards, out, sync, "zstd")),
            ("raw numpy tofile, 1 file/shard", "raw", lambda out, sync: write_raw(shards, out, sync)),
            ("torch.save, 1 file/sample", "torch", lambda out, sync: write_torch(sample_dicts(shards), out, sync)),
        ]
        # Interleaved rounds, best and median reported: this VM's other tenants and its lazily backed
        # guest memory (fresh page-cache pages cost 5-10x more than recycled ones) make single runs noisy.
        times: dict[tuple, list[tuple[float, float]]] = {}  # (kind, label, fsync) -> (wall, cpu) per round
        sizes: dict[str, tuple[int, int]] = {}  # label -> (apparent, allocated) bytes on disk
        keep = {"cache", "raw", "torch"}  # outputs of the last pass, for the read rows
        for r in range(args.repeat):
            for sync in modes:
                # each round starts at a different method, so none always follows the same one
                for label, key, fn in methods[r % len(methods):] + methods[:r % len(methods)]:
                    out = tmp / f"{key}-{'fsync' if sync else 'nosync'}"
                    shutil.rmtree(out, ignore_errors=True)
                    times.setdefault(("write", label, "data" if sync else "no"), []).append(timed(fn, out, sync))
                    sizes[label] = disk_bytes(out)
                    if not (r == args.repeat - 1 and sync == modes[-1] and key in keep):
                        shutil.rmtree(out)  # spare the page cache

        # Reads come straight after the writes, so the files are in the page cache: warm reads.
        last = "fsync" if modes[-1] else "nosync"
        write_manifest(tmp / f"cache-{last}")
        reads = [
            ("dflash open_cache().sequences()", lambda: read_cache(tmp / f"cache-{last}")),
            ("raw np.memmap, 1 file/shard", lambda: read_raw(shards, tmp / f"raw-{last}")),
            ("torch.load, 1 file/sample", lambda: read_torch(tmp / f"torch-{last}")),
        ]
        for r in range(args.repeat):
            for label, fn in reads[r % len(reads):] + reads[:r % len(reads)]:
                got = []
                times.setdefault(("read", label, "warm"), []).append(timed(lambda: got.append(fn())))
                assert got[0] == n_tokens, (label, got[0], n_tokens)

        print_table(times, sizes, n_tokens, payload)
        print(f"load average at the end {os.getloadavg()[0]:.2f}")

        if args.profile:
            profile_write(shards, tmp, "none")
            profile_write(shards, tmp, "zstd")
            profile_fsync(shards[0], tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        with contextlib.suppress(OSError):
            Path(args.tmp).rmdir()  # only if no other run is using it


def print_table(times, sizes, n_tokens: int, payload: int) -> None:
    raw = {(kind, sync): [w for w, _ in ts] for (kind, label, sync), ts in times.items() if label.startswith("raw")}
    head = (f"{'':5} {'method':<40} {'fsync':>5} {'MB/s':>6} {'(med)':>6} {'tok/s':>7} {'x raw':>6} {'(med)':>6} "
            f"{'CPU s':>6} {'B/token':>7} {'overhead':>8} {'(du)':>7}  wall s per round")
    print("\n" + head + "\n" + "-" * len(head))
    # rows in a fixed order whatever order the rounds ran them in
    for (kind, label, sync), ts in sorted(times.items(), key=lambda kv: (kv[0][0] == "read", kv[0][2] == "data")):
        walls = [w for w, _ in ts]
        best, med, cpu = min(walls), float(np.median(walls)), float(np.median([c for _, c in ts]))
        base = raw[(kind, sync)]
        size = ""
        if kind == "write":
            apparent, allocated = (x / n_tokens for x in sizes[label])
            size = f"{apparent:7,.0f} {100 * (apparent / PAYLOAD_BPT - 1):+7.2f}% {100 * (allocated / PAYLOAD_BPT - 1):+6.2f}%"
        print(f"{kind:5} {label:<40} {sync:>5} {payload / best / 1e6:6.0f} {payload / med / 1e6:6.0f} "
              f"{n_tokens / best:7,.0f} {min(base) / best:5.2f}x {np.median(base) / med:5.2f}x {cpu:6.2f} "
              f"{size:<24}  {' '.join(f'{w:.2f}' for w in walls)}")
    print(f"MB/s = payload ({PAYLOAD_BPT} B/token x {n_tokens:,} tokens) / wall seconds, best round and (median); "
          f"x raw = raw numpy's time / this method's time, same kind and fsync mode;\n"
          f"CPU s = median CPU seconds of the process, all threads; "
          f"overhead = bytes on disk / payload - 1, apparent size and (du) allocated blocks")


if __name__ == "__main__":
    main()
