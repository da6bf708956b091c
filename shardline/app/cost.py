"""`shardline cost CONFIG`: how long a config's training will take and what it will cost, before it runs.

The steps are the training loop's own count (`planned_steps`) on the encoded data set: ingest and encode
run first, as the pipeline runs them and cached with it, so the real run reuses them. The rate is measured,
never assumed: the run of this very config (its run folder) when it trained on the GPU type asked, else a
short probe of the real training step on this machine when that is the type asked. A CPU's probe says
nothing about an H100: asking for another type than this machine's, with no run of the config on it, is
an error that says how to measure one. Time is steps times the measured rate plus one validation pass
per epoch; cost is time times each provider's price for the type (shardline/core/cost/prices.py: an estimate).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass

from prefect import flow

from shardline.core import storage
from shardline.core.config import PipelineConfig, training_splits
from shardline.core.cost.ledger import describe, read_ledger, summarize
from shardline.core.cost.prices import CPU, PriceTable, detect_gpu, estimate
from shardline.core.manifest import Manifest
from shardline.core.metrics.report import format_duration, format_number


class CostError(RuntimeError):
    """No honest estimate can be made (no rate measured on the GPU type asked); the message says how to get one."""


@dataclass
class Rate:
    windows_per_s: float  # training windows a second
    val_seconds: float  # one validation pass over the validation split
    source: str  # how it was measured, in words
    warmup_s: float = 0.0  # once a run: loading the splits, the first batches (what a probe's first epoch adds)
    gpus: int = 1  # the GPUs that trained at this rate (a run's, from its ledger: every machine's; a probe's: one)


@dataclass
class Plan:
    name: str
    manifest: str
    train_windows: int
    val_windows: int
    steps_per_epoch: int
    steps: int
    epochs: int
    epoch_windows: int  # windows trained in one epoch (a last short batch counted, max_steps_per_epoch applied)
    rate: Rate
    hours: float
    gpu: str
    gpus: int  # GPUs the run is costed for (each GPU-hour of each)
    scaled: int  # >1: a probe of one process, its time divided among this many (compute.nodes x processes_per_node)
    spot: bool
    provider: str | None  # compute.provider: the one the run is costed at (None: the cheapest)
    sources: list[str]
    rows: list[dict]
    spent: dict | None  # what this config's run has cost so far (its ledger), when it has trained


@flow(name="encoded-data", log_prints=True)
def encoded_data(config: PipelineConfig) -> str:
    """The config's encoded data set (its manifest URI), for `shardline cost` and `rehearse`: the pipeline's own
    cached ingest and encode (a fine-tune: its parent's encoding), so the real run finds them cached."""
    from shardline.flows import pipeline

    return pipeline.encoded_data(config)[1]


def run_rate(folder: str, gpu: str, epoch_windows: int) -> tuple[Rate | None, str]:
    """The rate this config's run (its run folder) measured, when every attempt of it trained on `gpu` (its
    cost ledger says which GPU each attempt had); else None and why not."""
    attempts = read_ledger(folder)["attempts"]
    if not attempts:
        return None, f"this config has not trained yet ({folder} has no cost ledger)"
    types = sorted({a["gpu"] for a in attempts})
    if types != [gpu]:
        return None, f"this config's run ({folder}) trained on {', '.join(types)}, not {gpu}"
    result = storage.join(folder, "result.json")
    if storage.exists(result):
        history = json.loads(storage.read_text(result)).get("history") or []
    else:
        from shardline.trainer.checkpoint import latest_checkpoint

        found = latest_checkpoint(storage.join(folder, "checkpoints"))
        history = found[1].get("history", []) if found else []
    epochs = [h for h in history if h.get("windows_per_s")]
    if not epochs:
        return None, f"this config's run ({folder}) has not finished an epoch yet"
    warm = epochs[1:] or epochs  # the first epoch also loaded the splits: the others say what an epoch takes
    wps = len(warm) / sum(1 / h["windows_per_s"] for h in warm)  # windows over seconds, epochs of equal size
    # an epoch's validation: measured as such; a run from before it was recorded, its time less the training's
    val = [h["val_seconds"] if "val_seconds" in h else h["seconds"] - epoch_windows / h["windows_per_s"] for h in warm]
    gpus = int(attempts[-1].get("gpus", 1))  # what its machines were billed for: every GPU of every node
    on = gpu if gpus == 1 else f"{gpus} x {gpu}"
    return Rate(
        wps,
        max(0.0, sum(val) / len(val)),
        f"measured by this config's run on {on} (epoch(s) {', '.join(str(h['epoch'] + 1) for h in warm)} "
        f"of its {len(attempts)} attempt(s), {folder})",
        gpus=gpus,
    ), ""


def probe_rate(config: PipelineConfig, manifest_uri: str, manifest: Manifest, steps: int, log) -> Rate:
    """Train `steps` optimizer steps of the real training step on this machine (two short epochs, each with its
    full validation pass, into a temporary checkpoint folder) and time the parts apart: the second epoch's
    training and validation are the rate, what the first took more is the run's start-up."""
    from shardline.core.metrics.split_ranking import SplitRanking
    from shardline.trainer.data import open_split
    from shardline.trainer.loop import Callbacks, FitOptions, fit
    from shardline.trainer.models import model_spec_for
    from shardline.trainer.serving import data_spec
    from shardline.trainer.step import planned_steps
    from shardline.trainer.stops import setting_hooks

    _, how = detect_gpu()
    trains_on, validates_on = training_splits(config.data.split, config.training.fold)
    train = open_split(manifest, manifest_uri, trains_on)
    val = open_split(manifest, manifest_uri, validates_on)
    try:
        per_epoch, _ = planned_steps(train.n_windows, config.training)
        cfg = config.training.model_copy(
            update={
                "epochs": 2,
                "max_steps_per_epoch": min(max(1, steps // 2), per_epoch),
                "checkpoint_every_steps": 0,
                "checkpoint_every_seconds": 0,
                "keep_checkpoints": 1,
            }
        )
        spec = manifest.encoding
        log(f"probing the training step on this machine ({how}): 2 epochs of {cfg.max_steps_per_epoch} step(s)")
        with tempfile.TemporaryDirectory(prefix="shardline-cost-probe-") as tmp:
            result = fit(
                train,
                val,
                model_spec_for(config.model, data_spec(spec)),
                cfg,
                spec.target.task if spec.target else None,
                tmp,
                Callbacks(log=lambda _m: None, **setting_hooks()),
                FitOptions(
                    step_every=10**9,
                    ranking=SplitRanking.of_validation(manifest, manifest_uri, validates_on, config.evaluation.k),
                ),
            )
    finally:
        train.release()
        val.release()
    first, second = result.history
    return Rate(
        second["windows_per_s"],
        second["val_seconds"],
        f"a probe of the training step on this machine ({how}; {result.device}/{result.precision}): its second "
        f"epoch of {cfg.max_steps_per_epoch} step(s) and validation",
        warmup_s=max(0.0, first["seconds"] - second["seconds"]),
    )


def plan_cost(
    config: PipelineConfig, table: PriceTable, gpu: str | None, spot: bool | None, probe_steps: int, log
) -> Plan:
    """The planned steps, a measured rate, the time, and its cost per provider of `gpu` (default: this
    machine's type). `table.of(gpu)` must have been checked by the caller (an unknown type is a user error)."""
    from shardline.runs.parent import resolve_parent
    from shardline.runs.training_run import load_manifest, run_dir
    from shardline.trainer.step import planned_steps

    here, _ = detect_gpu()
    gpu = gpu or here
    spot = config.compute.spot if spot is None else spot
    manifest_uri = encoded_data(config)
    manifest = load_manifest(manifest_uri, config)
    t = config.training
    trains_on, validates_on = training_splits(config.data.split, t.fold)
    train_windows = sum(manifest.windows.get(s, 0) for s in trains_on)
    per_epoch, steps = planned_steps(train_windows, t)
    epoch_windows = min(train_windows, per_epoch * t.batch_size * t.grad_accum)
    folder = run_dir(config, manifest, resolve_parent(config))
    rate, why = run_rate(folder, gpu, epoch_windows)
    if rate is None and gpu != here:
        machine = "a CPU" if here == CPU else f"a {here}"
        raise CostError(
            f"no rate measured on {gpu}: {why}, and this machine is {machine}, whose speed says nothing about "
            f"a {gpu}'s. Measure one where the run will go: run `shardline cost CONFIG` on a {gpu} machine (its "
            f"probe), or train this config there once (`shardline run`: this command then reads its rate); or "
            "leave out --gpu for this machine's estimate"
        )
    scaled = 1
    if rate is None:
        log(f"{why}: measuring this machine instead")
        rate = probe_rate(config, manifest_uri, manifest, probe_steps, log)
        scaled = config.compute.nodes * config.compute.processes_per_node  # the probe trained in one process
    hours = (rate.warmup_s + t.epochs * (epoch_windows / rate.windows_per_s / scaled + rate.val_seconds)) / 3600
    gpus = rate.gpus * scaled
    return Plan(
        name=config.name,
        manifest=manifest_uri,
        train_windows=train_windows,
        val_windows=sum(manifest.windows.get(s, 0) for s in validates_on),
        steps_per_epoch=per_epoch,
        steps=steps,
        epochs=t.epochs,
        epoch_windows=epoch_windows,
        rate=rate,
        hours=hours,
        gpu=gpu,
        gpus=gpus,
        scaled=scaled,
        spot=spot,
        provider=config.compute.provider,
        sources=table.sources,
        rows=estimate(hours, gpu, table, spot=spot, gpus=gpus),
        spent=summarize(read_ledger(folder)["attempts"]),
    )


def report(plan: Plan) -> str:
    """What `shardline cost` prints: each figure with how it was got, then the cost per provider."""
    t = plan.rate
    train_s = plan.epoch_windows / t.windows_per_s / plan.scaled
    kind = "spot" if plan.spot else "on-demand"
    # a probe measures loading the splits and the first batches (its first epoch less its second); a run's
    # epochs after its first do not
    warmup = f"{format_number(t.warmup_s)} s start-up (loading the splits, first batches) + " if t.warmup_s else ""
    left_out = "checkpoints" if t.warmup_s else "start-up, checkpoints"
    left_out += ", MLflow, evaluation and registration"
    lines = [
        f"{plan.name}: training on " + (f"one {plan.gpu}" if plan.gpus == 1 else f"{plan.gpus} x {plan.gpu}"),
        f"  steps   {plan.epochs} epoch(s) x {plan.steps_per_epoch:,} optimizer steps = {plan.steps:,} steps, "
        f"{plan.epoch_windows:,} of {plan.train_windows:,} training windows an epoch (the training loop's own count, "
        f"from the encoded data set {plan.manifest})",
        f"  rate    {t.windows_per_s:,.1f} training windows/s and {format_number(t.val_seconds)} s per validation pass "
        f"({plan.val_windows:,} windows): {t.source}",
        *(
            [
                f"  scale   the probe trained in one process; this config trains in {plan.scaled} (compute.nodes x "
                "processes_per_node): its training time is divided among them as if they scaled linearly, an "
                "optimistic bound (the gradients' all-reduce adds to each step); a run of this config measures it"
            ]
            if plan.scaled > 1
            else []
        ),
        f"  time    {warmup}{plan.epochs} x ({format_number(train_s)} s training + {format_number(t.val_seconds)} s "
        f"validation) = {format_duration(plan.hours * 3600)} ({format_number(plan.hours)} hours); {left_out} not "
        "included",
        f"  prices  {kind} USD per GPU-hour for {plan.gpu}: an ESTIMATE from list prices, not a quote; as of "
        f"{'; '.join(plan.sources)}",
        *([f"  spent   so far by this config's run (its cost.json): {describe(plan.spent)}"] if plan.spent else []),
        "",
        f"  {'provider':<12} {'USD/GPU-hour':>12} {'GPU-hours':>10} {'USD':>10}",
    ]
    cheapest = min((r["usd"] for r in plan.rows if r["usd"] is not None), default=None)
    for r in plan.rows:
        rate = "not sold" if r["usd_per_gpu_hour"] is None else format_number(r["usd_per_gpu_hour"])
        usd = "-" if r["usd"] is None else format_number(r["usd"])
        marks = []
        if plan.provider == r["provider"]:
            marks.append("compute.provider")
        elif plan.provider is None and r["usd"] is not None and r["usd"] == cheapest:
            marks.append("the cheapest: what a run is costed at without compute.provider")
        lines.append(
            f"  {r['provider']:<12} {rate:>12} {format_number(r['gpu_hours']):>10} {usd:>10}"
            + (f"   <- {', '.join(marks)}" if marks else "")
        )
    if plan.provider is not None and all(r["provider"] != plan.provider for r in plan.rows):
        lines.append(
            f"  (compute.provider {plan.provider} lists no {plan.gpu} price: a run on one is timed, not priced)"
        )
    return "\n".join(lines)
