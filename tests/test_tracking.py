import json
import os
import time

import pytest

from shardline.core.config import MlflowConfig
from shardline.core.tracking.tracker import Tracker, tracking_uri
from tests.net import free_port


def closed_port() -> int:
    return free_port()  # bound, then closed: nothing listens there


def test_unreachable_mlflow_never_raises_and_keeps_metrics(tmp_path, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "2")
    t0 = time.perf_counter()
    tracker = Tracker(
        MlflowConfig(tracking_uri=f"http://127.0.0.1:{closed_port()}"), str(tmp_path), run_dir=str(tmp_path / "run")
    )
    assert tracker.start(None, "r", {}) is None
    tracker.log_metrics({"train/loss": 1.5}, step=3)
    tracker.log_metrics({"train/loss": 1.2}, step=4)
    assert not tracker.end("FINISHED", wait=0.5)
    assert time.perf_counter() - t0 < 30
    lines = [json.loads(x) for x in (tmp_path / "run" / "mlflow-journal.jsonl").read_text().splitlines()]
    assert [(x["metrics"], x["step"]) for x in lines if x.get("op") == "metrics"] == [
        ({"train/loss": 1.5}, 3),
        ({"train/loss": 1.2}, 4),
    ]
    assert [x["status"] for x in lines if x.get("op") == "end"] == ["FINISHED"]


def test_the_flush_wait_is_checked(monkeypatch, tmp_path):
    def tracker():
        return Tracker(MlflowConfig(experiment="e"), str(tmp_path / "store"), run_dir=str(tmp_path / "run"))

    monkeypatch.setenv("SHARDLINE_MLFLOW_FLUSH_SECONDS", "soon")
    with pytest.raises(ValueError, match="SHARDLINE_MLFLOW_FLUSH_SECONDS='soon' is not a number"):
        tracker()
    monkeypatch.setenv("SHARDLINE_MLFLOW_FLUSH_SECONDS", "5")
    assert tracker().flush_s == 5.0


def test_credentials_in_a_uri_are_never_said():
    from shardline.core.secrets import redact_text

    said = redact_text("MLflow at https://alice:pw@mlflow.example.com/x failed (url: http://bob:t0k@h:5000/api)")
    assert said == "MLflow at https://***@mlflow.example.com/x failed (url: http://***@h:5000/api)"


def test_sqlite_tracking_logs_and_resumes_the_same_run(tmp_path):
    from mlflow import MlflowClient

    cfg = MlflowConfig(experiment="e")
    tracker = Tracker(cfg, str(tmp_path / "store"), run_dir=str(tmp_path / "run"))
    assert tracker.uri == f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}" == tracking_uri(cfg, str(tmp_path / "store"))
    run_id = tracker.start(None, "r", {"k": "v"})
    tracker.log_metrics({"a": 1.0}, step=0)
    tracker.end("FAILED")
    again = Tracker(cfg, str(tmp_path / "store"), run_dir=str(tmp_path / "run"))
    assert again.start(run_id, "r", {}) == run_id
    again.log_metrics({"a": 2.0}, step=1)
    again.end("FINISHED")
    client = MlflowClient(tracker.uri)
    assert client.get_run(run_id).info.status == "FINISHED"
    assert [m.value for m in client.get_metric_history(run_id, "a")] == [1.0, 2.0]
    exp = client.get_experiment_by_name("e")
    assert exp.artifact_location == (tmp_path / "store" / "mlflow-artifacts").as_uri()


def test_fluent_tracking_uri_is_put_back(tmp_path, monkeypatch):
    import mlflow

    from shardline.core.tracking.tracker import fluent_tracking_uri

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path / 'users.db'}")
    mlflow.set_tracking_uri(f"sqlite:///{tmp_path / 'users.db'}")
    with fluent_tracking_uri(f"sqlite:///{tmp_path / 'run.db'}"):
        assert mlflow.get_tracking_uri() == f"sqlite:///{tmp_path / 'run.db'}"
    assert mlflow.get_tracking_uri() == f"sqlite:///{tmp_path / 'users.db'}"
    assert tracking_uri(MlflowConfig(), str(tmp_path / "store")) == f"sqlite:///{tmp_path / 'users.db'}"
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    with fluent_tracking_uri(f"sqlite:///{tmp_path / 'run.db'}"):
        pass
    assert "MLFLOW_TRACKING_URI" not in os.environ


def test_a_data_set_another_run_logs_at_the_same_moment_is_still_on_this_run(tmp_path, caplog):
    """A sweep's trials start together and log the same data set: MLflow looks for its row, finds none, and inserts
    it; the second trial's insert then fails on the store's unique constraint (seen in a sweep's console: "MLflow
    refused journal entry 4 ... it is skipped", and that trial's run had no data set). Here another writer inserts the
    row right before this run's insert, in the real SQLite store, as the other trial's process did."""
    import sqlite3

    from mlflow import MlflowClient
    from sqlalchemy import event
    from sqlalchemy.engine import Engine

    store = tmp_path / "store"
    raced = []

    def the_other_trial(conn, cursor, statement, parameters, context, executemany):
        if raced or not statement.lstrip().upper().startswith("INSERT INTO DATASETS"):
            return
        raced.append(statement)
        other = sqlite3.connect(store / "mlflow.db", timeout=10)
        for row in parameters if executemany else [parameters]:
            other.execute(statement, [f"other-{row[0]}", *row[1:]])  # its own id, the same experiment, name, digest
        other.commit()
        other.close()

    data_set = {"name": "demo", "digest": "5e1f0c", "source_type": "local", "source": '{"uri": "/d"}'}
    data_set["context"] = "train"
    tracker = Tracker(MlflowConfig(experiment="e"), str(store), run_dir=str(tmp_path / "run"))
    run_id = tracker.start(None, "t2", {})
    event.listen(Engine, "before_cursor_execute", the_other_trial)
    try:
        tracker.log_inputs([data_set])
        assert tracker.end("FINISHED", wait=30)
    finally:
        event.remove(Engine, "before_cursor_execute", the_other_trial)
    assert raced, "the other writer never ran: nothing was tested"
    inputs = MlflowClient(tracker.uri).get_run(run_id).inputs.dataset_inputs
    assert [(i.dataset.name, i.dataset.digest) for i in inputs] == [("demo", "5e1f0c")]
    assert "refused" not in caplog.text
