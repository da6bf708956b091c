"""`shardline doctor`'s Prefect checks: the API, the training and pipeline deployments and their work pools (a live
worker on each), the nodes a training on several machines starts, and a tiny flow run on the training pool that
reports the GPU its worker sees (`flows/probe.py`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime

from shardline.app.doctor_checks import (
    DEPLOY_HINT,
    PIPELINE_DEPLOYMENT,
    PROBE_DEPLOYMENT,
    Check,
    _net_reason,
    _short,
    describe_torch,
)
from shardline.core.config import PipelineConfig
from shardline.core.metrics.report import format_duration

# ---------------------------------------------------------------- Prefect: API, deployments, pools, workers


def _worker_window(worker) -> float:
    return 3 * float(worker.heartbeat_interval_seconds or 30)


def _age(ts) -> float | None:
    if ts is None:
        return None
    if ts.tzinfo is None:
        ts = ts.replace(tzinfo=UTC)
    return (datetime.now(UTC) - ts).total_seconds()


def _ago(seconds: float | None) -> str:
    return "never" if seconds is None else f"{format_duration(seconds)} ago"


def _pool_check(client, name: str, label: str, where: str) -> Check:
    from prefect.exceptions import ObjectNotFound

    try:
        pool = client.read_work_pool(name)
    except ObjectNotFound:
        return Check(
            label,
            False,
            f"work pool {name} does not exist: create it with `prefect work-pool create --type process {name}` "
            "(or another type: deploy/README.md)",
        )
    if pool.is_paused:
        return Check(
            label, False, f"work pool {name} is paused: no run starts there; `prefect work-pool resume {name}`"
        )
    if pool.type.endswith(":push") or pool.type == "prefect:managed":
        return Check(label, True, f"{name} ({pool.type}): a push pool, no worker needed")
    live, stale, window = _workers(client, name)
    if not live:
        seen = "; last seen: " + ", ".join(f"{w.name} {_ago(a)}" for w, a in stale[:3]) if stale else ""
        return Check(
            label,
            False,
            f"no worker has polled {name} in the last {window:.0f} s{seen}: start one with "
            f"`prefect worker start --pool {name}` {where}",
        )
    names = ", ".join(f"{w.name} (last heartbeat {_ago(a)})" for w, a in live[:5])
    return Check(label, True, f"{name} ({pool.type}): {len(live)} live worker(s): {names}")


def _workers(client, name: str) -> tuple[list, list, float]:
    """The workers of pool `name` that polled it lately (live) and the others, each with its age, and the window."""
    workers = client.read_workers_for_work_pool(name)
    live, stale = [], []
    for w in workers:
        age = _age(w.last_heartbeat_time)
        status = str(getattr(w.status, "value", w.status)).upper()
        (live if status == "ONLINE" and age is not None and age <= _worker_window(w) else stale).append((w, age))
    return live, stale, _worker_window(workers[0]) if workers else 90


def _starts_nodes(config: PipelineConfig) -> bool:
    """Whether a training of this config starts its other nodes as flow runs (not a launcher's machines)."""
    return config.compute.nodes > 1 and config.compute.train_on != "launcher"


def _node_check(client, config: PipelineConfig, api: str) -> Check:
    """The node deployment a training on several machines starts its other nodes with, and its pool's workers."""
    from shardline.launch.nodes import others

    c = config.compute
    dep = _deployment(client, c.node_deployment)
    if dep is None or not dep.work_pool_name:
        why = "does not exist" if dep is None else "has no work pool"
        return Check(
            "node deployment",
            False,
            f"deployment {c.node_deployment} (compute.node_deployment) {why} on {api}: compute.nodes={c.nodes} "
            f"starts {others(c.nodes)} as its flow run(s); {DEPLOY_HINT}",
        )
    pool = _pool_check(client, dep.work_pool_name, "node deployment", "on each training machine")
    if not pool.ok:
        return pool
    train = _deployment(client, c.train_deployment) if c.train_on == "deployment" else None
    shared = train is not None and train.work_pool_name == dep.work_pool_name  # the training run is node 0 there
    needed = c.nodes if shared else c.nodes - 1
    if client.read_work_pool(dep.work_pool_name).type == "process":  # a process worker: one machine
        live = len(_workers(client, dep.work_pool_name)[0])
        if live < needed:
            return Check(
                "node deployment",
                False,
                f"compute.nodes={c.nodes}: a training takes {needed} of its machines at once "
                f"({'the training run and ' if shared else ''}{others(c.nodes)}) on pool {dep.work_pool_name}, "
                f"where {live} live worker(s) poll; the other node run(s) would wait for a worker until "
                f"torchrun's rendezvous times out: start a worker of {dep.work_pool_name} on "
                f"{needed - live} more machine(s), or lower compute.nodes",
            )
    return Check(
        "node deployment",
        True,
        f"{c.node_deployment} on pool {dep.work_pool_name}: {pool.detail}; a training takes {c.nodes} of its "
        "machines at once (node 0 is the training run), which must reach node 0 over TCP",
    )


def _deployment(client, name: str):
    from prefect.exceptions import ObjectNotFound

    try:
        return client.read_deployment_by_name(name)
    except ObjectNotFound:
        return None


def _merged_job_variables(base: dict | None, override: dict | None) -> dict:
    out = dict(base or {})
    for k, v in (override or {}).items():
        out[k] = {**(out.get(k) or {}), **v} if k == "env" and isinstance(v, dict) else v
    return out


def prefect_checks(config: PipelineConfig, timeout: float, add: Callable[..., None]):
    """Add the API, deployment and pool rows; return the training deployment to probe, or the probe's SKIP row."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    api = PREFECT_API_URL.value()
    label = api or "ephemeral (no server: a temporary local API for each run)"
    remote = config.compute.train_on == "deployment"
    train_name = config.compute.train_deployment
    skip_local = "compute.train_on=local: training runs in the pipeline's own process"
    checks: list[Check] = []
    doing = "prefect api"  # the row a failed request belongs to
    try:
        with (
            temporary_settings({PREFECT_CLIENT_MAX_RETRIES: 0}),
            get_client(sync_client=True, httpx_settings={"timeout": timeout}) as client,
        ):
            error = client.api_healthcheck()
            if error is not None:
                raise error
            try:
                version = client.api_version()
            except Exception:  # noqa: BLE001 - the version is informational
                version = "unknown"
            checks.append(Check("prefect api", True, f"{label}: reachable, server version {version}"))
            if not api:
                if remote:
                    checks.append(
                        Check(
                            "train deployment",
                            False,
                            "compute.train_on=deployment needs a Prefect server with a worker on the GPU pool: "
                            "set PREFECT_API_URL (e.g. http://<server>:4200/api), or use train_on: local",
                        )
                    )
                else:
                    checks.append(Check("train deployment", None, skip_local))
                if _starts_nodes(config):
                    from shardline.launch.nodes import others

                    checks.append(
                        Check(
                            "node deployment",
                            False,
                            f"compute.nodes={config.compute.nodes}: {others(config.compute.nodes)} run(s) as "
                            f"flow runs of {config.compute.node_deployment} (compute.node_deployment) on a Prefect "
                            "server's work pool: set PREFECT_API_URL, or set compute.nodes: 1",
                        )
                    )
                checks.append(
                    Check(
                        "pipeline deployment",
                        None,
                        "no Prefect server (PREFECT_API_URL is not set): nothing is deployed on a temporary API",
                    )
                )
                add(*checks)
                return Check("gpu probe", None, "needs a Prefect server" if remote else skip_local)

            train_dep, no_probe = None, None
            doing = "train deployment"
            if remote:
                train_dep = _deployment(client, train_name)
                if train_dep is None:
                    checks.append(
                        Check(
                            "train deployment",
                            False,
                            f"deployment {train_name} (compute.train_deployment) does not exist on {api}: "
                            f"{DEPLOY_HINT}",
                        )
                    )
                elif not train_dep.work_pool_name:
                    checks.append(
                        Check(
                            "train deployment",
                            False,
                            f"deployment {train_name} has no work pool: set work_pool in prefect.yaml, then "
                            f"{DEPLOY_HINT}",
                        )
                    )
                    train_dep = None
                else:
                    paused = (
                        "; it is paused (runs started by the pipeline still go)"
                        if getattr(train_dep, "paused", False)
                        else ""
                    )
                    checks.append(
                        Check(
                            "train deployment",
                            True,
                            f"{train_name} on pool {train_dep.work_pool_name} "
                            f"(entrypoint {train_dep.entrypoint}){paused}",
                        )
                    )
                    doing = "train pool"
                    pool_row = _pool_check(
                        client, train_dep.work_pool_name, "train pool", "on each GPU machine (from the project's .venv)"
                    )
                    checks.append(pool_row)
                    if not pool_row.ok:  # nobody would run the probe: do not wait probe_timeout for it
                        no_probe = f"needs a live worker on {train_dep.work_pool_name} (see above)"
            else:
                checks.append(Check("train deployment", None, skip_local))
            if _starts_nodes(config):
                doing = "node deployment"
                checks.append(_node_check(client, config, api))

            doing = "pipeline deployment"
            pipe = _deployment(client, PIPELINE_DEPLOYMENT)
            if pipe is None:
                checks.append(
                    Check(
                        "pipeline deployment",
                        None,
                        f"{PIPELINE_DEPLOYMENT} is not deployed: fine for `shardline run` on this machine; "
                        f"for scheduled runs (the nightly retrain) {DEPLOY_HINT}",
                    )
                )
            else:
                checks.append(
                    Check("pipeline deployment", True, f"{PIPELINE_DEPLOYMENT} on pool {pipe.work_pool_name}")
                )
                if pipe.work_pool_name and not (
                    train_dep is not None and pipe.work_pool_name == train_dep.work_pool_name
                ):
                    doing = "pipeline pool"
                    checks.append(_pool_check(client, pipe.work_pool_name, "pipeline pool", "on any machine"))
    except Exception as e:  # noqa: BLE001 - unreachable, refused, timed out, bad URL, refused credentials
        if checks:  # the API answered, a later request failed: say which, keep what was found
            add(*checks)
            add(
                Check(
                    doing,
                    False,
                    f"reading it from {label} failed: {_short(e)}; check PREFECT_API_KEY / the server's logs",
                )
            )
            return Check("gpu probe", None, "needs the Prefect API (see above)")
        if "404" in str(e):
            hint = "that address answers but is not a Prefect API: PREFECT_API_URL usually ends in /api"
        elif any(code in str(e) for code in ("401", "403")):
            hint = "the API refused the credentials: check PREFECT_API_KEY (or PREFECT_API_AUTH_STRING)"
        elif api:
            hint = (
                "is `prefect server start` running there? Check PREFECT_API_URL (and PREFECT_API_KEY for Prefect Cloud)"
            )
        else:
            hint = (
                "the temporary API did not start: try again, or raise PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
            )
        found = "404 Not Found on /health" if "404" in str(e) else _net_reason(e)
        add(
            Check("prefect api", False, f"cannot reach the Prefect API at {label}: {found}; {hint}"),
            *[
                Check(name, None, "needs the Prefect API (see above)")
                for name in ("train deployment", "pipeline deployment")
            ],
        )
        return Check("gpu probe", None, "needs the Prefect API (see above)")
    add(*checks)
    if not remote:
        return Check("gpu probe", None, skip_local)
    if train_dep is None:
        return Check("gpu probe", None, f"needs the training deployment {train_name} (see above)")
    if no_probe:
        return Check("gpu probe", None, no_probe)
    return train_dep


def gpu_probe(config: PipelineConfig, train_dep, probe_timeout: float) -> Check:
    """A flow run of `probe/probe` on the training pool; its report, read back from its artifact."""
    import json

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey
    from prefect.deployments import run_deployment
    from prefect.states import Cancelled

    from shardline.flows.probe import ARTIFACT_KEY

    pool = train_dep.work_pool_name
    with get_client(sync_client=True) as client:
        probe_dep = _deployment(client, PROBE_DEPLOYMENT)
    if probe_dep is None:
        return Check("gpu probe", False, f"no {PROBE_DEPLOYMENT} deployment to run on {pool}: {DEPLOY_HINT}")
    same_pool = probe_dep.work_pool_name == pool
    # the training deployment's job variables (image, GPU request) and the config's per-run overrides,
    # so that the probe lands on the kind of machine training does
    jv = _merged_job_variables(train_dep.job_variables if same_pool else None, config.compute.job_variables)
    started = time.monotonic()
    flow_run = run_deployment(
        name=PROBE_DEPLOYMENT,
        parameters={"device": config.training.device, "precision": config.training.precision},
        job_variables=jv or None,
        timeout=probe_timeout,
        poll_interval=1,
        as_subflow=False,
        tags=["shardline", "doctor"],
    )
    took = time.monotonic() - started
    state = flow_run.state
    where = f"{PROBE_DEPLOYMENT} on {probe_dep.work_pool_name}"
    if state is None or not state.is_final():
        with get_client(sync_client=True) as client:
            try:  # do not leave it to run whenever a worker turns up
                client.set_flow_run_state(
                    flow_run.id, Cancelled(message="shardline doctor gave up waiting"), force=True
                )
            except Exception:  # noqa: BLE001
                pass
        status = state.name if state else "unknown"
        why = (
            "it started but did not finish: a slow start (an image pull, a cold node)? raise --probe-timeout"
            if state is not None and state.is_running()
            else f"no worker of {probe_dep.work_pool_name} took it (see the pool row); start one with "
            f"`prefect worker start --pool {probe_dep.work_pool_name}` on the GPU machine"
        )
        return Check(
            "gpu probe",
            False,
            f"the probe run {flow_run.name} on {probe_dep.work_pool_name} was still {status} "
            f"after {probe_timeout:.0f} s (cancelled it): {why}",
        )
    if not state.is_completed():
        return Check(
            "gpu probe",
            False,
            f"the probe run {flow_run.name} ({where}) ended {state.name}: {state.message}; "
            f"its logs: `prefect flow-run logs {flow_run.id}`",
        )
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run.id]), key=ArtifactFilterKey(any_=[ARTIFACT_KEY])
            )
        )
    if not artifacts:
        return Check("gpu probe", False, f"the probe run {flow_run.name} ({where}) finished but left no report")
    data = artifacts[0].data
    rows = json.loads(data) if isinstance(data, str) else data
    r = {row["field"]: row["value"] for row in rows}
    detail = f"{where}, worker host {r['host']}, answered in {took:.0f} s: {describe_torch(r)}"
    if not same_pool:
        return Check(
            "gpu probe",
            False,
            f"{detail}. But training runs on {pool}, not {probe_dep.work_pool_name}: set the probe "
            f"deployment's work_pool to {pool} in prefect.yaml, then {DEPLOY_HINT}",
        )
    if r["cuda_available"] and r["cuda_op"] != "ok":
        return Check(
            "gpu probe",
            False,
            f"{detail}; but a CUDA operation failed there: {r['cuda_op']} (driver and torch build mismatch?)",
        )
    if r["device_error"]:
        return Check("gpu probe", False, f"on {pool}'s worker {r['host']}: {r['device_error']}")
    if not r["cuda_available"] and config.training.device != "cpu":
        why = (
            "torch there is a CPU-only build: install a CUDA build of torch in the worker's environment "
            "(./scripts/setup with SHARDLINE_TORCH_INDEX, or the GPU image)"
            if not r.get("cuda_build")
            else f"torch there is built for CUDA {r['cuda_build']} but sees no device: check `nvidia-smi`, the driver, "
            "and the pool's GPU request (deploy/README.md)"
        )
        return Check(
            "gpu probe",
            False,
            f"no GPU visible on {pool}'s worker {r['host']}: training will run on CPU there; "
            f"{why}. Report: {describe_torch(r)}",
        )
    return Check("gpu probe", True, detail)
