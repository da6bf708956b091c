"""Evaluate: the best checkpoint on the test split, beside a trivial baseline, with plots."""

from __future__ import annotations

import io
import tempfile
from pathlib import Path

import numpy as np
import polars as pl
from prefect import task
from prefect.logging import get_run_logger

from shardline.core import metrics as M
from shardline.core import storage
from shardline.core.config import CLASSIFICATION_METRICS, FILE_SEQUENCE, REGRESSION_METRICS, PipelineConfig
from shardline.core.manifest import Manifest
from shardline.tasks.caching import CacheRule
from shardline.trainer.serving import prediction_frame


def sequence_keys(manifest: Manifest, manifest_uri: str, split: str, data) -> list[str]:
    """The sequence key of every window's target row, in window order (from the shards' key files)."""
    folder = manifest_uri.rsplit("/", 1)[0]
    where = data.window_keys()
    per_shard = [
        pl.read_parquet(io.BytesIO(storage.read_verified(storage.resolve(folder, info.keys_path), info.keys_sha256)))[
            "sequence"
        ].to_list()
        for info in manifest.shards_of(split)
    ]
    return [per_shard[s][g] for s, g in zip(where["shard"].tolist(), where["segment"].tolist())]


def train_statistic(manifest: Manifest, manifest_uri: str, i: int, t) -> np.ndarray | float:
    """What the i-th target's trivial baseline needs from the training split: its class counts by id (id 0:
    the values the encoding does not know), or its mean in raw units. From the manifest's statistics; a
    manifest written before it kept them: read from the training split's shards."""
    if manifest.target_stats is not None:
        stat = manifest.target_stats[i]
        if t.task == "classification":
            ids = {v: k + 1 for k, v in enumerate(t.classes or [])}
            counts = np.zeros(t.n_outputs, np.float64)
            for value, n in stat["counts"].items():
                counts[ids.get(value, 0)] += n
            return counts
        return float(stat["mean"])
    from shardline.trainer.data import open_split

    train_y = open_split(manifest, manifest_uri, "train").targets(i)
    if t.task == "classification":
        return np.bincount(train_y.reshape(-1).astype(np.int64), minlength=t.n_outputs).astype(np.float64)
    return float(train_y.mean() * t.std + t.mean)


def _target_scores(t, y: np.ndarray, outputs: np.ndarray, train_stat, out_dir: Path, prefix: str):
    """One target's metrics, its baseline's and its plot (every position counted when it has several)."""
    if t.task == "classification":
        y = y.reshape(-1).astype(np.int64)
        probs = outputs.reshape(-1, outputs.shape[-1])
        metrics = M.classification_metrics(y, probs)
        counts = train_stat
        baseline = M.classification_metrics(y, M.majority_baseline_probs(counts, len(y)))
        if probs.shape[1] - 1 <= M.TOP_K:  # 5 classes or fewer (id 0 is 'unseen'): top-5 says nothing
            metrics.pop("top5_accuracy")
            baseline.pop("top5_accuracy")
        names = ["<unseen>", *(t.classes or [])]
        plot = M.plot_confusion_matrix(y, probs.argmax(1), names, out_dir / f"{prefix}confusion_matrix.png")
        return metrics, baseline, plot, CLASSIFICATION_METRICS
    y_raw = y.reshape(-1).astype(np.float64) * t.std + t.mean
    pred_raw = outputs.reshape(-1).astype(np.float64) * t.std + t.mean
    metrics = M.regression_metrics(y_raw, pred_raw)
    baseline = M.regression_metrics(y_raw, M.mean_baseline(train_stat, len(y_raw)))
    plot = M.plot_residuals(y_raw, pred_raw, out_dir / f"{prefix}residuals.png")
    return metrics, baseline, plot, REGRESSION_METRICS


def _own_loss_scores(model, test, batch_size: int = 4096) -> dict[str, float]:
    """A model without a target: its own loss on the test split, and the means of its `metrics` (when it
    defines them), per window."""
    import torch

    from shardline.trainer.loop import evaluate as validate

    scores = validate(model, test, None, batch_size, torch.device("cpu"))
    return {("loss" if k == "val_loss" else k.removeprefix("val_")): v for k, v in scores.items()}


