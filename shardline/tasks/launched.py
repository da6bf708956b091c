"""A training on several machines under a launcher (a Kubeflow TrainJob, a JobSet): every node runs the same
`shardline run CONFIG`, with the rendezvous in its environment (PET_*, or MASTER_ADDR, MASTER_PORT and the node's
rank). Node 0 runs the pipeline: ingest, encode, train (its torchrun is node 0 of the launcher's rendezvous),
evaluate, register. Nodes 1..M-1 run no pipeline: they join each of node 0's torchruns (`join_launch` in
tasks/torchrun.py), their ranks taking rank 0's job over the process group, and end when node 0's pipeline does.

They meet in a folder of the storage root, `launches/<SHARDLINE_LAUNCH_ID>/`:

- `attempt-<k>.json`: node 0 is starting its k-th torchrun (the training step's retries are attempts too);
  rewritten with `"ended": true` when that torchrun has ended, or with `"abandoned": true` too when node 0 starts
  again (its pod restarted: the attempts its earlier process left open are over). A node joins the newest attempt
  not ended whose node 0 still holds its lease: a node whose pod restarted does not join an attempt node 0 left
  when its machine was lost (its torchrun would meet node 0's next one at the same rendezvous and be stopped in
  it, failing that attempt too).
- `attempt-<k>/`: what the other machines read (the parent model's weights of a fine-tune, deleted when the
  attempt ends) and where their ranks write their errors (`failures/`), which node 0 reports.
- `attempt-<k>/leases/node-<r>`: node r's lease while its torchrun of that attempt runs, renewed every third of
  its ttl; `attempt-<k>/nodes/node-<r>.json`: how that torchrun ended. Node 0 watches both while its own torchrun
  runs: a node whose torchrun failed (a rank killed, its GPU lost) or whose lease went silent (its machine gone)
  stops node 0's processes, which could otherwise wait in a collective on the lost peer for gloo's 30 minutes.
  The other nodes watch node 0's lease (`leases/node-0`) and `attempt-<k>.json` the same way
  (`watch_attempt_node0`): node 0's torchrun ended or its machine gone, they stop theirs.
- `present/node-<r>`: node r's lease while its `shardline run` of the launch runs. Before each torchrun node 0 waits
  until every node holds one (`wait_for_nodes`): a pod still pending while the cluster adds a GPU machine, or one
  restarted after its machine was lost, would otherwise fail torchrun's rendezvous after 10 minutes and spend one
  of the training's retries each time. It then waits until no node's torchrun of an earlier attempt still runs
  (its lease of that attempt released or expired): every torchrun at the launch's one rendezvous address is of
  the same attempt.
- `end.json`: node 0's pipeline has ended, `{"status": "completed" | "failed" | "preempted" | ..., "exit": N}`;
  the other nodes exit with that status (0 when it completed).

SHARDLINE_LAUNCH_ID names one launch: the same on every node of it and another for each launch, or a node could
join a finished launch's attempts (deploy/trainjob.yaml sets it from the Job's uid)."""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from shardline.core import storage
from shardline.core.lease import Lease, Silence, read_current
from shardline.tasks.nodes import (
    NODES_SAY_SECONDS,
    NODES_TIMEOUT,
    WATCH_SECONDS,
    NodesMissing,
    stop_without_peers,
    wait_while,
)

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


def next_attempt(folder: str) -> int:
    """The number node 0's next torchrun of the launch in `folder` gets."""
    return max(attempts(folder), default=0) + 1


def attempt_record(folder: str, number: int) -> str:
    """Where attempt `number` of the launch in `folder` is announced, and said ended."""
    return storage.join(folder, f"attempt-{number}.json")


def presence(folder: str, rank: int) -> str:
    """Where node `rank` (1..M-1) holds its lease while its `shardline run` of the launch in `folder` runs."""
    return storage.join(folder, "present", f"node-{rank}")


@contextmanager
def present_while(folder: str, rank: int, log: Callable[[str], None], wait: float) -> Iterator[Lease]:
    """Node `rank` holds its lease in `presence` while the block runs. Held by another process (an earlier `shardline
    run` of this node, its pod restarted on another machine; two pods given one rank), it is taken when that one's
    ends or expires; `LeaseHeld` after `wait` seconds."""
    lease = Lease(presence(folder, rank), f"node {rank} of the launch")
    lease.acquire(
        wait=wait,
        on_wait=lambda who: log(
            f"node {rank}: node {rank}'s place in the launch ({presence(folder, rank)}) is held by {who}: an "
            f"earlier run of node {rank}, or two nodes given rank {rank}? Waiting until it ends or expires"
        ),
    )
    try:
        yield lease
    finally:
        lease.release()


