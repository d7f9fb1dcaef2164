"""The summary of a sweep with seeds: ``summarize`` groups the runs into configurations (every
grid value but the seed) and writes ``summary.md``/``summary.csv`` and ``tau_vs_tokens.png``: per
configuration the mean and a 95% t-interval over seeds (``t_interval``), the difference from the
reference configuration paired by seed (``paired_difference``), tau at fixed fractions of the
run, and the tokens a configuration needs to reach the reference's final tau
(``tokens_to_reach``). The statistics themselves are dflash_train.measuring.summary_statistics' pure
functions; what each run measured is dflash_train.sweep.measure's measure.json.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from dflash_train.measuring.summary_statistics import (
    Interval,
    interpolate,
    paired_difference,
    spearman,
    t_interval,
    tokens_to_reach,
)

BUDGETS = (0.25, 0.5, 1.0)
"""Fractions of the run at which the summary tabulates held-out tau."""

@dataclass(frozen=True)
class RunOutcome:
    """What the summary needs of one run."""

    configuration: str
    """Its grid values without the seed, e.g. "loss=ce, weighting=decay, noise=off"."""

    seed: int
    final: dict
    """The held-out evaluation after the last step ({} when missing)."""

    measure: dict | None
    """Its measure.json (None when not measured)."""


def _per_seed(outcomes: Sequence[RunOutcome], value) -> dict[str, dict[int, float]]:
    """configuration -> {seed: value(outcome)} for the outcomes where value is not None."""
    out: dict[str, dict[int, float]] = {}
    for o in outcomes:
        v = value(o)
        out.setdefault(o.configuration, {})
        if v is not None:
            out[o.configuration][o.seed] = float(v)
    return out


def _accepted(o: RunOutcome, kind: str = "decoding") -> float | None:
    """A run's real accepted length: greedy ("decoding") or sampled ("sampling")."""
    return ((o.measure or {}).get(kind) or {}).get("accepted_length")


def _sampled(o: RunOutcome) -> float | None:
    return _accepted(o, "sampling")


def categories(outcomes: Sequence[RunOutcome]) -> list[str]:
    """The prompt categories the runs' real decodings report, in first-seen order (none: [])."""
    names: dict[str, None] = {}
    for o in outcomes:
        names.update(dict.fromkeys(((o.measure or {}).get("decoding") or {}).get("categories") or {}))
    return list(names) if len(names) > 1 else []


def category_key(kind: str, category: str) -> str:
    """The summary row's key of a category's real accepted length: "accepted_length[math]"."""
    return f"{'accepted_length' if kind == 'decoding' else 'accepted_length_sampled'}[{category}]"


def _category_intervals(outcomes: Sequence[RunOutcome], names: Sequence[str]) -> dict[str, dict[str, Interval | None]]:
    """configuration -> {category_key: interval over seeds} of the per-category accepted lengths."""
    out: dict[str, dict[str, Interval | None]] = {}
    for kind in ("decoding", "sampling"):
        for name in names:
            per_seed = _per_seed(outcomes, lambda o: (((o.measure or {}).get(kind) or {}).get("categories") or {}).get(name))
            for configuration, values in per_seed.items():
                out.setdefault(configuration, {})[category_key(kind, name)] = (t_interval(list(values.values()))
                                                                               if values else None)
    return out


def _curve(o: RunOutcome) -> list[tuple[float, float]]:
    return [(p["tokens"], p["tau"]) for p in (o.measure or {}).get("curve", []) if p.get("tau") is not None]


def mean_curve(outcomes: Sequence[RunOutcome], metric: str = "tau") -> list[tuple[int, float, float, Interval]]:
    """(step, mean tokens, mean of the metric, its interval) at the steps every seed evaluated;
    the metric is a curve point's "tau" (sampling estimate) or "tau_greedy" (greedy streak)."""
    by_step: dict[int, list[tuple[float, float]]] = {}
    for o in outcomes:
        for p in (o.measure or {}).get("curve", []):
            if p.get(metric) is not None:
                by_step.setdefault(p["step"], []).append((p["tokens"], p[metric]))
    n = len(outcomes)
    out = []
    for step in sorted(by_step):
        points = by_step[step]
        if len(points) == n:
            interval = t_interval([tau for _, tau in points])
            out.append((step, sum(t for t, _ in points) / n, interval.mean, interval))
    return out


def tau_at_budget(outcomes: Sequence[RunOutcome], fraction: float) -> Interval | None:
    """Held-out tau at ``fraction`` of each seed's training tokens (interpolated on its curve),
    over seeds."""
    values = []
    for o in outcomes:
        curve = _curve(o)
        if curve:
            values.append(interpolate(curve, fraction * curve[-1][0]))
    return t_interval(values) if values else None


