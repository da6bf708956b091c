"""Register: log the model (raw rows in, encoding inside) to MLflow and move `champion` only on merit."""

from __future__ import annotations

import json
import shutil
import tempfile
import warnings
from pathlib import Path

import yaml
from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.logging import get_run_logger

from shardline.core import storage
from shardline.core.config import PipelineConfig
from shardline.core.manifest import Manifest, Snapshot
from shardline.core.tracking import Tracker, fluent_tracking_uri, sync_run
from shardline.core.version import code_version, user_code, user_code_version
from shardline.tasks.caching import CacheRule
from shardline.tasks.ingest import raw_sample
from shardline.trainer.serving import bundle_dict, example_outputs, input_columns, key_columns, prediction_frame

PYFUNC_CODE = Path(__file__).resolve().parent / "pyfunc_model.py"


def _requirements() -> list[str]:
    """The packages the registered model imports, pinned to the versions it was trained with. Shardline
    itself is not among them (a bare `shardline` could resolve to someone else's package): its code
    travels inside the model (`_code_paths`)."""
    from importlib.metadata import version

    packages = ("torch", "polars", "pyarrow", "numpy", "pandas", "pydantic", "pyyaml", "fsspec", "mlflow")
    return [f"{pkg}=={version(pkg).split('+')[0]}" for pkg in packages]


SHARDLINE_PACKAGE = Path(__file__).resolve().parents[1]


def _copy_sources(src: Path, dest: Path) -> Path:
    """A copy of a module file or a package folder, its Python sources and data only (no caches)."""
    if src.is_file():
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest)
        return dest
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", ".*"))
    return dest


def _code_paths(config: PipelineConfig, folder: Path) -> list[str]:
    """The code the registered model runs, copied into it: Shardline's package, and for the user's own
    model the top-level modules and packages of its code (its entrypoint and what that imports), so the
    model predicts on a machine that has neither Shardline's repository nor the user's."""
    paths = [_copy_sources(SHARDLINE_PACKAGE, folder / "shardline")]
    model = config.model
    if model.entrypoint:
        root = Path(model.code_dir or Path.cwd()).resolve()
        for top in sorted({name.split(".")[0] for name in user_code(model.entrypoint, model.code_dir)}):
            src = root / top if (root / top).is_dir() else root / f"{top}.py"
            paths.append(_copy_sources(src, folder / src.name))
    return [str(p) for p in paths]


def _signature(spec, sample_uri: str):
    """Input schema: the raw columns the model needs (the target is not one); output: keys + prediction."""
    import numpy as np
    import pandas as pd
    from mlflow.models import infer_signature

    sample = raw_sample(sample_uri, input_columns(spec))
    keys = {k: (np.zeros(1, np.int64) if k == "row" else sample[k].iloc[:1].to_numpy()) for k in key_columns(spec)}
    out = prediction_frame(spec, keys, example_outputs(spec)).to_pandas()
    with warnings.catch_warnings():  # the integer-columns hint: nulls in them are handled by the encoding
        warnings.simplefilter("ignore", UserWarning)
        return infer_signature(sample, pd.DataFrame(out)), sample


def champion_gate(client, name: str, metric: str, direction: str, new_value: float) -> tuple[bool, dict | None]:
    """Whether the new version beats the current champion on `metric` (True when there is none)."""
    from mlflow.exceptions import MlflowException

    try:
        current = client.get_model_version_by_alias(name, "champion")
    except MlflowException:
        return True, None
    old = current.tags.get(f"metric.{metric}")
    if old is None:
        return True, {"version": current.version, "value": None}
    old = float(old)
    better = new_value > old if direction == "maximize" else new_value < old
    return better, {"version": current.version, "value": old}


