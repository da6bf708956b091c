"""Registrations that mean what they say: one version per model (not per machine or cadence), every
champion move recorded on the versions, and two registrations at once decided one after the other.
Real pipeline runs through a real Prefect API and a real MLflow SQLite store."""

from __future__ import annotations

import json
import logging
import threading

import polars as pl
import pytest
from mlflow import MlflowClient

from shardline.core.config import validate_config
from tests.conftest import make_raw, tiny_config

pytestmark = pytest.mark.e2e


def run(cfg: dict, force=None) -> dict:
    from shardline.flows.pipeline import pipeline

    return pipeline(validate_config(cfg), force=force)


@pytest.fixture
def base(tmp_path):
    make_raw(tmp_path / "raw", n_seq=9, rows=40)
    cfg = tiny_config(
        str(tmp_path / "raw" / "*.parquet"),
        str(tmp_path / "store"),
        **{"training.epochs": 1, "mlflow.model_name": f"reg-{tmp_path.name}"},
    )
    return tmp_path, cfg


class Said(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def test_where_or_how_fast_it_trained_registers_no_new_version(base, prefect_api, monkeypatch):
    tmp_path, cfg = base
    first = run(cfg)
    assert first["registered"]["version"] == 1
    # only where it trains and how often it checkpoints: the same weights, the same model
    cfg["training"].update(num_workers=1, checkpoint_every_steps=3, keep_checkpoints=5)
    cfg["compute"] = {"poll_seconds": 2.0, "max_preemptions": 5}
    said = Said()  # what registration warns of (on its own logger: Prefect's set-up owns the root's)
    logging.getLogger("shardline.register").addHandler(said)
    second = run(cfg)
    assert second["steps"]["train"] == "cached"
    assert second["registered"]["version"] == 1
    client = MlflowClient(f"sqlite:///{tmp_path}/store/mlflow.db")
    versions = client.search_model_versions(f"name='{cfg['mlflow']['model_name']}'")
    assert [str(v.version) for v in versions] == ["1"]
    # the registry's own record of the same model, even when the cached result is gone (another machine)
    for record in (tmp_path / "store" / "prefect-results").glob("register-*"):
        record.unlink()
    third = run(cfg)
    assert third["registered"]["version"] == 1 and third["registered"].get("already_registered")
    logging.getLogger("shardline.register").removeHandler(said)
    # no warning: nothing is wrong with the same model registered before (the task's log says "already registered")
    assert not [r.getMessage() for r in said.records if r.levelno >= logging.WARNING]
    assert len(client.search_model_versions(f"name='{cfg['mlflow']['model_name']}'")) == 1

    # a run SIGKILLed between register_model and the alias leaves version 1 registered without the gate's
    # decision (its state is made here: the gate's tag and the alias gone): the next run gates that version,
    # and a champion is there again, with no second version
    name = cfg["mlflow"]["model_name"]
    client.delete_registered_model_alias(name, "champion")
    client.delete_model_version_tag(name, "1", "shardline.gate")
    for record in (tmp_path / "store" / "prefect-results").glob("register-*"):
        record.unlink()
    fourth = run(cfg)
    assert fourth["registered"]["version"] == 1 and fourth["registered"]["alias"] == "champion"
    assert str(client.get_model_version_by_alias(name, "champion").version) == "1"
    assert json.loads(client.get_model_version(name, "1").tags["shardline.gate"])["decision"] == "champion"
    assert len(client.search_model_versions(f"name='{name}'")) == 1

    # the same training under a second model name (a team's name beside a personal one): registered there too, and
    # both versions load with their files checked (the second registration logged the model again, replacing the
    # run's file list the first version is checked against, and deleted the model that version held)
    from shardline.core.tracking.tracker import fluent_tracking_uri
    from shardline.runs.model_files import load_checked

    team = run({**cfg, "mlflow": {**cfg["mlflow"], "model_name": f"team-{tmp_path.name}"}})
    assert team["steps"]["train"] == "cached" and team["steps"]["register"] == "ran"
    assert team["registered"]["version"] == 1 and team["registered"]["run_id"] == fourth["registered"]["run_id"]
    raw = pl.read_parquet(sorted((tmp_path / "raw").glob("*.parquet"))[0]).to_pandas()
    with fluent_tracking_uri(f"sqlite:///{tmp_path}/store/mlflow.db"):
        for model in (name, f"team-{tmp_path.name}"):
            predictions = load_checked(f"models:/{model}/1").predict(raw)
            assert len(predictions) == len(raw) - 3 * raw["seq"].nunique(), model  # each row with 3 rows before it

    # Shardline's training code edited (an upgrade): the run is addressed anew and trained again, to the same
    # weights: the same version (a version was keyed by its checkpoint file, which also holds its MLflow run and
    # timings: each such retraining registered a duplicate)
    from shardline.core import version as code
    from shardline.tasks import caching

    real_trainer, real_code = code.trainer_version, caching.code_version_of
    monkeypatch.setattr(code, "trainer_version", lambda: real_trainer() + "-edited")
    monkeypatch.setattr(caching, "code_version_of", lambda *m: real_code(*m) + ("-edited" if m == code.TRAINER else ""))
    again = run(cfg)
    assert again["steps"]["train"] == "ran" and again["train"]["run_dir"] != first["train"]["run_dir"]
    assert again["registered"]["version"] == 1, again["registered"]
    assert len(client.search_model_versions(f"name='{name}'")) == 1


def test_the_input_example_of_a_file_of_interleaved_sequences_is_one_they_predict(tmp_path, prefect_api):
    """A click log's file holds many users' rows in time order: the first rows of it (registration's input example)
    held no user's window, so MLflow's check of the example warned at every registration ("Failed to validate
    serving input example ... 0 predictions") and the registered example was input the model makes nothing of."""
    import mlflow

    make_raw(tmp_path / "parts", n_seq=9, rows=40)
    (tmp_path / "raw").mkdir()
    pl.concat([pl.read_parquet(p) for p in sorted((tmp_path / "parts").glob("*.parquet"))]).sort(
        "t", "seq"
    ).write_parquet(tmp_path / "raw" / "log.parquet")
    cfg = tiny_config(str(tmp_path / "raw" / "*.parquet"), str(tmp_path / "store"), **{"training.epochs": 1})
    said = Said()
    logging.getLogger("mlflow").addHandler(said)
    try:
        registered = run(cfg)["registered"]
    finally:
        logging.getLogger("mlflow").removeHandler(said)
    assert not [r.getMessage() for r in said.records if r.levelno >= logging.WARNING]
    mlflow.set_tracking_uri(registered["tracking_uri"])
    local = mlflow.artifacts.download_artifacts(registered["model_uri"], dst_path=str(tmp_path / "registered"))
    example = mlflow.models.Model.load(local).load_input_example(local)
    assert example["seq"].nunique() == 1 and len(mlflow.pyfunc.load_model(local).predict(example)) > 0


def test_every_champion_move_is_recorded_on_the_versions(base, prefect_api):
    tmp_path, cfg = base
    first = run(cfg)
    cfg["training"]["epochs"] = 4  # a better model on the same data
    second = run(cfg)
    client = MlflowClient(f"sqlite:///{tmp_path}/store/mlflow.db")
    name = cfg["mlflow"]["model_name"]
    v1 = client.get_model_version(name, "1")
    v2 = client.get_model_version(name, "2")
    gate1 = json.loads(v1.tags["shardline.gate"])
    assert gate1["champion"] is None and gate1["decision"] == "champion"
    gate2 = json.loads(v2.tags["shardline.gate"])
    assert gate2["champion"]["version"] == "1" and gate2["metric"] == "accuracy"
    assert gate2["data_fingerprint"] == first["snapshot"]["fingerprint"]
    assert "flow run" in gate2["by"]
    if second["registered"]["alias"] == "champion":
        moved = json.loads(v2.tags["shardline.alias.champion.from"])
        assert moved["champion"]["version"] == "1" and moved["value"] == second["registered"]["value"]
        assert json.loads(v1.tags["shardline.alias.champion.to"])["version"] == "2"
    else:
        assert "shardline.alias.champion.from" not in v2.tags and gate2["decision"] == "challenger"
    assert gate2["compared"] == {"on": "the recorded test metrics (the same test split)"}  # the same test windows

    # the same raw files split otherwise: other test windows (a split of one easy file scored 0.98 against 0.88 on
    # ten and took @champion as "the same data"): the champion is re-scored on this test split, not its number used
    cfg["data"]["split"]["seed"] = 7
    third = run(cfg)
    assert third["snapshot"]["fingerprint"] == first["snapshot"]["fingerprint"]
    gate3 = json.loads(client.get_model_version(name, str(third["registered"]["version"])).tags["shardline.gate"])
    champion = (
        client.get_model_version_by_alias(name, "champion") if third["registered"]["alias"] != "champion" else None
    )
    compared = gate3["compared"]
    assert compared["champion_test_split"] == gate3["champion"]["test_split"] != gate3["test_split"], gate3
    assert compared["rows"] > 0 and 0 <= compared["champion_value"] <= 1 and "recorded" not in compared["on"]
    assert compared["candidate_value"] == pytest.approx(third["metrics"]["accuracy"], abs=1e-9)
    assert champion is None or str(champion.version) == gate3["champion"]["version"]


def test_registrations_killed_after_log_model_or_past_their_lease_leave_one_model_and_a_champion(
    base, prefect_api, monkeypatch
):
    """Killed between `log_model` and `register_model` (the registry refused here): the run holds a logged model no
    version points to. The next registration deletes it and logs the model again; that one stalls past its registry
    lease while another registration takes it (`LeaseLost`), so it stops before the gate's tag and the alias. The
    run after that gates the version it left: one logged model, one version, a champion."""
    import mlflow

    from shardline.core import layout, storage
    from shardline.core.lease import Lease, LeaseLost, _name, create_exclusive, read_current
    from shardline.tasks import register as register_module

    tmp_path, cfg = base
    name = cfg["mlflow"]["model_name"]

    def killed(*a, **k):
        raise KeyboardInterrupt("killed after log_model")

    with monkeypatch.context() as m:
        m.setattr(mlflow, "register_model", killed)
        with pytest.raises(BaseException, match="killed after log_model"):
            run(cfg)
    client = MlflowClient(f"sqlite:///{tmp_path}/store/mlflow.db")
    experiments = [e.experiment_id for e in client.search_experiments()]
    left = client.search_logged_models(experiments)
    assert len(left) == 1 and not client.search_model_versions(f"name='{name}'")

    real_gate = register_module.champion_gate

    def gate_then_lease_taken(*a, **k):
        decided = real_gate(*a, **k)
        folder = layout.registry_lock(str(tmp_path / "store"), name)
        gen, _ = read_current(folder)  # as another registration takes a lease whose holder went silent (it
        # ends in half a second, unreleased: the next run takes it once expired)
        other = Lease(folder, "another", ttl=0.5)._record()
        assert create_exclusive(storage.join(folder, _name(gen + 1)), other)
        return decided

    with monkeypatch.context() as m:
        m.setattr(register_module, "champion_gate", gate_then_lease_taken)
        with pytest.raises(LeaseLost):
            run(cfg)
    version = client.get_model_version(name, "1")
    assert "shardline.gate" not in version.tags and not version.aliases
    models = client.search_logged_models(experiments)
    assert len(models) == 1 and models[0].model_id != left[0].model_id  # the killed registration's is gone
    assert version.source.endswith(models[0].model_id)

    again = run(cfg)
    assert again["registered"]["version"] == 1 and again["registered"]["alias"] == "champion"
    assert len(client.search_logged_models(experiments)) == 1
    assert len(client.search_model_versions(f"name='{name}'")) == 1
    # three registrations of one run: its test metrics logged once (each killed one's were logged again)
    run_id = again["registered"]["run_id"]
    tested = [k for k in client.get_run(run_id).data.metrics if k.startswith("test/")]
    assert tested and all(len(client.get_metric_history(run_id, k)) == 1 for k in tested)


def test_two_registrations_at_once_decide_one_after_the_other(base, prefect_api):
    """Both candidates beat the first champion; without the registry lease both read "v1 is champion"
    and both promote themselves. With it, the second to decide compares against the first's result."""
    from shardline.core.manifest import Snapshot
    from shardline.runs.result import EvalResult, TrainResult
    from shardline.tasks.ingest import snapshot_source
    from shardline.tasks.register import register_model

    tmp_path, cfg = base
    runs = []
    for epochs in (1, 3, 5):
        cfg["training"]["epochs"] = epochs
        cfg["mlflow"]["model_name"] = f"scratch-{epochs}"
        runs.append(run(cfg))
    config = validate_config({**cfg, "mlflow": {**cfg["mlflow"], "model_name": "race"}})
    snapshot: Snapshot = snapshot_source(config.data)

    def register(result, out):
        train = TrainResult.read(result["train"]["run_dir"])  # the run folder's result.json
        scores = EvalResult(metrics=result["metrics"], baseline=result["baseline"], table="", test_windows=0, files=[])
        out.append(register_model(config, snapshot, result["manifest"], train, scores).model_dump())

    first: list = []
    register(runs[0], first)
    out: list = []
    barrier = threading.Barrier(2)

    def go(result):
        barrier.wait()
        register(result, out)

    threads = [threading.Thread(target=go, args=(r,)) for r in runs[1:]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert len(out) == 2
    client = MlflowClient(config.mlflow.tracking_uri)
    versions = {str(v.version): v for v in client.search_model_versions("name='race'")}
    gates = {v: json.loads(mv.tags["shardline.gate"]) for v, mv in versions.items()}
    champions = [v for v in versions if "champion" in client.get_model_version("race", v).aliases]
    # one champion, and it is the best of the three (the accuracy the gate maximises)
    assert len(champions) == 1
    value = {str(r["version"]): r["value"] for r in first + out}
    assert value[champions[0]] == max(value.values())
    a, b = (str(r["version"]) for r in out)
    if value[a] > value["1"] and value[b] > value["1"]:
        # both beat v1: the one that decided second compared against the first, not against a stale v1
        compared = {gates[a]["champion"]["version"], gates[b]["champion"]["version"]}
        assert compared & {a, b}, gates


def timed(raw_dir, zone: str = "Europe/Berlin") -> None:
    """The raw files ordered by a time-zone-aware date-time, with an id column, as users' event logs are."""
    for path in raw_dir.glob("*.parquet"):
        df = pl.read_parquet(path)
        if "when" not in df.columns:
            start = pl.datetime(2024, 1, 1, time_zone="UTC")
            when = (start + pl.duration(minutes=pl.col("t"))).dt.convert_time_zone(zone)
            event = (pl.col("seq") + "-" + pl.col("t").cast(pl.String)).alias("event")
            df.with_columns(when.alias("when"), event).write_parquet(path)


def test_a_champion_tested_on_other_data_is_rescored_on_the_candidates_test_split(base, prefect_api):
    # rows keyed by a time-zone-aware date-time and an id column: the re-score matched no row on them (the
    # candidate's predictions hold the order as the encoding does, and no id column), and it failed on files in
    # different zones (polars found no supertype), so no retrained model of such data was ever promoted
    tmp_path, cfg = base
    cfg["data"].update(order_by="when", id_columns=["event"])
    timed(tmp_path / "raw")
    first = run(cfg)
    assert first["registered"]["alias"] == "champion"
    # evaluation's predictions keyed in the raw types (the date-time with its zone: it was int64), so they join back
    predicted = pl.read_parquet(f"{first['train']['run_dir']}/eval/test_predictions.parquet")
    raw = pl.concat([pl.read_parquet(p) for p in sorted((tmp_path / "raw").glob("*.parquet"))])
    assert predicted.schema["when"] == raw.schema["when"] and predicted.schema["seq"] == raw.schema["seq"]
    assert predicted.join(raw, on=["seq", "when"]).height == predicted.height
    for path in make_raw(tmp_path / "raw", n_seq=6, rows=40, prefix="more", seed=5):  # new raw files: other data
        # and a kind the champion never saw: its predict notes go in the gate's record, not warned as a user's input
        pl.read_parquet(path).with_columns(pl.col("kind").replace("c", "new")).write_parquet(path)
    timed(tmp_path / "raw", "America/New_York")  # in another zone (the re-score failed on the rows' concat)
    cfg["training"]["epochs"] = 2
    said = Said()  # on Shardline's loggers' parent: a warning of `predict` would reach it
    logging.getLogger("shardline").addHandler(said)
    try:
        second = run(cfg)
    finally:
        logging.getLogger("shardline").removeHandler(said)
    assert not [r.getMessage() for r in said.records if r.name == "shardline.predict"]
    assert second["snapshot"]["fingerprint"] != first["snapshot"]["fingerprint"]
    client = MlflowClient(cfg["mlflow"]["tracking_uri"])
    name = cfg["mlflow"]["model_name"]
    gate = json.loads(client.get_model_version(name, str(second["registered"]["version"])).tags["shardline.gate"])
    compared = gate["compared"]
    # not the champion's recorded number (another test split): both scored on the same rows of this one
    assert compared["champion_data_fingerprint"] == first["snapshot"]["fingerprint"]
    assert compared["rows"] > 0 and 0 <= compared["champion_value"] <= 1
    unseen = "column 'kind' holds 1 value(s) training never saw"
    assert any(note.startswith(unseen) for note in compared["champion_notes"]), compared
    assert compared["candidate_value"] == pytest.approx(second["metrics"]["accuracy"], abs=1e-9)
    promoted = compared["candidate_value"] > compared["champion_value"]
    assert (second["registered"]["alias"] == "champion") == promoted

    # a metric a served prediction cannot give (log loss needs every class's probability): said, champion kept
    cfg["mlflow"]["promotion_metric"] = "log_loss"
    make_raw(tmp_path / "raw", n_seq=3, rows=40, prefix="evenmore", seed=6)
    timed(tmp_path / "raw")
    third = run(cfg)
    gate = json.loads(client.get_model_version(name, str(third["registered"]["version"])).tags["shardline.gate"])
    assert "log_loss needs every class's probability" in gate["compared"]["reason"]
    assert third["registered"]["alias"] == "challenger"


@pytest.mark.parametrize("order", ["t", None])
def test_a_file_as_the_sequence_is_kept_apart_in_predictions_and_the_gate(base, prefect_api, order, monkeypatch):
    """`data.sequence_key: '@file'`: each file is a sequence, and its rows' order values repeat from file to file.
    Evaluation's predictions name their file; `shardline predict` over a folder predicts each file as a sequence
    of its own, as it predicts that file alone (it made the folder one sequence: windows across two files, the
    files' rows of one order interleaved); the champion gate re-scores the champion on the candidate's test files,
    a file at a time (it matched rows on their order alone, in every file, test split or not). Without an order
    column (the rows in the file's order), each row is its number in its file, the gate's too (it refused: the
    champion kept forever)."""
    from typer.testing import CliRunner

    from shardline.app.cli import app

    tmp_path, cfg = base

    def files(prefix: str, n: int, seed: int) -> None:  # one sequence a file, `t` from 0 in each
        for path in make_raw(tmp_path / "files", n_seq=3 * n, rows=40, prefix=prefix, seed=seed):
            rows = pl.read_parquet(path).filter(pl.col("seq") == pl.col("seq").first()).sort("t")
            rows.drop("seq" if order else ["seq", "t"]).write_parquet(path)

    files("f", 10, 0)
    cfg["data"].update(source=str(tmp_path / "files"), sequence_key="@file", order_by=order)
    key = order or "row"
    cfg["data"]["split"]["seed"] = 3  # 2 of the 10 files in test; 3 of the 15 after the new ones
    first = run(cfg)
    evaluated = pl.read_parquet(f"{first['train']['run_dir']}/eval/test_predictions.parquet")
    assert evaluated.columns[:2] == ["file", key] and evaluated["file"].n_unique() >= 1
    assert evaluated.group_by("file").len()["len"].to_list() == [37] * evaluated["file"].n_unique()  # 40 - K

    model, store = f"models:/{cfg['mlflow']['model_name']}@champion", cfg["mlflow"]["tracking_uri"]

    def predict(source, out: str) -> pl.DataFrame:
        said = CliRunner().invoke(app, ["predict", model, str(source), "--out", out, "--tracking-uri", store])
        assert said.exit_code == 0, said.output
        return pl.read_parquet(out)

    folder = predict(tmp_path / "files", str(tmp_path / "all.parquet"))
    assert folder.columns[:2] == ["file", key] and folder.height == 10 * 37
    alone = predict(tmp_path / "files" / "f-003.parquet", str(tmp_path / "one.parquet"))
    assert alone["file"].unique().to_list() == ["f-003.parquet"]
    assert folder.filter(pl.col("file") == "f-003.parquet").equals(alone)
    if order:  # three files' rows as one frame (one file to the model): their windows mix them, which a warning says
        import mlflow

        from shardline.trainer.serving import kept_notes

        mlflow.set_tracking_uri(store)
        served = mlflow.pyfunc.load_model(model)
        three = pl.concat([pl.read_parquet(tmp_path / "files" / f"f-00{i}.parquet") for i in range(3)])
        for rows, warned in ((three.head(40), False), (three, True)):
            with kept_notes() as said:  # what predict warns of its input
                served.predict(rows.to_pandas())
            assert any("100% of the rows share their 't' value" in m for m in said) == warned, said
    # a large input is predicted whole files at a time, as it is all at once; a chunk of files too short for a
    # window (here one of 2 rows alone) gives no prediction, as in the whole input
    import shardline.app.predict_input as P

    pl.read_parquet(tmp_path / "files" / "f-000.parquet").head(2).write_parquet(tmp_path / "short.parquet")
    (tmp_path / "short.parquet").rename(tmp_path / "files" / "z-short.parquet")
    monkeypatch.setenv("SHARDLINE_PREDICT_ROWS", "40")  # each file a chunk
    chunks, whole = [], P._predicted
    monkeypatch.setattr(
        P, "_predicted", lambda model, predictor, df, *a: chunks.append(df.height) or whole(model, predictor, df, *a)
    )
    assert predict(tmp_path / "files", str(tmp_path / "chunked.parquet")).equals(folder)
    assert chunks == [40] * 10 + [2]
    (tmp_path / "files" / "z-short.parquet").unlink()

    files("g", 5, 7)  # new files: another test split, on which the gate re-scores the champion
    cfg["training"]["epochs"] = 2
    second = run(cfg)
    candidate = pl.read_parquet(f"{second['train']['run_dir']}/eval/test_predictions.parquet")
    client = MlflowClient(store)
    version = client.get_model_version(cfg["mlflow"]["model_name"], str(second["registered"]["version"]))
    compared = json.loads(version.tags["shardline.gate"])["compared"]
    assert compared["rows"] == candidate.height, compared  # each test row once, matched in its own file
    assert candidate[key].to_list() == [i for _ in range(candidate["file"].n_unique()) for i in range(3, 40)]
    assert compared["candidate_value"] == pytest.approx(second["metrics"]["accuracy"], abs=1e-9)


def test_the_gate_scores_served_labels_as_the_whole_table_would():
    """The champion gate's re-score counts served labels in batches (no rows x labels table): the same
    accuracy and macro F1 as the whole one-hot table gives, on more rows than one batch."""
    import numpy as np
    import polars as pl

    from shardline.core.metrics import scores as M
    from shardline.runs.gate import _score

    rng = np.random.default_rng(0)
    names = [f"act-{i}" for i in range(40)]
    truth = pl.Series([names[i] for i in rng.integers(0, 40, 150_000)])
    predicted = pl.Series([names[i] for i in rng.integers(0, 30, 150_000)])
    labels = sorted(set(truth) | set(predicted))
    y = np.array([labels.index(v) for v in truth])
    p = np.zeros((len(y), len(labels)))
    p[np.arange(len(y)), [labels.index(v) for v in predicted]] = 1.0
    whole = M.classification_metrics(y, p)
    got = _score("classification", truth, predicted)
    assert got == {"accuracy": whole["accuracy"], "macro_f1": pytest.approx(whole["macro_f1"], rel=1e-12)}


def test_the_gate_reads_a_large_raw_file_a_row_group_at_a_time_up_to_its_bound(tmp_path, monkeypatch):
    """The champion's re-score reads the first raw files' rows up to GATE_ROWS: a click log in one large file was
    read whole into memory (its bytes, then its columns) to keep the first 200,000 rows of it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from shardline.core.manifest import RawFile, Snapshot
    from shardline.runs import gate

    log = tmp_path / "log.parquet"
    kinds = pa.array(["a", "b", "c", "a"] * 2500).dictionary_encode()  # stored as a dictionary: read as text
    pq.write_table(pa.table({"t": range(10_000), "kind": kinds, "x": [0.5] * 10_000}), log, row_group_size=1000)
    files = [RawFile(uri=str(log), size=log.stat().st_size, version="1")]
    snapshot = Snapshot(source=str(log), files=files, fingerprint="f")
    monkeypatch.setattr(gate, "GATE_ROWS", 1500)
    frames, n = gate._first_rows(snapshot, ["t", "kind"], ["t"], lambda frame, uri: frame.filter(pl.col("t") % 2 == 0))
    rows = pl.concat(frames)
    assert n == rows.height == 1500 and rows["t"].to_list() == list(range(0, 3000, 2))  # 3 row groups of 10
    assert rows.schema == {"t": pl.Int64, "kind": pl.String}
    assert "which" in gate._first_rows(snapshot, ["t"], ["t", "label"], lambda frame, uri: frame)


def test_the_gate_compares_the_champions_full_precision_metric_not_its_rounded_tag(tmp_path):
    """A version's `metric.accuracy` tag is for reading (0.1524); the gate compares its run's `test/accuracy`
    at full precision: 0.15242 does not beat 0.15244, though both read 0.1524. A version whose run lacks the
    metric (registered before the tags were rounded, its tag the full float) is compared by its tag."""
    from mlflow import MlflowClient

    from shardline.core.metrics.report import format_number
    from shardline.runs.gate import champion_gate

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.create_experiment("gate", artifact_location=(tmp_path / "artifacts").as_uri())

    def champion(name: str, run_metric: float | None, tag: str) -> None:
        run = client.create_run(experiment)
        if run_metric is not None:
            client.log_metric(run.info.run_id, "test/accuracy", run_metric)
        client.create_registered_model(name)
        version = client.create_model_version(
            name, f"{run.info.artifact_uri}/model", run.info.run_id, tags={"metric.accuracy": tag}
        )
        client.set_registered_model_alias(name, "champion", version.version)

    champion("rounded", 0.15244, format_number(0.15244))
    assert client.get_model_version("rounded", "1").tags["metric.accuracy"] == "0.1524"
    record = {"version": "1", "value": 0.15244, "data_fingerprint": None, "tokenizer": None, "predicts": None}
    record["test_split"] = None
    assert champion_gate(client, "rounded", "accuracy", "maximize", 0.15242) == (False, record)
    assert champion_gate(client, "rounded", "accuracy", "maximize", 0.15246) == (True, record)
    assert champion_gate(client, "rounded", "accuracy", "minimize", 0.15242) == (True, record)
    assert champion_gate(client, "rounded", "accuracy", "maximize", 0.15244) == (False, record)  # a tie keeps it

    champion("older", None, "0.15244")
    assert champion_gate(client, "older", "accuracy", "maximize", 0.15242) == (False, record)


def test_the_model_report_rounds_for_reading_says_a_tie_and_which_epoch_was_evaluated():
    from shardline.core.manifest import Snapshot
    from shardline.runs.result import EvalResult, Registered, TrainResult
    from shardline.tasks import register

    def model_report(reg: dict, train: dict, scores: dict, snapshot) -> str:  # the task's typed results
        trained = {
            **dict.fromkeys(["best_sha256", "parent", "best_epoch", "best_score", "best_val_loss", "resumed_from"]),
            **dict.fromkeys(["mlflow_run_id", "flow_run_id", "cost"]),
            **{"run_dir": "r", "best_checkpoint": "b", "last_checkpoint": "l", "select_by": "val_loss"},
            **{"tracking_uri": "u", "host": "h"},
            **train,
        }
        tested = EvalResult(metrics={}, baseline={}, test_windows=0, files=[], **scores)
        return register.model_report(Registered(**reg), TrainResult(**trained), tested, snapshot)

    snapshot = Snapshot(source="raw/*.parquet", files=[], fingerprint="f")
    value = 0.1524390243902439
    reg = {
        "model_name": "m",
        "version": 2,
        "alias": "challenger",
        "previous_champion": {"version": "1", "value": value, "data_fingerprint": "f"},
        "model_uri": "models:/m/2",
        "run_id": "abc",
        "tracking_uri": "sqlite:///x.db",
        "promotion_metric": "accuracy",
        "value": value,
        "compared": {"on": "the recorded test metrics (the same test split)"},
    }
    history = [{"epoch": e, "val_loss": loss} for e, loss in enumerate([0.9, 0.41, 0.41, 0.6])]
    train = {"device": "cpu", "precision": "fp32", "steps": 40, "history": history}
    scores = {"table": "| metric | model | baseline | better? |"}

    report = model_report(reg, train, scores, snapshot)
    assert report.startswith(
        "## m v2: tied with champion v1 at 0.1524: kept as **challenger** (a tie keeps the champion)"
    )
    assert "- evaluated the checkpoint with the lowest validation loss (epoch 2 of 4)" in report.splitlines()
    selected = {**train, "best_epoch": 3, "select_by": "val_accuracy", "best_score": 0.32101234}
    assert (
        "- evaluated the checkpoint of epoch 3 of 4, selected by training.select_by=val_accuracy "
        "(0.3210, best of 4 epochs)" in model_report(reg, selected, scores, snapshot).splitlines()
    )

    # promoted over a champion worse in the 5th digit: enough digits to tell them apart, no more
    promoted = {**reg, "alias": "champion", "value": 0.15243, "previous_champion": {"version": "1", "value": 0.15241}}
    assert "promoted to **champion**: accuracy 0.15243 (previous champion v1: 0.15241)" in model_report(
        promoted, train, scores, snapshot
    )
    # the champion was tested on other data: the numbers the gate compared are those of this test split
    rescored = {**reg, "compared": {"candidate_value": 0.5, "champion_value": 0.61234567, "rows": 9}}
    assert (
        "kept as **challenger**: champion v1 has accuracy 0.6123, this version 0.5000, both scored on this test split "
        "(9 rows)" in (model_report(rescored, train, scores, snapshot))
    )
    # on a part of a large test split (the first rows the gate reads): said, as the candidate's figure there is not
    # its own evaluation's (the log said "both scored on this test split" beside two different figures)
    part = (
        "the candidate's test rows in its first 3 raw files, the first 200,000 rows or more, not its whole test split"
    )
    rescored["compared"] |= {"on": part, "rows": 201_234}
    assert f"this version 0.5000, both scored on {part} (201,234 rows)" in model_report(
        rescored, train, scores, snapshot
    )


CONSTANT = """
import torch
from torch import nn


class Constant(nn.Module):  # the same class for every window, whatever it sees: no better than the majority class
    def __init__(self, spec):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(1))
        self.n = spec.targets[0].n_classes

    def forward(self, cont, cat):
        out = torch.zeros(cont.shape[0], self.n) + self.w * 0
        out[:, -1] = 5.0
        return out
"""


def test_a_first_model_no_better_than_the_baseline_is_no_champion(base, prefect_api):
    """No champion yet: a version that does not beat the test split's trivial baseline on the promotion metric is
    registered as a challenger (said, with how to promote it anyway), not served as @champion; the first that beats
    it is the champion."""
    tmp_path, cfg = base
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "constant.py").write_text(CONSTANT)
    weak = {**cfg, "model": {"entrypoint": "models.constant:Constant", "code_dir": str(tmp_path)}}
    said = Said()
    logging.getLogger("shardline").addHandler(said)
    try:
        first = run(weak)
    finally:
        logging.getLogger("shardline").removeHandler(said)
    client = MlflowClient(f"sqlite:///{tmp_path}/store/mlflow.db")
    name = cfg["mlflow"]["model_name"]
    assert first["registered"]["alias"] == "challenger" and first["weak"]
    assert "champion" not in client.get_registered_model(name).aliases
    gate = json.loads(client.get_model_version(name, "1").tags["shardline.gate"])
    assert gate["decision"] == "challenger" and gate["champion"] is None
    assert gate["compared"]["baseline_value"] >= gate["value"]
    assert "does not beat the baseline" in client.get_model_version(name, "1").description
    warned = " ".join(r.getMessage() for r in said.records)
    assert "does not beat the baseline on test accuracy" in warned and "set_registered_model_alias" in warned
    # predicting with the champion says what the model has instead, as a bad command line
    import subprocess
    import sys
    from pathlib import Path

    shardline = str(Path(sys.executable).parent / "shardline")
    raw = str(next((tmp_path / "raw").glob("*.parquet")))
    uri = ["--tracking-uri", first["registered"]["tracking_uri"]]
    done = subprocess.run(
        [shardline, "predict", f"models:/{name}@champion", raw, "--out", str(tmp_path / "p.parquet"), *uri],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2, done.stderr
    assert f"alias champion not found; {name} has version(s) 1 (@challenger), none @champion" in done.stderr

    second = run({**cfg, "training": {**cfg["training"], "epochs": 4}})  # the built-in mlp learns the label
    assert second["registered"]["alias"] == "champion" and not second["weak"]
    assert client.get_registered_model(name).aliases == {"champion": 2, "challenger": 1}


def test_a_version_of_another_target_or_horizon_is_never_compared_with_the_champion(base, prefect_api):
    """A teammate's config that predicts another column (or the same one further ahead) under the same model name:
    its score answers another question. It was compared with the champion's all the same (recorded, or the champion
    re-scored against the other column's labels) and took @champion, so `models:/NAME@champion` served another
    target's predictions. Now the champion stays, and the new version is a challenger with the reason said."""
    tmp_path, cfg = base
    first = run(cfg)
    assert first["registered"]["alias"] == "champion"
    client = MlflowClient(cfg["mlflow"]["tracking_uri"])
    name = cfg["mlflow"]["model_name"]
    for change, theirs in [
        ({"target": {"column": "kind", "task": "classification"}}, "kind (classification), 1 row(s) ahead"),
        ({"horizon": 2}, "label (classification), 2 row(s) ahead"),
    ]:
        other = run({**cfg, "data": {**cfg["data"], **change}})
        version = str(other["registered"]["version"])
        assert other["registered"]["alias"] == "challenger", change
        gate = json.loads(client.get_model_version(name, version).tags["shardline.gate"])
        assert gate["compared"]["reason"].startswith(
            f"the champion predicts label (classification), 1 row(s) ahead; this version {theirs}: they answer "
            "different questions"
        ), gate["compared"]
        assert "set mlflow.model_name" in gate["compared"]["reason"]
        assert client.get_registered_model(name).aliases["champion"] == 1
