"""Evaluation metrics and naive baselines.

The streaming scorers count on scipy's sparse arrays (the confusion counts: only the (true, predicted)
pairs that occur, so a target of 30,000 classes needs no [C, C] table) and torchmetrics (MAE, RMSE, R²,
imported when a scorer is made); the rest is numpy.

Every metric is finite: empty inputs, non-finite values and labels out of range raise
``ValueError`` with a message naming the problem instead of returning NaN.

Two forms of each metric set: ``classification_metrics`` / ``regression_metrics`` take every
sample at once (the reference), and ``ClassificationScores`` / ``RegressionScores`` take batches
and keep only what the metrics need (confusion counts, torchmetrics' sums), so scoring a
test split needs memory independent of its size; both give the same numbers
(tests/test_metrics_streaming.py).
"""

from __future__ import annotations

import math

import numpy as np

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


def _check_probs(y: np.ndarray, p: np.ndarray) -> None:
    """Finite probabilities, and a column for every class id in ``y`` (non-empty)."""
    if not np.all(np.isfinite(p)):
        raise ValueError("probs contains NaN or infinite values")
    if y.max() >= p.shape[1]:
        raise ValueError(f"y_true has class id {int(y.max())} but probs has only {p.shape[1]} columns")


# --------------------------------------------------------------------------- metrics


def _top_k_hits(y: np.ndarray, p: np.ndarray) -> int:
    """How many samples have their class among the ``TOP_K`` highest probabilities of their row (every
    sample when there are at most ``TOP_K`` classes)."""
    k = min(TOP_K, p.shape[1])
    if k == p.shape[1]:
        return len(y)
    topk = np.argpartition(-p, k - 1, axis=1)[:, :k]
    return int(np.count_nonzero(np.any(topk == y[:, None], axis=1)))


def _log_losses(y: np.ndarray, p: np.ndarray) -> np.ndarray:
    """Each sample's ``-log(clip(p[y], 1e-12))``."""
    return -np.log(np.clip(p[np.arange(len(y)), y], LOG_LOSS_EPS, None))


