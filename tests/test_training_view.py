"""What a user sees of training: the best checkpoint chosen by a named validation metric (and said so),
the training flow run's own logs and a live table in the Prefect UI while it trains."""

from __future__ import annotations

import contextvars
import logging
import re
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from mlflow import MlflowClient

from shardline.core.config import ConfigError, ModelConfig, validate_config
from shardline.core.metrics.report import learning_curves_figure
from shardline.trainer.checkpoint import best_checkpoint
from shardline.trainer.inference import load_model, predict
from shardline.trainer.loop import Callbacks, fit
from shardline.trainer.models import legacy_data_spec, model_spec_for
from tests.conftest import make_raw, split_targets, tiny_config
from tests.test_trainer import CARDS, N_CLASSES, K, data, quiet, spec_for, train_cfg  # noqa: F401 (`data`: fixture)
from tests.user_project import WORLD, write_project

# ---------------------------------------------------------------- the selection criterion

# 5 short epochs in which validation accuracy peaks at epoch 3 while validation loss keeps falling
SHORT = dict(epochs=5, grad_accum=1, lr=0.003, checkpoint_every_steps=0, max_steps_per_epoch=3)


def accuracy_of(checkpoint: str, val) -> float:
    probs = predict(load_model(checkpoint), val)["target"]
    return float((probs.argmax(1) == split_targets(val)).mean())


def test_select_by_picks_the_best_epoch_by_that_metric_and_says_which(data, tmp_path):  # noqa: F811
    val = data["classification-val"]
    runs = {}
    for select_by in ("val_accuracy", "val_loss"):
        lines: list[str] = []
        result = fit(
            data["classification"],
            val,
            spec_for(),
            train_cfg(**SHORT, select_by=select_by),
            "classification",
            str(tmp_path / select_by),
            callbacks=Callbacks(log=lines.append),
        )
        runs[select_by] = (result, lines)
    by_accuracy, acc_lines = runs["val_accuracy"]
    by_loss, loss_lines = runs["val_loss"]
    history = by_accuracy.history
    accuracies = [h["val_accuracy"] for h in history]
    losses = [h["val_loss"] for h in history]
    highest, lowest = int(np.argmax(accuracies)) + 1, int(np.argmin(losses)) + 1  # epochs counted from 1
    assert highest != lowest  # the two criteria disagree on this run, so the choice shows

    # the criterion changes which checkpoint is best, never what is trained
    assert [h["val_loss"] for h in by_loss.history] == losses
    assert (by_accuracy.select_by, by_accuracy.best_epoch, by_accuracy.best_score) == (
        "val_accuracy",
        highest,
        max(accuracies),
    )
    assert (by_loss.select_by, by_loss.best_epoch, by_loss.best_score) == ("val_loss", lowest, min(losses))
    # the best checkpoint really holds the selected epoch's weights
    assert accuracy_of(by_accuracy.best_checkpoint, val) == pytest.approx(max(accuracies))
    assert accuracy_of(by_loss.best_checkpoint, val) == pytest.approx(accuracies[lowest - 1])

    # the logs say the criterion, mark the selected epochs "(best ...)", and name the one kept
    assert "the best checkpoint is the epoch with the highest val_accuracy (training.select_by)" in acc_lines[0]
    marked = [int(re.match(r"epoch (\d+)/5", line)[1]) for line in acc_lines if "(best val_accuracy)" in line]
    assert marked[-1] == highest and marked == sorted(marked)
    assert any(f"best checkpoint: epoch {highest}/5 by val_accuracy" in line for line in acc_lines)
    assert any(f"best checkpoint: epoch {lowest}/5 by val_loss" in line for line in loss_lines)
    # the epoch history says how much of the step time went into waiting for data
    assert all(0 <= h["data_wait_fraction"] <= 1 for h in history)

    # a finished run asked again returns the same selection
    again = fit(
        data["classification"],
        val,
        spec_for(),
        train_cfg(**SHORT, select_by="val_accuracy"),
        "classification",
        str(tmp_path / "val_accuracy"),
        callbacks=Callbacks(log=quiet),
    )
    assert (again.best_epoch, again.select_by, again.best_checkpoint) == (
        highest,
        "val_accuracy",
        by_accuracy.best_checkpoint,
    )
    # resuming under another criterion is refused: the saved best was chosen by the old one
    with pytest.raises(ValueError, match=r"training\.select_by: 'val_accuracy' -> 'val_loss'"):
        fit(
            data["classification"],
            val,
            spec_for(),
            train_cfg(**SHORT, select_by="val_loss"),
            "classification",
            str(tmp_path / "val_accuracy"),
            callbacks=Callbacks(log=quiet),
        )


