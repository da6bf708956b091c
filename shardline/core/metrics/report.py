"""Evaluation's plots (learning curves, confusion matrices, residuals) and its metrics tables, as PNG files and
text. Plots are drawn on a bare :class:`matplotlib.figure.Figure` with the Agg canvas (no pyplot, no global backend
state, safe from worker threads) and written atomically: to a temporary file beside the target, then
renamed into place."""

from __future__ import annotations

import io
import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from shardline.core import storage
from shardline.core.metrics.scores import _by_support, _class_name, _same_length, _values, margins

if TYPE_CHECKING:
    from matplotlib.figure import Figure

PLOT_DPI = 100


def _new_figure(width: float, height: float) -> Figure:
    # matplotlib is imported when a plot is drawn, not with this module: ~0.4 s of CPU in every process that loads
    # the pipeline (each `shardline` command, each flow run on a worker), most of which draw nothing
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=PLOT_DPI)
    FigureCanvasAgg(fig)
    return fig


def _save_atomic(fig: Figure, path: str | Path) -> Path:
    png = io.BytesIO()
    fig.savefig(png, format="png")
    storage.write_bytes(str(path), png.getvalue())
    return Path(path)


def _as_float(value: object) -> float:
    if value is None:
        return math.nan
    try:
        return float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return math.nan


def plot_learning_curves(
    history: list[dict], path: str | Path, selected_epoch: int | None = None, select_by: str | None = None
) -> Path:
    """`learning_curves_figure`, written as a PNG to ``path`` (atomically)."""
    return _save_atomic(learning_curves_figure(history, selected_epoch, select_by), path)


def learning_curves_figure(
    history: list[dict], selected_epoch: int | None = None, select_by: str | None = None
) -> Figure:
    """Two panels: train/val loss vs epoch, and every other ``val_*`` metric vs epoch.

    ``history`` has one dict per epoch with ``epoch``, ``train_loss``, ``val_loss`` and
    optionally more ``val_*`` keys. Missing or ``None`` values leave gaps; lines carry
    markers, so a single epoch still shows as points. ``selected_epoch`` (as ``epoch`` counts,
    with ``select_by``, the metric that chose it) is marked on both panels: a dotted vertical line,
    a star on ``select_by``'s curve and a legend entry "selected: epoch 3 (val_accuracy)".
    """
    if not history:
        raise ValueError("history is empty: no epochs to plot")

    epochs = np.array([_as_float(row.get("epoch")) for row in history], dtype=float)
    epochs = np.where(np.isfinite(epochs), epochs, np.arange(1, len(history) + 1))

    def series(key: str) -> np.ndarray:
        return np.array([_as_float(row.get(key)) for row in history], dtype=float)

    def drawn(keys) -> list[str]:
        return [key for key in keys if np.any(np.isfinite(series(key)))]

    losses = drawn(["train_loss", "val_loss"])
    extra = drawn(dict.fromkeys(k for row in history for k in row if k.startswith("val_") and k != "val_loss"))

    fig = _new_figure(11.0, 4.2)
    ax_loss, ax_val = fig.subplots(1, 2)
    panels = (
        (ax_loss, "Loss", "loss", losses, "no loss values"),
        (ax_val, "Validation metrics", "", extra, "no other validation metrics"),
    )
    for ax, title, ylabel, keys, empty in panels:
        for key in keys:
            ax.plot(epochs, series(key), "--s" if key == "val_loss" else "-o", label=key, markersize=5)
        ax.set_title(title)
        ax.set_xlabel("epoch")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        if keys:
            ax.legend()
        else:
            ax.text(0.5, 0.5, empty, ha="center", va="center", transform=ax.transAxes)

    if selected_epoch is not None:
        label = f"selected: epoch {selected_epoch}" + (f" ({select_by})" if select_by else "")
        where = ax_val if select_by in extra else ax_loss  # the panel with the curve that chose it
        for ax in (ax_loss, ax_val):
            ax.axvline(selected_epoch, color="0.35", linestyle=":", linewidth=1.5, label=label if ax is where else None)
        at = np.flatnonzero(epochs == selected_epoch)
        if select_by and at.size and np.isfinite(series(select_by)[at[0]]):
            where.plot([selected_epoch], [series(select_by)[at[0]]], "*", color="0.15", markersize=13, zorder=5)
        where.legend()

    from matplotlib.ticker import MaxNLocator

    for ax in (ax_loss, ax_val):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if len(epochs) == 1:  # a single point: give the x axis some room around it
        for ax in (ax_loss, ax_val):
            ax.set_xlim(epochs[0] - 1, epochs[0] + 1)

    fig.tight_layout()
    return fig


