"""The tracking server goes away and comes back: training is never held up, and MLflow ends up with every
metric exactly once and the run's right status (a real `mlflow server`, killed and started again)."""

from __future__ import annotations

import json
import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from mlflow import MlflowClient
from typer.testing import CliRunner

from shardline.core.config import MlflowConfig
from shardline.core.tracking.tracker import Tracker, sync_run
from tests.mlflow_server import MlflowServer, free_port
from tests.test_s3_source import s3_endpoint  # noqa: F401 - fixture: a real (moto) S3 server

SENDER = "shardline-mlflow-sender"


_EARLIER: set[threading.Thread] = set()  # sender threads alive when the test began (a failed test's, left behind)


def senders() -> list[threading.Thread]:
    """This test's MLflow sender threads still running."""
    return [t for t in threading.enumerate() if t.name == SENDER and t.is_alive() and t not in _EARLIER]


@pytest.fixture(autouse=True)
def _earlier_senders():
    _EARLIER.clear()
    _EARLIER.update(t for t in threading.enumerate() if t.name == SENDER)


@pytest.fixture
def server(tmp_path):
    s = MlflowServer(tmp_path / "mlflow-server")
    yield s
    s.stop()


@pytest.fixture(autouse=True)
def _fail_fast(monkeypatch):
    # MLflow's own retries only slow the test down: the tracker retries by itself
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "5")


def steps_of(client: MlflowClient, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in client.get_metric_history(run_id, key))


def test_a_server_that_is_down_costs_logging_nothing_and_loses_nothing(tmp_path, server):
    tracker = Tracker(
        MlflowConfig(tracking_uri=server.uri, experiment="outage"), str(tmp_path), run_dir=str(tmp_path / "run")
    )
    t0 = time.perf_counter()
    assert tracker.start(None, "r", {"k": "v"}) is None  # nothing answers: the run is created later
    assert time.perf_counter() - t0 < 5
    tracker.log_params({"lr": 0.01})
    slowest, t0 = 0.0, time.perf_counter()
    for step in range(1000):
        t = time.perf_counter()
        tracker.log_metrics({"train/loss": 1.0 / (step + 1), "train/lr": 0.01}, step)
        slowest = max(slowest, time.perf_counter() - t)
    took = time.perf_counter() - t0
    # a local file append each, never a network wait: one would take MLflow's request timeout (5 s, above). The
    # bounds leave room for a thread the loaded 2-core machine did not run for a while (0.49 s seen, once, in a
    # full suite: 0.2 s failed it)
    assert took < 4.0 and slowest < 2.5, (took, slowest)
    journal = tmp_path / "run" / "mlflow-journal.jsonl"
    assert sum('"op": "metrics"' in line for line in journal.read_text().splitlines()) == 1000

    server.start()  # the server comes back only now, at the end: end() delivers everything and the status
    assert tracker.end("FINISHED", wait=120)
    assert not senders()
    client = MlflowClient(server.uri)
    run_id = tracker.run_id
    assert json.loads((tmp_path / "run" / "mlflow-run.json").read_text())["run_id"] == run_id
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params == {"lr": "0.01"} and run.data.tags["k"] == "v"
    assert steps_of(client, run_id, "train/loss") == list(range(1000))
    assert steps_of(client, run_id, "train/lr") == list(range(1000))


