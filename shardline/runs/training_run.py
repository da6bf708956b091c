"""One training run, shared by the pipeline's train step (in-process) and the training flow (on a GPU
pool): its folder in storage, the check that the shards fit the config, one MLflow run however often
it is interrupted (continued, with the replayed steps logged once), and `result.json` beside the
checkpoints for a dispatcher on another machine."""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import socket
import time
import uuid
from functools import partial

import yaml

from shardline.core import layout, storage
from shardline.core.config import ModelConfig, PipelineConfig, settings, stable_hash, training_splits
from shardline.core.encoding.contract import contract, contract_differences, contract_of
from shardline.core.manifest import Manifest, edited_encoding
from shardline.core.metrics.split_ranking import SplitRanking
from shardline.core.secrets import redact_text
from shardline.core.study import PRUNED_TAG, Pruning
from shardline.core.tracking.system import CPU_KEY, SystemSampler
from shardline.core.tracking.tracker import Tracker, flatten
from shardline.core.version import code_version, user_code_version
from shardline.runs import links, training_cost
from shardline.runs.parent import init_weights, parent_encoding, resolve_parent
from shardline.runs.result import RESULT_FILE, Parent, TrainResult
from shardline.runs.training_view import LiveView, run_logger
from shardline.trainer.progress import BAR_SECONDS, DataWaitWatch, TerminalProgress


def model_identity(model: ModelConfig) -> dict:
    """What decides the model that is trained: its settings and, for the user's own model, the version of
    its code (the entrypoint's module and every module of the user's it imports), not where that code sits."""
    identity = model.model_dump(mode="json", exclude={"code_dir", "requirements"})
    if model.entrypoint:
        identity["code_version"] = user_code_version(model.entrypoint, model.code_dir)
    return identity


def training_identity(config: PipelineConfig, parent: Parent | None = None) -> dict:
    """The training settings that change what is trained, with `init_from` resolved (`parent`, when the
    caller has it, else resolved here)."""
    identity = config.training.model_dump(mode="json", exclude=set(config.training.RESUMABLE_CHANGES))
    if config.training.init_from:
        identity["init_from"] = (parent or resolve_parent(config)).identity()
    return identity


def run_dir(config: PipelineConfig, manifest: Manifest, parent: Parent | None = None, fresh: bool = False) -> str:
    """Where one training run's checkpoints and evaluation live: addressed by data + model (the user's code
    included) + the training settings that change what is trained + the version of the code that trains
    (`trainer_version`, as the train step's cache key has it), so an edit to the training code trains again rather than
    finding the finished run. `fresh` (`--force train`): a new folder beside it (the old run is kept)."""
    from shardline.core.version import trainer_version

    training = training_identity(config, parent)
    key = stable_hash(
        {
            "manifest": manifest.hash(),
            "model": model_identity(config.model),
            "training": training,
            "code": trainer_version(),
        }
    )
    folder = layout.run(config.storage.root, key[:20])
    return f"{folder}-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}" if fresh else folder


def is_fresh_run(folder: str) -> bool:
    """Whether `folder` is a `--force train` run's (`run_dir(fresh=True)`: its address, a dash, when it started)."""
    return "-" in folder.rstrip("/").rsplit("/", 1)[-1]


def dataset_inputs(manifest: Manifest, manifest_uri: str, name: str) -> list[dict]:
    """The encoded data set as MLflow data set inputs, one per split (context train, validation, test):
    its digest is the manifest's checksum with the split (the same shards, the same digest), its source
    the manifest, its schema the columns the model reads, its profile the split's size."""
    spec = manifest.encoding
    colspec = [{"name": c.name, "type": "double"} for c in spec.continuous]
    colspec += [{"name": v.name, "type": "string"} for v in spec.categorical]
    colspec += [{"name": b, "type": "boolean"} for b in spec.boolean]
    schema = json.dumps({"mlflow_colspec": colspec})
    out = []
    for split in dict.fromkeys(s.split for s in manifest.shards):
        shards = manifest.shards_of(split)
        profile = {
            "windows": manifest.windows.get(split, 0),
            "rows": manifest.rows.get(split, 0),
            "shards": len(shards),
            "stored_bytes": sum(s.bytes for s in shards),
            "window": spec.window,
            "targets": [t.column for t in spec.targets],
            "data_fingerprint": manifest.data_fingerprint,
            "raw_files": manifest.source_files,
        }
        out.append(
            {
                "name": f"{name}-{split}",
                "digest": stable_hash([manifest.hash(), split])[:16],
                "source_type": "shardline-manifest",
                "source": json.dumps({"uri": redact_text(manifest_uri), "split": split}),
                "schema": schema,
                "profile": json.dumps(profile),
                "context": split,
            }
        )
    return out


