"""Sweeps on Optuna: trials that fall behind are pruned at an epoch's end (said in MLflow, Prefect and the study),
the study lives in the storage root and a rerun continues it, TPE proposes trials from the finished ones, and a
trial preempted mid-epoch reports the same values to its pruner as one that never stopped. Real Prefect API, real
MLflow store, real (tiny) trainings, Optuna's own samplers and pruners."""

from __future__ import annotations

import threading

import optuna
import pytest
from mlflow import MlflowClient

from shardline.core.storage import join
from shardline.core.study import PRUNED_TAG, StorageJournal, open_study
from shardline.core.sweep import sweep_figure
from tests.conftest import make_raw, tiny_config
from tests.test_s3_source import s3_endpoint  # noqa: F401 - the moto fixture

pytestmark = pytest.mark.e2e


def run_sweep(cfg: dict, space: dict, **kw) -> dict:
    from shardline.core.config import validate_config
    from shardline.flows.sweep import sweep

    return sweep(validate_config(cfg), space, **kw)


def study_of(result: dict):
    return open_study(join(result["folder"], "optuna"), result["sweep_id"], None)


@pytest.fixture
def data(tmp_path):
    make_raw(tmp_path / "raw", n_seq=12, rows=50)
    cfg = tiny_config(str(tmp_path / "raw" / "*.parquet"), str(tmp_path / "store"), **{"training.epochs": 2})
    return tmp_path, cfg


def test_a_pruned_sweep_stopped_at_its_budget_finishes_when_the_limit_is_raised_and_new_data_is_a_new_sweep(
    data, prefect_api
):
    """Trials stopped at `training.max_hours` stay running in the study: the rerun with a raised limit (as the stop
    says to do) resumes them and reports their epochs to the pruner. They were told failed at the stop; the resumed
    trial's first report then raised Optuna's UpdateFinishedTrialError, on every rerun, and a trial that finished
    stayed failed in the study."""
    from shardline.core.failures import BudgetExceeded

    tmp_path, cfg = data
    space = {"training.lr": [0.05, 0.03]}
    cfg["training"]["max_hours"] = 1e-7  # stopped at once, each trial
    with pytest.raises(BudgetExceeded, match="every trial stopped at its budget"):
        run_sweep(cfg, space, at_once=1, prune="median")
    cfg["training"]["max_hours"] = 1.0
    raised = run_sweep(cfg, space, at_once=1, prune="median")
    assert [r["state"] for r in raised["trials"]] == ["ran", "ran"], raised["trials"]
    study = study_of(raised)
    assert [t.state for t in study.trials] == [optuna.trial.TrialState.COMPLETE] * 2
    assert [list(t.intermediate_values) for t in study.trials] == [[1], [1]]  # reported (not the last epoch)
    client = MlflowClient(cfg["mlflow"]["tracking_uri"])  # each trial's run named by its trial, not by time alone
    names = [client.get_run(r["mlflow_run_id"]).info.run_name for r in raised["trials"]]
    assert all(f"-{t}-2" in n for n, t in zip(names, ("t1", "t2"), strict=True)), names  # name-t1-2026...

    # new raw files: another sweep (its own study and parent run), not the old data's trials scored against the new
    make_raw(tmp_path / "raw", n_seq=3, rows=50, seed=1, prefix="n")
    more = run_sweep(cfg, space, at_once=1, prune="median")
    assert more["sweep_id"] != raised["sweep_id"] and more["parent_run_id"] != raised["parent_run_id"]
    assert [r["state"] for r in more["trials"]] == ["ran", "ran"] and len(study_of(more).trials) == 2
    assert len(study_of(raised).trials) == 2  # the old data's study as it was


