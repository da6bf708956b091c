"""The local journal of one training run's MLflow calls, and the thread that sends it.

Every tracking call is a line of `mlflow-journal.jsonl` before MLflow sees it; a background
`Sender` delivers the lines in order, in batches, and marks what MLflow took with `{"sent": seq}`
lines. A server that is down or refusing costs the training thread one line written to a local
file: the sender backs off and, when the server answers again, sends what was kept. Replay is
idempotent: entries whose delivery is in doubt (a send that failed, a journal left by a process
that died) are checked against the server, one value per (metric key, step), params by key, the
run by a key tag, before they are sent.

Lines (JSON, one each):
  {"seq": 1, "op": "create", "experiment", "artifact_location", "run_name", "tags", "key"}
  {"seq": 2, "op": "resume"}                                     the run goes on (RUNNING)
  {"seq": 3, "op": "params", "params": {...}}
  {"seq": 4, "op": "tags", "tags": {...}}              (a tag set to null is taken off the run)
  {"seq": 5, "op": "metrics", "step": 10, "ts": ms, "metrics": {...}}
  {"seq": 6, "op": "dict", "data": {...}, "file": "name.json"}
  {"seq": 7, "op": "inputs", "datasets": [{name, digest, source_type, source, schema, profile, context}]}
  {"seq": 8, "op": "end", "status": "FINISHED", "ts": ms}
  {"run": "<MLflow run id>"}                                    the run these lines log to
  {"sent": 7}                                                   every entry up to seq 7 is done
  {"sent": 8, "rejected": "..."}                                entry 8 was refused for good (said once)
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardline.core import storage
from shardline.core.secrets import redact_text

log = logging.getLogger("shardline.core.tracking.tracker")

JOURNAL_FILE = "mlflow-journal.jsonl"
RUN_FILE = "mlflow-run.json"
RUN_KEY_TAG = "shardline.journal_key"  # finds a run whose creation was sent but never acknowledged

SEND_EVERY_S = 1.0  # one request a second at most while training, unless this many entries wait:
WAKE_AT = 500
MAX_VALUES = 1000  # MLflow's log_batch limit: 1000 metric values, 100 params, 100 tags a request
MAX_PARAMS = 100
BACKOFF_S = (1.0, 15.0)  # between tries while the server is away: doubling from the first to the second
URGENT_RETRY_S = 0.5  # while end() waits for the last entries
PROBE_TIMEOUT_S = 2.0
SAY_REFUSALS = 5  # entries MLflow refuses for good are said this many times, then only marked


def _short(e: BaseException) -> str:
    msg = " ".join(str(e).split())[:300] or type(e).__name__
    return redact_text(f"{type(e).__name__}: {msg}")


class Journal:
    """The journal file and the entries MLflow has not taken yet."""

    def __init__(self, path: Path, mirror: str | None = None):
        self.path = path
        self.mirror_uri = mirror  # the copy beside the checkpoints, when the run folder is remote
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.pending: deque[dict] = deque()
        self.seq = 0
        self.sent = 0
        self.run_id: str | None = None
        self.steps: dict[str, int] = {}  # the highest step journaled per metric key
        self.rejected = 0
        self._closed = False
        self._write_failed = False
        self._load()

    @classmethod
    def for_run_dir(cls, run_dir: str, store: str = "") -> Journal:
        """The journal of a run folder: in it when it is local; else a local file keyed by the folder, started
        from the folder's copy unless the local file already extends it (this machine went further)."""
        local, copy_uri = cls.files_of(run_dir, store)
        if copy_uri is None:
            return cls(local)
        try:
            copy = storage.read_bytes(copy_uri) if storage.exists(copy_uri) else None
        except OSError as e:
            log.warning("could not read the MLflow journal %s (%s); going on with %s", copy_uri, _short(e), local)
            copy = None
        if copy is not None:
            mine = local.read_bytes() if local.exists() else b""
            if not mine.startswith(copy):
                storage.write_bytes(str(local), copy)
        return cls(local, mirror=copy_uri)

    @staticmethod
    def files_of(run_dir: str, store: str = "") -> tuple[Path, str | None]:
        """The local journal file of a run folder, and the copy in the folder when the folder is remote. The
        local file is keyed by the folder and the tracking store (its address, credentials left out): a
        machine's cache outlives stores and folders (a content-addressed folder trained again against
        another MLflow store, or after gc) and must never resume a run of another store."""
        if not storage.is_remote(run_dir):
            return Path(storage.local_path(run_dir)) / JOURNAL_FILE, None
        from shardline.core.secrets import without_userinfo

        where = f"{run_dir.rstrip('/')}\n{without_userinfo(store)}"
        key = hashlib.sha256(where.encode()).hexdigest()[:24]
        return storage.cache_dir() / "mlflow-journals" / key / JOURNAL_FILE, storage.join(run_dir, JOURNAL_FILE)

    @classmethod
    def exists_for(cls, run_dir: str, store: str = "") -> bool:
        local, copy_uri = cls.files_of(run_dir, store)
        return local.exists() or (copy_uri is not None and storage.exists(copy_uri))

    # ---------------------------------------------------------------- the file

    def _load(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        data = self.path.read_bytes() if self.path.exists() else b""
        if data and not data.endswith(b"\n"):  # a line cut by a kill: it was never complete
            data = data[: data.rfind(b"\n") + 1]
            with open(self.path, "r+b") as f:
                f.truncate(len(data))
        entries, skipped = [], 0
        for raw in data.splitlines():
            try:
                line = json.loads(raw)
            except ValueError:
                skipped += 1
                continue
            if "seq" in line and "op" in line:
                entries.append(line)
                self.seq = max(self.seq, int(line["seq"]))
                if line["op"] == "metrics":
                    self._note_steps(line)
            elif "sent" in line:
                self.sent = max(self.sent, int(line["sent"]))
            elif "run" in line:
                self.run_id = line["run"]
            else:
                skipped += 1
        if skipped:
            log.warning("%s: %d line(s) of another format are not replayed", self.path, skipped)
        self.pending.extend(e for e in entries if e["seq"] > self.sent)
        self._file = open(self.path, "a")  # held open for the run; closed by close()

    def _write(self, line: dict) -> None:
        """Append one line (caller holds the lock). A full disk is said once and the entry kept in memory."""
        if self._closed:
            return
        try:
            self._file.write(json.dumps(line, default=str) + "\n")
            self._file.flush()
        except OSError as e:
            if not self._write_failed:
                self._write_failed = True
                log.warning("cannot write the MLflow journal %s (%s); entries are kept in memory", self.path, e)

    def _note_steps(self, entry: dict) -> None:
        for key in entry["metrics"]:
            if entry["step"] > self.steps.get(key, -1):
                self.steps[key] = entry["step"]

    # ---------------------------------------------------------------- entries and marks

    def append(self, entry: dict) -> int:
        with self.lock:
            self.seq += 1
            entry = {"seq": self.seq, **entry}
            self._write(entry)
            self.pending.append(entry)
            if entry["op"] == "metrics":
                self._note_steps(entry)
            if len(self.pending) in (1, WAKE_AT) or entry["op"] != "metrics":
                self.changed.notify_all()
            return self.seq

    def ack(self, seq: int, rejected: str | None = None) -> None:
        with self.lock:
            self._write({"sent": seq, **({"rejected": rejected} if rejected else {})})
            self.sent = max(self.sent, seq)
            self.rejected += rejected is not None
            while self.pending and self.pending[0]["seq"] <= self.sent:
                self.pending.popleft()
            self.changed.notify_all()

    def set_run(self, run_id: str) -> None:
        with self.lock:
            if run_id != self.run_id:
                self.run_id = run_id
                self._write({"run": run_id})

    def head(self, n: int) -> list[dict]:
        with self.lock:
            return list(itertools.islice(self.pending, n))

    def has_pending_create(self) -> bool:
        with self.lock:
            return any(e["op"] == "create" for e in self.pending)

    def left(self) -> dict[str, Any]:
        """What MLflow has not taken: metric values, params, and the run's end status if it is among them."""
        with self.lock:
            pending = list(self.pending)
        return {
            "entries": len(pending),
            "metrics": sum(len(e["metrics"]) for e in pending if e["op"] == "metrics"),
            "params": sum(len(e["params"]) for e in pending if e["op"] == "params"),
            "status": next((e["status"] for e in reversed(pending) if e["op"] == "end"), None),
        }

    def where(self) -> str:
        return self.mirror_uri or str(self.path)

    def mirror(self) -> None:
        """Copy the journal beside the checkpoints (a remote run folder): what a resumed run, or
        `shardline sync` on another machine, starts from."""
        if self.mirror_uri is None:
            return
        with self.lock:
            if not self._closed:
                self._file.flush()
            size = self.path.stat().st_size  # lines are appended whole under the lock: a line boundary
        with open(self.path, "rb") as f:
            data = f.read(size)
        storage.write_bytes(self.mirror_uri, data)

    def close(self) -> None:
        with self.lock:
            self._closed = True
            self._file.close()
            self.changed.notify_all()


def _reachable(uri: str) -> bool:
    """Whether anything answers at an HTTP tracking URI (any status counts: only the connection is probed)."""
    if not uri.startswith(("http://", "https://")):
        return True
    import requests

    try:
        requests.get(uri.rstrip("/") + "/health", timeout=PROBE_TIMEOUT_S)
        return True
    except requests.exceptions.SSLError:
        return True  # something answered; whether MLflow's own TLS settings take it is the send's to find out
    except requests.RequestException:
        return False


def _permanent(e: BaseException) -> bool:
    """A refusal that sending again will not change: the server read the request and rejected its content."""
    from mlflow.exceptions import MlflowException

    return isinstance(e, MlflowException) and e.get_http_status_code() in (400, 404)


class Sender:
    """Sends a journal's pending entries to MLflow in order, from a daemon thread (`start`) or in the
    caller's thread (`deliver`, for `shardline sync`). `check`: entries may already be on the server (a
    journal left by another process), so metrics are filtered by the server's (key, step) and the run is
    looked up by its key tag before it is created."""

    def __init__(self, journal: Journal, uri: str, on_run: Callable[[str], None], check: bool):
        from mlflow import MlflowClient

        self.journal = journal
        self.uri = uri
        self.client = MlflowClient(uri)
        self.on_run = on_run
        self.check = check
        self.known: dict[str, set[int]] = {}  # the server's steps per key, fetched while checking
        self.counts = {"metrics": 0, "skipped": 0, "params": 0}
        self.outage_since: float | None = None
        self.contacted = False
        self._backoff = BACKOFF_S[0]
        self._next_try = 0.0
        self._last_send = 0.0
        self._kick = False
        self._urgent = False
        self._stop = False
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- the thread

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="shardline-mlflow-sender", daemon=True)
        self._thread.start()

    def _due(self, now: float) -> float:
        if self.outage_since is not None:
            return min(self._next_try, self._last_send + URGENT_RETRY_S) if self._urgent else self._next_try
        if self._kick or len(self.journal.pending) >= WAKE_AT:
            return now
        return self._last_send + SEND_EVERY_S

    def _loop(self) -> None:
        cond = self.journal.changed
        while True:
            with cond:
                while not self._stop:
                    now = time.monotonic()
                    if self.journal.pending and now >= self._due(now):
                        break
                    cond.wait(timeout=max(0.05, self._due(now) - now) if self.journal.pending else None)
                if self._stop:
                    return
                self._kick = False
            self._attempt()

    def _attempt(self) -> None:
        self._last_send = time.monotonic()
        try:
            if not (self.contacted and self.outage_since is None) and not _reachable(self.uri):
                raise ConnectionError("nothing answers there")
            self.deliver()
        except Exception as e:  # noqa: BLE001 - any failure to send is kept and retried: training goes on
            self._failed(e)
        else:
            if self.outage_since is not None:
                log.warning(
                    "MLflow at %s answers again after %.0f s: the entries kept meanwhile are sent",
                    redact_text(self.uri),
                    time.monotonic() - self.outage_since,
                )
            self.outage_since = None
            self._backoff = BACKOFF_S[0]

    def _failed(self, e: BaseException) -> None:
        now = time.monotonic()
        self.check = True  # what was in flight may have landed: look before sending it again
        self.known.clear()
        if self.outage_since is None:
            self.outage_since = now
            log.warning(
                "MLflow at %s cannot be reached (%s); training goes on: every metric is kept in %s and sent "
                "when it answers",
                redact_text(self.uri),
                _short(e),
                self.journal.where(),
            )
        else:
            self._backoff = min(self._backoff * 2, BACKOFF_S[1])
        self._next_try = now + self._backoff
        with self.journal.changed:
            self.journal.changed.notify_all()

    def flush(self, timeout: float, until_outage: bool = False) -> bool:
        """Wait until every entry journaled so far is sent (True), `timeout` passes, or (`until_outage`)
        the server is found away (False). While waiting, a server that is away is tried every half second."""
        deadline = time.monotonic() + timeout
        cond = self.journal.changed
        with cond:
            target = self.journal.seq
            self._kick = True
            self._urgent = not until_outage
            cond.notify_all()
            try:
                while self.journal.sent < target:
                    left = deadline - time.monotonic()
                    if left <= 0 or (until_outage and self.outage_since is not None):
                        return False
                    cond.wait(left)
                return True
            finally:
                self._urgent = False

    def stop(self) -> None:
        with self.journal.changed:
            self._stop = True
            self.journal.changed.notify_all()
        if self._thread is not None:
            self._thread.join(5.0)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---------------------------------------------------------------- delivery, in order

    def deliver(self) -> None:
        """Send every pending entry, in order, acknowledging each group in the journal. Raises on the first
        failure that may pass (the entries stay pending); an entry refused for good is skipped and said."""
        while not self._stop:
            group = self._next_group()
            if not group:
                return
            try:
                self._send(group)
            except Exception as e:
                if not _permanent(e) or group[0]["op"] == "create":
                    raise
                self._one_by_one(group, e)
            else:
                self.journal.ack(group[-1]["seq"])
            self.contacted = True

    def _next_group(self) -> list[dict]:
        head = self.journal.head(MAX_VALUES)
        if not head or head[0]["op"] != "metrics":
            return head[:1]
        group, values = [], 0
        for entry in head:
            if entry["op"] != "metrics" or (group and values + len(entry["metrics"]) > MAX_VALUES):
                break
            group.append(entry)
            values += len(entry["metrics"])
        return group

    def _one_by_one(self, group: list[dict], first: BaseException) -> None:
        """A group refused for good: each entry alone, so that only what the server refuses is skipped."""
        for entry in group:
            try:
                if len(group) == 1:
                    raise first
                self._send([entry])
            except Exception as e:
                if not _permanent(e):
                    raise
                if self.journal.rejected < SAY_REFUSALS:
                    log.warning(
                        "MLflow refused journal entry %d (%s): it is skipped%s",
                        entry["seq"],
                        _short(e),
                        "; further refusals are only marked in the journal"
                        if self.journal.rejected == SAY_REFUSALS - 1
                        else "",
                    )
                self.journal.ack(entry["seq"], rejected=_short(e))
            else:
                self.journal.ack(entry["seq"])

    def _send(self, group: list[dict]) -> None:
        entry = group[0]
        op = entry["op"]
        if op == "create":
            self._create(entry)
            return
        run_id = self.journal.run_id
        if run_id is None:
            raise RuntimeError("the journal names no MLflow run and creates none")
        if op == "metrics":
            self._metrics(run_id, group)
        elif op == "params":
            self._params(run_id, entry["params"])
        elif op == "tags":
            from mlflow.entities import RunTag

            tags = [RunTag(k, str(v)) for k, v in entry["tags"].items() if v is not None]
            for i in range(0, len(tags), MAX_PARAMS):
                self.client.log_batch(run_id, tags=tags[i : i + MAX_PARAMS], synchronous=True)
            for k in [k for k, v in entry["tags"].items() if v is None]:  # None: the tag is taken off the run
                if k in self.client.get_run(run_id).data.tags:
                    self.client.delete_tag(run_id, k)
        elif op == "dict":
            self.client.log_dict(run_id, entry["data"], entry["file"])
        elif op == "inputs":  # a data set logged again (a replay) is the same input: MLflow keeps one
            from mlflow.entities import Dataset, DatasetInput, InputTag

            inputs = [
                DatasetInput(
                    Dataset(d["name"], d["digest"], d["source_type"], d["source"], d.get("schema"), d.get("profile")),
                    [InputTag("mlflow.data.context", d["context"])] if d.get("context") else [],
                )
                for d in entry["datasets"]
            ]
            try:
                self.client.log_inputs(run_id, datasets=inputs)
            except Exception as e:
                if not _permanent(e):
                    raise
                # runs that log the same data set at once (a sweep's trials) race on its one row in MLflow's store:
                # the run that inserts it second is refused (a unique constraint); the row is there now, and the
                # same call again links it to this run
                self.client.log_inputs(run_id, datasets=inputs)
        elif op == "resume":
            self.client.update_run(run_id, status="RUNNING")
        elif op == "end":
            self.client.set_terminated(run_id, status=entry["status"], end_time=entry["ts"])
        else:
            raise ValueError(f"journal entry {entry['seq']}: unknown op {op!r}")

    def _create(self, entry: dict) -> None:
        run_id = None
        if self.check:  # a creation that was sent before may have landed
            exp = self.client.get_experiment_by_name(entry["experiment"])
            if exp is not None:
                found = self.client.search_runs(
                    [exp.experiment_id], f"tags.`{RUN_KEY_TAG}` = '{entry['key']}'", max_results=1
                )
                run_id = found[0].info.run_id if found else None
        if run_id is None:
            tags = {**entry["tags"], RUN_KEY_TAG: entry["key"]}
            run = self.client.create_run(self._experiment_id(entry), run_name=entry["run_name"], tags=tags)
            run_id = run.info.run_id
        self.journal.set_run(run_id)
        self.on_run(run_id)

    def _experiment_id(self, entry: dict) -> str:
        from mlflow.exceptions import MlflowException

        exp = self.client.get_experiment_by_name(entry["experiment"])
        if exp is not None:
            return exp.experiment_id
        try:
            return self.client.create_experiment(entry["experiment"], artifact_location=entry["artifact_location"])
        except MlflowException as e:  # another process created it meanwhile
            exp = self.client.get_experiment_by_name(entry["experiment"])
            if exp is None:
                raise e from None
            return exp.experiment_id

    def _metrics(self, run_id: str, group: list[dict]) -> None:
        from mlflow.entities import Metric

        # a point is its step (a resumed run's replay of a step MLflow has is not sent again), or where the entry says
        # each call is its own (`Tracker.log_metrics(each=True)`: two interruptions resumed at one step), its step and
        # its time (an entry in doubt sent again is still one point)
        points = [
            (Metric(k, float(v), e["ts"], e["step"]), bool(e.get("each")))
            for e in group
            for k, v in e["metrics"].items()
        ]
        if self.check:
            for key in {m.key for m, _ in points} - self.known.keys():
                history = self.client.get_metric_history(run_id, key)
                self.known[key] = {m.step for m in history} | {(m.step, m.timestamp) for m in history}
            fresh = [
                (m, each) for m, each in points if ((m.step, m.timestamp) if each else m.step) not in self.known[m.key]
            ]
            self.counts["skipped"] += len(points) - len(fresh)
            points = fresh
        batch = [m for m, _ in points]
        if batch:
            self.client.log_batch(run_id, metrics=batch, synchronous=True)
        self.counts["metrics"] += len(batch)
        if self.check:
            for m in batch:
                self.known[m.key] |= {m.step, (m.step, m.timestamp)}

    def _params(self, run_id: str, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        have = self.client.get_run(run_id).data.params
        todo = [Param(k, v) for k, v in params.items() if k not in have]
        for i in range(0, len(todo), MAX_PARAMS):
            self.client.log_batch(run_id, params=todo[i : i + MAX_PARAMS], synchronous=True)
            self.counts["params"] += len(todo[i : i + MAX_PARAMS])
