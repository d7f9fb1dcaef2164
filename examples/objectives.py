"""`make objectives`: do the objectives aimed at acceptance raise the real accepted length?

Run from the repository root:

    python examples/objectives.py [--out objectives] [--steps 600] [--seeds 3] [--parallel 2] [--caches quickstart,manpages]

On the recipe study's two caches (examples/recipe.py builds them, under OUT/caches), one sweep
per cache whose grid key `objective` names a whole configuration:

    kl+streak      the defaults (the reference)          ce+decay       the DFlash paper's recipe
    tv, nla,       the LK losses (streak weights)        ce0.1+tv0.9    the DSpark recipes' weighted sum
    lk_hybrid                                            kl+dpace       kl with D-PACE weights
    onpolicy_kl    on-policy replay (streak weights)

each with --seeds seeds, the quickstart drafter's shape (3 layers, B = 8), and real speculative
decoding of held-out prompts greedy and at temperature 1 in the built-in decoder. Each sweep
folder gets summary.md (means, 95% intervals over seeds, differences from kl+streak paired by
seed, the real accepted length at T=0 and T=1) and its plots. Everything resumes: rerunning
the same command skips finished runs. `--tiny` runs the same pipeline at toy size.
`--study drafters` compares DFlash with DSpark the same way (OUT/<cache>_drafters), `--study kinds`
DFlash, DSpark and DFlash2 (OUT/<cache>_kinds; positions.md also gets the DFlash2 selector's share of
drafts where it left the drafter's top-1 and how often those were accepted). `--study field`
(issue 46) runs DFlash, DSpark, DFlash2 and DFlash with the chain loss, first-error weights, the kl
at T = 2 and causal blocks (OUT/<cache>_field; see FIELD), the study's sizes as above: one command
for both caches and 3 seeds, resumed by rerunning it. `--arms a,b` runs only some configurations
(the reference always), e.g. to add an arm later.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import recipe  # noqa: E402  (examples/recipe.py: the caches, the man-page teacher, the sweep call)

OBJECTIVES: dict[str, dict] = {
    "kl+streak": {"loss.kind": "kl", "loss.weighting": "streak"},
    "ce+decay": {"loss.kind": "ce", "loss.weighting": "decay"},
    "tv": {"loss.kind": "tv", "loss.weighting": "streak"},
    "nla": {"loss.kind": "nla", "loss.weighting": "streak"},
    "lk_hybrid": {"loss.kind": "lk_hybrid", "loss.weighting": "streak"},
    "ce0.1+tv0.9": {"loss.terms": {"ce": 0.1, "tv": 0.9}, "loss.weighting": "streak"},
    "kl+dpace": {"loss.kind": "kl", "loss.weighting": "dpace"},
    "onpolicy_kl": {"loss.kind": "onpolicy_kl", "loss.weighting": "streak"},
}
"""Each configuration of the study: its name (the grid value) and the settings it sets."""

REFERENCE = "kl+streak"

DRAFTERS: dict[str, dict] = {"dflash": {"model.kind": "dflash"}, "dspark": {"model.kind": "dspark"}}
"""`--study drafters` (issue 24): DFlash against DSpark (vanilla Markov head of rank 256, the
confidence head, sample_from_anchor) under the default objective, at equal training tokens."""

KINDS: dict[str, dict] = {**DRAFTERS, "dflash2": {"model.kind": "dflash2"}}
"""`--study kinds` (issue 35): DFlash, DSpark and DFlash2 (grouped convolutions of 2 taps in groups of
16, the selector of rank 256 over the top 16) under the default objective, at equal training tokens."""

FIELD: dict[str, dict] = {
    **KINDS,
    "dflash+chain": {"model.kind": "dflash", "loss.terms": {"kl": 1.0, "chain": 1.0}},
    "dflash+first_error": {"model.kind": "dflash", "loss.weighting": "first_error"},
    "dflash+kl_t2": {"model.kind": "dflash", "loss.temperature": 2.0},
    "dflash+causal": {"model.kind": "dflash", "model.causal": True},
}
"""`--study field` (issue 46): what the field trains with now, each arm against DFlash under the
default objective (kl + streak) at equal training tokens: DSpark, DFlash2, and DFlash with the
chain loss, the first-error weights, the kl at temperature 2 (times 4) and causal attention inside
the block. The chain is a term beside kl, not alone: its gradient is a product of alphas, which
vanishes where acceptance starts near 0, as tv's did (tv alone stalled at 1.22 on the quickstart
cache, benchmarks/RESULTS.md), while kl trains a drafter from scratch; weight 1 keeps both terms
on the per-position scale. An arm whose settings name a field this checkout lacks (model.causal,
until the causal-blocks option lands under that name: edit the key here) is skipped with a message."""

ANCHORS: dict[str, dict] = {
    "random8": {"data.anchors": "random", "data.num_anchors": 8},
    "random32": {"data.anchors": "random", "data.num_anchors": 32},
    "cover": {"data.anchors": "cover", "data.num_anchors": None},
}
"""`--study anchors` (issue 59): the blocks an epoch trains, DFlash under the default objective at
equal training tokens read (the same batches): the seed recipe's 8 random anchors a sequence (the
reference), 32, and cover (every loss position once an epoch, the default since issue 59)."""

LONG: dict[str, dict] = {**ANCHORS, "random128": {"data.anchors": "random", "data.num_anchors": 128}}
"""`--study long` (issue 59): the anchors study on ~2,000-token conversations (recipe.QUICKSTART_LONG,
MANPAGES_LONG), where 8 random blocks of 7 train ~4% of a sequence's ~1,150-1,220 loss positions a
step, 32 ~17%, 128 ~68% (overlapping, so some twice) and cover every one once (measured:
benchmarks/RESULTS.md, "Anchors on ~2,000-token sequences")."""

LATTICE: dict[str, dict] = {
    **KINDS,
    "dflash2-teacher": {"model.kind": "dflash2", "dflash2.selector_target": "teacher"},
    "lilicorr": {"model.kind": "lilicorr"},
    "lilicorr-top1": {"model.kind": "lilicorr", "lilicorr.target": "top1"},
    "lilicorr+conv": {"model.kind": "lilicorr", "lilicorr.conv": True},
}
"""`--study lattice` (issue 56): the candidate walks against DFlash under the default objective at
equal training tokens: DSpark, DFlash2 with speculators' top-1 selector objective and with the
teacher's distribution over the candidates (dflash2.selector_target), LiLiCorr (its default: the
teacher's distribution), LiLiCorr trained toward the top-1, and LiLiCorr + conv."""