def _macro_f1(tp: np.ndarray, fp: np.ndarray, fn: np.ndarray) -> float:
    """Mean F1 over the classes with a true or a predicted sample, from per-class counts."""
    seen = (tp + fp + fn) > 0
    tp, fp, fn = tp[seen], fp[seen], fn[seen]
    return float(np.mean(2.0 * tp / (2.0 * tp + fp + fn)))


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
    _check_probs(y, p)
    n, c = p.shape

    pred = np.argmax(p, axis=1)
    hit = pred == y
    tp = np.bincount(y[hit], minlength=c)  # per class
    fp, fn = np.bincount(pred, minlength=c) - tp, np.bincount(y, minlength=c) - tp
    return {
        "accuracy": float(np.mean(hit)),
        "top5_accuracy": _top_k_hits(y, p) / n,
        "log_loss": float(np.mean(_log_losses(y, p))),
        "macro_f1": _macro_f1(tp, fp, fn),
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


# --------------------------------------------------------------------------- streaming: batch by batch

RESIDUAL_SAMPLE = 50_000
PENDING_PAIRS = 1 << 20  # (true, predicted) pairs a ClassificationScores buffers before adding them to its counts


def _empty() -> ValueError:
    return ValueError("y_true is empty (N=0): cannot compute metrics on zero samples")


def sparse_confusion(y_true: np.ndarray, y_pred: np.ndarray, n_classes: int):
    """The confusion counts of class ids ``y_true`` against ``y_pred`` (``[C, C]``, true class by predicted
    class) as a scipy sparse array: only the pairs that occur are stored."""
    from scipy import sparse

    ones = np.ones(len(y_true), np.int64)
    return sparse.coo_array((ones, (y_true, y_pred)), shape=(n_classes, n_classes)).tocsr()


def margins(confusion) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(true positives, true samples, predicted samples) per class of a confusion table (``[C, C]`` counts,
    true class by predicted class; a numpy array or a scipy sparse one), each a 1-D int64 array."""
    flat = lambda a: np.asarray(a).reshape(-1).astype(np.int64)
    return flat(confusion.diagonal()), flat(confusion.sum(axis=1)), flat(confusion.sum(axis=0))


def label_scores(confusion) -> dict[str, float]:
    """Accuracy and macro F1 from a confusion table (``[C, C]`` counts, true class by predicted class, dense
    or sparse): what predicted labels alone say (served predictions carry no probabilities)."""
    tp, true, predicted = margins(confusion)
    n = int(true.sum())
    if n == 0:
        raise _empty()
    return {"accuracy": float(tp.sum() / n), "macro_f1": _macro_f1(tp, predicted - tp, true - tp)}


def _class_name(names: list[str], c: int) -> str:
    """Class id ``c``'s name (its number when ``names`` has none for it)."""
    return names[c] if c < len(names) else str(c)


def _by_support(confusion) -> np.ndarray:
    """Class ids, most true samples first (then most predicted, then the lowest id)."""
    _, true, predicted = margins(confusion)
    return np.lexsort((np.arange(len(true)), -predicted, -true))


def per_class_scores(confusion, class_names: list[str]) -> list[dict]:
    """One row per class of a confusion table (``[C, C]`` counts, true class by predicted class), most true
    samples (support) first: ``class`` (its name), ``support``, ``predicted`` (how often it was predicted),
    ``precision``, ``recall`` and ``f1``. A score is None where it is undefined (precision of a class never
    predicted, recall of a class with no sample, F1 of a class with neither), so the mean of the F1s given
    is the macro F1 (``label_scores``)."""
    names = list(class_names)
    tp, support, predicted = margins(confusion)
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


def _regression_metrics():
    """torchmetrics' streaming MAE, RMSE and R², their sums kept in float64."""
    import torch
    from torchmetrics import MetricCollection
    from torchmetrics.regression import MeanAbsoluteError, MeanSquaredError, R2Score

    collection = MetricCollection(
        {"mae": MeanAbsoluteError(), "rmse": MeanSquaredError(squared=False), "r2": R2Score()}, compute_groups=False
    )
    return collection.set_dtype(torch.float64)


class ClassificationScores:
    """``classification_metrics`` batch by batch, and the majority baseline's, in memory independent of N.

    ``update(y_true, probs)`` takes one batch (``[B]`` class ids, ``[B, C]`` probabilities) into the
    confusion counts (``[C, C]``, true class by predicted class, sparse: the pairs that occur, at most one a
    sample, so 30,000 classes need no 7 GB table) and adds its top-5 hits and log losses; accuracy and macro
    F1 follow from the counts in float64. So ``metrics()`` equals
    ``classification_metrics`` on every batch at once: counts and accuracies exactly, the log loss to
    rounding (its terms are added in another order).

    The baseline (every sample given the training class distribution, smoothed as
    ``majority_baseline_probs`` does) predicts the same row for every sample, so ``baseline()`` is
    computed from the test samples' class counts alone, equal to ``classification_metrics(y,
    majority_baseline_probs(train_class_counts, N))`` without its ``[N, C]`` table.
    """

    def __init__(self, n_classes: int, train_class_counts: np.ndarray):
        c = int(n_classes)
        counts = np.asarray(train_class_counts, dtype=np.float64)
        if counts.shape != (c,):
            raise ValueError(f"train_class_counts must hold one count per class ({c}), got shape {counts.shape}")
        self.n_classes = c
        self.train_class_counts = counts
        self.n = 0
        self.top_k_hits = 0
        self.log_loss_sum = 0.0
        self._confusion = sparse_confusion(np.zeros(0, np.int64), np.zeros(0, np.int64), c)
        self._pending: list[tuple[np.ndarray, np.ndarray]] = []  # (true, predicted) ids not yet in the counts
        self._pending_n = 0

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
        _check_probs(y, p)
        self._pending.append((y, np.argmax(p, axis=1)))
        self._pending_n += len(y)
        if self._pending_n >= PENDING_PAIRS:  # folded in a million at a time: a sum per batch would cost the
            self._fold()  # whole table's size per batch (millions of test windows in batches of a few hundred)
        self.top_k_hits += _top_k_hits(y, p)
        self.log_loss_sum += float(np.sum(_log_losses(y, p)))
        self.n += len(y)

    def _fold(self) -> None:
        if self._pending:
            y, pred = (np.concatenate(a) for a in zip(*self._pending))
            self._confusion = self._confusion + sparse_confusion(y, pred, self.n_classes)
            self._pending, self._pending_n = [], 0

    @property
    def confusion(self):
        """``[C, C]`` counts so far (int64), true class by predicted class: a scipy sparse array (``.toarray()``
        for a dense one, of C x C int64)."""
        self._fold()
        return self._confusion

    def metrics(self) -> dict[str, float]:
        """What ``classification_metrics`` reports for every sample counted so far."""
        if self.n == 0:
            raise _empty()
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
        dist = majority_baseline_probs(self.train_class_counts, 1)[0]  # the row every sample is given
        _, true, _ = margins(self.confusion)  # samples per true class
        n, c = self.n, self.n_classes
        majority = int(np.argmax(dist))  # every sample's prediction (the lowest id on ties)
        k = min(TOP_K, c)
        # the same selection classification_metrics makes for each (identical) row: every class when k == c
        top = np.argpartition(-dist[None, :], k - 1, axis=1)[0, :k]
        present = true > 0
        log_loss = np.sum(true[present] * -np.log(np.clip(dist[present], LOG_LOSS_EPS, None))) / n
        tp = np.zeros(c, np.int64)
        tp[majority] = true[majority]
        fp = np.zeros(c, np.int64)
        fp[majority] = n - true[majority]
        return {
            "accuracy": float(true[majority] / n),
            "top5_accuracy": float(true[top].sum() / n),
            "log_loss": float(log_loss),
            "macro_f1": _macro_f1(tp, fp, true - tp),
        }


class StrideSample:
    """At most ``size`` points of a stream, evenly spread and deterministic: the points whose index is a
    multiple of ``stride`` (0, stride, 2 * stride, ...), the stride doubling (every other kept point
    dropped) whenever the sample would grow past ``size``. So a stream of at most ``size`` points is kept
    whole and in order, and a longer one keeps between ``size / 2`` and ``size`` of its points."""

    def __init__(self, size: int, columns: int = 2):
        self.size = size
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

    ``update(y_true, y_pred)`` takes one batch into torchmetrics' MAE, RMSE and R² (their states in
    float64: sums of errors and of ``y_true``), of the model and of the baseline (``train_mean`` for every
    sample). So ``metrics()`` and ``baseline()`` equal ``regression_metrics`` on every batch at once, to
    rounding. A constant ``y_true`` is told by its minimum and maximum, so R² is then 1.0 or 0.0 exactly
    (``regression_metrics`` can see a non-zero sum of squares from the rounding of a mean such as that of
    [0.1, 0.1, 0.1]).

    ``sample`` keeps at most ``RESIDUAL_SAMPLE`` (true, predicted) pairs, a ``StrideSample``, for a plot.
    """

    def __init__(self, train_mean: float):
        self.train_mean = float(train_mean)
        self.n = 0
        self.lo, self.hi = math.inf, -math.inf
        self._metrics = {"model": _regression_metrics(), "baseline": _regression_metrics()}
        self.sample = StrideSample(RESIDUAL_SAMPLE)

    def update(self, y_true: np.ndarray, y_pred: np.ndarray) -> None:
        t = _values(y_true, "y_true", allow_empty=True)
        p = _values(y_pred, "y_pred", allow_empty=True)
        _same_length(t, p, "y_true", "y_pred")
        if len(t) == 0:
            return
        import torch

        truth = torch.from_numpy(t)
        self._metrics["model"].update(torch.from_numpy(p), truth)
        self._metrics["baseline"].update(torch.full_like(truth, self.train_mean), truth)
        self.n += len(t)
        self.lo, self.hi = min(self.lo, float(t.min())), max(self.hi, float(t.max()))
        self.sample.add(t, p)

    def _scores(self, key: str) -> dict[str, float]:
        if self.n == 0:
            raise _empty()
        out = {k: float(v) for k, v in self._metrics[key].compute().items()}
        if self.lo == self.hi:  # constant y_true: R² undefined, reported as regression_metrics does
            out["r2"] = 1.0 if out["rmse"] == 0.0 else 0.0
        return out

    def metrics(self) -> dict[str, float]:
        """What ``regression_metrics`` reports for every sample counted so far."""
        return self._scores("model")

    def baseline(self) -> dict[str, float]:
        """What ``regression_metrics`` reports for the training-mean baseline on the samples counted so far."""
        return self._scores("baseline")
