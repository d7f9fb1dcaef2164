"""How sure each study cache's teacher is of its own answers (issue 54): per-token answer entropy.

Run from the repository root:

    python examples/cache_entropy.py [--out recipe] [--caches quickstart,manpages,varied,hybrid]

Builds (or reuses) each of examples/recipe.py's caches under OUT/caches, the varied and hybrid ones
from their teachers' regenerated answers (stage 0, under OUT/data), and prints one markdown row per
cache: sequences, answer tokens, size on disk, the mean entropy of the teacher's next-token
distribution over the answer positions (top-k renormalised: benchmarks/bench_peer.answer_entropy,
a lower bound on the full distribution's), the share of answer positions whose top-1 holds at least
90% of that mass, and the first sequence's answer as the cache holds it.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "benchmarks"))

import recipe  # noqa: E402

SPECS = {spec.name: spec for spec in recipe.CACHES}


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def confident_share(cache_url: str, threshold: float = 0.9) -> float:
    """The share of answer positions whose renormalised top-1 probability is at least `threshold`:
    how often the teacher is sure, beside the entropy's mean (which its branch points dominate)."""
    import numpy as np

    from dflash_cache import open_cache

    sure, count = 0, 0
    for record in open_cache(cache_url).sequences():
        logprobs = record.topk_logprobs[np.asarray(record.loss_mask, dtype=bool)].astype(np.float64)
        p = np.exp(logprobs - logprobs.max(axis=1, keepdims=True))
        top1 = p.max(axis=1) / p.sum(axis=1)
        sure += int((top1 >= threshold).sum())
        count += len(top1)
    return sure / max(count, 1)


def first_answer(cache_url: str, teacher: Path) -> str:
    """The first sequence's first answer (its loss-masked tokens up to the first end of turn),
    decoded with the teacher's tokenizer."""
    import numpy as np
    from transformers import AutoTokenizer

    from dflash_cache import open_cache

    record = next(iter(open_cache(cache_url).sequences()))
    ids = np.asarray(record.input_ids)[np.asarray(record.loss_mask, dtype=bool)]
    tokenizer = AutoTokenizer.from_pretrained(str(teacher))
    return tokenizer.decode(ids.tolist()).split(tokenizer.eos_token)[0]


def cache_row(name: str, settings: recipe.RecipeSettings) -> str:
    """One markdown row of the table (builds the cache first when it is missing)."""
    from bench_peer import answer_entropy

    from dflash_cache import open_cache

    spec = SPECS[name]
    teacher = spec.teacher or recipe.ensure_manpage_teacher(settings)
    url = recipe.build(spec, teacher, settings)
    records = list(open_cache(url).sequences())
    tokens = sum(int(r.loss_mask.sum()) for r in records)
    entropy = answer_entropy(url, limit=len(records))
    sample = first_answer(url, teacher).replace("\n", " ").replace("|", "\\|")
    return (f"| {name} | {len(records):,} | {tokens:,} | {folder_bytes(Path(url)) / 2**20:.1f} MiB | {entropy:.3f} | "
            f"{confident_share(url):.0%} | {sample[:200]} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=recipe.RecipeSettings.out)
    parser.add_argument("--caches", default=",".join(SPECS))
    args = parser.parse_args(argv)
    settings = recipe.RecipeSettings(out=args.out)
    print("| cache | sequences | answer tokens | size | answer entropy (nats/token) | top-1 >= 0.9 | first answer |")
    print("|---|---:|---:|---:|---:|---:|---|")
    for name in args.caches.split(","):
        print(cache_row(name, settings), flush=True)


if __name__ == "__main__":
    main()
