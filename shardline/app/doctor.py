"""`shardline doctor CONFIG`: check every dependency of a run before it starts, and say what is wrong.

One `Check` per dependency, in the order a run meets them: the config, the Prefect API, the training
and pipeline deployments and their work pools (a live worker on each), the raw data, the storage root
(a real write, read back and delete), MLflow (tracking and the model registry), torch on this machine,
and, when training is dispatched to a deployment, a tiny flow run on the training pool that reports
the GPU its worker sees (`flows/probe.py`). A check is `ok=True` (PASS), `False` (FAIL: the detail
says what to do) or `None` (SKIP: the detail says why). Every network check is bounded by `timeout`,
and no detail ever holds a secret: values of credential-like environment variables and passwords in
URLs are masked.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from shardline.core import layout, storage
from shardline.core.config import PipelineConfig
from shardline.core.secrets import redact_text

PROBE_DEPLOYMENT = "probe/probe"
PIPELINE_DEPLOYMENT = "pipeline/pipeline"
DEPLOY_HINT = "run `prefect --no-prompt deploy --all` in the project folder (prefect.yaml)"


@dataclass
class Check:
    name: str
    ok: bool | None  # True: PASS, False: FAIL, None: SKIP
    detail: str

    @property
    def mark(self) -> str:
        return {True: "PASS", False: "FAIL", None: "SKIP"}[self.ok]


# ---------------------------------------------------------------- no secret in any message


def redact(text: str) -> str:
    """`text` without secrets: by their names and URL userinfo (`shardline/core/secrets.py`), never by
    whatever other text happens to equal a credential's value (a bucket or a path stays readable)."""
    return redact_text(text)


def _short(e: BaseException, limit: int = 300) -> str:
    msg = " ".join(str(e).split()) or type(e).__name__
    msg = msg if len(msg) <= limit else msg[: limit - 3] + "..."
    return f"{type(e).__name__}: {msg}"


def _net_reason(e: BaseException) -> str:
    """A network failure in plain words when it is a common one, else the exception in short."""
    text = f"{type(e).__name__} {e}"
    for marks, words in (
        (("Connection refused", "Failed to establish a new connection", "ConnectionRefused"), "connection refused"),
        (
            ("Name or service not known", "nodename nor servname", "getaddrinfo failed", "NameResolution"),
            "the host name does not resolve",
        ),
        (("timed out", "Timeout", "TimeoutError"), "timed out"),
    ):
        if any(m in text for m in marks):
            return words
    return _short(e)


