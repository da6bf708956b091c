"""What training costs, end to end: a real run killed (SIGKILL) mid-way, resumed into a budget that stops it,
resumed again with a higher one, preempted (SIGTERM), resumed to a registered model; the ledger, the MLflow run
and the model version say what it cost, how much was wasted and what each preemption redid; `shardline cost`
estimates a config before it runs.

The price is made known and big: the machine declares an H100 (SHARDLINE_GPU_TYPE, as a pool's job variables
do) and a prices file (SHARDLINE_PRICES) puts it at 1,800 USD an hour at `testcloud` (half a dollar a second),
so a few seconds of tiny training reach a budget of a few dollars.
"""

from __future__ import annotations

import copy
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient
from typer.testing import CliRunner

from shardline.core.config import validate_config
from shardline.core.cost import ledger as cost_ledger
from shardline.core.failures import BudgetExceeded
from shardline.core.metrics.report import format_number
from shardline.trainer.checkpoint import checkpoint_step
from shardline.trainer.stops import BUDGET_EXIT_CODE
from tests.conftest import make_raw, tiny_config

pytestmark = pytest.mark.e2e

PRICES = (
    "as_of: '2026-11 test contract'\nprices:\n  - {gpu: H100, provider: testcloud, on_demand: 1800.0, spot: 600.0}\n"
)
USD_PER_SECOND = 0.5
STEPS = 58  # 2 epochs x 29 steps (456 training windows, batches of 16)
BUDGET_STEP_DELAY = 0.5  # seconds a step while the budget attempt trains: 48 steps left, 24 s and more


def ledger_of(root: Path) -> tuple[Path, dict]:
    (found,) = root.glob("runs/*/cost.json")
    return found.parent, json.loads(found.read_text())


