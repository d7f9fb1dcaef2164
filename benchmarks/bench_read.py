"""Stage-2 read benchmark: the cache reader to training batches, against a raw np.memmap and torch.load.

Production width on synthetic data (5 tapped layers x hidden 5120 in bf16, top-k 64, sequences of
200-2000 tokens, shards cut like `dflash-cache build` cuts them; bench_write.py makes the data).
Every method turns the same sequences, in the same shuffled epoch order, into the same padded
bf16 batches of hidden states (what the loader hands the trainer); tokens/s and GB/s count the
hidden-state bytes as stored (bf16). One more row adds what a CPU trainer then does to each batch
(float32 and the step's noise, `trainer.on_device`); a GPU trainer does that on the GPU.

The loader checks each shard's checksums before it hands out the shard's first sequence, once per
process (`Shard.checksum_problems`). The "load_batch" rows after the first round find the shards
already checked in this process; the "checksums hashed" row forgets them before every round, as a
new training process starts (format 2: each inner chunk's crc32c too), and so do the
steady-state loader rows and the format-1 row (the same rows written in format 1).

Two more tables time the public reader, each record's hidden states to a contiguous tensor:
`open_cache(url).sequences()` in order and `cache[id]` in a random order, format 2 and format 1,
each against a raw np.memmap copied into a tensor a sequence in the same order (issue 48).

    .venv/bin/python benchmarks/bench_read.py --hidden 4096 --tokens 10000   # issue 48's width (40 KB a token)
    .venv/bin/python benchmarks/bench_read.py             # ~12k tokens (0.6 GB of hidden states), 3 rounds
    .venv/bin/python benchmarks/bench_read.py --quick     # ~3k tokens, 1 round: a smoke test
    .venv/bin/python benchmarks/bench_read.py --workers 0,1,2   # DataLoader worker counts for the loader rows

See benchmarks/README.md for what each row means.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import bench_write as bw  # noqa: E402  (same folder)

from dflash_cache import open_cache  # noqa: E402
from dflash_cache.format import hidden as hidden_format  # noqa: E402
from dflash_cache.format import integrity  # noqa: E402
from dflash_train.settings.data_config import DataConfig
from dflash_train.settings.noise_config import NoiseConfig
from dflash_train.settings.train_config import TrainConfig  # noqa: E402
from dflash_train.training.batch import load_batch
from dflash_train.training.data import LoaderState, train_loader
from dflash_train.training.epoch_plan import EpochPlan
from dflash_train.training.noise import add_noise_
from dflash_train.training.train_step import on_device  # noqa: E402

BATCH_TOKENS = 8192  # DataConfig's default
DRAFT_POSITIONS = 15  # the default drafter's (block 16): the loader anchors with the default cover blocks


def padded(lengths: list[int]) -> np.ndarray:
    return np.zeros((len(lengths), max(lengths), len(bw.LAYERS), bw.HIDDEN), dtype=ml_dtypes.bfloat16)


def batches_memmap(shards, raw: Path, plan: list) -> int:
    """Baseline: the same rows from one raw file per shard, memory-mapped, into bf16 batches."""
    maps = [np.memmap(raw / f"{s.name}.bin", dtype=np.uint16, mode="r", shape=s.hidden.shape) for s in shards]
    offsets = [np.concatenate([[0], np.cumsum(s.lengths)]) for s in shards]
    n = 0
    for refs in plan:
        lengths = [int(shards[s].lengths[i]) for s, i in refs]
        out = padded(lengths)
        for row, ((s, i), t) in enumerate(zip(refs, lengths)):
            out[row, :t] = maps[s][offsets[s][i]:offsets[s][i] + t].view(ml_dtypes.bfloat16)
        n += sum(lengths)
    return n


def batches_torch(torch_dir: Path, shards, plan: list) -> int:
    """Baseline: one torch.load per sequence (today's per-sample caches), into bf16 batches."""
    n = 0
    for refs in plan:
        loaded = [torch.load(torch_dir / f"{shards[s].ids[i]}.pt", weights_only=True) for s, i in refs]
        out = torch.from_numpy(padded([len(d["input_ids"]) for d in loaded]).view(np.uint16)).view(torch.bfloat16)
        for row, d in enumerate(loaded):
            out[row, :len(d["input_ids"])] = d["hidden"]
            n += len(d["input_ids"])
    return n


def forget_checksums() -> None:
    """Forget which shards this process has hashed and (format 2) which inner chunks' crc32c it
    checked, as a new process starts: every reader row below pays for its checks."""
    with integrity._VERIFIED_LOCK:
        integrity._VERIFIED.clear()
    with hidden_format._VERIFIED_LOCK:
        hidden_format._VERIFIED.clear()


def tensor(bits: np.ndarray) -> torch.Tensor:
    """A record's hidden states as a contiguous bf16 tensor (a copy only where they are not contiguous)."""
    return torch.from_numpy(np.ascontiguousarray(bits).view(np.uint16)).view(torch.bfloat16)


def records_memmap(shards, raw: Path, order: list[tuple[int, int]]) -> int:
    """Baseline of the public reader: each sequence's bytes copied from a raw memory map into a
    tensor of its own, in ``order``."""
    maps = [np.memmap(raw / f"{s.name}.bin", dtype=np.uint16, mode="r", shape=s.hidden.shape) for s in shards]
    offsets = [np.concatenate([[0], np.cumsum(s.lengths)]) for s in shards]
    n = 0
    for s, i in order:
        n += len(tensor(np.array(maps[s][offsets[s][i]:offsets[s][i + 1]])))
    return n


def records_sequential(url: str) -> int:
    """The public reader in order: open_cache(url).sequences(), each record's hidden states to a tensor."""
    forget_checksums()
    return sum(len(tensor(r.hidden)) for r in open_cache(url).sequences())


def records_by_id(url: str, ids: list[str]) -> int:
    """The public reader by id (cache[id]) in ``ids``' order, each record's hidden states to a tensor."""
    forget_checksums()
    cache = open_cache(url)
    return sum(len(tensor(cache[i].hidden)) for i in ids)


def batches_reader(url: str, cfg: DataConfig, plan: list, train: TrainConfig | None = None,
                   zarr_only: bool = False, cold: bool = False) -> int:
    """The package: dflash_train.training.batch.load_batch (reader, anchors, padding, and the shards'
    checksums the first time this process reads them: every time with ``cold``), then with
    `train` the CPU trainer's float32 conversion and noise."""
    if cold:
        forget_checksums()
    cache = open_cache(url)
    if zarr_only:  # the read path before the chunk-file fast path, for comparison
        for shard in cache.shards:
            shard.files.__dict__["fast_hidden"] = None
    n = 0
    for b, refs in enumerate(plan):
        batch = load_batch(cache, cfg, refs, epoch=0, draft_positions=DRAFT_POSITIONS)
        if train is not None:
            batch = on_device(batch, torch.device("cpu"), train, b, 1000)
        n += batch.num_tokens
    return n


def noise_ns_per_draw(tokens: int) -> tuple[float, float]:
    """Nanoseconds a draw for the trainer's noise (add_noise_ on a float32 batch, on this CPU)
    and, as the baseline, numpy's Philox filling a float32 array of the same size."""
    width = bw.HIDDEN
    hidden = torch.zeros(1, tokens, len(bw.LAYERS), width)
    draws = tokens * (len(bw.LAYERS) - 1) * width
    t0 = time.perf_counter()
    add_noise_(hidden, ["seq"], [tokens], NoiseConfig(schedule="cosine"), 0, 1000)
    ours = time.perf_counter() - t0
    out = np.empty(draws, np.float32)
    t0 = time.perf_counter()
    np.random.Generator(np.random.Philox(0)).random(out=out, dtype=np.float32)
    philox = time.perf_counter() - t0
    return ours / draws * 1e9, philox / draws * 1e9


def batches_loader(url: str, cfg: DataConfig, count: int) -> tuple[float, int]:
    """The training loader as the trainer runs it: TrainStream in a DataLoader, read-ahead on.
    Steady state: (seconds, tokens) from the first batch's arrival to the last's, so worker start-up
    (importing torch in each worker) is left out."""
    cache = open_cache(url)
    state = LoaderState(seed=cfg.seed, manifest_fingerprint=cache.fingerprint)
    forget_checksums()  # a training process hashes the shards it reads, once
    n, first = 0, None
    for b, batch in enumerate(train_loader(url, None, cfg, state, draft_positions=DRAFT_POSITIONS)):
        if first is None:
            first = time.perf_counter()
        else:
            n += batch.num_tokens
        if b + 1 == count:
            break
    return time.perf_counter() - first, n


def timed(fn) -> tuple[float, float, int]:
    time.sleep(bw.SETTLE_S)  # see bench_write.timed: let every method start equally cold
    t0, c0 = time.perf_counter(), time.process_time()
    n = fn()
    return time.perf_counter() - t0, time.process_time() - c0, n


LONG_PATHS = {
    "raw np.memmap -> a tensor": "memmap",
    "cache[id]": "getitem",
    "Shard.read into a buffer": "read_into",
    "sequences()": "sequences",
    "load_batch, packed": "packed",
    "load_batch, padded": "padded",
    "train_loader, packed, 0 workers, 2 batches": "loader",
    "dflash-cache verify (verify_cache)": "verify",
}
"""One long sequence's read paths (label -> child mode), each measured in a process of its own."""


def long_read_child(mode: str, folder: Path, tokens: int) -> dict:
    """One read path of the long sequence in this process (bench_write.PeakMemory around it); the
    cache opened and its checksums hashed before, outside the measured block, except for verify."""
    from dflash_cache.verify import verify_cache

    url = str(folder / "cache")
    cache = open_cache(url)
    seq = int(tokens) * bw.HIDDEN_BPT
    cfg = DataConfig(batch_tokens=max(1, tokens // 4), heldout_fraction=0.0,  # the sequence forms a batch alone
                     layout="padded" if mode == "padded" else "packed")
    if mode not in ("verify", "memmap"):
        cache.ensure_intact()
    held = []  # what each path hands out stays alive until the block ends, as a caller's would
    with bw.PeakMemory() as peak:
        if mode == "memmap":
            mm = np.memmap(folder / "raw" / "shard-r00000-000000.bin", dtype=np.uint16, mode="r",
                           shape=(tokens, len(bw.LAYERS), bw.HIDDEN))
            held.append(tensor(np.array(mm)))
        elif mode == "getitem":
            held.append(tensor(cache["long-00000000"].hidden))
        elif mode == "read_into":
            out = cache.padded_hidden([tokens])[0]
            held.append(cache.shards[0].read(0, out=out))
        elif mode == "sequences":
            held.extend(tensor(r.hidden) for r in cache.sequences())
        elif mode in ("packed", "padded"):
            batch = load_batch(cache, cfg, [(0, 0)], epoch=0, draft_positions=DRAFT_POSITIONS)
            assert batch.num_tokens == tokens
            held.append(batch)
        elif mode == "loader":
            state = LoaderState(seed=cfg.seed, manifest_fingerprint=cache.fingerprint)
            for b, batch in enumerate(train_loader(url, None, cfg, state, draft_positions=DRAFT_POSITIONS)):
                held[:] = [batch]  # the trainer holds the batch of its step
                if b == 1:
                    break
        elif mode == "verify":
            report = verify_cache(cache)
            assert not report.bad_shards, report.bad_shards  # (a hand-made cache has no teacher head to verify)
    return peak.result(bytes=seq)


def long_read_rows(tokens: int, tmp: Path, repeat: int) -> list[tuple[str, list[dict]]]:
    """The long sequence's cache (format 2, default StorageConfig) and raw file written once, then
    every read path of LONG_PATHS in its own process, rounds interleaved."""
    shard = bw.long_shard(tokens)
    bw.write_cache([shard], tmp / "cache", sync=False, compression="none")
    bw.write_manifest(tmp / "cache")
    bw.write_raw([shard], tmp / "raw", sync=False)
    del shard
    runs: dict[str, list[dict]] = {label: [] for label in LONG_PATHS}
    args = ["--long-child-tokens", str(tokens), "--hidden", str(bw.HIDDEN), "--long-dir", str(tmp)]
    for _ in range(repeat):
        for label, mode in LONG_PATHS.items():
            time.sleep(bw.SETTLE_S)
            runs[label].append(bw.in_child(__file__, ["--long-child", mode, *args]))
    return list(runs.items())


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=12_000, help="tokens of synthetic data (51.2 KB of hidden states each)")
    ap.add_argument("--quick", action="store_true", help="3,000 tokens, one round: a smoke test")
    ap.add_argument("--repeat", type=int, default=3, help="interleaved rounds; the table shows the best and the median")
    ap.add_argument("--workers", default="0,2", help="DataLoader worker counts for the loader rows")
    ap.add_argument("--hidden", type=int, default=bw.HIDDEN, help="hidden size of the 5 tapped layers (issue 48's check: 4096)")
    ap.add_argument("--tmp", default=str(Path(__file__).resolve().parents[1] / ".bench-tmp"),
                    help="scratch folder on the disk to measure; deleted at the end")
    ap.add_argument("--long-tokens", type=int, default=0,
                    help="instead: one sequence of this many tokens (issue 59: 32768), each read path in its own process, "
                         "with its peak memory")
    ap.add_argument("--long-child", choices=sorted(LONG_PATHS.values()), help=argparse.SUPPRESS)  # one path, in a child
    ap.add_argument("--long-child-tokens", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--long-dir", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    tokens, repeat = (3_000, 1) if args.quick else (args.tokens, args.repeat)
    workers = [int(w) for w in args.workers.split(",") if w.strip()]
    bw.set_width(args.hidden)  # bench_write's data at this width
    if args.long_child:
        print(json.dumps(long_read_child(args.long_child, Path(args.long_dir), args.long_child_tokens)))
        return

    tmp = Path(args.tmp) / f"read-{os.getpid()}"
    tmp.mkdir(parents=True)
    try:
        if args.long_tokens:
            seq = args.long_tokens * bw.HIDDEN_BPT
            print(f"one sequence of {args.long_tokens:,} tokens, {len(bw.LAYERS)} layers x hidden {bw.HIDDEN}: hidden states "
                  f"{seq / 1e9:.2f} GB ({bw.HIDDEN_BPT} B/token), batch_tokens {max(1, args.long_tokens // 4):,}; "
                  f"load average {os.getloadavg()[0]:.2f}")
            bw.print_long_table("one long sequence read, each path in a process of its own (warm page cache)",
                                long_read_rows(args.long_tokens, tmp, args.repeat), seq, "memmap")
            print(f"load average at the end {os.getloadavg()[0]:.2f}")
            return
        shards = bw.make_shards(tokens)
        n_tokens = sum(len(s.input_ids) for s in shards)
        hidden_bytes = n_tokens * bw.HIDDEN_BPT
        bw.write_cache(shards, tmp / "cache", sync=False, compression="none")
        bw.write_manifest(tmp / "cache")
        bw.write_cache(shards, tmp / "v1", sync=False, compression="none", version=1)  # the same rows in format 1
        bw.write_manifest(tmp / "v1", version=1)
        bw.write_raw(shards, tmp / "raw", sync=False)
        bw.write_torch(bw.sample_dicts(shards), tmp / "torch", sync=False)
        url = str(tmp / "cache")
        cfg = DataConfig(batch_tokens=BATCH_TOKENS, heldout_fraction=0.0)
        plan = EpochPlan(open_cache(url), cfg).batches(0)
        train = TrainConfig(cache=url, out="unused", data=cfg, noise=NoiseConfig(schedule="cosine"))  # noise on: its cost is measured
        print(f"data: {n_tokens:,} tokens in {sum(len(s.ids) for s in shards)} sequences, {len(shards)} shard(s), "
              f"{len(plan)} batches of <= {BATCH_TOKENS} tokens; hidden states {hidden_bytes / 1e9:.2f} GB "
              f"({bw.HIDDEN_BPT} B/token); load average {os.getloadavg()[0]:.2f}")

        methods = [
            ("raw np.memmap -> batches", lambda: batches_memmap(shards, tmp / "raw", plan)),
            ("torch.load per sample -> batches", lambda: batches_torch(tmp / "torch", shards, plan)),
            ("dflash load_batch, Zarr read path", lambda: batches_reader(url, cfg, plan, None, zarr_only=True)),
            ("dflash load_batch", lambda: batches_reader(url, cfg, plan, None)),
            ("dflash load_batch, checksums hashed", lambda: batches_reader(url, cfg, plan, None, cold=True)),
            ("dflash load_batch + float32 + noise (CPU)", lambda: batches_reader(url, cfg, plan, train)),
            ("dflash load_batch, format 1", lambda: batches_reader(str(tmp / "v1"), cfg, plan, None, cold=True)),
        ]
        in_order = [(s, i) for s, shard in enumerate(shards) for i in range(len(shard.ids))]
        shuffled = [in_order[k] for k in np.random.default_rng(1).permutation(len(in_order))]
        ids = [shards[s].ids[i] for s, i in shuffled]
        sequential = [("raw np.memmap -> a tensor a sequence", lambda: records_memmap(shards, tmp / "raw", in_order)),
                      ("format 2 sequences()", lambda: records_sequential(url)),
                      ("format 1 sequences()", lambda: records_sequential(str(tmp / "v1")))]
        by_id = [("raw np.memmap, random order", lambda: records_memmap(shards, tmp / "raw", shuffled)),
                 ("format 2 cache[id], random order", lambda: records_by_id(url, ids)),
                 ("format 1 cache[id], random order", lambda: records_by_id(str(tmp / "v1"), ids))]
        everything = methods + sequential + by_id
        times: dict[str, list[tuple[float, float]]] = {}
        for r in range(repeat):
            for label, fn in everything[r % len(everything):] + everything[:r % len(everything)]:
                wall, cpu, n = timed(fn)
                assert n == n_tokens, (label, n, n_tokens)
                times.setdefault(label, []).append((wall, cpu))
        print_table(times, methods, n_tokens, hidden_bytes)
        print("\nthe public reader, each record's hidden states to a contiguous tensor (every reader row checks "
              "its crc32c / checksums afresh, as a new process does)")
        print_table(times, sequential, n_tokens, hidden_bytes)
        print_table(times, by_id, n_tokens, hidden_bytes)

        # the loader over 4 epochs, first batch excluded (worker start-up), as tokens/s against memmap's
        memmap_tps = n_tokens / min(w for w, _ in times[methods[0][0]])
        print(f"\n{'steady-state loader (4 epochs, first batch excluded)':<54} {'tok/s':>8} {'(med)':>8} {'x memmap':>8}")
        for w in workers:
            wcfg = DataConfig(batch_tokens=BATCH_TOKENS, heldout_fraction=0.0, num_workers=w)
            rates = []
            for _ in range(repeat):
                time.sleep(bw.SETTLE_S)
                seconds, n = batches_loader(url, wcfg, 4 * len(plan))
                rates.append(n / seconds)
            print(f"{f'dflash train_loader, {w} workers':<54} {max(rates):8,.0f} {np.median(rates):8,.0f} "
                  f"{max(rates) / memmap_tps:7.2f}x")
        ours, philox = min(noise_ns_per_draw(min(n_tokens, 2048)) for _ in range(repeat))
        print(f"\nnoise on this CPU: add_noise_ {ours:.2f} ns a draw; numpy Philox into float32 {philox:.2f} ns a draw "
              f"({philox / ours:.2f}x ours); {(len(bw.LAYERS) - 1) * bw.HIDDEN:,} draws a token")
        print(f"load average at the end {os.getloadavg()[0]:.2f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        with contextlib.suppress(OSError):
            Path(args.tmp).rmdir()


def print_table(times, methods, n_tokens: int, hidden_bytes: int) -> None:
    base = [w for w, _ in times[methods[0][0]]]
    head = (f"{'method':<42} {'GB/s':>6} {'(med)':>6} {'tok/s':>8} {'(med)':>8} {'x memmap':>8} {'(med)':>6} "
            f"{'CPU s':>6}  wall s per round")
    print("\n" + head + "\n" + "-" * len(head))
    for label, _ in methods:
        walls = [w for w, _ in times[label]]
        best, med = min(walls), float(np.median(walls))
        cpu = float(np.median([c for _, c in times[label]]))
        print(f"{label:<42} {hidden_bytes / best / 1e9:6.2f} {hidden_bytes / med / 1e9:6.2f} {n_tokens / best:8,.0f} "
              f"{n_tokens / med:8,.0f} {min(base) / best:7.2f}x {np.median(base) / med:5.2f}x {cpu:6.2f}  "
              f"{' '.join(f'{w:.2f}' for w in walls)}")
    print("GB/s = hidden-state bytes as stored (bf16) / wall seconds, best and (median) round; x memmap = the memmap "
          "row's time / this row's time;\nCPU s = median CPU seconds of this process (DataLoader workers are other "
          "processes and not counted)")


if __name__ == "__main__":
    main()
