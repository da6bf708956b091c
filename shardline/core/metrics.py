"""Evaluation metrics, naive baselines and PNG plots, in plain numpy and matplotlib.

No torch, sklearn, Prefect or MLflow here: every function takes numpy arrays (or things
``np.asarray`` accepts) and returns plain floats, arrays, strings or paths, so the module is
cheap to import and easy to test. Plots are drawn on a bare :class:`matplotlib.figure.Figure`
with the Agg canvas (no pyplot, no global backend state, safe from worker threads) and written
atomically: to a temporary file beside the target, then ``os.replace``-d into place.

Every metric is finite: empty inputs, non-finite values and labels out of range raise
``ValueError`` with a message naming the problem instead of returning NaN.

Two forms of each metric set: ``classification_metrics`` / ``regression_metrics`` take every
sample at once (the reference), and ``ClassificationScores`` / ``RegressionScores`` take batches
and keep only what the metrics need (confusion counts, sums), so scoring a test split needs memory
independent of its size; both give the same numbers (tests/test_metrics_streaming.py).
"""

from __future__ import annotations

import math
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

__all__ = [
    "classification_metrics",
    "regression_metrics",
    "ClassificationScores",
    "RegressionScores",
    "StrideSample",
    "majority_baseline_probs",
    "mean_baseline",
    "plot_learning_curves",
    "learning_curves_figure",
    "plot_confusion_matrix",
    "plot_confusion_counts",
    "fold_confusion",
    "plot_residuals",
    "format_metrics_table",
    "format_number",
    "per_class_scores",
    "CONFUSION_TOP_N",
]

LOG_LOSS_EPS = 1e-12
BASELINE_SMOOTHING = 1e-6
TOP_K = 5


# --------------------------------------------------------------------------- validation


def _labels(y: object, name: str, allow_empty: bool = False) -> np.ndarray:
    """A 1-D int64 array of class ids; floats are accepted only when they are whole numbers."""
    arr = np.asarray(y)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D class ids, got shape {arr.shape}")
    if arr.size == 0:
        if allow_empty:
            return arr.astype(np.int64)
        raise ValueError(f"{name} is empty (N=0): cannot compute metrics on zero samples")
    if arr.dtype.kind == "b":
        arr = arr.astype(np.int64)
    elif arr.dtype.kind in "iu":
        arr = arr.astype(np.int64, copy=False)
    elif arr.dtype.kind == "f":
        if not np.all(np.isfinite(arr)):
            raise ValueError(f"{name} contains NaN or infinite values")
        if not np.all(arr == np.round(arr)):
            raise ValueError(f"{name} must hold integer class ids, got non-integer floats")
        arr = arr.astype(np.int64)
    else:
        raise ValueError(f"{name} must hold integer class ids, got dtype {arr.dtype}")
    if arr.min() < 0:
        raise ValueError(f"{name} contains negative class ids (min {int(arr.min())})")
    return arr


def _values(y: object, name: str, allow_empty: bool = False) -> np.ndarray:
    """A 1-D finite float64 array (a trailing singleton axis, e.g. [N, 1], is squeezed)."""
    arr = np.asarray(y, dtype=np.float64)
    if arr.ndim == 2 and arr.shape[1] == 1:
        arr = arr[:, 0]
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if arr.size == 0 and not allow_empty:
        raise ValueError(f"{name} is empty (N=0): cannot compute metrics on zero samples")
    if not np.all(np.isfinite(arr)):
        bad = int(np.count_nonzero(~np.isfinite(arr)))
        raise ValueError(f"{name} contains {bad} NaN or infinite value(s)")
    return arr


def _same_length(a: np.ndarray, b: np.ndarray, name_a: str, name_b: str) -> None:
    if a.shape[0] != b.shape[0]:
        raise ValueError(f"{name_a} and {name_b} have different lengths ({a.shape[0]} vs {b.shape[0]})")


# --------------------------------------------------------------------------- metrics