CONFUSION_TOP_N = 20  # classes a confusion matrix draws: the most frequent in the test split, the rest folded
CONFUSION_NAME_CHARS = 24  # a longer class name is cut on the axes (the per-class table has it whole)
CONFUSION_MAX_INCHES = 16.0  # the figure's side: it grows with the classes drawn up to this
CONFUSION_NUMBER_PX = 30  # a cell narrower than this shows its colour only (its number would not be readable)


def _short(name: str) -> str:
    return name if len(name) <= CONFUSION_NAME_CHARS else name[: CONFUSION_NAME_CHARS - 1] + "\u2026"


def fold_confusion(counts, class_names: list[str], top_k: int = CONFUSION_TOP_N) -> tuple[np.ndarray, list[str], str]:
    """What a confusion matrix of the counts ``[C, C]`` (true class by predicted class) draws: the counts of
    the classes the test split has (true or predicted), their labels and a title.

    Up to ``top_k`` classes: every one, most test samples (support) first. More: the ``top_k`` with the most
    support, then one ``other (K classes)`` row and column that adds up every other class, and the title says
    "top N of M classes by test support" (``per_class_scores`` has every class). Labels are the classes'
    names cut to ``CONFUSION_NAME_CHARS`` (ids beyond ``class_names``: their number)."""
    from scipy import sparse

    counts = sparse.coo_array(counts)  # dense or sparse: the (true, predicted) pairs that occur, with their counts
    if counts.ndim != 2 or counts.shape[0] != counts.shape[1]:
        raise ValueError(f"counts must be a square [C, C] matrix (true by predicted class), got shape {counts.shape}")
    if counts.sum() == 0:
        raise ValueError("counts holds no sample (N=0): nothing to plot")
    names = list(class_names)

    _, true, predicted = margins(counts)
    seen = (true + predicted) > 0
    order = _by_support(counts)
    present = order[seen[order]]
    kept = present[:top_k]
    folded = len(present) - len(kept)
    slot = np.full(counts.shape[0], len(kept), dtype=np.int64)  # every class not kept: the last slot, 'other'
    slot[kept] = np.arange(len(kept))
    size = len(kept) + (1 if folded else 0)
    cm = np.zeros((len(kept) + 1, len(kept) + 1), dtype=np.int64)
    np.add.at(cm, (slot[counts.row], slot[counts.col]), counts.data.astype(np.int64, copy=False))

    labels = [_short(_class_name(names, c)) for c in kept.tolist()]
    if folded:
        labels.append(f"other ({folded} class{'' if folded == 1 else 'es'})")
        title = f"Confusion matrix (row-normalised): top {len(kept)} of {len(present)} classes by test support"
    else:
        title = f"Confusion matrix (row-normalised, {len(present)} class{'' if len(present) == 1 else 'es'})"
    return cm[:size, :size], labels, title


def plot_confusion_counts(
    counts,
    class_names: list[str],
    path: str | Path,
    top_k: int = CONFUSION_TOP_N,
) -> Path:
    """Row-normalised confusion matrix from the confusion counts ``[C, C]`` (true class by predicted class,
    e.g. ``ClassificationScores.confusion``): over at most ``top_k`` classes and an ``other`` row and column,
    as ``fold_confusion`` says. A cell shows its share when it is wide enough to read and the share does not
    read 0.00; rows with no samples stay all zero."""
    cm, labels, title = fold_confusion(counts, class_names, top_k)
    size = len(labels)
    cm = cm.astype(np.float64)
    row_sums = cm.sum(axis=1, keepdims=True)
    norm = np.divide(cm, row_sums, out=np.zeros_like(cm), where=row_sums > 0)

    side = min(CONFUSION_MAX_INCHES, max(4.5, 0.45 * size + 2.5))
    fig = _new_figure(side + 1.2, side)
    ax = fig.add_subplot(1, 1, 1)
    im = ax.imshow(norm, cmap="Blues", vmin=0.0, vmax=1.0, interpolation="nearest")
    fig.colorbar(im, ax=ax, fraction=0.046, pad=0.04)
    ax.set_xticks(range(size))
    ax.set_yticks(range(size))
    fontsize = 9 if size <= 12 else 7
    ax.set_xticklabels(labels, rotation=60, ha="right", fontsize=fontsize)
    ax.set_yticklabels(labels, fontsize=fontsize)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    ax.set_title(title, fontsize=10)
    cell_px = (side - 2.5) * PLOT_DPI / size  # the plot area (the side less the labels) over the cells
    if cell_px >= CONFUSION_NUMBER_PX:
        for i, j in zip(*np.nonzero(norm >= 0.005)):  # a share that reads 0.00 stays blank
            v = norm[i, j]
            ax.text(
                j,
                i,
                f"{v:.2f}",
                ha="center",
                va="center",
                fontsize=min(8.0, cell_px / 5.5),
                color="white" if v > 0.5 else "black",
            )
    fig.tight_layout()
    return _save_atomic(fig, path)