STUDY = dict(steps=600, seeds=3, num_layers=3, block_size=8, batch_tokens=1000, num_anchors=8, lr=1e-3,
             eval_sequences=48, curve_points=2, max_prompts=20, max_new_tokens=48)
"""The study's sizes (benchmarks/RESULTS.md): the quickstart drafter's shape, >= 600 steps."""

STUDY_SIZES = {"long": dict(batch_tokens=2048, steps=300, caches=("quickstart_long", "manpages_long"))}
"""A study's own sizes where they differ: `long` reads one ~2,000-token conversation a batch, on the
long caches unless --caches names others."""


STUDIES = {"objectives": ("objective", OBJECTIVES, REFERENCE, ""), "drafters": ("drafter", DRAFTERS, "dflash", "_drafters"),
           "confidence": ("drafter", {"dspark": DRAFTERS["dspark"],
                                      "dspark-greedy": {**DRAFTERS["dspark"], "dspark.confidence_target": "greedy"}},
                          "dspark", "_confidence"),
           "kinds": ("drafter", KINDS, "dflash", "_kinds"),
           "field": ("arm", FIELD, "dflash", "_field"),
           "anchors": ("anchors", ANCHORS, "random8", "_anchors"),
           "long": ("anchors", LONG, "random8", "_anchors"),
           "lattice": ("drafter", LATTICE, "dflash", "_lattice")}
"""Per study: its grid key, its configurations, the reference and the suffix of its sweep folders
(`confidence`: DSpark alone, its confidence head trained on alpha or on the greedy hit, whose
confidence thresholds examples/confidence.py decodes)."""


def bundle_axis(key: str, bundles: dict[str, dict]):
    """A grid key whose values name configurations; each value's settings come as its extras."""
    from dflash_train.sweep import GridAxis

    return GridAxis(key, (), tuple(bundles), extras=tuple(tuple(settings.items()) for settings in bundles.values()))