def test_select_by_defaults_to_the_promotion_metrics_validation_counterpart(tmp_path):
    def resolved(**over):
        cfg = validate_config(tiny_config("raw", str(tmp_path), **over))
        return cfg.training.select_by, cfg.training.select_direction

    assert resolved() == ("val_accuracy", "maximize")  # promotion: accuracy
    assert resolved(**{"mlflow.promotion_metric": "macro_f1"}) == ("val_loss", "minimize")  # not validated
    regression = {"data.target": {"column": "value", "task": "regression"}}
    assert resolved(**regression) == ("val_loss", "minimize")  # promotion: rmse
    assert resolved(**regression, **{"mlflow.promotion_metric": "mae"}) == ("val_mae", "minimize")
    several = {"data.target": None, "data.targets": [{"column": "label", "task": "classification"},
                                                     {"column": "value", "task": "regression"}]}  # fmt: skip
    assert resolved(**several) == ("val_label/accuracy", "maximize")
    assert resolved(**{"training.select_by": "val_loss"}) == ("val_loss", "minimize")  # said, not defaulted
    # the stored config says the resolved value, and validates again to itself
    cfg = validate_config(tiny_config("raw", str(tmp_path)))
    assert validate_config(cfg.model_dump(mode="json")).training == cfg.training


def test_a_select_by_the_validation_never_gives_is_refused_with_the_names_there_are(data, tmp_path):  # noqa: F811
    with pytest.raises(ConfigError) as e:
        validate_config(tiny_config("raw", str(tmp_path), **{"training.select_by": "accuracy"}))
    assert "training.select_by='accuracy'" in str(e.value) and "['val_accuracy', 'val_loss']" in str(e.value)
    with pytest.raises(ConfigError, match=r"select_direction=minimize contradicts training.select_by='val_accuracy'"):
        validate_config(
            tiny_config(
                "raw", str(tmp_path), **{"training.select_by": "val_accuracy", "training.select_direction": "minimize"}
            )
        )
    # fit, called directly, refuses it before the first step: no checkpoint is written
    folder = tmp_path / "ckpt"
    with pytest.raises(ValueError, match=r"training.select_by='val_f1'.*\['val_accuracy', 'val_loss'\]"):
        fit(
            data["classification"],
            data["classification-val"],
            spec_for(),
            train_cfg(select_by="val_f1"),
            "classification",
            str(folder),
            callbacks=Callbacks(log=quiet),
        )
    assert not folder.exists() or not any(folder.iterdir())


SCORED = (
    WORLD
    + '''

class Scored(WindowGRU):
    """Its own validation metric: how sure it is of its answer."""

    def metrics(self, outputs, cont, cat, targets):
        return {"confidence": outputs["target"].float().softmax(-1).max(-1).values.mean()}
'''
)


@pytest.fixture
def scored_model(tmp_path):
    import sys

    folder = tmp_path / "proj"
    write_project(folder, world=textwrap.dedent(SCORED))
    yield model_spec_for(
        ModelConfig(entrypoint="models.world:Scored", params={"hidden": 8}, code_dir=str(folder)),
        legacy_data_spec(2, CARDS, K, N_CLASSES),
    )
    for name in [m for m in sys.modules if m == "models" or m.startswith("models.")]:
        del sys.modules[name]
    if str(folder) in sys.path:
        sys.path.remove(str(folder))


def test_a_models_own_metric_selects_with_its_direction_and_a_missing_one_fails_before_any_best(
    data,  # noqa: F811
    tmp_path,
    scored_model,
):
    quick = dict(epochs=3, grad_accum=1, checkpoint_every_steps=0, max_steps_per_epoch=2)
    result = fit(
        data["classification"],
        data["classification-val"],
        scored_model,
        train_cfg(**quick, select_by="val_confidence", select_direction="maximize"),
        "classification",
        str(tmp_path / "own"),
        callbacks=Callbacks(log=quiet),
    )
    confidence = [h["val_confidence"] for h in result.history]
    assert (result.best_epoch, result.best_score) == (int(np.argmax(confidence)) + 1, max(confidence))

    with pytest.raises(ValueError, match="set training.select_direction"):  # which way is better: not guessed
        fit(
            data["classification"],
            data["classification-val"],
            scored_model,
            train_cfg(**quick, select_by="val_confidence"),
            "classification",
            str(tmp_path / "no-direction"),
            callbacks=Callbacks(log=quiet),
        )
    # a name the model's metrics() does not return: known at the first epoch's end, before it is marked best
    folder = tmp_path / "missing"
    with pytest.raises(ValueError, match=r"training.select_by='val_sureness'.*'val_confidence'"):
        fit(
            data["classification"],
            data["classification-val"],
            scored_model,
            train_cfg(**quick, select_by="val_sureness", select_direction="maximize"),
            "classification",
            str(folder),
            callbacks=Callbacks(log=quiet),
        )
    assert best_checkpoint(str(folder)) is None