def test_a_server_killed_mid_run_loses_nothing_and_sync_sends_the_rest_once(tmp_path, server, caplog, monkeypatch):
    from shardline.app.cli import app
    from tests.cluster import wait_until

    server.start()
    run_dir = tmp_path / "run"
    tracker = Tracker(MlflowConfig(tracking_uri=server.uri, experiment="outage"), str(tmp_path), run_dir=str(run_dir))
    run_id = tracker.start(None, "r", {})
    assert run_id is not None  # the server answered: created at once
    for step in range(50):
        tracker.log_metrics({"loss": float(step)}, step)
    server.kill()
    for step in range(50, 100):
        tracker.log_metrics({"loss": float(step)}, step)
    server.start()  # back while the run goes on: the sender notices by itself and catches up
    wait_until(lambda: tracker.journal.sent == tracker.journal.seq, 60, "the sender to catch up")
    client = MlflowClient(server.uri)
    assert steps_of(client, run_id, "loss") == list(range(100))

    server.kill()  # and away again when the run ends
    for step in range(100, 150):
        tracker.log_metrics({"loss": float(step)}, step)
    assert not tracker.end("FINISHED", wait=1)  # kept in the journal, said in one line
    assert not senders()
    kept = [r.getMessage() for r in caplog.records if "did not take everything" in r.getMessage()]
    sync = f"shardline sync {run_dir} --tracking-uri {server.uri}"
    assert len(kept) == 1 and sync in kept[0] and "end status FINISHED" in kept[0], kept

    server.start()
    # the server the run's folder names (shared storage: anyone who can write there can change it) is not where
    # this machine's MLflow credentials go unless this machine says so: refused, naming it, nothing sent
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    record = run_dir / "mlflow-run.json"
    planted = json.loads(record.read_text())
    for uri in (server.uri, "http://127.0.0.1:9"):
        record.write_text(json.dumps({**planted, "tracking_uri": uri}))
        refused = CliRunner().invoke(app, ["sync", str(run_dir)])
        assert refused.exit_code == 2, refused.output
        assert f"names the MLflow server {uri}, which is not this machine's MLFLOW_TRACKING_URI" in refused.output
        assert "--tracking-uri URI" in refused.output
    record.write_text(json.dumps(planted))
    assert steps_of(client, run_id, "loss") == list(range(100))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.uri)  # this machine's own server: taken
    first = CliRunner().invoke(app, ["sync", str(run_dir)])
    assert first.exit_code == 0, first.output
    assert "sent 50 metric value(s) and 0 param(s)" in first.output and "run status: FINISHED" in first.output
    again = CliRunner().invoke(app, ["sync", str(run_dir)])
    assert again.exit_code == 0, again.output
    assert "sent 0 metric value(s) and 0 param(s)" in again.output, again.output
    assert steps_of(client, run_id, "loss") == list(range(150))
    assert client.get_run(run_id).info.status == "FINISHED"
    # another store, which answers but has no such run: said so, not "run this again when it answers"
    other = f"sqlite:///{tmp_path / 'other.db'}"
    wrong = CliRunner().invoke(app, ["sync", str(run_dir), "--tracking-uri", other])
    assert wrong.exit_code == 2 and f"the MLflow store {other} has no run of the journal" in wrong.output, wrong.output


def test_replay_of_entries_in_doubt_checks_the_server_first(tmp_path):
    """A process died after MLflow took its entries but before the journal marked them, and its resumed
    run logs some steps again (new timestamps): each (key, step) still reaches MLflow once."""
    cfg, root, run_dir = MlflowConfig(experiment="e"), str(tmp_path / "store"), tmp_path / "run"
    first = Tracker(cfg, root, run_dir=str(run_dir))
    run_id = first.start(None, "r", {})
    for step in range(10):
        first.log_metrics({"loss": float(step)}, step)
    first.end("KILLED")
    journal = run_dir / "mlflow-journal.jsonl"
    lines = [json.loads(x) for x in journal.read_text().splitlines()]
    # the marks of everything after the run's creation are lost, and the timestamps are a replay's
    kept = [x for x in lines if not ("sent" in x and x["sent"] > 1)]
    journal.write_text("".join(json.dumps({**x, "ts": x["ts"] + 7} if "ts" in x else x) + "\n" for x in kept))

    report = sync_run(str(run_dir))
    assert (report.metrics, report.skipped, report.left) == (0, 10, 0)
    assert sync_run(str(run_dir)).skipped == 0  # now marked: nothing is looked at again

    resumed = Tracker(cfg, root, run_dir=str(run_dir))
    assert resumed.start(None, "r", {}) == run_id and resumed.resumed
    assert resumed.last_step("loss") == 9
    for step in range(5, 15):  # steps 5-9 replayed from a checkpoint, logged again regardless
        resumed.log_metrics({"loss": float(step)}, step)
    assert resumed.end("FINISHED")
    client = MlflowClient(resumed.uri)
    assert steps_of(client, run_id, "loss") == list(range(15))
    assert client.get_run(run_id).info.status == "FINISHED"
    assert len(client.search_runs([client.get_experiment_by_name("e").experiment_id])) == 1


