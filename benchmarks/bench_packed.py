"""Packed against padded training batches (issue #27): how much of a padded batch is padding, and
the training step's speed and peak memory in each layout (`data.layout`).

Part 1, padding fraction (padded positions / all positions of the epoch's right-padded batches;
a packed batch has none), from the epoch plan alone: the quickstart cache, the man-page corpus
(a cache when given, else the corpus tokenized exactly as `dflash-cache build` does, which is
all the padding depends on) and a synthetic corpus with a ShareGPT-like spread (log-normal
lengths clipped to 50..4,096 tokens), each at its own batch size and at the default 8,192.

Part 2, step speed: the trainer's step (`trainer.micro_step`: forward, loss, backward, then clip
and AdamW) on the same batches in both layouts, each (shape, layout, round) in a fresh
subprocess so its peak memory is its own (bench_trainer.py's method: VmHWM reset after a
warm-up step; on CUDA torch.cuda.max_memory_allocated), rounds interleaved. Shapes: the
quickstart's drafter on the quickstart cache's own batches; production width (hidden 5,120, 5
tapped layers, bench_trainer's drafter) on synthetic sequences of the ShareGPT-like spread.

    .venv/bin/python benchmarks/bench_packed.py --quickstart-cache CACHE [--manpage-cache CACHE]
    .venv/bin/python benchmarks/bench_packed.py --tiny     # a smoke test (seconds)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from bench_trainer import _reset_peak_rss, _status_bytes, drafter, synthetic_sequences  # noqa: E402

from dflash_cache import open_cache  # noqa: E402
from dflash_train.settings.data_config import LAYOUTS, DataConfig  # noqa: E402
from dflash_train.settings.model_config import ModelConfig  # noqa: E402
from dflash_train.settings.train_config import TrainConfig  # noqa: E402
from dflash_train.training.batch import load_batch  # noqa: E402
from dflash_train.training.batch_objective import batch_loss  # noqa: E402
from dflash_train.training.distributed import DistInfo  # noqa: E402
from dflash_train.training.epoch_plan import EpochPlan, cut_batches, epoch_order  # noqa: E402
from dflash_train.training.layout import padding_fraction  # noqa: E402
from dflash_train.training.session import build_drafter  # noqa: E402
from dflash_train.training.train_step import micro_step  # noqa: E402

RESULT_TAG = "RESULT "
SHAREGPT = dict(median=450, sigma=1.1, low=50, high=4096)  # log-normal lengths, clipped


def sharegpt_lengths(count: int, seed: int = 0) -> np.ndarray:
    """Sequence lengths with a ShareGPT-like spread: log-normal (median 450, sigma 1.1), clipped to 50..4,096."""
    rng = np.random.default_rng(seed)
    raw = rng.lognormal(np.log(SHAREGPT["median"]), SHAREGPT["sigma"], count)
    return np.clip(raw, SHAREGPT["low"], SHAREGPT["high"]).astype(np.int64)


def plan_lengths(lengths: np.ndarray, batch_tokens: int, seed: int = 0) -> list[list[int]]:
    """The lengths of each batch of one epoch, ordered and cut as the trainer's plan does."""
    order = epoch_order([len(lengths)], seed, 0)
    return [[int(lengths[i]) for _, i in b] for b in cut_batches(order, [lengths], batch_tokens)]


def cache_batches(url: str, batch_tokens: int, heldout_fraction: float = 0.05) -> tuple[np.ndarray, list[list[int]]]:
    """A cache's training-split lengths and epoch 0's batches of lengths, as the trainer plans them."""
    cache = open_cache(url)
    plan = EpochPlan(cache, DataConfig(batch_tokens=batch_tokens, heldout_fraction=heldout_fraction))
    return plan.lengths[plan.rows], [[plan.length(s, i) for s, i in b] for b in plan.batches(0)]


def corpus_lengths(data: str, tokenizer_dir: str) -> np.ndarray:
    """Token counts of a corpus's sequences as `dflash-cache build` tokenizes them (no teacher run)."""
    from transformers import AutoTokenizer

    from dflash_build.tokens import tokenize_row
    from dflash_corpus import CorpusConfig, iter_rows

    cfg = CorpusConfig(data=data)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    out = [len(r.input_ids) for r in (tokenize_row(row, tokenizer, cfg) for row in iter_rows(cfg) if row.problem is None)
           if not isinstance(r, str)]
    return np.array(out, dtype=np.int64)


