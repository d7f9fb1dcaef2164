"""Training step cost against sequence length (issue 59): time per trained position and peak
memory for sequences of 512 to 32,768 tokens at a fixed per-micro-batch budget, with the default
anchors (data.anchors cover: every loss position trained once).

Each micro-batch holds batch_tokens of sequence tokens (several sequences packed end to end up to
8,192 tokens; a longer sequence alone); its blocks run in the forwards that `Batch.parts` cuts
under data.block_tokens and the attention-area budget, each attending only to the context before
its own last anchor (the dense SDPA path on CPU), exactly as `train_step.step_gradients` runs
them: loss scaled by each part's share of the valid positions, one backward a part. The baseline
row of each length is the same batch in ONE forward (no parts, every block seeing every key of
its sequence: what the trainer did before parts existed). Each (length, mode, round) runs in a
fresh subprocess so its peak RSS (VmHWM, reset after the inputs are built) is its own.

The table also fits time per trained position = a + b x T (least squares over the lengths): with
the blocks attending to their own prefix, no term should grow faster than linearly in T; peak
memory over the budget is reported beside it.

    .venv/bin/python benchmarks/bench_long.py                 # 512..32,768, 2 rounds (~15 min alone)
    .venv/bin/python benchmarks/bench_long.py --quick         # 512..2,048 at a tiny width (seconds)

The flex path (model.attention_backend flex, compiled, the default on CUDA) has no backward on
CPU; it needs a GPU (benchmarks/gpu_check.sh) and is not measured here.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from bench_trainer import _reset_peak_rss, _status_bytes, drafter, synthetic_sequences  # noqa: E402

from dflash_train.settings.data_config import PACKED, DataConfig  # noqa: E402
from dflash_train.settings.loss_config import LossConfig  # noqa: E402
from dflash_train.training.batch_objective import batch_loss, block_targets  # noqa: E402

RESULT_TAG = "RESULT "
LENGTHS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
QUICK_LENGTHS = (512, 1024, 2048)


def run_worker(args) -> dict:
    """One step of one (length, mode) in this process: its seconds, positions and peak RSS growth."""
    torch.set_num_threads(args.threads)
    block_size = args.block_size
    model = drafter(args.vocab, args.hidden, args.layers, args.tapped, block_size, "cpu")
    per_batch = max(1, args.batch_tokens // args.length)
    lengths = [args.length] * per_batch
    batch = synthetic_sequences(lengths, args.vocab, args.tapped, args.hidden, 8, 0, seed=1, layout=PACKED,
                                cover=model.cfg.num_draft_positions)
    batch = batch.to("cpu")
    data = DataConfig(batch_tokens=args.batch_tokens, block_tokens=args.block_tokens)
    spans = batch.parts(block_size, data) if args.mode == "parts" else [None]
    loss_cfg = LossConfig()
    counts = [int(block_targets(batch.columns(s), block_size)["valid"].sum()) for s in spans]

    def step() -> None:
        for span, count in zip(spans, counts):
            out = batch_loss(model, batch.columns(span), loss_cfg)
            (out.loss * (count / sum(counts))).backward()
        model.zero_grad(set_to_none=True)

    step()  # warm-up: allocator pools, thread pools
    baseline = _status_bytes("VmRSS")
    reset = _reset_peak_rss()
    started = time.perf_counter()
    for _ in range(args.steps):
        step()
    seconds = (time.perf_counter() - started) / args.steps
    peak = _status_bytes("VmHWM") if reset else 0
    return {"length": args.length, "mode": args.mode, "seconds": seconds, "positions": sum(counts),
            "tokens": sum(lengths), "parts": len(spans), "peak_growth": max(0, peak - baseline) if reset else None}


def spawn(args, length: int, mode: str) -> dict:
    command = [sys.executable, __file__, "--worker", "--length", str(length), "--mode", mode,
               *(f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                 if k in ("hidden", "layers", "tapped", "vocab", "block_size", "batch_tokens", "block_tokens",
                          "threads", "steps"))]
    out = subprocess.run(command, capture_output=True, text=True, check=False)
    for line in out.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    raise RuntimeError(f"worker {length} {mode} failed:\n{out.stderr[-3000:]}")


def fit_linear(lengths: list[int], values: list[float]) -> tuple[float, float]:
    """(a, b) of values ~ a + b x length, least squares."""
    b, a = np.polyfit(np.asarray(lengths, dtype=float), np.asarray(values, dtype=float), 1)
    return float(a), float(b)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--length", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=("parts", "one"), help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="512..2,048 tokens at a tiny width (a smoke test)")
    parser.add_argument("--lengths", type=str, default=None, help="comma-separated sequence lengths")
    parser.add_argument("--one-forward-up-to", type=int, default=16384,
                        help="the longest length whose one-forward baseline runs (its mask grows with T^2)")
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2, help="drafter layers")
    parser.add_argument("--tapped", type=int, default=3, help="tapped teacher layers")
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--batch-tokens", type=int, default=8192)
    parser.add_argument("--block-tokens", type=int, default=0, help="data.block_tokens (0: its default, 1.25 x batch tokens)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=1, help="timed steps a round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", type=str, default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.worker:
        print(RESULT_TAG + json.dumps(run_worker(args)), flush=True)
        return
    if args.quick:
        args.hidden, args.vocab, args.batch_tokens, args.rounds = 32, 512, 2048, 1
    lengths = [int(x) for x in args.lengths.split(",")] if args.lengths else list(QUICK_LENGTHS if args.quick else LENGTHS)
    if args.quick:
        lengths = [t for t in lengths if t <= 2048]
    rows: dict[tuple[int, str], list[dict]] = {}
    for _ in range(args.rounds):  # rounds interleaved, so drift on a shared machine hits every row alike
        for length in lengths:
            for mode in ("parts", "one"):
                if mode == "one" and length > args.one_forward_up_to:
                    continue
                rows.setdefault((length, mode), []).append(spawn(args, length, mode))
    print(f"Training step against sequence length: drafter {args.layers} layers x hidden {args.hidden}, "
          f"{args.tapped} tapped layers, vocab {args.vocab}, block {args.block_size}, batch_tokens {args.batch_tokens}, "
          f"block_tokens {DataConfig(batch_tokens=args.batch_tokens, block_tokens=args.block_tokens).forward_tokens}, cover anchors, dense SDPA on CPU, "
          f"{args.threads} threads, best of {args.rounds} rounds")
    print(f"{'tokens':>7} {'seqs':>4} {'parts':>5} {'positions':>9} {'us/position':>11} {'peak MB':>8} "
          f"{'one fwd us/pos':>14} {'one fwd MB':>10} {'parts/one time':>14}")
    table = []
    for length in lengths:
        best = min(rows[(length, "parts")], key=lambda r: r["seconds"])
        one = min(rows[(length, "one")], key=lambda r: r["seconds"]) if (length, "one") in rows else None
        per = best["seconds"] / best["positions"] * 1e6
        mb = (best["peak_growth"] or 0) / 2**20
        one_per = one["seconds"] / one["positions"] * 1e6 if one else None
        one_mb = (one["peak_growth"] or 0) / 2**20 if one else None
        print(f"{length:>7,} {best['tokens'] // length:>4} {best['parts']:>5} {best['positions']:>9,} {per:>11.2f} {mb:>8.0f} "
              + (f"{one_per:>14.2f} {one_mb:>10.0f} {best['seconds'] / one['seconds']:>13.2f}x" if one else f"{'-':>14} {'-':>10} {'-':>14}"))
        table.append({"length": length, "parts": best, "one": one, "us_per_position": per, "peak_mb": mb})
    a, b = fit_linear(lengths, [r["us_per_position"] for r in table])
    print(f"fit: us/position = {a:.2f} + {b * 1000:.4f} x (T / 1000)  (linear in T: a block attends to its prefix)")
    quad = np.polyfit(np.asarray(lengths, float), [r["us_per_position"] for r in table], 2) if len(lengths) > 2 else None
    if quad is not None:
        print(f"quadratic term of a degree-2 fit: {quad[0] * 1e6:.5f} x (T / 1000)^2 us (about 0 when no term grows faster than T)")
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
