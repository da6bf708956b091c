"""The training flow: shards in, best checkpoint out. A flow of its own so that it can be deployed to
a GPU work pool (prefect.yaml: `train/train`) and dispatched by the pipeline; in-process it is the
pipeline's subflow. The run itself (shardline/tasks/training_run.py) is the same on both paths."""

from __future__ import annotations

from prefect import flow

from shardline.core.config import PipelineConfig
from shardline.core.memory import return_freed_memory
from shardline.core.secrets import install_log_redaction
from shardline.tasks import links
from shardline.tasks.training_run import run_training


@flow(name="train", log_prints=True, flow_run_name=links.flow_run_name("train"))
def train(manifest_uri: str, config: PipelineConfig, run_folder: str | None = None) -> dict:
    """Train the configured model on the manifest's shards (in `run_folder`, when the pipeline chose it);
    return the best checkpoint and its scores."""
    install_log_redaction()  # a worker's process too: no secret in its console or the Prefect API's logs
    return_freed_memory()  # buffers of shards decompressed for a moment go back to the system when freed
    return run_training(manifest_uri, config, run_folder)
