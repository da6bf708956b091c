"""The streaming scores (`ClassificationScores`, `RegressionScores`) against the whole-array reference
functions on the same data, fed in uneven batches: counts and accuracies equal exactly, sums to rounding."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

from shardline.core.metrics.report import fold_confusion, plot_confusion_counts
from shardline.core.metrics.scores import (
    ClassificationScores,
    RegressionScores,
    StrideSample,
    classification_metrics,
    label_scores,
    majority_baseline_probs,
    per_class_scores,
    regression_metrics,
)

EXACT = ("accuracy", "top5_accuracy", "macro_f1")


def batches(n: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """[lo, hi) spans covering 0..n in uneven pieces, one of them empty."""
    cuts = np.sort(rng.choice(np.arange(1, n), size=min(6, n - 1), replace=False)) if n > 1 else []
    edges = [0, *cuts.tolist(), n] if len(cuts) else [0, n]
    spans = list(zip(edges[:-1], edges[1:]))
    return [(0, 0), *spans]


def assert_same(streamed: dict, reference: dict) -> None:
    assert streamed.keys() == reference.keys()
    for key, want in reference.items():
        if key in EXACT:
            assert streamed[key] == want, key
        else:
            assert streamed[key] == pytest.approx(want, rel=1e-9, abs=1e-12), key


def probabilities(rng: np.random.Generator, n: int, c: int, ties: bool) -> np.ndarray:
    """float32 rows that sum to 1, class 0 at 0 (as `predict` gives them); with ties: coarse values, so
    argmax and top-5 meet equal probabilities."""
    logits = rng.normal(scale=3.0, size=(n, c))
    if ties:
        logits = np.round(logits)
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p[:, 0] = 0.0
    return (p / p.sum(axis=1, keepdims=True)).astype(np.float32)


@pytest.mark.parametrize(
    "n, c, ties",
    [(3000, 401, False), (3000, 401, True), (500, 4, True), (777, 6, False), (1, 12, False)],
)
def test_classification_scores_equal_the_whole_array_metrics(n, c, ties):
    rng = np.random.default_rng(c + n)
    # skewed labels with classes that never occur, and a few id-0 ('unseen') labels
    y = np.minimum(rng.zipf(1.6, size=n), c - 1).astype(np.int64)
    y[rng.random(n) < 0.02] = 0
    probs = probabilities(rng, n, c, ties)
    train_counts = np.bincount(np.minimum(rng.zipf(1.4, size=5 * n), c - 1), minlength=c).astype(np.float64)
    train_counts[0] = 0
    scores = ClassificationScores(c, train_counts)
    for lo, hi in batches(n, rng):
        scores.update(y[lo:hi], probs[lo:hi])

    assert scores.n == n and scores.confusion.sum() == n
    assert_same(scores.metrics(), classification_metrics(y, probs))
    assert_same(scores.baseline(), classification_metrics(y, majority_baseline_probs(train_counts, n)))


def test_classification_counts_folded_in_as_they_pile_up_equal_the_whole_array_metrics(monkeypatch):
    """The (true, predicted) pairs are added to the sparse counts a batch of pairs at a time: with that batch
    smaller than the scorer's, every update folds, and the counts are those of every sample at once."""
    import shardline.core.metrics.scores as scores_module

    monkeypatch.setattr(scores_module, "PENDING_PAIRS", 100)
    rng = np.random.default_rng(7)
    n, c = 2000, 50
    y = np.minimum(rng.zipf(1.6, size=n), c - 1).astype(np.int64)
    probs = probabilities(rng, n, c, ties=False)
    scores = ClassificationScores(c, np.ones(c))
    for lo, hi in batches(n, rng):
        scores.update(y[lo:hi], probs[lo:hi])
        assert scores._pending_n < 100 + (hi - lo)
    assert scores.confusion.sum() == n and scores._pending_n == 0
    assert_same(scores.metrics(), classification_metrics(y, probs))


def test_classification_baseline_with_tied_and_absent_classes():
    """Training counts that tie (the lowest id is the majority) and a majority class absent from the test."""
    train_counts = np.array([0, 5, 5, 0, 2, 2, 2, 0, 0], dtype=np.float64)
    for y in (np.array([3, 3, 4, 8, 8, 8, 0]), np.array([1, 2, 2, 6, 6])):
        scores = ClassificationScores(len(train_counts), train_counts)
        scores.update(y, np.full((len(y), len(train_counts)), 1 / len(train_counts), np.float32))
        assert_same(scores.baseline(), classification_metrics(y, majority_baseline_probs(train_counts, len(y))))