def run_description(config: PipelineConfig, manifest: Manifest) -> str:
    """The MLflow run's description (its Overview's first panel), until registration adds the test results."""
    model = config.model.entrypoint or config.model.family
    targets = ", ".join(f"{t.column} ({t.task})" for t in manifest.encoding.targets) or "the model's own loss"
    run = links.current_flow_run()
    where = f" in Prefect flow run [{run['name']}]({run['url']})" if run and run.get("url") else ""
    where = where or (f" in Prefect flow run {run['name']} (`{run['id']}`)" if run else "")
    trains_on, validates_on = training_splits(config.data.split, config.training.fold)
    windows = sum(manifest.windows.get(s, 0) for s in trains_on)
    return (
        f"**{config.name}**: `{model}` trained on {windows:,} windows of "
        f"{manifest.encoding.window} frames from {manifest.source_files} raw file(s), predicting {targets}; "
        f"{config.training.epochs} epoch(s){where}." + kfold_note(config)
    )


def kfold_note(config: PipelineConfig) -> str:
    """What a k-fold run trains and validates on, for its description (empty for other data)."""
    split = config.data.split
    if split.method != "kfold":
        return ""
    trains_on, validates_on = training_splits(split, config.training.fold)
    if config.training.fold is None:
        return (
            f" k-fold: retrained on all {split.folds} non-test folds ({', '.join(trains_on)}); its validation, "
            f"{validates_on[0]}, is one of them (in-sample): the test split measures it."
        )
    return (
        f" k-fold: fold {config.training.fold} of {split.folds}: trained on {', '.join(trains_on)}, "
        f"validated on {validates_on[0]}."
    )


def kfold_tags(config: PipelineConfig) -> dict[str, str]:
    """MLflow tags of a k-fold run: its fold (`all` for the final retrain on every non-test fold)."""
    if config.data.split.method != "kfold":
        return {}
    fold = config.training.fold
    return {
        "shardline.kfold.folds": str(config.data.split.folds),
        "shardline.kfold.fold": "all" if fold is None else str(fold),
    }


def load_manifest(manifest_uri: str, config: PipelineConfig) -> Manifest:
    """Read the manifest and refuse it when its encoding disagrees with the config."""
    text = storage.read_text(manifest_uri)
    manifest = Manifest.model_validate_json(text)
    if edited_encoding(text):  # a scaling or a vocabulary edited after it was written
        raise ValueError(
            f"{manifest_uri}: its encoding is not the one it was written with (its encoding_hash "
            f"{manifest.encoding_hash[:12]}): it was changed after the encode; run the pipeline again and the encode "
            "step writes it anew"
        )
    expected = contract(config.data)
    tok = config.data.tokenizer
    if config.training.init_from and config.data.features.text and (tok is None or tok.file is None):
        # a text fine-tune is tokenized with its parent's tokenizer, whatever data.tokenizer's BPE says: the
        # encode took it from the parent (with_parent_tokenizer) and checked the data set's against it
        expected["tokenizer"] = contract_of(manifest.encoding).get("tokenizer", expected["tokenizer"])
    if manifest.contract_hash != stable_hash(expected):
        diffs = contract_differences(expected, contract_of(manifest.encoding))
        raise ValueError(
            f"the shards in {manifest_uri} were encoded for another config:\n  "
            + "\n  ".join(diffs or ["(the encoding contract hash differs)"])
            + "\nRe-run the pipeline so the encode step writes shards for this config."
        )
    return manifest