def classification_metrics(y_true: np.ndarray, probs: np.ndarray) -> dict[str, float]:
    """Accuracy, top-5 accuracy, log loss and macro F1 of class probabilities.

    ``y_true``: int class ids ``[N]``; ``probs``: ``[N, C]`` probabilities (rows sum to 1).

    - ``accuracy``: fraction where ``argmax(probs) == y_true`` (ties go to the lowest class id).
    - ``top5_accuracy``: fraction where ``y_true`` is among the 5 highest probabilities
      (all ``C`` of them when ``C < 5``, so it is 1.0 then).
    - ``log_loss``: mean of ``-log(clip(p[y], 1e-12))``.
    - ``macro_f1``: mean F1 over the classes present in ``y_true`` or in the predictions.
    """
    y = _labels(y_true, "y_true")
    p = np.asarray(probs, dtype=np.float64)
    if p.ndim != 2:
        raise ValueError(f"probs must be 2-D [N, C], got shape {p.shape}")
    if p.shape[0] == 0:
        raise ValueError("probs is empty (N=0): cannot compute metrics on zero samples")
    if p.shape[1] == 0:
        raise ValueError("probs has zero columns (C=0): there are no classes")
    _same_length(y, p, "y_true", "probs")
    if not np.all(np.isfinite(p)):
        raise ValueError("probs contains NaN or infinite values")
    n, c = p.shape
    if y.max() >= c:
        raise ValueError(f"y_true has class id {int(y.max())} but probs has only {c} columns")

    pred = np.argmax(p, axis=1)
    accuracy = float(np.mean(pred == y))

    k = min(TOP_K, c)
    if k == c:
        top5 = 1.0
    else:
        topk = np.argpartition(-p, k - 1, axis=1)[:, :k]
        top5 = float(np.mean(np.any(topk == y[:, None], axis=1)))

    p_true = np.clip(p[np.arange(n), y], LOG_LOSS_EPS, None)
    log_loss = float(np.mean(-np.log(p_true)))

    classes = np.union1d(y, pred)
    f1s = []
    for cls in classes:
        t = y == cls
        q = pred == cls
        tp = np.count_nonzero(t & q)
        fp = np.count_nonzero(~t & q)
        fn = np.count_nonzero(t & ~q)
        f1s.append(2.0 * tp / (2.0 * tp + fp + fn))  # > 0 denominator: cls is in t or q
    macro_f1 = float(np.mean(f1s))

    return {
        "accuracy": accuracy,
        "top5_accuracy": top5,
        "log_loss": log_loss,
        "macro_f1": macro_f1,
    }


def regression_metrics(y_true: np.ndarray, y_pred: np.ndarray) -> dict[str, float]:
    """MAE, RMSE and R² of point predictions.

    ``r2 = 1 - SS_res / SS_tot``. When ``y_true`` is constant (``SS_tot == 0``) R² is
    undefined; it is reported as 1.0 for a perfect prediction and 0.0 otherwise (the
    scikit-learn ``force_finite`` convention), so the result is never NaN or infinite.
    """
    t = _values(y_true, "y_true")
    p = _values(y_pred, "y_pred")
    _same_length(t, p, "y_true", "y_pred")
    err = p - t
    mae = float(np.mean(np.abs(err)))
    rmse = float(np.sqrt(np.mean(err**2)))
    ss_res = float(np.sum(err**2))
    ss_tot = float(np.sum((t - t.mean()) ** 2))
    if ss_tot == 0.0:
        r2 = 1.0 if ss_res == 0.0 else 0.0
    else:
        r2 = 1.0 - ss_res / ss_tot
    return {"mae": mae, "rmse": rmse, "r2": float(r2)}


# --------------------------------------------------------------------------- baselines


