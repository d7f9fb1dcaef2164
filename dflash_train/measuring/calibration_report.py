"""DSpark's confidence calibration in eval's report: the printed lines and the reliability plot,
from the calibration summaries (dflash_train.training.calibration) the report holds: the
held-out split's (against the head's training target, teacher-forced) and each real decoding's
(against the drafts the teacher accepted)."""

from __future__ import annotations

from collections.abc import Sequence


def calibration_sources(report: dict) -> list[tuple[str, dict]]:
    """(label, calibration summary) of every part of an eval report that has one, in print order:
    the held-out split's, against the head's training target, then each decoding's, against the
    drafts the teacher accepted."""
    out = []
    offline = (report.get("offline") or {}).get("calibration")
    if offline and offline.get("ece") is not None:
        out.append(("held-out (vs target)", offline))
    decodings = report.get("decodings") or ([report["decoding"]] if report.get("decoding") else [])
    for d in decodings:
        if (d.get("calibration") or {}).get("ece") is not None:
            out.append((f"T={d['temperature']:g} (vs accepted)", d["calibration"]))
    return out


def calibration_text(summary: dict) -> str:
    """One calibration summary as a line: ECE, mean absolute error, observations, the verdict."""
    verdict = "calibrated" if summary["calibrated"] else "MISCALIBRATED"
    return (f"ECE {summary['ece']:.3f}, mean abs error {summary['mean_abs_error']:.3f} over "
            f"{summary['observations']:,} draft positions: {verdict} (ECE <= {summary['ece_tolerance']:g} is calibrated)")


def calibration_lines(report: dict) -> list[tuple[str, str]]:
    """The printout's lines of the confidence head's calibration (none without a head)."""
    return [(f"confidence head, {label}", calibration_text(summary)) for label, summary in calibration_sources(report)]


def plot_reliability(sources: Sequence[tuple[str, dict]], path, title: str) -> None:
    """The reliability diagram: per bin of predicted acceptance, the realised acceptance against
    the predicted (the diagonal is a calibrated head), a line per source; beside it, per draft
    position, predicted and realised acceptance."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from dflash_common.files import write_atomic

    fig = Figure(figsize=(11, 4.5))
    diagram, positions = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    diagram.plot([0, 1], [0, 1], color="grey", linestyle=":", linewidth=1, label="calibrated")
    for s, (label, summary) in enumerate(sources):
        bins = summary["reliability"]
        points = [(p, m, c) for p, m, c in zip(bins["predicted"], bins["measured"], bins["count"]) if c]
        diagram.plot([p for p, _, _ in points], [m for _, m, _ in points], marker="o", color=f"C{s}",
                     label=f"{label} (ECE {summary['ece']:.3f})")
        steps = range(1, len(summary["predicted"]) + 1)
        positions.plot(steps, [_or_nan(x) for x in summary["predicted"]], color=f"C{s}", linestyle="--", marker=".")
        positions.plot(steps, [_or_nan(x) for x in summary["measured"]], color=f"C{s}", marker="o",
                       label=f"{label}: realised (dashed: predicted)")
    diagram.set(xlim=(0, 1), ylim=(0, 1), xlabel="predicted acceptance (bin mean)", ylabel="realised acceptance",
                title=title)
    positions.set(ylim=(0, 1.02), xlabel="draft position", ylabel="acceptance", title="by draft position")
    for ax in (diagram, positions):
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small")
    FigureCanvasAgg(fig)  # Agg without touching pyplot's global backend, as the other eval plots
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=120, bbox_inches="tight"))


def _or_nan(value: float | None) -> float:
    return float("nan") if value is None else value
