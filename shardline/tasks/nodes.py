"""Training on several machines, started by the training run itself: with `compute.nodes` = M > 1 (and no
launcher's rendezvous in the environment), the training task is node 0. It writes the DDP job to the run's
folder in storage, starts nodes 1..M-1 as flow runs of `compute.node_deployment` (prefect.yaml: `train-node`
on the GPU pool, one machine each), and runs its own torchrun with `--node-rank 0`; every node's torchrun
meets at node 0's `master_addr:master_port` (torchrun's static rendezvous) and trains the same job.

Rank 0 is on node 0, so its events and its result stay on this machine, as with one node; the other nodes'
ranks write their errors to the job's `failures` folder in storage. When node 0's torchrun ends, the node runs
end with it (their peers are gone); one still running after `FINISH_SECONDS` is cancelled. A node that dies
makes every torchrun fail: the training task raises `RankFailed`, and its retry starts the nodes again
(a new job, new flow runs), resuming from the newest checkpoint. A node whose machine vanished without a word
leaves its flow run RUNNING and node 0's ranks waiting on it in a collective: each node run holds a lease in
the attempt's folder (`leases/node-<rank>`), and node 0 sets a run whose lease went silent past its ttl
Crashed and stops (`RankFailed`, retried). Node 0 starts its torchrun once no node run is still Scheduled or
Pending (`wait_running`, at most SHARDLINE_NODES_TIMEOUT): a machine the pool's infrastructure is still adding
would otherwise fail torchrun's rendezvous after 10 minutes.
"""

from __future__ import annotations

import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable

from shardline.core import storage
from shardline.core.config import ComputeConfig

FINISH_SECONDS = 60.0  # how long the node runs get to end after node 0's torchrun did, before they are cancelled
WATCH_SECONDS = 5.0  # how often the node runs' states are read while node 0 trains
# how long a torchrun whose peers on another machine are gone gets to end after SIGTERM before its processes are
# killed: a checkpoint needs every rank's agreement (the step's all-reduce), so no more can be written, and ranks
# waiting on a vanished machine in a collective never see the signal (torchrun would wait its 300 s shutdown)
PEERLESS_SECONDS = 20.0
PEERLESS_ENV = "SHARDLINE_PEERLESS_SECONDS"  # more for a model whose checkpoint takes longer to write
# how long node 0 waits, before each torchrun, for the other nodes to run (their flow runs RUNNING, or under a
# launcher their `shardline run`): a machine the cluster is still adding takes minutes, and torchrun's own
# rendezvous would give up after 10 minutes and spend one of the training's retries
NODES_TIMEOUT = "SHARDLINE_NODES_TIMEOUT"
DEFAULT_NODES_SECONDS = 1800.0
NODES_SAY_SECONDS = 60.0  # how often node 0 says which nodes it still waits for


def peerless_seconds() -> float:
    """The grace of `stop_without_peers`: $SHARDLINE_PEERLESS_SECONDS or PEERLESS_SECONDS (read before training
    starts, so that a bad value is said then, not in the watching thread)."""
    from shardline.core.config import env_seconds

    return env_seconds(PEERLESS_ENV, PEERLESS_SECONDS)


def nodes_seconds() -> float:
    """How long node 0 waits for the other nodes before each torchrun: $SHARDLINE_NODES_TIMEOUT or 30 minutes (read
    before anything starts, so that a bad value is said then)."""
    from shardline.core.config import env_seconds

    return env_seconds(NODES_TIMEOUT, DEFAULT_NODES_SECONDS, zero="a node not running then fails the training at once")


def wait_while(
    pending: Callable[[], str | None],
    timeout: float,
    poll: float,
    say_every: float,
    say: Callable[[str, float], None],
    fail: Callable[[str], Exception],
) -> float:
    """Poll `pending()` (what is still awaited, in words; None once nothing is) every `poll` seconds, calling
    `say(what, seconds waited)` every `say_every` seconds and raising `fail(what)` after `timeout` seconds. The
    seconds waited."""
    start = said = time.monotonic()
    while (what := pending()) is not None:
        if time.monotonic() - start >= timeout:
            raise fail(what)
        if time.monotonic() - said >= say_every:
            said = time.monotonic()
            say(what, said - start)
        time.sleep(poll)
    return time.monotonic() - start


class NodesMissing(RuntimeError):
    """Nodes of the training did not start (or were lost and did not come back) in time: no training started. Not
    retried: the next attempt would wait for the same machines."""


class NodeFailed(RuntimeError):
    """A node's flow run failed (an error in its code, config or environment) or was cancelled: not retried."""


