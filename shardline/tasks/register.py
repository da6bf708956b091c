"""Register: log the model (raw rows in, encoding inside) to MLflow and move `champion` only on merit."""

from __future__ import annotations

import json
import logging
import math
import tempfile
import warnings
from pathlib import Path

import yaml
from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.logging import get_run_logger

from shardline.core import layout, storage
from shardline.core.config import PipelineConfig, metric_key, stable_hash
from shardline.core.cost.ledger import PREEMPTION_KEYS
from shardline.core.lease import Lease
from shardline.core.manifest import Manifest, Snapshot
from shardline.core.metrics import report as R
from shardline.core.secrets import redact_text, redacted_errors
from shardline.core.tracking.tracker import (
    fluent_tracking_uri,
    mlflow_client_defaults,
    model_version_page,
    run_page,
    sync_run,
    tracking_uri,
    ui_command,
    unreachable_tracking,
)
from shardline.core.version import code_version, user_code_version
from shardline.runs import links, model_files
from shardline.runs.gate import (
    PREDICTS_TAG,
    TEST_SPLIT_TAG,
    TOKENIZER_TAG,
    better,
    champion_gate,
    compare_with_champion,
    predicts,
    test_split_id,
)
from shardline.runs.model_code import PYFUNC_CODE, code_paths, requirements
from shardline.runs.result import EvalResult, Registered, TrainResult
from shardline.runs.training_run import is_fresh_run, kfold_note, model_identity, training_identity
from shardline.tasks.caching import CacheRule
from shardline.tasks.ingest import SAMPLE_ROWS, raw_sample
from shardline.trainer.serving import (
    bundle_dict,
    example_outputs,
    input_columns,
    kept_notes,
    key_columns,
    optional_columns,
    prediction_frame,
)
from shardline.trainer.serving_text import GENERATION_PARAMS, text_prediction_frame

logger = logging.getLogger("shardline.register")


def _signature(spec, sample_uri: str, types: dict | None = None, source: str = ""):
    """Input schema: the raw columns the model needs (the target is not one); output: keys + prediction. `types`
    gets each input column's polars type (from the same read of the sample)."""
    import numpy as np
    from mlflow.models import infer_signature

    # MLflow predicts with the input example as it logs the model: an example the model refuses put an error
    # message in the middle of every registration's output
    if spec.text is not None:  # per row: its keys, prompt length, next token, probability and generated text
        # a few rows (each a generation), with text in every text column: the model refuses empty ones (as
        # training left them out)
        sample = raw_sample(sample_uri, input_columns(spec), rows=SAMPLE_ROWS, types=types, source=source)
        has_text = np.logical_and.reduce(
            [sample[c].map(lambda v: isinstance(v, str) and v != "").to_numpy(bool) for c in spec.text.columns]
        )
        sample = (sample[has_text] if has_text.any() else sample).head(3).reset_index(drop=True)
        keys = {c: sample[c].iloc[:1].to_numpy() for c in spec.id_columns} or {"row": np.zeros(1, np.int64)}
        columns = {"prompt_tokens": [1], "next_token": ["a"], "probability": [1.0], "generated": ["a"]}
        out, params = text_prediction_frame(keys, columns), GENERATION_PARAMS
    else:  # enough rows of one sequence for a window (five gave "0 predictions")
        rows, need = max(5, 4 * (spec.window + spec.horizon)), spec.window + spec.horizon
        sample = example_rows(
            raw_sample(sample_uri, input_columns(spec), SAMPLE_ROWS, types, source), spec.sequence_key, need, rows
        )
        keys = {k: np.zeros(1, np.int64) if k == "row" else sample[k].iloc[:1].to_numpy() for k in key_columns(spec)}
        out, params = prediction_frame(spec, keys, example_outputs(spec)), None
    integers = {c for c, t in (types or {}).items() if t.startswith(("Int", "UInt")) and c in sample}
    sample = model_files.integer_example(sample, integers)
    # the integer-columns hint: nulls in the id columns are the user's, in the others handled by the encoding
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        signature = infer_signature(sample, out.to_pandas(), params=params)
        return model_files.widened_signature(signature, optional_columns(spec), integers), sample


