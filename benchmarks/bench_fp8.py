"""fp8 e4m3 hidden-state storage against lossless bf16, on a real cache.

    .venv/bin/python benchmarks/bench_fp8.py --bf16 demo/cache [--fp8 /tmp/fp8demo/cache]
        [--run bf16=demo/run/eval.json --run fp8=/tmp/fp8demo/run/eval.json ...]

1. Quantisation error per tapped layer, ||decoded - bf16|| / ||bf16|| over every stored value of
   the bf16 cache, for the shipped encoding (power-of-two scale per token per layer) and the
   alternatives: exact max/448 scales per token per layer, power-of-two scales per 1x32 block,
   one power-of-two scale per token for all layers. Also whether the bf16 decode equals the
   float32 decode bit for bit.
2. With --fp8 (a cache built from the same corpus): bytes per token of both caches, the error of
   what the fp8 cache's reader returns against the bf16 cache (same ids), whether it is exactly
   the quantiser's decode of the bf16 values (true when both builds batched the teacher alike),
   and the read time of every hidden state through Shard.read_hidden, fp8 against bf16 in the
   same run.
3. With --run: held-out loss and tau of eval.json reports, side by side.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import ml_dtypes
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dflash_cache import open_cache
from dflash_cache.format import fp8  # noqa: E402


def exact_scale_roundtrip(x: np.ndarray) -> np.ndarray:
    """The alternative: scale = max|row| / 448 (float32), decoded in float32."""
    t = torch.from_numpy(np.asarray(x, np.float32))
    amax = t.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / fp8.E4M3_MAX, torch.ones_like(amax))
    codes = (t / scale).clamp(-fp8.E4M3_MAX, fp8.E4M3_MAX).to(torch.float8_e4m3fn)
    return (codes.float() * scale).numpy()


def pow2_roundtrip(x: np.ndarray, block: int | None = None, per_token: bool = False) -> np.ndarray:
    t, n_layers, h = x.shape
    shaped = x.reshape(t, 1, n_layers * h) if per_token else x.reshape(t, n_layers, h // block, block) if block else x
    return fp8.dequantize(*fp8.quantize(np.ascontiguousarray(shaped)), "float32").reshape(x.shape)


class ErrorSums:
    """Accumulates per-layer squared error and squared norm."""

    def __init__(self, n_layers: int):
        self.err, self.ref = np.zeros(n_layers), np.zeros(n_layers)

    def add(self, approx: np.ndarray, exact: np.ndarray) -> None:
        a, b = np.asarray(approx, np.float64), np.asarray(exact, np.float64)
        self.err += np.square(a - b).sum(axis=(0, 2))
        self.ref += np.square(b).sum(axis=(0, 2))

    def relative(self) -> np.ndarray:
        return np.sqrt(self.err / self.ref)


def quantisation_errors(cache) -> None:
    n_layers, h = len(cache.layer_ids), cache.hidden_size
    variants = {"pow2 scale per token per layer (shipped)": lambda x: fp8.dequantize(*fp8.quantize(x), "float32"),
                "exact max/448 scale per token per layer": exact_scale_roundtrip,
                "pow2 scale per 1x32 block": lambda x: pow2_roundtrip(x, block=32),
                "pow2 scale per token (all layers)": lambda x: pow2_roundtrip(x, per_token=True)}
    sums = {name: ErrorSums(n_layers) for name in variants}
    values = tokens = mismatched = 0
    seconds = {"quantize": 0.0, "dequantize": 0.0}
    for shard in cache.shards:
        x = shard.read_hidden(0, int(shard.record["tokens"]))
        t0 = time.perf_counter()
        codes, exponents = fp8.quantize(x)
        t1 = time.perf_counter()
        as_bf16 = fp8.dequantize(codes, exponents, "bfloat16")
        seconds["quantize"] += t1 - t0
        seconds["dequantize"] += time.perf_counter() - t1
        mismatched += int(np.count_nonzero(as_bf16.astype(np.float32) != fp8.dequantize(codes, exponents, "float32")))
        for name, roundtrip in variants.items():
            sums[name].add(roundtrip(x), x)
        values += x.size
        tokens += len(x)
    print(f"## quantisation error on {cache.url}: {tokens:,} tokens, layers {cache.layer_ids}, hidden {h}\n")
    print("| encoding | " + " | ".join(f"layer {i}" for i in cache.layer_ids) + " |")
    print("|---|" + "---|" * n_layers)
    for name, s in sums.items():
        print(f"| {name} | " + " | ".join(f"{e:.4f}" for e in s.relative()) + " |")
    print(f"\nbf16 decode != float32 decode: {mismatched} of {values:,} values")
    print(f"quantize {values / seconds['quantize'] / 1e6:,.0f} M values/s, dequantize to bf16 "
          f"{values / seconds['dequantize'] / 1e6:,.0f} M values/s (one thread: OMP_NUM_THREADS={torch.get_num_threads()})\n")


def synthetic_outliers(tokens: int = 512, width: int = 5120, seed: int = 0) -> None:
    """Production width with "massive activations": two channels far above the rest, which the
    tiny teacher lacks. Per-row scales push the other values of such a row towards e4m3's
    subnormals; 1x128 blocks confine that to the outliers' blocks."""
    rng = np.random.default_rng(seed)
    print(f"## synthetic rows, width {width}, two outlier channels ({tokens} tokens)\n")
    print("| outlier / typical | per row: all values | per row: non-outlier values | 1x128 blocks: all | 1x128 blocks: non-outlier |")
    print("|---|---|---|---|---|")
    for ratio in (1e2, 1e3, 1e4, 1e5):
        x = rng.standard_normal((tokens, 1, width)).astype(np.float32)
        x[:, :, [17, 3001]] *= ratio
        x = x.astype(ml_dtypes.bfloat16).astype(np.float32)
        rest = np.ones(width, bool)
        rest[[17, 3001]] = False
        row, block = pow2_roundtrip(x), pow2_roundtrip(x, block=128)
        cells = [fp8.relative_error(a[..., m], x[..., m])[0] for a in (row, block) for m in (slice(None), rest)]
        print(f"| {ratio:.0e} | " + " | ".join(f"{c:.4f}" for c in cells) + " |")
    print()