def others(nodes: int) -> str:
    """The nodes a training on `nodes` machines starts, in words: 'node 1', 'nodes 1 to 3'."""
    return "node 1" if nodes == 2 else f"nodes 1 to {nodes - 1}"


def own_address() -> str:
    """This machine's address as other machines see it: the interface its default route leaves by (no packet
    is sent), else what its host name resolves to."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.254.254.254", 1))
            return s.getsockname()[0]
    except OSError:
        pass
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError as e:
        raise ValueError(
            f"compute.nodes > 1: this machine's address, where the other nodes meet it, could not be told ({e}); "
            "set compute.master_addr"
        ) from None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class Nodes:
    """Nodes 1..M-1 of this training: one flow run of `compute.node_deployment` each."""

    def __init__(self, compute: ComputeConfig, shared: str, log: Callable[[str], None]):
        self.compute, self.log = compute, log
        self.folder = storage.join(shared, uuid.uuid4().hex[:12])  # this attempt's: a retry starts afresh
        self.failures = storage.join(self.folder, "failures")
        self.master = (compute.master_addr or own_address(), compute.master_port or free_port())
        self.runs: list = []
        self.lost = None  # a node run that ended, not completed, while node 0 trained
        self.grace = peerless_seconds()
        self._stop = threading.Event()
        self._check_deployment()

    def _check_deployment(self) -> None:
        from prefect.client.orchestration import get_client
        from prefect.exceptions import ObjectNotFound

        name = self.compute.node_deployment
        with get_client(sync_client=True) as client:
            try:
                client.read_deployment_by_name(name)
            except ObjectNotFound:
                raise ValueError(
                    f"compute.nodes={self.compute.nodes}: {others(self.compute.nodes)} run(s) as flow runs of "
                    f"compute.node_deployment '{name}', which the Prefect API ({_api()}) does not have. Deploy it "
                    "(`prefect --no-prompt deploy --all` in the project folder: prefect.yaml's train-node) and start "
                    "a worker of its pool on each training machine, or run the nodes under a launcher "
                    "(deploy/trainjob.yaml), or set compute.nodes: 1"
                ) from None

    def rank_of(self, run) -> int | str:
        """The node rank of one of this attempt's node runs."""
        return next((rank for rank, r in enumerate(self.runs, 1) if r.id == run.id), "?")

    def lease_folder(self, rank: int) -> str:
        return node_lease(self.folder, rank)

    def put(self, name: str, data: bytes) -> str:
        """`data` in this attempt's folder in storage, where every node reads it; its URI."""
        uri = storage.join(self.folder, name)
        storage.write_bytes(uri, data)
        return uri

    def start(self, job_uri: str, shutdown_seconds: int) -> None:
        from prefect.deployments import run_deployment

        c = self.compute
        address, port = self.master
        for rank in range(1, c.nodes):
            self.runs.append(
                run_deployment(
                    name=c.node_deployment,
                    parameters={
                        "job": job_uri,
                        "node_rank": rank,
                        "nodes": c.nodes,
                        "processes_per_node": c.processes_per_node,
                        "master_addr": address,
                        "master_port": port,
                        "shutdown_seconds": shutdown_seconds,
                    },
                    job_variables=c.job_variables or None,
                    timeout=0,  # started, not waited for: this process is node 0
                    as_subflow=True,
                    tags=["shardline", "shardline-node"],
                )
            )
        self.log(
            f"{others(c.nodes)}: flow run(s) {', '.join(r.name for r in self.runs)} of {c.node_deployment}; "
            f"the rendezvous is node 0's {address}:{port} (the other machines must reach it: compute.master_addr, "
            "compute.master_port)"
        )

    def wait_running(self, timeout: float, poll: float = 1.0, say_every: float | None = None) -> None:
        """Before node 0's torchrun: wait until no node run is still Scheduled or Pending (its machine being added,
        no worker of its pool free), saying which every `say_every` seconds; `NodesMissing` after `timeout` seconds.
        A node run that ended meanwhile is left to `watch`, which names it. torchrun's own rendezvous would wait 10
        minutes for a node that is not there, then fail the attempt (and a retry starts its nodes afresh)."""
        from prefect.client.schemas.objects import StateType

        say_every = NODES_SAY_SECONDS if say_every is None else say_every
        names = "?"

        def pending() -> str | None:
            nonlocal names
            try:
                runs = self._states()
            except Exception:  # noqa: BLE001 - the API away for a moment: ask again
                return names
            waiting = [r for r in runs if not r.state or r.state.type in (StateType.SCHEDULED, StateType.PENDING)]
            names = ", ".join(f"{r.name} ({r.state.name if r.state else '?'})" for r in waiting)
            return names or None

        waited = wait_while(
            pending,
            timeout,
            poll,
            say_every,
            lambda what, waited: self.log(
                f"waiting for flow run(s) {what} of {self.compute.node_deployment} to start ({waited:.0f} s; the "
                f"training starts when every node runs, at most {timeout:.0f} s, {NODES_TIMEOUT}): is a worker of "
                "its pool free on another machine?"
            ),
            lambda what: NodesMissing(
                f"flow run(s) {what} of {self.compute.node_deployment} did not start within {timeout:.0f} s "
                f"({NODES_TIMEOUT}): no training started, and they are cancelled. Is a worker of its pool free "
                f"on another machine (one per machine, as many as compute.nodes={self.compute.nodes}), or can "
                "the pool's infrastructure add one? The training's checkpoints stay: a rerun resumes from the "
                "newest"
            ),
        )
        if waited >= say_every:
            self.log(f"every node's flow run runs ({waited:.0f} s): training")

    def watch(self, proc) -> None:
        """While node 0's torchrun `proc` runs, watch the node runs (a thread): one that ends without completing
        (it crashed, failed or was cancelled, often before it ever joined: node 0 would wait out torchrun's
        rendezvous timeout) stops node 0's processes and is kept in `lost`. (Node 0's torchrun starts once every
        node run runs: `wait_running`.)"""
        threading.Thread(target=self._watch, args=(proc,), name="shardline-nodes", daemon=True).start()

    def _watch(self, proc) -> None:
        from prefect.client.orchestration import get_client
        from prefect.states import Crashed

        from shardline.core.lease import Silence

        silences = {r.id: Silence(self.lease_folder(rank), r.id) for rank, r in enumerate(self.runs, 1)}
        while proc.poll() is None and not self._stop.wait(WATCH_SECONDS):
            try:
                runs = self._states()
                for r in runs:  # a node whose machine vanished: its run RUNNING, its lease silent
                    if r.state and r.state.is_running() and (message := silences[r.id].check()):
                        with get_client(sync_client=True) as client:
                            client.set_flow_run_state(r.id, Crashed(message=message), force=True)
                        runs = self._states()
                        break
            except Exception:  # noqa: BLE001 - the API away for a moment: torchrun itself still sees a lost peer
                continue
            ended = next((r for r in runs if r.state and r.state.is_final() and not r.state.is_completed()), None)
            if ended is not None and proc.poll() is None:
                self.lost = ended
                self.log(
                    f"node run {ended.name} ({ended.id}) ended {ended.state.name} while this node trains: "
                    "stopping this node's processes"
                )
                stop_without_peers(proc, self.log, self.grace)
                return

    def lost_error(self, ckpt_dir: str, rank_failed: type[Exception]) -> Exception:
        """The error for a node run that ended without completing: `rank_failed` (torchrun.RankFailed: retried)
        when it crashed (its machine or process died) or failed on a rank of its own that died (`run_node`
        raised RankFailed: a rank killed, as on node 0), `NodeFailed` (not retried) when it failed otherwise or
        was cancelled."""
        run, state = self.lost, self.lost.state
        died = state.is_crashed() or (state.is_failed() and "RankFailed" in (state.message or ""))
        said = (
            f"node {self.rank_of(run)}'s flow run {run.name} ({run.id}) of {self.compute.node_deployment} ended "
            f"{state.name}"
            f"{': ' + state.message if state.message else ''}; the training on {self.compute.nodes} machines stopped"
            f" (its newest checkpoint in {ckpt_dir} is where a rerun resumes)"
        )
        return rank_failed(said) if died else NodeFailed(f"{said}. Its logs are in the Prefect UI")

    def _states(self) -> list:
        from prefect.client.orchestration import get_client

        with get_client(sync_client=True) as client:
            return [client.read_flow_run(r.id) for r in self.runs]

    def report(self) -> str:
        """What became of the node runs, for the error of a failed training."""
        try:
            runs = self._states()
        except Exception as e:  # noqa: BLE001 - the API away: the error stands without it
            return f"; the other nodes' flow runs could not be read ({type(e).__name__})"
        said = [
            f"node {i + 1}: {r.name} ({r.id}) {r.state.name if r.state else '?'}"
            + (f": {r.state.message}" if r.state and r.state.message else "")
            for i, r in enumerate(runs)
        ]
        return "; the other nodes' flow runs: " + "; ".join(said)

    def finish(self) -> None:
        """Wait for the running node runs to end (they end with node 0's torchrun), cancel any still going after
        FINISH_SECONDS (node 0 failed before they joined) and, at once, any not started, and clear the attempt's
        folder, however it ended (its errors are read by then; a retry writes a new one): a stopped or failed
        attempt does not leave its job and its copy of the parent's weights in the run's folder."""
        from prefect.client.orchestration import get_client
        from prefect.states import Cancelled, Cancelling

        self._stop.set()
        until = time.monotonic() + FINISH_SECONDS
        pending = []
        while True:
            try:
                pending = [r for r in self._states() if not (r.state and r.state.is_final())]
            except Exception as e:  # noqa: BLE001 - the API away: nothing more to do here
                self.log(f"note: the nodes' flow runs could not be read ({type(e).__name__}: {e})")
                pending = []
                break
            # only a running node ends by itself; one not started yet has nothing left to join: cancelled at once
            if not any(r.state and r.state.is_running() for r in pending) or time.monotonic() >= until:
                break
            time.sleep(1.0)
        with get_client(sync_client=True) as client:
            for run in pending:
                running = run.state is not None and run.state.is_running()
                client.set_flow_run_state(run.id, Cancelling() if running else Cancelled(), force=True)
                self.log(f"node run {run.name} ({run.id}) was still {run.state.name if run.state else '?'}: cancelled")
        self.clear()

    def clear(self) -> None:
        """Delete what this attempt put in storage: the job, the parent's weights, the ranks' errors, the node runs'
        leases."""
        try:
            for name in ("job.json", "init.pt"):
                storage.delete(storage.join(self.folder, name))
            for name in storage.names(self.failures):
                storage.delete(storage.join(self.failures, name))
            for rank in range(1, self.compute.nodes):
                for name in storage.names(self.lease_folder(rank)):
                    storage.delete(storage.join(self.lease_folder(rank), name))
        except OSError as e:  # the storage away: the error of the training stands without it
            self.log(f"note: {self.folder} could not be cleared ({type(e).__name__}: {e})")