def example_rows(sample, key: str | None, need: int, rows: int):
    """The input example: the sample's first `rows` rows, or where no sequence has `need` rows among them (a file
    of interleaved sequences, a click log's users), the rows of the first sequence that has them."""
    head = sample.head(rows)
    if key not in sample.columns or (head[key].value_counts() >= need).any():
        return head
    sizes = sample.groupby(key, sort=False).size()
    whole = sizes.index[sizes >= need]
    return sample[sample[key] == whole[0]].head(rows).reset_index(drop=True) if len(whole) else head


def text_artifacts(manifest: Manifest, manifest_uri: str, tmp: Path) -> dict[str, str]:
    """Text data: the tokenizer the shards were encoded with (beside the manifest, checked against the
    encoding's sha256), bundled with the model so that it tokenizes raw text anywhere; {} for other data."""
    if manifest.encoding.text is None:
        return {}
    import hashlib

    text = storage.read_text(storage.resolve(manifest_uri.rsplit("/", 1)[0], manifest.tokenizer or "tokenizer.json"))
    if hashlib.sha256(text.encode()).hexdigest() != manifest.encoding.text.tokenizer_sha256:
        raise ValueError(
            f"the tokenizer beside {manifest_uri} is not the one its shards were encoded with; encode again"
        )
    (tmp / "tokenizer.json").write_bytes(text.encode())  # its bytes as hashed: no newline translation
    return {"tokenizer": str(tmp / "tokenizer.json")}


def registration_identity(config: PipelineConfig, manifest: Manifest, train_result: TrainResult) -> str:
    """What a registered version is: its weights (their checksum, not the checkpoint file's), the data they were
    trained and tested on, and the settings that decide training. Where or how fast it trained (`compute.*`,
    `num_workers`, checkpoint cadence, device) is not part of it: changing only those registers no new version, nor
    does a retraining after an edit of Shardline's training code that ends on the same weights. `--force train` asks
    for a training of its own (a fresh folder): its version is its own, keyed by its checkpoint file."""
    fresh = is_fresh_run(train_result.run_dir)
    return stable_hash(
        {
            "weights": train_result.best_sha256 if fresh else train_result.weights_sha256 or train_result.best_sha256,
            "data": manifest.data_fingerprint,
            "encoding": manifest.encoding_hash,
            "model": model_identity(config.model),
            "training": training_identity(config, train_result.parent),
        }
    )[:24]


def cost_tags(cost: dict | None) -> dict[str, str]:
    """A version's cost tags, for reading: GPU-hours and USD of every attempt of its training run, and what its
    preemptions cost (the run's `cost/*` metrics hold the full floats; the figures are an estimate)."""
    if not cost:
        return {}
    tags = {"shardline.cost.gpu_hours": R.format_number(cost["gpu_hours"]), "shardline.cost.gpu": cost["gpu"]}
    if cost.get("usd") is not None:
        tags["shardline.cost.usd"] = R.format_number(cost["usd"])
    if cost.get("preemptions"):  # what its preemptions cost, summed: steps, GPU-seconds redone, seconds to recover
        for k in ("preemptions", *PREEMPTION_KEYS):  # counts as they are, seconds for reading
            tags[f"shardline.cost.{k}"] = str(cost[k]) if isinstance(cost[k], int) else R.format_number(cost[k])
    return tags


def existing_version(client, name: str, identity: str):
    """The version of `name` already registered with this identity, or None."""
    from mlflow.exceptions import MlflowException

    try:
        versions = client.search_model_versions(f"name='{name}'")
    except MlflowException:
        return None
    return next((v for v in versions if v.tags.get(IDENTITY_TAG) == identity), None)


IDENTITY_TAG = "shardline.model_identity"