def evaluate_model(manifest_uri: str, train_result: dict, config: PipelineConfig, out_dir: Path) -> dict:
    """The best checkpoint on the test split: per target its metrics, a trivial baseline's (the training
    split's majority class or mean) and a plot, named `metric` for one target and `target/metric` for
    several; a model without a target: its own loss (and metrics) on the test split."""
    from shardline.trainer.data import open_split
    from shardline.trainer.loop import load_model, predict

    manifest = Manifest.model_validate_json(storage.read_text(manifest_uri))
    spec = manifest.encoding
    model = load_model(train_result["best_checkpoint"])
    test = open_split(manifest, manifest_uri, "test")
    outputs = predict(model, test)
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = [M.plot_learning_curves(train_result["history"], out_dir / "learning_curves.png")]
    metrics: dict[str, float] = {}
    baseline: dict[str, float] = {}
    directions: dict[str, str] = {}
    several = len(spec.targets) > 1
    for i, t in enumerate(spec.targets):
        name = f"{t.column}/" if several else ""
        m, b, plot, d = _target_scores(
            t,
            test.targets(i),
            list(outputs.values())[i],
            train_statistic(manifest, manifest_uri, i, t),
            out_dir,
            f"{t.column}_" if several else "",
        )
        metrics.update({name + k: v for k, v in m.items()})
        baseline.update({name + k: v for k, v in b.items()})
        directions.update({name + k: v for k, v in d.items()})
        plots.append(plot)
    if not spec.targets:
        metrics = _own_loss_scores(model, test)
        directions = {"loss": "minimize", config.mlflow.promotion_metric: config.mlflow.promotion_direction}
    columns = {spec.order_by or "row": test.window_keys()["order"]}
    if spec.sequence_key and spec.sequence_key != FILE_SEQUENCE:  # the sequence key column, then the order
        columns = {spec.sequence_key: sequence_keys(manifest, manifest_uri, "test", test), **columns}
    preds = prediction_frame(spec, columns, outputs)
    preds.write_parquet(out_dir / "test_predictions.parquet")
    return {
        "metrics": metrics,
        "baseline": baseline,
        "table": M.format_metrics_table(metrics, baseline, directions),
        "test_windows": int(test.n_windows),
        "files": [str(p) for p in plots] + [str(out_dir / "test_predictions.parquet")],
    }


@task(name="evaluate")
def evaluate(manifest_uri: str, train_result: dict, config: PipelineConfig) -> dict:
    """Score the best checkpoint on the test split against the trivial baseline; write plots and predictions."""
    log = get_run_logger()
    if not storage.is_remote(train_result["run_dir"]):
        out_dir = Path(storage.local_path(storage.join(train_result["run_dir"], "eval")))
        result = evaluate_model(manifest_uri, train_result, config, out_dir)
    else:  # written aside, then kept beside the checkpoints in the storage root, which is where the result points
        with tempfile.TemporaryDirectory(prefix="shardline-eval-") as tmp:
            result = evaluate_model(manifest_uri, train_result, config, Path(tmp))
            stored = []
            for f in result["files"]:
                uri = storage.join(train_result["run_dir"], "eval", Path(f).name)
                storage.write_bytes(uri, Path(f).read_bytes())
                stored.append(uri)
        result["files"] = stored
    log.info("evaluate: %d test windows\n%s", result["test_windows"], result["table"])
    return result


# What decides the scores: the evaluated weights (the best checkpoint's checksum), the data (the
# manifest's checksum) and the targets; the plots and tables it wrote must still be there.
EVALUATE_CACHE = CacheRule(
    "evaluate",
    key=lambda inputs: (
        inputs["train_result"]["best_sha256"],
        storage.sha256_uri(inputs["manifest_uri"]),
        [t.model_dump() for t in inputs["config"].data.target_list],
        inputs["config"].data.target_positions,
    ),
    code=(__name__,),
    # what it wrote is still in the storage root (a listing: any machine that shares the root sees it)
    still_valid=lambda result, inputs: all(storage.exists(f) for f in result["files"]),
)
