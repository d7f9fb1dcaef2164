"""Real decoding per benchmark category, as the field reports it: pure functions from eval's
per-prompt rows to one row per category and one overall.

Per category and temperature: the accepted length per teacher forward as the mean over prompts
with its 95% t-interval over prompts (dflash_train.measuring.summary_statistics.t_interval), the speedup
(tokens/s with the drafter over tokens/s of the teacher alone, both summed over the category's
prompts) and, greedy, whether every output equals the teacher's. vLLM's counters are per engine
call, so its per-category accepted length (one call per category) has no interval.
"""

from __future__ import annotations

from typing import Sequence

from dflash_common.errors import quoted
from dflash_train.measuring.acceptance import DEFINITIONS, HEADLINE, RequestCounts, acceptance_summary
from dflash_train.measuring.summary_statistics import Interval, t_interval

OVERALL = "overall"
"""The row over every prompt, so no category may be named so."""
CATEGORY_CHARS = 64
"""The longest category name: it labels a table's row and a plot's bar (SPEED-Bench's longest is 20)."""


def category_problem(name: str) -> str | None:
    """What is wrong with a category name (pure): reserved, too long for the report and the plot, or
    holding characters that are not printable (a newline or an ANSI escape breaks the table and
    the plot's save); None when it is a name."""
    if name.casefold() == OVERALL:
        return f"is {name!r}, the name of the row over every prompt"
    if len(name) > CATEGORY_CHARS:
        return f"is {len(name):,} characters long, more than {CATEGORY_CHARS}"
    if not name.isprintable():
        bad = next(c for c in name if not c.isprintable())
        return f"{quoted(name, 40)} holds {bad!r}, which is not a printable character"
    return None


def categories_of(rows: Sequence[dict]) -> list[str]:
    """The categories of per-prompt rows in first-seen order."""
    return list(dict.fromkeys(r["category"] for r in rows))


def _speedup(rows: Sequence[dict]) -> float | None:
    seconds, teacher_seconds = sum(r["seconds"] for r in rows), sum(r["teacher_seconds"] for r in rows)
    if seconds <= 0 or teacher_seconds <= 0:
        return None
    return (sum(r["new_tokens"] for r in rows) / seconds) / (sum(r["teacher_new_tokens"] for r in rows) / teacher_seconds)


def request_counts(rows: Sequence[dict]) -> list[RequestCounts]:
    """The per-prompt rows' draft steps and accepted drafts (measuring.acceptance)."""
    return [RequestCounts(int(r["verify_forwards"]), int(r["accepted_drafts"])) for r in rows]


def summarize_prompts(rows: Sequence[dict], greedy: bool, max_length: float) -> dict:
    """One decoding's numbers over some prompts: accepted length (the headline, per_request_mean:
    its interval over the prompts that drafted), the three definitions with the per-request
    histogram (bins up to max_length) and the share below the floor (``acceptance``), speedup,
    output = teacher (greedy; None when sampled)."""
    drafted = [r["accepted_length"] for r in rows if r["verify_forwards"] > 0]
    interval = t_interval(drafted) if drafted else None
    return {"prompts": len(rows), "accepted_length": None if interval is None else interval_dict(interval),
            "acceptance": acceptance_summary(request_counts(rows), max_length), "speedup": _speedup(rows),
            "matched_teacher": all(r["matched_teacher"] for r in rows) if greedy else None}


def interval_dict(interval: Interval) -> dict:
    return {"mean": interval.mean, "low": interval.low, "high": interval.high, "n": interval.n}


def as_interval(record: dict) -> Interval:
    return Interval(record["mean"], record["low"], record["high"], record["n"])


def by_category(decodings: Sequence[dict], vllm_groups: dict | None = None) -> list[dict]:
    """One row per category (first-seen order), then OVERALL: for each decoding (its "temperature"
    and "per_prompt" rows, each with a "category"), summarize_prompts; with ``vllm_groups``
    (category -> vLLM's summary of that category's call), vLLM's numbers beside them."""
    first = decodings[0]["per_prompt"] if decodings else []
    names = categories_of(first) if first else [n for n in vllm_groups or {} if n != OVERALL]
    out = []
    for name in names + [OVERALL]:
        row: dict = {"category": name, "decodings": []}
        for d in decodings:
            chosen = [r for r in d["per_prompt"] if name == OVERALL or r["category"] == name]
            row["decodings"].append({"temperature": d["temperature"],
                                     **summarize_prompts(chosen, d["temperature"] == 0, d["num_speculative_tokens"] + 1)})
        if vllm_groups:
            row["vllm"] = vllm_groups.get(name)
        row["prompts"] = (row["decodings"][0]["prompts"] if row["decodings"] else
                          (row["vllm"] or {}).get("prompts", 0))
        out.append(row)
    return out