def register_model(
    config: PipelineConfig, snapshot: Snapshot, manifest_uri: str, train_result: TrainResult, eval_result: EvalResult
) -> Registered:
    """Register under the registry lease of this model name (in the storage root): two pipelines
    registering at once decide one after the other, each on a fresh read of the champion."""
    name = config.mlflow.model_name
    lock = Lease(layout.registry_lock(config.storage.root, name), f"registering {name}")
    lock.acquire(on_wait=lambda who: logger.warning("register: waiting for %s", who))
    try:
        return _register_model(config, snapshot, manifest_uri, train_result, eval_result, lock)
    except Exception as e:
        if (said := unreachable_tracking(tracking_uri(config.mlflow, config.storage.root), "registration")) is not None:
            raise said from e
        raise
    finally:
        lock.release()


def _who() -> str:
    """Who moves an alias: the Prefect flow run (name and id) and user@host."""
    import getpass
    import socket

    try:
        from prefect.runtime import flow_run

        run = f"flow run {flow_run.name} ({flow_run.id})" if flow_run.id else "no flow run"
    except Exception:  # noqa: BLE001 - outside a flow
        run = "no flow run"
    return f"shardline register, {run}, {getpass.getuser()}@{socket.gethostname()}"


def _register_model(
    config: PipelineConfig,
    snapshot: Snapshot,
    manifest_uri: str,
    train_result: TrainResult,
    eval_result: EvalResult,
    lock: Lease,
) -> Registered:
    from mlflow import MlflowClient

    manifest = Manifest.model_validate_json(storage.read_text(manifest_uri))
    uri = tracking_uri(config.mlflow, config.storage.root)
    mlflow_client_defaults(uri)
    client = MlflowClient(uri)
    # what training left in its journal (MLflow was away when it ended) is sent first: its run, metrics, status
    synced = sync_run(train_result.run_dir, uri, missing_ok=True) if train_result.run_dir else None
    run_id = train_result.mlflow_run_id or (synced.run_id if synced else None)
    if run_id is None:
        raise RuntimeError(f"the training run {train_result.run_dir} has no MLflow run to register from")
    metric_name = config.mlflow.promotion_metric
    if metric_name not in eval_result.metrics:
        raise ValueError(
            f"mlflow.promotion_metric='{metric_name}' is not among the evaluation's metrics "
            f"{sorted(eval_result.metrics)}; name one of them"
        )
    identity = registration_identity(config, manifest, train_result)
    same = existing_version(client, config.mlflow.model_name, identity)
    if same is None:
        version = _log_and_register(
            config, manifest, manifest_uri, snapshot, train_result, eval_result, client, uri, run_id, identity
        )
    elif "shardline.gate" in (same.tags or {}):  # the same model, registered before (only where or how fast it trained)
        # no warning (an upgrade of Shardline, a move to another pool: nothing is wrong): `register` says it at INFO
        aliases = list(client.get_model_version(config.mlflow.model_name, same.version).aliases or [])
        return _registered(
            client,
            uri,
            config,
            same.version,
            same.run_id,
            alias=aliases[0] if aliases else "none",
            previous_champion=None,
            value=float(eval_result.metrics[metric_name]),
            already_registered=True,
        )
    else:  # registered by a run killed before its gate decided (after register_model, before the alias): gated now
        logger.warning(
            "register: %s version %s is this model, registered by a run that stopped before the champion gate "
            "decided: gating it now",
            config.mlflow.model_name,
            same.version,
        )
        version, run_id = str(same.version), same.run_id
    return _gate(
        config, manifest, manifest_uri, snapshot, train_result, eval_result, client, uri, version, run_id, lock
    )


