"""The sweep's figures: loss curves and acceptance by block position, one line per run."""

from __future__ import annotations

from pathlib import Path


def style(i: int) -> dict:
    # Ten colours, then the same colours dashed, dotted, ...: lines stay distinguishable in big grids.
    return {"color": f"C{i % 10}", "linestyle": ("-", "--", ":", "-.")[(i // 10) % 4]}


def save_figure(fig, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from dflash_common.files import write_atomic

    FigureCanvasAgg(fig)  # render with Agg without touching pyplot's global backend
    # a fresh temporary, never a fixed name a link could be planted at, and no link at the path
    write_atomic(path, lambda f: fig.savefig(f, format="png", dpi=120, bbox_inches="tight"))


def plot_loss_curves(curves: dict[str, tuple[list[int], list[float]]], path: str | Path) -> None:
    """Train loss against step, one line per run."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5))
    ax = fig.add_subplot()
    for i, (label, (steps, losses)) in enumerate(curves.items()):
        ax.plot(steps, losses, label=label, linewidth=1.4, **style(i))
    values = [v for _, losses in curves.values() for v in losses]
    if values and min(values) > 0:
        ax.set_yscale("log")  # losses of different kinds span orders of magnitude
    finish(fig, ax, "step", "train loss", "train loss by run", len(curves), path)


def plot_acceptance_by_position(curves: dict[str, list[float]], path: str | Path) -> None:
    """Held-out alpha_k against block position k, one line per run."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(8, 5))
    ax = fig.add_subplot()
    for i, (label, alpha) in enumerate(curves.items()):
        ax.plot(range(1, len(alpha) + 1), alpha, marker="o", markersize=3, label=label, linewidth=1.4, **style(i))
    longest = max((len(a) for a in curves.values()), default=0)
    if longest:
        ax.set_xticks(range(1, longest + 1))
    else:
        ax.text(0.5, 0.5, "no held-out evaluation (eval_sequences = 0)", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylim(0, 1.02)
    finish(fig, ax, "block position k", "held-out acceptance alpha_k", "held-out acceptance by block position",
           len(curves), path)


def finish(fig, ax, xlabel: str, ylabel: str, title: str, lines: int, path: str | Path) -> None:
    """Label the axes, add a grid and the legend, and save the figure as a PNG at `path`."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    legend(fig, ax, lines)
    save_figure(fig, Path(path))


def legend(fig, ax, count: int) -> None:
    if count == 0:
        return
    if count <= 6:
        ax.legend(fontsize="small")
    else:  # a big grid's legend would hide the lines: put it beside the axes
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