def test_the_learning_curves_mark_the_selected_epoch():
    history = [
        {"epoch": e, "train_loss": 1.0 / e, "val_loss": 0.5 + abs(e - 2) / 10, "val_accuracy": 0.5 + e / 20}
        for e in range(1, 6)
    ]
    fig = learning_curves_figure(history, selected_epoch=4, select_by="val_accuracy")
    ax_loss, ax_val = fig.axes
    assert "selected: epoch 4 (val_accuracy)" in [t.get_text() for t in ax_val.get_legend().get_texts()]
    for ax in (ax_loss, ax_val):  # a vertical line at the epoch on both panels
        assert any(list(line.get_xdata()) == [4, 4] for line in ax.get_lines())
    fig = learning_curves_figure(history, selected_epoch=2, select_by="val_loss")
    assert "selected: epoch 2 (val_loss)" in [t.get_text() for t in fig.axes[0].get_legend().get_texts()]


# ---------------------------------------------------------------- the training flow run in the Prefect UI


def training_flow_run(client, pipeline_run_id):
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterParentFlowRunId

    children = client.read_flow_runs(
        flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[pipeline_run_id]))
    )
    found = [r for r in children if client.read_flow(r.flow_id).name == "train"]
    assert len(found) == 1, [r.name for r in children]
    return found[0]


def step_of(table: str) -> tuple[int, int]:
    done, total = re.search(r"\| step \| ([\d,]+) / ([\d,]+) \|", table).groups()
    return int(done.replace(",", "")), int(total.replace(",", ""))


@pytest.fixture
def flow_run_info_logs():
    """The flow runs' INFO lines reach the API (the test session keeps Prefect's loggers at WARNING)."""
    import shardline.flows.pipeline  # noqa: F401 - first: Prefect sets its logging up when its flow API is imported

    logger = logging.getLogger("prefect.flow_runs")
    before = logger.level
    logger.setLevel(logging.INFO)
    yield
    logger.setLevel(before)