def node_lease(attempt_folder: str, rank: int) -> str:
    """Where node `rank`'s flow run holds its lease while its processes run (node 0 watches it)."""
    return storage.join(attempt_folder, "leases", f"node-{rank}")


def watch_node0(proc, node0_run: str, log: Callable[[str], None], grace: float = PEERLESS_SECONDS) -> list:
    """On node 1..M-1, while its torchrun `proc` runs: when node 0's flow run `node0_run` (the training run
    that started this node) has ended (its process or machine died before this node joined, or it failed
    while this node waits on a peer), stop `proc` rather than wait out torchrun's rendezvous (10 minutes)
    holding this machine (`stop_without_peers` with `grace`). Returns a list that gets node 0's flow run when it
    did (a thread watches)."""
    gone: list = []

    def watch() -> None:
        from prefect.client.orchestration import get_client

        while proc.poll() is None:
            try:
                with get_client(sync_client=True) as client:
                    run = client.read_flow_run(node0_run)
            except Exception:  # noqa: BLE001 - the API away for a moment: torchrun itself still sees a lost peer
                run = None
            if run is not None and run.state is not None and run.state.is_final() and proc.poll() is None:
                gone.append(run)
                log(f"node 0's flow run {run.name} ({run.id}) ended {run.state.name}: stopping this node's processes")
                stop_without_peers(proc, log, grace)
                return
            time.sleep(WATCH_SECONDS)

    threading.Thread(target=watch, name="shardline-node0", daemon=True).start()
    return gone