def _cell(value, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "interval":
        interval = as_interval(value)
        return f"{interval.mean:.2f}" if interval.n < 2 else f"{interval.mean:.2f} ± {interval.half_width:.2f}"
    if kind == "speedup":
        return f"{value:.2f}x"
    if kind == "match":
        return "yes" if value else "NO"
    return f"{value:.2f}"


def category_columns(rows: Sequence[dict]) -> list[tuple[str, list[str]]]:
    """The per-category table's columns: (header, one cell per row)."""
    columns = [("category", [r["category"] for r in rows]), ("prompts", [str(r["prompts"]) for r in rows])]
    temperatures = [d["temperature"] for d in rows[0]["decodings"]] if rows else []
    for i, t in enumerate(temperatures):
        columns.append((f"T={t:g} accepted", [_cell(r["decodings"][i]["accepted_length"], "interval") for r in rows]))
        columns.append((f"T={t:g} speedup", [_cell(r["decodings"][i]["speedup"], "speedup") for r in rows]))
    if 0 in temperatures:
        i = temperatures.index(0)
        columns.append(("output = teacher", [_cell(r["decodings"][i]["matched_teacher"], "match") for r in rows]))
    if rows and "vllm" in rows[0]:
        columns += [("vLLM T=0 accepted", [_cell(_vllm_headline(r["vllm"]), "") for r in rows]),
                    ("vLLM speedup", [_cell((r["vllm"] or {}).get("speedup"), "speedup") for r in rows]),
                    ("vLLM = teacher", [_cell((r["vllm"] or {}).get("matched_teacher"), "match") for r in rows])]
    return columns


def _vllm_headline(vllm: dict | None) -> float | None:
    """vLLM's accepted length by the headline definition: from its per-request counts (None
    without them; its counters give the pooled one only, which the definitions table shows)."""
    return ((vllm or {}).get("acceptance") or {}).get(HEADLINE)


SHORT_NAMES = {"per_request_mean": "per-request", "pooled": "pooled", "token_weighted": "token-wtd"}
"""The definitions' names as the definitions table's columns say them."""


def _engine_acceptances(rows: Sequence[dict]) -> list[tuple[str, list[dict | None]]]:
    """(label, each row's acceptance summary) per decoding, then vLLM's (its pooled length from
    the counters where it gave no per-request counts)."""
    out = [(f"T={d['temperature']:g}", [r["decodings"][i].get("acceptance") for r in rows])
           for i, d in enumerate(rows[0]["decodings"])] if rows else []
    if rows and "vllm" in rows[0]:
        out.append(("vLLM T=0", [(r["vllm"] or {}).get("acceptance") or {"pooled": (r["vllm"] or {}).get("accepted_length")}
                                 for r in rows]))
    return out


def definitions_table(rows: Sequence[dict]) -> str:
    """Per category, the three accepted lengths (measuring.acceptance.DEFINITIONS) and the share of
    requests below the floor, for each decoding and vLLM, as aligned text."""
    columns = [("category", [r["category"] for r in rows])]
    for label, summaries in _engine_acceptances(rows):
        for name in DEFINITIONS:
            columns.append((f"{label} {SHORT_NAMES[name]}", [_cell((a or {}).get(name), "") for a in summaries]))
        floor = next((a["below_floor"]["floor"] for a in summaries if a and "below_floor" in a), None)
        if floor is not None:
            shares = [((a or {}).get("below_floor") or {}).get("share") for a in summaries]
            columns.append((f"{label} < {floor:g}", ["-" if x is None else f"{x:.0%}" for x in shares]))
    return aligned(columns)


def histogram_lines(rows: Sequence[dict]) -> list[str]:
    """The per-request histograms as text: a header naming the bins, then per category and
    decoding the requests in each bin."""
    found = [(label, r["category"], a["histogram"]) for label, summaries in _engine_acceptances(rows)
             for r, a in zip(rows, summaries) if a and "histogram" in a]
    if not found:
        return []
    edges = found[0][2]["edges"]
    width = max(len(f"{c} {label}") for label, c, _ in found)
    head = (f"per-request accepted length: requests per bin of {edges[1] - edges[0]:g} from {edges[0]:g} to "
            f"{edges[-1]:g} (the first [{edges[0]:g}, {edges[1]:g}), the last closed)")
    return [head] + [f"{c + ' ' + label:<{width}}  " + " ".join(f"{n:>2}" for n in h["counts"]) for label, c, h in found]


def aligned(columns: list[tuple[str, list[str]]]) -> str:
    """Columns (header, cells) as left-aligned text, two spaces apart."""
    widths = [max(len(header), *(len(c) for c in cells)) for header, cells in columns]
    lines = ["  ".join(h.ljust(w) for (h, _), w in zip(columns, widths)).rstrip()]
    for i in range(len(columns[0][1]) if columns else 0):
        lines.append("  ".join(cells[i].ljust(w) for (_, cells), w in zip(columns, widths)).rstrip())
    return "\n".join(lines)


def category_table(rows: Sequence[dict]) -> str:
    """The per-category table as aligned text (accepted length: the headline, mean over prompts ± 95% half-width)."""
    return aligned(category_columns(rows))


def plot_categories(rows: Sequence[dict], path, title: str) -> None:
    """Accepted length per category: one bar per temperature (and vLLM's greedy), 95% intervals
    over prompts; below it, per category, the histogram of per-request accepted length."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from dflash_common.files import write_atomic

    series = [(f"T={d['temperature']:g}", [None if r["decodings"][i]["accepted_length"] is None
                                           else as_interval(r["decodings"][i]["accepted_length"]) for r in rows])
              for i, d in enumerate(rows[0]["decodings"])] if rows else []
    if rows and "vllm" in rows[0]:
        lengths = [_vllm_headline(r["vllm"]) for r in rows]
        series.append(("vLLM T=0", [None if x is None else Interval(x, x, x, 1) for x in lengths]))
    columns = min(4, max(len(rows), 1))
    grid_rows = -(-len(rows) // columns)
    fig = Figure(figsize=(max(6.0, 1.1 * len(rows) * max(len(series), 1) ** 0.5 + 2, 3.2 * columns), 4.5 + 2.4 * grid_rows))
    grid = fig.add_gridspec(1 + grid_rows, columns, height_ratios=[4.5] + [2.4] * grid_rows, hspace=0.6)
    ax = fig.add_subplot(grid[0, :])
    width = 0.8 / max(len(series), 1)
    for s, (label, values) in enumerate(series):
        xs = [i + (s - (len(series) - 1) / 2) * width for i, v in enumerate(values) if v is not None]
        kept = [v for v in values if v is not None]
        ax.bar(xs, [v.mean for v in kept], width, label=label, color=f"C{s}",
               yerr=[[v.mean - v.low for v in kept], [v.high - v.mean for v in kept]], capsize=3)
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r["category"] for r in rows], rotation=20 if len(rows) > 5 else 0, ha="right" if len(rows) > 5 else "center")
    ax.set_ylabel("accepted length per teacher forward")
    ax.set_title(title)
    ax.grid(alpha=0.3, axis="y")
    if series:
        ax.legend(fontsize="small")
    for k, row in enumerate(rows):
        _histogram_panel(fig.add_subplot(grid[1 + k // columns, k % columns]), row, rows)
    FigureCanvasAgg(fig)  # Agg without touching pyplot's global backend, as the sweep's plots
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=120, bbox_inches="tight"))


def _histogram_panel(ax, row: dict, rows: Sequence[dict]) -> None:
    """One category's histograms of per-request accepted length, a bar series per decoding."""
    index = rows.index(row)
    found = [(label, summaries[index]["histogram"]) for label, summaries in _engine_acceptances(rows)
             if summaries[index] and "histogram" in summaries[index]]
    for s, (label, h) in enumerate(found):
        edges, step = h["edges"], (h["edges"][1] - h["edges"][0]) / max(len(found), 1)
        ax.bar([e + s * step for e in edges[:-1]], h["counts"], step, align="edge", label=label, color=f"C{s}")
    floor = next((a["below_floor"]["floor"] for _, summaries in _engine_acceptances(rows)
                  for a in [summaries[index]] if a and "below_floor" in a), None)
    if floor is not None:
        ax.axvline(floor, color="grey", linestyle=":", linewidth=1)
    ax.set_title(f"{row['category']}: requests by accepted length", fontsize="small")
    ax.tick_params(labelsize="x-small")
