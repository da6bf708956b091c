"""The whole pipeline: ingest -> encode -> train -> evaluate -> register. Thin: it only wires steps."""

from __future__ import annotations

from prefect import flow

from flows.train import train
from shardline.config import PipelineConfig
from tasks.encode import encode
from tasks.evaluate import evaluate
from tasks.ingest import ingest
from tasks.register import register


@flow(name="pipeline", log_prints=True)
def pipeline(config: PipelineConfig) -> dict:
    """Raw parquet to a registered, evaluated model version."""
    snapshot = ingest(config.data)
    manifest_uri = encode(snapshot, config.data, config.storage.root)
    trained = train(manifest_uri, config)
    scores = evaluate(manifest_uri, trained, config)
    registered = register(config, snapshot, manifest_uri, trained, scores)
    return {
        "snapshot": {"files": len(snapshot.files), "skipped": [r.model_dump() for r in snapshot.rejected], "fingerprint": snapshot.fingerprint},
        "manifest": manifest_uri,
        "train": {k: trained[k] for k in ("best_checkpoint", "best_val_loss", "steps", "device", "precision", "mlflow_run_id")},
        "metrics": scores["metrics"],
        "baseline": scores["baseline"],
        "table": scores["table"],
        "registered": registered,
    }
