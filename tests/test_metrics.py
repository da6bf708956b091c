"""Fast tests of shardline.core.metrics against hand-computed values."""

from __future__ import annotations

import math
import os
from pathlib import Path

import numpy as np
import pytest

from shardline.core.metrics.report import (
    format_metrics_table,
    format_number,
    plot_confusion_counts,
    plot_learning_curves,
    plot_residuals,
)
from shardline.core.metrics.scores import (
    classification_metrics,
    label_scores,
    majority_baseline_probs,
    per_class_scores,
    regression_metrics,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def assert_png(path: Path) -> None:
    path = Path(path)
    assert path.is_file()
    data = path.read_bytes()
    assert len(data) > 1000
    assert data[:8] == PNG_SIGNATURE
    # atomic write: no temporary files left behind beside the plot
    assert [p.name for p in path.parent.iterdir() if p.name.startswith(".tmp-")] == []


# --------------------------------------------------------------------------- classification

# 4 samples, 6 classes (so top-5 is not trivially 1.0).
Y4 = np.array([0, 1, 2, 2])
P4 = np.array(
    [
        [0.70, 0.10, 0.10, 0.05, 0.05, 0.00],  # pred 0, right
        [0.50, 0.40, 0.10, 0.00, 0.00, 0.00],  # pred 0, wrong; true class 2nd -> in top 5
        [0.10, 0.10, 0.80, 0.00, 0.00, 0.00],  # pred 2, right
        [0.30, 0.25, 0.01, 0.20, 0.14, 0.10],  # pred 0, wrong; true class last -> not in top 5
    ]
)


def test_classification_hand_computed():
    m = classification_metrics(Y4, P4)
    assert set(m) == {"accuracy", "top5_accuracy", "log_loss", "macro_f1"}
    assert m["accuracy"] == pytest.approx(2 / 4)
    assert m["top5_accuracy"] == pytest.approx(3 / 4)
    expected_ll = -(math.log(0.7) + math.log(0.4) + math.log(0.8) + math.log(0.01)) / 4
    assert m["log_loss"] == pytest.approx(expected_ll)
    # preds [0,0,2,0] vs true [0,1,2,2]:
    # class 0: tp1 fp2 fn0 -> 2/4; class 1: tp0 fp0 fn1 -> 0; class 2: tp1 fp0 fn1 -> 2/3
    assert m["macro_f1"] == pytest.approx((0.5 + 0.0 + 2 / 3) / 3)
    assert all(isinstance(v, float) and math.isfinite(v) for v in m.values())


def test_classification_perfect_and_fewer_than_five_classes():
    y = np.array([0, 1, 2, 1])
    probs = np.eye(3)[y]
    m = classification_metrics(y, probs)
    assert m["accuracy"] == 1.0
    assert m["top5_accuracy"] == 1.0  # C < 5: every class is in the "top 5"
    assert m["macro_f1"] == 1.0
    assert m["log_loss"] == pytest.approx(0.0, abs=1e-12)


def test_classification_macro_f1_counts_predicted_only_classes():
    # class 2 is never true but is predicted once: it joins the average with F1 0
    y = np.array([0, 0, 1, 1])
    probs = np.array([[0.9, 0.05, 0.05], [0.1, 0.1, 0.8], [0.1, 0.8, 0.1], [0.2, 0.7, 0.1]])
    m = classification_metrics(y, probs)
    # class 0: tp1 fp0 fn1 -> 2/3; class 1: tp2 -> 1; class 2: tp0 fp1 -> 0
    assert m["macro_f1"] == pytest.approx((2 / 3 + 1.0 + 0.0) / 3)
    assert m["accuracy"] == pytest.approx(3 / 4)


def test_classification_log_loss_clips_zero_probability():
    y = np.array([1])
    probs = np.array([[1.0, 0.0]])
    m = classification_metrics(y, probs)
    assert m["log_loss"] == pytest.approx(-math.log(1e-12))
    assert m["accuracy"] == 0.0
    assert m["macro_f1"] == 0.0


def test_classification_single_class():
    y = np.zeros(5, dtype=int)
    probs = np.ones((5, 1))
    m = classification_metrics(y, probs)
    assert m == {"accuracy": 1.0, "top5_accuracy": 1.0, "log_loss": pytest.approx(0.0), "macro_f1": 1.0}


def test_classification_rejects_empty_and_bad_input():
    with pytest.raises(ValueError, match="N=0"):
        classification_metrics(np.array([], dtype=int), np.zeros((0, 3)))
    with pytest.raises(ValueError, match="different lengths"):
        classification_metrics(np.array([0, 1]), np.full((3, 2), 0.5))
    with pytest.raises(ValueError, match="columns"):
        classification_metrics(np.array([0, 3]), np.full((2, 2), 0.5))
    with pytest.raises(ValueError, match="NaN"):
        classification_metrics(np.array([0, 1]), np.array([[np.nan, 0.5], [0.5, 0.5]]))


# --------------------------------------------------------------------------- regression


def test_regression_hand_computed():
    y = np.array([1.0, 2.0, 3.0, 4.0])
    p = np.array([1.0, 3.0, 2.0, 6.0])  # errors 0, 1, -1, 2
    m = regression_metrics(y, p)
    assert set(m) == {"mae", "rmse", "r2"}
    assert m["mae"] == pytest.approx(1.0)
    assert m["rmse"] == pytest.approx(math.sqrt(1.5))
    # SS_res = 6, SS_tot = 2.25 + 0.25 + 0.25 + 2.25 = 5
    assert m["r2"] == pytest.approx(1 - 6 / 5)


def test_regression_perfect_and_constant_target():
    y = np.array([1.0, 2.0, 3.0])
    assert regression_metrics(y, y) == {"mae": 0.0, "rmse": 0.0, "r2": 1.0}
    const = np.full(3, 2.0)
    m = regression_metrics(const, const)
    assert m["r2"] == 1.0
    m = regression_metrics(const, np.array([2.0, 3.0, 1.0]))
    assert m["r2"] == 0.0 and all(math.isfinite(v) for v in m.values())
    assert m["mae"] == pytest.approx(2 / 3)


def test_regression_rejects_empty_and_nan():
    with pytest.raises(ValueError, match="N=0"):
        regression_metrics(np.array([]), np.array([]))
    with pytest.raises(ValueError, match="NaN"):
        regression_metrics(np.array([1.0, 2.0]), np.array([1.0, np.nan]))


# --------------------------------------------------------------------------- baselines


def test_majority_baseline_argmax_is_majority_class():
    counts = np.array([3, 10, 0, 7])
    probs = majority_baseline_probs(counts, 6)
    assert probs.shape == (6, 4)
    np.testing.assert_allclose(probs.sum(axis=1), 1.0)
    assert np.all(probs.argmax(axis=1) == 1)
    assert np.all(probs > 0)  # smoothing: unseen class 2 still has non-zero mass
    np.testing.assert_allclose(probs[0], counts / counts.sum(), atol=1e-6)
    m = classification_metrics(np.array([1, 1, 0, 2, 3, 1]), probs)
    assert m["accuracy"] == pytest.approx(3 / 6)
    assert math.isfinite(m["log_loss"])


def test_majority_baseline_all_zero_counts_is_uniform():
    probs = majority_baseline_probs(np.zeros(4), 2)
    np.testing.assert_allclose(probs, 0.25)


def test_mean_baseline():
    m = regression_metrics(np.array([1.0, 2.0, 3.0, 4.0]), np.full(4, 2.5))
    assert m["r2"] == pytest.approx(0.0)
    assert m["mae"] == pytest.approx(1.0)


# --------------------------------------------------------------------------- plots


def test_learning_curves_multi_epoch(tmp_path):
    history = [
        {
            "epoch": e,
            "train_loss": 1.0 / e,
            "val_loss": 1.2 / e,
            "val_accuracy": 0.5 + 0.1 * e,
            "val_macro_f1": 0.4 + 0.1 * e,
        }
        for e in range(1, 6)
    ]
    out = plot_learning_curves(history, tmp_path / "curves.png")
    assert out == tmp_path / "curves.png"
    assert_png(out)


def test_learning_curves_single_epoch_and_string_path(tmp_path):
    target = tmp_path / "sub" / "one.png"
    out = plot_learning_curves([{"epoch": 1, "train_loss": 0.9, "val_loss": 1.1, "val_mae": 3.2}], str(target))
    assert Path(out) == target
    assert_png(out)


def test_learning_curves_without_extra_metrics_overwrites(tmp_path):
    target = tmp_path / "c.png"
    target.write_bytes(b"old")
    plot_learning_curves([{"epoch": 1, "train_loss": 0.5, "val_loss": None}], target)
    assert_png(target)


def test_learning_curves_empty_history_raises(tmp_path):
    with pytest.raises(ValueError, match="empty"):
        plot_learning_curves([], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


def confusion(y_true, y_pred, c: int) -> np.ndarray:
    counts = np.zeros((c, c), np.int64)
    np.add.at(counts, (np.asarray(y_true), np.asarray(y_pred)), 1)
    return counts


def test_confusion_matrix_more_classes_than_top_k(tmp_path):
    rng = np.random.default_rng(0)
    n_classes = 30
    y_true = rng.integers(0, n_classes, size=500)
    y_pred = np.where(rng.random(500) < 0.6, y_true, rng.integers(0, n_classes, size=500))
    names = [f"class_{i}" for i in range(n_classes)]
    out = plot_confusion_counts(confusion(y_true, y_pred, n_classes), names, tmp_path / "cm.png", top_k=5)
    assert_png(out)


def test_confusion_matrix_small_and_single_class(tmp_path):
    out = plot_confusion_counts(confusion([0, 1, 1, 2], [0, 1, 2, 2], 3), ["a", "b", "c"], tmp_path / "a.png")
    assert_png(out)
    out = plot_confusion_counts(confusion([0, 0, 0], [0, 0, 0], 1), ["only"], tmp_path / "b.png")
    assert_png(out)


def test_residuals_plot(tmp_path):
    rng = np.random.default_rng(1)
    y = rng.normal(size=200)
    out = plot_residuals(y, y + rng.normal(scale=0.3, size=200), tmp_path / "res.png")
    assert_png(out)
    # degenerate: one sample, zero residual
    assert_png(plot_residuals([1.0], [1.0], tmp_path / "one.png"))
    with pytest.raises(ValueError, match="N=0"):
        plot_residuals([], [], tmp_path / "none.png")


# --------------------------------------------------------------------------- table


def _rows(table: str) -> dict[str, list[str]]:
    lines = table.strip().splitlines()
    assert lines[0] == "| metric | model | baseline | better? |"
    rows = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        rows[cells[0]] = cells[1:]
    return rows


def test_metrics_table_directions():
    model = {"accuracy": 0.8, "log_loss": 0.5, "macro_f1": 0.3, "rmse": 1.0}
    baseline = {"accuracy": 0.6, "log_loss": 0.4, "macro_f1": 0.3, "rmse": 2.0}
    directions = {"accuracy": "maximize", "log_loss": "minimize", "macro_f1": "maximize", "rmse": "minimize"}
    rows = _rows(format_metrics_table(model, baseline, directions))
    assert rows["accuracy"] == ["0.8000", "0.6000", "model"]
    assert rows["log_loss"] == ["0.5000", "0.4000", "baseline"]
    assert rows["macro_f1"] == ["0.3000", "0.3000", "tie"]
    assert rows["rmse"] == ["1.000", "2.000", "model"]


def test_metrics_table_baseline_wins_when_maximizing_and_missing_values():
    rows = _rows(format_metrics_table({"r2": 0.1, "mae": 1.23456789}, {"r2": 0.5}, {"r2": "maximize"}))
    assert rows["r2"] == ["0.1000", "0.5000", "baseline"]
    assert rows["mae"] == ["1.235", "n/a", "n/a"]
    with pytest.raises(ValueError, match="maximize"):
        format_metrics_table({"a": 1.0}, {"a": 2.0}, {"a": "bigger"})


@pytest.mark.parametrize(
    "value, text",
    [
        (0.1524390243902439, "0.1524"),
        (0.8, "0.8000"),
        (1.23456789, "1.235"),
        (9.99996, "10.00"),  # rounded first: four digits, not 9.99996 or 10.000
        (1234.5678, "1235"),
        (123456.7, "123500"),
        (0.012345, "0.01235"),
        (-0.5, "-0.5000"),
        (0.0, "0.0000"),
        (5e-5, "5.000e-05"),
        (2e9, "2.000e+09"),
        (None, "n/a"),
        (math.inf, "inf"),
    ],
)
def test_numbers_read_to_four_significant_digits(value, text):
    assert format_number(value) == text


def test_per_class_scores_by_hand():
    """3 classes and an 'unseen' id 0 that never occurs; rows by support, None where a score is undefined."""
    confusion = np.array(
        [
            [0, 0, 0, 0],
            [0, 3, 1, 0],  # a: 4 samples, 3 right, 1 predicted b
            [0, 2, 5, 1],  # b: 8 samples, 5 right
            [0, 0, 0, 0],  # c: no sample, predicted once
        ]
    )
    rows = per_class_scores(confusion, ["<unseen>", "a", "b", "c"])
    assert [(r["class"], r["support"], r["predicted"]) for r in rows] == [
        ("b", 8, 6),
        ("a", 4, 5),
        ("c", 0, 1),
        ("<unseen>", 0, 0),
    ]
    b, a, c, unseen = rows
    assert (a["precision"], a["recall"]) == (3 / 5, 3 / 4)
    assert a["f1"] == pytest.approx(2 * (3 / 5) * (3 / 4) / (3 / 5 + 3 / 4))
    assert (b["precision"], b["recall"]) == (5 / 6, 5 / 8)
    assert (c["precision"], c["recall"], c["f1"]) == (0.0, None, 0.0)  # predicted, never right, no sample
    assert (unseen["precision"], unseen["recall"], unseen["f1"]) == (None, None, None)
    # the mean of the F1s given is the macro F1 over the classes seen
    assert np.mean([r["f1"] for r in rows if r["f1"] is not None]) == pytest.approx(label_scores(confusion)["macro_f1"])


def test_no_tmp_files_left_after_failed_plot(tmp_path):
    with pytest.raises(ValueError):
        plot_residuals([1.0, 2.0], [1.0], tmp_path / "bad.png")
    assert os.listdir(tmp_path) == []