def test_points_of_their_own_at_a_repeated_step_all_reach_mlflow_once_each(tmp_path):
    """Two interruptions resumed from one checkpoint: each is a point of `preemption/*` at that step. A resumed run's
    sender looks at what MLflow has and took a second point at a step as a replay: the second interruption was
    lost. Points logged as each their own all land, and an entry in doubt sent again is still one point."""
    cfg, root, run_dir = MlflowConfig(experiment="e"), str(tmp_path / "store"), tmp_path / "run"
    run_id = None
    for value in (29.0, 39.0):  # two attempts, each resumed at step 59
        tracker = Tracker(cfg, root, run_dir=str(run_dir))
        run_id = tracker.start(run_id, "r", {})
        tracker.log_metrics({"preemption/steps_redone": value}, 59, each=True)
        tracker.log_metrics({"loss": 1.0}, 59)  # a replayed step: once
        assert tracker.end("KILLED")
        time.sleep(0.01)  # another millisecond
    journal = run_dir / "mlflow-journal.jsonl"
    lines = [json.loads(x) for x in journal.read_text().splitlines()]
    journal.write_text("".join(json.dumps({k: v for k, v in x.items() if k != "sent"}) + "\n" for x in lines))
    sync_run(str(run_dir))  # every entry in doubt, sent again
    client = MlflowClient(Tracker(cfg, root, run_dir=str(run_dir)).uri)
    points = client.get_metric_history(run_id, "preemption/steps_redone")
    assert sorted((m.step, m.value) for m in points) == [(59, 29.0), (59, 39.0)]
    assert [m.step for m in client.get_metric_history(run_id, "loss")] == [59]


class _Refusing(BaseHTTPRequestHandler):
    def _refuse(self):
        self.send_response(503)
        self.end_headers()

    do_GET = do_POST = do_PATCH = _refuse

    def log_message(self, *args):
        pass


def test_a_refusing_server_never_holds_up_or_ends_the_run(tmp_path, caplog):
    httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), _Refusing)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        uri = f"http://alice:s3cret-pw@127.0.0.1:{httpd.server_address[1]}"
        tracker = Tracker(MlflowConfig(tracking_uri=uri), str(tmp_path), run_dir=str(tmp_path / "run"))
        t0 = time.perf_counter()
        assert tracker.start(None, "r", {}) is None
        for step in range(200):
            tracker.log_metrics({"loss": 1.0}, step)
        assert time.perf_counter() - t0 < 10
        assert not tracker.end("FAILED", wait=1)
        assert not senders()
    finally:
        httpd.shutdown()
        httpd.server_close()
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert "cannot be reached" in said and "did not take everything" in said
    assert "s3cret-pw" not in said and "http://***@127.0.0.1" in said
    left = [json.loads(x) for x in (tmp_path / "run" / "mlflow-journal.jsonl").read_text().splitlines()]
    assert [x["step"] for x in left if x.get("op") == "metrics"] == list(range(200))
    assert not any("sent" in x for x in left)