def test_trials_that_fall_behind_are_pruned_a_rerun_continues_the_study_and_tpe_proposes(data, prefect_api):
    """Median pruning, one trial at a time, two epochs each: the two first trials (good learning rates) finish;
    the third, with a learning rate that learns nothing, falls below the median at its first epoch and stops
    there, with a checkpoint. Pruned in the study, on its MLflow run and its Prefect flow run; the best finished
    trial is registered. The same sweep again opens the same study: no trial is added or trained again.
    Then `--tpe 2` on the same data: Optuna's TPE sampler proposes each trial as the one before finishes
    (seeded); the same sweep again finds its two trials in the study, trains nothing and proposes nothing new."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    tmp_path, cfg = data
    space = {"training.lr": [0.05, 0.03, 1e-7]}
    first = run_sweep(cfg, space, at_once=1, prune="median")
    rows = {r["trial"]: r for r in first["trials"]}
    assert [rows[t]["state"] for t in ("t1", "t2")] == ["ran", "ran"]
    assert (rows["t3"]["state"], rows["t3"]["pruned_epoch"]) == ("pruned", 1)
    assert first["best"]["trial"] in ("t1", "t2") and first["registered"]["version"] == 1
    assert "1 pruned" in first["steps"]["train"]
    # the comparison picture tells the pruned trial (a score of fewer epochs) from the finished ones: hollow, named
    fig = sweep_figure(first["trials"], ["training.lr"], "val_accuracy", "maximize")
    for ax in fig.axes:
        hollow = [c for c in ax.collections if c.get_label() == "pruned (fewer epochs)"]
        assert len(hollow) == 1 and len(hollow[0].get_offsets()) == 1
        assert hollow[0].get_offsets()[0][1] == rows["t3"]["score"] and len(hollow[0].get_facecolors()) == 0
        assert "pruned (fewer epochs)" in [t.get_text() for t in ax.get_legend().get_texts()]

    study = study_of(first)
    states = {t.user_attrs["shardline.trial"]: t.state for t in study.trials}
    done, pruned_state = optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED
    assert states == {"t1": done, "t2": done, "t3": pruned_state}
    pruned = next(t for t in study.trials if t.user_attrs["shardline.trial"] == "t3")
    assert list(pruned.intermediate_values) == [1]  # one epoch reported, then stopped

    client = MlflowClient(cfg["mlflow"]["tracking_uri"])
    run = client.get_run(rows["t3"]["mlflow_run_id"])
    assert run.data.tags[PRUNED_TAG] == "1" and run.info.status == "FINISHED"
    assert PRUNED_TAG not in client.get_run(rows["t1"]["mlflow_run_id"]).data.tags
    with get_client(sync_client=True) as prefect:
        flow_runs = prefect.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=["pruned"])))
    assert len(flow_runs) == 1 and flow_runs[0].state.is_completed()

    again = run_sweep(cfg, space, at_once=1, prune="median")
    assert [r["state"] for r in again["trials"]] == ["cached", "cached", "pruned"]
    assert len(study_of(again).trials) == 3 and again["sweep_id"] == first["sweep_id"]
    assert client.get_run(first["parent_run_id"]).data.params["sweep.pruner"] == "median"

    # the same trials unpruned: another sweep (its own study and parent run); the pruned trial trains on to its
    # end in its run, which is pruned no more
    unpruned = run_sweep(cfg, space, at_once=1)
    assert unpruned["sweep_id"] != first["sweep_id"] and unpruned["parent_run_id"] != first["parent_run_id"]
    assert [r["mlflow_run_id"] for r in unpruned["trials"]] == [rows[t]["mlflow_run_id"] for t in ("t1", "t2", "t3")]
    # t1 and t2 were found finished in their run folders (another study's: not in the train cache), not trained
    assert [r["state"] for r in unpruned["trials"]] == ["cached", "cached", "ran"]
    assert [r["score"] for r in unpruned["trials"][:2]] == [rows[t]["score"] for t in ("t1", "t2")]  # found finished
    assert PRUNED_TAG not in client.get_run(rows["t3"]["mlflow_run_id"]).data.tags

    cfg["training"]["epochs"] = 1
    tpe_space = {"training.lr": {"low": 0.001, "high": 0.1, "log": True}, "model.hidden": [8, 16]}
    proposed = run_sweep(cfg, tpe_space, trials=2, sampler="tpe", at_once=1, seed=3)
    assert proposed["mode"] == "tpe" and [r["trial"] for r in proposed["trials"]] == ["t1", "t2"]
    assert {r["state"] for r in proposed["trials"]} == {"ran"}
    tpe_study = study_of(proposed)
    assert [t.state for t in tpe_study.trials] == [done] * 2
    for row, trial in zip(proposed["trials"], tpe_study.trials):
        lr = trial.params["training.lr"]  # Optuna's draw, kept to 6 significant digits as a random sweep's
        assert row["overrides"] == {**trial.params, "training.lr": float(f"{lr:.6g}")} and 0.001 <= lr <= 0.1
    again = run_sweep(cfg, tpe_space, trials=2, sampler="tpe", at_once=1, seed=3)
    assert [r["state"] for r in again["trials"]] == ["cached"] * 2
    assert [r["overrides"] for r in again["trials"]] == [r["overrides"] for r in proposed["trials"]]
    assert len(study_of(again).trials) == 2


def _racing_writers(journal: str, writers: int = 4, each: int = 25) -> None:
    journals = [StorageJournal(journal) for _ in range(writers)]

    def write(i: int) -> None:
        for j in range(each):
            journals[i].append_logs([{"writer": i, "n": j}])

    threads = [threading.Thread(target=write, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    logs = StorageJournal(journal).read_logs(0)
    assert len(logs) == writers * each
    for i in range(writers):
        assert [e["n"] for e in logs if e["writer"] == i] == list(range(each))
    assert StorageJournal(journal).read_logs(len(logs) - 2) == logs[-2:]


def test_the_study_journal_takes_appends_from_many_writers_at_once(tmp_path):
    """The journal in the storage root: writers that race for the next entry never overwrite each other, and a
    reader replays every append once, in order."""
    _racing_writers(str(tmp_path / "journal"))


def test_the_study_journal_on_s3(s3_endpoint):  # noqa: F811
    """The same on an S3 root (a real moto server): the entries are created with S3's conditional put, so racing
    writers on two machines cannot overwrite each other's; and a study opened there works as Optuna's storage."""
    import s3fs

    s3fs.S3FileSystem().mkdir("study-bucket")
    _racing_writers("s3://study-bucket/sweeps/x/race", writers=3, each=6)
    study = open_study("s3://study-bucket/sweeps/x/optuna", "x", "maximize")
    trial = study.ask()
    trial.report(0.5, 1)
    study.tell(trial, 0.7)
    again = open_study("s3://study-bucket/sweeps/x/optuna", "x", None)
    assert [(t.value, t.intermediate_values) for t in again.trials] == [(0.7, {1: 0.5})]


def test_a_log_axis_over_a_decade_or_two_labels_its_decades_only():
    """A rate swept from 1e-3 to 3e-2: the log axis labelled every minor tick too, and they ran into each other
    ("2×10⁻³4×10⁻³6×10⁻³")."""
    rates = [0.0012, 0.002, 0.004, 0.008, 0.02, 0.03]
    rows = [
        {"trial": f"t{i}", "overrides": {"training.lr": lr}, "score": 0.5 + i / 100, "state": "ran"}
        | {"direction": "maximize", "metric": "val_accuracy"}
        for i, lr in enumerate(rates)
    ]
    fig = sweep_figure(rows, ["training.lr"], "val_accuracy", "maximize")
    fig.canvas.draw()
    ax = next(a for a in fig.axes if a.get_xlabel() == "training.lr")
    assert ax.get_xscale() == "log"
    assert [t.get_text() for t in ax.xaxis.get_minorticklabels() if t.get_text()] == []
    assert len([t for t in ax.xaxis.get_majorticklabels() if t.get_text()]) >= 2