def _log_and_register(
    config: PipelineConfig,
    manifest: Manifest,
    manifest_uri: str,
    snapshot: Snapshot,
    train_result: TrainResult,
    eval_result: EvalResult,
    client,
    uri: str,
    run_id: str,
    identity: str,
) -> str:
    """Log the raw-rows model on the training's MLflow run, with its metrics, evaluation files and lineage, and
    register it: the new version."""
    import mlflow
    import torch

    from shardline.trainer.checkpoint import load_checkpoint

    spec = manifest.encoding
    tags = {
        IDENTITY_TAG: identity,
        "shardline.data_fingerprint": manifest.data_fingerprint,
        "shardline.config_hash": config.hash(),
        "shardline.code_version": code_version(),
        "shardline.encoding_hash": manifest.encoding_hash,
        **({TOKENIZER_TAG: spec.text.tokenizer_sha256} if spec.text is not None else {}),
        PREDICTS_TAG: predicts(spec),
        TEST_SPLIT_TAG: test_split_id(manifest),
    }
    parent = train_result.parent
    if parent:  # fine-tuned from another model: its lineage
        tags["shardline.parent"] = parent.uri
        for key in ("name", "version", "run_id", "checkpoint"):
            if getattr(parent, key):
                tags[f"shardline.parent_{key}"] = str(getattr(parent, key))
    if config.model.entrypoint:
        tags["shardline.model_entrypoint"] = config.model.entrypoint
        tags["shardline.model_code_version"] = user_code_version(config.model.entrypoint, config.model.code_dir)
    held = _held_model(client, run_id, identity)
    if held is not None:  # this model, registered under another name (a second config on the same training)
        logger.info("register: the model %s version %s holds is registered as it is", held.name, held.version)
        with fluent_tracking_uri(uri):
            version = mlflow.register_model(
                held.source,
                config.mlflow.model_name,
                tags={**tags, model_files.FILES_TAG: held.tags[model_files.FILES_TAG]},
            )
        return version.version
    _drop_unregistered(client, run_id, identity)
    ckpt = load_checkpoint(train_result.best_checkpoint)
    with fluent_tracking_uri(uri), tempfile.TemporaryDirectory(prefix="shardline-register-") as tmp:
        tmp = Path(tmp)
        torch.save(ckpt["model"], tmp / "weights.pt")
        # each input column's type in training: the model casts wider numbers back to it (a float32 category's
        # values match as they were trained; an integer column with a null, float in pandas, reads as integers)
        types: dict[str, str] = {}
        signature, sample = _signature(spec, snapshot.files[0].uri, types, snapshot.source)
        extra = {"tags": tags, "input_types": types}
        (tmp / "bundle.json").write_text(json.dumps(bundle_dict(spec, ckpt["model_spec"], extra), indent=1))
        (tmp / "config.yaml").write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
        (tmp / "manifest.json").write_text(manifest.model_dump_json(indent=1))
        # MLflow loads the model to check its input example as it logs it: its code folders go last on sys.path
        have = client.get_run(run_id).data.metrics  # a registration interrupted after them logged them twice
        with mlflow.start_run(run_id=run_id), model_files.code_paths_last():
            # each baseline beside the metric it is the baseline of (one chart section, adjacent names)
            for suffix, values in (("", eval_result.metrics), ("_baseline", eval_result.baseline)):
                named = {f"test/{metric_key(k)}{suffix}": v for k, v in values.items()}
                mlflow.log_metrics({k: v for k, v in named.items() if have.get(k) != v})
            mlflow.set_tags({**tags, **links.mlflow_tags("shardline.prefect.register")})
            for f in eval_result.files:  # local files, or the storage root's copies (a remote root)
                if storage.is_remote(f):
                    (tmp / "evaluation").mkdir(exist_ok=True)
                    local = tmp / "evaluation" / f.rsplit("/", 1)[-1]
                    local.write_bytes(storage.read_bytes(f))
                    f = str(local)
                mlflow.log_artifact(f, artifact_path="evaluation")
            mlflow.log_artifact(str(tmp / "config.yaml"))
            mlflow.log_artifact(str(tmp / "manifest.json"))
            if snapshot.rejected:
                mlflow.log_dict({"skipped_files": [r.model_dump() for r in snapshot.rejected]}, "skipped_files.json")
            with kept_notes():  # MLflow predicts the input example: not the user's rows
                info = mlflow.pyfunc.log_model(
                    name="model",
                    python_model=str(PYFUNC_CODE),
                    artifacts={"weights": str(tmp / "weights.pt"), "bundle": str(tmp / "bundle.json")}
                    | text_artifacts(manifest, manifest_uri, tmp),
                    signature=signature,
                    input_example=sample,
                    pip_requirements=requirements(config.model),
                    code_paths=code_paths(config, tmp / "code"),
                    tags=tags,
                )
            # every file of the model, by sha256: the list in the run, its own sha256 on the version (MLflow's
            # database), checked before the model is loaded again (runs/model_files.py)
            listing, files_sha256 = model_files.record(info.model_uri)
            mlflow.log_text(model_files.list_bytes(listing).decode(), model_files.FILES_ARTIFACT)
        version = mlflow.register_model(
            info.model_uri, config.mlflow.model_name, tags={**tags, model_files.FILES_TAG: files_sha256}
        )
    return version.version