def majority_baseline_probs(train_class_counts: np.ndarray, n: int) -> np.ndarray:
    """``[n, C]`` rows that all equal the training class distribution.

    Counts are smoothed by ``+1e-6`` and renormalised, so no class has probability zero (the
    log loss stays finite) and the argmax of every row is the majority class (the lowest id
    on ties).
    """
    counts = np.asarray(train_class_counts, dtype=np.float64)
    if counts.ndim != 1 or counts.size == 0:
        raise ValueError(f"train_class_counts must be a non-empty 1-D array, got shape {counts.shape}")
    if not np.all(np.isfinite(counts)) or np.any(counts < 0):
        raise ValueError("train_class_counts must be finite and non-negative")
    n = int(n)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    smoothed = counts + BASELINE_SMOOTHING
    dist = smoothed / smoothed.sum()
    return np.tile(dist, (n, 1))


def mean_baseline(train_mean: float, n: int) -> np.ndarray:
    """``[n]`` predictions that all equal the training-set mean target."""
    value = float(train_mean)
    if not math.isfinite(value):
        raise ValueError(f"train_mean must be finite, got {train_mean!r}")
    n = int(n)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    return np.full(n, value, dtype=np.float64)


# --------------------------------------------------------------------------- streaming: batch by batch

RESIDUAL_SAMPLE = 50_000


def _empty() -> ValueError:
    return ValueError("y_true is empty (N=0): cannot compute metrics on zero samples")


def label_scores(confusion: np.ndarray) -> dict[str, float]:
    """Accuracy and macro F1 from a confusion table (``[C, C]`` counts, true class by predicted class):
    what predicted labels alone say (served predictions carry no probabilities)."""
    n = int(confusion.sum())
    if n == 0:
        raise _empty()
    tp = np.diag(confusion)
    return {
        "accuracy": float(tp.sum() / n),
        "macro_f1": ClassificationScores._macro_f1(tp, confusion.sum(axis=0) - tp, confusion.sum(axis=1) - tp),
    }


def _class_name(names: list[str], c: int) -> str:
    """Class id ``c``'s name (its number when ``names`` has none for it)."""
    return names[c] if c < len(names) else str(c)


def _by_support(confusion: np.ndarray) -> np.ndarray:
    """Class ids, most true samples first (then most predicted, then the lowest id)."""
    ids = np.arange(confusion.shape[0])
    return np.lexsort((ids, -confusion.sum(axis=0), -confusion.sum(axis=1)))


def per_class_scores(confusion: np.ndarray, class_names: list[str]) -> list[dict]:
    """One row per class of a confusion table (``[C, C]`` counts, true class by predicted class), most true
    samples (support) first: ``class`` (its name), ``support``, ``predicted`` (how often it was predicted),
    ``precision``, ``recall`` and ``f1``. A score is None where it is undefined (precision of a class never
    predicted, recall of a class with no sample, F1 of a class with neither), so the mean of the F1s given
    is the macro F1 (``label_scores``)."""
    confusion = np.asarray(confusion)
    names = list(class_names)
    tp, support, predicted = np.diag(confusion), confusion.sum(axis=1), confusion.sum(axis=0)
    rows = []
    for c in _by_support(confusion).tolist():
        t, s, p = int(tp[c]), int(support[c]), int(predicted[c])
        rows.append(
            {
                "class": _class_name(names, c),
                "support": s,
                "predicted": p,
                "precision": t / p if p else None,
                "recall": t / s if s else None,
                "f1": 2.0 * t / (s + p) if s + p else None,  # 2tp / (2tp + fp + fn): fp = p - tp, fn = s - tp
            }
        )
    return rows


