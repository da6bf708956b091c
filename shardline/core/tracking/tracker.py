"""MLflow access that never holds training up: a tracker that journals every call locally and sends it
from a background thread, and `sync_run`, which sends what a dead process left in a run's journal.

MLflow is imported lazily (it costs ~5 s of start-up) and driven through `MlflowClient` with explicit
run ids, so training threads and resumed runs never depend on a global "active run".
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardline.core import layout, storage
from shardline.core.config import MlflowConfig, settings
from shardline.core.secrets import has_masked_userinfo, redact_text, without_userinfo
from shardline.core.tracking.journal import JOURNAL_FILE, RUN_FILE, Journal, Sender, _reachable, _short

log = logging.getLogger("shardline.core.tracking.tracker")


class TrackingUnreachable(ConnectionError):
    """The MLflow server answered no connection where a step needs it (registration): said naming the URI and the
    setting, with what is kept (the trained, evaluated model: the same command again takes it from the cache)."""


def unreachable_tracking(uri: str, step: str) -> TrackingUnreachable | None:
    """A TrackingUnreachable for `step` when nothing answers at the HTTP tracking `uri` now (MLflow's own client
    has retried by then: MLFLOW_HTTP_REQUEST_MAX_RETRIES); None when something does, or it is no server."""
    if _reachable(uri):
        return None
    return TrackingUnreachable(
        f"MLflow at {redact_text(uri)} cannot be reached (mlflow.tracking_uri, else MLFLOW_TRACKING_URI), so the "
        f"{step} did not happen: is the server up and its address right? What came before is kept: run the same "
        "command again once it answers, and the steps before come from the cache"
    )


def unmasked(uri: str) -> str:
    """A URI whose credentials were masked (a config that came through Prefect, a run's recorded URI):
    this machine's own MLFLOW_TRACKING_URI, else the server's address with MLFLOW_TRACKING_USERNAME /
    MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) from the environment, as MLflow reads them."""
    if not has_masked_userinfo(uri):
        return uri
    return os.environ.get("MLFLOW_TRACKING_URI") or without_userinfo(uri)


def tracking_uri(cfg: MlflowConfig, storage_root: str) -> str:
    if cfg.tracking_uri:
        return unmasked(cfg.tracking_uri)
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
        return layout.mlflow_artifacts(storage_root)
    return (Path(storage.local_path(storage_root)).resolve() / layout.MLFLOW_ARTIFACTS).as_uri()


def mlflow_client_defaults(uri: str | None = None) -> None:
    """How this process talks to MLflow, unless its environment says otherwise."""
    # The MLflow default blocks ~4 minutes on an unreachable server (7 retries, backoff 2).
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
    # the logs are lines: no terminal bar for each download of a model's files (a registration's gate reads the
    # champion's, over a hundred files, three bars that filled the demo's output)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    if uri and redact_text(uri) != uri:
        # MLflow prints "View run <name> at <the URI, credentials included>" when a run ends
        os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")


START_WAIT_S = 30.0  # start() waits this long at most for the run to be created (it returns on an outage)


def read_run_file(run_dir: str) -> dict:
    """`mlflow-run.json` of a run folder: the MLflow run's id and tracking URI ({} when there is none)."""
    uri = storage.join(run_dir, RUN_FILE)
    return json.loads(storage.read_text(uri)) if storage.exists(uri) else {}


def write_run_file(run_dir: str, run_id: str, uri: str) -> None:
    """`mlflow-run.json`: the run's id, and its tracking URI without credentials (a file in the storage root)."""
    record = {"run_id": run_id, "tracking_uri": redact_text(uri)}
    storage.write_text(storage.join(run_dir, RUN_FILE), json.dumps(record))


def _set_journal_aside(run_dir: str, store: str) -> str | None:
    """Move a run folder's MLflow journal (the one in the folder) aside, named by the tracking store it was
    written for (`store`, credentials already left out): what it holds is that store's; returns where it went."""
    import hashlib

    journal = storage.join(run_dir, JOURNAL_FILE)
    if not storage.exists(journal):
        return None
    aside = f"{journal}.{hashlib.sha256(store.encode()).hexdigest()[:12]}"
    storage.write_bytes(aside, storage.read_bytes(journal))  # written whole before the journal goes
    storage.delete(journal)
    return aside