def stop_without_peers(proc, log: Callable[[str], None], grace: float | None = None) -> None:
    """Stop torchrun `proc` whose peers on another machine are gone: SIGTERM (torchrun passes it on; ranks that
    are not waiting on the lost machine stop), then, if it still runs after `grace` seconds (`peerless_seconds`),
    SIGKILL it and every process under it: its ranks are waiting in a collective on a machine that will not
    answer, and no checkpoint can be agreed without it. The training resumes from the newest checkpoint."""
    import psutil

    grace = peerless_seconds() if grace is None else grace
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        family = []
    proc.terminate()
    try:
        proc.wait(grace)
        return
    except subprocess.TimeoutExpired:  # still waiting on the lost peers
        pass
    try:
        family = {p.pid: p for p in [*family, *psutil.Process(proc.pid).children(recursive=True)]}.values()
    except psutil.Error:
        pass
    log(
        f"the training processes did not stop within {grace:.0f} s of SIGTERM (they wait on the lost machine in a "
        f"collective): killing {len(family)} of them"
    )
    for p in family:
        try:
            p.kill()
        except psutil.Error:
            continue
    proc.kill()
    proc.wait()
    psutil.wait_procs(list(family), timeout=30)  # gone (their GPU memory freed) before the retry starts


def _api() -> str:
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value() or "ephemeral, in this process"
