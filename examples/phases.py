"""Does an on-policy fine-tuning phase raise the real accepted length? (issue 34)

Run from the repository root:

    python examples/phases.py [--out phases] [--first 600] [--second 200] [--seeds 3] [--rows N]

On the recipe study's quickstart cache (examples/recipe.py builds it under OUT/caches), per seed:

    kl            kl (streak weights) for FIRST + SECOND steps: the reference, same total steps
    kl-first      kl for FIRST steps (the first phase; measured too)
    kl>onpolicy   `--init-from` kl-first's drafter, then `onpolicy_kl` for SECOND steps, its own
                  warmup and cosine schedule, the optimizer fresh

at the objectives study's drafter shape (3 layers, B = 8, 1,000-token batches, 8 anchors, lr 1e-3),
then real speculative decoding of held-out prompts in the built-in decoder, greedy and at T = 1
(seeded by the run's seed). OUT/summary.md: means with 95% intervals over seeds, and the
differences from kl paired by seed. Everything resumes: a finished run (its result.json) is
skipped, so rerunning the same command continues where it stopped. `--tiny` is the pipeline at
toy size.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import recipe  # noqa: E402  (examples/recipe.py: the caches and their held-out prompts)


@dataclass(frozen=True)
class PhaseSettings:
    out: Path = recipe.ROOT / "phases"
    first: int = 600
    """Steps of the kl phase."""
    second: int = 200
    """Steps of the onpolicy_kl phase (and the reference trains first + second steps of kl)."""
    seeds: int = 3
    rows: int | None = None
    """Rows of the quickstart corpus in the cache (None: all 3,000)."""
    num_layers: int = 3
    block_size: int = 8
    batch_tokens: int = 1000
    anchors: str = "random"
    """data.anchors: the studies of these caches were measured with the seed recipe's random anchors."""
    num_anchors: int = 8
    lr: float = 1e-3
    eval_sequences: int = 48
    max_prompts: int = 20
    max_new_tokens: int = 48
    temperature: float = 1.0
    threads: int = 1


TINY = dict(first=2, second=2, seeds=2, rows=30, num_layers=1, block_size=4, batch_tokens=400, num_anchors=4,
            eval_sequences=4, max_prompts=1, max_new_tokens=4)

ARMS = ("kl", "kl-first", "kl>onpolicy")
REFERENCE = "kl"