class Tracker:
    """Logs one training run to one MLflow run without ever holding training up: each call goes to the run's
    `Journal` (copied beside the checkpoints by `save_journal` when the run folder is remote), which a `Sender`
    thread delivers. What `end` could not deliver stays for the next attempt or `shardline sync RUN_DIR`."""

    def __init__(self, cfg: MlflowConfig, storage_root: str, run_dir: str):
        from mlflow import MlflowClient

        self.uri = tracking_uri(cfg, storage_root)
        mlflow_client_defaults(self.uri)
        self.cfg = cfg
        self.client = MlflowClient(self.uri)
        self.storage_root = storage_root
        self.run_dir = run_dir
        # how long `end` waits for MLflow by default: a bad value fails here, before training, not at its end
        self.flush_s = settings.number("SHARDLINE_MLFLOW_FLUSH_SECONDS")
        self.resumed = False
        self.journal: Journal | None = None
        self._sender: Sender | None = None
        self._ended = False

    @property
    def run_id(self) -> str | None:
        return self.journal.run_id

    def start(self, run_id: str | None = None, run_name: str = "", tags: dict[str, str] | None = None) -> str | None:
        """Continue `run_id`, or the run the run folder's journal or `mlflow-run.json` names (a resumed
        training), else create one. Returns the run id, or None while MLflow is away (the run is created
        when it answers; `run_id` says it then)."""
        recorded = read_run_file(self.run_dir)
        if recorded.get("tracking_uri") not in (None, redact_text(self.uri)):
            # the folder was trained against another MLflow store (its settings are not in the folder's address):
            # that store's run cannot be continued here; its journal is set aside and a new run is created
            set_aside = _set_journal_aside(self.run_dir, recorded["tracking_uri"])
            log.warning(
                "%s logged to MLflow run %s in another tracking store (%s); this one (%s) gets a new run%s",
                self.run_dir, recorded.get("run_id"), recorded["tracking_uri"], redact_text(self.uri),
                f" (that store's journal kept as {set_aside})" if set_aside else "",
            )  # fmt: skip
            recorded = {}
        self.journal = Journal.for_run_dir(self.run_dir, self.uri)
        run_id = run_id or self.journal.run_id or recorded.get("run_id")
        if run_id:
            self.journal.set_run(run_id)
        self.resumed = run_id is not None or self.journal.has_pending_create()
        if self.resumed:
            self.journal.append({"op": "resume"})
        else:
            self.journal.append(
                {
                    "op": "create",
                    "experiment": self.cfg.experiment,
                    "artifact_location": artifact_location(self.storage_root),
                    "run_name": run_name,
                    "tags": dict(tags or {}),
                    "key": uuid.uuid4().hex,
                }
            )
        if run_id and recorded.get("run_id") != run_id:
            self._record_run(run_id)
        self._sender = Sender(self.journal, self.uri, on_run=self._record_run, check=self.resumed)
        self._sender.start()
        self._sender.flush(START_WAIT_S, until_outage=True)
        return self.run_id

    def _record_run(self, run_id: str) -> None:
        try:
            write_run_file(self.run_dir, run_id, self.uri)
        except OSError as e:
            log.warning("could not write %s (%s)", storage.join(self.run_dir, RUN_FILE), redact_text(str(e)))

    def log_metrics(self, metrics: dict[str, float], step: int, each: bool = False) -> None:
        """`metrics` at `step`. A resumed run's step that MLflow has already is a replay, not sent again; `each`:
        every call is a point of its own, at a step that may repeat (two interruptions resumed at one checkpoint)."""
        values = {k: float(v) for k, v in metrics.items() if v is not None}
        if values:
            entry = {"op": "metrics", "step": int(step), "ts": int(time.time() * 1000), "metrics": values}
            self.journal.append({**entry, "each": True} if each else entry)

    def log_params(self, params: dict[str, Any]) -> None:
        # MLflow keeps a param's first value: a resumed run's are sent only where the run has none
        self.journal.append({"op": "params", "params": {k: str(v)[:6000] for k, v in params.items()}})

    def set_tags(self, tags: dict[str, str | None]) -> None:
        """Set the tags; one given as None is taken off the run."""
        self.journal.append({"op": "tags", "tags": {k: None if v is None else str(v) for k, v in tags.items()}})

    def log_dict(self, data: dict, artifact_file: str) -> None:
        self.journal.append({"op": "dict", "data": data, "file": artifact_file})

    def log_inputs(self, datasets: list[dict]) -> None:
        """Data sets the run read (MLflow's Dataset: name, digest, source_type, source, schema, profile as
        JSON text), each with its `context` (train, validation, test): the run page's Datasets panel."""
        self.journal.append({"op": "inputs", "datasets": datasets})

    def last_step(self, key: str) -> int:
        """The highest step logged for `key` in this run: in the journal, or on the server when it answers
        (-1 when none)."""
        best = self.journal.steps.get(key, -1)
        if self.run_id and self._sender.outage_since is None and _reachable(self.uri):
            try:
                history = self.client.get_metric_history(self.run_id, key)
                best = max([best, *(m.step for m in history)])
            except Exception as e:  # noqa: BLE001 - the tracker never kills a run: the journal's answer stands
                log.warning("could not read %s's history from MLflow (%s); the journal's stands", key, _short(e))
        return best

    def save_journal(self) -> None:
        """Copy the journal beside the checkpoints (a remote run folder; a local one holds it already)."""
        try:
            self.journal.mirror()
        except OSError as e:
            log.warning("could not copy the MLflow journal to %s (%s)", self.journal.mirror_uri, _short(e))

    def end(self, status: str = "FINISHED", wait: float | None = None) -> bool:
        """Journal the run's end status, wait up to `wait` seconds (default `SHARDLINE_MLFLOW_FLUSH_SECONDS`)
        for MLflow to take everything, stop the sender and keep the rest in the journal, said in one warning.
        True when everything was delivered."""
        if self._ended:
            return not self.journal.pending
        self._ended = True
        self.journal.append({"op": "end", "status": status, "ts": int(time.time() * 1000)})
        wait = self.flush_s if wait is None else wait
        done = self._sender.alive and self._sender.flush(wait)
        self._sender.stop()
        self.save_journal()
        self.journal.close()
        if not done:
            left = self.journal.left()
            what = f"{left['metrics']} metric value(s), {left['params']} param(s)"
            if left["status"]:
                what += f" and the run's end status {left['status']}"
            server = not local_store(self.uri)
            log.warning(
                "MLflow at %s did not take everything in %g s: %s are kept in %s; send them with `shardline sync %s%s`",
                redact_text(self.uri),
                wait,
                what,
                self.journal.where(),
                self.run_dir,
                f" --tracking-uri {redact_text(self.uri)}" if server else "",
            )
        return done


