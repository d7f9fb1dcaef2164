"""`make recipe`: does soft-label KL, streak weighting and step-indexed noise buy sample efficiency?

Run from the repository root:

    python examples/recipe.py [--out recipe] [--steps 150] [--seeds 3] [--parallel 2]

On two caches it trains the `dflash-train sweep --preset recipe` grid (loss ce/kl/mix x
weighting decay/streak x noise off/constant 0.05/cosine, each with --seeds seeds) and writes one
sweep folder per cache, each with its summary.md (means and 95% intervals over seeds,
differences from the paper's recipe ce + decay + off paired by seed, tau at 25/50/100% of the
run, the tokens to reach the paper recipe's final tau, offline tau against the real decoder's
accepted length) and tau_vs_tokens.png:

    OUT/quickstart/   examples/data/chat.jsonl through the shipped quickstart teacher
    OUT/manpages/     examples/data/manpages.jsonl (real manual-page text, examples/manpage_chat.py)
                      through examples/manpage_teacher (make_example.py --chat; trained here first
                      when that folder is missing)

recipe.VARIED and recipe.HYBRID (issue 54) are two more caches for the studies: teachers trained on
examples/data/varied_chat.jsonl answer its prompts themselves (stage 0) before the build; see
examples/README.md. `recipe.CACHES` lists all four; this study's sweep runs on the first two.

Everything resumes: rerunning the same command skips finished caches and runs. `--tiny` is the
same pipeline at toy size (2 steps a run, a few rows, a 2-step teacher under OUT), which the
default test suite runs so that none of it rots.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"
sys.path.insert(0, str(EXAMPLES))
sys.path.insert(0, str(ROOT))


@dataclass(frozen=True)
class CacheSpec:
    """One of the study caches and what its sweep decodes."""

    name: str
    data: Path
    prompts: Path
    """Held-out prompts (never in `data`) for the real decoder."""

    teacher: Path | None
    """None: the man-page teacher of the settings."""

    design: str = "full"
    regenerate: bool = False
    """Stage 0 first: the cache holds the teacher's own greedy answers to `data`'s prompts (every
    turn, answered in turn), regenerated under OUT/data, instead of `data`'s answers."""

    join_tokens: int = 0
    """Consecutive chats of `data` joined into conversations of at most this many tokens, and the
    held-out prompts given contexts as long (examples/long_chat.py, under OUT/data); 0: as they are."""


QUICKSTART = CacheSpec("quickstart", EXAMPLES / "data" / "chat.jsonl", EXAMPLES / "data" / "heldout_prompts.jsonl",
                       EXAMPLES / "teacher")
MANPAGES = CacheSpec("manpages", EXAMPLES / "data" / "manpages.jsonl",
                     EXAMPLES / "data" / "manpages_heldout_prompts.jsonl", None)
# Issue 54's third and fourth caches: teachers that learned a corpus whose replies vary among equally
# valid phrasings (examples/varied_chat.py), so their answers are confident except at those choices;
# HYBRID's teacher is a Qwen3.5 text model (Gated DeltaNet and attention layers).
VARIED = CacheSpec("varied", EXAMPLES / "data" / "varied_chat.jsonl", EXAMPLES / "data" / "varied_heldout_prompts.jsonl",
                   EXAMPLES / "varied_teacher", regenerate=True)
HYBRID = replace(VARIED, name="hybrid", teacher=EXAMPLES / "hybrid_teacher")
CACHES = (QUICKSTART, MANPAGES, VARIED, HYBRID)
# Issue 59's long sequences: the same corpora and teachers, chats joined into ~2,000-token
# conversations (the teachers' 2,048 positions), every assistant turn a loss-masked span.
QUICKSTART_LONG = replace(QUICKSTART, name="quickstart_long", join_tokens=2000)
MANPAGES_LONG = replace(MANPAGES, name="manpages_long", join_tokens=2000)
STUDY_CACHES = (QUICKSTART, MANPAGES, QUICKSTART_LONG, MANPAGES_LONG)
"""The caches the objectives studies choose from (--caches)."""


@dataclass(frozen=True)
class RecipeSettings:
    """Sizes of the study; the defaults are what benchmarks/RESULTS.md reports."""

    out: Path = ROOT / "recipe"
    steps: int = 150
    """Optimizer steps of every run (the same steps and tokens for every configuration)."""

    seeds: int = 3
    parallel: int = 2
    """Runs trained at once (each in its own process, one thread each on CPU)."""

    num_layers: int = 1
    block_size: int = 8
    batch_tokens: int = 1000
    anchors: str = "random"
    """data.anchors: the studies of these caches were measured with the seed recipe's random anchors."""
    num_anchors: int = 8
    lr: float = 2e-3
    eval_sequences: int = 48
    heldout_fraction: float = 0.05
    curve_points: int = 3
    max_prompts: int = 10
    max_new_tokens: int = 40
    rows: int | None = None
    """Rows of each corpus in its cache (None: all)."""

    manpage_teacher: Path = EXAMPLES / "manpage_teacher"
    teacher_steps: int = 250
    """Steps of the man-page teacher when it has to be trained."""

    quickstart_design: str = "one-at-a-time"
    """Design of the quickstart sweep: "full" (all 18 configurations) or "one-at-a-time" (the 7
    that change one part of the paper's recipe, and the full recipe kl + streak + cosine)."""

    manpage_design: str = "one-at-a-time"
    """Design of the man-page sweep (as quickstart_design)."""

    answer_tokens: int = 128
    """Longest regenerated answer, in tokens (the corpora's longest replies are under 100)."""

    top_k: int = 32
    sample_temperature: float = 0.0
    """Also decode the held-out prompts by speculative sampling at this temperature (0: greedy only)."""