def absent(folder: str, nodes: int) -> list[int]:
    """The ranks of the other nodes of a launch on `nodes` machines that hold no live lease in `presence`: not
    started, ended (released), or gone (not renewed past its expiry)."""
    missing = []
    for rank in range(1, nodes):
        if not held(presence(folder, rank)):  # an unanswered read counts as absent
            missing.append(rank)
    return missing


def held(uri: str) -> bool | None:
    """Whether the lease in `uri` is held by its record: taken, not released and not past its expiry (this machine's
    clock, as `absent`); None when the store did not answer."""
    try:
        _, record = read_current(uri)
    except OSError:
        return None
    return bool(record) and not record.get("released") and record.get("expires_at", 0) > time.time()


def earlier_torchruns(folder: str, nodes: int, before: int) -> list[tuple[int, int]]:
    """(attempt, node rank) of the other nodes' torchruns of attempts before `before` that still hold their lease of
    the attempt (an unanswered read counts as held: asked again)."""
    return [
        (number, rank)
        for number in sorted(attempts(folder))
        if number < before
        for rank in range(1, nodes)
        if held(node_lease(attempt_folder(folder, number), rank)) is not False
    ]


def to_join(folder: str, joined: int) -> int | None:
    """On node 1..M-1, which has joined attempts up to `joined`: the attempt to join now, or None. The newest attempt
    not ended, once node 0 holds its lease of it: an attempt whose node 0 lease is released or expired was left by a
    node 0 that is gone (node 0 starting again ends it, `begin`)."""
    open_ones = [k for k, a in attempts(folder).items() if k > joined and not a.get("ended")]
    if not open_ones:
        return None
    newest = max(open_ones)
    return None if held(node_lease(attempt_folder(folder, newest), 0)) is False else newest


def _ranks(ranks: list[int]) -> str:
    return f"node {ranks[0]}" if len(ranks) == 1 else "nodes " + ", ".join(str(r) for r in ranks)


def wait_for_nodes(
    folder: str,
    nodes: int,
    log: Callable[[str], None],
    timeout: float,
    poll: float = 1.0,
    say_every: float = NODES_SAY_SECONDS,
) -> None:
    """Node 0, before a torchrun: wait until every other node of the launch runs (`absent` is empty), saying which
    it waits for every `say_every` seconds; `NodesMissing` after `timeout` seconds. torchrun's own rendezvous
    would wait 10 minutes for a missing node, then fail the attempt. Then wait, the same way, until no other node's
    torchrun of an earlier attempt runs (`earlier_torchruns` is empty): such a torchrun (a node that joined an
    attempt just before node 0 started again, or whose previous torchrun is still stopping) would meet the new one
    at the launch's one rendezvous address. Each is stopped by its node's watch of node 0 (`watch_attempt_node0`),
    or its lease expires within its ttl (its machine gone)."""
    if absent(folder, nodes):
        _wait_for_places(folder, nodes, log, timeout, poll, say_every)
    before = next_attempt(folder)

    def busy() -> str | None:
        found = earlier_torchruns(folder, nodes, before)
        return ", ".join(f"node {rank}'s torchrun of attempt {number}" for number, rank in found) or None

    first = busy()
    if first is None:
        return
    log(f"node 0 of a launch: waiting for {first} to end before attempt {before} (at most {timeout:.0f} s)")
    waited = wait_while(
        busy,
        timeout,
        poll,
        say_every,
        lambda what, waited: log(f"node 0 of a launch: still waiting for {what} to end ({waited:.0f} s)"),
        lambda what: NodesMissing(
            f"{what} did not end within {timeout:.0f} s ({NODES_TIMEOUT}): its node should stop it once node 0's "
            f"attempt ended. Is that node's `shardline run` stuck (kubectl logs)? The training's checkpoints stay: a "
            f"rerun resumes from the newest"
        ),
    )
    log(f"node 0 of a launch: the other nodes' earlier torchruns have ended ({waited:.0f} s)")


def _wait_for_places(
    folder: str, nodes: int, log: Callable[[str], None], timeout: float, poll: float, say_every: float
) -> None:
    missing = absent(folder, nodes)
    log(
        f"node 0 of a launch: waiting for {_ranks(missing)} of {nodes} to start before training (each node's "
        f"`shardline run` holds a lease in {storage.join(folder, 'present')}; at most {timeout:.0f} s, "
        f"{NODES_TIMEOUT})"
    )
    waited = wait_while(
        lambda: _ranks(m) if (m := absent(folder, nodes)) else None,
        timeout,
        poll,
        say_every,
        lambda what, waited: log(f"node 0 of a launch: still waiting for {what} ({waited:.0f} s)"),
        lambda what: NodesMissing(
            f"{what} of the launch did not start within {timeout:.0f} s ({NODES_TIMEOUT}), or stopped and did not "
            f"come back: no training started. Are their pods pending (kubectl get pods; a GPU machine the cluster "
            f"could not add)? Every node runs `shardline run` with the same {LAUNCH_ID} and a storage.root that all "
            f"of them see ({folder}). The training's checkpoints stay: a rerun resumes from the newest"
        ),
    )
    log(f"node 0 of a launch: all {nodes} nodes are running ({waited:.0f} s)")


