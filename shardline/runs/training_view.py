"""What a user sees of a training run while it trains, in the Prefect UI: its logs and artifacts on the
training flow run, a `train-progress` bar (optimizer steps done) and a `train-live` table updated in place.

The pipeline's train step calls the training flow as a subflow from inside a task, and Prefect keeps the
task's context inside that subflow: `get_run_logger()` and the artifact helpers would file everything
under the pipeline's train task, and the training flow run would show nothing. `run_logger` and
`LiveView` file it under the flow run that trains. A dispatched run (its own process, no task around it)
gets the same.
"""

from __future__ import annotations

import logging
import threading
from uuid import UUID

from prefect import get_run_logger

from shardline.core.metrics.report import format_duration

PROGRESS_KEY = "train-progress"
LIVE_KEY = "train-live"


def _contexts():
    from prefect.context import FlowRunContext, TaskRunContext

    flow_ctx, task_ctx = FlowRunContext.get(), TaskRunContext.get()
    flow_run = flow_ctx.flow_run if flow_ctx else None
    task_run = task_ctx.task_run if task_ctx else None
    # a flow called from a task: the task run is its parent's, not one of this flow run's
    in_flow = flow_run is not None and (task_run is None or task_run.flow_run_id != flow_run.id)
    return flow_ctx, flow_run, task_run, in_flow


def run_ids() -> tuple[UUID | None, UUID | None]:
    """(task run id, flow run id) of the run executing this code: the flow run alone inside a flow's own
    body, its subflow body included; the task run and its flow run inside a task."""
    _, flow_run, task_run, in_flow = _contexts()
    if in_flow:
        return None, flow_run.id
    if task_run is not None:
        return task_run.id, task_run.flow_run_id
    return None, None


def run_logger() -> logging.Logger | logging.LoggerAdapter:
    """The logger of the run executing this code (`run_ids`): the flow run's inside a flow, a subflow
    called from a task included; else Prefect's `get_run_logger()`."""
    from prefect.logging.loggers import flow_run_logger

    flow_ctx, flow_run, _, in_flow = _contexts()
    if in_flow:
        return flow_run_logger(flow_run=flow_run, flow=flow_ctx.flow)
    return get_run_logger()


def _number(value, fmt: str) -> str:
    return "–" if value is None else format(value, fmt)


def _about(seconds: float | None) -> str:
    return "–" if seconds is None else f"about {format_duration(seconds)}"


def live_table(state: dict) -> str:
    """The `train-live` table: where the run is (a `fit` on_progress entry, the latest value of each field)."""
    select_by = state.get("select_by") or "val_loss"
    validated = state.get("validated_epoch")
    after = f" (after epoch {validated})" if validated else ""
    rows = [
        ("step", f"{state['step']:,} / {state['total_steps']:,}"),
        ("epoch", f"{state['epoch']} / {state['epochs']}"),
        ("train loss (last step)", _number(state.get("train_loss"), ".4f")),
        ("val_loss" + after, _number(state.get("val_loss"), ".4f")),
    ]
    if select_by != "val_loss":
        rows.append((f"{select_by}{after}", _number(state.get("selected"), ".4f")))
    best, waited = state.get("best_epoch"), state.get("data_wait_fraction")
    rows += [
        (
            f"best so far (by {select_by})",
            f"epoch {best}: {_number(state.get('best_score'), '.4f')}" if best else "–",
        ),
        ("windows/s", _number(state.get("windows_per_s"), ",.0f")),
        ("time left", "done" if state["step"] >= state["total_steps"] else _about(state.get("seconds_left"))),
        ("waiting for data", f"{waited:.0%} of step time" if waited is not None else "–"),
    ]
    return "\n".join(["| training | now |", "| --- | --- |", *(f"| {k} | {v} |" for k, v in rows)])


class LiveView:
    """The `train-progress` bar and the `train-live` table of the training run executing this code
    (`run_ids`), created at the first `show` and then updated in place, by a daemon thread: `show` keeps
    the newest state and returns, so training never waits for the Prefect API, however slow. An API that
    fails is said once, as a warning, and the view goes on without it; training never sees the error."""

    def __init__(self, log: logging.Logger | logging.LoggerAdapter):
        self.log = log
        self.task_run_id, self.flow_run_id = run_ids()
        self._state: dict = {}
        self._pending = False
        self._closing = False
        self._warned = False
        self._changed = threading.Condition()
        self._thread = None
        if self.flow_run_id is not None:  # outside any run there is nothing to show it on
            from prefect.context import get_settings_context

            # the API this run talks to, for a client of the thread's own (the run's client is not shared)
            self._settings = get_settings_context().model_copy()
            self._thread = threading.Thread(target=self._send_loop, name="shardline-live-view", daemon=True)
            self._thread.start()

    def show(self, progress: dict) -> None:
        """Take the run's newest state (a field left None keeps its last value); sent when the thread is free."""
        with self._changed:
            self._state.update({k: v for k, v in progress.items() if v is not None})
            self._pending = True
            self._changed.notify()

    def close(self) -> None:
        """Send the last state (waiting 10 seconds at most) and stop the thread."""
        if self._thread is None:
            return
        with self._changed:
            self._closing = True
            self._changed.notify()
        self._thread.join(10.0)

    def _warn(self, error: Exception) -> None:
        if not self._warned:
            self._warned = True
            self.log.warning(
                "train: the live view (%s, %s artifacts) could not be updated (%s: %s); training goes on without it",
                PROGRESS_KEY,
                LIVE_KEY,
                type(error).__name__,
                str(error)[:200],
            )

    def _send_loop(self) -> None:
        from prefect.client.orchestration import get_client

        ids: dict[str, UUID] = {}
        try:
            with self._settings, get_client(sync_client=True) as client:
                while True:
                    with self._changed:
                        while not self._pending and not self._closing:
                            self._changed.wait()
                        if not self._pending:
                            return
                        state, self._pending = dict(self._state), False
                    try:
                        self._send(client, ids, state)
                    except Exception as e:  # noqa: BLE001 - a view never fails training: said once, then skipped
                        self._warn(e)
        except Exception as e:  # noqa: BLE001 - the client itself could not be made
            self._warn(e)

    def _send(self, client, ids: dict[str, UUID], state: dict) -> None:
        from prefect.client.schemas.actions import ArtifactCreate, ArtifactUpdate

        done = 100.0 * state["step"] / max(1, state["total_steps"])
        values = {
            PROGRESS_KEY: ("progress", "optimizer steps done (%)", done),
            LIVE_KEY: ("markdown", "the training run now: step, epoch, losses, speed, time left", live_table(state)),
        }
        for key, (kind, description, data) in values.items():
            if key in ids:
                client.update_artifact(ids[key], ArtifactUpdate(data=data))
            else:  # the flow run's own, not its parent task's: ids given, not taken from the context
                made = client.create_artifact(
                    ArtifactCreate(
                        key=key,
                        type=kind,
                        description=description,
                        data=data,
                        flow_run_id=self.flow_run_id,
                        task_run_id=self.task_run_id,
                    )
                )
                ids[key] = made.id