def padding_table(sources: list[tuple[str, np.ndarray, dict[int, list[list[int]]]]]) -> None:
    """One row per (data, batch tokens): its epoch-0 batches' padding fraction, padded and packed."""
    print(f"{'data':<44} {'sequences':>9} {'mean len':>8} {'max len':>7} {'batch tokens':>12} {'batches':>7} "
          f"{'seqs/batch':>10} {'padded: padding':>15} {'packed':>6}")
    for name, lengths, by_size in sources:
        for batch_tokens, batches in by_size.items():
            print(f"{name:<44} {len(lengths):>9,} {lengths.mean():>8.0f} {lengths.max():>7} {batch_tokens:>12,} "
                  f"{len(batches):>7,} {len(lengths) / len(batches):>10.1f} {padding_fraction(batches):>15.1%} {0:>6.0%}")


# --- one (shape, layout) measurement, in its own process ---------------------------------------------------


def quickstart_setup(args):
    cache = open_cache(args.quickstart_cache)
    cfg = TrainConfig(cache=args.quickstart_cache, out="", model=ModelConfig(num_layers=3, block_size=8),
                      data=DataConfig(batch_tokens=1600, anchors="random", num_anchors=8, heldout_fraction=0.05))
    model = build_drafter(cfg, cache, torch.device("cpu"))
    refs = EpochPlan(cache, cfg.data).batches(0)[: args.batches]
    return cfg, model, {layout: [load_batch(cache, replace(cfg.data, layout=layout), r, 0) for r in refs]
                        for layout in LAYOUTS}


def production_setup(args):
    cfg = TrainConfig(cache="", out="", model=ModelConfig(block_size=16))
    model = drafter(args.prod_vocab, args.prod_hidden, args.prod_layers, 5, 16, torch.device("cpu"))
    # full-length sequences (scaling them down would inflate the blocks' share of the step next to
    # the context's), cut at prod_batch_tokens: less padding than the default 8,192 has
    batches = plan_lengths(sharegpt_lengths(4000, seed=1), args.prod_batch_tokens)
    # the batches whose padding is nearest the spread's median padding: a typical batch, not a lucky one
    median = statistics.median(padding_fraction([b]) for b in batches)
    typical = sorted(batches, key=lambda b: abs(padding_fraction([b]) - median))[: args.batches]
    return cfg, model, {layout: [synthetic_sequences(b, args.prod_vocab, 5, args.prod_hidden, 64, 8, seed=i, layout=layout)
                                 for i, b in enumerate(typical)] for layout in LAYOUTS}


def run_worker(args) -> dict:
    """Both layouts in one process on one model, their steps alternating round by round, so the
    machine's load falls on both alike; each step's peak RSS is read on its own."""
    torch.set_num_threads(args.threads)
    cfg, model, batches = (quickstart_setup if args.shape == "quickstart" else production_setup)(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optim.lr, betas=cfg.optim.betas)
    autocast = torch.autocast("cpu", enabled=False)

    def step(batch):
        out = micro_step(model, model, batch, cfg, DistInfo(), torch.device("cpu"), autocast)
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optim.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return out

    with torch.no_grad():  # the same weights, the same batch: the two layouts' losses side by side
        first = {layout: float(batch_loss(model, b[0], cfg.loss).loss) for layout, b in batches.items()}
    for layout in LAYOUTS:  # warm-up: allocates gradients and AdamW state
        step(batches[layout][0])
    seconds = {layout: [] for layout in LAYOUTS}
    peaks = {layout: [] for layout in LAYOUTS}
    for rnd in range(args.rounds):
        # alternate the order so neither layout always runs right after the other
        for layout in (LAYOUTS if rnd % 2 else LAYOUTS[::-1]):
            total = 0.0
            for batch in batches[layout]:
                before = _status_bytes("VmRSS")
                reset = _reset_peak_rss()
                start = time.perf_counter()
                step(batch)
                total += time.perf_counter() - start
                peaks[layout].append((_status_bytes("VmHWM") if reset else float("nan")) - before)
            seconds[layout].append(total)
    return {layout: {"seconds": seconds[layout], "step_peak": max(peaks[layout]), "first_loss": first[layout],
                     "tokens": sum(b.num_tokens for b in batches[layout]),
                     "row_positions": sum(int(b.input_ids.numel()) for b in batches[layout])} for layout in LAYOUTS}