def test_classification_scores_name_what_is_wrong():
    scores = ClassificationScores(3, np.ones(3))
    with pytest.raises(ValueError, match=r"probs must be \[B, 3\].*shape \(2, 4\)"):
        scores.update(np.array([0, 1]), np.full((2, 4), 0.25))
    with pytest.raises(ValueError, match="class id 5 but probs has only 3 columns"):
        scores.update(np.array([0, 5]), np.full((2, 3), 1 / 3))
    with pytest.raises(ValueError, match="NaN"):
        scores.update(np.array([0, 1]), np.array([[np.nan, 0.5, 0.5], [0.2, 0.3, 0.5]]))
    with warnings.catch_warnings(record=True) as caught, pytest.raises(ValueError, match="N=0"):
        warnings.simplefilter("always")
        scores.metrics()
    assert not caught, [str(w.message) for w in caught]  # said once, ours (not torchmetrics' "compute before update")
    with pytest.raises(ValueError, match=r"one count per class \(3\)"):
        ClassificationScores(3, np.ones(4))


def test_regression_scores_equal_the_whole_array_metrics():
    rng = np.random.default_rng(7)
    n = 5000
    y = rng.normal(loc=1e3, scale=2.0, size=n)  # a large mean: the sum of squares must not lose it
    pred = y + rng.normal(scale=1.5, size=n)
    train_mean = 1000.7
    scores = RegressionScores(train_mean)
    for lo, hi in batches(n, rng):
        scores.update(y[lo:hi], pred[lo:hi])
    assert_same(scores.metrics(), regression_metrics(y, pred))
    assert_same(scores.baseline(), regression_metrics(y, np.full(n, train_mean)))
    t, p = scores.sample.kept
    np.testing.assert_array_equal(t, y)  # fewer than 50,000 points: every one, in order
    np.testing.assert_array_equal(p, pred)


def test_regression_scores_of_a_constant_target():
    y = np.full(10, 2.0)
    perfect, off = RegressionScores(2.0), RegressionScores(2.0)
    perfect.update(y[:4], y[:4])
    perfect.update(y[4:], y[4:])
    off.update(y, y + 1.0)
    assert perfect.metrics() == regression_metrics(y, y) == {"mae": 0.0, "rmse": 0.0, "r2": 1.0}
    assert off.metrics() == regression_metrics(y, y + 1.0)
    assert perfect.baseline()["r2"] == 1.0 and off.baseline()["r2"] == 1.0  # the mean is the constant
    with pytest.raises(ValueError, match="N=0"):
        RegressionScores(0.0).metrics()
    with pytest.raises(ValueError, match="NaN or infinite"):
        RegressionScores(0.0).update(np.array([1.0]), np.array([np.inf]))


def test_stride_sample_is_bounded_even_and_deterministic():
    data = np.arange(1000, dtype=np.float64)
    sample = StrideSample(64, columns=1)
    for lo in range(0, 1000, 37):
        sample.add(data[lo : lo + 37])
    (kept,) = sample.kept
    assert 32 <= len(kept) <= 64
    np.testing.assert_array_equal(kept, data[:: sample.stride])  # every stride-th point, from the first


def test_confusion_plot_refuses_counts_it_cannot_draw(tmp_path):
    names = [f"c{i}" for i in range(30)]
    with pytest.raises(ValueError, match=r"square \[C, C\].*\(3, 4\)"):
        plot_confusion_counts(np.zeros((3, 4), np.int64), names, tmp_path / "x.png")
    with pytest.raises(ValueError, match="N=0"):
        plot_confusion_counts(np.zeros((3, 3), np.int64), names, tmp_path / "x.png")


