"""`shardline doctor`'s checks other than Prefect's: the result row (`Check`, its detail never holding a secret), torch
on this machine, the storage root (a real write, read back and delete), the raw data, and MLflow (tracking and the
model registry)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardline.core import layout, storage
from shardline.core.config import PipelineConfig
from shardline.core.unreachable import s3_endpoint

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


# ---------------------------------------------------------------- storage and data


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
            f"{s3_endpoint()} did not answer: check AWS_ENDPOINT_URL (for MinIO and other S3-compatible stores; unset "
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
            f"cannot connect to {s3_endpoint()}: is the server up? AWS_ENDPOINT_URL names an S3-compatible endpoint "
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
            f"bucket {bucket} does not exist at {s3_endpoint()}: create it (`aws s3 mb s3://{bucket}`) or fix "
            "storage.root"
        )
    return f"check the credentials (AWS_* variables, AWS_PROFILE or the role) and the endpoint ({s3_endpoint()})"


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
        storage.delete(probe)
        if not storage.is_remote(probe):
            with contextlib.suppress(OSError):  # its folder, if now empty
                os.rmdir(os.path.dirname(storage.local_path(probe)))
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
    where = f" via {s3_endpoint()}" if storage.is_remote(root) else ""
    return Check("storage", True, f"{shown}{where}: wrote, read back and deleted a probe object ({took * 1000:.0f} ms)")


def _data_check(config: PipelineConfig, timeout: float) -> Check:
    from shardline.core.listing import list_source

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
    from shardline.core.tracking.tracker import mlflow_client_defaults, tracking_uri

    cfg = config.mlflow
    try:
        uri = tracking_uri(cfg, config.storage.root)
    except ValueError as e:
        return [
            Check("mlflow tracking", False, str(e)),
            Check("mlflow registry", None, "needs a tracking URI (see above)"),
        ]
    if cfg.tracking_uri:
        source = "mlflow.tracking_uri"
    elif os.environ.get("MLFLOW_TRACKING_URI"):
        source = "$MLFLOW_TRACKING_URI"
    else:
        source = "the default: SQLite under storage.root"
    db = uri.removeprefix("sqlite:///") if uri.startswith("sqlite:///") else None
    if db and not os.path.exists(db) and os.access(os.path.dirname(db) or ".", os.W_OK):  # MLflow would make it
        return [
            Check("mlflow tracking", True, f"{uri} ({source}): no database there yet: the first run creates it"),
            Check("mlflow registry", True, f"a new store: model {cfg.model_name} has no version yet (the first run "
                  "registers it and makes it @champion); if your team's runs are in a store, this URI is not it"),
        ]  # fmt: skip
    mlflow_client_defaults()  # as the pipeline does: a dead server fails in seconds, not minutes
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