def available(bundles: dict[str, dict], chosen: tuple[str, ...] | None, reference: str, say=print) -> dict[str, dict]:
    """The configurations to run: those named in chosen (all when None; the reference always), less
    any whose settings name a field this checkout does not have, each skipped with a message."""
    from dflash_train.options import find_knob

    unknown = sorted(set(chosen or ()) - set(bundles))
    if unknown:
        raise SystemExit(f"--arms {unknown[0]!r} is not a configuration of this study (use some of {', '.join(bundles)})")
    kept = {}
    for name, settings in bundles.items():
        if chosen is not None and name not in chosen and name != reference:
            continue
        missing = [key for key in settings if find_knob(key) is None]
        if missing:
            say(f"skipping {name}: this checkout has no config field {missing[0]} (set the arm's settings in "
                "examples/objectives.py once it exists)")
            continue
        kept[name] = settings
    return kept


def run_study(settings: recipe.RecipeSettings, caches: tuple[str, ...], progress=None,
              study: str = "objectives", arms: tuple[str, ...] | None = None) -> dict[str, object]:
    """One sweep per cache (of the study's configurations named in arms, all when None, the
    reference always); returns {cache name: SweepResult}."""
    key, bundles, reference, suffix = STUDIES[study]
    bundles = available(bundles, arms, reference)
    results = {}
    for spec in recipe.STUDY_CACHES:
        if spec.name not in caches:
            continue
        teacher = spec.teacher or recipe.ensure_manpage_teacher(settings)
        cache = recipe.build(spec, teacher, settings)
        results[spec.name] = recipe.sweep(replace(spec, name=spec.name + suffix), cache, teacher, settings, "full",
                                          progress, grid=(bundle_axis(key, bundles),), reference=((key, reference),))
    return results