def attempt_folder(folder: str, number: int) -> str:
    """The folder of attempt `number` of the launch in `folder`: what the other nodes read, where they write."""
    return storage.join(folder, f"attempt-{number}")


def node_lease(shared: str, rank: int) -> str:
    """Where node `rank` holds its lease while its torchrun of the attempt whose folder is `shared` runs."""
    return storage.join(shared, "leases", f"node-{rank}")


def node_holder(shared: str, rank: int) -> str:
    """Who holds `node_lease(shared, rank)`, in its record: node 0 tells this attempt's node from another."""
    return f"{shared}#node-{rank}"


def node_ended(shared: str, rank: int, exit_code: int, stopped: bool) -> None:
    """Node `rank`'s torchrun of the attempt in `shared` has ended with `exit_code`; `stopped`: its ranks stopped
    with the training (preempted or out of budget: node 0's ranks checkpointed), not on a failure."""
    uri = storage.join(shared, "nodes", f"node-{rank}.json")
    storage.write_text(uri, json.dumps({"rank": rank, "exit": exit_code, "stopped": stopped, "at": time.time()}))


def nodes_ended(shared: str) -> dict[int, dict]:
    """How the other nodes' torchruns of the attempt in `shared` ended, by node rank (those that have)."""
    folder, found = storage.join(shared, "nodes"), {}
    for name in storage.names(folder) if storage.exists(folder) else []:
        if re.fullmatch(r"node-\d+\.json", name):
            try:
                record = json.loads(storage.read_text(storage.join(folder, name)))
                found[int(record["rank"])] = record
            except (OSError, ValueError, KeyError, TypeError):
                continue
    return found


class Attempt:
    """Node 0's k-th torchrun of this launch: `announce` before it starts, `watch` while it runs, `end` when it has
    ended."""

    def __init__(self, folder: str):
        self.folder = folder
        self.number = next_attempt(folder)
        self.shared = attempt_folder(folder, self.number)
        self.failures = storage.join(self.shared, "failures")
        self._uri = attempt_record(folder, self.number)
        self._put: list[str] = []
        self._stop = threading.Event()
        self.lost: str | None = None  # what became of a node that stopped node 0's processes, in words
        self._lease: Lease | None = None

    def watch(self, proc, nodes: int, log: Callable[[str], None], grace: float, every: float = WATCH_SECONDS) -> None:
        """While node 0's torchrun `proc` runs (a thread): a node whose torchrun failed, or whose lease went silent
        past its ttl, stops `proc` (`stop_without_peers`, with `grace`) and is said in `lost`. Without it, node 0's
        ranks could wait on the lost peer in a collective for gloo's timeout (30 minutes), holding every machine;
        the training's retry resumes from the newest checkpoint."""

        def run() -> None:
            silences = {r: Silence(node_lease(self.shared, r), node_holder(self.shared, r)) for r in range(1, nodes)}
            while proc.poll() is None and not self._stop.wait(every):
                try:
                    ended = sorted(nodes_ended(self.shared).items())
                    failed = [(r, e) for r, e in ended if e.get("exit") != 0 and not e.get("stopped")]
                    said = (
                        f"node {failed[0][0]}'s torchrun ended with exit status {failed[0][1]['exit']}"
                        if failed
                        else None
                    )
                    if said is None:
                        said = next((f"node {r}: {m}" for r, s in silences.items() if (m := s.check())), None)
                except OSError:  # the store did not answer: no verdict this time
                    continue
                if said is not None and proc.poll() is None:
                    self.lost = said
                    log(f"{said}, while node 0 trains: stopping node 0's processes")
                    stop_without_peers(proc, log, grace)
                    return

        threading.Thread(target=run, name="shardline-launch-nodes", daemon=True).start()

    def put(self, name: str, data: bytes) -> str:
        """`data` where the other nodes read it (deleted when the attempt ends: no copy of a parent model's
        weights is left in storage)."""
        uri = storage.join(self.shared, name)
        storage.write_bytes(uri, data)
        self._put.append(uri)
        return uri

    def announce(self) -> None:
        """The other nodes may join: node 0 holds its lease of this attempt (`node_lease(shared, 0)`, which they watch
        while they train) until `end`."""
        holder = {"flow_run": node_holder(self.shared, 0)}
        self._lease = Lease(node_lease(self.shared, 0), "node 0", holder=holder)
        self._lease.acquire()
        storage.write_text(self._uri, json.dumps({"attempt": self.number, "started": time.time(), "ended": False}))

    def end(self, exit_code: int | None) -> None:
        self._stop.set()
        for uri in self._put:
            storage.delete(uri)
        storage.write_text(
            self._uri, json.dumps({"attempt": self.number, "ended": True, "exit": exit_code, "at": time.time()})
        )
        if self._lease is not None:
            self._lease.release()


