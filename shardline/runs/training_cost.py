"""What a training run costs, kept while it trains (shardline/runs/training_run.py calls these): this attempt's
entry in the run folder's cost ledger, priced for this machine; the budget (training.max_hours, max_cost) as a
deadline for the training loop; and the run's spend on its MLflow run when an attempt ends."""

from __future__ import annotations

from shardline.core import storage
from shardline.core.config import PipelineConfig
from shardline.core.tracking.tracker import Tracker


def open_ledger(config: PipelineConfig, folder: str, log):
    """This attempt's `CostLedger` (priced for this machine: compute.provider, compute.spot; said in the log)
    and the `Deadline` of training.max_hours / max_cost, or None without one."""
    from shardline.core.cost.ledger import CostLedger, machine_pricing
    from shardline.trainer.checkpoint import latest_checkpoint
    from shardline.trainer.stops import Deadline

    pricing = machine_pricing(config.compute.provider, config.compute.spot, config.compute.nodes)
    if pricing.usd_per_gpu_hour is None:
        log.warning(
            "train: cost: no price for %s x%d (%s): its hours are counted, not its USD",
            pricing.gpu,
            pricing.gpus,
            pricing.note,
        )
    else:
        log.info(
            "train: cost: %s x%d at %g USD/GPU-hour (%s; an estimate, prices as of %s)",
            pricing.gpu,
            pricing.gpus,
            pricing.usd_per_gpu_hour,
            pricing.note,
            pricing.as_of,
        )
    previous = latest_checkpoint(storage.join(folder, "checkpoints"))
    ledger = CostLedger(folder, pricing, previous[1]["step"] if previous else 0)
    t = config.training
    try:
        found = ledger.deadline(t.max_hours, t.max_cost)
    except ValueError:
        ledger.end("failed")
        raise
    if found is None:
        return ledger, None
    at, limit = found
    return ledger, Deadline(at, lambda: ledger.spent_text(t.max_hours, t.max_cost, limit), limit)


def progress(tracker: Tracker, ledger, step: int, log) -> None:
    """Where training is, to the ledger; at this attempt's first step after a preemption or a kill, what that
    cost on the MLflow run (`preemption/*`, at the step it resumed from: one point per interruption) and in the log."""
    cut = ledger.progress(step)
    if cut is None:
        return
    points = {f"preemption/{k}": v for k, v in cut.items() if k != "after"}
    tracker.log_metrics(points, ledger.entry["first_step"], each=True)  # two resumed at one checkpoint: two points
    # after a kill nothing records its last steps: its last ledger record is up to SHARDLINE_COST_LEDGER_SECONDS
    # older, so what was redone is a lower bound (it said "0 step(s) redone" where 9 were)
    at_least = "" if cut["after"] == "preempted" else "at least "
    log.info(
        "train: resumed at step %d after a %s: %s%d step(s) redone, %s%.3g GPU-seconds redone, %.3g s from the "
        "last record of the interrupted attempt to this first new step",
        ledger.entry["first_step"],
        "preemption (SIGTERM/SIGINT, with a checkpoint)" if cut["after"] == "preempted" else "kill",
        at_least,
        cut["steps_redone"],
        at_least,
        cut["gpu_seconds_redone"],
        cut["recovery_seconds"],
    )


def close_cost(tracker: Tracker, ledger, outcome: str, step: int | None, log) -> dict | None:
    """End this attempt's ledger entry and put the run's spend so far on its MLflow run (before its end)."""
    from shardline.core.cost.ledger import PREEMPTION_KEYS, describe

    summary = ledger.end(outcome, step)
    if summary is None:
        return None
    # its spend as `cost/*` (USD None when the table had no price), with what its preemptions cost, summed
    keys = ("gpu_hours", "gpu_hours_wasted", "usd", "usd_wasted", "preemptions", *PREEMPTION_KEYS)
    tracker.log_metrics({f"cost/{k}": summary.get(k) for k in keys}, ledger.entry["last_step"])
    tags = {
        "shardline.cost.gpu": f"{summary['gpu']} x{summary['gpus']}",
        "shardline.cost.provider": f"{summary['provider'] or 'unpriced'} "
        + ("(spot)" if summary["spot"] else "(on-demand)"),
        "shardline.cost.prices_as_of": str(summary["prices_as_of"]),
        "shardline.cost.estimate": summary["estimate"],
    }
    if outcome == "budget":  # the run is left KILLED until its limit is raised
        tags["shardline.stopped_by"] = "budget"
    elif outcome == "finished" and any(a.get("outcome") == "budget" for a in ledger.earlier):
        tags["shardline.stopped_by"] = "budget, then resumed to the end"
    tracker.set_tags(tags)
    log.info("train: cost so far: %s", describe(summary))
    return summary
