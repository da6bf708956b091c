"""Train: run the training flow on the encoded data set, as a cached step of the pipeline."""

from __future__ import annotations

from prefect import task

from shardline import storage
from shardline.config import PipelineConfig


@task(name="train")
def train_step(manifest_uri: str, manifest_hash: str, config: PipelineConfig) -> dict:
    """Run the training flow (a subflow here; it resumes from its newest checkpoint)."""
    from flows.train import train

    return train(manifest_uri, config)


def checkpoint_intact(result: dict) -> bool:
    uri = result.get("best_checkpoint")
    return bool(uri) and storage.exists(uri) and storage.sha256_uri(uri) == result.get("best_sha256")


def train_key(inputs: dict) -> tuple:
    from flows.train import RESUMABLE_ACROSS

    cfg: PipelineConfig = inputs["config"]
    return (
        inputs["manifest_hash"],
        cfg.model.model_dump(mode="json"),
        cfg.training.model_dump(mode="json", exclude=RESUMABLE_ACROSS),
        cfg.mlflow.model_dump(mode="json", include={"tracking_uri", "experiment"}),
    )