def _held_model(client, run_id: str, identity: str):
    """A version, of any name, that holds the model this run logged for this identity (with its file list's
    checksum), or None. The run keeps one file list (`model-files.json`): a model logged again would replace the
    list that version's loading checks."""
    from mlflow.exceptions import MlflowException

    try:
        versions = client.search_model_versions(f"run_id = '{run_id}'")
    except MlflowException:
        return None
    tagged = lambda v: (v.tags or {}).get(IDENTITY_TAG) == identity and (v.tags or {}).get(model_files.FILES_TAG)
    return next((v for v in versions if tagged(v)), None)


def _drop_unregistered(client, run_id: str, identity: str) -> None:
    """A model this run logged for this identity that no version holds (a registration killed between `log_model`
    and `register_model`) is deleted before it is logged again: the run keeps one model per registration."""
    run = client.get_run(run_id)
    found = client.search_logged_models([run.info.experiment_id], filter_string=f"tags.`{IDENTITY_TAG}` = '{identity}'")
    for model in found:
        if model.source_run_id == run_id:
            logger.warning(
                "register: run %s holds model %s, logged by a registration that stopped before it registered a "
                "version: deleted, logged again",
                run_id,
                model.model_id,
            )
            client.delete_logged_model(model.model_id)


def _gate(
    config: PipelineConfig,
    manifest: Manifest,
    manifest_uri: str,
    snapshot: Snapshot,
    train_result: TrainResult,
    eval_result: EvalResult,
    client,
    uri: str,
    version: str,
    run_id: str,
    lock: Lease,
) -> Registered:
    """The champion gate on registered `version`: compare it with the champion (re-scored on this test split when
    it was tested on other data), record the decision on the version, move the alias. The registry lease `lock` is
    renewed right before the alias moves: a registration that lost it (it stalled past the lease and another took
    it) stops there, with `LeaseLost`, and moves nothing."""
    name = config.mlflow.model_name
    metric_name = config.mlflow.promotion_metric
    new_value = float(eval_result.metrics[metric_name])
    for k, v in eval_result.metrics.items():  # for reading: the gate reads the run's full-precision metric
        client.set_model_version_tag(name, version, f"metric.{metric_key(k)}", R.format_number(v))
    for k, v in cost_tags(train_result.cost).items():  # what training it cost, for reading (an estimate)
        client.set_model_version_tag(name, version, k, v)
    promote, previous = champion_gate(client, name, metric_name, config.mlflow.promotion_direction, new_value)
    compared = compare_with_champion(
        previous, manifest, manifest_uri, snapshot, eval_result.files, name, metric_name, new_value, uri
    )
    if "reason" in compared:
        promote = False
        logger.warning(
            "register: champion v%s and this version cannot be compared (%s): it stays champion; the new version "
            "is a challenger (to promote it anyway: MlflowClient(%r).set_registered_model_alias(%r, 'champion', %s))",
            previous["version"],
            compared["reason"],
            redact_text(uri),
            name,
            version,
        )
    elif "champion_value" in compared:
        promote = better(compared["candidate_value"], compared["champion_value"], config.mlflow.promotion_direction)
    floor = eval_result.baseline.get(metric_name) if previous is None else None
    if floor is not None and not better(new_value, float(floor), config.mlflow.promotion_direction):
        promote = False  # no champion yet: the first is one that beats the trivial baseline
        compared = {"baseline_value": float(floor), "on": "the test split's baseline"}
        logger.warning(
            "register: v%s does not beat the baseline on test %s (%s against %s): it is a challenger and %s has no "
            "champion yet (to promote it anyway: MlflowClient(%r).set_registered_model_alias(%r, 'champion', %s))",
            version,
            metric_name,
            R.format_number(new_value),
            R.format_number(float(floor)),
            name,
            redact_text(uri),
            name,
            version,
        )
    alias = "champion" if promote else "challenger"
    describe(client, name, version, run_id, config, train_result, eval_result, alias, previous, compared, uri)
    import datetime as dt

    record = {
        "at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "by": _who(),
        "version": str(version),
        "metric": metric_name,
        "direction": config.mlflow.promotion_direction,
        "value": new_value,
        "data_fingerprint": manifest.data_fingerprint,
        "test_split": test_split_id(manifest),
        "champion": previous,
        "compared": compared,
        "decision": alias,
    }
    lock.renew()  # raises LeaseLost when another registration took the lease: this one decides nothing
    # what the gate compared, on the version; an alias move also on the version it moved from
    client.set_model_version_tag(name, version, "shardline.gate", json.dumps(record))
    client.set_registered_model_alias(name, alias, version)
    if promote:
        client.set_model_version_tag(name, version, "shardline.alias.champion.from", json.dumps(record))
        if previous:
            client.set_model_version_tag(
                name,
                previous["version"],
                "shardline.alias.champion.to",
                json.dumps({"at": record["at"], "by": record["by"], "version": str(version)}),
            )
    fields = {"previous_champion": previous, "value": new_value, "compared": compared}
    return _registered(client, uri, config, version, run_id, alias=alias, **fields)


