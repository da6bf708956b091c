"""Sweeps through a real Prefect API, a real MLflow SQLite store and real (tiny) trainings: trials train
once each, concurrently, in child processes; the best is registered; a rerun trains nothing; a failed
trial is reported and does not sink the sweep; a sweep killed mid-way finishes on rerun; bad input is
refused before any work."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from mlflow import MlflowClient

from shardline.core.sweep import SweepError, parse_space, plan_sweep, random_trials
from tests.conftest import api_env, make_raw, tiny_config

pytestmark = pytest.mark.e2e

BIN = Path(sys.executable).parent / "shardline"
GRID = {"model.hidden": [8, 32], "training.lr": [0.01, 0.001]}


def run_sweep(cfg: dict, space: dict, **kw) -> dict:
    from shardline.core.config import validate_config
    from shardline.flows.sweep import sweep

    return sweep(validate_config(cfg), space, **kw)


def runs_of(client: MlflowClient, experiment: str = "tiny") -> list:
    exp = client.get_experiment_by_name(experiment)
    return client.search_runs([exp.experiment_id]) if exp else []


def sweep_artifact(key: str = "sweep") -> str:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterKey

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[key])), limit=50)
    return "\n".join(str(a.data) for a in found)


@pytest.fixture
def data(tmp_path):
    make_raw(tmp_path / "raw", n_seq=12, rows=50)
    root = str(tmp_path / "store")
    cfg = tiny_config(str(tmp_path / "raw" / "*.parquet"), root, **{"training.epochs": 1})
    return tmp_path, cfg


def test_a_grid_sweep_trains_each_trial_once_registers_the_best_and_a_rerun_trains_nothing(data, prefect_api):
    tmp_path, cfg = data
    result = run_sweep(cfg, GRID, at_once=2)

    rows = result["trials"]
    assert [r["overrides"] for r in rows] == [
        {"model.hidden": 8, "training.lr": 0.01},
        {"model.hidden": 8, "training.lr": 0.001},
        {"model.hidden": 32, "training.lr": 0.01},
        {"model.hidden": 32, "training.lr": 0.001},
    ]
    assert [r["state"] for r in rows] == ["ran"] * 4
    assert result["steps"] == {"ingest": "ran", "encode": "ran", "train": "4 ran", "evaluate": "ran", "register": "ran"}
    # one data set encoded for the four trials; four training runs, each in its own folder
    datasets = [d for d in (tmp_path / "store" / "datasets").iterdir() if d.name != "groups"]
    assert len(datasets) == 1
    assert len({r["run_dir"] for r in rows}) == 4 and all(Path(r["run_dir"], "result.json").exists() for r in rows)
    # two at once on this machine, each with its share of the cores
    assert result["at_once"] == 2 and result["cpu_threads"] == max(1, len(os.sched_getaffinity(0)) // 2)

    # the best by the validation score is the registered one, tagged with the sweep
    sign = -1 if result["direction"] == "maximize" else 1
    best = min(rows, key=lambda r: sign * r["score"])
    assert result["best"]["trial"] == best["trial"]
    reg = result["registered"]
    assert (reg["version"], reg["alias"], reg["run_id"]) == (1, "champion", best["mlflow_run_id"])
    client = MlflowClient(reg["tracking_uri"])
    version = client.get_model_version("tiny-model", "1")
    parent = result["parent_run_id"]
    assert version.tags["shardline.sweep"] == parent
    assert json.loads(version.tags["shardline.sweep.overrides"]) == best["overrides"]

    # MLflow: the trials are children of the sweep's run, with their overrides; the parent has the scores
    children = {r.data.tags.get("shardline.sweep.trial"): r for r in runs_of(client) if r.info.run_id != parent}
    assert sorted(children) == ["t1", "t2", "t3", "t4"]
    for row in rows:
        run = children[row["trial"]]
        assert run.data.tags["mlflow.parentRunId"] == parent and run.info.status == "FINISHED"
        assert json.loads(run.data.tags["shardline.sweep.overrides"]) == row["overrides"]
        assert run.data.params["model.hidden"] == str(row["overrides"]["model.hidden"])
        # two trials train at once and log to one console: each training's flow run names its trial
        assert run.data.tags["shardline.prefect.flow_run_name"].startswith(f"tiny · train {row['trial']} · ")
    parent_run = client.get_run(parent)
    assert parent_run.info.status == "FINISHED"
    key = f"trial/{result['metric']}"
    assert [(m.step, m.value) for m in client.get_metric_history(parent, key)] == [
        (i, r["score"]) for i, r in enumerate(rows, start=1)
    ]
    # the runs table shows a metric's last value: the sweep's best is its own metric (trial/... ends at the last trial)
    best_key = f"best/{result['metric']}"
    assert [(m.step, m.value) for m in client.get_metric_history(parent, best_key)] == [(4, best["score"])]
    assert {a.path for a in client.list_artifacts(parent, "sweep")} == {"sweep/comparison.png"}
    assert Path(result["plot"]).read_bytes()[:4] == b"\x89PNG"
    # what the sweep cost: each trial's training, added up, on the result and on the parent run
    total = result["cost"]
    assert total["runs"] == 4 and total["gpu_hours"] > 0
    assert total["gpu_hours"] == sum(r["cost"]["gpu_hours"] for r in rows)
    assert [m.value for m in client.get_metric_history(parent, "cost/gpu_hours")] == [total["gpu_hours"]]
    listed = sweep_artifact()
    assert all(f"`model.hidden={r['overrides']['model.hidden']}`" in listed for r in rows)
    assert f"**{best['trial']}** (best)" in listed

    # the same sweep again: nothing trains, the same parent run, no new MLflow run
    before = len(runs_of(client))
    again = run_sweep(cfg, GRID, at_once=2)
    assert again["steps"] == {
        "ingest": "cached",
        "encode": "cached",
        "train": "4 cached",
        "evaluate": "cached",
        "register": "cached",
    }
    assert again["parent_run_id"] == parent and len(runs_of(client)) == before
    assert [r["score"] for r in again["trials"]] == [r["score"] for r in rows]
    assert len(client.get_metric_history(parent, key)) == 4  # each trial's score logged once
    assert len(client.get_metric_history(parent, best_key)) == 1
    assert again["cost"]["gpu_hours"] == total["gpu_hours"]  # the cached trials at what they cost when they ran
    assert len(client.get_metric_history(parent, "cost/gpu_hours")) == 1


def test_a_trial_that_fails_is_reported_and_the_best_of_the_rest_is_registered(data, prefect_api):
    """The built-in MLP's dropout of 2 is no probability: that trial fails when its model is built."""
    tmp_path, cfg = data
    result = run_sweep(cfg, {"model.params": [{}, {"dropout": 2.0}]}, at_once=2)

    ok, bad = result["trials"]
    assert ok["state"] == "ran" and bad["state"] == "failed"
    assert "dropout probability" in bad["error"] and bad["score"] is None
    assert result["best"]["trial"] == ok["trial"] and result["steps"]["train"] == "1 ran, 1 failed"
    reg = result["registered"]
    assert reg["run_id"] == ok["mlflow_run_id"] and reg["alias"] == "champion"
    client = MlflowClient(reg["tracking_uri"])
    parent = client.get_run(result["parent_run_id"])
    assert parent.info.status == "FINISHED"
    assert "dropout probability" in json.loads(parent.data.tags["shardline.sweep.failed"])[bad["trial"]]
    failed_run = next(r for r in runs_of(client) if r.data.tags.get("shardline.sweep.trial") == bad["trial"])
    assert failed_run.info.status == "FAILED" and failed_run.data.tags["mlflow.parentRunId"] == parent.info.run_id
    assert "failed: " in sweep_artifact() and "dropout probability" in sweep_artifact()
    assert result["cost"]["runs"] == 2  # the failed trial held its machine until it failed: that is paid for too

    # a trial that fails after training a while (it diverges) paid for those steps: they count in the sweep's cost
    diverged = run_sweep(cfg, {"training.lr": [0.01, 1e6]}, at_once=1)
    ok, bad = diverged["trials"]
    assert (ok["state"], bad["state"]) == ("cached", "failed") and bad["cost"]["gpu_hours"] > 0, bad
    assert diverged["cost"]["runs"] == 2
    assert diverged["cost"]["gpu_hours"] == pytest.approx(ok["cost"]["gpu_hours"] + bad["cost"]["gpu_hours"])

    # a data setting that does not encode (a window longer than every sequence) fails its trials, not the sweep:
    # it stopped the sweep before any trial trained, naming no trial
    windows = run_sweep(cfg, {"data.window": [3, 600]}, at_once=2)
    ok, bad = windows["trials"]
    assert ok["state"] == "cached" and bad["state"] == "failed" and bad["score"] is None, windows["trials"]
    assert "with no window" in bad["error"] and "data.window=600" in bad["error"], bad["error"]
    assert windows["best"]["trial"] == ok["trial"] and windows["registered"]["alias"] in ("champion", "challenger")