TINY = dict(steps=2, seeds=2, parallel=1, num_layers=1, block_size=4, batch_tokens=400, num_anchors=4,
            eval_sequences=4, heldout_fraction=0.2, curve_points=1, max_prompts=1, max_new_tokens=4, rows=30,
            teacher_steps=2, top_k=8)


def subset(path: Path, rows: int | None, out: Path) -> Path:
    """The first `rows` rows of a JSONL file (the file itself when rows is None)."""
    if rows is None:
        return path
    out.parent.mkdir(parents=True, exist_ok=True)
    lines = [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()][:rows]
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return out


def ensure_manpage_teacher(settings: RecipeSettings) -> Path:
    """The man-page teacher: the settings' folder when it holds one, else trained there with
    make_example.py's quickstart recipe (`--chat`)."""
    teacher = settings.manpage_teacher
    if (teacher / "model.safetensors").exists():
        return teacher
    import make_example
    import torch

    torch.manual_seed(make_example.TRAIN_SEED)
    data = subset(MANPAGES.data, settings.rows, settings.out / "data" / "manpages.jsonl")
    heldout = subset(MANPAGES.prompts, settings.rows, settings.out / "data" / "manpages_heldout.jsonl")
    steps = make_example.TrainSettings(steps=settings.teacher_steps,
                                       warmup_steps=min(make_example.TrainSettings.warmup_steps, settings.teacher_steps))
    make_example.train_on_chats(data, heldout, teacher, steps)
    return teacher


def answers(spec: CacheSpec, teacher: Path, settings: RecipeSettings) -> Path:
    """The corpus the spec's cache holds: `data` (its first settings.rows), with spec.join_tokens
    its chats joined into long conversations, or with spec.regenerate the teacher's greedy answers
    to its prompts in float32 (stage 0; resumed or reused when rerun)."""
    data = subset(spec.data, settings.rows, settings.out / "data" / f"{spec.name}.jsonl")
    if spec.join_tokens:
        import long_chat

        prompts = heldout_prompts(spec, settings)
        joined = prompts.with_name(f"{spec.data.stem}_{spec.join_tokens}.jsonl")
        return long_chat.write_long(data, spec.prompts, teacher, joined, prompts, spec.join_tokens)[0]
    if not spec.regenerate:
        return data
    from dflash_regenerate import regenerate
    from dflash_regenerate.settings.regenerate_config import RegenerateConfig
    from dflash_teacher.teacher import TeacherConfig

    out = settings.out / "data" / f"{spec.name}_answers.jsonl"
    regenerate(RegenerateConfig(data=str(data), out=str(out), keep_turns="all", max_new_tokens=settings.answer_tokens,
                                teacher=TeacherConfig(name_or_path=str(teacher), dtype="float32", device="cpu")))
    return out


def heldout_prompts(spec: CacheSpec, settings: RecipeSettings) -> Path:
    """The prompts the spec's runs decode: its own, or with join_tokens their long-context
    versions under OUT/data (written by answers)."""
    if not spec.join_tokens:
        return spec.prompts
    return settings.out / "data" / f"{spec.data.stem}_{spec.join_tokens}_prompts.jsonl"  # the same under a study's name


def build(spec: CacheSpec, teacher: Path, settings: RecipeSettings) -> str:
    """The spec's cache under OUT/caches (resumed or reused when it exists)."""
    from dflash_build import BuildConfig, build_cache
    from dflash_cache import open_cache
    from dflash_cache.settings.storage_config import StorageConfig
    from dflash_corpus import CorpusConfig
    from dflash_teacher.teacher import TeacherConfig

    out = settings.out / "caches" / spec.name
    if (out / "manifest.json").exists() and open_cache(str(out)).complete:
        return str(out)
    data = answers(spec, teacher, settings)
    # float32: this CPU runs bf16 matmuls several times slower, and the tiny caches stay small
    build_cache(BuildConfig(out=str(out), corpus=CorpusConfig(data=str(data)),
                            teacher=TeacherConfig(name_or_path=str(teacher), dtype="float32", device="cpu",
                                                  num_tapped_layers=3, top_k=settings.top_k),
                            storage=StorageConfig(shard_bytes=32 * 2**20, chunk_bytes=512 * 2**10)))
    return str(out)


