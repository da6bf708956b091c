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
from shardline.core.config import CLASSIFICATION_METRICS, REGRESSION_METRICS, PipelineConfig
from shardline.core.manifest import Manifest
from shardline.tasks.caching import CacheRule
from shardline.trainer.serving import decode_outputs, key_columns


def sequence_keys(manifest: Manifest, manifest_uri: str, split: str, data) -> list[str]:
    """The sequence key of every window's target row, in window order (from the shards' key files)."""
    folder = manifest_uri.rsplit("/", 1)[0]
    where = data.window_keys()
    per_shard = [
        pl.read_parquet(io.BytesIO(storage.read_bytes(storage.join(folder, info.keys_path))))["sequence"].to_list()
        for info in manifest.shards_of(split)
    ]
    return [per_shard[s][g] for s, g in zip(where["shard"].tolist(), where["segment"].tolist())]


def evaluate_model(manifest_uri: str, train_result: dict, config: PipelineConfig, out_dir: Path) -> dict:
    from shardline.trainer.data import open_split
    from shardline.trainer.loop import load_model, predict

    manifest = Manifest.model_validate_json(storage.read_text(manifest_uri))
    spec = manifest.encoding
    model = load_model(train_result["best_checkpoint"])
    test = open_split(manifest, manifest_uri, "test")
    outputs = predict(model, test)
    y = test.targets()
    train_y = open_split(manifest, manifest_uri, "train").targets()
    out_dir.mkdir(parents=True, exist_ok=True)
    plots = [M.plot_learning_curves(train_result["history"], out_dir / "learning_curves.png")]
    if spec.target.task == "classification":
        y = y.astype(np.int64)
        metrics = M.classification_metrics(y, outputs)
        counts = np.bincount(train_y.astype(np.int64), minlength=outputs.shape[1])
        baseline = M.classification_metrics(y, M.majority_baseline_probs(counts, len(y)))
        names = ["<unseen>", *(spec.target.classes or [])]
        plots.append(M.plot_confusion_matrix(y, outputs.argmax(1), names, out_dir / "confusion_matrix.png"))
        directions = CLASSIFICATION_METRICS
    else:
        t = spec.target
        y_raw = y.astype(np.float64) * t.std + t.mean
        pred_raw = outputs[:, 0].astype(np.float64) * t.std + t.mean
        metrics = M.regression_metrics(y_raw, pred_raw)
        baseline = M.regression_metrics(y_raw, M.mean_baseline(float(train_y.mean() * t.std + t.mean), len(y_raw)))
        plots.append(M.plot_residuals(y_raw, pred_raw, out_dir / "residuals.png"))
        directions = REGRESSION_METRICS
    key_names = key_columns(spec)
    columns = {key_names[-1]: test.window_keys()["order"]}
    if len(key_names) == 2:  # a sequence key column, then the order column
        columns = {key_names[0]: sequence_keys(manifest, manifest_uri, "test", test), **columns}
    preds = pl.DataFrame({**columns, **decode_outputs(spec, outputs)})
    preds.write_parquet(out_dir / "test_predictions.parquet")
    return {
        "metrics": metrics,
        "baseline": baseline,
        "table": M.format_metrics_table(metrics, baseline, directions),
        "test_windows": int(len(y)),
        "files": [str(p) for p in plots] + [str(out_dir / "test_predictions.parquet")],
    }


@task(name="evaluate")
def evaluate(manifest_uri: str, train_result: dict, config: PipelineConfig) -> dict:
    """Score the best checkpoint on the test split against the trivial baseline; write plots and predictions."""
    log = get_run_logger()
    local = not storage.is_remote(train_result["run_dir"])
    out_dir = (
        Path(storage.local_path(storage.join(train_result["run_dir"], "eval")))
        if local
        else Path(tempfile.mkdtemp(prefix="shardline-eval-"))
    )
    result = evaluate_model(manifest_uri, train_result, config, out_dir)
    if not local:  # keep the evaluation beside the checkpoints in the storage root
        for f in result["files"]:
            storage.write_bytes(storage.join(train_result["run_dir"], "eval", Path(f).name), Path(f).read_bytes())
    log.info("evaluate: %d test windows\n%s", result["test_windows"], result["table"])
    return result


# What decides the scores: the evaluated weights (the best checkpoint's checksum), the data (the
# manifest's checksum) and the target; the plots and tables it wrote must still be there.
EVALUATE_CACHE = CacheRule(
    "evaluate",
    key=lambda inputs: (
        inputs["train_result"]["best_sha256"],
        storage.sha256_uri(inputs["manifest_uri"]),
        inputs["config"].data.target.model_dump(),
    ),
    code=(__name__,),
    still_valid=lambda result, inputs: all(Path(f).exists() for f in result["files"]),
)