@pytest.mark.e2e
def test_the_training_flow_run_has_its_logs_a_live_table_and_says_its_best_epoch(
    tmp_path, prefect_api, monkeypatch, flow_run_info_logs
):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        ArtifactFilter,
        ArtifactFilterFlowRunId,
        ArtifactFilterKey,
        LogFilter,
        LogFilterFlowRunId,
    )
    from prefect.logging.handlers import APILogHandler

    from shardline.flows.pipeline import pipeline

    monkeypatch.setenv("SHARDLINE_PROGRESS_SECONDS", "0")  # every step may change the table
    # a few seconds of training to watch, spent waiting for a (test-only) slowed loader
    monkeypatch.setenv("SHARDLINE_TEST_LOADER_DELAY", "0.05")
    make_raw(tmp_path / "raw")
    cfg = validate_config(tiny_config(str(tmp_path / "raw" / "*.parquet"), str(tmp_path / "store"),
                                      **{"training.epochs": 3}))  # fmt: skip

    # Prefect keeps only an artifact's latest data: watch it from a thread while training runs
    seen: list = []
    stop = threading.Event()

    def watch() -> None:
        with get_client(sync_client=True) as client:
            while not stop.is_set():
                live = ArtifactFilter(key=ArtifactFilterKey(any_=["train-live"]))
                seen.extend((a.flow_run_id, a.task_run_id, a.data) for a in client.read_artifacts(artifact_filter=live))
                time.sleep(0.05)

    watcher = threading.Thread(target=contextvars.copy_context().run, args=(watch,), daemon=True)
    watcher.start()
    try:
        state = pipeline(cfg, return_state=True)
    finally:
        stop.set()
        watcher.join(30)
    result = state.result()
    APILogHandler().flush()

    with get_client(sync_client=True) as client:
        run = training_flow_run(client, state.state_details.flow_run_id)
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))
        made = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))
    artifacts = {a.key: a for a in made}

    # (a) the epoch lines are the training flow run's own logs, not its parent task's
    lines = [log for log in logs if re.match(r"epoch \d/3: train_loss", log.message)]
    assert [line.message[:9] for line in lines] == ["epoch 1/3", "epoch 2/3", "epoch 3/3"]
    assert all(line.task_run_id is None for line in lines)
    train = result["train"]
    assert any(f"best checkpoint: epoch {train['best_epoch']}/3 by val_accuracy" in log.message for log in logs)

    # (b) the live table on the training flow run: created once, updated in place while training ran
    assert sorted(a.key for a in made if a.key in ("train-live", "train-progress")) == ["train-live", "train-progress"]
    live = artifacts["train-live"]
    assert live.task_run_id is None and live.type == "markdown"
    assert step_of(live.data) == (train["steps"], train["steps"]) and "| epoch | 3 / 3 |" in live.data
    assert re.search(r"\| windows/s \| [\d,]+ \|", live.data) and "waiting for data" in live.data
    assert f"| best so far (by val_accuracy) | epoch {train['best_epoch']}: " in live.data
    assert artifacts["train-progress"].data == 100.0
    steps = [step_of(table)[0] for flow_run_id, _, table in seen if flow_run_id == run.id]
    assert len(set(steps)) >= 3 and min(steps) < train["steps"]  # seen changing while it trained
    assert all(task_run_id is None for flow_run_id, task_run_id, _ in seen if flow_run_id == run.id)

    # (c) the selection in the result and on the MLflow run
    assert train["select_by"] == "val_accuracy" and 1 <= train["best_epoch"] <= 3
    mlflow_run = MlflowClient(cfg.mlflow.tracking_uri).get_run(train["mlflow_run_id"])
    assert mlflow_run.data.metrics["best_epoch"] == train["best_epoch"]
    assert mlflow_run.data.tags["shardline.select_by"] == "val_accuracy"
    accuracy = {
        m.step: m.value
        for m in MlflowClient(cfg.mlflow.tracking_uri).get_metric_history(mlflow_run.info.run_id, "epoch/val_accuracy")
    }
    assert sorted(accuracy) == [1, 2, 3]  # epochs counted from 1, as the logs count them
    assert train["best_score"] == accuracy[train["best_epoch"]] == max(accuracy.values())
    assert min(e for e, v in accuracy.items() if v == max(accuracy.values())) == train["best_epoch"]
    # denser step metrics: every step of a short run
    steps_logged = MlflowClient(cfg.mlflow.tracking_uri).get_metric_history(mlflow_run.info.run_id, "train/train_loss")
    assert len(steps_logged) == train["steps"]
    assert Path(train["run_dir"], "eval", "learning_curves.png").exists()

    # (d) a run starved of data: the fraction of step time spent waiting for it, per epoch in MLflow, and
    # one warning in the training run's log, after the second such epoch, naming the fixes
    waited = MlflowClient(cfg.mlflow.tracking_uri).get_metric_history(
        mlflow_run.info.run_id, "epoch/data_wait_fraction"
    )
    assert sorted(m.step for m in waited) == [1, 2, 3] and all(m.value > 0.1 for m in waited), [m.value for m in waited]
    warnings = [log for log in logs if "waiting for the next batch" in log.message]
    assert len(warnings) == 1 and warnings[0].level == logging.WARNING, [w.message for w in warnings]
    assert "training.num_workers, now null: 2 on a GPU, 0 elsewhere" in warnings[0].message
    assert "training.batch_size" in warnings[0].message
    assert "SHARDLINE_CACHE" in warnings[0].message


def test_a_prefect_api_that_fails_costs_the_live_view_one_warning_and_training_nothing(prefect_api, caplog):
    from prefect import flow
    from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    from shardline.runs.training_view import LiveView
    from tests.net import free_port

    log = logging.getLogger("shardline.test.live-view")

    @flow(name="train-with-the-api-gone")
    def train_while_the_api_is_gone() -> int:
        # the view's thread talks to an API nobody answers at (no retries: the test need not wait them out)
        with temporary_settings(
            {PREFECT_API_URL: f"http://127.0.0.1:{free_port()}/api", PREFECT_CLIENT_MAX_RETRIES: 0}
        ):
            view = LiveView(log)
        for step in range(1, 41):  # every "step" shows where it is, as fit's on_progress does with 0 seconds
            view.show({"step": step, "total_steps": 40, "epoch": 1, "epochs": 1, "train_loss": 1.0 / step})
        view.close()
        return step

    with caplog.at_level(logging.WARNING, logger=log.name):
        assert train_while_the_api_is_gone() == 40
    warned = [r.getMessage() for r in caplog.records if r.name == log.name]
    assert len(warned) == 1 and "train-live" in warned[0] and "training goes on without it" in warned[0]
