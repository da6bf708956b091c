"""The price table and the arithmetic of what training costs: the ledger of a run's attempts, useful and wasted
time, the budget's deadline, and the training loop stopping at it."""

import time

import pytest

from shardline.core.cost import ledger as cost_ledger
from shardline.core.cost import prices as cost
from shardline.trainer import loop
from shardline.trainer.checkpoint import latest_checkpoint
from shardline.trainer.inference import load_model
from shardline.trainer.loop import Callbacks, FitOptions, fit
from tests.conftest import list_checkpoints
from tests.test_trainer import assert_same_weights, data, no_timing, quiet, spec_for, train_cfg  # noqa: F401


def test_device_names_map_to_the_tables_types():
    assert cost.gpu_type("NVIDIA H100 80GB HBM3") == "H100"
    assert cost.gpu_type("NVIDIA H200") == "H200"
    assert cost.gpu_type("NVIDIA A100-SXM4-80GB") == "A100-80GB"
    assert cost.gpu_type("NVIDIA A100-SXM4-40GB") == "A100-40GB"
    assert cost.gpu_type("NVIDIA A10G") == "A10G"
    assert cost.gpu_type("NVIDIA A10") == "A10"
    assert cost.gpu_type("NVIDIA L4") == "L4" and cost.gpu_type("NVIDIA L40S") == "L40S"
    assert cost.gpu_type("Tesla T4") == "T4" and cost.gpu_type("NVIDIA GeForce RTX 4090") == "RTX4090"
    assert cost.gpu_type("cpu") == "CPU"
    assert cost.gpu_type("Radeon Pro W7900") == "RADEON PRO W7900"  # unknown: kept, for the user's own table


def test_the_shipped_table_is_an_estimate_with_its_date_and_every_type_has_a_price():
    table = cost.load_prices()
    # its date and how it was made; every place that shows it says "an estimate" itself (the log's cost line, the
    # ledger's summary, `shardline cost`'s "shipped estimate", the run's `shardline.cost.estimate` tag): said once
    assert "2025" in table.as_of and "list prices" in table.as_of and "estimate" not in table.as_of
    assert table.sources == [f"shipped estimate, {table.as_of}"]
    assert {"H100", "A100-80GB", "L4", "T4", "CPU"} <= set(table.gpus)
    for gpu in table.gpus:
        assert all(p.on_demand > 0 and (p.spot is None or p.spot < p.on_demand) for p in table.of(gpu)), gpu


def test_an_estimate_is_hours_times_the_rate_per_provider(tmp_path, monkeypatch):
    own = tmp_path / "prices.yaml"
    own.write_text(
        "as_of: '2026-11 our contract'\nprices:\n"
        "  - {gpu: H100, provider: aws, on_demand: 4.00, spot: 1.50}\n"
        "  - {gpu: MI300X, provider: neo, on_demand: 3.00, spot: null}\n"
    )
    monkeypatch.setenv(cost.PRICES_ENV, str(own))
    table = cost.load_prices()
    assert "our contract" in table.as_of and str(own) in table.sources[0]
    aws = [p for p in table.of("H100") if p.provider == "aws"]
    assert len(aws) == 1 and aws[0].on_demand == 4.0  # replaced, not added twice
    assert any(p.provider == "lambda" for p in table.of("H100"))  # the shipped rest stays
    rows = {r["provider"]: r for r in cost.estimate(2.5, "H100", table, spot=True, gpus=2)}
    assert rows["aws"]["usd"] == pytest.approx(2.5 * 2 * 1.5) and rows["aws"]["gpu_hours"] == 5.0
    assert rows["lambda"]["usd"] is None  # no spot there: said, not priced as zero
    assert cost.estimate(1.0, "MI300X", table)[0]["usd"] == 3.0


