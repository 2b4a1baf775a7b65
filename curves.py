"""curves.png: the curves a user of a run watches (reward and accuracy, response length, entropy
and KL, clip fractions, step time, loss), drawn with matplotlib from OUTPUT_DIR/metrics.csv.
``python metrics.py plot OUTPUT_DIR`` draws it by hand; a run draws it at every validation."""
from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Panel:
    """One picture of curves.png: (column, legend label) pairs on the left y axis and, for values
    of another scale, on a right one."""

    title: str
    left: tuple[tuple[str, str], ...]
    right: tuple[tuple[str, str], ...] = ()


PANELS = (
    Panel("reward and accuracy", (("reward_mean", "train reward"), ("acc_mean", "train accuracy"),
                                  ("val_reward_mean", "val reward"), ("val_acc", "val accuracy"))),
    Panel("response length (tokens)", (("response_length_mean", "mean"), ("response_length_max", "max"))),
    Panel("entropy and KL", (("entropy", "entropy"),),
          (("kl", "KL to reference (right)"), ("ppo_kl", "KL old -> new policy (right)"))),
    Panel("clip fractions (of tokens)", (("pg_clipfrac", "ratio clipped"), ("pg_clipfrac_lower", "dual clip"))),
    Panel("step time (s)", (("step_time_s", "step"), ("gen_time_s", "generation"), ("train_time_s", "train"),
                            ("sync_time_s", "weight sync"))),
    Panel("loss and gradient norm", (("policy_loss", "policy loss"),), (("grad_norm", "grad norm (right)"),)),
)


def _series(rows: list[dict[str, str]], column: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps, values) of the rows where ``column`` has a value."""
    points = [(float(row["step"]), float(row[column])) for row in rows if row.get(column)]
    return tuple(np.array(points).T) if points else (np.empty(0), np.empty(0))


def _trailing_mean(values: np.ndarray, window: int) -> np.ndarray:
    """Each value averaged with up to ``window - 1`` before it."""
    sums = np.concatenate([[0.0], np.cumsum(values)])
    ends = np.arange(1, len(values) + 1)
    starts = np.maximum(0, ends - window)
    return (sums[ends] - sums[starts]) / (ends - starts)


def _draw(axes: Any, rows: list[dict[str, str]], series: tuple[tuple[str, str], ...], *, first_color: int,
          window: int) -> list[Any]:
    """Each series as a line: a faint one of every value under the trailing mean over ``window``
    steps where there are many values, a marker on each where there are few (validation, short
    runs), so series that coincide stay apart. Returns the legend handles."""
    handles, shown = [], []  # shown: the value range each series needs on the y axis
    for index, (column, label) in enumerate(series):
        steps, values = _series(rows, column)
        if not len(values):
            continue
        color, marker = f"C{first_color + index}", "os^D"[(first_color + index) % 4] if len(values) <= 40 else None
        shown.append((values.min(), values.max()))
        if window > 1 and len(values) > 2 * window:
            axes.plot(steps, values, color=color, alpha=0.2, linewidth=0.8)
            smoothed = _trailing_mean(values, window)
            # A rare spike (a slow step, one large gradient) must not flatten the curve below it.
            shown[-1] = (min(np.percentile(values, 1), smoothed.min()), max(np.percentile(values, 99), smoothed.max()))
            values = smoothed
        handles += axes.plot(steps, values, color=color, label=label, marker=marker, markersize=5, linewidth=1.6)
    if shown:
        low, high = min(low for low, _ in shown), max(high for _, high in shown)
        margin = 0.05 * (high - low) or 0.05 * abs(high) or 0.05
        axes.set_ylim(low - margin, high + margin)
    return handles


def plot_curves(out_dir: Path) -> Path:
    """OUTPUT_DIR/curves.png: the curves a user watches, drawn from OUTPUT_DIR/metrics.csv."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    with (out_dir / "metrics.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    window = len(rows) // 40  # about 40 independent points across the run
    figure = Figure(figsize=(16, 9))
    FigureCanvasAgg(figure)  # the Agg backend by name: training machines have no display
    # Fixed margins, with room for the right-hand axes: a layout engine would double the drawing time.
    figure.subplots_adjust(left=0.05, right=0.95, bottom=0.07, top=0.92, wspace=0.3, hspace=0.3)
    for axes, panel in zip(figure.subplots(2, 3).flatten(), PANELS):
        handles = _draw(axes, rows, panel.left, first_color=0, window=window)
        if panel.right:
            handles += _draw(axes.twinx(), rows, panel.right, first_color=len(panel.left), window=window)
        axes.set_title(panel.title)
        axes.set_xlabel("step")
        axes.xaxis.set_major_locator(MaxNLocator(integer=True))
        axes.grid(alpha=0.3)
        if handles:
            axes.legend(handles=handles, fontsize=8, loc="best")
        else:
            axes.text(0.5, 0.5, "not logged in this run", ha="center", va="center", transform=axes.transAxes)
    smoothing = f" (faint: every step; bold: mean of the last {window} steps)" if window > 1 else ""
    figure.suptitle(f"{out_dir.name}: step {rows[-1]['step'] if rows else 'none yet'}{smoothing}")
    path = out_dir / "curves.png"
    figure.savefig(path, dpi=80)
    return path