def _bounded(fn: Callable[[], Any], timeout: float) -> Any:
    """`fn()`, or TimeoutError when it has not answered within `timeout` seconds (it is left to finish
    in a daemon thread: a client stuck in its own retries must not hang the doctor)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e

    t = threading.Thread(target=target, daemon=True, name="shardline-doctor")
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise TimeoutError(f"no answer within {timeout:.0f} s")
    if "error" in box:
        raise box["error"]
    return box.get("value")


# ---------------------------------------------------------------- torch (here, and in the probe flow)


def describe_torch(r: dict) -> str:
    build = f"CUDA build {r['cuda_build']}" if r.get("cuda_build") else "CPU-only build"
    parts = [f"torch {r['torch']} ({build})"]
    if r.get("cuda_available"):
        gpus = ", ".join(
            f"{d['name']} (sm {d['capability']}, {d['memory_gb']} GiB, bf16 {'yes' if d['bf16'] else 'no'})"
            for d in r["devices"]
        )
        parts.append(f"{len(r['devices'])} GPU(s): {gpus}")
        if r.get("cudnn"):
            parts.append(f"cuDNN {r['cudnn']}")
    else:
        parts.append("no CUDA device visible")
    parts.append("MPS available" if r.get("mps_available") else "no MPS")
    if r.get("would_train_on"):
        parts.append(f"training.device={r['training_device']} -> {r['would_train_on']} in {r['precision']}")
    return "; ".join(parts)


def _local_torch(config: PipelineConfig) -> Check:
    try:
        from shardline.trainer.device import torch_report

        r = torch_report(config.training.device, config.training.precision)
    except Exception as e:  # noqa: BLE001
        return Check(
            "torch (here)", False, f"cannot import or query torch here: {_short(e)}; reinstall with ./scripts/setup"
        )
    detail = describe_torch(r)
    if r["cuda_available"] and r["cuda_op"] != "ok":
        return Check(
            "torch (here)",
            False,
            f"{detail}; but a CUDA operation failed: {r['cuda_op']} (driver and torch build mismatch?)",
        )
    if r["device_error"]:
        if config.compute.train_on == "local":
            return Check("torch (here)", False, r["device_error"])
        detail += f"; (training.device={config.training.device} would not work here, but training runs on the pool)"
    return Check("torch (here)", True, detail)


# ---------------------------------------------------------------- Prefect: API, deployments, pools, workers


def _prefect_label() -> tuple[str | None, str]:
    from prefect.settings import PREFECT_API_URL

    api = PREFECT_API_URL.value()
    return api, (api if api else "ephemeral (no server: a temporary local API for each run)")


def _worker_window(worker) -> float:
    return 3 * float(worker.heartbeat_interval_seconds or 30)


def _age(ts) -> float | None:
    if ts is None:
        return None
    if ts.tzinfo is None:
        ts = ts.replace(tzinfo=UTC)
    return (datetime.now(UTC) - ts).total_seconds()


def _ago(seconds: float | None) -> str:
    if seconds is None:
        return "never"
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


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


def _prefect_checks(config: PipelineConfig, timeout: float, add: Callable[..., None]):
    """Add the API, deployment and pool rows; return the training deployment to probe, or the probe's SKIP row."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    api, label = _prefect_label()
    remote = config.compute.train_on == "deployment"
    train_name = config.compute.train_deployment
    skip_local = "compute.train_on=local: training runs in the pipeline's own process"
    checks: list[Check] = []
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
                    pool_row = _pool_check(
                        client, train_dep.work_pool_name, "train pool", "on each GPU machine (from the project's .venv)"
                    )
                    checks.append(pool_row)
                    if not pool_row.ok:  # nobody would run the probe: do not wait probe_timeout for it
                        no_probe = f"needs a live worker on {train_dep.work_pool_name} (see above)"
            else:
                checks.append(Check("train deployment", None, skip_local))
            if _starts_nodes(config):
                checks.append(_node_check(client, config, api))

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
                    checks.append(_pool_check(client, pipe.work_pool_name, "pipeline pool", "on any machine"))
    except Exception as e:  # noqa: BLE001 - unreachable, refused, timed out, bad URL, refused credentials
        if checks:  # the API answered, a later request failed: say which, keep what was found
            add(*checks)
            done = {c.name for c in checks}
            step = next(
                n for n in ("train deployment", "train pool", "pipeline deployment", "pipeline pool") if n not in done
            )
            add(
                Check(
                    step,
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


def _gpu_probe(config: PipelineConfig, train_dep, probe_timeout: float) -> Check:
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


# ---------------------------------------------------------------- storage and data


def _endpoint() -> str:
    ep = (
        os.environ.get("AWS_ENDPOINT_URL_S3")
        or os.environ.get("AWS_ENDPOINT_URL")
        or os.environ.get("FSSPEC_S3_ENDPOINT_URL")
    )
    return ep or "AWS's default S3 endpoint"


def _storage_hint(e: BaseException, uri: str) -> str:
    text = f"{type(e).__name__} {e}"
    if not storage.is_remote(uri):
        if isinstance(e, PermissionError):
            return "this user may not write there: fix the folder's permissions or set storage.root to another folder"
        if isinstance(e, OSError) and "No space" in text:
            return "the disk is full"
        return "check that the folder can be created and written (storage.root)"
    bucket = uri.split("://", 1)[1].split("/", 1)[0]
    if isinstance(e, TimeoutError):
        return (
            f"{_endpoint()} did not answer: check AWS_ENDPOINT_URL (for MinIO and other S3-compatible stores; unset "
            "it for AWS) "
            "and the network; botocore retries (AWS_MAX_ATTEMPTS, AWS_RETRY_MODE) can make a dead endpoint slow to fail"
        )
    if any(s in text for s in ("NoCredentials", "Unable to locate credentials", "PartialCredentials")):
        return (
            "no S3 credentials were found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, or "
            "give the machine a role)"
        )
    if any(
        s in text
        for s in (
            "EndpointConnectionError",
            "Could not connect",
            "Connection refused",
            "ConnectTimeout",
            "Cannot connect",
            "Name or service not known",
            "nodename nor servname",
            "ConnectionError",
        )
    ):
        return (
            f"cannot connect to {_endpoint()}: is the server up? AWS_ENDPOINT_URL names an S3-compatible endpoint "
            "(MinIO, ...); unset it for AWS"
        )
    if any(
        s in text
        for s in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "Forbidden", "403", "ExpiredToken")
    ) or isinstance(e, PermissionError):
        return (
            "access denied: check the credentials (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, AWS_PROFILE or the "
            "role) "
            f"and that they may read and write {bucket}"
        )
    if "NoSuchBucket" in text or isinstance(e, FileNotFoundError):
        return (
            f"bucket {bucket} does not exist at {_endpoint()}: create it (`aws s3 mb s3://{bucket}`) or fix "
            "storage.root"
        )
    return f"check the credentials (AWS_* variables, AWS_PROFILE or the role) and the endpoint ({_endpoint()})"


def _storage_check(config: PipelineConfig, timeout: float) -> Check:
    root = config.storage.root
    shown = root if storage.is_remote(root) else os.path.abspath(storage.local_path(root))
    probe = layout.doctor_probe(root, uuid.uuid4().hex)
    payload = f"shardline doctor {uuid.uuid4().hex} {time.time()}".encode()

    def round_trip() -> float:
        t0 = time.monotonic()
        storage.write_bytes(probe, payload)
        back = storage.read_bytes(probe)
        if back != payload:
            raise OSError(f"read back {len(back)} bytes that differ from the {len(payload)} written")
        if storage.is_remote(probe):
            fs, path = storage.filesystem(probe)
            fs.rm(path)
        else:
            os.remove(storage.local_path(probe))
            try:
                os.rmdir(os.path.dirname(storage.local_path(probe)))
            except OSError:
                pass
        if storage.exists(probe):
            raise OSError("the probe object is still there after deleting it")
        return time.monotonic() - t0

    try:
        took = _bounded(round_trip, timeout)
    except Exception as e:  # noqa: BLE001
        return Check(
            "storage",
            False,
            f"storage.root {shown}: a write, read back and delete failed ({_short(e)}); {_storage_hint(e, root)}",
        )
    where = f" via {_endpoint()}" if storage.is_remote(root) else ""
    return Check("storage", True, f"{shown}{where}: wrote, read back and deleted a probe object ({took * 1000:.0f} ms)")


def _data_check(config: PipelineConfig, timeout: float) -> Check:
    from shardline.tasks.ingest import list_source

    source = config.data.source
    try:
        files = _bounded(lambda: list_source(source), timeout)
    except Exception as e:  # noqa: BLE001
        return Check("data source", False, f"cannot list data.source {source}: {_short(e)}; {_storage_hint(e, source)}")
    if not files:
        return Check("data source", False, f"no parquet file matches data.source {source}: check the path or glob")
    from shardline.tasks.ingest import first_file_problems

    try:  # one footer: the columns the config names are there, with types that fit
        first, problems = _bounded(lambda: first_file_problems(config.data), timeout)
    except Exception as e:  # noqa: BLE001
        return Check("data source", False, f"cannot read {files[0]}: {_short(e)}; {_storage_hint(e, source)}")
    if problems:
        return Check("data source", False, f"{first} does not fit the config: " + "; ".join(problems))
    return Check("data source", True, f"{len(files)} parquet file(s) match {source}; the columns fit {first}")


# ---------------------------------------------------------------- MLflow


def _mlflow_checks(config: PipelineConfig, timeout: float) -> list[Check]:
    from shardline.core.tracking.tracker import _configure_http_failfast, tracking_uri

    cfg = config.mlflow
    try:
        uri = tracking_uri(cfg, config.storage.root)
    except ValueError as e:
        return [
            Check("mlflow tracking", False, str(e)),
            Check("mlflow registry", None, "needs a tracking URI (see above)"),
        ]
    source = (
        "mlflow.tracking_uri"
        if cfg.tracking_uri
        else (
            "$MLFLOW_TRACKING_URI"
            if os.environ.get("MLFLOW_TRACKING_URI")
            else "the default: SQLite under storage.root"
        )
    )
    _configure_http_failfast()  # as the pipeline does: a dead server fails in seconds, not minutes
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    try:
        exp = _bounded(
            lambda: (client.search_experiments(max_results=1), client.get_experiment_by_name(cfg.experiment))[1],
            timeout,
        )
    except Exception as e:  # noqa: BLE001
        hint = (
            "is the MLflow server up (`mlflow server ...`) and is the address right? Credentials come from "
            "MLFLOW_TRACKING_USERNAME/PASSWORD or MLFLOW_TRACKING_TOKEN"
            if uri.startswith(("http://", "https://"))
            else "check the database URI, that its folder exists and is writable"
        )
        return [
            Check("mlflow tracking", False, f"cannot reach MLflow at {uri} ({source}): {_net_reason(e)}; {hint}"),
            Check("mlflow registry", None, "needs MLflow tracking (see above)"),
        ]
    exp_note = (
        f"experiment {cfg.experiment} exists (id {exp.experiment_id})"
        if exp is not None
        else f"experiment {cfg.experiment} will be created by the first run"
    )
    checks = [Check("mlflow tracking", True, f"{uri} ({source}): reachable; {exp_note}")]

    def registry() -> str:
        from mlflow.exceptions import MlflowException

        client.search_registered_models(max_results=1)
        try:
            model = client.get_registered_model(cfg.model_name)
        except MlflowException as e:
            if "RESOURCE_DOES_NOT_EXIST" in str(getattr(e, "error_code", "")) or "not found" in str(e).lower():
                return (
                    f"usable; model {cfg.model_name} has no version yet (the first run registers it and makes it "
                    "@champion)"
                )
            raise
        versions = client.search_model_versions(f"name='{cfg.model_name}'", max_results=1000)
        aliases = getattr(model, "aliases", None) or {}
        champion = f"@champion is version {aliases['champion']}" if "champion" in aliases else "no @champion alias yet"
        return f"usable; model {cfg.model_name} has {len(versions)} version(s), {champion}"

    try:
        checks.append(Check("mlflow registry", True, _bounded(registry, timeout)))
    except Exception as e:  # noqa: BLE001
        checks.append(
            Check(
                "mlflow registry",
                False,
                f"the model registry at {uri} is not usable: {_short(e)}; "
                "the registry needs a database-backed store (SQLite, Postgres, MySQL) or a server with one",
            )
        )
    return checks


# ---------------------------------------------------------------- all of it


def doctor(
    config: PipelineConfig,
    timeout: float = 30.0,
    probe_timeout: float = 300.0,
    source: str | None = None,
    on_check: Callable[[Check], None] | None = None,
) -> list[Check]:
    """Every check, in order; `on_check` sees each one as soon as it is done (the GPU probe takes a while)."""
    done: list[Check] = []

    def add(*checks: Check) -> None:
        for chk in checks:
            chk.detail = redact(chk.detail)
            done.append(chk)
            if on_check is not None:
                on_check(chk)

    def guarded(name: str, fn: Callable[[], Any]) -> Any:
        """`fn()`'s value; a bug in a check is a failed row, not a crash of the doctor."""
        try:
            return fn()
        except Exception as e:  # noqa: BLE001
            add(Check(name, False, f"the check itself failed: {_short(e)}"))
            return None

    def row(name: str, fn: Callable[[], Check | list[Check]]) -> None:
        out = guarded(name, fn)
        if out is not None:
            add(*(out if isinstance(out, list) else [out]))

    c = config.compute
    where = (
        f"training dispatched to {c.train_deployment}"
        if c.train_on == "deployment"
        else "training in the pipeline's process"
    )
    add(
        Check(
            "config",
            True,
            f"{source + ': ' if source else ''}valid; name {config.name}, hash {config.hash()[:12]}, {where}",
        )
    )
    probe = guarded("prefect api", lambda: _prefect_checks(config, timeout, add))
    row("data source", lambda: _data_check(config, timeout))
    row("storage", lambda: _storage_check(config, timeout))
    row("mlflow tracking", lambda: _mlflow_checks(config, timeout))
    row("torch (here)", lambda: _local_torch(config))
    # the probe goes last: a flow run on the pool takes a while (worker pickup, process start-up)
    if isinstance(probe, Check):
        add(probe)
    elif probe is not None:
        row("gpu probe", lambda: _gpu_probe(config, probe, probe_timeout))
    return done
