"""The training body in several processes: `compute.processes_per_node` > 1 (or `compute.nodes` > 1) runs
`python -m torch.distributed.run ... -m shardline.trainer.ddp_run JOB.json` as a child of the training task.

`fit_in_processes` takes what `fit` takes and gives back what it gives (a FitResult, or `Preempted` /
`BudgetExceeded`), so the training run around it (MLflow, Prefect, the cost ledger, result.json) is the
same: rank 0's events (its log lines, steps, epochs, checkpoints, progress) are read from a file while it
trains and handed to the same callbacks. A SIGTERM/SIGINT to the task is passed on to torchrun, which
passes it to every rank: they checkpoint together and stop. A rank that dies (SIGKILL, a lost machine)
makes torchrun fail: that is a `RankFailed` (a torch distributed error: the training step's retry resumes
from the newest checkpoint).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from shardline.core import storage
from shardline.core.config import ComputeConfig, TrainingConfig
from shardline.core.failures import infrastructure_by_names
from shardline.tasks.launched import Attempt, wait_for_nodes
from shardline.tasks.nodes import Nodes, nodes_seconds, peerless_seconds, watch_node0
from shardline.trainer.device import pick_device
from shardline.trainer.distributed import check_batch_size, check_gpus_per_node
from shardline.trainer.loop import (
    ANOTHER_PROCESS,
    BUDGET_EXIT_CODE,
    PREEMPTED_EXIT_CODE,
    BudgetExceeded,
    Deadline,
    FitResult,
    Preempted,
)

POLL_SECONDS = 0.2  # how often the events file is read while torchrun runs
WAITING_SAY_SECONDS = 300  # how often a node under a launcher says it is still waiting for node 0's training
TAIL_LINES = 40  # of torchrun's output, in the error of a failed run
# after a SIGTERM, how long torchrun waits for the ranks to checkpoint and stop before it SIGKILLs them: long
# enough for rank 0 to finish a validation pass and write the checkpoint (the others wait for it at the save);
# torchrun's own default, 30 s, lost the epoch of a run stopped while it validated
SHUTDOWN_SECONDS = 300
# a rank's error that follows from another rank's failure: its peer's connection closed, a collective aborted
_PEER_LOST = re.compile(
    r"by peer|connection (closed|reset|refused)|broken pipe|communicator was aborted|socket timeout", re.IGNORECASE
)


class RankFailed(dist.DistBackendError):
    """A rank died (killed, its machine lost, a peer gone) and torchrun ended the run: an infrastructure
    failure, retried like one; the retry resumes from the newest checkpoint."""


def world_size(compute: ComputeConfig) -> int:
    return compute.nodes * compute.processes_per_node


_LAUNCHER_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "GROUP_RANK", "JOB_COMPLETION_INDEX")


def launched_by_environment(environ: dict[str, str] | None = None) -> bool:
    """Whether a launcher (Kubeflow Trainer, a JobSet) started this node and its environment names the
    rendezvous; if not, a run of `compute.nodes` > 1 starts the other nodes itself (`start_nodes`)."""
    env = os.environ if environ is None else environ
    return any(env.get(k) for k in ("PET_RDZV_ENDPOINT", "PET_MASTER_ADDR", *_LAUNCHER_VARIABLES))


def launcher_args(
    compute: ComputeConfig, environ: dict[str, str] | None = None, master: tuple[str, int] | None = None
) -> list[str]:
    """torchrun's arguments: one node (a rendezvous of its own on this machine); `compute.nodes` with this
    one as node 0 at `master` (address, port), which starts the others (flow runs of the node deployment);
    or `compute.nodes` whose rendezvous the launcher's environment gives (Kubeflow Trainer and JobSet set PET_*
    or MASTER_ADDR, MASTER_PORT and the node's rank)."""
    env = os.environ if environ is None else environ
    args = [f"--nproc-per-node={compute.processes_per_node}"]
    if compute.nodes == 1:
        return ["--standalone", *args]
    args.append(f"--nnodes={compute.nodes}")
    if master is not None:
        return [*args, "--node-rank=0", f"--master-addr={master[0]}", f"--master-port={master[1]}"]
    if env.get("PET_RDZV_ENDPOINT") or env.get("PET_MASTER_ADDR"):
        return args  # torchrun reads the rest of its arguments from PET_* itself
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not env.get(k)]
    rank = env.get("NODE_RANK") or env.get("GROUP_RANK") or env.get("JOB_COMPLETION_INDEX")
    if missing or rank is None:
        raise ValueError(
            f"compute.nodes={compute.nodes}: the rendezvous comes from the launcher's environment, and "
            f"{', '.join(missing + ([] if rank is not None else ['NODE_RANK']))} is not set; run it under a "
            "launcher that sets it (deploy/trainjob.yaml: Kubeflow Trainer sets PET_*; a JobSet sets "
            "MASTER_ADDR, MASTER_PORT and JOB_COMPLETION_INDEX), or unset "
            f"{', '.join(k for k in _LAUNCHER_VARIABLES if env.get(k))} to have this run start the other nodes "
            "as flow runs of compute.node_deployment"
        )
    return [*args, f"--node-rank={rank}", f"--master-addr={env['MASTER_ADDR']}", f"--master-port={env['MASTER_PORT']}"]