class ClassificationScores:
    """``classification_metrics`` batch by batch, and the majority baseline's, in memory independent of N.

    ``update(y_true, probs)`` takes one batch (``[B]`` class ids, ``[B, C]`` probabilities) and keeps only
    the confusion counts (``[C, C]`` int64, true class by predicted class), the top-5 hits and the sum of
    the log losses; accuracy and macro F1 follow from the counts. So ``metrics()`` equals
    ``classification_metrics`` on every batch at once: counts and accuracies exactly, the log loss to
    rounding (its terms are added in another order).

    The baseline (every sample given the training class distribution, smoothed as
    ``majority_baseline_probs`` does) predicts the same row for every sample, so ``baseline()`` is
    computed from the test samples' class counts alone, equal to ``classification_metrics(y,
    majority_baseline_probs(train_class_counts, N))`` without its ``[N, C]`` table.
    """

    def __init__(self, n_classes: int, train_class_counts: np.ndarray):
        c = int(n_classes)
        if c < 1:
            raise ValueError(f"n_classes must be >= 1, got {n_classes}")
        counts = np.asarray(train_class_counts, dtype=np.float64)
        if counts.shape != (c,):
            raise ValueError(f"train_class_counts must hold one count per class ({c}), got shape {counts.shape}")
        if not np.all(np.isfinite(counts)) or np.any(counts < 0):
            raise ValueError("train_class_counts must be finite and non-negative")
        self.n_classes = c
        self.train_class_counts = counts
        self.confusion = np.zeros((c, c), dtype=np.int64)
        self.n = 0
        self.top_k_hits = 0
        self.log_loss_sum = 0.0

    def update(self, y_true: np.ndarray, probs: np.ndarray) -> None:
        """Count one batch: ``y_true`` ``[B]`` class ids, ``probs`` ``[B, C]`` (float32 is widened first, as
        ``classification_metrics`` does, so ties and clipping fall the same way)."""
        y = _labels(y_true, "y_true", allow_empty=True)
        p = np.asarray(probs, dtype=np.float64)
        c = self.n_classes
        if p.ndim != 2 or p.shape[1] != c:
            raise ValueError(f"probs must be [B, {c}] (one column per class), got shape {p.shape}")
        _same_length(y, p, "y_true", "probs")
        if y.size == 0:
            return
        if not np.all(np.isfinite(p)):
            raise ValueError("probs contains NaN or infinite values")
        if y.max() >= c:
            raise ValueError(f"y_true has class id {int(y.max())} but probs has only {c} columns")
        pred = np.argmax(p, axis=1)
        np.add.at(self.confusion, (y, pred), 1)
        k = min(TOP_K, c)
        if k == c:
            self.top_k_hits += len(y)
        else:
            topk = np.argpartition(-p, k - 1, axis=1)[:, :k]
            self.top_k_hits += int(np.count_nonzero(np.any(topk == y[:, None], axis=1)))
        p_true = np.clip(p[np.arange(len(y)), y], LOG_LOSS_EPS, None)
        self.log_loss_sum += float(np.sum(-np.log(p_true)))
        self.n += len(y)

    @property
    def true_counts(self) -> np.ndarray:
        """``[C]`` samples seen per true class."""
        return self.confusion.sum(axis=1)

    @staticmethod
    def _macro_f1(tp: np.ndarray, fp: np.ndarray, fn: np.ndarray) -> float:
        """Mean F1 over the classes with a true or a predicted sample (as ``classification_metrics``)."""
        seen = (tp + fp + fn) > 0
        tp, fp, fn = tp[seen], fp[seen], fn[seen]
        return float(np.mean(2.0 * tp / (2.0 * tp + fp + fn)))

    def metrics(self) -> dict[str, float]:
        """What ``classification_metrics`` reports for every sample counted so far."""
        label = label_scores(self.confusion)
        return {
            "accuracy": label["accuracy"],
            "top5_accuracy": float(self.top_k_hits / self.n),
            "log_loss": self.log_loss_sum / self.n,
            "macro_f1": label["macro_f1"],
        }

    def baseline(self) -> dict[str, float]:
        """What ``classification_metrics`` reports for the majority baseline on the samples counted so far:
        from the training class distribution and the test samples' class counts."""
        if self.n == 0:
            raise _empty()
        smoothed = self.train_class_counts + BASELINE_SMOOTHING
        dist = smoothed / smoothed.sum()
        true = self.true_counts
        n, c = self.n, self.n_classes
        majority = int(np.argmax(dist))  # every sample's prediction (the lowest id on ties)
        k = min(TOP_K, c)
        # the same selection classification_metrics makes for each (identical) row
        top = np.arange(c) if k == c else np.argpartition(-dist[None, :], k - 1, axis=1)[0, :k]
        present = true > 0
        log_loss = np.sum(true[present] * -np.log(np.clip(dist[present], LOG_LOSS_EPS, None))) / n
        tp = np.zeros(c, np.int64)
        tp[majority] = true[majority]
        fp = np.zeros(c, np.int64)
        fp[majority] = n - true[majority]
        return {
            "accuracy": float(true[majority] / n),
            "top5_accuracy": 1.0 if k == c else float(true[top].sum() / n),
            "log_loss": float(log_loss),
            "macro_f1": self._macro_f1(tp, fp, true - tp),
        }