class Said(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.mark.e2e
def test_the_tracking_server_killed_mid_training(tmp_path, server, prefect_api, monkeypatch):
    """The whole pipeline against a real MLflow server that is SIGKILLed at the first checkpoint and
    started again on the same store while training goes on: one FINISHED run with every step of every
    metric exactly once, and the model registered from it."""
    from shardline.core.config import validate_config
    from shardline.flows.pipeline import pipeline
    from shardline.trainer.loop import STEP_POINTS
    from tests.cluster import wait_until
    from tests.conftest import make_raw, tiny_config

    make_raw(tmp_path / "raw", n_seq=15, rows=200)
    root = tmp_path / "store"
    cfg = tiny_config(
        str(tmp_path / "raw" / "*.parquet"),
        str(root),
        **{"training.epochs": 3, "mlflow.tracking_uri": server.uri, "mlflow.experiment": "outage"},
    )
    monkeypatch.setenv("SHARDLINE_TEST_STEP_DELAY", "0.04")  # a few seconds of training to kill the server in
    monkeypatch.setenv("SHARDLINE_MLFLOW_FLUSH_SECONDS", "180")
    server.start()

    def checkpoints() -> set[str]:
        return {p.name for p in root.glob("runs/*/checkpoints/ckpt-*.json")}

    seen: dict = {}

    def outage() -> None:
        try:
            wait_until(checkpoints, 600, "the first checkpoint", every=0.01)
            server.kill()
            seen["killed_after"] = checkpoints()
            # training goes on while nothing answers: two more checkpoints, then the server comes back
            wait_until(lambda: len(checkpoints() - seen["killed_after"]) >= 2, 120, "training to go on", every=0.01)
            seen["went_on"] = True
            server.start()
        except BaseException as e:  # noqa: BLE001 - reported by the test's thread below
            seen["error"] = e

    said = Said()
    logging.getLogger("shardline.core.tracking.tracker").addHandler(said)  # Prefect's logging config bypasses caplog
    watcher = threading.Thread(target=outage, daemon=True)
    watcher.start()
    try:
        result = pipeline(validate_config(cfg))
    finally:
        logging.getLogger("shardline.core.tracking.tracker").removeHandler(said)
    watcher.join(timeout=300)
    assert "error" not in seen, seen.get("error")
    assert seen.get("went_on") and server.healthy()
    assert not senders()

    reg = result["registered"]
    client = MlflowClient(server.uri)
    runs = client.search_runs([client.get_experiment_by_name("outage").experiment_id])
    assert [r.info.run_id for r in runs] == [reg["run_id"]] == [result["train"]["mlflow_run_id"]]
    assert client.get_run(reg["run_id"]).info.status == "FINISHED"
    steps = result["train"]["steps"]
    every = max(1, steps // STEP_POINTS)  # every step of a run this short
    assert steps_of(client, reg["run_id"], "train/train_loss") == list(range(every, steps + 1, every))
    assert steps_of(client, reg["run_id"], "train/lr") == list(range(every, steps + 1, every))
    epoch_keys = [k for k in client.get_run(reg["run_id"]).data.metrics if k.startswith("epoch/")]
    assert "epoch/val_loss" in epoch_keys
    for key in epoch_keys:
        assert steps_of(client, reg["run_id"], key) == [1, 2, 3], key
    # the journal beside the checkpoints says everything was taken, the end status included
    run_dir = result["train"]["run_dir"]
    lines = [json.loads(x) for x in (tmp_path / run_dir / "mlflow-journal.jsonl").read_text().splitlines()]
    entries = [x for x in lines if "op" in x]
    assert max(x["sent"] for x in lines if "sent" in x) == entries[-1]["seq"]
    assert entries[-1] == {**entries[-1], "op": "end", "status": "FINISHED"}
    version = client.get_model_version("tiny-model", str(reg["version"]))
    assert version.run_id == reg["run_id"] and reg["alias"] == "champion"
    assert sum("cannot be reached" in m for m in said.messages) == 1, said.messages  # said once, not per step
    assert not any("did not take everything" in m for m in said.messages), said.messages


def test_a_server_down_through_the_run_stops_registration_naming_it_and_the_same_command_then_registers_from_the_cache(
    tmp_path, server, prefect_api, monkeypatch
):
    """Nothing answers at mlflow.tracking_uri all along (the server not started yet): training and evaluation go on,
    then registration fails naming the URI and its setting (not MLflow's raw connection error); the server
    started, the same pipeline registers with every step before it from the cache, and the run that training
    journaled is the registered version's."""
    from shardline.core.config import validate_config
    from shardline.core.tracking.tracker import TrackingUnreachable
    from shardline.flows.pipeline import pipeline
    from tests.conftest import make_raw, tiny_config

    make_raw(tmp_path / "raw")
    cfg = tiny_config(
        str(tmp_path / "raw" / "*.parquet"),
        str(tmp_path / "store"),
        **{"mlflow.tracking_uri": server.uri, "mlflow.experiment": "down"},
    )
    monkeypatch.setenv("SHARDLINE_MLFLOW_FLUSH_SECONDS", "1")
    with pytest.raises(TrackingUnreachable, match=rf"MLflow at {server.uri} cannot be reached \(mlflow.tracking_uri"):
        pipeline(validate_config(cfg))
    server.start()
    result = pipeline(validate_config(cfg))
    assert result["steps"] == {**dict.fromkeys(["ingest", "encode", "train", "evaluate"], "cached"), "register": "ran"}
    reg = result["registered"]
    client = MlflowClient(server.uri)
    assert reg["version"] == 1 and reg["alias"] == "champion"
    assert client.get_model_version("tiny-model", "1").run_id == reg["run_id"]
    runs = client.search_runs([client.get_experiment_by_name("down").experiment_id])
    assert [r.info.run_id for r in runs] == [reg["run_id"]]  # the one training journaled, not a second
    assert steps_of(client, reg["run_id"], "epoch/val_loss") == [1, 2]  # what training journaled, sent


@pytest.mark.usefixtures("s3_endpoint")
def test_a_remote_run_folder_keeps_its_journal_locally_and_a_copy_beside_the_checkpoints(tmp_path, monkeypatch):
    """A run folder on S3: the journal is a local file, copied into the folder at each checkpoint and at the
    end; a resumed run on another machine (another local cache) continues from the copy."""
    import s3fs

    from shardline.core import storage

    s3fs.S3FileSystem().mkdir("runs-bucket")
    run_dir = "s3://runs-bucket/store/runs/abc"
    cfg, root = MlflowConfig(experiment="e"), str(tmp_path / "store")  # MLflow on sqlite, the run folder on S3
    monkeypatch.setenv("SHARDLINE_CACHE", str(tmp_path / "machine-a"))
    first = Tracker(cfg, root, run_dir=run_dir)
    run_id = first.start(None, "r", {})
    for step in range(5):
        first.log_metrics({"loss": float(step)}, step)
    first.save_journal()  # a checkpoint
    copy = storage.read_text(f"{run_dir}/mlflow-journal.jsonl")
    assert sum('"op": "metrics"' in line for line in copy.splitlines()) == 5
    assert json.loads(storage.read_text(f"{run_dir}/mlflow-run.json"))["run_id"] == run_id
    assert list((tmp_path / "machine-a").glob("mlflow-journals/*/mlflow-journal.jsonl"))
    first.end("KILLED")

    monkeypatch.setenv("SHARDLINE_CACHE", str(tmp_path / "machine-b"))  # resumed elsewhere
    again = Tracker(cfg, root, run_dir=run_dir)
    assert again.start(None, "r", {}) == run_id and again.last_step("loss") == 4
    for step in range(5, 8):
        again.log_metrics({"loss": float(step)}, step)
    assert again.end("FINISHED")
    lines = [json.loads(x) for x in storage.read_text(f"{run_dir}/mlflow-journal.jsonl").splitlines()]
    assert [x["status"] for x in lines if x.get("op") == "end"] == ["KILLED", "FINISHED"]
    assert max(x["sent"] for x in lines if "sent" in x) == max(x["seq"] for x in lines if "seq" in x)
    client = MlflowClient(again.uri)
    assert steps_of(client, run_id, "loss") == list(range(8))
    assert client.get_run(run_id).info.status == "FINISHED"
    monkeypatch.setenv("SHARDLINE_CACHE", str(tmp_path / "machine-c"))
    assert sync_run(run_dir).metrics == 0  # nothing left: a third machine sends nothing


def test_sync_of_a_folder_that_is_no_training_run_says_so(tmp_path):
    from shardline.app.cli import app

    out = CliRunner().invoke(app, ["sync", str(tmp_path)])
    assert out.exit_code == 2
    assert f"{tmp_path}: no MLflow journal (mlflow-journal.jsonl) there" in out.output
    assert list(tmp_path.iterdir()) == []  # nothing written into it