def run_config(settings: PhaseSettings, cache: str, arm: str, seed: int) -> dict:
    """The train config (plain values) of one arm at one seed."""
    out = settings.out / "runs" / f"{arm.replace('>', '-then-')}-seed{seed}"
    steps = {"kl": settings.first + settings.second, "kl-first": settings.first, "kl>onpolicy": settings.second}[arm]
    values = {"cache": cache, "out": str(out), "steps": steps, "device": "cpu", "seed": seed,
              "eval_sequences": settings.eval_sequences, "log_every": max(1, steps // 20), "save_every": steps,
              "keep_checkpoints": 1,
              "model": {"num_layers": settings.num_layers, "block_size": settings.block_size},
              "data": {"batch_tokens": settings.batch_tokens, "anchors": settings.anchors, "num_anchors": settings.num_anchors,
                       "heldout_fraction": 0.05, "seed": seed},
              "noise": {"schedule": "off"},
              "loss": {"kind": "kl", "weighting": "streak"},
              "optim": {"lr": settings.lr}}
    if arm == "kl>onpolicy":
        first = run_config(settings, cache, "kl-first", seed)["out"]
        values["loss"] = {"kind": "onpolicy_kl", "weighting": "streak"}
        values["init_from"] = str(Path(first) / "drafter")
    return values


def train_and_measure(settings: PhaseSettings, values: dict, teacher: Path, prompts: Path, reference: dict,
                      seed: int, progress) -> dict:
    """Train one run (unless its result.json exists) and decode its drafter greedy and at T."""
    from dflash_train.config import config_from_dict
    from dflash_train.settings.measure_config import MeasureConfig
    from dflash_train.sweep.measure import decode_heldout
    from dflash_train.training.trainer import train

    out = Path(values["out"])
    done = out / "result.json"
    if done.exists():
        return json.loads(done.read_text())
    cfg = config_from_dict(values)
    resume = (out / "checkpoints").is_dir() and any((out / "checkpoints").glob("step-*/COMPLETE"))
    result = train(cfg, resume=resume, progress=progress)
    measure = MeasureConfig(teacher=str(teacher), prompts=str(prompts), max_prompts=settings.max_prompts,
                            max_new_tokens=settings.max_new_tokens)
    greedy = decode_heldout(out / "drafter", measure, reference, "cpu")
    sampled = decode_heldout(out / "drafter", measure, reference, "cpu", temperature=settings.temperature, seed=seed)
    record = {"steps": result.steps, "tau": result.after.get("tau"), "loss": result.after.get("loss"),
              "greedy": greedy["accepted_length"], "matched_teacher": greedy["matched_teacher"],
              "sampled": sampled["accepted_length"], "temperature": settings.temperature}
    done.write_text(json.dumps(record, indent=1) + "\n")
    return record


def summary_markdown(records: dict[str, dict[int, dict]], settings: PhaseSettings) -> str:
    """Means ± 95% intervals over seeds and differences from kl paired by seed."""
    from dflash_train.measuring.summary_statistics import paired_difference, t_interval

    def cell(arm: str, key: str) -> str:
        values = {s: r[key] for s, r in records[arm].items() if r.get(key) is not None}
        if not values:
            return "-", "-"
        mean = t_interval(list(values.values())).text()
        if arm == REFERENCE:
            return mean, ""
        ref = {s: r[key] for s, r in records[REFERENCE].items() if r.get(key) is not None}
        diff = paired_difference(values, ref)
        return mean, "" if diff is None else (f"{diff.mean:+.3f} [{diff.low:+.3f}, {diff.high:+.3f}]"
                                              + (" *" if diff.n > 1 and (diff.low > 0 or diff.high < 0) else ""))

    lines = [f"{settings.first} + {settings.second} steps, seeds {sorted({s for r in records.values() for s in r})}, "
             f"real decoding of {settings.max_prompts} held-out prompts x {settings.max_new_tokens} tokens\n",
             f"| arm | steps | held-out tau | greedy accepted length | Δ greedy vs kl | T={settings.temperature:g} accepted "
             f"length | Δ T={settings.temperature:g} vs kl | output = teacher |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for arm in ARMS:
        if not records.get(arm):
            continue
        steps = next(iter(records[arm].values()))["steps"]
        tau, _ = cell(arm, "tau")
        greedy, dg = cell(arm, "greedy")
        sampled, ds = cell(arm, "sampled")
        matched = "yes" if all(r["matched_teacher"] for r in records[arm].values()) else "no"
        lines.append(f"| {arm} | {steps} | {tau} | {greedy} | {dg} | {sampled} | {ds} | {matched} |")
    return "\n".join(lines) + "\n"


def run_phases(settings: PhaseSettings, progress=None) -> str:
    import torch

    from dflash_train.sweep.measure import reference_outputs

    torch.set_num_threads(settings.threads)
    spec = recipe.QUICKSTART
    recipe_settings = recipe.RecipeSettings(out=settings.out, rows=settings.rows)
    cache = recipe.build(spec, spec.teacher, recipe_settings)
    from dflash_train.settings.measure_config import MeasureConfig

    settings.out.mkdir(parents=True, exist_ok=True)
    measure = MeasureConfig(teacher=str(spec.teacher), prompts=str(spec.prompts), max_prompts=settings.max_prompts,
                            max_new_tokens=settings.max_new_tokens)
    reference = reference_outputs(measure, settings.out, None)
    records: dict[str, dict[int, dict]] = {arm: {} for arm in ARMS}
    for seed in range(settings.seeds):
        for arm in ("kl-first", "kl>onpolicy", "kl"):  # the second phase needs the first's drafter
            values = run_config(settings, cache, arm, seed)
            records[arm][seed] = train_and_measure(settings, values, spec.teacher, spec.prompts, reference, seed, progress)
            text = summary_markdown(records, settings)
            tmp = settings.out / ".summary.md.tmp"
            tmp.write_text(text)
            os.replace(tmp, settings.out / "summary.md")
    return summary_markdown(records, settings)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=PhaseSettings.out)
    parser.add_argument("--first", type=int, default=None)
    parser.add_argument("--second", type=int, default=None)
    parser.add_argument("--seeds", type=int, default=None)
    parser.add_argument("--rows", type=int, default=None)
    parser.add_argument("--tiny", action="store_true", help="toy sizes (2 + 2 steps, 30 rows)")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    settings = PhaseSettings(out=args.out)
    if args.tiny:
        settings = replace(settings, **TINY)
    overrides = {k: v for k, v in (("first", args.first), ("second", args.second), ("seeds", args.seeds),
                                   ("rows", args.rows)) if v is not None}
    settings = replace(settings, **overrides)
    from cli.common import BarProgress

    print(run_phases(settings, BarProgress(enabled=not args.quiet)))


if __name__ == "__main__":
    main()