def test_an_unknown_gpu_type_or_a_bad_prices_file_is_a_clear_error(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"GPU type 'B200' is not in the price table .*known types: .*H100"):
        cost.load_prices().of("B200")
    bad = tmp_path / "bad.yaml"
    bad.write_text("prices:\n  - {gpu: H100, provider: aws}\n")
    with pytest.raises(ValueError, match=r"bad.yaml: entry 1 .* needs gpu, provider, on_demand"):
        cost.load_prices(bad)
    monkeypatch.setenv(cost.PRICES_ENV, str(tmp_path / "missing.yaml"))
    with pytest.raises(ValueError, match=r"missing.yaml \(from SHARDLINE_PRICES\) does not exist"):
        cost.load_prices()


def test_the_gpu_type_is_declared_detected_or_cpu(monkeypatch):
    monkeypatch.setenv(cost.GPU_ENV, "NVIDIA L4")
    assert cost.detect_gpu() == ("L4", "SHARDLINE_GPU_TYPE=NVIDIA L4")
    monkeypatch.delenv(cost.GPU_ENV)
    gpu, how = cost.detect_gpu()
    import torch

    if not torch.cuda.is_available():
        assert gpu == "CPU" or how.startswith("nvidia-smi")


# ---------------------------------------------------------------- the ledger: useful and wasted time


def attempt(first: int, last: int, seconds: float, marks, price: float | None = 2.0, gpus: int = 1, **over) -> dict:
    return {
        "host": "h",
        "gpu": "H100",
        "gpus": gpus,
        "provider": "aws",
        "spot": False,
        "usd_per_gpu_hour": price,
        "prices_as_of": "2026-11",
        "seconds": seconds,
        "first_step": first,
        "last_step": last,
        "outcome": "finished",
        "marks": [[first, 0.0], *marks],
        **over,
    }


def test_time_on_steps_a_later_attempt_trained_again_is_wasted():
    killed = attempt(0, 34, 400.0, [[10, 100.0], [20, 210.0], [30, 330.0]], outcome="killed")
    # the next attempt resumed from step 30: what the first spent after its checkpoint at 30 was redone
    finished = attempt(30, 60, 300.0, [[40, 100.0], [60, 300.0]])
    assert cost_ledger.useful_seconds([killed, finished]) == [330.0, 300.0]
    # a damaged newest checkpoint: the resume starts from 20, so the first attempt's time after 20 is wasted
    assert cost_ledger.useful_seconds([killed, attempt(20, 60, 420.0, [])]) == [210.0, 420.0]
    # preempted with a checkpoint at the step it stopped: nothing is redone
    preempted = attempt(0, 34, 380.0, [[34, 379.0]], outcome="preempted")
    assert cost_ledger.useful_seconds([preempted, attempt(34, 60, 280.0, [])]) == [380.0, 280.0]
    # killed before its first checkpoint: all of it redone, and a third attempt that goes back further
    # makes the second one's time after its start wasted too
    early = attempt(0, 8, 90.0, [], outcome="killed")
    assert cost_ledger.useful_seconds([early, attempt(0, 60, 700.0, [])]) == [0.0, 700.0]
    assert cost_ledger.useful_seconds([killed, attempt(30, 45, 150.0, [], outcome="killed"), finished])[:2] == [
        330.0,
        0.0,
    ]


def test_the_summary_prices_each_attempt_at_its_own_rate_and_useful_plus_wasted_is_the_total():
    killed = attempt(0, 34, 3600.0, [[30, 1800.0]], price=4.0, gpus=2, outcome="killed")
    finished = attempt(30, 60, 1800.0, [], price=1.0, gpus=1, gpu="L4", provider="gcp")
    s = cost_ledger.summarize([killed, finished])
    assert s["gpu_hours"] == pytest.approx(2 * 1.0 + 0.5)
    assert s["gpu_hours_wasted"] == pytest.approx(2 * 0.5)
    assert s["gpu_hours_useful"] + s["gpu_hours_wasted"] == pytest.approx(s["gpu_hours"])
    assert s["usd"] == pytest.approx(2 * 1.0 * 4.0 + 0.5 * 1.0)
    assert s["usd_wasted"] == pytest.approx(2 * 0.5 * 4.0)
    assert s["usd_useful"] + s["usd_wasted"] == pytest.approx(s["usd"])
    assert (s["gpu"], s["provider"], s["attempts"]) == ("L4", "gcp", 2)  # the last attempt's machine
    assert "estimate" in s["estimate"] and "not a bill" in s["estimate"]
    # an attempt the table had no price for counts in the hours, not in the USD, and is said
    s = cost_ledger.summarize([killed, {**finished, "usd_per_gpu_hour": None}])
    assert s["usd"] == pytest.approx(8.0) and s["unpriced_attempts"] == 1
    assert cost_ledger.summarize([{**finished, "usd_per_gpu_hour": None}])["usd"] is None
    assert cost_ledger.summarize([]) is None


