"""The frozen LM head in bf16 (loss.head_matmul bf16) against fp32: held-out loss and tau of a
trained drafter, and the head's memory at production size (issue 34).

    python benchmarks/bench_head.py RUN_DIR [--sequences 48]

RUN_DIR is a finished run (its config.json names the cache; its drafter/ is evaluated). On CPU the
bf16 head's numbers are computed from bf16-rounded inputs with fp32 accumulation, what CUDA's
bf16 GEMM with fp32 output computes (up to the order of the sums).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PRODUCTION = {"vocab_size": 248_320, "hidden_size": 5_120}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", type=Path)
    parser.add_argument("--sequences", type=int, default=48)
    args = parser.parse_args(argv)
    import torch

    from dflash_cache import open_cache
    from dflash_train.config import config_from_dict
    from dflash_train.measuring.replay import load_drafter_for
    from dflash_train.training.heldout import evaluate_heldout

    torch.set_num_threads(1)
    cfg = config_from_dict(json.loads((args.run / "config.json").read_text()))
    cache = open_cache(cfg.cache)
    model = load_drafter_for(str(args.run / "drafter"), cache, torch.device("cpu"))
    rows = {}
    for mode in ("fp32", "bf16"):
        rows[mode] = evaluate_heldout(model, cache, cfg.data, replace(cfg.loss, head_matmul=mode), args.sequences,
                              torch.device("cpu"))
    elements = PRODUCTION["vocab_size"] * PRODUCTION["hidden_size"]
    print("| head | held-out loss | tau | Δ loss vs fp32 | Δ tau vs fp32 | head memory at production size |")
    print("|---|---:|---:|---:|---:|---:|")
    for mode, bytes_per in (("fp32", 4), ("bf16", 2)):
        r = rows[mode]
        print(f"| {mode} | {r['loss']:.5f} | {r['tau']:.4f} | {r['loss'] - rows['fp32']['loss']:+.2e} | "
              f"{r['tau'] - rows['fp32']['tau']:+.2e} | {elements * bytes_per / 1e9:.2f} GB |")


if __name__ == "__main__":
    main()