def run_training(
    manifest_uri: str,
    config: PipelineConfig,
    folder: str | None = None,
    mlflow_tags: dict[str, str] | None = None,
    parent: Parent | None = None,
    pruning: Pruning | None = None,
) -> TrainResult:
    """Train the configured model on the manifest's shards in `folder` (default: `run_dir`; the pipeline
    passes the one it chose, so a worker with other code writes where the pipeline reads), resuming its
    newest checkpoint; return the best checkpoint and its scores (also written there as `result.json`).
    `mlflow_tags` go on the MLflow run when it is created (a sweep's trial: its parent run, its overrides).
    `parent`: the fine-tune parent the caller resolved (else resolved here, once: the folder and the starting
    weights agree). `pruning`: a sweep's trial reports each epoch to its study, whose pruner may stop it early."""
    from shardline.core.lease import Lease

    log = run_logger()  # the training flow run's, also when the pipeline's train task calls it as a subflow
    manifest = load_manifest(manifest_uri, config)
    parent = parent or resolve_parent(config)  # None without training.init_from
    if parent is not None and manifest.encoding.text is not None:
        from shardline.core.encoding.reuse import check_parent_tokenizer

        # the manifest may come from anywhere (the training flow is its own deployment): a text fine-tune's
        # token ids must be its parent's, which load_manifest cannot tell when data.tokenizer leaves it to it
        check_parent_tokenizer(manifest.encoding, parent_encoding(config, parent), parent.uri)
    folder = folder or run_dir(config, manifest, parent)
    # one writer per run folder, whichever machine (a retry racing a re-dispatch, two laptops, a "Crashed"
    # run that was not dead): the second waits while the first renews its lease, then resumes or attaches
    # the flow run in its record: a dispatcher that sees it silent past its ttl while that run is RUNNING knows
    # the run's machine is gone (train.watch_training_run)
    lease = Lease(
        storage.join(folder, "lease"),
        f"training {folder.rstrip('/').rsplit('/', 1)[-1]}",
        holder={"flow_run": (links.current_flow_run() or {}).get("id")},
    )
    lease.acquire(
        on_wait=lambda who: log.warning(
            "train: %s is being trained by %s; waiting for it, then this run takes its result or resumes it",
            folder,
            who,
        )
    )
    if lease.taken_from:
        log.warning(
            "train: %s was held by %s, which no longer runs on this machine (killed?): taken at once, not waited out",
            folder,
            lease.taken_from.get("owner"),
        )
    try:
        # this attempt's entry in the run's cost ledger (cost.json), and the budget it trains within
        ledger, deadline = training_cost.open_ledger(config, folder, log)
        try:
            return _run_training(
                manifest_uri, manifest, config, folder, parent, lease, ledger, deadline, mlflow_tags, pruning
            )
        except BaseException:
            ledger.end("failed")  # an attempt that ended before fit could say how (an outcome said stays)
            raise
    finally:
        lease.release()


# the built-in families' settings (`builtin_params`): a model of one's own (model.entrypoint) reads none of them
FAMILY_SETTINGS = ("family", "hidden", "layers", "heads", "dropout", "embedding_dim")


def logged_config(config: PipelineConfig) -> dict:
    """The config as the MLflow run's params: without the built-in family's settings for a model of one's own
    (`model.hidden=256` beside `model.params.hidden=16` read as the model's width in the runs table)."""
    dumped = config.model_dump(mode="json")
    if config.model.entrypoint:
        dumped["model"] = {k: v for k, v in dumped["model"].items() if k not in FAMILY_SETTINGS}
    return dumped