def watch_attempt_node0(
    proc, folder: str, number: int, rank: int, log: Callable[[str], None], grace: float, every: float = WATCH_SECONDS
) -> list[str]:
    """On node `rank` (1..M-1), while its torchrun `proc` of attempt `number` runs (a thread): node 0's torchrun of
    that attempt ended `grace` seconds ago (or node 0 began a newer attempt: its pod restarted) and `proc` still
    runs, or node 0's lease of the attempt went silent past its ttl (node 0's machine gone): stop `proc`
    (`stop_without_peers`, with `grace`). Without it, this node's ranks could wait on node 0 in a collective for
    gloo's timeout (30 minutes) while node 0's next attempt waits for them. Returns a list that gets what was seen,
    in words, when it stopped `proc`."""
    shared = attempt_folder(folder, number)
    silence = Silence(node_lease(shared, 0), node_holder(shared, 0))
    gone: list[str] = []

    def run() -> None:
        over = None  # when node 0's torchrun was first seen ended
        while proc.poll() is None:
            time.sleep(every)
            try:
                known = attempts(folder)
                silent = silence.check()
            except OSError:  # the store did not answer: no verdict this time
                continue
            said = f"node 0's lease of attempt {number}: {silent}" if silent else None
            if said is None and known.get(number, {}).get("abandoned"):  # nothing of node 0's runs in it
                said = f"node 0 started again and ended attempt {number}, which its earlier process left"
            if known.get(number, {}).get("ended") or any(k > number for k in known):
                over = time.monotonic() if over is None else over
                if said is None and time.monotonic() - over >= grace:
                    said = f"node 0's torchrun of attempt {number} ended {time.monotonic() - over:.0f} s ago"
            if said is not None and proc.poll() is None:
                gone.append(said)
                log(f"node {rank}: {said}: stopping this node's processes")
                stop_without_peers(proc, log, grace)
                return

    threading.Thread(target=run, name="shardline-launch-node0", daemon=True).start()
    return gone


def begin(folder: str, log: Callable[[str], None] = print) -> list[int]:
    """Node 0's pipeline starts: an end of an earlier run of this launch (node 0's pod restarted) is cleared, and the
    attempts an earlier node 0 left open are ended as abandoned (its torchrun is gone with it), so that no node joins
    one, and a node in one stops at once. Their numbers."""
    storage.delete(storage.join(folder, "end.json"))
    left = sorted(k for k, a in attempts(folder).items() if not a.get("ended"))
    for number in left:
        record = {"attempt": number, "ended": True, "abandoned": True, "exit": None, "at": time.time()}
        storage.write_text(attempt_record(folder, number), json.dumps(record))
    if left:
        which = ", ".join(str(k) for k in left)
        log(f"node 0 of a launch: attempt(s) {which} of an earlier node 0 of this launch (its pod restarted) ended")
    return left


def _launch_id(folder: str) -> str:
    return folder.rstrip("/").rsplit("/", 1)[-1]


def run_tag(folder: str) -> str:
    """The tag of the flow runs node 0's pipeline makes in the launch whose folder is `folder`."""
    return f"shardline-launch:{_launch_id(folder)}"


def crash_earlier_node0(folder: str, log: Callable[[str], None]) -> list[str]:
    """Node 0's pipeline starts again in this launch (its pod restarted): the flow runs an earlier node 0 of it left
    Running or Pending in a Prefect server they share are set Crashed, saying why (their process is gone; nothing
    else would end them, and the UI would show them running for ever). Their names; none without a server of the
    team's (a temporary API per pod has no earlier runs)."""
    from prefect.settings import PREFECT_API_URL

    if not PREFECT_API_URL.value():
        return []
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
        FlowRunFilterTags,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    launch = _launch_id(folder)
    crashed = []
    try:
        with get_client(sync_client=True) as client:
            runs = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(
                    tags=FlowRunFilterTags(all_=[run_tag(folder)]),
                    state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING, StateType.PENDING])),
                )
            )
            for run in runs:
                message = f"node 0 of launch {launch} started again (its pod restarted?): this run's process is gone"
                client.set_flow_run_state(run.id, Crashed(message=message), force=True)
                crashed.append(run.name)
    except Exception as e:  # noqa: BLE001 - the UI's view of old runs is not worth failing the pipeline for
        log(f"note: the earlier runs of launch {launch} could not be read ({type(e).__name__}: {e})")
    if crashed:
        log(f"node 0 of launch {launch}: an earlier node 0's flow run(s) {', '.join(crashed)} set Crashed")
    return crashed


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
