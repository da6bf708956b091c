"""A training on several machines under a launcher (a Kubeflow TrainJob, a JobSet): every node runs the same
`shardline run CONFIG`, with the rendezvous in its environment (PET_*, or MASTER_ADDR, MASTER_PORT and the node's
rank). Node 0 runs the pipeline: ingest, encode, train (its torchrun is node 0 of the launcher's rendezvous),
evaluate, register. Nodes 1..M-1 run no pipeline: they join each of node 0's torchruns (`join_launch` in
tasks/torchrun.py), their ranks taking rank 0's job over the process group, and end when node 0's pipeline does.

They meet in a folder of the storage root, `launches/<SHARDLINE_LAUNCH_ID>/`:

- `attempt-<k>.json`: node 0 is starting its k-th torchrun (the training step's retries are attempts too);
  rewritten with `"ended": true` when that torchrun has ended. A node joins the newest attempt not ended.
- `attempt-<k>/`: what the other machines read (the parent model's weights of a fine-tune, deleted when the
  attempt ends) and where their ranks write their errors (`failures/`), which node 0 reports.
- `end.json`: node 0's pipeline has ended, `{"status": "completed" | "failed" | "preempted" | ..., "exit": N}`;
  the other nodes exit with that status (0 when it completed).

SHARDLINE_LAUNCH_ID names one launch: the same on every node of it and another for each launch, or a node could
join a finished launch's attempts (deploy/trainjob.yaml sets it from the Job's uid)."""

from __future__ import annotations

import json
import os
import re
import time

from shardline.core import storage

LAUNCH_ID = "SHARDLINE_LAUNCH_ID"
JOIN_TIMEOUT = "SHARDLINE_JOIN_TIMEOUT"  # how long a node waits for node 0's next torchrun or its pipeline's end
DEFAULT_JOIN_SECONDS = 6 * 3600  # node 0 ingests and encodes before it trains: hours, on a big data set
_RANK_VARIABLES = ("PET_NODE_RANK", "NODE_RANK", "GROUP_RANK", "JOB_COMPLETION_INDEX")
_ATTEMPT = re.compile(r"^attempt-(\d+)\.json$")


def node_rank(environ: dict[str, str] | None = None) -> int:
    """This node's rank in the launcher's environment (0 when it names none: torchrun then takes it from PET_*)."""
    env = os.environ if environ is None else environ
    for name in _RANK_VARIABLES:
        value = env.get(name, "").strip()
        if value:
            if not value.isdigit():
                raise ValueError(f"{name}={value!r}: a node's rank is a whole number (0 for the first node)")
            return int(value)
    return 0


def launch_folder(root: str, environ: dict[str, str] | None = None) -> str:
    """The launch's folder in the storage root, from SHARDLINE_LAUNCH_ID (refused when unset or unfit for a
    folder name)."""
    env = os.environ if environ is None else environ
    launch = env.get(LAUNCH_ID, "").strip()
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", launch):
        said = f"is {launch!r}" if launch else "is not set"
        raise ValueError(
            f"compute.nodes > 1 under a launcher (its rendezvous is in the environment): {LAUNCH_ID} {said}. Every "
            "node of one launch needs the same id, and each launch its own (letters, digits, '.', '_', '-'; at "
            "most 128): the nodes meet in launches/<id>/ in the storage root. deploy/trainjob.yaml sets it from "
            "the Job's uid"
        )
    return storage.join(root, "launches", launch)


def join_seconds(environ: dict[str, str] | None = None) -> float:
    env = os.environ if environ is None else environ
    raw = env.get(JOIN_TIMEOUT, "").strip()
    if not raw:
        return float(DEFAULT_JOIN_SECONDS)
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{JOIN_TIMEOUT}={raw!r}: seconds, more than 0 (default {DEFAULT_JOIN_SECONDS})")
    return value


def attempts(folder: str) -> dict[int, dict]:
    """The launch's attempts so far, by number."""
    found = {}
    for name in storage.names(folder) if storage.exists(folder) else []:
        match = _ATTEMPT.match(name)
        if match:
            try:
                found[int(match.group(1))] = json.loads(storage.read_text(storage.join(folder, name)))
            except (OSError, ValueError):
                continue  # being written
    return found


class Attempt:
    """Node 0's k-th torchrun of this launch: `announce` before it starts, `end` when it has ended."""

    def __init__(self, folder: str):
        self.folder = folder
        self.number = max(attempts(folder), default=0) + 1
        self.shared = storage.join(folder, f"attempt-{self.number}")
        self.failures = storage.join(self.shared, "failures")
        self._uri = storage.join(folder, f"attempt-{self.number}.json")
        self._put: list[str] = []

    def put(self, name: str, data: bytes) -> str:
        """`data` where the other nodes read it (deleted when the attempt ends: no copy of a parent model's
        weights is left in storage)."""
        uri = storage.join(self.shared, name)
        storage.write_bytes(uri, data)
        self._put.append(uri)
        return uri

    def announce(self) -> None:
        storage.write_text(self._uri, json.dumps({"attempt": self.number, "started": time.time(), "ended": False}))

    def end(self, exit_code: int | None) -> None:
        for uri in self._put:
            storage.delete(uri)
        storage.write_text(
            self._uri, json.dumps({"attempt": self.number, "ended": True, "exit": exit_code, "at": time.time()})
        )


def begin(folder: str) -> None:
    """Node 0's pipeline starts: an end of an earlier run of this launch (node 0's pod restarted) is cleared."""
    storage.delete(storage.join(folder, "end.json"))


def end(folder: str, status: str, exit_code: int) -> None:
    """Node 0's pipeline has ended: the other nodes stop waiting and exit with `exit_code`."""
    storage.write_text(
        storage.join(folder, "end.json"), json.dumps({"status": status, "exit": exit_code, "at": time.time()})
    )


def ended(folder: str) -> dict | None:
    uri = storage.join(folder, "end.json")
    try:
        return json.loads(storage.read_text(uri)) if storage.exists(uri) else None
    except (OSError, ValueError):
        return None
