"""From one UI to the other: the Prefect flow runs and the MLflow runs and model versions of one pipeline
run name each other.

- The MLflow run is tagged with the training flow run and the pipeline's flow run (`shardline.prefect.*`:
  ids, names, and UI addresses when a Prefect server is used; an ephemeral API serves no UI).
- The Prefect flow runs are tagged `mlflow-run:<id>` and, once registered, `model:<name>` and
  `model-version:<name>/<version>`, so the runs list filters by them; the pipeline's flow run is renamed
  after the version it produced (`demo · demo-model v3 champion`).

Nothing here may fail a run: a Prefect API that does not answer costs a warning.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

log = logging.getLogger("shardline.runs.links")

# the root flow run of each flow run asked about in this process (it never changes; finding it costs an API read
# a level, each on a client of its own)
_ROOTS: dict[str, str] = {}


def ui_url_of(flow_run_id: str) -> str | None:
    """The Prefect UI's page of a flow run, when a Prefect server is used (PREFECT_API_URL set); None with
    the ephemeral API, which serves no UI and is gone when the process ends."""
    from prefect.settings import PREFECT_API_URL
    from prefect.utilities.urls import url_for

    return url_for("flow-run", obj_id=flow_run_id) if PREFECT_API_URL.value() else None


def current_flow_run() -> dict[str, Any] | None:
    """This process's flow run (id, name, UI address) and the run at the root of its tree (the pipeline),
    or None outside a flow run."""
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    if ctx is None or ctx.flow_run is None:
        return None
    run = ctx.flow_run
    out = {"id": str(run.id), "name": run.name, "flow": ctx.flow.name if ctx.flow else None, "url": ui_url_of(run.id)}
    try:
        from prefect.runtime import flow_run

        root = _ROOTS.get(out["id"]) or flow_run.root_flow_run_id
        if root:
            _ROOTS[out["id"]] = str(root)
        if root and str(root) != out["id"]:
            out["root_id"] = str(root)
            out["root_url"] = ui_url_of(root)
    except Exception as e:  # noqa: BLE001 - a link, not a result
        log.warning("could not read the root flow run of %s: %s", run.id, e)
    return out


def mlflow_tags(prefix: str = "shardline.prefect") -> dict[str, str]:
    """Tags that lead from an MLflow run (or model version) to the Prefect flow run that made it."""
    run = current_flow_run()
    if run is None:
        return {}
    tags = {f"{prefix}.flow_run_id": run["id"], f"{prefix}.flow_run_name": run["name"]}
    if run.get("flow"):
        tags[f"{prefix}.flow"] = run["flow"]
    if run.get("url"):
        tags[f"{prefix}.flow_run_url"] = run["url"]
    if run.get("root_id"):
        tags[f"{prefix}.pipeline_run_id"] = run["root_id"]
        if run.get("root_url"):
            tags[f"{prefix}.pipeline_run_url"] = run["root_url"]
    return tags


def tag_flow_run(tags: list[str], flow_run_id: str | None = None, name: str | None = None) -> None:
    """Add `tags` to a flow run (this one by default), and rename it when `name` is given. A Prefect API that
    does not take it is said in a warning: a link is never worth a failed run."""
    from prefect.client.orchestration import get_client

    if flow_run_id is None:
        run = current_flow_run()
        if run is None:
            return
        flow_run_id = run["id"]
    try:
        with get_client(sync_client=True) as client:
            have = list(client.read_flow_run(flow_run_id).tags or [])
            wanted = have + [t for t in tags if t not in have]
            client.update_flow_run(flow_run_id, tags=wanted, **({"name": name} if name else {}))
    except Exception as e:  # noqa: BLE001 - a link, not a result
        log.warning("could not tag flow run %s with %s: %s: %s", flow_run_id, tags, type(e).__name__, e)


def run_name_of(config: Any) -> str:
    """What a pipeline or training run is about: its config's name (a config object, its dict, its YAML text or
    file's `name`, as the runs it starts say it), else the file's stem."""
    import yaml

    from shardline.core.config.load import is_inline

    name = getattr(config, "name", None)
    if name is None and isinstance(config, dict):
        name = config.get("name")
    inline = isinstance(config, str) and is_inline(config)
    if name is None and isinstance(config, str | Path):
        try:  # its YAML text (never the text itself: it may hold credentials), or the file's
            name = (yaml.safe_load(config if inline else Path(config).read_text()) or {}).get("name")
        except (OSError, yaml.YAMLError, AttributeError):
            name = None
        name = name or (None if inline else Path(str(config)).stem)
    return str(name or "shardline")


TRIAL_TAG = "shardline.sweep.trial"  # a sweep trial's MLflow tag: its id (t3), also in its training's flow run name


def flow_run_name(kind: str):
    """A `flow_run_name` callable for `@flow`: `<config name> · <kind> · <time>`, in place of Prefect's
    random names, so the runs list says what each run trains. A sweep trial's training says which trial it is
    (`demo · train t3 · ...`): trials train at once, and their log lines share the console."""

    def name() -> str:
        import datetime as dt

        from prefect.runtime import flow_run

        parameters = flow_run.parameters or {}
        trial = (parameters.get("mlflow_tags") or {}).get(TRIAL_TAG)
        what = f"{kind} {trial}" if trial else kind
        return f"{run_name_of(parameters.get('config'))} · {what} · {dt.datetime.now().strftime('%m-%d %H:%M')}"

    return name