@dataclass(frozen=True)
class Summary:
    """Per configuration: intervals over seeds, differences from the reference, sample efficiency."""

    rows: tuple[dict, ...]
    reference: str
    ranking_note: str
    sample_temperature: float | None = None
    """The temperature of the sampled decodings (None: greedy only)."""
    categories: tuple[str, ...] = ()
    """The prompt categories with a real accepted length each (rows' category_key; none for one file
    without categories)."""


def summarize(outcomes: Sequence[RunOutcome], reference: str) -> Summary:
    """The numbers of summary.md from the per-run outcomes (pure)."""
    configurations = list(dict.fromkeys(o.configuration for o in outcomes))
    groups = {c: [o for o in outcomes if o.configuration == c] for c in configurations}
    tau = _per_seed(outcomes, lambda o: o.final.get("tau"))
    greedy = _per_seed(outcomes, lambda o: o.final.get("tau_greedy"))
    loss = _per_seed(outcomes, lambda o: o.final.get("loss"))
    accepted = _per_seed(outcomes, _accepted)
    sampled = _per_seed(outcomes, _sampled)
    names = categories(outcomes)
    per_category = _category_intervals(outcomes, names)
    ref_curve = mean_curve(groups.get(reference, []))
    ref_final = ref_curve[-1][2] if ref_curve else (t_interval(list(tau[reference].values())).mean
                                                     if tau.get(reference) else None)
    rows = []
    for c in configurations:
        curve = mean_curve(groups[c])
        row: dict[str, Any] = {"configuration": c, "seeds": len(groups[c]), "reference": c == reference}
        for name, values in (("tau", tau), ("tau_greedy", greedy), ("heldout_loss", loss), ("accepted_length", accepted),
                             ("accepted_length_sampled", sampled)):
            row[name] = t_interval(list(values[c].values())) if values.get(c) else None
        for name, values in (("tau", tau), ("tau_greedy", greedy), ("accepted_length", accepted),
                             ("accepted_length_sampled", sampled)):
            row[f"{name}_vs_reference"] = (paired_difference(values[c], values[reference])
                                           if c != reference and values.get(c) and values.get(reference) else None)
        for fraction in BUDGETS:
            row[f"tau_at_{int(fraction * 100)}pct"] = tau_at_budget(groups[c], fraction)
        reach = tokens_to_reach([(t, m) for _, t, m, _ in curve], ref_final) if ref_final is not None and curve else None
        row["tokens_to_reference_tau"] = reach
        row["run_tokens"] = curve[-1][1] if curve else None
        row.update(per_category.get(c, {}))
        decodings = [(o.measure or {}).get("decoding") for o in groups[c]]
        row["matched_teacher"] = (all(d["matched_teacher"] for d in decodings) if decodings and all(decodings) else None)
        rows.append(row)
    temperatures = {(o.measure or {}).get("sampling", {}).get("temperature") for o in outcomes} - {None}
    return Summary(tuple(rows), reference, ranking_note(rows), max(temperatures) if temperatures else None, tuple(names))


def ranking_note(rows: Sequence[dict]) -> str:
    """Whether offline tau (both estimates) and the real accepted length rank the configurations alike."""
    real = {r["configuration"]: r["accepted_length"].mean for r in rows if r.get("accepted_length")}
    parts = []
    for key, name in (("tau", "offline tau (sampling estimate)"), ("tau_greedy", "offline tau (greedy streak)")):
        offline = {r["configuration"]: r[key].mean for r in rows if r.get(key)}
        rho = spearman(offline, real)
        if rho is None:
            continue
        best_offline, best_real = max(offline, key=offline.get), max(real, key=real.get)
        same = ("both rank the same configuration first" if best_offline == best_real else
                f"they rank different configurations first ({best_offline} offline, {best_real} real)")
        parts.append(f"Spearman rank correlation of {name} and the real accepted length over "
                     f"{len(set(offline) & set(real))} configurations: {rho:.2f}; {same}.")
    return " ".join(parts) or ("Offline tau and the real accepted length: too few configurations with both, or a score "
                               "equal for all of them, to compare their rankings.")


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, Interval):
        return value.text(digits)
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.{digits}f}"
    return str(value)


def _signed(interval: Interval | None) -> str:
    if interval is None:
        return "n/a"
    mark = " *" if interval.n >= 2 and (interval.low > 0 or interval.high < 0) else ""
    return f"{interval.mean:+.3f} [{interval.low:+.3f}, {interval.high:+.3f}]{mark}" if interval.n >= 2 else \
        f"{interval.mean:+.3f} (n=1)"