def test_a_confusion_matrix_over_hundreds_of_classes_draws_the_most_frequent_and_folds_the_rest(tmp_path):
    """300 classes (and id 0, never seen): the plot draws the 20 with the most test samples, by name, and one
    'other' row and column holding the rest; the per-class table has every class."""
    rng = np.random.default_rng(5)
    c = 301
    y = np.minimum(rng.zipf(1.3, size=20_000), c - 1)
    pred = np.where(rng.random(len(y)) < 0.6, y, rng.integers(1, c, size=len(y)))
    scores = ClassificationScores(c, np.ones(c))
    scores.update(y, np.eye(c, dtype=np.float32)[pred])
    names = ["<unseen>", *(f"action-{i:03d}-{'x' * 40}" for i in range(1, c))]
    support = np.bincount(y, minlength=c)
    present = int(np.count_nonzero(np.bincount(y, minlength=c) + np.bincount(pred, minlength=c)))

    counts, labels, title = fold_confusion(scores.confusion, names)
    assert title.endswith(f"top 20 of {present} classes by test support")
    assert counts.shape == (21, 21) and counts.sum() == len(y)
    top = np.lexsort((np.arange(c), -np.bincount(pred, minlength=c), -support))[:20]
    assert labels[:20] == [names[i][:23] + "\u2026" for i in top]  # long names cut, the table has them whole
    assert labels[20] == f"other ({present - 20} classes)"
    np.testing.assert_array_equal(counts[:20, :20], scores.confusion.toarray()[np.ix_(top, top)])
    assert counts[20].sum() == len(y) - support[top].sum()  # the other classes' samples, in one row
    plot = plot_confusion_counts(scores.confusion, names, tmp_path / "cm.png")
    assert plot.read_bytes()[:4] == b"\x89PNG"

    rows = per_class_scores(scores.confusion, names)
    assert len(rows) == c and {r["class"] for r in rows} == set(names)
    assert [r["support"] for r in rows] == sorted(support.tolist(), reverse=True)
    assert [r["class"] for r in rows[:20]] == [names[i] for i in top]
    f1s = [r["f1"] for r in rows if r["f1"] is not None]
    assert np.mean(f1s) == pytest.approx(label_scores(scores.confusion)["macro_f1"], rel=1e-12)


def test_a_confusion_matrix_over_few_classes_draws_every_one():
    counts = np.array([[0, 0, 0, 0], [0, 5, 1, 0], [1, 0, 2, 0], [0, 0, 3, 7]])
    folded, labels, title = fold_confusion(counts, ["<unseen>", "a", "b", "c"])
    assert labels == ["c", "a", "b", "<unseen>"]  # most test samples first; predicted only: last
    assert title == "Confusion matrix (row-normalised, 4 classes)"
    assert folded.sum() == counts.sum() and (folded[0, 0], folded[1, 2], folded[2, 3]) == (7, 1, 1)


REPO = Path(__file__).resolve().parents[1]
MANY_CLASSES_CHILD = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))  # 2 GiB of address space: a [C, C] table is 7.2 GB
import numpy as np
from shardline.core.metrics.report import fold_confusion, plot_confusion_counts
from shardline.core.metrics.scores import ClassificationScores, classification_metrics, per_class_scores
c, n = 30_000, 1024
rng = np.random.default_rng(0)
y = np.minimum(rng.zipf(1.3, size=n), c - 1)
logits = rng.normal(size=(n, c)).astype(np.float32)
logits[np.arange(n), y] += 4.0  # mostly right, so the diagonal and the rest both hold counts
probs = np.exp(logits - logits.max(axis=1, keepdims=True))
probs /= probs.sum(axis=1, keepdims=True)
scores = ClassificationScores(c, np.bincount(y, minlength=c).astype(np.float64))
for lo in range(0, n, 256):
    scores.update(y[lo : lo + 256], probs[lo : lo + 256])
counts, labels, _ = fold_confusion(scores.confusion, [f"item-{i}" for i in range(c)])
plot_confusion_counts(scores.confusion, [f"item-{i}" for i in range(c)], sys.argv[1])
print(json.dumps({"streamed": scores.metrics(), "whole": classification_metrics(y, probs), "fold": counts.tolist(),
                  "labels": labels, "classes": len(per_class_scores(scores.confusion, [])), "n": scores.n}))
"""


def test_a_target_of_thirty_thousand_classes_is_scored_without_a_classes_by_classes_table(tmp_path):
    """Next-item prediction over a click log's items: ~36,000 classes took a 10 GB confusion table (torchmetrics'
    [C, C] int64 counts) and the evaluation was killed for memory after training. The counts are sparse now (the
    pairs that occur): under a 2 GiB address-space limit, 30,000 classes score as the whole-array metrics do, the
    matrix draws its top 20 and 'other', and the per-class table has a row per class."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    png = tmp_path / "cm.png"
    child = subprocess.run([sys.executable, "-c", MANY_CLASSES_CHILD, str(png)], capture_output=True, text=True,
                           env=env, timeout=300)  # fmt: skip
    assert child.returncode == 0, child.stderr[-3000:]
    report = json.loads(child.stdout.strip().splitlines()[-1])
    assert_same(report["streamed"], report["whole"])
    assert 0.2 < report["streamed"]["accuracy"] < 0.9 and report["classes"] == 30_000
    fold = np.array(report["fold"])
    assert fold.shape == (21, 21) and fold.sum() == report["n"] and report["labels"][-1].startswith("other (")
    assert png.stat().st_size > 0
