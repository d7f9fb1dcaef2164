"""What DSpark's `--confidence-threshold` does in real decoding (issue 24's decoding setting).

Run from the repository root:

    python examples/confidence.py [--out objectives] [--thresholds 0,0.2,0.4,0.6,0.8] [--caches quickstart,manpages]

Trains (or reuses) the DSpark runs of `objectives.py --study confidence` (OUT/<cache>_confidence:
the drafters study's settings and seeds, DSpark alone with its confidence head trained on alpha,
the default, and on the greedy hit, `dspark-greedy`), then decodes each run's held-out prompts
once per threshold, greedy and at temperature 1 (seeded by the run's seed), in the built-in
decoder. A threshold cuts a block before the draft whose cumulative predicted acceptance falls
below it: the teacher verifies fewer drafts per forward and accepts fewer tokens per forward.
OUT/<cache>_confidence/confidence.md gets, per configuration, decoding and threshold, the accepted length (mean
and 95% interval over seeds), its difference from no threshold paired by seed, the drafts verified
per forward, the share of those accepted and whether greedy output equals the teacher's;
confidence.png plots the accepted length against the threshold. Each run keeps its decodings in
confidence.json, so rerunning resumes. `--tiny` runs the same pipeline at toy size.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import objectives  # noqa: E402  (examples/objectives.py: the study settings and sweeps)

recipe = objectives.recipe  # examples/recipe.py: the caches and their teachers

RECORD = "confidence.json"
"""A run's decodings, keyed by decoding and threshold, in its folder."""

KINDS = {"greedy": 0.0, "T=1": 1.0}
"""The decodings measured, by label: their temperatures."""


def decode_run(run: Path, sweep_dir: Path, measure, thresholds: tuple[float, ...]) -> dict:
    """The run's decoding at every (decoding, threshold), from its record where it has one."""
    from dflash_common.files import write_file_atomic
    from dflash_train.sweep.measure import REFERENCE_FILE, decode_heldout

    path = run / RECORD
    record = json.loads(path.read_text()) if path.exists() else {}
    reference = json.loads((sweep_dir / REFERENCE_FILE).read_text())
    seed = json.loads((run / "config.json").read_text())["seed"]
    for label, temperature in KINDS.items():
        for threshold in thresholds:
            key = f"{label}@{threshold:g}"
            if key not in record:
                record[key] = decode_heldout(run / "drafter", measure, reference, "cpu", temperature, seed, threshold)
                write_file_atomic(path, (json.dumps(record, indent=1) + "\n").encode())  # a kill keeps the rest
    return record


def table(groups: dict[str, dict[int, dict]], thresholds: tuple[float, ...]) -> tuple[str, dict]:
    """Markdown over seeds (records by configuration, then seed) and the accepted-length intervals
    it shows, by (configuration, decoding, threshold), for the plot."""
    from dflash_train.measuring.summary_statistics import paired_difference, t_interval
    from dflash_train.sweep.recipe import _signed

    lines = ["| configuration | decoding | threshold | accepted length | Δ vs no threshold | drafts verified per forward | "
             "share of verified drafts accepted | output equals the teacher's |", "|---|---|---:|---:|---:|---:|---:|---|"]
    shown = {}
    for label in KINDS:
        for name, records in groups.items():
            base = {seed: r[f"{label}@{thresholds[0]:g}"]["accepted_length"] for seed, r in records.items()}
            for threshold in thresholds:
                runs = {seed: r[f"{label}@{threshold:g}"] for seed, r in records.items()}
                accepted = {seed: d["accepted_length"] for seed, d in runs.items()}
                drafts = t_interval([d["drafts_per_forward"] for d in runs.values()])
                # a forward's tokens are its accepted drafts and one more (the teacher's own)
                share = t_interval([(d["accepted_length"] - 1) / max(d["drafts_per_forward"], 1e-9) for d in runs.values()])
                matched = "n/a" if label != "greedy" else ("yes" if all(d["matched_teacher"] for d in runs.values()) else "NO")
                shown[name, label, threshold] = t_interval(list(accepted.values()))
                delta = "-" if threshold == thresholds[0] else _signed(paired_difference(accepted, base))
                lines.append(f"| {name} | {label} | {threshold:g} | {shown[name, label, threshold].text()} | {delta} | "
                             f"{drafts.text()} | {share.text()} | {matched} |")
    return "\n".join(lines) + "\n", shown


def plot(shown: dict, thresholds: tuple[float, ...], path: Path, title: str) -> None:
    """Accepted length against the threshold, one line per configuration and decoding, a band of
    its 95% interval."""
    from matplotlib.figure import Figure

    from dflash_train.sweep.plots import save_figure, style

    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot(1, 1, 1)
    for i, (name, label) in enumerate(dict.fromkeys((n, k) for n, k, _ in shown)):
        intervals = [shown[name, label, t] for t in thresholds]
        line_style = style(i)
        ax.plot(thresholds, [iv.mean for iv in intervals], label=f"{name}, {label}", marker="o", **line_style)
        ax.fill_between(thresholds, [iv.low for iv in intervals], [iv.high for iv in intervals],
                        color=line_style["color"], alpha=0.15, linewidth=0)
    ax.set_xlabel("confidence threshold (0: off)")
    ax.set_ylabel("real accepted length (tokens per verify forward)")
    ax.set_title(f"{title}: DSpark's confidence threshold\nmean over seeds, 95% band", fontsize="medium")
    ax.grid(alpha=0.3)
    ax.legend()
    save_figure(fig, path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    objectives.add_study_arguments(parser)
    parser.add_argument("--thresholds", default="0,0.2,0.4,0.6,0.8",
                        help="comma-separated, the first the reference (0: no threshold)")
    args = parser.parse_args(argv)
    thresholds = tuple(float(t) for t in args.thresholds.split(","))
    settings = objectives.study_settings(args)
    from cli.common import BarProgress
    from dflash_train.settings.measure_config import MeasureConfig

    caches = tuple(c.strip() for c in (args.caches or "quickstart,manpages").split(","))
    results = objectives.run_study(settings, caches, BarProgress(enabled=not args.quiet), "confidence")
    for spec in (recipe.QUICKSTART, recipe.MANPAGES):
        if spec.name not in results:
            continue
        sweep_dir = results[spec.name].out
        teacher = spec.teacher or recipe.ensure_manpage_teacher(settings)
        measure = MeasureConfig(teacher=str(teacher), prompts=str(spec.prompts), max_prompts=settings.max_prompts,
                                max_new_tokens=settings.max_new_tokens)
        groups: dict[str, dict[int, dict]] = {}
        for run in sorted(r for r in (sweep_dir / "runs").iterdir() if (r / "drafter").is_dir()):
            name = run.name.split("_seed-")[0].removeprefix("drafter-")
            seed = json.loads((run / "config.json").read_text())["seed"]
            groups.setdefault(name, {})[seed] = decode_run(run, sweep_dir, measure, thresholds)
        order = list(objectives.STUDIES["confidence"][1])  # the reference (alpha, the default) first
        text, shown = table(dict(sorted(groups.items(), key=lambda item: order.index(item[0]))), thresholds)
        (sweep_dir / "confidence.md").write_text(text)
        plot(shown, thresholds, sweep_dir / "confidence.png", spec.name)
        print(f"\n## {spec.name}\n\n{text}")


if __name__ == "__main__":
    main()