def add_study_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every study script shares: where, which caches, how long, how many seeds."""
    parser.add_argument("--out", type=Path, default=recipe.ROOT / "objectives")
    parser.add_argument("--caches", default=None,
                        help="comma-separated, of " + ", ".join(s.name for s in recipe.STUDY_CACHES) +
                             " (default quickstart,manpages; the long study's: quickstart_long,manpages_long)")
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seeds", type=int, default=None)
    parser.add_argument("--parallel", type=int, default=None)
    parser.add_argument("--tiny", action="store_true", help="toy sizes (2 steps a run) and a 2-step teacher under --out")
    parser.add_argument("--quiet", action="store_true")
    parser.add_argument("--arms", default=None,
                        help="comma-separated configurations of the study to run (default all; the reference always)")


def study_settings(args: argparse.Namespace, study: str = "objectives") -> recipe.RecipeSettings:
    """STUDY's sizes and the study's own (TINY's with --tiny), decoding greedy and at T = 1, with the
    options' overrides."""
    sizes = {k: v for k, v in STUDY_SIZES.get(study, {}).items() if k != "caches"}
    settings = replace(recipe.RecipeSettings(out=args.out, manpage_teacher=recipe.EXAMPLES / "manpage_teacher"),
                       **{**STUDY, **sizes})
    if args.tiny:
        settings = replace(settings, manpage_teacher=args.out / "manpage_teacher", **recipe.TINY)
    overrides = {k: v for k, v in (("steps", args.steps), ("seeds", args.seeds), ("parallel", args.parallel)) if v is not None}
    return replace(settings, sample_temperature=1.0, **overrides)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_study_arguments(parser)
    parser.add_argument("--study", choices=tuple(STUDIES), default="objectives",
                        help="objectives (issue 23), drafters: DFlash against DSpark (OUT/<cache>_drafters), "
                             "confidence: DSpark's two confidence targets (examples/confidence.py decodes their thresholds), "
                             "kinds: DFlash, DSpark and DFlash2 (OUT/<cache>_kinds), or field (issue 46): those and "
                             "DFlash with the chain loss, first-error weights, kl at T = 2 and causal blocks "
                             "(OUT/<cache>_field), or anchors (issue 59): 8 and 32 random anchors a sequence against "
                             "cover (OUT/<cache>_anchors), or long (issue 59): 8, 32 and 128 against cover on "
                             "~2,000-token conversations (OUT/<cache>_long_anchors), or lattice (issue 56): DFlash, DSpark, DFlash2 with both "
                             "selector objectives, LiLiCorr with both and LiLiCorr + conv (OUT/<cache>_lattice)")
    args = parser.parse_args(argv)
    from cli.common import BarProgress

    arms = None if args.arms is None else tuple(a.strip() for a in args.arms.split(",") if a.strip())
    caches = args.caches or ",".join(STUDY_SIZES.get(args.study, {}).get("caches", ("quickstart", "manpages")))
    results = run_study(study_settings(args, args.study), tuple(c.strip() for c in caches.split(",")),
                        BarProgress(enabled=not args.quiet), args.study, arms)
    key = STUDIES[args.study][0]
    for name, result in results.items():
        table = position_table(result.out, key) + selector_table(result.out, key)
        (result.out / "positions.md").write_text(table)
        print(f"\n## {name}\n\n{result.report.summary}\n### Acceptance by draft position (real decoding)\n\n{table}")


def reached(histogram: list[int]) -> list[float]:
    """Per draft position k = 1, 2, ...: the share of verify rounds whose k-th draft was accepted,
    from a histogram of tokens per round (a round of n tokens accepted n - 1 drafts)."""
    rounds = sum(histogram)
    return [sum(histogram[k + 1:]) / rounds for k in range(1, max(len(histogram) - 1, 2))] if rounds else []


def position_table(sweep_dir: Path, key: str) -> str:
    """Markdown: per configuration (mean over seeds) the share of real verify rounds that accept
    draft position k, greedy and sampled, and the training tokens/s; the acceptance decay along
    the block that DSpark's Markov head is meant to slow."""
    import json

    from dflash_train.sweep.measure import read_measure
    from dflash_train.sweep.status import read_metrics

    groups: dict[str, list[Path]] = {}
    for run in sorted((sweep_dir / "runs").iterdir()):
        if (run / "config.json").exists():
            groups.setdefault(run.name.split("_seed-")[0].removeprefix(f"{key}-"), []).append(run)
    lines = ["| configuration | decoding | " + " | ".join(f"k={k}" for k in range(1, 9)) + " | train tokens/s |",
             "|---|---|" + "---:|" * 9]
    for name, runs in groups.items():
        speed = [read_metrics(r).final_train.get("tokens_per_s") for r in runs]
        speed = [s for s in speed if s]
        for kind in ("decoding", "sampling"):
            curves = [reached(((read_measure(r) or {}).get(kind) or {}).get("accepted_histogram", [])) for r in runs]
            curves = [c for c in curves if c]
            if not curves:
                continue
            width = max(len(c) for c in curves)
            mean = [sum((c + [0.0] * width)[k] for c in curves) / len(curves) for k in range(min(width, 8))]
            temperature = next(m[kind]["temperature"] for m in map(read_measure, runs) if m and m.get(kind))
            label = "greedy" if kind == "decoding" else "T=" + json.dumps(temperature)
            cells = [f"{x:.3f}" for x in mean] + [""] * (8 - len(mean))
            rate = f"{sum(speed) / len(speed):,.0f}" if speed else "n/a"
            lines.append(f"| {name} | {label} | " + " | ".join(cells) + f" | {rate} |")
    return "\n".join(lines) + "\n"


def selector_table(sweep_dir: Path, key: str) -> str:
    """Markdown: per DFlash2 configuration and decoding (mean over seeds) the share of real drafts
    where the selector left the drafter's top-1, the share of those accepted and of the others;
    empty without DFlash2 runs."""
    from dflash_train.sweep.measure import read_measure

    rows = {}
    for run in sorted((sweep_dir / "runs").iterdir()):
        for kind in ("decoding", "sampling"):
            found = (((read_measure(run) or {}).get(kind) or {}).get("selector"))
            if found:
                rows.setdefault((run.name.split("_seed-")[0].removeprefix(f"{key}-"), kind), []).append(found)
    if not rows:
        return ""
    lines = ["", "The candidate walk (DFlash2's selector, LiLiCorr's correlator) in real decoding (mean over seeds)", "",
             "| configuration | decoding | drafts changed | changed accepted | unchanged accepted | seeds |",
             "|---|---|---:|---:|---:|---:|"]
    for (name, kind), found in rows.items():
        mean = {k: sum(f[k] for f in found) / len(found) for k in ("changed", "changed_accepted", "kept_accepted")}
        lines.append(f"| {name} | {'greedy' if kind == 'decoding' else 'T=1'} | {mean['changed']:.3f} | "
                     f"{mean['changed_accepted']:.3f} | {mean['kept_accepted']:.3f} | {len(found)} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
