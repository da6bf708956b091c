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


# errors of the machine or the network, worth a retry that resumes from the newest checkpoint
INFRASTRUCTURE_ERRORS = (OSError, ConnectionError, TimeoutError, MemoryError)
INFRASTRUCTURE_MARKERS = ("CUDA", "NCCL", "cuDNN", "out of memory", "device-side")


def is_infrastructure_failure(exc: BaseException) -> bool:
    """True for failures of the infrastructure (retry and resume), False for a real error in the code,
    the config or the data (fail at once with its message)."""
    from trainer.loop import Preempted

    if isinstance(exc, Preempted):  # asked to stop: stopping is the answer, not a retry
        return False
    if isinstance(exc, (ValueError, TypeError, KeyError, IndexError, AssertionError, NotImplementedError)):
        return False
    if isinstance(exc, INFRASTRUCTURE_ERRORS):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in INFRASTRUCTURE_MARKERS)


def retry_on_infrastructure(task, task_run, state) -> bool:
    try:
        state.result()
    except BaseException as e:  # noqa: BLE001 - classifying, not swallowing
        return is_infrastructure_failure(e)
    return False


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