def _registered(client, uri: str, config: PipelineConfig, version, run_id: str, **fields) -> Registered:
    """The task's result for `version`, with where a user sees it in the MLflow UI: the run's and the version's
    pages, and for a store no server serves (SQLite) the command that serves it at the pages' address."""
    name = config.mlflow.model_name
    try:
        experiment = client.get_run(run_id).info.experiment_id
        pages = {
            "run_page": run_page(uri, experiment, run_id),
            "version_page": model_version_page(uri, name, version),
            "ui_command": ui_command(uri),
        }
    except Exception:  # noqa: BLE001 - an address, not a result
        pages = {}
    return Registered(
        **pages,
        model_name=name,
        version=int(version),
        model_uri=f"models:/{name}/{version}",
        run_id=run_id,
        tracking_uri=redact_text(uri),
        promotion_metric=config.mlflow.promotion_metric,
        **fields,
    )


def _num(value) -> str:
    return "n/a" if value is None else R.format_number(value)


def describe(client, name, version, run_id, config, train_result, eval_result, alias, previous, compared, uri) -> None:
    """The version's description (the registry's first panel), the registered model's when it has none,
    and the run's (its Overview), in words: what was trained on what, its test results beside the
    baseline's, which checkpoint, and what the gate decided. A description is never worth a failed run."""
    metric = config.mlflow.promotion_metric
    metrics, baseline = eval_result.metrics, eval_result.baseline
    scores = ", ".join(
        f"{k} **{_num(v)}**" + (f" (baseline {_num(baseline[k])})" if k in baseline else "") for k, v in metrics.items()
    )
    epochs = len(train_result.history)
    best = train_result.best_epoch
    chosen = f"the checkpoint of epoch {best} of {epochs}" if best else "the best checkpoint"
    if train_result.select_by:
        chosen += f", selected by training.select_by={train_result.select_by}"
    verdict = gate_verdict(alias, previous, compared, metric, metrics.get(metric))
    text = (
        f"{config.name}: `{config.model.entrypoint or config.model.family}` on {eval_result.test_windows:,} "
        f"test windows: {scores}. Evaluated {chosen}; {train_result.steps:,} steps on "
        f"{train_result.device}. @{alias}, by test {metric}: {verdict}." + kfold_note(config)
    )
    try:
        client.update_model_version(name, str(version), description=text)
        if not client.get_registered_model(name).description:
            client.update_registered_model(
                name,
                description=f"Trained by Shardline from config '{config.name}'; @champion moves only when a new "
                f"version beats it on test {metric} ({config.mlflow.promotion_direction}).",
            )
        client.set_tag(
            run_id,
            "mlflow.note.content",
            f"{text}\n\nRegistered as [{name} v{version}]({model_version_page(uri, name, version)}).",
        )
    except Exception as e:  # noqa: BLE001 - words about a result, not the result
        logger.warning("register: could not write the descriptions: %s", e)