def fit_in_processes(
    compute: ComputeConfig,
    manifest_uri: str,
    trains_on: list[str],
    validates_on: list[str],
    model_spec: dict,
    cfg: TrainingConfig,
    task: str | None,
    ckpt_dir: str,
    on_step: Callable[[int, dict], None] | None = None,
    on_epoch: Callable[[int, dict], None] | None = None,
    run_meta: dict | None = None,
    log: Callable[[str], None] = print,
    step_every: int | None = 10,
    init_weights: dict[str, torch.Tensor] | None = None,
    init_source: str = "",
    on_checkpoint: Callable[[str], None] | None = None,
    on_progress: Callable[[dict], None] | None = None,
    progress_seconds: float = 5.0,
    deadline: Deadline | None = None,
    ranking=None,
    shared: str | None = None,
    launch: str | None = None,
) -> FitResult:
    """`fit` in `compute.processes_per_node` processes (x `compute.nodes`) under torchrun. `ranking` (a
    SplitRanking, ranking data) is rebuilt by rank 0 from the manifest and its cutoffs. `shared`: a folder in
    the run's storage, where a run of several nodes that starts the others itself puts what they read (the
    job, the parent's weights) and where their ranks write their errors. `launch`: under a launcher, the launch's
    folder in storage, where this run (node 0) says when its torchrun starts and ends, for the other nodes to join
    it (tasks/launched.py)."""
    size = world_size(compute)
    check_batch_size(cfg.batch_size, size)  # before starting anything
    check_gpus_per_node(compute.processes_per_node, pick_device(cfg.device).type, torch.cuda.device_count())
    nodes = None
    if compute.nodes > 1 and not launched_by_environment():  # this run is node 0, and starts the others
        if shared is None:
            raise ValueError("compute.nodes > 1: the job's shared folder in storage is not given")
        nodes = Nodes(compute, shared, log)
        args = launcher_args(compute, master=nodes.master)
        waits = nodes_seconds()  # a bad value said before any node starts
    else:
        args = launcher_args(compute)
    attempt = None
    if compute.nodes > 1 and nodes is None:  # under a launcher: the other nodes join this run's torchrun
        if launch is None:
            raise ValueError("compute.nodes > 1 under a launcher: the launch's folder in storage is not given")
        peerless = peerless_seconds()  # a bad value said before anything starts
        # every other node runs (a pod still pending, one restarted after its machine was lost): else torchrun's
        # rendezvous waits 10 minutes for it, then fails the attempt
        # ...and none still runs a torchrun of an earlier attempt, which would meet this one at the rendezvous
        wait_for_nodes(launch, compute.nodes, log, nodes_seconds())
        attempt = Attempt(launch)
    with tempfile.TemporaryDirectory(prefix="shardline-ddp-") as tmp:
        folder = Path(tmp)
        job = {
            "manifest": manifest_uri,
            "trains_on": list(trains_on),
            "validates_on": list(validates_on),
            "model_spec": model_spec,
            "training": cfg.model_dump(mode="json"),
            "task": task,
            "ckpt_dir": ckpt_dir,
            "run_meta": run_meta or {},
            "events": str(folder / "events.jsonl"),
            "result": str(folder / "result.json"),
            "step_every": step_every,
            "progress_seconds": progress_seconds,
            "init_source": init_source,
            "ranking_ks": list(ranking.ks) if ranking is not None else None,
            # the machine's threads shared by the processes on it
            "threads": max(1, torch.get_num_threads() // compute.processes_per_node),
        }
        if init_weights is not None:
            torch.save(init_weights, folder / "init.pt")
            job["init_weights"] = str(folder / "init.pt")
            if nodes is not None:  # the other machines read it from storage
                job["init_weights"] = nodes.put("init.pt", (folder / "init.pt").read_bytes())
            elif attempt is not None:
                job["init_weights"] = attempt.put("init.pt", (folder / "init.pt").read_bytes())
        if nodes is not None:
            job["failures"] = nodes.failures
        elif attempt is not None:
            job["failures"] = attempt.failures
        if deadline is not None:
            job.update(
                deadline_seconds=max(0.0, deadline.at - time.monotonic()),
                deadline_reason=deadline.reason(),
                deadline_limit=deadline.limit,
            )
        (folder / "job.json").write_text(json.dumps(job))
        grace = shutdown_seconds()
        command = [*torchrun_command(grace), *args]
        command += ["-m", "shardline.trainer.ddp_run"]
        log(f"training in {size} processes ({compute.nodes} node(s) x {compute.processes_per_node}): torchrun")
        output = folder / "torchrun.log"
        code = None
        try:
            if nodes is not None:  # inside: node runs started before a failure here are cancelled
                nodes.start(nodes.put("job.json", json.dumps(job).encode()), grace)
                nodes.wait_running(waits)  # else torchrun's rendezvous gives up on a machine not there yet
            if attempt is not None:
                log(f"node 0 of a launch: attempt {attempt.number}, the other nodes join it ({attempt.folder})")
                attempt.announce()
            with open(output, "w") as out:
                proc = subprocess.Popen(
                    [*command, str(folder / "job.json")],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    preexec_fn=_term_with_parent,
                )
                if nodes is not None:
                    nodes.watch(proc)
                elif attempt is not None:
                    attempt.watch(proc, compute.nodes, log, peerless)
                code, forwarded = _follow(
                    proc, folder / "events.jsonl", log, on_step, on_epoch, on_checkpoint, on_progress, grace
                )
            said = output.read_text(errors="replace")
            lost = nodes is not None and nodes.lost is not None and not forwarded
            gone = attempt.lost if attempt is not None and not forwarded else None  # a node of the launch lost
            failures = nodes.failures if nodes is not None else attempt.failures if attempt is not None else None
            try:
                fit = outcome(folder / "result.json", said, code, ckpt_dir, forwarded, grace, failures)
            except RankFailed as e:  # what became of the other nodes' runs says more
                if lost:
                    raise nodes.lost_error(ckpt_dir, RankFailed) from None
                if gone:
                    raise RankFailed(launch_lost(gone, compute.nodes, ckpt_dir)) from None
                raise RankFailed(f"{e}{nodes.report() if nodes is not None else ''}") from None
            except (Preempted, BudgetExceeded) as stopped:
                if lost:  # stopped because a node run ended: that is the error (the checkpoint stands)
                    raise nodes.lost_error(ckpt_dir, RankFailed) from None
                if gone:
                    raise RankFailed(launch_lost(gone, compute.nodes, ckpt_dir)) from None
                if nodes is not None and stopped_elsewhere(stopped, forwarded, compute.nodes):
                    raise RankFailed(
                        f"another process of this training on {compute.nodes} machines was stopped (SIGTERM: a spot "
                        f"reclaim's notice?) and every rank checkpointed at {stopped.checkpoint}, where a retry "
                        f"resumes{nodes.report()}"
                    ) from None
                raise
            return fit
        finally:
            if nodes is not None:
                nodes.finish()
            if attempt is not None:
                attempt.end(code)


def stopped_with_the_run(said: str) -> bool:
    """Whether a node's torchrun, which said `said`, ended because its ranks stopped with the training (preempted
    or out of budget: node 0's ranks checkpointed), not on a failure."""
    codes = {int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", said)}
    return bool(codes) and codes <= {PREEMPTED_EXIT_CODE, BUDGET_EXIT_CODE}


def launch_lost(said: str, machines: int, ckpt_dir: str) -> str:
    """The error of node 0's torchrun under a launcher that was stopped because another node was lost (`said`)."""
    return (
        f"{said}; the training on {machines} machines stopped (its newest checkpoint in {ckpt_dir} is where a "
        "retry resumes, which the other nodes join)"
    )


def stopped_elsewhere(stopped: Exception, forwarded: str | None, machines: int) -> bool:
    """Whether a training on several `machines` stopped (`Preempted`) for another process's signal, not one this
    node's task passed on (`forwarded`): another machine's notice, a spot reclaim of node 1. Every rank
    checkpointed together, but this node was not asked to stop, so the training is retried (`RankFailed`, new
    node runs, resumed from that checkpoint) rather than stopped as preempted."""
    return machines > 1 and not forwarded and getattr(stopped, "signal_name", "") == ANOTHER_PROCESS


def torchrun_command(grace: int) -> list[str]:
    """torchrun, giving the ranks `grace` seconds after a SIGTERM on every torch (`shardline.trainer.torchrun`)."""
    return [sys.executable, "-m", "shardline.trainer.torchrun", f"--shutdown-timeout={grace}"]


def shutdown_seconds() -> int:
    """torchrun's --shutdown-timeout: $TORCH_ELASTIC_SHUTDOWN_TIMEOUT (torchrun's own setting) or SHUTDOWN_SECONDS."""
    value = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "")
    return int(value) if value.strip().isdigit() else SHUTDOWN_SECONDS


def _consequence(failure: dict) -> bool:
    """Whether a rank's error follows from another rank's failure rather than being a cause of its own: a torch
    distributed error, or a collective's error on a lost peer (gloo raises a RuntimeError saying so; an OSError
    that says "connection refused" is the rank's own: its storage or network)."""
    bases = failure.get("bases", [])
    if any(b.startswith("Dist") for b in bases):
        return True
    return "OSError" not in bases and bool(_PEER_LOST.search(failure.get("message", "")))


def outcome(
    result_file: Path,
    said: str,
    code: int,
    ckpt_dir: str,
    forwarded: str | None = None,
    grace: int = 0,
    failures_uri: str | None = None,
) -> FitResult:
    """What the processes' run came to, from rank 0's result, the other ranks' failures beside it (or in
    `failures_uri`, when they were on other machines) and torchrun's output `said`: the FitResult, or the
    error to raise (`Preempted`, `BudgetExceeded`, the failing rank's own error, or `RankFailed` for a rank
    that died)."""
    result = json.loads(result_file.read_text()) if result_file.exists() else None
    _, cause, after = said.rpartition("Root Cause")  # torchrun's own account of the failure, or the end
    tail = cause + after if cause else "\n".join(said.splitlines()[-TAIL_LINES:])
    status = (result or {}).get("status")
    if status == "finished":
        return FitResult(**result["fit"])
    if status == "preempted":
        raise Preempted(result["checkpoint"], result["signal"])
    if status == "budget":
        raise BudgetExceeded(result["message"], result["checkpoint"])
    failures = [{"rank": 0, **result}] if status == "failed" else []
    written = [str(p) for p in sorted(result_file.parent.glob(f"{result_file.name}.rank-*"))]
    if failures_uri:
        written += [storage.join(failures_uri, n) for n in storage.names(failures_uri) if n.startswith("rank-")]
    for uri in written:
        try:
            failures.append(json.loads(storage.read_text(uri)))
        except (OSError, ValueError):
            continue  # a rank killed while it wrote: its error is in torchrun's output
    killed = _killed_first(said)
    causes = sorted((f for f in failures if not _consequence(f)), key=lambda f: f.get("at", 0))
    if causes and killed is None:  # a rank raised: its error here (a ValueError stays one: not retried)
        first = causes[0]
        where = "the training processes" if first["rank"] == 0 else f"training process {first['rank']}"
        said = f"{first['error']} in {where}: {first['message']}"
        if infrastructure_by_names(first["bases"]):  # its storage or network: retried, as in one process
            raise RankFailed(f"{said}; the newest checkpoint in {ckpt_dir} is where a retry resumes")
        raise (ValueError if "ValueError" in first["bases"] else RuntimeError)(said)
    why = "a rank died or lost its peers"
    if forwarded and killed == signal.SIGKILL:
        why = (
            f"{forwarded} was passed on to the ranks, and they did not checkpoint and stop within torchrun's "
            f"shutdown timeout ({grace} s, TORCH_ELASTIC_SHUTDOWN_TIMEOUT; a long validation pass or checkpoint "
            "write outlasts it), so torchrun killed them"
        )
    raise RankFailed(
        f"the training processes failed (torchrun exit status {code}"
        + (f"; a rank was killed by {signal.Signals(killed).name}" if killed else "")
        + f"): {why}; the newest checkpoint in {ckpt_dir} is where a retry resumes. torchrun said:\n{tail}"
    )


def _term_with_parent() -> None:
    """In torchrun's process before it starts (Linux): SIGTERM it when the training task's process dies (SIGKILL,
    a lost pod), so that the ranks checkpoint and stop instead of training on unwatched, holding the run's
    lease. Elsewhere nothing is done."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _killed_first(said: str) -> int | None:
    """The signal that ended the rank torchrun names as the root cause of a failure, if a signal did
    (its report: `Root Cause (first observed failure): ... exitcode : -9`), else None."""
    _, found, after = said.rpartition("Root Cause")
    match = re.search(r"exitcode\s*:\s*(-?\d+)", after) if found else None
    return -int(match.group(1)) if match and int(match.group(1)) < 0 else None


def _follow(
    proc, events: Path, log, on_step, on_epoch, on_checkpoint, on_progress, grace: int
) -> tuple[int, str | None]:
    """Hand rank 0's events to the callbacks until torchrun exits (the rest after it); a SIGTERM/SIGINT to
    this process goes to torchrun, which passes it to the ranks. Returns torchrun's exit status and the
    signal passed on, if one was."""
    handlers = {
        "log": lambda e: log(e["message"]),
        "step": lambda e: on_step and on_step(e["step"], e["metrics"]),
        "epoch": lambda e: on_epoch and on_epoch(e["epoch"], e["metrics"]),
        "checkpoint": lambda e: on_checkpoint and on_checkpoint(e["uri"]),
        "progress": lambda e: on_progress and on_progress(e["progress"]),
    }
    previous, forwarded = {}, None
    if threading.current_thread() is threading.main_thread():

        def forward(signum, frame):
            nonlocal forwarded
            forwarded = signal.Signals(signum).name
            log(f"{forwarded} received: passing it to the training processes")
            proc.send_signal(signal.SIGTERM)

        previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    position, pending = 0, ""
    try:
        while True:
            done = proc.poll() is not None
            if events.exists():
                with open(events, encoding="utf-8") as f:
                    f.seek(position)
                    chunk = f.read()
                    position = f.tell()
                pending += chunk
                *lines, pending = pending.split("\n")  # a line not yet ended waits for its end
                for line in lines:
                    if line.strip():
                        event = json.loads(line)
                        handlers[event["kind"]](event)
            if done:
                return proc.returncode, forwarded
            time.sleep(POLL_SECONDS)
    except BaseException:
        proc.terminate()  # a callback failed (the lease lost, ...): the ranks stop with a checkpoint
        try:
            proc.wait(grace + 30)  # torchrun kills its ranks after `grace` seconds, then exits
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    finally:
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


def run_node(
    job: str,
    node_rank: int,
    nodes: int,
    processes_per_node: int,
    master_addr: str,
    master_port: int,
    shutdown_seconds: int,
    log: Callable[[str], None] = print,
    node0_run: str | None = None,
    own_run: str | None = None,
) -> str:
    """Node `node_rank`'s torchrun of the training `job` (a URI in storage) until it ends: 'finished', or
    'stopped' when the run was preempted or out of budget (node 0 says so to the pipeline); a failure
    raises, with what torchrun said: `RankFailed` when a rank was killed by a signal (its GPU or machine lost,
    the OOM killer: node 0 retries, as for a rank of its own), else a RuntimeError. `node0_run`: node 0's flow
    run (the training run that started this node): when it has ended, this node stops (`watch_node0`). `own_run`:
    this node's flow run, named in the lease it holds while its processes run (node 0 watches it: a node whose
    machine vanished leaves it silent)."""
    if not 1 <= node_rank < nodes or processes_per_node < 1:  # its torchrun would wait 10 minutes, silently
        raise ValueError(
            f"node_rank={node_rank}, nodes={nodes}, processes_per_node={processes_per_node}: a node run is one of "
            f"nodes 1 to nodes-1 of a training on `nodes` machines (node 0 is the training run, which starts "
            "the others with these parameters: compute.nodes, compute.processes_per_node) and runs at least "
            "one process"
        )
    command = [
        *torchrun_command(shutdown_seconds),
        f"--nproc-per-node={processes_per_node}", f"--nnodes={nodes}", f"--node-rank={node_rank}",
        f"--master-addr={master_addr}", f"--master-port={master_port}", "-m", "shardline.trainer.ddp_run", job,
    ]  # fmt: skip
    log(f"node {node_rank} of {nodes}: {processes_per_node} process(es), rendezvous at {master_addr}:{master_port}")
    from shardline.core.lease import Lease
    from shardline.tasks.nodes import node_lease, peerless_seconds

    grace = peerless_seconds()  # a bad value said before anything starts
    lease = Lease(node_lease(job.rsplit("/", 1)[0], node_rank), f"node {node_rank}", holder={"flow_run": own_run})
    with lease, tempfile.TemporaryDirectory(prefix="shardline-node-") as tmp:
        output = Path(tmp) / "torchrun.log"
        nothing = lambda *a: None  # rank 0's events are node 0's
        with open(output, "w") as out:
            proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, preexec_fn=_term_with_parent)
            gone = watch_node0(proc, node0_run, log, grace) if node0_run else []
            code, _ = _follow(proc, Path(tmp) / "no-events", log, nothing, nothing, nothing, nothing, shutdown_seconds)
        said = output.read_text(errors="replace")
    if code == 0:
        log(f"node {node_rank}: its processes finished")
        return "finished"
    if stopped_with_the_run(said):
        log(f"node {node_rank}: its processes stopped with the run (checkpointed by node 0)")
        return "stopped"
    tail = "\n".join(said.splitlines()[-TAIL_LINES:])
    if gone:  # nothing left to train with: the training's retry starts nodes of its own
        run = gone[0]
        raise RuntimeError(
            f"node {node_rank}: node 0's flow run {run.name} ({run.id}), which started this node, ended "
            f"{run.state.name}: this node's processes were stopped (torchrun exit status {code})"
        )
    killed = _killed_first(said)
    if killed is not None:  # the infrastructure's: node 0 sees RankFailed in this run's state and retries
        how = f"a rank was killed by {signal.Signals(killed).name} (torchrun exit status {code})"
        raise RankFailed(f"node {node_rank}: {how}; it said:\n{tail}")
    raise RuntimeError(f"node {node_rank}: torchrun exit status {code}; it said:\n{tail}")


def join_launch(
    compute: ComputeConfig, device: str, folder: str, rank: int, log: Callable[[str], None] = print, poll: float = 1.0
) -> int:
    """Node `rank` (1..M-1) of a training under a launcher (tasks/launched.py): join each of node 0's torchruns
    announced in the launch's `folder` until node 0's pipeline ends; the exit status that node 0's had (0: completed).
    Its ranks take rank 0's job over the process group (trainer/ddp_run.py, a job of `{"join": true}`), so that
    every rank trains the one job node 0 made. A node whose torchrun fails (a lost peer, a rank killed) waits for
    node 0's next attempt: node 0 decides whether the training is retried. While it runs it holds its place in the
    launch (`launched.presence`): node 0 starts each torchrun once every node holds one."""
    from shardline.core.lease import LeaseHeld
    from shardline.tasks import launched

    wait = launched.join_seconds()
    log(f"node {rank} of {compute.nodes} under a launcher: joining node 0's training in {folder}")
    try:
        with launched.present_while(folder, rank, log, wait):
            return _join_attempts(compute, device, folder, rank, log, poll, wait)
    except LeaseHeld as e:
        log(f"node {rank}: {e}")
        return 1


def _join_attempts(
    compute: ComputeConfig, device: str, folder: str, rank: int, log: Callable[[str], None], poll: float, wait: float
) -> int:
    """`join_launch`'s loop: each attempt node 0 announces is joined, until node 0's pipeline ends."""
    from shardline.core.lease import Lease
    from shardline.tasks import launched

    args = launcher_args(compute)
    grace, peerless = shutdown_seconds(), peerless_seconds()
    joined, count, deadline = 0, 0, time.monotonic() + wait  # the last attempt joined; how many this process joined
    since = said = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="shardline-join-") as tmp:
        stub = Path(tmp) / "job.json"
        threads = max(1, torch.get_num_threads() // compute.processes_per_node)
        stub.write_text(json.dumps({"join": True, "training": {"device": device}, "threads": threads}))
        while True:
            end = launched.ended(folder)
            if end is not None:
                status, code = end.get("status", "?"), int(end.get("exit", 1))
                log(f"node {rank}: node 0's pipeline ended ({status}); {count} torchrun(s) joined")
                return code
            number = launched.to_join(folder, joined)
            if number is None:
                if time.monotonic() > deadline:
                    log(
                        f"node {rank}: node 0 started no training and its pipeline did not end within {wait:.0f} s "
                        f"({launched.JOIN_TIMEOUT}); is node 0 running, with the same {launched.LAUNCH_ID} and a "
                        f"storage.root every node sees ({folder})?"
                    )
                    return 1
                if time.monotonic() - said >= WAITING_SAY_SECONDS:  # a node that waits for nothing says so
                    said = time.monotonic()
                    log(
                        f"node {rank}: still waiting for node 0's {'next ' if joined else ''}training "
                        f"({said - since:.0f} s; node 0 ingests and encodes first): its attempts appear in {folder}, "
                        "which every node must see (a storage.root shared by all, such as s3://)"
                    )
                time.sleep(poll)
                continue
            joined, count = number, count + 1
            log(f"node {rank}: joining node 0's attempt {joined}")
            command = [*torchrun_command(grace), *args]
            output = Path(tmp) / f"torchrun-{joined}.log"
            shared = launched.attempt_folder(folder, joined)
            # node 0 watches this lease while it trains (silent: this machine is gone) and how the torchrun ended
            holder = {"flow_run": launched.node_holder(shared, rank)}
            with Lease(launched.node_lease(shared, rank), f"node {rank}", holder=holder), open(output, "w") as out:
                proc = subprocess.Popen(
                    [*command, "-m", "shardline.trainer.ddp_run", str(stub)],
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    preexec_fn=_term_with_parent,
                )
                # node 0's torchrun ended or its machine gone: this node's ranks could wait on it in a collective
                gone = launched.watch_attempt_node0(proc, folder, joined, rank, log, peerless)
                nothing = lambda *a: None  # rank 0's events are node 0's
                code, _ = _follow(proc, Path(tmp) / "no-events", log, nothing, nothing, nothing, nothing, grace)
                stopped = stopped_with_the_run(output.read_text(errors="replace")) and not gone
                try:
                    launched.node_ended(shared, rank, code, stopped)
                except OSError as e:  # node 0 still sees the lost peer, later
                    log(f"node {rank}: could not say in {shared} that its torchrun ended ({type(e).__name__}: {e})")
            if code == 0:
                log(f"node {rank}: attempt {joined}: its processes finished")
            else:
                tail = "\n".join(output.read_text(errors="replace").splitlines()[-TAIL_LINES:])
                log(f"node {rank}: attempt {joined}: torchrun exit status {code}; waiting for node 0. It said:\n{tail}")
            deadline = time.monotonic() + wait
            since = said = time.monotonic()
