"""MLflow access that never kills a run: a tracker that keeps going (and says so) when MLflow is down.

MLflow is imported lazily (it costs ~5 s of start-up) and driven through `MlflowClient` with explicit
run ids, so training threads and resumed runs never depend on a global "active run".
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from shardline.core import storage
from shardline.core.config import MlflowConfig
from shardline.core.secrets import has_masked_userinfo, redact_text, without_userinfo

log = logging.getLogger("shardline.core.tracking")


def tracking_uri(cfg: MlflowConfig, storage_root: str) -> str:
    if cfg.tracking_uri and has_masked_userinfo(cfg.tracking_uri):
        # a config that came through Prefect (a deployment's parameter) has its credentials masked: this
        # machine's own MLFLOW_TRACKING_URI, else the server's address with MLFLOW_TRACKING_USERNAME /
        # MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) from the environment, as MLflow reads them
        return os.environ.get("MLFLOW_TRACKING_URI") or without_userinfo(cfg.tracking_uri)
    if cfg.tracking_uri:
        return cfg.tracking_uri
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    if storage.is_remote(storage_root):
        raise ValueError(
            f"mlflow.tracking_uri must be set when storage.root is remote ({storage_root}); "
            "point it at your MLflow server (http://...) or a database URI"
        )
    root = Path(storage.local_path(storage_root)).resolve()
    root.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{root / 'mlflow.db'}"


@contextmanager
def fluent_tracking_uri(uri: str) -> Iterator[None]:
    """Point MLflow's fluent API (`mlflow.start_run`, `log_model`, `register_model`) at `uri` for a block.

    `mlflow.set_tracking_uri` also exports MLFLOW_TRACKING_URI to the whole process, so a worker that
    runs a second pipeline with another store would silently log into the first one's; this puts both
    the global and the variable back afterwards.
    """
    import mlflow
    from mlflow.tracking._tracking_service import utils

    previous = utils._tracking_uri
    previous_env = os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(previous)
        if previous_env is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)
        else:
            os.environ["MLFLOW_TRACKING_URI"] = previous_env


def artifact_location(storage_root: str) -> str:
    if storage.is_remote(storage_root):
        return storage.join(storage_root, "mlflow-artifacts")
    return (Path(storage.local_path(storage_root)).resolve() / "mlflow-artifacts").as_uri()


def _configure_http_failfast() -> None:
    # The MLflow default blocks ~4 minutes on an unreachable server (7 retries, backoff 2).
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")


class Tracker:
    """Logs to one MLflow run. Each call that fails is logged as a warning and kept in a local
    journal (so nothing is lost); after a failure, the tracker stops trying for this process."""

    def __init__(self, cfg: MlflowConfig, storage_root: str, journal: str | None = None):
        _configure_http_failfast()
        from mlflow import MlflowClient

        self.uri = tracking_uri(cfg, storage_root)
        self.cfg = cfg
        self.client = MlflowClient(self.uri)
        self.storage_root = storage_root
        self.run_id: str | None = None
        self.alive = True
        self.journal = journal

    def _guard(self, what: str, fn, *args, **kwargs) -> Any:
        if not self.alive:
            self._journal(what, args, kwargs)
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the tracker never kills a run
            self.alive = False
            log.warning(
                "MLflow %s failed (%s: %s); training goes on, metrics are kept in %s",
                what,
                type(e).__name__,
                redact_text(str(e)),
                self.journal,
            )
            self._journal(what, args, kwargs)
            return None

    def _journal(self, what: str, args, kwargs) -> None:
        if not self.journal:
            return
        line = json.dumps({"call": what, "args": args, "kwargs": kwargs}, default=str)
        try:
            Path(self.journal).parent.mkdir(parents=True, exist_ok=True)
            with open(self.journal, "a") as f:
                f.write(line + "\n")
        except OSError:
            pass

    def experiment_id(self) -> str:
        exp = self.client.get_experiment_by_name(self.cfg.experiment)
        if exp is not None:
            return exp.experiment_id
        return self.client.create_experiment(
            self.cfg.experiment, artifact_location=artifact_location(self.storage_root)
        )

    def start(self, run_id: str | None, run_name: str, tags: dict[str, str]) -> str | None:
        """Continue `run_id` if given (a resumed training), else create a new run."""
        if run_id:
            self.run_id = run_id
            self._guard("update_run", self.client.update_run, run_id, status="RUNNING")
            return run_id
        run = self._guard(
            "create_run", lambda: self.client.create_run(self.experiment_id(), run_name=run_name, tags=tags)
        )
        self.run_id = run.info.run_id if run is not None else None
        return self.run_id

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if not self.run_id:
            self._journal("log_metrics", (metrics, step), {})
            return
        import time

        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        batch = [Metric(k, float(v), ts, step) for k, v in metrics.items() if v is not None]
        self._guard("log_batch", self.client.log_batch, self.run_id, metrics=batch)

    def log_params(self, params: dict[str, Any]) -> None:
        if not self.run_id:
            return
        from mlflow.entities import Param

        existing = self._guard("get_run", self.client.get_run, self.run_id)
        have = existing.data.params if existing is not None else {}
        todo = [Param(k, str(v)[:6000]) for k, v in params.items() if k not in have]
        for i in range(0, len(todo), 100):
            self._guard("log_batch", self.client.log_batch, self.run_id, params=todo[i : i + 100])

    def set_tags(self, tags: dict[str, str]) -> None:
        if self.run_id:
            for k, v in tags.items():
                self._guard("set_tag", self.client.set_tag, self.run_id, k, v)

    def log_dict(self, data: dict, artifact_file: str) -> None:
        if self.run_id:
            self._guard("log_dict", self.client.log_dict, self.run_id, data, artifact_file)

    def last_step(self, key: str) -> int:
        """The highest step already logged for `key` in this run (-1 when none, or when MLflow is away)."""
        if not self.run_id:
            return -1
        history = self._guard("get_metric_history", self.client.get_metric_history, self.run_id, key)
        return max((m.step for m in history), default=-1) if history else -1

    def end(self, status: str = "FINISHED") -> None:
        if self.run_id:
            self._guard("set_terminated", self.client.set_terminated, self.run_id, status=status)


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out