def register_model(
    config: PipelineConfig, snapshot: Snapshot, manifest_uri: str, train_result: dict, eval_result: dict
) -> dict:
    import mlflow
    import torch

    from shardline.trainer.checkpoint import load_checkpoint

    manifest = Manifest.model_validate_json(storage.read_text(manifest_uri))
    spec = manifest.encoding
    tracker = Tracker(config.mlflow, config.storage.root)
    client = tracker.client
    # what training left in its journal (MLflow was away when it ended) is sent first: its run, metrics, status
    synced = sync_run(train_result["run_dir"], tracker.uri, missing_ok=True) if train_result.get("run_dir") else None
    run_id = train_result["mlflow_run_id"] or (synced.run_id if synced else None)
    if run_id is None:
        raise RuntimeError(f"the training run {train_result.get('run_dir')} has no MLflow run to register from")
    metric_name = config.mlflow.promotion_metric
    if metric_name not in eval_result["metrics"]:
        raise ValueError(
            f"mlflow.promotion_metric='{metric_name}' is not among the evaluation's metrics "
            f"{sorted(eval_result['metrics'])}; name one of them"
        )
    new_value = float(eval_result["metrics"][metric_name])
    tags = {
        "shardline.data_fingerprint": manifest.data_fingerprint,
        "shardline.config_hash": config.hash(),
        "shardline.code_version": code_version(),
        "shardline.encoding_hash": manifest.encoding_hash,
    }
    parent = train_result.get("parent")
    if parent:  # fine-tuned from another model: its lineage
        tags["shardline.parent"] = parent["uri"]
        for key in ("name", "version", "run_id", "checkpoint"):
            if parent.get(key):
                tags[f"shardline.parent_{key}"] = str(parent[key])
    if config.model.entrypoint:
        tags["shardline.model_entrypoint"] = config.model.entrypoint
        tags["shardline.model_code_version"] = user_code_version(config.model.entrypoint, config.model.code_dir)
    ckpt = load_checkpoint(train_result["best_checkpoint"])
    with fluent_tracking_uri(tracker.uri), tempfile.TemporaryDirectory(prefix="shardline-register-") as tmp:
        tmp = Path(tmp)
        torch.save(ckpt["model"], tmp / "weights.pt")
        (tmp / "bundle.json").write_text(json.dumps(bundle_dict(spec, ckpt["model_spec"], {"tags": tags}), indent=1))
        (tmp / "config.yaml").write_text(yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False))
        (tmp / "manifest.json").write_text(manifest.model_dump_json(indent=1))
        signature, sample = _signature(spec, snapshot.files[0].uri)
        with mlflow.start_run(run_id=run_id):
            mlflow.log_metrics({f"test/{k}": v for k, v in eval_result["metrics"].items()})
            mlflow.log_metrics({f"baseline/{k}": v for k, v in eval_result["baseline"].items()})
            mlflow.set_tags(tags)
            for f in eval_result["files"]:
                mlflow.log_artifact(f, artifact_path="evaluation")
            mlflow.log_artifact(str(tmp / "config.yaml"))
            mlflow.log_artifact(str(tmp / "manifest.json"))
            if snapshot.rejected:
                mlflow.log_dict({"skipped_files": [r.model_dump() for r in snapshot.rejected]}, "skipped_files.json")
            info = mlflow.pyfunc.log_model(
                name="model",
                python_model=str(PYFUNC_CODE),
                artifacts={"weights": str(tmp / "weights.pt"), "bundle": str(tmp / "bundle.json")},
                signature=signature,
                input_example=sample,
                pip_requirements=_requirements(),
                code_paths=_code_paths(config, tmp / "code"),
                tags=tags,
            )
        version = mlflow.register_model(info.model_uri, config.mlflow.model_name, tags=tags)
    for k, v in eval_result["metrics"].items():
        client.set_model_version_tag(config.mlflow.model_name, version.version, f"metric.{k}", str(v))
    promote, previous = champion_gate(
        client, config.mlflow.model_name, metric_name, config.mlflow.promotion_direction, new_value
    )
    alias = "champion" if promote else "challenger"
    client.set_registered_model_alias(config.mlflow.model_name, alias, version.version)
    return {
        "model_name": config.mlflow.model_name,
        "version": int(version.version),
        "alias": alias,
        "previous_champion": previous,
        "model_uri": f"models:/{config.mlflow.model_name}/{version.version}",
        "run_id": run_id,
        "tracking_uri": tracker.uri,
        "promotion_metric": metric_name,
        "value": new_value,
    }


@task(name="register")
def register(
    config: PipelineConfig, snapshot: Snapshot, manifest_uri: str, train_result: dict, eval_result: dict
) -> dict:
    """Log the raw-rows model with its metrics and plots; register a version; move the champion alias on merit."""
    log = get_run_logger()
    reg = register_model(config, snapshot, manifest_uri, train_result, eval_result)
    prev = reg["previous_champion"]
    verdict = (
        f"promoted to **champion** (previous champion v{prev['version']}: {prev['value']})"
        if reg["alias"] == "champion" and prev
        else "the first **champion**"
        if reg["alias"] == "champion"
        else f"kept as **challenger**: champion v{prev['version']} has {reg['promotion_metric']}={prev['value']}"
    )
    skipped = "".join(f"\n- skipped `{r.uri}`: {r.reason}" for r in snapshot.rejected)
    create_markdown_artifact(
        key="model-report",
        markdown=(
            f"## {reg['model_name']} v{reg['version']}: {verdict}\n\n{eval_result['table']}\n\n"
            f"- MLflow run `{reg['run_id']}` at `{reg['tracking_uri']}`\n- model `{reg['model_uri']}`\n"
            f"- trained on {train_result['device']} ({train_result['precision']}), {train_result['steps']} steps"
            + (f"\n\nSkipped raw files:{skipped}" if skipped else "")
        ),
        description="metrics against the baseline and the registered model version",
    )
    log.info("register: %s v%s -> %s", reg["model_name"], reg["version"], reg["alias"])
    return reg


def version_exists(reg: dict, inputs: dict | None = None) -> bool:
    """A cached registration still stands: its model version is in the registry, from the same run."""
    from mlflow import MlflowClient

    try:
        version = MlflowClient(reg["tracking_uri"]).get_model_version(reg["model_name"], str(reg["version"]))
    except Exception:  # noqa: BLE001 - any registry error: the cached version cannot be trusted
        return False
    return version.run_id == reg["run_id"]


# What decides the registered version: the weights, their test metrics, the raw data's fingerprint,
# the registry settings and the whole config (logged with the model); the logged model's own code
# (pyfunc_model.py) counts as code. A cached registration stands while its version is in the registry.
REGISTER_CACHE = CacheRule(
    "register",
    key=lambda inputs: (
        inputs["train_result"]["best_sha256"],
        inputs["eval_result"]["metrics"],
        inputs["snapshot"].fingerprint,
        inputs["config"].mlflow.model_dump(mode="json"),
        inputs["config"].hash(),
    ),
    code=(__name__, "shardline.tasks.pyfunc_model"),
    still_valid=version_exists,
)