@dataclass
class SyncReport:
    run_id: str | None
    tracking_uri: str  # redacted: safe to print
    metrics: int  # metric values sent
    skipped: int  # metric values the server had already
    params: int
    left: int  # journal entries still not taken (refused ones are skipped, not left)
    status: str | None


def sync_run(run_dir: str, uri: str | None = None, missing_ok: bool = False) -> SyncReport | None:
    """Send what a run folder's journal still holds (a training process died, or MLflow came back after it
    ended). Idempotent: entries MLflow took are marked in the journal, and entries in doubt are checked
    against the server first. The tracking URI: `uri`, else `mlflow-run.json`'s, else the run's config."""
    recorded = read_run_file(run_dir)
    try:
        given = uri
        uri = unmasked(uri or recorded.get("tracking_uri") or _configured_uri(run_dir))  # this machine's credentials
        if given is None:  # read from the run's folder, shared storage: it must not choose where credentials go
            uri = trusted_uri(uri, run_dir)
    except ValueError:
        if Journal.exists_for(run_dir):  # a journal but no store named: say that; neither: say there is no journal
            raise
        uri = None
    if uri is None or not Journal.exists_for(run_dir, uri):
        if missing_ok:
            return None
        raise FileNotFoundError(f"{run_dir}: no MLflow journal ({JOURNAL_FILE}) there; is it a training run folder?")
    mlflow_client_defaults(uri)
    journal = Journal.for_run_dir(run_dir, uri)
    if journal.run_id is None and recorded.get("run_id"):
        journal.set_run(recorded["run_id"])
    sender = Sender(journal, uri, on_run=lambda run_id: write_run_file(run_dir, run_id, uri), check=True)
    before = (journal.sent, journal.run_id)
    try:
        sender.deliver()
    finally:
        journal.close()
        if (journal.sent, journal.run_id) != before:
            journal.mirror()
    status = None
    if journal.run_id:
        status = sender.client.get_run(journal.run_id).info.status
    return SyncReport(
        run_id=journal.run_id,
        tracking_uri=redact_text(uri),
        metrics=sender.counts["metrics"],
        skipped=sender.counts["skipped"],
        params=sender.counts["params"],
        left=journal.left()["entries"],
        status=status,
    )