def test_a_sweep_whose_trials_all_stop_at_their_budget_exits_as_a_budget_stop(data, prefect_api):
    """Every trial stopped at `training.max_hours`: not a failure (exit 1 with three tracebacks) but `run`'s budget
    stop, exit 76, saying to raise the limit; each trial is `budget` in the summary, with what it cost."""
    tmp_path, cfg = data
    cfg["training"].update(epochs=400, max_hours=0.0004)  # 1.4 s of training each: far short of 400 epochs
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    out = subprocess.run(
        [str(BIN), "sweep", str(tmp_path / "c.yaml"), "--grid", "model.hidden=8,16"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env=api_env(),
    )  # fmt: skip
    assert out.returncode == 76, out.stderr[-3000:]
    assert "every trial stopped at its budget after " in out.stderr and "raise training.max_hours" in out.stderr
    for trial in ("t1 (model.hidden=8): ", "t2 (model.hidden=16): "):  # each trial, with where it stopped
        assert f"{trial}BudgetExceeded: training stopped at its budget" in out.stderr, out.stderr[-3000:]
    assert "RuntimeError" not in out.stderr and "Traceback" not in out.stderr, out.stderr[-5000:]  # trials' too


def test_a_sweep_whose_every_trial_fails_lists_each_with_its_error_without_a_traceback(data, prefect_api):
    """Every trial fails (here the user's model refuses its params): exit 1 and one `error:` saying so, then each
    trial on a line of its own, with its overrides and its error. It was a Prefect traceback of a RuntimeError,
    then an `error:` line joining every trial's error into one."""
    tmp_path, cfg = data
    (tmp_path / "nets.py").write_text(
        "class Net:\n    def __init__(self, spec, width=8):\n        raise ValueError(f'no net is {width} wide')\n"
    )
    cfg["model"] = {"entrypoint": "nets:Net", "params": {"width": 8}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    out = subprocess.run(
        [str(BIN), "sweep", str(tmp_path / "c.yaml"), "--grid", "model.params.width=8,16"],
        capture_output=True, text=True, timeout=600, cwd=tmp_path, env=api_env(),
    )  # fmt: skip
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback" not in out.stdout + out.stderr and "RuntimeError" not in out.stderr, out.stderr[-5000:]
    said = out.stderr[out.stderr.index("error: every trial failed:") :].splitlines()
    assert said[1].startswith("  t1 (model.params.width=8): ") and "no net is 8 wide" in said[1], said
    assert said[2].startswith("  t2 (model.params.width=16): ") and "no net is 16 wide" in said[2], said


def test_a_killed_sweep_finishes_on_rerun_without_retraining_finished_trials(data, prefect_api):
    """`shardline sweep` is SIGKILLed once its first trial has finished and the second has checkpointed: the
    second trial's process stops by itself (at a checkpoint) and exits within seconds, though the Prefect API it
    reported to (the command's own temporary one) went with the sweep (it retried that API for about 4 minutes,
    holding its memory); the same command again takes the first trial from the cache, resumes the second from its
    checkpoint, trains the third and registers the best."""
    tmp_path, cfg = data
    cfg["training"]["checkpoint_every_steps"] = 2
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # each command's own API, as a user's
    env["SHARDLINE_TEST_STEP_DELAY"] = "0.25"  # a few seconds of training per trial: room to kill mid-trial
    env["PREFECT_HOME"] = str(tmp_path / "prefect-home")
    command = [str(BIN), "sweep", str(tmp_path / "c.yaml"), "--grid", "model.hidden=8,16,32", "--at-once", "1"]
    runs = tmp_path / "store" / "runs"

    def checkpointed() -> set[Path]:
        return {p.parent.parent for p in runs.glob("*/checkpoints/ckpt-*.json")}

    log = tmp_path / "sweep.log"
    proc = subprocess.Popen(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        # the honest signal: the first trial's result is in its folder, the second has a checkpoint in its own
        while not (len(list(runs.glob("*/result.json"))) == 1 and len(checkpointed()) == 2):
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the sweep did not get to its second trial"
            time.sleep(0.2)
        trainers = psutil.Process(proc.pid).children()  # the second trial's process (and multiprocessing's helper)
        proc.send_signal(signal.SIGKILL)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    finished = next(runs.glob("*/result.json"))
    first_result = finished.read_text()
    # the second trial's process saw the sweep die and stopped at a checkpoint, then exited
    killed = time.monotonic()
    gone, alive = psutil.wait_procs(trainers, timeout=120)
    assert not alive, f"a trial's process outlived its sweep: {alive}"
    assert time.monotonic() - killed < 40, time.monotonic() - killed
    # ...like a preempted run: a checkpoint, its MLflow run marked KILLED
    client = MlflowClient(cfg["mlflow"]["tracking_uri"])
    stopped = next(r for r in runs_of(client) if r.data.tags.get("shardline.sweep.trial") == "t2")
    assert stopped.info.status == "KILLED"

    again = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert "steps: ingest cached, encode cached, train 2 ran, 1 cached" in again.stdout
    assert finished.read_text() == first_result  # the finished trial was not trained again
    results = [json.loads(p.read_text()) for p in runs.glob("*/result.json")]
    assert len(results) == 3
    resumed = [r for r in results if r["resumed_from"]]
    assert len(resumed) == 1 and resumed[0]["run_dir"] != str(finished.parent)
    assert "Best t" in again.stdout and "registered as tiny-model version 1" in again.stdout


def trial_processes(pid: int) -> list[psutil.Process]:
    """The trial processes of the sweep `pid`: the children of its fork server."""
    try:
        servers = [p for p in psutil.Process(pid).children() if "forkserver" in " ".join(p.cmdline())]
        return [c for s in servers for c in s.children()]
    except psutil.Error:
        return []


def long_sweep(data, grid: str) -> tuple[subprocess.Popen, Path]:
    """`shardline sweep` of trials that would train for minutes, two at once, in a session of its own (a terminal's
    foreground group), reporting to the session's Prefect API; its output in the returned log."""
    from prefect.settings import PREFECT_API_URL

    tmp_path, cfg = data
    cfg["training"]["epochs"] = 200  # minutes, were it not stopped
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "SHARDLINE_TEST_STEP_DELAY": "0.05"}
    command = [str(BIN), "sweep", str(tmp_path / "c.yaml"), "--grid", grid, "--at-once", "2"]
    log = tmp_path / "sweep.log"
    proc = subprocess.Popen(command, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    return proc, log


def test_ctrl_c_while_trials_start_stops_the_sweep_and_its_trials_in_seconds_without_a_traceback(data, prefect_api):
    """Ctrl-C (the terminal's SIGINT to the sweep's process group) just as the first trial's process has started and
    the second's is starting. Before: the trial processes, in the same group, died of it while they loaded (a
    traceback each), the broken start was retried, and the trials started anew trained to their end before the
    sweep exited. Now the sweep stops starting and retrying trials, passes the SIGINT on to the trials (their
    fork server's own process group), each stops at its first step, and the sweep exits in seconds, saying so."""
    proc, log = long_sweep(data, "model.hidden=8,16,32")
    try:
        deadline = time.monotonic() + 300
        while not trial_processes(proc.pid):  # a trial's process forked from the fork server
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "no trial started"
            time.sleep(0.05)
        started = psutil.Process(proc.pid).children(recursive=True)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C in the terminal does
        interrupted = time.monotonic()
        assert proc.wait(120) == 130, log.read_text()[-3000:]
        took = time.monotonic() - interrupted
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log.read_text()
    assert took < 60, f"the sweep took {took:.0f} s to stop after Ctrl-C:\n{out[-3000:]}"
    assert "interrupted; run the same command again" in out
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    assert "Retry" not in out, out[-3000:]
    gone, alive = psutil.wait_procs(started, timeout=60)
    assert not alive, f"left running after the sweep: {alive}"


def test_a_notice_to_a_sweep_stops_its_trials_at_a_checkpoint_and_exits_as_preempted(data, prefect_api):
    """SIGTERM to the sweep's process group (a spot machine reclaimed) while two trials train. Before: the trials, in
    their fork server's own group, never got it and trained to their end; then the sweep died of the signal (exit
    -15, no word). Now the sweep passes it on, each trial checkpoints and stops, and the sweep exits 75 (preempted:
    the same command again resumes), its parent run KILLED, not FAILED."""
    tmp_path, cfg = data
    proc, log = long_sweep(data, "model.hidden=8,16")
    try:
        deadline = time.monotonic() + 300
        # both trials training: a checkpoint in each one's run folder (counting files, two of the first trial's passed
        # on a slow machine before the second had one, and only one trial was there to stop)
        while len({p.parents[1] for p in (tmp_path / "store").glob("runs/*/checkpoints/ckpt-*.pt")}) < 2:
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the trials did not checkpoint"
            time.sleep(0.2)
        trials = trial_processes(proc.pid)
        os.killpg(proc.pid, signal.SIGTERM)
        noticed = time.monotonic()
        assert proc.wait(120) == 75, log.read_text()[-3000:]
        took = time.monotonic() - noticed
    finally:
        if proc.poll() is None:
            proc.kill()
    out = log.read_text()
    assert took < 60, f"the sweep took {took:.0f} s to stop after the notice:\n{out[-3000:]}"
    assert "stopped by SIGTERM; run the same command again: finished trials are cached" in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    gone, alive = psutil.wait_procs(trials, timeout=60)
    assert not alive, f"left running after the sweep: {alive}"
    from shardline.core.cost.ledger import read_ledger

    ends = [read_ledger(str(f.parent))["attempts"][-1] for f in (tmp_path / "store").glob("runs/*/checkpoints")]
    assert [a["outcome"] for a in ends] == ["preempted", "preempted"], ends  # each trial stopped at a checkpoint
    client = MlflowClient(cfg["mlflow"]["tracking_uri"])
    (parent,) = [r for r in runs_of(client) if "mlflow.parentRunId" not in r.data.tags]
    assert parent.info.status == "KILLED"


def test_bad_sweeps_are_refused_before_any_work(tmp_path):
    make_raw(tmp_path / "raw", n_seq=3, rows=20)
    cfg = tiny_config("raw/*.parquet", "store")
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    (tmp_path / "space.yaml").write_text(yaml.safe_dump({"training.lr": {"low": 1e-4, "high": 1e-2, "log": True}}))

    def refused(*args: str) -> str:
        out = subprocess.run([str(BIN), "sweep", str(tmp_path / "c.yaml"), *args], capture_output=True, text=True)
        assert out.returncode == 2, out.stdout + out.stderr
        return out.stderr

    assert "'model.hiden' is not a config key: model has no 'hiden'; did you mean 'model.hidden'?" in refused(
        "--grid", "model.hiden=8,16"
    )
    assert "--grid training.lr: the grid is empty" in refused("--grid", "training.lr=")
    bad_value = refused("--grid", "model.hidden=16,0")
    assert "trial t2 (model.hidden=0)" in bad_value and "model.hidden: Input should be greater than or equal to 1" in (
        bad_value
    )
    assert "training.lr: a range has no grid; sample it with --random N" in refused(
        "--space", str(tmp_path / "space.yaml")
    )
    assert "--random N draws from a search space: add --space" in refused("--random", "3")
    assert "is the sweep's, not a trial's" in refused("--grid", "storage.root=a,b")
    assert "training.num_workers does not change what is trained" in refused("--grid", "training.num_workers=0,2")
    # precision changes the numbers: not "only where or how fast", but a setting a run resumes across
    precision = refused("--grid", "training.precision=fp32,bf16")
    assert "training.precision is a setting a run resumes across" in precision and "--force train" in precision
    assert "how fast" not in precision
    assert not (tmp_path / "store").exists()  # nothing started


def test_random_trials_are_seeded_and_stay_in_their_ranges():
    space = parse_space(
        {
            "training.lr": {"low": 1e-4, "high": 1e-1, "log": True},
            "training.batch_size": {"low": 16, "high": 256, "int": True, "log": True},
            "model.dropout": {"low": 0.0, "high": 0.5},
            "model.family": ["mlp", "transformer"],
        }
    )
    first = random_trials(space, 20, seed=7)
    assert first == random_trials(space, 20, seed=7) and first != random_trials(space, 20, seed=8)
    for t in first:
        o = t.overrides
        assert 1e-4 <= o["training.lr"] <= 1e-1 and 0.0 <= o["model.dropout"] <= 0.5
        assert isinstance(o["training.batch_size"], int) and 16 <= o["training.batch_size"] <= 256
        assert o["model.family"] in ("mlp", "transformer")
    lrs = sorted(t.overrides["training.lr"] for t in first)
    assert lrs[len(lrs) // 2] < 1e-2  # log-uniform: the median is near the geometric middle (3e-3), not 0.05
    # each trial's config is validated by the config's own rules, naming the trial
    raw = tiny_config("raw/*.parquet", "store", **{"model": {"family": "mlp", "hidden": 30, "layers": 1}})
    with pytest.raises(SweepError, match=r"model.hidden: int: true, and no whole number lies between low=1.5 and high"):
        parse_space({"model.hidden": {"low": 1.5, "high": 1.7, "int": True}})  # it drew 1, outside the range
    divisible = r"(?s)trial t2 \(model.family=transformer\).*must be divisible by model.heads"
    with pytest.raises(SweepError, match=divisible):
        plan_sweep(raw, parse_space({"model.family": ["mlp", "transformer"]}))


def test_a_raised_budget_is_the_same_sweep_and_mistakes_in_a_space_are_said_before_any_work():
    """Raising `training.max_cost` (as the budget's message says) keeps the sweep's id: the same parent run and
    study, its trials resumed. A tpe range the config takes no value of, and two grid values YAML reads as one (1e-2
    is text to YAML), are refused naming the key, before any work."""
    raw = tiny_config("raw/*.parquet", "store")
    grid = parse_space({"model.hidden": [8, 16]})
    first = plan_sweep({**raw, "training": {**raw["training"], "max_cost": 0.01}}, grid).id
    assert plan_sweep({**raw, "training": {**raw["training"], "max_cost": 0.05}}, grid).id == first
    assert plan_sweep({**raw, "training": {**raw["training"], "max_cost": 0.05, "lr": 0.1}}, grid).id != first
    with pytest.raises(SweepError, match=r"model.hidden: the config takes no value of its range \(tried -5, -2, 0\)"):
        plan_sweep(raw, parse_space({"model.hidden": {"low": -5, "high": 0, "int": True}}), 4, 0, "tpe")
    plan_sweep(raw, parse_space({"model.hidden": {"low": -5, "high": 8, "int": True}}), 4, 0, "tpe")  # 2..8 are taken
    # more proposals than the lists hold: Optuna proposed the same two again and again (38 warnings), then ended
    with pytest.raises(SweepError, match=r"--tpe 4: the search space's lists hold 2 trial\(s\) in all; sweep them"):
        plan_sweep(raw, parse_space({"model.hidden": [8, 16]}), 4, 0, "tpe")
    with pytest.raises(SweepError, match=r"t1 and t2 are one trial: training.lr='1e-2' and 0.01 are the same value"):
        plan_sweep(raw, parse_space({"training.lr": ["1e-2", 0.01]}))
    # equal in Python, written otherwise: said naming the key (the list of keys was empty), without the YAML hint
    with pytest.raises(SweepError, match=r"one trial: model.hidden=16 and 16.0 are the same value to the config$"):
        plan_sweep(raw, parse_space({"model.hidden": [16, 16.0]}))
    # a pruner judges a trial at an epoch before its last: with one epoch, --prune did nothing, silently
    from shardline.tasks.sweep import check_pruning

    one = {**raw, "training": {**raw["training"], "epochs": 1}}
    with pytest.raises(SweepError, match=r"--prune median: every trial trains 1 epoch.*training.epochs"):
        check_pruning(plan_sweep(one, grid), "median")
    check_pruning(plan_sweep(one, parse_space({"training.epochs": [1, 3]})), "median")  # some trials train 3


def test_a_sweep_over_the_tokenizer_compared_by_a_score_over_tokens_is_refused_before_any_work(tmp_path):
    """Trials of other tokenizers count other tokens: their perplexities do not compare (the sweep picked the larger
    vocabulary's trial by val_perplexity, and the champion gate then refused to compare the two). Refused, naming
    the key and the score; the model and training settings of a text model are swept as before."""
    raw = {
        "data": {
            "source": str(tmp_path / "raw" / "*.parquet"),
            "features": {"text": ["body"]},
            "tokenizer": {"kind": "bpe", "vocab_size": 300},
            "window": 8,
        },
        "model": {"family": "transformer", "hidden": 16, "layers": 1, "heads": 2},
        "storage": {"root": str(tmp_path / "store")},
    }
    said = r"varies data.tokenizer.vocab_size, and the trials are compared by val_perplexity, a score over tokens"
    with pytest.raises(SweepError, match=said):
        plan_sweep(raw, parse_space({"data.tokenizer.vocab_size": [300, 350], "data.window": [8, 16]}))
    with pytest.raises(SweepError, match=r"varies data.tokenizer, and the trials are compared by val_loss"):
        by_loss = {**raw, "training": {"select_by": "val_loss"}}
        vocabularies = [{"kind": "bpe", "vocab_size": v} for v in (300, 400)]
        plan_sweep(by_loss, parse_space({"data.tokenizer": vocabularies}), 2, 0, "tpe")
    assert len(plan_sweep(raw, parse_space({"data.window": [8, 16], "training.lr": [0.01, 0.001]})).trials) == 4
    # a value another setting overrides (gpt's params.d_model wins over model.hidden), or the columns the predictions
    # carry: both trials trained one model (the same score), and one of them was called the best
    gpt = {**raw, "model": {"family": "gpt", "hidden": 16, "layers": 1, "heads": 2, "params": {"d_model": 32}}}
    with pytest.raises(SweepError, match=r"model.hidden does not change what is trained .*params.d_model wins"):
        plan_sweep(gpt, parse_space({"model.hidden": [16, 64]}))
    with pytest.raises(SweepError, match=r"data.id_columns does not change what is trained"):
        plan_sweep(raw, parse_space({"data.id_columns": [[], ["doc_id"]]}))
    assert len(plan_sweep(gpt, parse_space({"model.params.d_model": [32, 64]})).trials) == 2


def test_a_sweep_over_the_split_source_or_target_is_refused_before_any_work(tmp_path):
    """Trials of other split seeds were each validated on other rows: 0.39 against 0.67 for the same model and
    settings, and the sweep registered the luckier split's as the best. Refused, naming the keys; the window and
    the model's settings are swept as before."""
    from tests.conftest import tiny_config

    raw = tiny_config(str(tmp_path / "raw" / "*.parquet"), str(tmp_path / "store"))
    for space in (
        {"data.split.seed": [1, 2]},
        {"data.split.fractions": [{"train": 0.6, "validation": 0.2, "test": 0.2}, {"train": 0.8, "validation": 0.1,
                                                                                  "test": 0.1}]},
        {"data.source": [str(tmp_path / "a" / "*.parquet"), str(tmp_path / "b" / "*.parquet")]},
        {"data.target": [{"column": "label", "task": "classification"}, {"column": "kind", "task": "classification"}]},
    ):  # fmt: skip
        key = next(iter(space))
        with pytest.raises(SweepError, match=rf"varies {key}: each trial would be validated on other rows"):
            plan_sweep(raw, parse_space({**space, "training.lr": [0.01, 0.001]}))
    assert len(plan_sweep(raw, parse_space({"data.window": [2, 3], "training.lr": [0.01, 0.001]})).trials) == 4


def test_a_trial_from_the_cache_gives_the_study_its_epochs_so_the_pruner_sees_the_whole_history(tmp_path):
    """A trial whose training came from the cache (a smaller --tpe's, another sweep's) reported no epoch to this
    study: told, it brings its epochs' values from its result first, so that the median pruner judges a new trial
    against every earlier one (before: only against those trained under this study). One that reported its own
    epochs keeps them."""
    from types import SimpleNamespace

    from optuna.trial import TrialState

    from shardline.core.sweep import Trial
    from shardline.tasks.sweep import SweepStudy

    raw = tiny_config("raw/*.parquet", str(tmp_path / "store"))
    plan = plan_sweep(raw, parse_space({"training.lr": {"low": 1e-3, "high": 1e-1, "log": True}}), 4, 0, "tpe")
    study = SweepStudy(plan, str(tmp_path / "sweep"), "median", raw)
    cached, ran = Trial("t1", {"training.lr": 0.01}), Trial("t2", {"training.lr": 0.02})
    history = [{"epoch": 1, "val_loss": 0.9}, {"epoch": 2, "val_loss": 0.7}, {"epoch": 3, "val_loss": float("nan")}]
    result = SimpleNamespace(history=history, select_by="val_loss")
    study.pruning(cached)
    study.tell(cached, {"state": "cached", "score": 0.7}, result)
    ran_number = study.pruning(ran).trial
    import optuna

    # the trial that ran reported its own first epoch, as its training does
    optuna.trial.Trial(study.study, study.study.get_trials()[ran_number]._trial_id).report(0.5, 1)
    study.tell(ran, {"state": "ran", "score": 0.5}, result)
    by_number = {t.number: t for t in study.study.get_trials()}
    assert by_number[study.numbers["t1"]].intermediate_values == {1: 0.9, 2: 0.7}
    assert by_number[ran_number].intermediate_values == {1: 0.5}
    assert [t.state for t in by_number.values()] == [TrialState.COMPLETE, TrialState.COMPLETE]


def test_grid_and_random_trials_hold_their_values_in_the_study_as_optuna_reads_them(tmp_path):
    """Optuna's own views of a sweep's study (`trials_dataframe`, the parameter importances) read each trial's
    params: a grid's and a random sweep's trials held none (params {}), so the study said nothing of what they
    tried. Each now holds the values it trains. A waiting trial that a sweep killed mid-ask left with other
    values is told failed, not taken for the next trial."""
    from optuna.trial import TrialState

    from shardline.tasks.sweep import SweepStudy

    raw = tiny_config("raw/*.parquet", str(tmp_path / "store"))
    grid = plan_sweep(raw, parse_space({"model.hidden": [8, 16], "model.params": [{}, {"dropout": 0.5}]}))
    space = {
        "training.lr": {"low": 1e-4, "high": 1e-1, "log": True},
        "training.batch_size": {"low": 8, "high": 64, "int": True},
    }
    drawn = plan_sweep(raw, parse_space(space), 3, 7)
    for name, plan in (("grid", grid), ("random", drawn)):
        study = SweepStudy(plan, str(tmp_path / name), None, raw)
        if name == "random":
            study.study.enqueue_trial({"training.lr": 0.05, "training.batch_size": 9})  # a killed sweep's
        for trial in plan.trials:
            study.pruning(trial)
        frame = study.study.trials_dataframe()
        live = frame[frame.state != "FAIL"]
        assert len(live) == len(plan.trials) and (frame.state == "FAIL").sum() == (name == "random")
        for trial, number in ((t, study.numbers[t.id]) for t in plan.trials):
            held = study.study.trials[number].params
            expected = {k: (v if not isinstance(v, dict) else json.dumps(v)) for k, v in trial.overrides.items()}
            assert held == expected, (name, trial.id, held, expected)
        assert study.study.trials[study.numbers[plan.trials[0].id]].state == TrialState.RUNNING


def test_tpe_proposes_new_trials_after_an_interrupted_sweep_and_never_one_the_config_refuses_or_has(
    tmp_path, prefect_api
):
    """`--tpe`: a sweep interrupted after two proposals, run again, resumes those two and asks Optuna for two new
    ones (a sampler seeded as the first run's drew the same two again: four trials paid for, two models). A
    proposal the config refuses, or one that trains an earlier trial's model, is told to Optuna as failed and
    another asked; when the space has nothing new, the sweep ends with the trials it has."""
    import itertools

    import optuna
    from prefect import flow

    from shardline.tasks.sweep import SweepStudy

    raw = tiny_config("raw/*.parquet", str(tmp_path / "store"))
    space = {"training.lr": {"low": 1e-4, "high": 1e-1, "log": True}, "model.hidden": [8, 16]}

    def proposals(folder: str, space: dict, size: int, take: int) -> tuple[list, object]:
        study = SweepStudy(plan_sweep(raw, parse_space(space), size, 0, "tpe"), folder, None, raw)
        taken = flow(lambda: [t for t, _ in itertools.islice(study.proposed(), take)], name="proposals")()
        return taken, study.study

    before, _ = proposals(str(tmp_path / "a"), space, 4, 2)  # interrupted: two trials asked, none told
    after, _ = proposals(str(tmp_path / "a"), space, 4, 4)
    assert [t.id for t in after] == ["t1", "t2", "t3", "t4"] and after[:2] == before
    labels = [t.label for t in after]
    assert len(set(labels)) == 4, labels
    assert all((lr := t.overrides["training.lr"]) == float(f"{lr:.6g}") for t in after)  # as a random sweep's

    # hidden 0 is refused by the config; 16, 16.0 and "16" train one model: one trial, not three
    one, study = proposals(str(tmp_path / "b"), {"model.hidden": [0, 16, 16.0, "16"]}, 3, 3)
    assert [t.id for t in one] == ["t1"] and one[0].overrides["model.hidden"] in (16, "16")
    states = [t.state for t in study.get_trials(deepcopy=False)]
    assert len(states) == 30 and states.count(optuna.trial.TrialState.FAIL) == 29


def test_trials_of_a_models_own_metric_are_compared_the_way_its_config_says(tmp_path, prefect_api):
    """A model's own validation metric (`val_<name>` of its metrics()) has a direction only its config gives
    (training.select_direction); the sweep compares its trials that way (it took the lower of a metric whose name
    it did not know, and registered the worst trial)."""
    from prefect import flow, task

    from shardline.core.config import validate_config
    from shardline.core.sweep import Trial, best_of
    from shardline.runs.result import TrainResult
    from shardline.tasks.sweep import trial_outcome

    config = validate_config(tiny_config("raw/*.parquet", str(tmp_path / "store")))
    own = {"select_by": "val_hits", "select_direction": "maximize"}
    config = config.model_copy(update={"training": config.training.model_copy(update=own)})

    @task
    def trained(score: float) -> TrainResult:
        fields = dict(select_by="val_hits", best_score=score, best_epoch=1, pruned_epoch=None, cost=None)
        return TrainResult.model_construct(**fields, mlflow_run_id=None, run_dir=f"runs/{score}")

    @flow
    def two_trials() -> list[dict]:
        trials = [Trial("t1", {"model.hidden": 8}), Trial("t2", {"model.hidden": 32})]
        futures = [trained.submit(0.9), trained.submit(0.2)]
        return [trial_outcome(t, config, f)[0] for t, f in zip(trials, futures, strict=True)]

    rows = two_trials()
    assert [(r["metric"], r["score"], r["direction"]) for r in rows] == [
        ("val_hits", 0.9, "maximize"),
        ("val_hits", 0.2, "maximize"),
    ]
    assert best_of(rows)["trial"] == "t1"
