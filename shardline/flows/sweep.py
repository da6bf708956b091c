"""The sweep: many trainings of one config, each with a few keys overridden, the best registered.

Ingest and encode run once per distinct data setting (cached as in the pipeline); every trial trains
through the pipeline's cached train step, concurrently: on the training deployment's work pool (one
flow run per trial: N workers take N trials) or locally in child processes, `at_once` at a time, each
with its share of the cores. The best trial by its validation score is evaluated on the test split and
registered by the pipeline's own steps. One parent MLflow run holds the trials' runs, the scores and
the comparison picture; the `sweep` artifact lists the trials. A rerun trains only what did not finish.
"""

from __future__ import annotations

from functools import partial

from prefect import flow
from prefect.logging import get_run_logger

from shardline.core import layout
from shardline.core.config import PipelineConfig, validate_config
from shardline.core.cost.ledger import add_up
from shardline.core.encoding.columns import DataError
from shardline.core.failures import BudgetExceeded
from shardline.core.memory import return_freed_memory
from shardline.core.secrets import install_log_redaction, redacted_errors
from shardline.core.sweep import (
    FOLD_KEY,
    SweepFailed,
    Trial,
    best_of,
    cpu_share,
    cross_validate,
    data_key,
    is_cross_validation,
    parse_space,
    plan_sweep,
    raw_config,
    read_space,
    trial_config,
    with_folds,
)
from shardline.flows.pipeline import baseline_name, encoded_data, sample_file
from shardline.flows.train import train
from shardline.runs import links
from shardline.runs.parent import pinned, resolve_parent
from shardline.tasks.caching import run_cached
from shardline.tasks.evaluate import EVALUATE_CACHE, evaluate
from shardline.tasks.register import REGISTER_CACHE, register, with_alias_now
from shardline.tasks.sweep import (
    SweepStudy,
    check_pruning,
    finish_parent_run,
    parent_pages,
    parent_run,
    report_sweep,
    tag_version,
    train_in_child,
    train_trials,
)

LOCAL_AT_ONCE = 2  # measured (docs/experiments.md): two demo-sized trials at once beat one at a time on 2 cores