def sweep(spec: CacheSpec, cache: str, teacher: Path, settings: RecipeSettings, design: str, progress=None,
          grid=None, reference=None):
    """The preset's sweep on one cache (or `grid` compared with `reference`); returns run_sweep's result."""
    from dflash_train.config import config_from_dict
    from dflash_train.settings.measure_config import MeasureConfig
    from dflash_train.sweep import SweepConfig, preset, run_sweep

    chosen = preset("recipe")
    base = config_from_dict({
        "cache": cache, "out": str(settings.out / spec.name), "steps": settings.steps, "device": "cpu",
        "eval_sequences": settings.eval_sequences, "log_every": max(1, settings.steps // 20),
        "model": {"num_layers": settings.num_layers, "block_size": settings.block_size},
        "data": {"batch_tokens": settings.batch_tokens, "anchors": settings.anchors, "num_anchors": settings.num_anchors,
                 "heldout_fraction": settings.heldout_fraction},
        "optim": {"lr": settings.lr},
    })
    measure = MeasureConfig(curve_points=settings.curve_points, teacher=str(teacher),
                            prompts=str(heldout_prompts(spec, settings)),
                            max_prompts=settings.max_prompts, max_new_tokens=settings.max_new_tokens,
                            sample_temperature=settings.sample_temperature)
    custom = grid is not None
    cfg = SweepConfig(out=str(settings.out / spec.name), base=base, grid=grid if custom else chosen.grid,
                      parallel=settings.parallel, seeds=settings.seeds, design=design,
                      reference=reference if custom else chosen.reference, centers=() if custom else chosen.centers,
                      include=() if custom else chosen.include, measure=measure)
    return run_sweep(cfg, progress=progress)


def longer_run(settings: RecipeSettings, steps: int, progress=None):
    """The paper's recipe against the full recipe on the man-page cache at `steps` steps (the
    later phase the main study could not afford): one grid key whose two values carry their
    whole recipe, the same seeds and measurements. Writes OUT/manpages_long/."""
    from dflash_train.sweep import FULL_RECIPE, PAPER_RECIPE, GridAxis

    def settings_of(recipe):
        values = dict(recipe)
        extras = [("loss.weighting", values["weighting"]), ("noise.schedule", values["noise"])]
        if values["noise"] == "cosine":
            extras += [("noise.distribution", "uniform"), ("noise.start", 0.1), ("noise.end", 0.01)]
        return tuple(extras)

    axis = GridAxis("recipe", ("loss", "kind"), ("ce", "kl"), extras=(settings_of(PAPER_RECIPE), settings_of(FULL_RECIPE)))
    teacher = ensure_manpage_teacher(settings)
    cache = build(MANPAGES, teacher, settings)
    long = replace(settings, steps=steps)
    return sweep(replace(MANPAGES, name="manpages_long"), cache, teacher, long, "full", progress, grid=(axis,),
                 reference=(("recipe", "ce"),))


def run_recipe(settings: RecipeSettings, progress=None) -> dict[str, object]:
    """Both caches, both sweeps; returns {cache name: SweepResult}."""
    results = {}
    for spec, design in ((QUICKSTART, settings.quickstart_design), (MANPAGES, settings.manpage_design)):
        teacher = spec.teacher or ensure_manpage_teacher(settings)
        cache = build(spec, teacher, settings)
        results[spec.name] = sweep(spec, cache, teacher, settings, design, progress)
    settings.out.mkdir(parents=True, exist_ok=True)
    (settings.out / "recipe.json").write_text(json.dumps(
        {k: str(v) if isinstance(v, Path) else v for k, v in settings.__dict__.items()}, indent=1) + "\n")
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RecipeSettings.out)
    parser.add_argument("--steps", type=int, default=None)
    parser.add_argument("--seeds", type=int, default=None)
    parser.add_argument("--parallel", type=int, default=None)
    parser.add_argument("--quickstart-design", choices=("full", "one-at-a-time"), default=None)
    parser.add_argument("--manpage-design", choices=("full", "one-at-a-time"), default=None)
    parser.add_argument("--tiny", action="store_true", help="toy sizes (2 steps a run) and a 2-step teacher under --out")
    parser.add_argument("--longer", type=int, default=None, metavar="STEPS",
                        help="instead: the paper's recipe against the full recipe on the man-page cache at STEPS steps "
                        "(OUT/manpages_long)")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    settings = RecipeSettings(out=args.out)
    if args.tiny:
        settings = replace(settings, manpage_teacher=args.out / "manpage_teacher", **TINY)
    overrides = {k: v for k, v in (("steps", args.steps), ("seeds", args.seeds), ("parallel", args.parallel),
                                   ("quickstart_design", args.quickstart_design), ("manpage_design", args.manpage_design))
                 if v is not None}
    settings = replace(settings, **overrides)
    from cli.common import BarProgress

    if args.longer is not None:
        result = longer_run(settings, args.longer, BarProgress(enabled=not args.quiet))
        print(result.report.summary)
        return
    results = run_recipe(settings, BarProgress(enabled=not args.quiet))
    for name, result in results.items():
        print(f"\n## {name}\n\n{result.report.summary}")


if __name__ == "__main__":
    main()