def stop_run(cfg_path: Path, root: Path, sig: int, ready, again: float | None = None) -> int:
    """`shardline run` in a process of its own (on the tests' Prefect API), sent `sig` (SIGKILL: the machine is
    gone; SIGTERM: a spot notice) once its attempt's entry in the run's ledger satisfies `ready` (and once more
    `again` seconds later: a second Ctrl-C); its exit status."""
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    before = len(ledger_of(root)[1]["attempts"]) if list(root.glob("runs/*/cost.json")) else 0
    output = cfg_path.with_suffix(".log")
    with open(output, "w") as sink:
        proc = subprocess.Popen(
            [sys.executable, "-m", "shardline", "run", str(cfg_path)],
            stdout=sink,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    deadline = time.monotonic() + 240
    try:
        while True:
            assert proc.poll() is None, f"the run ended before it could be stopped:\n{output.read_text()[-3000:]}"
            assert time.monotonic() < deadline, "the run never reached the point to stop it at"
            found = list(root.glob("runs/*/cost.json"))
            if found:
                attempts = json.loads(found[0].read_text())["attempts"]
                if len(attempts) > before and ready(attempts[-1]):
                    break
            time.sleep(0.02)
        os.killpg(proc.pid, sig)
        if again is not None:
            time.sleep(again)
            os.killpg(proc.pid, sig)
        return proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def past_a_checkpoint(entry: dict) -> bool:
    """A few steps after the attempt's first checkpoint, once its ledger has recorded them."""
    return len(entry["marks"]) > 1 and entry["last_step"] >= entry["marks"][-1][0] + 3


@pytest.fixture(scope="module")
def story(tmp_path_factory, prefect_api):
    """The four attempts of one run: killed, stopped at its budget, preempted (SIGTERM), finished; what each left."""
    from shardline.flows.pipeline import pipeline

    tmp = tmp_path_factory.mktemp("cost")
    make_raw(tmp / "raw")
    (tmp / "prices.yaml").write_text(PRICES)
    root = tmp / "store"
    cfg = tiny_config(
        str(tmp / "raw" / "*.parquet"),
        str(root),
        **{"training.batch_size": 16, "training.checkpoint_every_steps": 10},
    )
    cfg["compute"] = {"provider": "testcloud"}
    (tmp / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    out: dict = {"tmp": tmp, "root": root, "cfg": cfg}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("SHARDLINE_GPU_TYPE", "H100")
        env.setenv("SHARDLINE_PRICES", str(tmp / "prices.yaml"))
        env.setenv("SHARDLINE_TEST_STEP_DELAY", "0.2")  # about 12 s of training in all
        env.setenv("SHARDLINE_PROGRESS_SECONDS", "0")  # progress at every step...
        env.setenv(cost_ledger.LEDGER_ENV, "0")  # ...and the ledger written with it: the time after a checkpoint

        assert stop_run(tmp / "cfg.yaml", root, signal.SIGKILL, past_a_checkpoint) == -signal.SIGKILL
        # the killed process's lease is taken at once (it ran on this machine), not waited out for 90 s
        run, out["after_kill"] = ledger_of(root)

        # the budget: what the killed attempt spent, its setup (from its start to its first step) and 6 steps of
        # 0.5 s more. The next attempt, resumed in this process (its modules imported, its MLflow store made),
        # sets up faster than the killed one, by 3 s here and 9 s on a slow CI machine: its slower steps leave
        # it 20 s of leeway before it would finish, whatever this machine's speed (a fixed 6 s more stopped it
        # before a step on a slow machine; the killed attempt's time to its checkpoint let it finish)
        killed = out["after_kill"]["attempts"][-1]
        spent = cost_ledger.summarize([killed])["usd"]
        at_checkpoint = dict(map(tuple, killed["marks"]))[10]
        step_s = (killed["seconds"] - at_checkpoint) / (killed["last_step"] - 10)
        setup = at_checkpoint - 10 * step_s
        limited = copy.deepcopy(cfg)
        limited["training"]["max_cost"] = spent + (setup + 6 * BUDGET_STEP_DELAY) * USD_PER_SECOND
        env.setenv("SHARDLINE_TEST_STEP_DELAY", str(BUDGET_STEP_DELAY))
        with pytest.raises(BudgetExceeded) as stopped:
            pipeline(validate_config(limited))
        env.setenv("SHARDLINE_TEST_STEP_DELAY", "0.2")
        out["stopped"] = stopped.value
        out["checkpoint_there"] = Path(stopped.value.checkpoint).is_file()  # the finished run prunes it later
        out["after_budget"] = ledger_of(root)[1]

        raised = copy.deepcopy(limited)
        raised["training"]["max_cost"] = 1000.0
        # a spot notice (SIGTERM) a few steps into the next attempt: it checkpoints where it is and exits 75
        (tmp / "raised.yaml").write_text(yaml.safe_dump(raised))
        out["sigterm_status"] = stop_run(
            tmp / "raised.yaml", root, signal.SIGTERM, lambda a: a["last_step"] >= a["first_step"] + 3
        )
        out["after_sigterm"] = ledger_of(root)[1]
        out["result"] = pipeline(validate_config(raised))
        out["run"], out["ledger"] = ledger_of(root)
    return out


def test_a_budget_stop_says_which_limit_the_spend_and_the_checkpoint_then_a_higher_one_resumes_from_it(story):
    stopped = story["stopped"]
    message = str(stopped)
    assert "training stopped at its budget: training.max_cost=" in message and " USD reached: " in message
    assert "(an estimate, prices as of 2026-11 test contract (prices.yaml); others 2025-07" in message
    assert f"checkpoint saved at {stopped.checkpoint}" in message
    assert message.endswith("raise training.max_cost and run again to resume")
    assert story["checkpoint_there"]
    killed, budget = story["after_budget"]["attempts"]
    at = checkpoint_step(stopped.checkpoint)
    assert killed["first_step"] == 0 and budget["first_step"] == killed["marks"][-1][0]  # resumed from the kill's
    # stopped mid-way, at its checkpoint (the two attempts' ledger entries said when it did not)
    assert budget["first_step"] < at < STEPS and budget["last_step"] == at, (killed, budget)
    assert (killed["outcome"], budget["outcome"]) == ("killed", "budget")
    said = float(re.search(r"GPU-hours on H100 x1 at testcloud, ([0-9.e+-]+) USD", message).group(1))
    assert said == pytest.approx(cost_ledger.summarize([killed, budget])["usd"], rel=0.05)  # said as it stopped
    # the same config with a higher max_cost: the same run folder, resumed from that checkpoint, not from scratch
    # (then preempted, and resumed from the checkpoint its SIGTERM saved)
    preempted = story["after_sigterm"]["attempts"][-1]
    assert preempted["first_step"] == at and preempted["outcome"] == "preempted"
    train = story["result"]["train"]
    assert checkpoint_step(train["resumed_from"]) == preempted["last_step"] and train["steps"] == STEPS
    assert str(story["run"]) == train["run_dir"]
    assert story["result"]["registered"]["version"] == 1


def test_the_ledger_counts_the_time_a_kill_made_redo_as_wasted(story):
    attempts = story["ledger"]["attempts"]
    assert [a["outcome"] for a in attempts] == ["killed", "budget", "preempted", "finished"]
    assert all(
        (a["gpu"], a["gpus"], a["provider"], a["usd_per_gpu_hour"]) == ("H100", 1, "testcloud", 1800.0)
        for a in attempts
    )
    killed = attempts[0]
    resumed = attempts[1]["first_step"]
    assert killed["last_step"] > resumed  # the kill came after steps its checkpoint does not hold
    useful = cost_ledger.useful_seconds(attempts)
    wasted = killed["seconds"] - useful[0]
    assert useful[0] == dict(map(tuple, killed["marks"]))[resumed] and wasted > 0
    assert useful[1:] == [a["seconds"] for a in attempts[1:]]  # each stopped where the next one started
    s = cost_ledger.summarize(attempts)
    assert s["gpu_hours_wasted"] == pytest.approx(wasted / 3600)
    assert s["gpu_hours_useful"] + s["gpu_hours_wasted"] == pytest.approx(s["gpu_hours"])
    assert s["usd_useful"] + s["usd_wasted"] == pytest.approx(s["usd"])
    assert s["usd"] == pytest.approx(sum(a["seconds"] for a in attempts) * USD_PER_SECOND)


def test_the_cost_is_in_the_result_on_the_mlflow_run_and_on_the_model_version(story):
    result = story["result"]
    summary = cost_ledger.summarize(story["ledger"]["attempts"])
    cost = result["train"]["cost"]
    assert cost == {**summary, "seconds": pytest.approx(summary["seconds"])}
    assert cost["usd"] > cost["usd_wasted"] > 0 and cost["gpu"] == "H100" and cost["provider"] == "testcloud"
    assert "2026-11 test contract" in cost["prices_as_of"] and "estimate" in cost["estimate"]

    reg = result["registered"]
    client = MlflowClient(story["cfg"]["mlflow"]["tracking_uri"])
    run = client.get_run(reg["run_id"])
    assert run.info.status == "FINISHED"
    m = run.data.metrics
    assert m["cost/gpu_hours"] == pytest.approx(cost["gpu_hours"])
    assert m["cost/gpu_hours_wasted"] == pytest.approx(cost["gpu_hours_wasted"])
    assert m["cost/usd"] == pytest.approx(cost["usd"]) and m["cost/usd_wasted"] == pytest.approx(cost["usd_wasted"])
    # every attempt said what the run had cost so far, the killed one through the next
    assert len(client.get_metric_history(reg["run_id"], "cost/usd")) == 3
    tags = run.data.tags
    assert tags["shardline.cost.gpu"] == "H100 x1" and tags["shardline.cost.provider"] == "testcloud (on-demand)"
    assert "2026-11 test contract" in tags["shardline.cost.prices_as_of"]
    assert "an estimate" in tags["shardline.cost.estimate"] and "not a bill" in tags["shardline.cost.estimate"]
    assert tags["shardline.stopped_by"] == "budget, then resumed to the end"

    version = client.get_model_version("tiny-model", str(reg["version"]))
    assert version.tags["shardline.cost.gpu_hours"] == format_number(cost["gpu_hours"])
    assert version.tags["shardline.cost.usd"] == format_number(cost["usd"])
    assert version.tags["shardline.cost.gpu"] == "H100"


def test_each_preemption_says_the_steps_and_gpu_seconds_it_redid_and_the_time_to_the_first_new_step(story):
    """Issue #47: the kill redid the steps past its checkpoint; the SIGTERM, which checkpoints where it stops, at
    most one. Each is recorded by the attempt that resumed (at its first step) in the ledger, on the MLflow run,
    and summed on the model version; the budget stop is no preemption."""
    assert story["sigterm_status"] == 75  # PREEMPTED_EXIT_CODE
    killed, budget, preempted, finished = story["ledger"]["attempts"]
    # recorded by the attempt that resumed from each and trained a step (the budget's, unless it stopped before one)
    kill_by, notice_by = [a for a in story["ledger"]["attempts"] if "interruption" in a]
    assert kill_by is (budget if budget["last_step"] > budget["first_step"] else preempted) and notice_by is finished
    kill, notice = kill_by["interruption"], notice_by["interruption"]
    assert kill["after"] == "killed" and kill["steps_redone"] == killed["last_step"] - kill_by["first_step"] >= 3
    redone_s = killed["seconds"] - dict(map(tuple, killed["marks"]))[kill_by["first_step"]]
    assert kill["gpu_seconds_redone"] == pytest.approx(redone_s * 1) and redone_s >= 3 * 0.2  # 1 GPU, 0.2 s a step
    assert notice["after"] == "preempted" and notice["steps_redone"] <= 1
    assert notice["steps_redone"] == preempted["last_step"] - finished["first_step"]
    assert notice["gpu_seconds_redone"] <= 0.2 + 0.5  # one step and a checkpoint, at most
    assert all(0 < c["recovery_seconds"] < 120 for c in (kill, notice))

    cost = story["result"]["train"]["cost"]
    assert cost["preemptions"] == 2
    for k in ("steps_redone", "gpu_seconds_redone", "recovery_seconds"):
        assert cost[k] == pytest.approx(kill[k] + notice[k])
    client = MlflowClient(story["cfg"]["mlflow"]["tracking_uri"])
    reg = story["result"]["registered"]
    metrics = client.get_run(reg["run_id"]).data.metrics
    for k in ("steps_redone", "gpu_seconds_redone", "recovery_seconds"):
        # one point per preemption, at the step resumed from; the sum among the run's cost/*
        history = sorted((m.step, m.value) for m in client.get_metric_history(reg["run_id"], f"preemption/{k}"))
        assert history == [
            (kill_by["first_step"], pytest.approx(kill[k])),
            (finished["first_step"], pytest.approx(notice[k])),
        ]
        assert metrics[f"cost/{k}"] == pytest.approx(cost[k])
    assert metrics["cost/preemptions"] == 2
    tags = client.get_model_version("tiny-model", str(reg["version"])).tags
    assert tags["shardline.cost.preemptions"] == "2"
    assert tags["shardline.cost.steps_redone"] == str(kill["steps_redone"] + notice["steps_redone"])
    for k in ("gpu_seconds_redone", "recovery_seconds"):
        assert tags[f"shardline.cost.{k}"] == format_number(cost[k])


def cost_cli(story, *args: str):
    from shardline.app.cli import app

    return CliRunner().invoke(app, ["cost", str(story["tmp"] / "cfg.yaml"), *args])


def test_shardline_cost_prices_a_config_on_a_gpu_only_with_a_rate_measured_on_it(story, monkeypatch):
    monkeypatch.delenv("SHARDLINE_GPU_TYPE", raising=False)  # this machine as it is: a CPU
    prices = str(story["tmp"] / "prices.yaml")
    # the run of this config trained on an H100 (declared): its measured rate stands for an H100
    done = cost_cli(story, "--gpu", "H100", "--prices", prices)
    assert done.exit_code == 0, done.output
    out = done.output
    assert "2 epoch(s) x 29 optimizer steps = 58 steps" in out
    assert f"measured by this config's run on H100 (epoch(s) 2 of its 4 attempt(s), {story['run']})" in out
    assert "an ESTIMATE from list prices, not a quote; as of " in out and "2026-11 test contract" in out
    assert "spent   so far by this config's run (its cost.json): " in out and "in 4 attempt(s)" in out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("  ") and "USD/GPU-hour" not in line}
    assert "<- compute.provider" in rows["testcloud"] and "1800" in rows["testcloud"]
    assert {"aws", "gcp", "lambda", "runpod"} <= set(rows)  # the shipped providers of an H100 beside it

    # the same config with another learning rate has not trained anywhere: this CPU's speed says nothing
    # about an H100's, so it says how to measure one instead of guessing
    other = cost_cli(story, "--gpu", "H100", "--set", "training.lr=0.02", "--prices", prices)
    assert other.exit_code == 1, other.output
    assert "no rate measured on H100: this config has not trained yet" in other.output
    assert "this machine is a CPU, whose speed says nothing about a H100's" in other.output

    # for this machine: a probe of the real training step, priced as a CPU machine
    here = cost_cli(story, "--set", "training.lr=0.02")
    assert here.exit_code == 0, here.output
    assert "training on one CPU" in here.output and "a probe of the training step on this machine" in here.output
    assert " 2 x (" in here.output and "s validation) = " in here.output
    assert "  aws " in here.output and "  gcp " in here.output
    assert "(compute.provider testcloud lists no CPU price: a run on one is timed, not priced)" in here.output

    # a config of 2 processes: the probe's one process is scaled (said, and priced for both)
    two = cost_cli(story, "--set", "training.lr=0.02", "--set", "compute.processes_per_node=2")
    assert two.exit_code == 0, two.output
    assert "training on 2 x CPU" in two.output and "this config trains in 2 (compute.nodes x" in two.output

    # priced for both processes: the GPU-hours are the time's hours twice over
    hours = float(re.search(r"\(([0-9.e+-]+) hours\)", two.output).group(1))
    aws = next(line for line in two.output.splitlines() if line.startswith("  aws "))
    assert float(aws.split()[2]) == pytest.approx(2 * hours, rel=2e-3), two.output

    bad = cost_cli(story, "--gpu", "B200")
    assert bad.exit_code == 2
    assert "GPU type 'B200' is not in the price table" in bad.output and "known types: A10, " in bad.output


def test_a_budget_stop_has_its_own_exit_status(story, monkeypatch):
    """`shardline run` on a run already past a tiny budget: stopped before a step, said, exit 76."""
    from shardline.app.cli import app

    monkeypatch.setenv("SHARDLINE_GPU_TYPE", "H100")
    monkeypatch.setenv("SHARDLINE_PRICES", str(story["tmp"] / "prices.yaml"))
    done = CliRunner().invoke(
        app, ["run", str(story["tmp"] / "cfg.yaml"), "--set", "training.max_cost=0.01", "--force", "train"]
    )
    assert done.exit_code == BUDGET_EXIT_CODE == 76, done.output
    assert "stopped: training stopped at its budget: training.max_cost=0.01 USD reached" in done.output
    assert "raise training.max_cost and run again to resume" in done.output


def test_max_hours_stops_a_run_with_status_76_and_a_higher_limit_resumes_it_to_the_uninterrupted_weights(
    story, monkeypatch
):
    """`shardline run` with a few seconds of `training.max_hours`: a checkpoint, the budget's message and status;
    the same command with a higher limit resumes that run folder, into the same MLflow run, and ends with the
    weights of a run never stopped (trained here with `--force train`, in a folder of its own)."""
    import torch

    from shardline.app.cli import app
    from shardline.flows.pipeline import pipeline
    from shardline.trainer.checkpoint import latest_checkpoint, load_checkpoint

    cfg_path = str(story["tmp"] / "cfg.yaml")
    this = ["--set", "training.lr=0.003"]  # a run of its own (the others' learning rate is the story's)
    monkeypatch.setenv("SHARDLINE_TEST_STEP_DELAY", "0.2")  # 58 steps: about 12 s against a limit of 5.4 s
    stopped = CliRunner().invoke(app, ["run", cfg_path, *this, "--set", "training.max_hours=0.0015"])
    assert stopped.exit_code == BUDGET_EXIT_CODE == 76, stopped.output
    said = re.search(
        r"stopped: (training stopped at its budget: .*run again to resume)", " ".join(stopped.output.split())
    )
    assert said and "training.max_hours=0.0015 reached: " in said.group(1), stopped.output
    assert said.group(1).endswith("raise training.max_hours and run again to resume")
    checkpoint = re.search(r"checkpoint saved at (\S+\.pt)", said.group(1)).group(1)
    assert Path(checkpoint).is_file() and 0 < checkpoint_step(checkpoint) < STEPS
    run = Path(checkpoint).parents[1]

    monkeypatch.delenv("SHARDLINE_TEST_STEP_DELAY")
    resumed = CliRunner().invoke(app, ["run", cfg_path, *this, "--set", "training.max_hours=1"])
    assert resumed.exit_code == 0, resumed.output
    ledger = json.loads((run / "cost.json").read_text())  # the same run folder, its two attempts
    assert [a["outcome"] for a in ledger["attempts"]] == ["budget", "finished"], (
        resumed.output[-3000:],
        sorted(p.name for p in run.parent.iterdir()),
    )
    assert ledger["attempts"][1]["first_step"] == checkpoint_step(checkpoint)
    client = MlflowClient(story["cfg"]["mlflow"]["tracking_uri"])
    (mlflow_run,) = [
        r
        for r in client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
        if r.data.params.get("training.lr") == "0.003"
    ]
    assert mlflow_run.info.status == "FINISHED"
    assert mlflow_run.data.tags["shardline.stopped_by"] == "budget, then resumed to the end"

    config = copy.deepcopy(story["cfg"])
    config["training"]["lr"] = 0.003
    never_stopped = pipeline(validate_config(config), force="train")["train"]
    assert never_stopped["run_dir"] != str(run)
    for folder in (str(run), never_stopped["run_dir"]):
        assert latest_checkpoint(f"{folder}/checkpoints")[1]["step"] == STEPS
    final = [
        load_checkpoint(latest_checkpoint(f"{f}/checkpoints")[0])["model"] for f in (run, never_stopped["run_dir"])
    ]
    assert final[0].keys() == final[1].keys()
    assert all(torch.equal(final[0][k], final[1][k]) for k in final[1])


def test_a_second_ctrl_c_is_an_interruption_its_resume_counts_and_the_run_is_killed_not_running(
    tmp_path, prefect_api, monkeypatch
):
    """Ctrl-C twice, a moment apart: the second stops the training at once, past its checkpoint. It was recorded as
    a failure (no interruption counted on the resume, its redone steps unbilled), and a Ctrl-C while the run was
    being closed left the MLflow run RUNNING. It is a kill: the attempt `killed`, its MLflow run KILLED, and the
    resume counts the steps it redid."""
    from shardline.core.tracking.tracker import read_run_file
    from shardline.flows.pipeline import pipeline

    make_raw(tmp_path / "raw")
    root = tmp_path / "store"
    cfg = tiny_config(
        str(tmp_path / "raw" / "*.parquet"),
        str(root),
        **{"training.batch_size": 16, "training.checkpoint_every_steps": 10},
    )
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    monkeypatch.setenv("SHARDLINE_TEST_STEP_DELAY", "0.2")
    monkeypatch.setenv("SHARDLINE_PROGRESS_SECONDS", "0")
    monkeypatch.setenv(cost_ledger.LEDGER_ENV, "0")
    assert stop_run(tmp_path / "cfg.yaml", root, signal.SIGINT, past_a_checkpoint, again=0.01) == 130
    folder, ledger = ledger_of(root)
    stopped = ledger["attempts"][-1]
    # never "failed": a kill, or (on a loaded machine the first Ctrl-C's stop is done, its checkpoint saved and its
    # end written, before the second lands, during the close) a preemption
    assert stopped["outcome"] in ("killed", "preempted"), stopped
    client = MlflowClient(cfg["mlflow"]["tracking_uri"])
    assert client.get_run(read_run_file(str(folder))["run_id"]).info.status == "KILLED"
    monkeypatch.setenv("SHARDLINE_TEST_STEP_DELAY", "0")
    pipeline(validate_config(cfg))
    resumed = ledger_of(root)[1]["attempts"][-1]
    # (the first Ctrl-C's checkpoint may be saved before the second lands: then nothing is redone)
    assert resumed["interruption"]["after"] == stopped["outcome"]
    assert resumed["interruption"]["steps_redone"] == stopped["last_step"] - resumed["first_step"] >= 0