def spawn(args, shape: str) -> dict:
    cmd = [sys.executable, __file__, "--worker", "--shape", shape]
    for name in ("quickstart_cache", "batches", "rounds", "threads", "prod_hidden", "prod_vocab", "prod_layers",
                 "prod_batch_tokens"):
        value = getattr(args, name)
        if value is not None:
            cmd += [f"--{name.replace('_', '-')}", str(value)]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_=str(2**20), OMP_NUM_THREADS=str(args.threads))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_TAG):
            return json.loads(line[len(RESULT_TAG):])
    return {"error": f"exit {proc.returncode}: {(proc.stderr.strip().splitlines() or ['no output'])[-1]}"}


def speed_table(args, results: dict) -> None:
    print(f"{'shape':<11} {'layout':<7} {'tokens/step':>11} {'row positions':>13} {'tok/s best':>10} {'(med)':>8} "
          f"{'x padded':>8} {'(med)':>6} {'step peak MiB':>13} {'x padded':>8} {'first loss':>11}")
    for shape, res in results.items():
        if "error" in res:
            print(f"{shape:<11} {res['error']}")
            continue
        base = res["padded"]
        base_rates = [base["tokens"] / t for t in base["seconds"]]
        for layout in ("padded", "packed"):
            r = res[layout]
            rates = [r["tokens"] / t for t in r["seconds"]]
            n = args.batches
            print(f"{shape:<11} {layout:<7} {r['tokens'] / n:>11,.0f} {r['row_positions'] / n:>13,.0f} "
                  f"{max(rates):>10,.0f} {statistics.median(rates):>8,.0f} {max(rates) / max(base_rates):>8.2f} "
                  f"{statistics.median(rates) / statistics.median(base_rates):>6.2f} {r['step_peak'] / 2**20:>13,.1f} "
                  f"{r['step_peak'] / base['step_peak']:>8.2f} {r['first_loss']:>11.6f}")
    print("tokens/step = real tokens; row positions = positions the context projections run on (padded: rows x "
          "longest); tok/s = real tokens / step time, best round and (median); step peak = the largest peak RSS of "
          "one step minus the RSS before it; first loss = both layouts' loss on the same first batch and weights")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quickstart-cache", help="the quickstart cache (examples/quickstart.sh's demo/cache)")
    parser.add_argument("--manpage-cache", help="the man-page cache; without it the man-page corpus is tokenized")
    parser.add_argument("--manpage-corpus", default=str(ROOT / "examples" / "data" / "manpages.jsonl"))
    parser.add_argument("--manpage-tokenizer", default=str(ROOT / "examples" / "manpage_teacher"))
    parser.add_argument("--shapes", default="quickstart,production")
    parser.add_argument("--batches", type=int, default=6, help="timed batches a round (after one warm-up step each)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prod-hidden", type=int, default=5120)
    parser.add_argument("--prod-vocab", type=int, default=32768)
    parser.add_argument("--prod-layers", type=int, default=1)
    parser.add_argument("--prod-batch-tokens", type=int, default=2048)
    parser.add_argument("--tiny", action="store_true", help="a seconds-long smoke test")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--shape", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(RESULT_TAG + json.dumps(run_worker(args)), flush=True)
        return
    if args.tiny:
        args.prod_hidden, args.prod_vocab, args.batches, args.rounds = 64, 512, 1, 1
    args.shapes = [s for s in args.shapes.split(",") if s and (s != "quickstart" or args.quickstart_cache)]

    started = time.perf_counter()
    sources = []
    for name, url, own in (("quickstart cache", args.quickstart_cache, 1600), ("man-page cache", args.manpage_cache, 1000)):
        if url:  # the trainer's own plan (held-out fraction 0.05, as both runs use)
            lengths = cache_batches(url, own)[0]
            sources.append((name, lengths, {size: cache_batches(url, size)[1] for size in (own, 8192)}))
    if not args.manpage_cache and not args.tiny:
        lengths = corpus_lengths(args.manpage_corpus, args.manpage_tokenizer)
        sources.append(("man-page corpus (tokenized as the build does)", lengths,
                        {size: plan_lengths(lengths, size) for size in (1000, 8192)}))
    lengths = sharegpt_lengths(20000)
    sources.append((f"synthetic log-normal {SHAREGPT['low']}..{SHAREGPT['high']}", lengths,
                    {size: plan_lengths(lengths, size) for size in (2048, 8192)}))
    print("## padding fraction (padded positions / all positions, epoch 0's batches)")
    padding_table(sources)

    print(f"\n## step speed, {args.batches} timed batch(es) a round, {args.rounds} round(s), {args.threads} thread(s)")
    results = {}
    for shape in args.shapes:
        results[shape] = spawn(args, shape)
        print(f"# {shape}: done after {time.perf_counter() - started:.0f} s", flush=True)
    speed_table(args, results)
    print(f"total wall time {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