def summary_markdown(summary: Summary) -> str:
    rows = summary.rows
    lines = [f"Reference: **{summary.reference}**. Intervals: 95% t-interval over seeds, mean ± "
             "t_{0.975,n-1}·s/√n; differences from the reference are paired by seed (seed i of both runs had the "
             "same drafter init, anchors and noise) and marked * when their interval excludes 0. Held-out loss is "
             "each run's own objective, so it compares runs of one loss kind only.", "",
             "### Final numbers", "",
             "| configuration | seeds | held-out tau | Δ tau vs reference | tau (greedy streak) | Δ greedy vs reference "
             "| real accepted length | Δ accepted vs reference"
             + (f" | real accepted length, T={summary.sample_temperature:g} | Δ T={summary.sample_temperature:g} vs reference"
                if summary.sample_temperature else "") + " | held-out loss | output = teacher |",
             "|---|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|" if summary.sample_temperature else "") + "---:|---|"]
    for r in rows:
        name = f"**{r['configuration']}**" if r["reference"] else r["configuration"]
        sampled = (f"{_fmt(r['accepted_length_sampled'])} | {_signed(r['accepted_length_sampled_vs_reference'])} | "
                   if summary.sample_temperature else "")
        lines.append(f"| {name} | {r['seeds']} | {_fmt(r['tau'])} | {_signed(r['tau_vs_reference'])} | "
                     f"{_fmt(r['tau_greedy'])} | {_signed(r['tau_greedy_vs_reference'])} | {_fmt(r['accepted_length'])} | "
                     f"{_signed(r['accepted_length_vs_reference'])} | {sampled}"
                     f"{_fmt(r['heldout_loss'], 4)} | {_fmt(r['matched_teacher'])} |")
    lines += category_markdown(summary)
    budgets = [f"tau at {int(f * 100)}%" for f in BUDGETS]
    lines += ["", "### Sample efficiency", "",
              "Held-out tau (sampling estimate) at fractions of the run's training tokens (each seed's curve "
              "interpolated), and the tokens the mean curve needs to reach the reference's final mean tau (n/a: not "
              "reached); tau_vs_tokens.png also shows the greedy streak.", "",
              "| configuration | " + " | ".join(budgets) + " | tokens to reference tau | share of the run |",
              "|---|" + "---:|" * (len(budgets) + 2)]
    for r in rows:
        reach, total = r["tokens_to_reference_tau"], r["run_tokens"]
        share = f"{reach / total:.0%}" if reach is not None and total else "n/a"
        lines.append(f"| {r['configuration']} | " + " | ".join(_fmt(r[f'tau_at_{int(f * 100)}pct']) for f in BUDGETS)
                     + f" | {_fmt(float(reach)) if reach is not None else 'n/a'} | {share} |")
    lines += ["", summary.ranking_note, ""]
    return "\n".join(lines)


def category_markdown(summary: Summary) -> list[str]:
    """The per-category table of summary.md: the real accepted length of each category's prompts,
    greedy and (when sampled) at the sampling temperature, over seeds (no lines without categories)."""
    if not summary.categories:
        return []
    kinds = [("decoding", "T=0")] + ([("sampling", f"T={summary.sample_temperature:g}")] if summary.sample_temperature else [])
    headers = [f"{name}, {label}" for kind, label in kinds for name in summary.categories]
    lines = ["", "### Real accepted length per prompt category", "",
             "Each category's prompts (its file, or its rows' category) decoded with each run's drafter: accepted "
             "tokens per teacher forward, mean ± 95% t-interval over seeds.", "",
             "| configuration | " + " | ".join(headers) + " |", "|---|" + "---:|" * len(headers)]
    for r in summary.rows:
        cells = [_fmt(r.get(category_key(kind, name))) for kind, _ in kinds for name in summary.categories]
        lines.append(f"| {r['configuration']} | " + " | ".join(cells) + " |")
    return lines


def summary_csv(summary: Summary) -> str:
    import csv
    import io

    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    header = ["configuration", "seeds", "reference"]
    for name in ("tau", "tau_greedy", "heldout_loss", "accepted_length", "accepted_length_sampled", "tau_vs_reference",
                 "tau_greedy_vs_reference", "accepted_length_vs_reference", "accepted_length_sampled_vs_reference",
                 *(f"tau_at_{int(f * 100)}pct" for f in BUDGETS),
                 *(category_key(kind, name) for kind in ("decoding", "sampling") for name in summary.categories)):
        header += [f"{name}_mean", f"{name}_low", f"{name}_high"]
    header += ["tokens_to_reference_tau", "run_tokens", "matched_teacher"]
    writer.writerow(header)
    for r in summary.rows:
        line = [r["configuration"], r["seeds"], r["reference"]]
        for name in header[3:-3:3]:
            interval = r.get(name.removesuffix("_mean"))
            line += ["", "", ""] if interval is None else [interval.mean, interval.low, interval.high]
        line += ["" if r[k] is None else r[k] for k in ("tokens_to_reference_tau", "run_tokens", "matched_teacher")]
        writer.writerow(line)
    return buffer.getvalue()


