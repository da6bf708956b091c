"""The whole pipeline: ingest -> encode -> train -> evaluate -> register. Thin: it only wires steps.

Every step is cached by the content of its inputs (tasks/caching.py): a rerun redoes only what
changed, and `force` refreshes one step and everything after it.
"""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from shardline import storage
from shardline.config import PipelineConfig, load_config, validate_config
from tasks.caching import STEPS, cached
from tasks.encode import encode
from tasks.evaluate import evaluate
from tasks.ingest import ingest, source_listing
from tasks.register import register, version_exists
from tasks.train import checkpoint_intact, retry_on_infrastructure, train_key, train_step


def _refreshed(force: str | None) -> set[str]:
    if force is None:
        return set()
    if force not in STEPS:
        raise ValueError(f"force='{force}' is not a step; allowed: {list(STEPS)}")
    return set(STEPS[STEPS.index(force):])


def resolve_config(config: PipelineConfig | dict | str) -> PipelineConfig:
    """A deployment's `config` parameter: a path to a YAML file (on the worker), or the config inline."""
    if isinstance(config, PipelineConfig):
        return config
    if isinstance(config, str):
        return load_config(config)
    return validate_config(config, "the 'config' parameter")


@flow(name="pipeline", log_prints=True)
def pipeline(config: PipelineConfig | str, force: str | None = None) -> dict:
    """Raw parquet to a registered, evaluated model version. `config`: a YAML path or the config itself."""
    config = resolve_config(config)
    root = config.storage.root
    refresh = _refreshed(force)
    ran: dict[str, bool] = {}

    ingest_t = cached(
        ingest, "ingest", ("tasks.ingest",), lambda i: (source_listing(i["data"]), i["data"].model_dump(mode="json")),
        root, refresh="ingest" in refresh,
    )
    state = ingest_t(config.data, return_state=True)
    snapshot, ran["ingest"] = state.result(), state.name != "Cached"

    manifest_uri, ran["encode"] = encode(snapshot, config.data, root, refresh="encode" in refresh)
    manifest_hash = storage.sha256_uri(manifest_uri)

    train_t = cached(
        train_step, "train", ("tasks.train", "flows.train"), train_key, root, validate=checkpoint_intact, refresh="train" in refresh
    ).with_options(retries=config.training.max_restarts, retry_delay_seconds=5, retry_condition_fn=retry_on_infrastructure)
    state = train_t(manifest_uri, manifest_hash, config, return_state=True)
    trained, ran["train"] = state.result(), state.name != "Cached"

    evaluate_t = cached(
        evaluate, "evaluate", ("tasks.evaluate",),
        lambda i: (i["train_result"]["best_sha256"], manifest_hash, i["config"].data.target.model_dump()),
        root, validate=lambda r: all(Path(f).exists() for f in r["files"]), refresh="evaluate" in refresh,
    )
    state = evaluate_t(manifest_uri, trained, config, return_state=True)
    scores, ran["evaluate"] = state.result(), state.name != "Cached"

    register_t = cached(
        register, "register", ("tasks.register", "shardline.pyfunc_model"),
        lambda i: (i["train_result"]["best_sha256"], i["eval_result"]["metrics"], i["snapshot"].fingerprint,
                   i["config"].mlflow.model_dump(mode="json"), i["config"].hash()),
        root, validate=version_exists, refresh="register" in refresh,
    )
    state = register_t(config, snapshot, manifest_uri, trained, scores, return_state=True)
    registered, ran["register"] = state.result(), state.name != "Cached"

    return {
        "steps": {step: ("ran" if did else "cached") for step, did in ran.items()},
        "snapshot": {"files": len(snapshot.files), "skipped": [r.model_dump() for r in snapshot.rejected], "fingerprint": snapshot.fingerprint},
        "manifest": manifest_uri,
        "train": {k: trained.get(k) for k in ("best_checkpoint", "best_val_loss", "steps", "device", "precision", "mlflow_run_id", "host", "flow_runs", "resumed_from", "run_dir")},
        "metrics": scores["metrics"],
        "baseline": scores["baseline"],
        "table": scores["table"],
        "registered": registered,
    }
