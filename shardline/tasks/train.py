"""Train: run the training flow on the encoded data set, as a cached step of the pipeline.

In-process (`compute.train_on: local`, the laptop default) the training flow is a subflow. Dispatched
(`compute.train_on: deployment`) it is a flow run of the training deployment on its work pool (GPU
workers), and this step is its watchdog: Prefect does not retry a Crashed flow run (its process or
machine died, its pod was evicted, the spot instance was reclaimed), so a crashed or preempted run is
dispatched again, up to `compute.max_preemptions`, and resumes from its newest checkpoint in storage.
A run that Failed on its infrastructure (`InfrastructureFailure`: storage or network errors, a lost node) is
dispatched again by this step's retry (`training.max_restarts`); one that Failed on a real error in the
code, the config or the data is not. A run left RUNNING by a machine that vanished without a word is found
by its silent lease and set Crashed (`watch_training_run`).
"""

from __future__ import annotations

import json
from collections.abc import Callable

from prefect import task
from prefect.logging import get_run_logger

from shardline.core import storage
from shardline.core.config import PipelineConfig
from shardline.core.failures import (
    BudgetExceeded,
    InfrastructureFailure,
    failed_on_infrastructure,
    was_preempted,
)
from shardline.core.secrets import job_variables_here, redacted_errors
from shardline.core.study import Pruning
from shardline.core.version import TRAINER
from shardline.runs.result import Parent, TrainResult
from shardline.runs.training_run import load_manifest, model_identity, run_dir, training_identity
from shardline.tasks.caching import CacheRule


class TrainingRunFailed(RuntimeError):
    """The dispatched training run failed for a reason a re-dispatch would not fix (or its budget is spent)."""


@task(name="train")
@redacted_errors
def train_step(
    manifest_uri: str,
    manifest_hash: str,
    config: PipelineConfig,
    train_here: Callable[..., TrainResult],
    fresh: bool = False,
    mlflow_tags: dict[str, str] | None = None,
    parent: Parent | None = None,
    pruning: Pruning | None = None,
) -> TrainResult:
    """Train on the manifest's shards where the config says: here (`train_here`: the training flow as a
    subflow, or in a child process of its own for a sweep's trial), or on the training deployment's work
    pool. The run's folder is chosen here and handed over; `fresh` (`--force train`) trains in a new folder
    instead of returning a finished run. `mlflow_tags` go on a new MLflow run (a sweep's trial: its parent);
    `parent`: the fine-tune parent the flow resolved, handed on (else the training run resolves it); `pruning`: a
    sweep's trial, which its study's pruner may stop early."""
    folder = run_dir(config, load_manifest(manifest_uri, config), parent, fresh=fresh)
    if config.compute.train_on == "deployment":
        return dispatch_training(manifest_uri, config, folder, mlflow_tags, parent, pruning)
    return train_here(manifest_uri, config, folder, mlflow_tags=mlflow_tags, parent=parent, pruning=pruning)


def run_tag(folder: str) -> str:
    """The tag of the flow runs that train the run in `folder` (a dispatched one, a sweep's child process)."""
    return f"shardline-run:{folder.rstrip('/').rsplit('/', 1)[-1]}"