class StrideSample:
    """At most ``size`` points of a stream, evenly spread and deterministic: the points whose index is a
    multiple of ``stride`` (0, stride, 2 * stride, ...), the stride doubling (every other kept point
    dropped) whenever the sample would grow past ``size``. So a stream of at most ``size`` points is kept
    whole and in order, and a longer one keeps between ``size / 2`` and ``size`` of its points."""

    def __init__(self, size: int, columns: int = 2):
        if int(size) < 1:
            raise ValueError(f"size must be >= 1, got {size}")
        self.size = int(size)
        self.stride = 1
        self.seen = 0
        self.kept = [np.zeros(0, np.float64) for _ in range(columns)]

    def add(self, *columns: np.ndarray) -> None:
        n = len(columns[0])
        first = -self.seen % self.stride  # the first index of this chunk that is a multiple of the stride
        self.kept = [
            np.concatenate([k, np.asarray(c, np.float64)[first :: self.stride]]) for k, c in zip(self.kept, columns)
        ]
        self.seen += n
        while len(self.kept[0]) > self.size:
            self.kept = [k[::2] for k in self.kept]
            self.stride *= 2


class RegressionScores:
    """``regression_metrics`` batch by batch, and the training-mean baseline's, in memory independent of N.

    ``update(y_true, y_pred)`` takes one batch and keeps running sums: of the absolute and squared errors
    (of the model and of the baseline, which predicts ``train_mean`` for every sample), and the count,
    mean and sum of squared deviations of ``y_true`` merged batch by batch (Chan et al.'s pairwise update,
    as exact as the two-pass sum), from which R² follows. So ``metrics()`` and ``baseline()`` equal
    ``regression_metrics`` on every batch at once, to rounding. A constant ``y_true`` is told by its
    minimum and maximum, so R² is then 1.0 or 0.0 exactly (``regression_metrics`` can see a non-zero
    sum of squares from the rounding of a mean such as that of [0.1, 0.1, 0.1]).

    ``sample`` keeps at most ``sample_size`` (true, predicted) pairs, a ``StrideSample``, for a plot.
    """

    def __init__(self, train_mean: float, sample_size: int = RESIDUAL_SAMPLE):
        value = float(train_mean)
        if not math.isfinite(value):
            raise ValueError(f"train_mean must be finite, got {train_mean!r}")
        self.train_mean = value
        self.n = 0
        self.mean = 0.0  # of y_true
        self.ss_tot = 0.0  # sum of squared deviations of y_true from its mean
        self.lo, self.hi = math.inf, -math.inf
        self.sums = {"model": [0.0, 0.0], "baseline": [0.0, 0.0]}  # absolute, squared errors
        self.sample = StrideSample(sample_size)

    def update(self, y_true: np.ndarray, y_pred: np.ndarray) -> None:
        t = _values(y_true, "y_true", allow_empty=True)
        p = _values(y_pred, "y_pred", allow_empty=True)
        _same_length(t, p, "y_true", "y_pred")
        b = len(t)
        if b == 0:
            return
        for key, err in (("model", p - t), ("baseline", self.train_mean - t)):
            self.sums[key][0] += float(np.sum(np.abs(err)))
            self.sums[key][1] += float(np.sum(err**2))
        mean_b = float(t.mean())
        ss_b = float(np.sum((t - mean_b) ** 2))
        n = self.n + b
        delta = mean_b - self.mean
        self.ss_tot += ss_b + delta * delta * self.n * b / n
        self.mean += delta * b / n
        self.n = n
        self.lo, self.hi = min(self.lo, float(t.min())), max(self.hi, float(t.max()))
        self.sample.add(t, p)

    def _scores(self, key: str) -> dict[str, float]:
        if self.n == 0:
            raise _empty()
        abs_sum, sq_sum = self.sums[key]
        if self.lo == self.hi:  # constant y_true: R² undefined, reported as regression_metrics does
            r2 = 1.0 if sq_sum == 0.0 else 0.0
        else:
            r2 = 1.0 - sq_sum / self.ss_tot
        return {"mae": abs_sum / self.n, "rmse": math.sqrt(sq_sum / self.n), "r2": float(r2)}

    def metrics(self) -> dict[str, float]:
        """What ``regression_metrics`` reports for every sample counted so far."""
        return self._scores("model")

    def baseline(self) -> dict[str, float]:
        """What ``regression_metrics`` reports for the training-mean baseline on the samples counted so far."""
        return self._scores("baseline")


