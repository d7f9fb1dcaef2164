"""The comparison of a sweep's runs: results.csv, results.md, the figures and sweep.json."""

from __future__ import annotations

import csv
import dataclasses
import io
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from dflash_common.files import write_file_atomic
from dflash_train.settings.sweep_config import SweepConfig
from dflash_train.sweep.grid import value_label
from dflash_train.sweep.measure import read_measure
from dflash_train.sweep.plan import SEED_KEY, SweepRun, plan_runs, planned_combinations, reference_combination
from dflash_train.sweep.plots import plot_acceptance_by_position, plot_loss_curves
from dflash_train.sweep.recipe import (
    RunOutcome,
    write_summary,
)
from dflash_train.sweep.status import RunMetrics, read_metrics

ALPHA_POSITIONS = (1, 2, 4)
"""Block positions whose held-out alpha gets a table column (plus the last position)."""


def alpha_columns(alpha: Sequence[float] | None) -> dict[str, float | None]:
    """alpha at ALPHA_POSITIONS and the last position (None where the block is shorter)."""
    alpha = list(alpha or [])
    out: dict[str, float | None] = {f"alpha_{k}": alpha[k - 1] if k <= len(alpha) else None for k in ALPHA_POSITIONS}
    out["alpha_last"] = alpha[-1] if alpha else None
    return out


RESULT_COLUMNS = ("train_loss", "heldout_loss", "tau", "tau_greedy",
                  *(f"alpha_{k}" for k in ALPHA_POSITIONS), "alpha_last", "tokens_per_s", "steps")


def result_row(run: SweepRun, metrics: RunMetrics) -> dict[str, Any]:
    """One table row: the run, its grid values and its final numbers (None where missing)."""
    final, last = metrics.final_eval, metrics.final_train
    row: dict[str, Any] = {"run": run.name}
    row.update({key: value_label(value) for key, value in run.values})
    if run.seed is not None:
        row[SEED_KEY] = run.seed
    row.update({
        "train_loss": last.get("loss"),
        "heldout_loss": final.get("loss"),
        "tau": final.get("tau"),
        "tau_greedy": final.get("tau_greedy"),
        **alpha_columns(final.get("alpha")),
        "tokens_per_s": last.get("tokens_per_s"),  # the average of the run's last session
        "steps": metrics.last_step or None,
    })
    return row


def rows_to_csv(rows: Sequence[dict], columns: Sequence[str]) -> str:
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    writer.writerow(columns)
    for row in rows:
        writer.writerow(["" if row.get(c) is None else row[c] for c in columns])
    return buffer.getvalue()


def _cell(column: str, value: Any) -> str:
    if value is None:
        return "n/a"
    if column == "tokens_per_s":
        return f"{value:,.0f}"
    if isinstance(value, float):
        return f"{value:.4f}" if math.isfinite(value) else str(value)
    return str(value).replace("|", "\\|")


def rows_to_markdown(rows: Sequence[dict], columns: Sequence[str]) -> str:
    lines = ["| " + " | ".join(columns) + " |",
             "|" + "|".join("---" if c == "run" or not _numeric(rows, c) else "---:" for c in columns) + "|"]
    lines += ["| " + " | ".join(_cell(c, row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _numeric(rows: Sequence[dict], column: str) -> bool:
    return any(isinstance(r.get(column), (int, float)) and not isinstance(r.get(column), bool) for r in rows)


def _legend_label(run: SweepRun) -> str:
    seed = () if run.seed is None else ((SEED_KEY, run.seed),)
    return ", ".join(f"{key}={value_label(value)}" for key, value in run.values + seed)


@dataclass(frozen=True)
class SweepReport:
    """The comparison of a sweep's runs, as written to its folder."""

    rows: tuple[dict, ...]
    """One row per combination (see result_row)."""

    columns: tuple[str, ...]
    """Column order of results.csv and results.md."""

    markdown: str
    """The text of results.md."""

    summary: str | None = None
    """The text of summary.md (sweeps with --seeds or measurements), else None."""


def write_report(cfg: SweepConfig, runs: Sequence[SweepRun] | None = None) -> SweepReport:
    """(Re)write results.csv, results.md and both plots from the runs' metrics.jsonl files."""
    runs = plan_runs(cfg) if runs is None else runs
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    metrics = {run.name: read_metrics(run.config.out) for run in runs}
    rows = tuple(result_row(run, metrics[run.name]) for run in runs)
    columns = ("run", *(axis.key for axis in cfg.grid), *((SEED_KEY,) if cfg.seeds is not None else ()), *RESULT_COLUMNS)
    markdown = rows_to_markdown(rows, columns)
    write_file_atomic(out / "results.csv", rows_to_csv(rows, columns).encode())
    write_file_atomic(out / "results.md", markdown.encode())
    plot_loss_curves({_legend_label(run): ([r["step"] for r in metrics[run.name].train if "loss" in r],
                                           [r["loss"] for r in metrics[run.name].train if "loss" in r])
                      for run in runs if metrics[run.name].train}, out / "loss_curves.png")
    plot_acceptance_by_position({_legend_label(run): metrics[run.name].final_eval["alpha"]
                                 for run in runs if metrics[run.name].final_eval.get("alpha")},
                                out / "acceptance_by_position.png")
    summary = None
    if cfg.seeds is not None or cfg.measure.active:
        summary = write_summary(out, [RunOutcome(configuration=value_label_of(run.values), seed=run.seed or 0,
                                                 final=metrics[run.name].final_eval, measure=read_measure(run.config.out))
                                      for run in runs], value_label_of(reference_combination(cfg)))
    return SweepReport(rows=rows, columns=columns, markdown=markdown, summary=summary)


def value_label_of(assignment: Sequence[tuple[str, Any]]) -> str:
    """A combination as "loss=ce, weighting=decay": how summary.md and its plot name it."""
    return ", ".join(f"{key}={value_label(value)}" for key, value in assignment)


def sweep_record(cfg: SweepConfig, runs: Sequence[SweepRun]) -> dict:
    """The content of sweep.json: the grid, the base config and the run names."""
    return {
        "grid": [{"key": a.key, "field": ".".join(a.path), "values": list(a.values),
                  **({"extras": [dict(e) for e in a.extras]} if a.extras else {})} for a in cfg.grid],
        "base": cfg.base.to_dict(),
        "seeds": cfg.seeds,
        "design": cfg.design,
        "planned": [dict(c) for c in planned_combinations(cfg)],
        "reference": dict(reference_combination(cfg)),
        "measure": dataclasses.asdict(cfg.measure),
        "runs": [{"name": r.name, "values": {k: v for k, v in r.values}, **({"seed": r.seed} if r.seed is not None else {})}
                 for r in runs],
    }