def test_a_price_is_the_providers_or_the_cheapest_listed(tmp_path):
    table = cost.load_prices()
    chosen = cost_ledger.choose_price(table, "H100", 1, None, spot=False)
    assert chosen.usd_per_gpu_hour == min(p.on_demand for p in table.of("H100"))
    assert "cheapest" in chosen.note and chosen.provider in chosen.note
    spot = cost_ledger.choose_price(table, "H100", 8, None, spot=True)
    assert spot.usd_per_gpu_hour == min(p.spot for p in table.of("H100") if p.spot is not None) and spot.gpus == 8
    assert cost_ledger.choose_price(table, "H100", 1, "aws", spot=False).usd_per_gpu_hour == 6.88
    missing = cost_ledger.choose_price(table, "H100", 1, "nimbus", spot=False)
    assert missing.usd_per_gpu_hour is None and "'nimbus' has no H100 price" in missing.note and "aws" in missing.note
    assert "no spot price" in cost_ledger.choose_price(table, "H100", 1, "lambda", spot=True).note
    assert "known types" in cost_ledger.choose_price(table, "B200", 1, None, spot=False).note


class Clock:
    """A clock the test moves: the ledger's seconds are what it says."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def pricing(rate: float | None = 3600.0, gpus: int = 1) -> cost_ledger.Pricing:
    return cost_ledger.Pricing("H100", gpus, "testcloud", False, rate, "2026-11 (test)", "test price")


def test_the_ledger_keeps_each_attempt_and_a_killed_one_is_said(tmp_path, monkeypatch):
    monkeypatch.setenv(cost_ledger.LEDGER_ENV, "30")
    run = str(tmp_path / "run")
    clock = Clock()
    first = cost_ledger.CostLedger(run, pricing(), 0, clock=clock)
    clock.now += 10
    first.checkpoint(5)
    clock.now += 20
    first.progress(8)  # 20 s after the last write: not written yet
    on_disk = cost_ledger.read_ledger(run)["attempts"][0]
    assert (on_disk["last_step"], on_disk["seconds"], on_disk["marks"]) == (5, 10.0, [[0, 0.0], [5, 10.0]])
    clock.now += 15
    first.progress(11)  # 35 s after it: written
    assert cost_ledger.read_ledger(run)["attempts"][0]["last_step"] == 11
    # the process dies here (SIGKILL): its entry says `running` until the next attempt calls it killed
    clock.now += 100
    second = cost_ledger.CostLedger(run, pricing(), 5, clock=clock)
    killed = cost_ledger.read_ledger(run)["attempts"][0]
    assert killed["outcome"] == "killed" and killed["seconds"] == 45.0
    clock.now += 60
    second.checkpoint(20)
    summary = second.end("finished", 20)
    assert second.end("failed") == summary  # said once
    doc = cost_ledger.read_ledger(run)
    assert [a["outcome"] for a in doc["attempts"]] == ["killed", "finished"]
    assert doc["attempts"][1]["host"] and doc["attempts"][1]["started"].endswith("+00:00")
    assert summary["seconds"] == 105.0
    assert summary["gpu_hours_wasted"] == pytest.approx(35 / 3600)  # first's 35 s after its checkpoint at 5
    assert summary["usd"] == pytest.approx(105.0)  # 3600 USD per GPU-hour: one a second
    # an attempt that found the run finished and trained nothing is not an attempt
    third = cost_ledger.CostLedger(run, pricing(), 20, clock=clock)
    clock.now += 3
    assert third.end("finished", 20) == summary
    assert len(cost_ledger.read_ledger(run)["attempts"]) == 2


def test_a_checkpoint_written_while_training_went_on_marks_the_time_its_state_was_taken(tmp_path):
    clock = Clock()
    ledger = cost_ledger.CostLedger(str(tmp_path / "run"), pricing(), 0, clock=clock)
    clock.now += 30
    ledger.checkpoint(10, age=4.0)  # complete at 30 s, its state (step 10) taken at 26 s: later steps are redone
    clock.now += 30
    ledger.checkpoint(20)
    clock.now += 1
    ledger.checkpoint(30, age=60.0)  # never before the mark before it
    assert ledger.entry["marks"] == [[0, 0.0], [10, 26.0], [20, 60.0], [30, 60.0]]


def test_a_resume_records_what_its_preemption_or_kill_cost_at_its_first_new_step(tmp_path, monkeypatch):
    at = "2026-11-01T10:0{}:00.000+00:00"
    # killed 4 steps past its checkpoint at 30 on 2 GPUs: its 70 s after that checkpoint are redone on both
    killed = attempt(0, 34, 400.0, [[30, 330.0]], gpus=2, outcome="killed", started=at.format(0))
    resumed = attempt(30, 31, 12.5, [], started=at.format(8))  # its first step: 8 min after the other started
    assert cost_ledger.interruption(killed, resumed) == {
        "after": "killed",
        "steps_redone": 4,
        "gpu_seconds_redone": 140.0,
        "recovery_seconds": 480 + 12.5 - 400.0,  # from the killed one's last record to that first step
    }
    # a notice (SIGTERM): checkpointed at the step it stopped at, nothing redone
    preempted = attempt(0, 34, 380.0, [[34, 379.0]], outcome="preempted", started=at.format(0))
    cut = cost_ledger.interruption(preempted, attempt(34, 35, 20.0, [], started=at.format(7)))
    assert (cut["steps_redone"], cut["gpu_seconds_redone"], cut["recovery_seconds"]) == (0, 0.0, 60.0)
    s = cost_ledger.summarize([killed, {**resumed, "interruption": cut}])
    assert (s["preemptions"], s["steps_redone"], s["recovery_seconds"]) == (1, 0, 60.0)
    assert "; 1 preemption(s): 0 step(s), 0 GPU-seconds redone" in cost_ledger.describe(s)
    # after a kill the summary's line says what was redone as the lower bound it is, as the resume's log does
    k = cost_ledger.summarize([killed, {**resumed, "interruption": cost_ledger.interruption(killed, resumed)}])
    assert "; 1 preemption(s), 1 of them kill(s): at least 4 step(s), at least 140 GPU-seconds redone" in (
        cost_ledger.describe(k)
    ), cost_ledger.describe(k)

    # the ledger records it at the resumed attempt's first step past its checkpoint, written at once, once
    monkeypatch.setenv(cost_ledger.LEDGER_ENV, "3600")
    run, clock = str(tmp_path / "run"), Clock()
    first = cost_ledger.CostLedger(run, pricing(gpus=2), 0, clock=clock)
    clock.now += 10
    first.checkpoint(5)
    clock.now += 6
    first.progress(8)
    first._write()  # its last record: step 8 at 16 s (then SIGKILL)
    cost_ledger.CostLedger(run, pricing(), 5, clock=clock).end("budget", 5)  # stopped before a step: skipped
    second = cost_ledger.CostLedger(run, pricing(gpus=2), 5, clock=clock)
    assert second.progress(5) is None  # where it resumed: no step yet
    clock.now += 2
    cut = second.progress(6)
    assert (cut["after"], cut["steps_redone"], cut["gpu_seconds_redone"]) == ("killed", 3, 12.0)
    assert cost_ledger.read_ledger(run)["attempts"][2]["interruption"] == cut
    assert second.progress(7) is None
    assert second.end("budget", 7)["preemptions"] == 1
    third = cost_ledger.CostLedger(run, pricing(), 7, clock=clock)  # after a budget stop: no preemption
    assert third.progress(8) is None and third.end("finished", 8)["preemptions"] == 1


def test_the_log_of_a_resume_after_a_kill_says_the_steps_redone_are_a_lower_bound(tmp_path, monkeypatch):
    """No record survives a kill: its last steps are unknown, so what was redone is at least what the log says (it
    said "0 step(s) redone" where 9 were)."""
    from shardline.runs.training_cost import progress

    class Logged:  # the MLflow run's side (the tracker), kept here: the test is about the log line
        def log_metrics(self, metrics, step, each=False):
            self.logged = (metrics, step, each)

    monkeypatch.setenv(cost_ledger.LEDGER_ENV, "3600")
    run, clock, said = str(tmp_path / "run"), Clock(), []
    first = cost_ledger.CostLedger(run, pricing(), 0, clock=clock)
    clock.now += 10
    first.checkpoint(5)
    first.progress(6)
    first._write()  # its last record: step 6 (then SIGKILL, some steps later)
    second = cost_ledger.CostLedger(run, pricing(), 5, clock=clock)
    second.progress(5)
    clock.now += 2

    class Said:  # what the run's logger is told
        def info(self, message, *args):
            said.append(message % args)

    progress(Logged(), second, 6, Said())
    assert "after a kill: at least 1 step(s) redone, at least " in said[0], said


def test_the_budget_left_is_a_deadline_on_this_attempts_clock(tmp_path):
    run = str(tmp_path / "run")
    clock = Clock()
    first = cost_ledger.CostLedger(run, pricing(rate=7200.0), 0, clock=clock)  # 2 USD a second
    clock.now += 50
    first.end("budget", 40)
    second = cost_ledger.CostLedger(run, pricing(rate=3600.0, gpus=2), 40, clock=clock)  # 2 USD a second too
    start = clock.now
    assert second.deadline(None, None) is None
    # 100 USD spent of 300: 100 s left at 2 USD a second
    assert second.deadline(None, 300.0) == (start + 100.0, "max_cost")
    # 50 s of 60 s: 10 s left, the nearer limit
    assert second.deadline(60 / 3600, 300.0) == (pytest.approx(start + 10.0), "max_hours")
    # spent already: a deadline in the past (fit stops before its first step)
    assert second.deadline(None, 50.0)[0] < start
    clock.now += 12
    text = second.spent_text(None, 120.0, "max_cost")
    assert text.startswith("training.max_cost=120 USD reached: ") and "124 USD" in text and "2 attempt(s)" in text
    assert "H100 x2 at testcloud" in text and "estimate" in text
    unpriced = cost_ledger.CostLedger(str(tmp_path / "other"), pricing(rate=None), 0, clock=clock)
    with pytest.raises(ValueError, match=r"training.max_cost=5 needs a price for this machine \(H100\): test price"):
        unpriced.deadline(None, 5.0)
    assert unpriced.deadline(1.0, None) == (pytest.approx(clock.now + 3600.0), "max_hours")  # hours need no price


# ---------------------------------------------------------------- the loop stops at its budget


def test_a_budget_stop_saves_a_checkpoint_and_raising_the_budget_resumes_exactly(data, tmp_path):  # noqa: F811
    args = (data["classification"], data["classification-val"], spec_for("mlp"))
    reference = fit(*args, train_cfg(), "classification", str(tmp_path / "straight"), callbacks=Callbacks(log=quiet))
    folder = str(tmp_path / "budget")
    deadline = loop.Deadline(time.monotonic() + 3.0, lambda: "training.max_cost=1 USD reached: 1.2 USD", "max_cost")

    def slow_at_step_4(step: int, metrics: dict) -> None:
        if step == 4:  # this step outlasts the budget: the loop stops at its boundary
            time.sleep(max(0.0, deadline.at - time.monotonic()) + 0.05)

    with pytest.raises(loop.BudgetExceeded) as stopped:
        fit(
            *args,
            train_cfg(),
            "classification",
            folder,
            callbacks=Callbacks(on_step=slow_at_step_4, log=quiet),
            options=FitOptions(step_every=1, deadline=deadline),
        )
    message = str(stopped.value)
    assert stopped.value.checkpoint.endswith("ckpt-000000004.pt")
    assert message.startswith("training stopped at its budget: training.max_cost=1 USD reached: 1.2 USD; ")
    assert f"checkpoint saved at {stopped.value.checkpoint}" in message
    assert message.endswith("raise training.max_cost and run again to resume")
    assert "Preempted" not in message  # a budget stop is never taken for a preemption (tasks/train.py)
    assert latest_checkpoint(folder)[1]["step"] == 4
    saved = list_checkpoints(folder)
    # still out of budget: stopped before a step is trained, nothing saved
    spent = loop.Deadline(time.monotonic() - 1, lambda: "training.max_hours=1 reached", "max_hours")
    with pytest.raises(loop.BudgetExceeded, match="raise training.max_hours and run again") as again:
        fit(
            *args,
            train_cfg(),
            "classification",
            folder,
            callbacks=Callbacks(log=quiet),
            options=FitOptions(deadline=spent),
        )
    assert again.value.checkpoint == stopped.value.checkpoint and list_checkpoints(folder) == saved
    # ...and said so: it saved nothing (it said "checkpoint saved at" the one it had resumed)
    assert f"before its first step; its newest checkpoint is {stopped.value.checkpoint}" in str(again.value)
    # a higher budget (a far deadline) resumes from the checkpoint to the uninterrupted run's weights, to the bit
    result = fit(
        *args,
        train_cfg(max_cost=100.0),
        "classification",
        folder,
        callbacks=Callbacks(log=quiet),
        options=FitOptions(deadline=loop.Deadline(time.monotonic() + 3600, lambda: "", "max_cost")),
    )
    assert result.resumed_from == stopped.value.checkpoint
    assert_same_weights(
        load_model(result.last_checkpoint).state_dict(), load_model(reference.last_checkpoint).state_dict()
    )
    assert no_timing(result.history) == no_timing(reference.history)
    assert all(h["val_seconds"] <= h["seconds"] for h in result.history)


def test_budgets_and_prices_change_nothing_that_is_trained():
    from shardline.core.config import TrainingConfig, validate_config
    from shardline.runs.training_run import training_identity
    from tests.conftest import tiny_config

    base = tiny_config("raw/*.parquet", "/tmp/store")
    limited = tiny_config("raw/*.parquet", "/tmp/store", **{"training.max_cost": 5.0, "training.max_hours": 2.0})
    limited["compute"] = {"provider": "aws", "spot": True}
    a, b = validate_config(base), validate_config(limited)
    assert training_identity(a) == training_identity(b)  # the run folder, the train cache key, the version
    assert {"max_hours", "max_cost"} <= set(TrainingConfig.RESUMABLE_CHANGES)
    with pytest.raises(ValueError, match="greater than 0"):
        TrainingConfig(max_cost=0)


def test_a_sweeps_cost_adds_its_trials_up_and_says_what_was_not_priced():
    from shardline.core.cost.ledger import add_up

    priced = {"seconds": 3600.0, "gpu_hours": 1.0, "gpu_hours_useful": 0.75, "gpu_hours_wasted": 0.25, "attempts": 2}
    priced.update(usd=2.0, usd_useful=1.5, usd_wasted=0.5)
    unpriced = {**priced, "gpu_hours": 0.5, "gpu_hours_useful": 0.5, "gpu_hours_wasted": 0.0, "attempts": 1}
    unpriced.update(usd=None, usd_useful=None, usd_wasted=None)
    total = add_up([priced, unpriced, None])
    assert (total["gpu_hours"], total["gpu_hours_wasted"], total["attempts"]) == (1.5, 0.25, 3)
    assert (total["usd"], total["usd_wasted"]) == (2.0, 0.5)  # only the priced run has a price
    assert (total["runs"], total["uncosted"], total["unpriced_runs"]) == (2, 1, 1)
    assert add_up([unpriced])["usd"] is None and add_up([]) is None