def tagged_flow_runs(tag: str, live: bool = False) -> list:
    """The flow runs tagged `tag`, newest first (20 at most); `live`: only the scheduled, pending or running."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
        FlowRunFilterTags,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.client.schemas.sorting import FlowRunSort

    states = FlowRunFilterState(
        type=FlowRunFilterStateType(any_=[StateType.SCHEDULED, StateType.PENDING, StateType.RUNNING])
    )
    with get_client(sync_client=True) as client:
        return client.read_flow_runs(
            flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[tag]), state=states if live else None),
            sort=FlowRunSort.EXPECTED_START_TIME_DESC,
            limit=20,
        )


def watch_training_run(flow_run_id, folder: str, timeout: float | None, poll: float, log=None):
    """Wait for a dispatched training run to end (or `timeout`), and return it.

    A run whose machine vanished without a word (a spot machine reclaimed at once, a host powered off, a frozen
    VM) stays RUNNING in Prefect: no process is left to say otherwise, nor a worker when it ran on the same
    machine. Its lease in the run folder says it: the run renews it every third of its ttl. If the lease was
    taken by this flow run and has not changed for longer than its ttl, by this process's clock (no clock of
    two machines is compared), the run is set Crashed and so dispatched again. Should it only have stalled,
    its next write finds the lease taken and stops (`LeaseLost`)."""
    import time

    from prefect.client.orchestration import get_client
    from prefect.states import Crashed

    from shardline.core.lease import Silence

    start = time.monotonic()
    silence = Silence(storage.join(folder, "lease"), flow_run_id)
    with get_client(sync_client=True) as client:
        while True:
            flow_run = client.read_flow_run(flow_run_id)
            state = flow_run.state
            if state is not None and state.is_final():
                return flow_run
            if timeout is not None and time.monotonic() - start > timeout:
                return flow_run
            if state is not None and state.is_running() and (message := silence.check()):
                if log is not None:
                    log.warning("train: run %s: %s; setting it Crashed", flow_run.name, message)
                client.set_flow_run_state(flow_run_id, Crashed(message=message), force=True)
                continue  # read back: Crashed, dispatched again
            time.sleep(poll)


def dispatch_training(
    manifest_uri: str,
    config: PipelineConfig,
    folder: str,
    mlflow_tags: dict[str, str] | None,
    parent: Parent | None,
    pruning: Pruning | None,
) -> TrainResult:
    """Run the training deployment, re-dispatch it while it is preempted, and return its result."""
    from prefect.deployments import run_deployment

    log = get_run_logger()
    c = config.compute
    if not storage.is_remote(config.storage.root):
        log.warning(
            "compute.train_on=deployment with a local storage.root (%s): the training workers must see the same "
            "disk. Use an object store (s3://...) for workers on other machines.",
            config.storage.root,
        )
    parameters = {
        "manifest_uri": manifest_uri,
        "config": config.model_dump(mode="json"),
        "run_folder": folder,
        "watched": True,  # an infrastructure failure is raised as InfrastructureFailure: dispatched again
    }
    if mlflow_tags:
        parameters["mlflow_tags"] = mlflow_tags
    if parent is not None:
        parameters["parent"] = parent.model_dump(mode="json")
    if pruning is not None:
        parameters["pruning"] = pruning.model_dump(mode="json")
    runs: list[dict] = []
    for attempt in range(c.max_preemptions + 1):
        live = tagged_flow_runs(run_tag(folder), live=True) if attempt == 0 else []
        if live:
            # a pipeline killed while its training went on: wait for that run, never start a second
            # writer of the same checkpoints
            log.info("train: run %s (%s) is already training this; waiting for it", live[0].name, live[0].id)
            started = live[0]
        else:
            started = run_deployment(
                name=c.train_deployment,
                parameters=parameters,
                job_variables=job_variables_here(c.job_variables) or None,
                timeout=0,  # created; watched below
                as_subflow=True,
                tags=["shardline", run_tag(folder)],
            )
        flow_run = watch_training_run(started.id, folder, c.dispatch_timeout_seconds, c.poll_seconds, log)
        state = flow_run.state
        runs.append(
            {
                "name": flow_run.name,
                "id": str(flow_run.id),
                "state": state.name if state else None,
                "message": state.message if state else None,
            }
        )
        log.info(
            "train: dispatched run %s on %s ended %s", flow_run.name, c.train_deployment, state.name if state else "?"
        )
        if state is not None and state.is_completed():
            return TrainResult.read(folder, runs)
        if state is None or not state.is_final():
            raise TrainingRunFailed(
                f"training run {flow_run.name} ({flow_run.id}) on {c.train_deployment} was still "
                f"{state.name if state else 'unknown'} "
                f"after compute.dispatch_timeout_seconds={c.dispatch_timeout_seconds}; is a worker polling its work "
                "pool? "
                "(shardline doctor CONFIG checks)"
            )
        if "BudgetExceeded" in (state.message or ""):  # stopped at training.max_cost / max_hours: not re-dispatched
            raise BudgetExceeded(
                f"training run {flow_run.name} ({flow_run.id}) on {c.train_deployment}: "
                + (state.message or "").split("BudgetExceeded: ", 1)[-1]
            )
        if failed_on_infrastructure(state):  # the step's retry (training.max_restarts) dispatches it again
            raise InfrastructureFailure(
                f"training run {flow_run.name} ({flow_run.id}) on {c.train_deployment} failed on its "
                f"infrastructure: {state.message}"
            )
        if not was_preempted(state):
            raise TrainingRunFailed(
                f"training run {flow_run.name} ({flow_run.id}) on {c.train_deployment} ended {state.name}: "
                f"{state.message}. "
                "Not dispatched again: fix the error (its logs are in the Prefect UI) and rerun."
            )
        if attempt < c.max_preemptions:
            log.warning(
                "train: run %s was %s (%s); dispatching again (%d of %d), it resumes from its newest checkpoint",
                flow_run.name,
                state.name,
                state.message,
                attempt + 1,
                c.max_preemptions,
            )
    raise TrainingRunFailed(
        f"training on {c.train_deployment} was preempted {c.max_preemptions + 1} times "
        f"(runs: {', '.join(r['name'] + ' ' + r['id'] for r in runs)}); "
        "its checkpoints are kept: rerun to resume, or raise compute.max_preemptions"
    )


def checkpoint_intact(result: TrainResult, inputs: dict) -> bool:
    """A cached training result stands while its best checkpoint is in storage: its sidecar names the
    result's checksum and the file has the sidecar's size. A listing and a small read, no download of the
    weights (on S3, hashing them fetched every checkpoint on each rerun); the bytes are checked against
    the checksum where they are read anyway (`load_checkpoint`: evaluate, register)."""
    from shardline.trainer.checkpoint import sidecar_uri

    uri = result.best_checkpoint
    if not uri or not storage.exists(sidecar_uri(uri)):
        return False
    try:
        side = json.loads(storage.read_text(sidecar_uri(uri)))
    except (OSError, ValueError):
        return False
    if side.get("sha256") != result.best_sha256:
        return False
    size = storage.size_of(uri)
    return size is not None and size == side.get("bytes", size)


def train_key(inputs: dict) -> tuple:
    """What decides the trained weights: the data (the manifest's checksum), the model (the user's model
    code included), the training settings that change what is computed, and the MLflow run they are logged to; for
    a sweep's trial under a pruner, its study (a pruned result is that study's answer, not a finished training's)."""
    cfg: PipelineConfig = inputs["config"]
    pruning = inputs.get("pruning")
    return (
        inputs["manifest_hash"],
        model_identity(cfg.model),
        training_identity(cfg, inputs.get("parent")),
        cfg.mlflow.model_dump(mode="json", include={"tracking_uri", "experiment"}),
        *([pruning.journal, pruning.study, pruning.pruner] if pruning is not None else []),
    )


# keyed on the code that trains (core/version.py's TRAINER), not on this step's own: an edit to the training run's
# bookkeeping (its Prefect view, MLflow links, cost table) retrains nothing
TRAIN_CACHE = CacheRule("train", key=train_key, code=TRAINER, still_valid=checkpoint_intact)