@flow(name="sweep", log_prints=True, flow_run_name=links.flow_run_name("sweep"))
@redacted_errors
def sweep(
    config: PipelineConfig | dict | str,
    space: dict | str,
    trials: int | None = None,
    seed: int = 0,
    at_once: int | None = None,
    folds: bool = False,
    sampler: str | None = None,
    prune: str | None = None,
) -> dict:
    """Train one model per trial of `space` (a YAML path or the space itself: dotted config keys to a list
    of values or {low, high, log, int}) over `config`; register the best. `trials`: that many drawn at random
    with `seed`; None: the grid of the lists. `at_once`: trials training at once (default: all of them on a
    deployment's pool, two here). `sampler="tpe"`: `trials` proposed by Optuna's TPE sampler as trials finish;
    `prune` ("median", "hyperband"): Optuna's pruner stops the trials that fall behind at an epoch's end. The trials
    are an Optuna study in the sweep's folder: the same sweep again continues it."""
    install_log_redaction()
    return_freed_memory()
    log = get_run_logger()
    raw = raw_config(config)
    space = read_space(space) if isinstance(space, str) else parse_space(space) if space or not folds else {}
    if folds:  # every setting on every fold of the k-fold data
        space = with_folds(space, validate_config(raw, "(the sweep's base config)"))
    if (raw.get("training") or {}).get("init_from") and "training.init_from" not in space:  # once for every trial
        given = validate_config(raw, "(the sweep's base config)")
        init_from = pinned(given, resolve_parent(given)).training.init_from
        raw = {**raw, "training": {**raw["training"], "init_from": init_from}}
    plan = plan_sweep(raw, space, trials, seed, sampler)
    check_pruning(plan, prune)
    plan.pruner = prune
    base = plan.base
    root = base.storage.root
    n = plan.size or len(plan.trials)
    data, ran = {}, {"ingest": False, "encode": False}

    def with_data(pairs):  # one ingest and encode per data setting; the encode's own cache shares the rest
        for trial, config_ in pairs:
            if (key := data_key(config_)) not in data:
                try:
                    *data[key], did = encoded_data(config_)
                except DataError as e:  # this setting's data (a window longer than the sequences): its trials fail
                    data[key], did = e, {}
                    log.warning("sweep: %s: the data does not encode, its trial(s) fail: %s", setting(config_), e)
                ran.update({step: ran[step] or did.get(step, False) for step in ran})
            yield trial, config_

    def setting(config_) -> str:  # the data keys a trial sets, for reading
        trial = next((t for t, c in zip(plan.trials, plan.configs) if c is config_), None)
        keys = {k: v for k, v in (trial.overrides if trial else {}).items() if k.startswith("data.")}
        return ", ".join(f"{k}={v}" for k, v in keys.items()) or "the base config"

    for _ in with_data([(None, c) for c in plan.configs or [base]]):
        pass
    # the sweep is its trials on these raw files: files added or changed are another sweep (its own study and parent
    # run), not trials scored and pruned against the old data's
    plan.data = next((d[0].fingerprint for d in data.values() if not isinstance(d, Exception)), None)
    log.info("sweep %s: %d %s trial(s) over %s", plan.id, n, plan.mode, ", ".join(plan.keys))
    folder = layout.sweep(root, plan.id)
    study = SweepStudy(plan, folder, prune, raw)
    remote = base.compute.train_on == "deployment"
    at_once = at_once or (n if remote else max(1, min(n, LOCAL_AT_ONCE)))  # locally: each with its share of the cores
    threads = None if remote else cpu_share(at_once)
    here = train if remote else partial(train_in_child, train, cpu_threads=threads)
    if not remote:
        log.info("sweep: %d trial(s) at once on this machine, %d torch thread(s) each", at_once, threads)
    with parent_run(plan, folder) as parent:  # ended KILLED or FAILED if the sweep is interrupted or fails
        pairs = with_data(study.proposed()) if plan.mode == "tpe" else None
        outcomes = train_trials(plan, data, parent.run_id, at_once, here, study=study, pairs=pairs)
        rows = [row for row, _ in outcomes]
        cv = is_cross_validation(plan.space)
        settings = cross_validate(rows) if cv else None
        best = best_of(settings if cv else rows)  # cross-validation: the setting with the best mean over folds
        metric = best["metric"] if best else "val_loss"
        direction = best["direction"] if best else "minimize"
        final = None
        if cv and best is not None:  # the chosen setting retrained on every non-test fold (training.fold: null)
            final = Trial("final", {**best["setting"], FOLD_KEY: None})
            final_config = trial_config(raw, final)
            final_pair = [(final, final_config)]
            final_row, final_trained = train_trials(plan, data, parent.run_id, 1, here, pairs=final_pair)[0]
            rows.append(final_row)
        pages = parent_pages(parent, [r["mlflow_run_id"] for r in rows if r.get("mlflow_run_id")])
        heading = f"{base.name}: sweep of {len(rows)} trial(s) over {', '.join(plan.keys)}, by {metric}"
        retrain = (
            f"The best setting, {best['trial']} (mean {metric} {best['score']:.4g} ± {best['std']:.3g} over "
            f"{len(best['scores'])} folds), retrained on all non-test data ({base.data.split.folds} folds, "
            "training.fold: null, validated in-sample on the last fold) as trial `final`; that model is evaluated "
            "on the test split and registered."
            if final
            else ""
        )
        plot = report_sweep(
            [r for r in rows if r["trial"] != "final"],
            plan.keys,
            metric,
            direction,
            folder,
            heading,
            pages,
            settings=settings,
            final=retrain,
        )
        if best is None or (final and final_trained is None):
            why = "every trial failed" if best is None else f"the final retrain failed: {rows[-1]['error']}"
            finish_parent_run(parent, rows, metric, plot, f"**{heading}**: {why}.", settings)
            each = "\n".join(
                f"  {r['trial']} ({' '.join(f'{k}={v}' for k, v in r['overrides'].items()) or 'the config'}): "
                f"{r['error']}"
                for r in rows
                if r.get("error")
            )
            if best is None and rows and all(r["state"] == "budget" for r in rows):  # exit 76, as `run`'s stop
                spent = add_up([r.get("cost") for r in rows])
                usd = "" if not spent or spent["usd"] is None else f", about {spent['usd']:.3g} USD"
                spent = f" after {spent['gpu_hours']:.3g} GPU-hours in all{usd}" if spent else ""
                raise BudgetExceeded(
                    f"every trial stopped at its budget{spent}; raise "
                    "training.max_hours or max_cost and run the same command again: the same sweep, each trial "
                    f"resuming from its checkpoint:\n{each}"
                )
            raise SweepFailed(f"{why}:\n{each}")

        # the best trial (cross-validation: its retrain): evaluated on the test split, registered as the pipeline does
        if final:
            trial, config_, trained = final, final_config, final_trained
        else:
            i = [r["trial"] for r in rows].index(best["trial"])
            trial, config_, trained = plan.trials[i], plan.configs[i], outcomes[i][1]
        snapshot, manifest_uri, _ = data[data_key(config_)]
        scores, ran["evaluate"] = run_cached(
            evaluate, EVALUATE_CACHE, root, False, manifest_uri, trained, config_, sample_file(snapshot)
        )
        registered, ran["register"] = run_cached(
            register, REGISTER_CACHE, root, False, config_, snapshot, manifest_uri, trained, scores
        )
        if not ran["register"]:
            registered = with_alias_now(registered, config_)
        tag_version(config_, registered, parent.run_id, trial)
        version = f"{registered.model_name} v{registered.version} @{registered.alias}"
        summary = f"best {trial.id} ({trial.label}), {metric} {best['score']:.4g}; registered as {version}."
        if final:
            summary = f"{retrain} Registered as {version}."
            parent.set_tags({"shardline.sweep.final": "retrained on all non-test folds (training.fold: null)"})
        finish_parent_run(parent, rows, metric, plot, f"**{heading}**: {summary}", settings, best)
    links.tag_flow_run(
        [f"mlflow-run:{parent.run_id}", f"model:{registered.model_name}"] if parent.run_id else [],
        name=f"{base.name} · sweep · best {trial.id} · {version}",
    )
    counts = {s: sum(r["state"] == s for r in rows) for s in ("ran", "cached", "pruned", "failed", "budget")}
    return {
        "sweep_id": plan.id,
        "mode": plan.mode,
        "pruner": prune,
        "keys": plan.keys,
        "parent_run_id": parent.run_id,
        "parent_page": pages.get(parent.run_id) if parent.run_id else None,
        "folder": folder,
        "plot": plot,
        "metric": metric,
        "direction": direction,
        "at_once": at_once,
        "cpu_threads": threads,
        "trials": rows,
        "best": best,
        "settings": settings,
        "final": rows[-1] if final else None,
        # what the trials' training cost in all (a cached trial: when it ran): an estimate, by the price table
        "cost": add_up([r.get("cost") for r in rows]),
        "steps": {
            "ingest": "ran" if ran["ingest"] else "cached",
            "encode": "ran" if ran["encode"] else "cached",
            "train": ", ".join(f"{n} {s}" for s, n in counts.items() if n),
            "evaluate": "ran" if ran["evaluate"] else "cached",
            "register": "ran" if ran["register"] else "cached",
        },
        "train": {k: getattr(trained, k) for k in ("best_checkpoint", "steps", "device", "precision", "run_dir")},
        "metrics": scores.metrics,
        "baseline": scores.baseline,
        "baseline_name": baseline_name(config_),
        "table": scores.table,
        "registered": registered.model_dump(),
    }
