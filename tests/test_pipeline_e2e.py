"""The whole pipeline through a real Prefect API and a real MLflow SQLite store, on tiny data."""

import json
import re
from pathlib import Path

import polars as pl
import pytest
from mlflow import MlflowClient

from shardline.core.config import validate_config
from shardline.core.metrics.report import format_number
from shardline.core.tracking.tracker import fluent_tracking_uri
from tests.conftest import make_raw, tiny_config

pytestmark = pytest.mark.e2e


def run_pipeline(cfg_dict):
    from shardline.flows.pipeline import pipeline

    return pipeline(validate_config(cfg_dict))


def artifacts_of(flow_run_id) -> dict:
    """The artifacts a flow run created, by key, as the Prefect API has them."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]))
        )
    return {a.key: a for a in found}


def test_pipeline_registers_a_champion_whose_predictions_match_evaluation(tmp_path, prefect_api):
    import mlflow

    make_raw(tmp_path / "raw", n_seq=15, rows=80)
    root = str(tmp_path / "store")
    cfg = tiny_config(str(tmp_path / "raw" / "*.parquet"), root, **{"training.epochs": 3})
    from shardline.flows.pipeline import pipeline

    state = pipeline(validate_config(cfg), return_state=True)
    result = state.result()

    reg = result["registered"]
    assert (reg["version"], reg["alias"]) == (1, "champion")
    client = MlflowClient(reg["tracking_uri"])
    assert int(client.get_model_version_by_alias("tiny-model", "champion").version) == 1
    run = client.get_run(reg["run_id"])
    assert run.info.status == "FINISHED"
    m = run.data.metrics
    # the label is the previous row's kind: a window model gets it, the majority class does not
    assert m["test/accuracy"] > 0.9 and m["test/accuracy_baseline"] < 0.5
    assert {"test/log_loss", "test/macro_f1", "epoch/val_loss", "train/train_loss"} <= set(m)
    assert "test/top5_accuracy" not in m  # 3 classes: every class is in the top 5, the metric says nothing
    history = client.get_metric_history(reg["run_id"], "epoch/val_loss")
    assert [h.step for h in history] == [1, 2, 3]  # epochs counted as the logs count them
    version = client.get_model_version("tiny-model", "1")
    assert version.tags["shardline.data_fingerprint"] == result["snapshot"]["fingerprint"]
    assert {"shardline.config_hash", "shardline.code_version", "metric.accuracy"} <= set(version.tags)
    artifacts = {a.path for a in client.list_artifacts(reg["run_id"], "evaluation")}
    assert {
        "evaluation/learning_curves.png",
        "evaluation/confusion_matrix.png",
        "evaluation/per_class.csv",
    } <= artifacts
    # numbers for reading in the registry's tags, at full precision where they are data
    assert version.tags["metric.accuracy"] == format_number(m["test/accuracy"])
    assert reg["value"] == m["test/accuracy"] == json.loads(version.tags["shardline.gate"])["value"]

    run_dir = result["train"]["best_checkpoint"].rsplit("/checkpoints/", 1)[0]
    # what the Prefect UI shows: the per-class table's top rows, and a report rounded for reading that says
    # which checkpoint was evaluated
    shown = artifacts_of(state.state_details.flow_run_id)
    per_class = json.loads(shown["per-class"].data)
    assert {row["class"] for row in per_class} == {"a", "b", "c", "<unseen>"}
    assert [row["support"] for row in per_class] == sorted((row["support"] for row in per_class), reverse=True)
    assert per_class[-1] == {"class": "<unseen>", "support": 0, "predicted": 0} | dict.fromkeys(
        ("precision", "recall", "f1"), "n/a"
    )
    assert f"{run_dir}/eval/per_class.csv" in shown["per-class"].description
    report = shown["model-report"].data
    assert report.startswith("## tiny-model v1: the first **champion**")
    assert re.search(r"^- evaluated the checkpoint .*epoch [1-3] of 3", report, re.M), report
    digits = [len(n.replace(".", "").lstrip("0")) for n in re.findall(r"\d+\.\d+", report)]
    assert digits and max(digits) <= 5, report

    # the registered model takes raw rows and agrees with the evaluation on the test split
    eval_preds = pl.read_parquet(f"{run_dir}/eval/test_predictions.parquet")
    raw = pl.concat([pl.read_parquet(p) for p in sorted((tmp_path / "raw").glob("*.parquet"))])
    test_rows = raw.filter(pl.col("seq").is_in(eval_preds["seq"].unique().to_list()))
    with fluent_tracking_uri(reg["tracking_uri"]):
        served = pl.from_pandas(
            mlflow.pyfunc.load_model("models:/tiny-model@champion").predict(test_rows.drop("label").to_pandas())
        )
    joined = eval_preds.join(served, on=["seq", "t"], suffix="_served")
    assert joined.height == eval_preds.height == served.height
    assert (joined["prediction"] == joined["prediction_served"]).all()
    assert (joined["probability"] - joined["probability_served"]).abs().max() < 1e-5

    # a worse model is registered as challenger; the champion stays
    worse = tiny_config(str(tmp_path / "raw" / "*.parquet"), root, **{"training.epochs": 1, "training.lr": 1e-7})
    second = run_pipeline(worse)["registered"]
    assert (second["version"], second["alias"]) == (2, "challenger")
    assert int(client.get_model_version_by_alias("tiny-model", "champion").version) == 1
    assert int(client.get_model_version_by_alias("tiny-model", "challenger").version) == 2


def test_regression_with_a_transformer(tmp_path, prefect_api):
    import os

    make_raw(tmp_path / "raw", n_seq=12, rows=60, seed=3)
    cfg = tiny_config(
        str(tmp_path / "raw" / "*.parquet"),
        str(tmp_path / "store"),
        **{
            "data.target": {"column": "value", "task": "regression"},
            "data.horizon": 0,
            "model": {"family": "transformer", "hidden": 32, "layers": 1, "heads": 2, "dropout": 0.0},
            "training.epochs": 4,
            "mlflow.model_name": "tiny-reg",
        },
    )
    result = run_pipeline(cfg)
    assert result["registered"]["alias"] == "champion"
    assert result["registered"]["promotion_metric"] == "rmse"
    # value = noise + 3 * (kind == 'a') of the window's last row: learnable, the mean is not
    assert result["metrics"]["rmse"] < 0.8 * result["baseline"]["rmse"]
    assert result["metrics"]["r2"] > 0.3
    # registering did not leave MLflow pointed at this store for the rest of the process
    assert "MLFLOW_TRACKING_URI" not in os.environ
    assert result["registered"]["tracking_uri"] == f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    client = MlflowClient(result["registered"]["tracking_uri"])
    assert [m.name for m in client.search_registered_models()] == ["tiny-reg"]

    # the same storage root, another MLflow store (a team moving to a server): the run folder is the same (its
    # address is the data, model and training), its MLflow run the first store's; the new store gets a run and a
    # version of its own (it said "MlflowException: Run with id=... not found", exit 1)
    other = f"sqlite:///{tmp_path / 'other.db'}"
    moved = run_pipeline({**cfg, "mlflow": {**cfg.get("mlflow", {}), "tracking_uri": other}})
    assert moved["train"]["run_dir"] == result["train"]["run_dir"]
    assert (moved["registered"]["tracking_uri"], moved["registered"]["version"]) == (other, 1)
    run = MlflowClient(other).get_run(moved["registered"]["run_id"])
    assert run.info.run_id != result["registered"]["run_id"]
    assert run.data.metrics["test/rmse"] == pytest.approx(result["metrics"]["rmse"])
    kept = list(Path(result["train"]["run_dir"]).glob("mlflow-journal.jsonl.*"))
    assert len(kept) == 1 and '"op": "create"' in kept[0].read_text()  # the first store's journal, set aside


def test_files_written_by_pandas_with_its_nullable_and_category_types_register(tmp_path, prefect_api):
    """pandas records its own types in the files it writes: a nullable Int64 and a boolean with a null, a
    category. Registration's input example read them back as such, which MLflow's signature refuses: after the
    whole training (a null past the first 5 rows the ingest check read), or at ingest naming no column."""
    import pandas as pd

    for path in make_raw(tmp_path / "raw", n_seq=9, rows=40):
        df = pl.read_parquet(path).to_pandas()
        df["season"] = df["season"].astype("Int64")
        df.loc[df.index[7::5], "season"] = pd.NA  # nulls only past the first rows
        df["flag"] = df["flag"].astype("boolean")
        df.loc[df.index[9], "flag"] = pd.NA
        df["kind"] = df["kind"].astype("category")
        df.to_parquet(path)
    cfg = tiny_config(str(tmp_path / "raw" / "*.parquet"), str(tmp_path / "store"), **{"training.epochs": 1})
    cfg["data"]["features"]["categorical"] = ["kind", "season"]
    result = run_pipeline(cfg)
    assert result["registered"]["version"] == 1