# --------------------------------------------------------------------------- plots


PLOT_DPI = 100


def _new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height), dpi=PLOT_DPI)
    FigureCanvasAgg(fig)
    return fig


def _save_atomic(fig: Figure, path: str | Path) -> Path:
    """Write ``fig`` as PNG to a temporary file beside ``path``, then rename it into place."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".png", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fig.savefig(fh, format="png")
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    return target


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
    if not all(isinstance(row, Mapping) for row in history):
        raise ValueError("history must be a list of dicts, one per epoch")

    epochs = np.array([_as_float(row.get("epoch", i + 1)) for i, row in enumerate(history)], dtype=float)
    epochs = np.where(np.isfinite(epochs), epochs, np.arange(1, len(history) + 1))

    def series(key: str) -> np.ndarray:
        return np.array([_as_float(row.get(key)) for row in history], dtype=float)

    extra: list[str] = []
    for row in history:
        for key in row:
            if key.startswith("val_") and key != "val_loss" and key not in extra:
                if np.any(np.isfinite(series(key))):
                    extra.append(key)

    fig = _new_figure(11.0, 4.2)
    ax_loss, ax_val = fig.subplots(1, 2)

    plotted = False
    for key, style in (("train_loss", "-o"), ("val_loss", "--s")):
        ys = series(key)
        if np.any(np.isfinite(ys)):
            ax_loss.plot(epochs, ys, style, label=key, markersize=5)
            plotted = True
    ax_loss.set_title("Loss")
    ax_loss.set_xlabel("epoch")
    ax_loss.set_ylabel("loss")
    ax_loss.grid(True, alpha=0.3)
    if plotted:
        ax_loss.legend()
    else:
        ax_loss.text(0.5, 0.5, "no loss values", ha="center", va="center", transform=ax_loss.transAxes)

    for key in extra:
        ax_val.plot(epochs, series(key), "-o", label=key, markersize=5)
    ax_val.set_title("Validation metrics")
    ax_val.set_xlabel("epoch")
    ax_val.grid(True, alpha=0.3)
    if extra:
        ax_val.legend()
    else:
        ax_val.text(0.5, 0.5, "no other validation metrics", ha="center", va="center", transform=ax_val.transAxes)

    if selected_epoch is not None:
        label = f"selected: epoch {selected_epoch}" + (f" ({select_by})" if select_by else "")
        where = ax_val if select_by in extra else ax_loss  # the panel with the curve that chose it
        for ax in (ax_loss, ax_val):
            ax.axvline(selected_epoch, color="0.35", linestyle=":", linewidth=1.5, label=label if ax is where else None)
        at = np.flatnonzero(epochs == selected_epoch)
        if select_by and at.size and np.isfinite(series(select_by)[at[0]]):
            where.plot([selected_epoch], [series(select_by)[at[0]]], "*", color="0.15", markersize=13, zorder=5)
        where.legend()

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


def plot_confusion_matrix(
    y_true: np.ndarray,
    y_pred: np.ndarray,
    class_names: list[str],
    path: str | Path,
    top_k: int = CONFUSION_TOP_N,
) -> Path:
    """Row-normalised confusion matrix over the ``top_k`` most frequent true classes, from class ids
    (``plot_confusion_counts`` draws it from the counts)."""
    t = _labels(y_true, "y_true")
    p = _labels(y_pred, "y_pred")
    _same_length(t, p, "y_true", "y_pred")
    c = int(max(t.max(), p.max())) + 1
    counts = np.zeros((c, c), dtype=np.int64)
    np.add.at(counts, (t, p), 1)
    return plot_confusion_counts(counts, class_names, path, top_k)


def _short(name: str) -> str:
    return name if len(name) <= CONFUSION_NAME_CHARS else name[: CONFUSION_NAME_CHARS - 1] + "\u2026"


def fold_confusion(
    counts: np.ndarray, class_names: list[str], top_k: int = CONFUSION_TOP_N
) -> tuple[np.ndarray, list[str], str]:
    """What a confusion matrix of the counts ``[C, C]`` (true class by predicted class) draws: the counts of
    the classes the test split has (true or predicted), their labels and a title.

    Up to ``top_k`` classes: every one, most test samples (support) first. More: the ``top_k`` with the most
    support, then one ``other (K classes)`` row and column that adds up every other class, and the title says
    "top N of M classes by test support" (``per_class_scores`` has every class). Labels are the classes'
    names cut to ``CONFUSION_NAME_CHARS`` (ids beyond ``class_names``: their number)."""
    counts = np.asarray(counts)
    if counts.ndim != 2 or counts.shape[0] != counts.shape[1]:
        raise ValueError(f"counts must be a square [C, C] matrix (true by predicted class), got shape {counts.shape}")
    if counts.dtype.kind not in "iu" or (counts.size and counts.min() < 0):
        raise ValueError(f"counts must be non-negative integers, got dtype {counts.dtype}")
    if counts.sum() == 0:
        raise ValueError("counts holds no sample (N=0): nothing to plot")
    top_k = int(top_k)
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k}")
    names = list(class_names)

    seen = (counts.sum(axis=0) + counts.sum(axis=1)) > 0
    order = _by_support(counts)
    present = order[seen[order]]
    kept = present[:top_k]
    folded = len(present) - len(kept)
    slot = np.full(counts.shape[0], len(kept), dtype=np.int64)  # every class not kept: the last slot, 'other'
    slot[kept] = np.arange(len(kept))
    size = len(kept) + (1 if folded else 0)
    cm = np.zeros((len(kept) + 1, len(kept) + 1), dtype=np.int64)
    np.add.at(cm, (slot[:, None], slot[None, :]), counts.astype(np.int64, copy=False))

    labels = [_short(_class_name(names, c)) for c in kept.tolist()]
    if folded:
        labels.append(f"other ({folded} class{'' if folded == 1 else 'es'})")
        title = f"Confusion matrix (row-normalised): top {len(kept)} of {len(present)} classes by test support"
    else:
        title = f"Confusion matrix (row-normalised, {len(present)} class{'' if len(present) == 1 else 'es'})"
    return cm[:size, :size], labels, title


def plot_confusion_counts(
    counts: np.ndarray,
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

    Draws the points it is given: evaluation passes ``RegressionScores.sample``, every point of a test
    split of at most 50,000 (``RESIDUAL_SAMPLE``) and an evenly strided, deterministic sample of
    25,000 to 50,000 of a larger one, so the plot's cost does not grow with the split."""
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

    bins = int(np.clip(np.sqrt(resid.size), 5, 60))
    if np.ptp(resid) == 0:
        r0 = float(resid[0])
        ax_hist.hist(resid, bins=bins, range=(r0 - 0.5, r0 + 0.5))
    else:
        ax_hist.hist(resid, bins=bins)
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
        if direction is not None:
            direction = str(direction).strip().lower()
            if direction not in ("maximize", "minimize"):
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