def _readable(*values: float | None) -> list[str]:
    """Values for reading (4 significant digits), with more digits where those would read the same for
    values that differ (a decision between 0.15242 and 0.15244 is not shown as one between equals)."""
    for digits in range(R.READING_DIGITS, 18):
        texts = [R.format_number(v, digits) for v in values]
        if len(set(texts)) == len(set(values)):
            break
    return texts


def _verdict(reg: Registered) -> str:
    """What became of the version, with the numbers the gate compared."""
    if reg.already_registered:
        return f"already registered (the same weights, data and training settings), @{reg.alias}"
    return gate_verdict(reg.alias, reg.previous_champion, reg.compared, reg.promotion_metric, reg.value)


def gate_verdict(alias: str, prev: dict | None, compared: dict | None, metric: str, value: float | None) -> str:
    """What the gate decided, with the numbers it compared (the champion re-scored on this test split where it
    was tested on other data: its recorded number was not compared), in markdown."""
    if prev is None:
        if compared and "baseline_value" in compared:
            new_text, old_text = _readable(value, compared["baseline_value"])
            return f"kept as **challenger**: {metric} {new_text} does not beat the baseline's {old_text} (no champion)"
        return "the first **champion**"
    champion = f"champion v{prev['version']}"
    compared = compared or {}
    if "reason" in compared:
        return f"kept as **challenger**: {champion} and it cannot be compared ({compared['reason']})"
    rescored = "champion_value" in compared  # the champion was tested on other data: both scored on this test split
    new, old = (compared["candidate_value"], compared["champion_value"]) if rescored else (value, prev["value"])
    if old is None:
        return f"@{alias} ({champion} has no {metric})"
    new_text, old_text = _readable(new, old)
    # where both were scored: which rows (the candidate's figure here is on those rows: on a part of a large test
    # split, not the figure of its own evaluation), and how many
    rows = f" ({compared['rows']:,} rows)" if rescored and compared.get("rows") else ""
    on = f", both scored on {compared.get('on', 'this test split')}{rows}" if rescored else ""
    if alias == "champion":
        return f"promoted to **champion**: {metric} {new_text} (previous {champion}: {old_text}){on}"
    if new == old:
        return f"tied with {champion} at {old_text}{on}: kept as **challenger** (a tie keeps the champion)"
    return f"kept as **challenger**: {champion} has {metric} {old_text}, this version {new_text}{on}"


def _evaluated_epoch(train_result: TrainResult) -> str | None:
    """Which checkpoint was evaluated, and why. A train result from before training named its selection (no
    `best_epoch`) kept the checkpoint of the lowest validation loss: the epoch is read from its history."""
    history = train_result.history
    epochs = len(history)
    if train_result.best_epoch is not None:
        score = train_result.best_score
        return (
            f"evaluated the checkpoint of epoch {train_result.best_epoch} of {epochs}, selected by "
            f"training.select_by={train_result.select_by} "
            f"({R.format_number(score) + ', ' if score is not None else ''}best of {epochs} epochs)"
        )
    losses = [(e.get("val_loss"), i) for i, e in enumerate(history)]
    finite = [(v, i) for v, i in losses if v is not None and math.isfinite(v)]
    if not finite:
        return None
    index = min(finite)[1]  # the first of equal losses, as training keeps it
    epoch = history[index].get("epoch", index) + 1  # the history counts epochs from 0
    return f"evaluated the checkpoint with the lowest validation loss (epoch {epoch} of {epochs})"


