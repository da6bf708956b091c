"""The training flow: shards in, best checkpoint out. A flow of its own so that it can be deployed to
a GPU work pool (prefect.yaml: `train/train`) and dispatched by the pipeline; in-process it is the
pipeline's subflow; a local sweep runs it in a child process per trial. The run itself
(shardline/runs/training_run.py) is the same on every path."""

# no `from __future__ import annotations`: a sweep's child process gets this flow's function pickled by value
# (the module's `train` is the Flow, not the function), and Prefect validates the parameters from its
# annotations there: they must be the classes themselves, not names the child cannot resolve

import logging

from prefect import flow

from shardline.core.config import PipelineConfig
from shardline.core.failures import (
    PREEMPTED_EXIT_CODE,
    InfrastructureFailure,
    Preempted,
    is_infrastructure_failure,
    quiet_as_parent,
)
from shardline.core.memory import return_freed_memory
from shardline.core.parent_watch import exit_now, parent_gone, stop_when_parent_exits
from shardline.core.secrets import install_log_redaction, redacted_errors
from shardline.core.study import Pruning
from shardline.runs import links
from shardline.runs.result import Parent, TrainResult
from shardline.runs.training_run import run_training


@flow(name="train", log_prints=True, flow_run_name=links.flow_run_name("train"))
@redacted_errors
def train(
    manifest_uri: str,
    config: PipelineConfig,
    run_folder: str | None = None,
    mlflow_tags: dict[str, str] | None = None,
    cpu_threads: int | None = None,
    watched: bool = False,
    parent: Parent | None = None,
    pruning: Pruning | None = None,
) -> TrainResult:
    """Train the configured model on the manifest's shards (in `run_folder`, when the pipeline chose it);
        return the best checkpoint and its scores. `mlflow_tags`: tags of a new MLflow run (a sweep's trial:
        its parent run); `cpu_threads`: torch's threads in this process (a share of the machine's cores when
        several trainings share it); `watched`: run by a watchdog that sees only this flow run's state (a dispatched
    run, a sweep's trial in a child process), which then raises an infrastructure failure as `InfrastructureFailure`
    so that the watchdog can tell it from an error in the code, config or data. `parent`: the fine-tune parent the
    pipeline resolved (run on its own, the training resolves `training.init_from` itself, once). `pruning`: a sweep's
    trial, reporting each epoch to its study, whose pruner may stop it early."""
    install_log_redaction()  # a worker's process too: no secret in its console or the Prefect API's logs
    return_freed_memory()  # buffers of shards decompressed for a moment go back to the system when freed
    stop_when_parent_exits()  # a sweep's child process: stops like a preempted run when the sweep dies
    quiet_as_parent()  # ...and its console says a preemption or a budget stop as the sweep's does, quietly
    if cpu_threads:
        import torch

        torch.set_num_threads(cpu_threads)
    from shardline.trainer.stops import kept_while_starting

    try:
        with kept_while_starting():  # a notice before the training's first step stops it there, at a checkpoint
            result = run_training(manifest_uri, config, run_folder, mlflow_tags, parent, pruning)
        exit_if_orphaned(0)  # its result is in its run folder, for the sweep's rerun
        return result
    except Exception as e:
        exit_if_orphaned(PREEMPTED_EXIT_CODE if isinstance(e, Preempted) else 1)  # at its checkpoint, said to MLflow
        if watched and not isinstance(e, InfrastructureFailure) and is_infrastructure_failure(e):
            # by type, here where the error is: a dispatched run's watchdog sees only the flow run's state
            raise InfrastructureFailure(f"{type(e).__name__}: {e}") from e
        raise


@flow(name="train-node", log_prints=True)
@redacted_errors
def train_node(job: str, endpoint: str, shutdown_seconds: int = 300) -> str:
    """One more machine of a training on several (`compute.nodes` > 1), started by the training run (node 0): its
    torchrun agent meets the others at the rendezvous `endpoint` (HOST:PORT) and trains the `job` in storage until
    the training ends (shardline/launch/torchrun.py)."""
    install_log_redaction()
    from shardline.launch.torchrun import run_node

    return run_node(job, endpoint, shutdown_seconds)


def exit_if_orphaned(code: int) -> None:
    """Where a sweep's trial has done its work (stopped at a checkpoint, or finished) and the sweep that started it is
    gone, with the Prefect API it reports to (the command's temporary one): exit with `code` now. Prefect would retry
    the dead API for minutes (its client's retries, each request's, then its log handler's), the process holding its
    memory meanwhile and its console filling with tracebacks of it. A server of its own answers: the flow run's end
    is reported as any other's."""
    if not parent_gone():
        return
    import httpx
    from prefect.settings import PREFECT_API_URL

    api = PREFECT_API_URL.value()
    try:
        answered = bool(api) and httpx.get(f"{str(api).rstrip('/')}/health", timeout=3).status_code < 500
    except httpx.HTTPError:
        answered = False
    if not answered:
        logging.getLogger("shardline.parent_watch").warning(
            "the Prefect API went with it: this process ends here (exit status %d)", code
        )
        exit_now(code)