def _run_training(
    manifest_uri: str,
    manifest: Manifest,
    config: PipelineConfig,
    folder: str,
    parent: Parent | None,
    lease,
    ledger,
    deadline,
    mlflow_tags=None,
    pruning: Pruning | None = None,
) -> TrainResult:
    from shardline.core.failures import BudgetExceeded, Preempted
    from shardline.trainer.checkpoint import best_checkpoint, checkpoint_step, latest_checkpoint, weights_checksum
    from shardline.trainer.data import open_split
    from shardline.trainer.loop import Callbacks, FitOptions, fit
    from shardline.trainer.models import model_spec_for
    from shardline.trainer.serving import data_spec
    from shardline.trainer.stops import setting_hooks

    log = run_logger()
    every = settings.number("SHARDLINE_PROGRESS_SECONDS")  # the live view's pace: a bad value fails here, not later
    spec = manifest.encoding
    trains_on, validates_on = training_splits(config.data.split, config.training.fold)
    train_data = open_split(manifest, manifest_uri, trains_on)
    val_data = open_split(manifest, manifest_uri, validates_on)
    ckpt_dir = storage.join(folder, "checkpoints")
    # the resolved config (after extends and --set) is stored with what it produced
    storage.write_text(
        storage.join(folder, "config.yaml"), yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
    )

    # one MLflow run per training run, however often it is interrupted: the run folder's journal and
    # `mlflow-run.json` name it, and every call is journaled there before MLflow sees it
    tracker = Tracker(config.mlflow, config.storage.root, run_dir=folder)
    run_id = tracker.start(
        # a sweep's trial by its id (t3) too: MLflow's list of a sweep's runs tells them apart
        run_name="-".join(
            filter(None, [config.name, (mlflow_tags or {}).get(links.TRIAL_TAG), time.strftime("%Y%m%d-%H%M%S")])
        ),
        tags={
            "shardline.config_hash": config.hash(),
            "shardline.data_fingerprint": manifest.data_fingerprint,
            "shardline.code_version": code_version(),
            **kfold_tags(config),
            **(mlflow_tags or {}),
        },
    )
    tracker.log_params(flatten(logged_config(config)))
    # both UIs name each other: the MLflow run the flow run training it (a resumed run: the latest one),
    # the flow run its MLflow run
    tracker.set_tags({**links.mlflow_tags(), "mlflow.note.content": run_description(config, manifest)})
    if run_id:
        links.tag_flow_run([f"mlflow-run:{run_id}"])
    tracker.log_inputs(dataset_inputs(manifest, manifest_uri, config.name))
    previous = latest_checkpoint(ckpt_dir)
    if previous:
        log.info("train: resuming from %s (MLflow run %s)", previous[0], tracker.run_id)
    tracker.set_tags({"shardline.select_by": config.training.select_by})  # what picks the registered epoch
    # a resumed run replays the steps between its checkpoint and the kill: log each step once. Epoch metrics
    # are logged at step = the epoch counted from 1, as the logs count it
    logged_step = tracker.last_step("train/train_loss") if tracker.resumed else -1
    logged_epoch = tracker.last_step("epoch/val_loss") if tracker.resumed else -1

    def on_step(step: int, metrics: dict) -> None:
        lease.check()  # another process took the folder over (this one stalled past its lease): stop writing
        training_cost.progress(tracker, ledger, step, log)
        if step <= logged_step:
            return
        tracker.log_metrics({f"train/{k}": v for k, v in metrics.items()}, step)

    starved = DataWaitWatch(config.training.batch_size, config.training.num_workers)

    def on_epoch(epoch: int, metrics: dict) -> None:
        if (warning := starved.epoch(metrics.get("data_wait_fraction"))) is not None:
            log.warning(warning)  # once a run: the loader, not the model, sets the pace
        if epoch + 1 <= logged_epoch:
            return
        tracker.log_metrics({f"epoch/{k}": v for k, v in metrics.items()}, epoch + 1)

    mspec = model_spec_for(config.model, data_spec(spec))
    if parent is not None:
        tracker.set_tags({"shardline.parent": json.dumps(parent.identity())})
    # the machine while it trains: MLflow's System metrics tab (a resumed run continues the samples)
    system = SystemSampler(tracker, first_step=tracker.last_step(CPU_KEY) + 1 if tracker.resumed else 0).start()
    view = LiveView(log)  # the progress bar and the live table, sent from a thread of their own
    bar = TerminalProgress()  # a bar on the terminal, when this process has one (a local run)
    shown = {"at": -math.inf}

    def on_checkpoint(uri: str, age: float) -> None:
        tracker.save_journal()  # the journal's copy beside each checkpoint holds every step up to it
        # a later attempt may resume from here: time up to when its state was taken is useful
        ledger.checkpoint(checkpoint_step(uri), age)

    def on_progress(progress: dict) -> None:
        bar.show(progress)
        # the terminal's bar is fed more often than the Prefect view needs: that one keeps its own pace,
        # plus each epoch's end (its validation) and the last step
        now, epoch_end = time.monotonic(), progress.get("validated_epoch") == progress["epoch"]
        if now - shown["at"] >= every or epoch_end or progress["step"] >= progress["total_steps"]:
            view.show(progress)
            shown["at"] = now
        # written every SHARDLINE_COST_LEDGER_SECONDS (time after a checkpoint); the first step's, after an interruption
        training_cost.progress(tracker, ledger, progress["step"], log)

    c = config.compute
    if c.processes_per_node * c.nodes > 1 or c.train_on == "launcher":  # DDP: the same body under torchrun
        from shardline.launch.torchrun import fit_in_processes

        # the splits stay open here: their shards are in the local cache before the ranks open them
        body = partial(
            fit_in_processes,
            c,
            manifest_uri,
            list(trains_on),
            list(validates_on),
            shared=storage.join(folder, "ddp"),  # several machines: the job, rank 0's events and result
            run_id=folder.rstrip("/").rsplit("/", 1)[-1],
        )
    else:
        body = partial(fit, train_data, val_data)

    def said(text: str) -> None:  # the trainer's own warnings ("warning: ...") at the log's warning level
        (log.warning if text.startswith("warning: ") else log.info)(text.removeprefix("warning: "))

    callbacks = Callbacks(said, on_step, on_epoch, on_checkpoint, on_progress, **setting_hooks(log.info))
    if pruning is not None:  # a sweep's trial: each epoch reported to its study, whose pruner may stop it
        callbacks = dataclasses.replace(callbacks, prune=pruning.callback(log.info))
    options = FitOptions(
        run_meta={"mlflow_run_id": run_id, "config_hash": config.hash(), "manifest": manifest_uri},
        step_every=None,  # about STEP_POINTS points a run, every step of a short one
        progress_seconds=min(every, BAR_SECONDS) if bar.on else every,
        # a resumed run has its weights; only a fresh one reads the parent's
        init_weights=init_weights(config, parent) if parent and not previous else None,
        init_source=config.training.init_from or "",
        deadline=deadline,
        # ranking data: the validation split's groups ranked each epoch (val_ndcg_at_10, ...)
        ranking=SplitRanking.of_validation(manifest, manifest_uri, validates_on, config.evaluation.k),
    )
    from shardline.trainer.stops import kept_while_starting  # (torch: not imported with the pipeline)

    try:
        task = spec.target.task if spec.target else None
        result = body(mspec, config.training, task, ckpt_dir, callbacks, options)
    # each ending below is written whole: a Ctrl-C while it is (a second one, a moment after the first) waits for it
    # (it left the MLflow run RUNNING, with no end in its journal for `shardline sync`)
    except Preempted as stopped:
        with kept_while_starting(signal.SIGINT):
            training_cost.close_cost(tracker, ledger, "preempted", checkpoint_step(stopped.checkpoint), log)
            # resumed later into the same run, which sends what is left: a spot notice leaves no time to wait
            tracker.end("KILLED", wait=min(5.0, tracker.flush_s))
        raise
    except BudgetExceeded as stopped:
        with kept_while_starting(signal.SIGINT):
            at = checkpoint_step(stopped.checkpoint) if stopped.checkpoint else None
            training_cost.close_cost(tracker, ledger, "budget", at, log)
            tracker.end("KILLED")  # resumed into the same run when the limit is raised
        raise
    # a second Ctrl-C stops at once, past the checkpoint: an interruption, as a kill is; so is an exit asked from
    # outside (the Prefect worker that ran this one killed: "Execution was aborted by Python system exit call")
    except (KeyboardInterrupt, SystemExit):
        with kept_while_starting(signal.SIGINT):
            training_cost.close_cost(tracker, ledger, "killed", None, log)
            tracker.end("KILLED", wait=min(5.0, tracker.flush_s))
        raise
    except BaseException:
        with kept_while_starting(signal.SIGINT):
            training_cost.close_cost(tracker, ledger, "failed", None, log)
            tracker.end("FAILED")
        raise
    finally:  # streamed shards still held go back to the cache now, not when the splits are collected
        system.stop()
        train_data.release()
        val_data.release()
        view.close()
        bar.close()
    init = result.run_meta.get("init_from")
    if init and not tracker.resumed:
        tracker.log_dict(init, "init_from.json")  # which tensors were loaded, which are new, which skipped
        tracker.set_tags({f"shardline.init_from.{k}": str(len(init[k])) for k in ("loaded", "new", "skipped")})
    if result.best_epoch is not None:
        tracker.log_metrics({"best_epoch": result.best_epoch}, result.steps)
    if result.pruned_epoch is not None:  # ended early by the sweep's pruner: said on both runs
        tracker.set_tags({PRUNED_TAG: str(result.pruned_epoch)})
        links.tag_flow_run(["pruned"])
    elif tracker.resumed:  # a pruned run trained on to its end (without the pruner): pruned no more
        tracker.set_tags({PRUNED_TAG: None})
    cost = training_cost.close_cost(tracker, ledger, "finished", result.steps, log)
    tracker.end("FINISHED")
    best = best_checkpoint(ckpt_dir)
    best_entry = next((h for h in result.history if h["epoch"] + 1 == result.best_epoch), {})
    out = TrainResult(
        best_sha256=best[1]["sha256"] if best else None,
        weights_sha256=weights_checksum(best[0]) if best else None,
        parent=parent,
        run_dir=folder,
        best_checkpoint=result.best_checkpoint,
        last_checkpoint=result.last_checkpoint,
        best_epoch=result.best_epoch,
        select_by=result.select_by,
        best_score=result.best_score,
        best_val_loss=best_entry.get("val_loss"),
        history=result.history,
        steps=result.steps,
        device=result.device,
        precision=result.precision,
        resumed_from=result.resumed_from,
        mlflow_run_id=tracker.run_id,
        tracking_uri=redact_text(tracker.uri),
        host=socket.gethostname(),
        flow_run_id=(links.current_flow_run() or {}).get("id"),
        cost=cost,
        pruned_epoch=result.pruned_epoch,
    )
    storage.write_text(storage.join(folder, RESULT_FILE), out.model_dump_json(indent=1))
    return out