def local_store(uri: str) -> bool:
    """Whether a tracking URI is a store on this machine (sqlite, a folder), not a server credentials go to."""
    return "://" not in uri or uri.split("://", 1)[0].lower() in ("sqlite", "file")


def trusted_uri(uri: str, run_dir: str) -> str:
    """A tracking URI read from a run's folder (its `mlflow-run.json` or config), which anyone who can write to the
    storage root can change: MLflow sends this machine's credentials (MLFLOW_TRACKING_USERNAME / PASSWORD / TOKEN)
    to the server it names. A local store (sqlite, a folder) is taken; a server only where it is this machine's own
    MLFLOW_TRACKING_URI; any other is refused, naming it, for `--tracking-uri` to confirm."""
    if local_store(uri):
        return uri
    mine = os.environ.get("MLFLOW_TRACKING_URI")
    if mine and without_userinfo(mine).rstrip("/") == without_userinfo(uri).rstrip("/"):
        return mine
    raise PermissionError(
        f"{run_dir} names the MLflow server {redact_text(without_userinfo(uri))}, which is not this machine's "
        "MLFLOW_TRACKING_URI: a file in shared storage does not choose where your MLflow credentials are sent. If "
        "it is your server, pass it: --tracking-uri URI (or set MLFLOW_TRACKING_URI)"
    )


def _configured_uri(run_dir: str) -> str:
    """The tracking URI of the config the run was trained with (`config.yaml` in its folder)."""
    import yaml

    from shardline.core.config import PipelineConfig

    config_uri = storage.join(run_dir, "config.yaml")
    if not storage.exists(config_uri):
        raise ValueError(
            f"{run_dir}: neither {RUN_FILE} nor config.yaml says which MLflow server to send to; pass --tracking-uri"
        )
    config = PipelineConfig.model_validate(yaml.safe_load(storage.read_text(config_uri)))
    return tracking_uri(config.mlflow, config.storage.root)


def ui_base(uri: str) -> str | None:
    """The web address of the MLflow UI that shows `uri`'s runs: the server itself for http(s) (without
    credentials); None for a store no server serves (a SQLite file: `ui_command` says how to open it)."""
    if not uri.startswith(("http://", "https://")):
        return None
    return without_userinfo(uri).rstrip("/")


def ui_command(uri: str) -> str | None:
    """The command that opens the MLflow UI on a store no server serves (a SQLite file, a folder)."""
    if uri.startswith(("http://", "https://")):
        return None
    return f"mlflow ui --backend-store-uri {redact_text(uri)}"


def run_page(uri: str, experiment_id: str, run_id: str, base: str = "http://127.0.0.1:5000") -> str:
    """The MLflow 3 UI's page of a run (on `ui_base(uri)`, else on `base`, where `ui_command` serves it)."""
    return f"{ui_base(uri) or base}/#/experiments/{experiment_id}/runs/{run_id}"


def model_version_page(uri: str, name: str, version: int | str, base: str = "http://127.0.0.1:5000") -> str:
    """The MLflow 3 UI's page of a registered model version."""
    from urllib.parse import quote

    return f"{ui_base(uri) or base}/#/models/{quote(name, safe='')}/versions/{version}"


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out