def model_report(reg: Registered, train_result: TrainResult, eval_result: EvalResult, snapshot: Snapshot) -> str:
    """The `model-report` artifact: a heading with the verdict, the metrics against the baseline, a few facts
    (one line each, so a line can change on its own); numbers rounded for reading."""
    run, model = f"MLflow run `{reg.run_id}`", f"model `{reg.model_uri}`"
    if reg.run_page:  # links into the MLflow UI; a SQLite store: the command that serves them
        run, model = f"[{run}]({reg.run_page})", f"[{model}]({reg.version_page})"
    served = f" (open with `{reg.ui_command}`)" if reg.ui_command else ""
    facts = [
        f"{run} at `{reg.tracking_uri}`{served}",
        model,
        f"trained on {train_result.device} ({train_result.precision}), {train_result.steps} steps",
        _evaluated_epoch(train_result),
    ]
    text = f"## {reg.model_name} v{reg.version}: {_verdict(reg)}\n\n{eval_result.table}\n\n"
    text += "\n".join(f"- {fact}" for fact in facts if fact)
    if snapshot.rejected:
        text += "\n\nSkipped raw files:\n" + "\n".join(f"- skipped `{r.uri}`: {r.reason}" for r in snapshot.rejected)
    return redact_text(text)


@task(name="register")
@redacted_errors
def register(
    config: PipelineConfig, snapshot: Snapshot, manifest_uri: str, train_result: TrainResult, eval_result: EvalResult
) -> Registered:
    """Log the raw-rows model with its metrics and plots; register a version; move the champion alias on merit."""
    reg = register_model(config, snapshot, manifest_uri, train_result, eval_result)
    create_markdown_artifact(
        key="model-report",
        markdown=model_report(reg, train_result, eval_result, snapshot),
        description="metrics against the baseline and the registered model version",
    )
    # why, in the log too (it said only "v3 -> challenger"; the numbers were in the report and the description)
    get_run_logger().info(
        "register: %s v%s -> %s: %s", reg.model_name, reg.version, reg.alias, _verdict(reg).replace("**", "")
    )
    return reg


def version_exists(reg: Registered, inputs: dict) -> bool:
    """A cached registration still stands: its model version is in the registry, from the same run."""
    from mlflow import MlflowClient

    try:
        uri = tracking_uri(inputs["config"].mlflow, inputs["config"].storage.root)
        version = MlflowClient(uri).get_model_version(reg.model_name, str(reg.version))
    except Exception:  # noqa: BLE001 - any registry error: the cached version cannot be trusted
        return False
    return version.run_id == reg.run_id


def with_alias_now(reg: Registered, config: PipelineConfig) -> Registered:
    """A cached registration with the alias its version holds now: a later version (or a teammate) may have moved
    `champion` or `challenger` away since, and the summary and its `predict` command name the alias."""
    from mlflow import MlflowClient

    try:
        uri = tracking_uri(config.mlflow, config.storage.root)
        aliases = list(MlflowClient(uri).get_model_version(reg.model_name, str(reg.version)).aliases or [])
    except Exception:  # noqa: BLE001 - the registry answered `version_exists` a moment ago; else say what was cached
        return reg
    return reg.model_copy(update={"alias": "champion" if "champion" in aliases else (aliases or ["none"])[0]})


# What decides the registered version: the weights, their test metrics, the raw data's fingerprint,
# the registry settings and the whole config (logged with the model); the logged model's own code
# (pyfunc_model.py) counts as code. A cached registration stands while its version is in the registry.
REGISTER_CACHE = CacheRule(
    "register",
    key=lambda inputs: (
        inputs["train_result"].best_sha256,
        inputs["eval_result"].metrics,
        inputs["snapshot"].fingerprint,
        inputs["config"].mlflow.model_dump(mode="json"),
        # what decides training, not the whole config: where or how fast it trained registers nothing new
        model_identity(inputs["config"].model),
        training_identity(inputs["config"], inputs["train_result"].parent),
    ),
    code=(__name__, "shardline.runs.pyfunc_model"),
    still_valid=version_exists,
)