def hidden_zarr_bytes(cache) -> int:
    return sum(int(size) for s in cache.shards for name, size in s.record["files"].items() if name.startswith("hidden.zarr/c/"))


def read_all(cache) -> float:
    start = time.perf_counter()
    for shard in cache.shards:
        n = int(shard.record["tokens"])
        window = max(1, 64 * 2**20 // cache.hidden_bytes_per_token)
        for lo in range(0, n, window):
            shard.read_hidden(lo, min(n, lo + window))
    return time.perf_counter() - start


def compare_caches(bf16, lossy, repeat: int) -> None:
    print(f"## {lossy.url} ({lossy.hidden_format}) against {bf16.url} ({bf16.hidden_format})\n")
    print("| cache | tokens | shards | bytes/token (all files) | hidden.zarr bytes/token |")
    print("|---|---|---|---|---|")
    for c in (bf16, lossy):
        t = c.manifest["totals"]
        print(f"| {c.hidden_format} | {t['tokens']:,} | {t['shards']} | {t['bytes'] / t['tokens']:,.1f} | "
              f"{hidden_zarr_bytes(c) / t['tokens']:,.1f} |")
    n_layers = len(bf16.layer_ids)
    sums, exact_rows, rows = ErrorSums(n_layers), 0, 0
    reference = {r.id: r.hidden for r in bf16.sequences()}
    for rec in lossy.sequences():
        x = reference[rec.id]
        sums.add(rec.hidden, x)
        exact_rows += bool(np.array_equal(rec.hidden.view(np.uint16), fp8.dequantize(*fp8.quantize(x)).view(np.uint16)))
        rows += 1
    print("\nrelative error of what the fp8 reader returns, per layer: "
          + ", ".join(f"layer {i} {e:.4f}" for i, e in zip(bf16.layer_ids, sums.relative())))
    print(f"sequences whose fp8 values are exactly quantize(bf16 values): {exact_rows} of {rows}")
    times = {c.hidden_format: [] for c in (bf16, lossy)}
    for _ in range(repeat):  # interleaved rounds, best of each
        for c in (bf16, lossy):
            times[c.hidden_format].append(read_all(c))
    best = {k: min(v) for k, v in times.items()}
    tokens = bf16.manifest["totals"]["tokens"]
    print(f"read every hidden state via Shard.read_hidden (warm page cache, best of {repeat}): "
          + ", ".join(f"{k} {v:.3f} s ({tokens / v / 1e6:.2f} M tokens/s)" for k, v in best.items())
          + f"; fp8 / lossless time {best[lossy.hidden_format] / best[bf16.hidden_format]:.2f}x\n")


def runs_table(runs: list[str]) -> None:
    print("## drafter evaluations\n")
    print("| run | held-out loss | offline tau | offline tau (greedy streak) | greedy replay | "
          "real accepted length | kept per forward | output = teacher greedy |")
    print("|---|---|---|---|---|---|---|---|")
    nan = float("nan")
    for spec in runs:
        name, _, path = spec.partition("=")
        report = json.loads(Path(path).read_text())
        o, d = report.get("offline", {}), report.get("decoding", {})
        replay = report.get("greedy_replay", {}).get("accepted_length", nan)
        real = f"{d['accepted_length']:.3f} | {d['kept_per_forward']:.3f} | {'yes' if d['matched_teacher'] else 'NO'}" if d else "- | - | -"
        print(f"| {name} | {o.get('loss', nan):.4f} | {o.get('tau', nan):.3f} | {o.get('tau_greedy', nan):.3f} | "
              f"{replay:.3f} | {real} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bf16", help="a lossless bf16 cache")
    parser.add_argument("--fp8", help="an fp8_e4m3 cache of the same corpus")
    parser.add_argument("--run", action="append", default=[], help="NAME=path/to/eval.json (repeatable)")
    parser.add_argument("--repeat", type=int, default=3, help="rounds of the read timing")
    parser.add_argument("--synthetic", action="store_true", help="also: production-width rows with outlier channels")
    args = parser.parse_args()
    if args.synthetic:
        synthetic_outliers()
    if args.bf16:
        bf16 = open_cache(args.bf16)
        quantisation_errors(bf16)
        if args.fp8:
            compare_caches(bf16, open_cache(args.fp8), args.repeat)
    if args.run:
        runs_table(args.run)


if __name__ == "__main__":
    main()