def plot_tau_vs_tokens(outcomes: Sequence[RunOutcome], path: str | Path, reference: str) -> None:
    """Held-out tau against training tokens, the sampling estimate and the greedy streak side by
    side: one line per configuration (mean over seeds), a band of its 95% interval."""
    from matplotlib.figure import Figure

    from dflash_train.sweep.plots import legend, save_figure, style

    fig = Figure(figsize=(14, 5.5))
    configurations = list(dict.fromkeys(o.configuration for o in outcomes))
    for panel, (metric, title) in enumerate((("tau", "held-out tau, sampling estimate"),
                                             ("tau_greedy", "held-out tau, greedy streak (what greedy decoding accepts)"))):
        ax = fig.add_subplot(1, 2, panel + 1)
        drawn = 0
        for i, c in enumerate(configurations):
            curve = mean_curve([o for o in outcomes if o.configuration == c], metric)
            if not curve:
                continue
            line_style = style(i)
            xs = [t for _, t, _, _ in curve]
            ax.plot(xs, [m for _, _, m, _ in curve], label=c + (" (reference)" if c == reference else ""),
                    linewidth=2.6 if c == reference else 1.3, **line_style)
            if all(iv.n >= 2 for *_, iv in curve):
                ax.fill_between(xs, [iv.low for *_, iv in curve], [iv.high for *_, iv in curve], color=line_style["color"],
                                alpha=0.12, linewidth=0)
            drawn += 1
        if not drawn:
            ax.text(0.5, 0.5, "no held-out curve (curve_points = 0 or no finished run)", ha="center", va="center",
                    transform=ax.transAxes)
        ax.set_xlabel("training tokens")
        ax.set_ylabel("held-out tau (acceptance length)")
        ax.set_title(f"{title}\nmean over seeds, 95% band", fontsize="medium")
        ax.grid(alpha=0.3)
        if panel == 1:
            legend(fig, ax, drawn)
    save_figure(fig, Path(path))


def plot_differences(summary: Summary, path: str | Path) -> None:
    """Each configuration's paired difference from the reference, with its interval: offline tau
    and, where measured, the real accepted length."""
    from matplotlib.figure import Figure

    from dflash_train.sweep.plots import save_figure

    rows = [r for r in summary.rows if not r["reference"]]
    fig = Figure(figsize=(9, 1.2 + 0.45 * max(len(rows), 1)))
    ax = fig.add_subplot()
    series = [("tau_vs_reference", "held-out tau (sampling estimate)", "C0"),
              ("tau_greedy_vs_reference", "held-out tau (greedy streak)", "C2"),
              ("accepted_length_vs_reference", "real accepted length, greedy", "C3")]
    if summary.sample_temperature:
        series.append(("accepted_length_sampled_vs_reference",
                       f"real accepted length, T={summary.sample_temperature:g}", "C1"))
    for offset, (key, label, color) in enumerate(series):
        ys, xs, lo, hi = [], [], [], []
        for i, r in enumerate(rows):
            if r[key] is not None:
                ys.append(i + (offset - (len(series) - 1) / 2) * 0.2)
                xs.append(r[key].mean)
                lo.append(r[key].mean - r[key].low)
                hi.append(r[key].high - r[key].mean)
        if xs:
            ax.errorbar(xs, ys, xerr=[lo, hi], fmt="o", color=color, label=label, markersize=4, capsize=2)
    ax.axvline(0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([r["configuration"] for r in rows], fontsize="small")
    ax.invert_yaxis()
    ax.set_xlabel(f"difference from {summary.reference} (paired by seed, 95% interval)")
    ax.grid(alpha=0.3, axis="x")
    if rows:
        ax.legend(fontsize="small")
    save_figure(fig, Path(path))


SUMMARY_FILES = ("summary.md", "summary.csv", "tau_vs_tokens.png", "difference_from_reference.png")


def write_summary(out: str | Path, outcomes: Sequence[RunOutcome], reference: str) -> str:
    """Write SUMMARY_FILES into the sweep folder; returns the text of summary.md."""
    from dflash_common.files import write_file_atomic

    out = Path(out)
    summary = summarize(outcomes, reference)
    markdown = summary_markdown(summary)
    write_file_atomic(out / "summary.md", markdown.encode())
    write_file_atomic(out / "summary.csv", summary_csv(summary).encode())
    plot_tau_vs_tokens(outcomes, out / "tau_vs_tokens.png", reference)
    plot_differences(summary, out / "difference_from_reference.png")
    return markdown