def plot_residuals(y_true: np.ndarray, y_pred: np.ndarray, path: str | Path) -> Path:
    """Predicted vs true scatter (with the identity line) beside a histogram of residuals.

    Draws the points it is given (evaluation passes ``RegressionScores.sample``, at most ``RESIDUAL_SAMPLE``),
    so the plot's cost does not grow with the split."""
    t = _values(y_true, "y_true")
    p = _values(y_pred, "y_pred")
    _same_length(t, p, "y_true", "y_pred")
    resid = p - t

    fig = _new_figure(11.0, 4.5)
    ax_sc, ax_hist = fig.subplots(1, 2)

    alpha = 0.6 if t.size <= 2000 else 0.25
    ax_sc.scatter(t, p, s=10, alpha=alpha, edgecolors="none")
    lo = float(min(t.min(), p.min()))
    hi = float(max(t.max(), p.max()))
    if hi == lo:
        lo, hi = lo - 1.0, hi + 1.0
    ax_sc.plot([lo, hi], [lo, hi], "r--", linewidth=1, label="y = x")
    ax_sc.set_xlim(lo, hi)
    ax_sc.set_ylim(lo, hi)
    ax_sc.set_xlabel("true")
    ax_sc.set_ylabel("predicted")
    ax_sc.set_title("Predicted vs true")
    ax_sc.legend(loc="upper left")
    ax_sc.grid(True, alpha=0.3)

    # equal residuals: numpy spans the bins over the value +- 0.5
    ax_hist.hist(resid, bins=int(np.clip(np.sqrt(resid.size), 5, 60)))
    ax_hist.axvline(0.0, color="r", linestyle="--", linewidth=1)
    ax_hist.set_xlabel("residual (predicted - true)")
    ax_hist.set_ylabel("count")
    ax_hist.set_title("Residuals")
    ax_hist.grid(True, alpha=0.3)

    fig.tight_layout()
    return _save_atomic(fig, path)


# --------------------------------------------------------------------------- table


READING_DIGITS = 4


def format_number(value: object, digits: int = READING_DIGITS) -> str:
    """A number for reading, to 4 significant digits (``digits``): ``0.1524``, ``12.35``, ``1235``, ``123500``;
    ``1.235e-05`` below 1e-4 and from 1e9; ``n/a`` for a missing value. For text only (reports, tables,
    tags): data (results, JSON records, run metrics) keep the full float."""
    v = _as_float(value)
    if math.isnan(v):
        return "n/a"
    if math.isinf(v):
        return "inf" if v > 0 else "-inf"
    if v == 0:
        return f"{0.0:.{digits}f}"
    scientific = f"{v:.{digits - 1}e}"
    rounded = float(scientific)  # the exponent after rounding: 9.99996 reads 10.00, not 9.99996 or 10.000
    exponent = math.floor(math.log10(abs(rounded)))
    if exponent < -4 or exponent >= 9:
        return scientific
    return f"{rounded:.{max(0, digits - 1 - exponent)}f}"


def format_duration(seconds: float) -> str:
    """A duration for reading: ``1.2 s``, ``45 s``, ``12 min``, ``3.5 h``, ``2.1 days``."""
    if seconds < 120:
        return f"{seconds:.{1 if seconds < 10 else 0}f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h" if seconds < 2 * 86400 else f"{seconds / 86400:.1f} days"


def format_metrics_table(
    model: dict[str, float],
    baseline: dict[str, float],
    directions: dict[str, str],
) -> str:
    """Markdown table ``| metric | model | baseline | better? |``, values to 4 significant digits.

    Rows follow the order of ``model`` (then metrics only in ``baseline``). ``better?`` is
    ``model``, ``baseline`` or ``tie`` by ``directions[metric]`` (``maximize``/``minimize``),
    and ``n/a`` when the direction or either value is missing.
    """
    header = "| metric | model | baseline | better? |\n|---|---:|---:|:---:|"
    keys = list(model) + [k for k in baseline if k not in model]
    lines = [header]
    for key in keys:
        m = _as_float(model.get(key))
        b = _as_float(baseline.get(key))
        direction = directions.get(key)
        if direction not in (None, "maximize", "minimize"):
            raise ValueError(f"direction for {key!r} must be 'maximize' or 'minimize', got {direction!r}")
        if direction is None or math.isnan(m) or math.isnan(b):
            better = "n/a"
        elif m == b:
            better = "tie"
        elif (m > b) == (direction == "maximize"):
            better = "model"
        else:
            better = "baseline"
        name = str(key).replace("|", "\\|")
        lines.append(f"| {name} | {format_number(m)} | {format_number(b)} | {better} |")
    return "\n".join(lines)
