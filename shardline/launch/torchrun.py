"""The training body in several processes, on torch's elastic agent: `compute.processes_per_node` > 1, or
`compute.nodes` > 1, or `compute.train_on: launcher`.

One torchrun agent per machine (`shardline.trainer.torchrun`, torch's own in this process), running
`shardline.trainer.ddp_run` on the job this task writes. With several machines every agent has the run's id as
`--rdzv-id` and meets the others at one c10d rendezvous; membership, waiting for late nodes, restart rounds after a
lost rank or node (`training.max_restarts` is torchrun's `--max-restarts`) and dead-agent detection are torch's.
Where the machines come from:

- on a Prefect pool (no launcher): this task is node 0. It hosts the rendezvous' store (torch's TCPStore, so that
  the store outlives any one agent: a lost node, node 0's agent included, is a restart round), starts nodes 1..M-1
  as flow runs of `compute.node_deployment`, and runs its own agent;
- under a launcher (`compute.train_on: launcher`): the pipeline runs `compute.launch_command`, every machine runs
  `shardline node JOB` (the trainer alone, with the launcher's rendezvous address), and this task follows.

Either way rank 0 (on whichever machine) writes its events, checkpoints and result to storage; `fit_in_processes`
hands the events to the same callbacks as `fit` and gives back what `fit` gives (a FitResult, or `Preempted` /
`BudgetExceeded`), so the training run around it (MLflow, Prefect, the cost ledger) is the same. A training torch
cannot mend (its restarts spent, a replacement node that never came) fails with the root cause from torch's error
records, `RankFailed` when it is the infrastructure's: the training step's retry (or re-dispatch) starts it whole
again, from the newest checkpoint. A SIGTERM/SIGINT to this task goes to its agent, which passes it to its ranks:
every rank checkpoints at the same step and stops.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from shardline.core import storage
from shardline.core.config import ComputeConfig, TrainingConfig
from shardline.core.failures import BudgetExceeded, Preempted, infrastructure_by_names
from shardline.core.parent_watch import signal_on_parent_death
from shardline.trainer.device import pick_device
from shardline.trainer.distributed import check_gpus_per_node
from shardline.trainer.loop import Callbacks, FitOptions, FitResult
from shardline.trainer.stops import on_stop_signals

POLL_SECONDS = 0.5  # how often the events are read while the training runs
TAIL_LINES = 40  # of torchrun's output, in the error of a failed run
# after a SIGTERM, how long torchrun waits for the ranks to checkpoint and stop before it SIGKILLs them: long
# enough for rank 0 to finish a validation pass and write the checkpoint
SHUTDOWN_SECONDS = 300
# how long the node runs get to end by themselves after node 0's agent, before they are cancelled: after a finished
# training (their agents end with node 0's), and after a failed one (long enough for their agents to write torch's
# error records; a node whose machine was lost stays RUNNING in Prefect, and is not waited for longer)
FINISH_SECONDS = 60.0
FAILED_FINISH_SECONDS = 15.0
# how long an agent whose ranks are done waits for the other machines' agents (torch's exit barrier, 300 s in torch):
# the ranks of one training end within moments of each other, and after a stop on several machines the agents of
# the machines the notice stopped never come
EXIT_BARRIER_SECONDS = 30


class RankFailed(dist.DistBackendError):
    """A rank or a machine was lost and torch's agent could not mend it (its restarts spent, or no replacement
    node joined in time): an infrastructure failure, retried whole; the retry resumes from the newest checkpoint."""


class NodesMissing(RuntimeError):
    """Not every node of the training joined its first rendezvous in time: no training started. Not retried: the
    next attempt would wait for the same machines."""


def torchrun_command(grace: int, record: str | None = None, log_dir: str | None = None) -> list[str]:
    """torch's agent through `shardline.trainer.torchrun`: `grace` seconds for the ranks after a SIGTERM on every
    torch, torch's error record written to `record` (a path or a URI) when it fails, and the agent's own folder
    (its ranks' error files) in `log_dir`, a temporary folder of the launch's (else torch makes one in /tmp per
    launch and leaves it there). An agent whose ranks are done waits EXIT_BARRIER_SECONDS for the other machines'."""
    return [
        sys.executable, "-m", "shardline.trainer.torchrun", *([f"--error-record={record}"] if record else []),
        *([f"--log-dir={log_dir}"] if log_dir else []), f"--shutdown-timeout={grace}",
        f"--exit-barrier-timeout={EXIT_BARRIER_SECONDS}",
    ]  # fmt: skip


def agent_args(job: dict, endpoint: str | None, host: bool | None) -> list[str]:
    """torchrun's arguments for the job's rendezvous: one machine (a rendezvous of its own) or `nodes` meeting at
    `endpoint` (HOST:PORT) under the job's run id. `host`: whether this agent hosts the rendezvous' store (None:
    torch decides, by whether the endpoint names this machine)."""
    r = job["rendezvous"]
    args = [f"--nproc-per-node={r['processes_per_node']}", f"--max-restarts={r['max_restarts']}"]
    if r["nodes"] == 1:
        return ["--standalone", *args]
    conf = f"join_timeout={r['join_timeout']:g}" + ("" if host is None else f",is_host={str(host).lower()}")
    return [
        *args, f"--nnodes={r['nodes']}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
        f"--rdzv-id={r['id']}", f"--rdzv-conf={conf}",
    ]  # fmt: skip


def shutdown_seconds() -> int:
    """torchrun's --shutdown-timeout: $TORCH_ELASTIC_SHUTDOWN_TIMEOUT (torchrun's own setting) or SHUTDOWN_SECONDS."""
    value = os.environ.get("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "")
    return int(value) if value.strip().isdigit() else SHUTDOWN_SECONDS


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


def launcher_endpoint(environ: dict[str, str] | None = None) -> str:
    """The rendezvous HOST:PORT a launcher gives every machine: PET_RDZV_ENDPOINT, else PET_MASTER_ADDR and
    PET_MASTER_PORT (Kubeflow Trainer), else MASTER_ADDR and MASTER_PORT (a JobSet, or what a Slurm or SkyPilot
    script sets from its first node). The machine at that address hosts the rendezvous' store."""
    env = os.environ if environ is None else environ
    if env.get("PET_RDZV_ENDPOINT"):
        return env["PET_RDZV_ENDPOINT"]
    for prefix in ("PET_", ""):
        addr, port = env.get(f"{prefix}MASTER_ADDR"), env.get(f"{prefix}MASTER_PORT")
        if addr and port:
            return f"{addr}:{port}"
    raise ValueError(
        "shardline node: no rendezvous address in the environment: give --endpoint HOST:PORT, or run it under a "
        "launcher that sets PET_RDZV_ENDPOINT, PET_MASTER_ADDR and PET_MASTER_PORT (Kubeflow Trainer) or "
        "MASTER_ADDR and MASTER_PORT (a JobSet; in a Slurm or SkyPilot script, the first node's address)"
    )


class Store:
    """The rendezvous' store (torch's TCPStore) hosted by this task for the whole attempt, so that it outlives any
    one agent: a node lost whole, node 0's agent included, is a restart round among the agents that are left and
    its replacement. Closed when the attempt ends: agents still waiting in a round then fail at once."""

    def __init__(self, compute: ComputeConfig):
        from datetime import timedelta

        port = compute.master_port or 0
        self._store = dist.TCPStore(
            "0.0.0.0", port, is_master=True, multi_tenant=True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
        self.endpoint = f"{compute.master_addr or own_address()}:{self._store.port}"

    def close(self) -> None:
        self._store = None


def fit_in_processes(
    compute: ComputeConfig,
    manifest_uri: str,
    trains_on: list[str],
    validates_on: list[str],
    model_spec: dict,
    cfg: TrainingConfig,
    task: str | None,
    ckpt_dir: str,
    callbacks: Callbacks,
    options: FitOptions,
    shared: str | None = None,
    run_id: str = "",
) -> FitResult:
    """`fit` in `compute.processes_per_node` processes on each of `compute.nodes` machines, rank 0's events handed
    to `callbacks` (each rank takes its `after_*` hooks from the environment: `setting_hooks`). `shared`: a folder
    in the run's storage for a training on several machines (the job, rank 0's events and result, the agents' error
    records); one machine uses a temporary folder. `run_id`: the rendezvous id's stem (the run folder's name)."""
    log, deadline, init_weights = callbacks.log, options.deadline, options.init_weights
    size = compute.nodes * compute.processes_per_node  # the config checked that the batch divides among them
    launcher = compute.train_on == "launcher"
    if not launcher:
        check_gpus_per_node(compute.processes_per_node, pick_device(cfg.device).type, torch.cuda.device_count())
    several = compute.nodes > 1 or launcher
    if several and shared is None:
        raise ValueError("compute.nodes > 1: the training's folder in storage is not given")
    grace = shutdown_seconds()
    with tempfile.TemporaryDirectory(prefix="shardline-ddp-") as tmp:
        folder = shared if several else tmp
        for launch in range(compute.max_preemptions + 1 if launcher else 1):  # an earlier attempt's
            for name in ("events", launched("errors", launch)):
                for old in storage.names(storage.join(folder, name)):
                    storage.delete(storage.join(folder, name, old))
            storage.delete(storage.join(folder, launched("result", launch) + ".json"))
        job = {
            "manifest": manifest_uri,
            "trains_on": list(trains_on),
            "validates_on": list(validates_on),
            "model_spec": model_spec,
            "training": cfg.model_dump(mode="json"),
            "task": task,
            "ckpt_dir": ckpt_dir,
            "run_meta": options.run_meta,
            "events": storage.join(folder, "events"),
            "result": storage.join(folder, "result.json"),
            "errors": storage.join(folder, "errors"),
            "step_every": options.step_every,
            "progress_seconds": options.progress_seconds,
            "init_source": options.init_source,
            "ranking_ks": list(options.ranking.ks) if options.ranking is not None else None,
            # the machine's threads shared by the processes on it
            "threads": max(1, torch.get_num_threads() // compute.processes_per_node),
            "collective_timeout": compute.collective_timeout_seconds if several else None,
            "rendezvous": {
                "nodes": compute.nodes,
                "processes_per_node": compute.processes_per_node,
                "max_restarts": cfg.max_restarts,
                "join_timeout": compute.join_timeout_seconds,
                "id": f"{run_id or 'shardline'}-{uuid.uuid4().hex[:8]}",  # each attempt its own rendezvous
            },
        }
        if deadline is not None:
            job.update(
                deadline_seconds=max(0.0, deadline.at - time.monotonic()),
                deadline_reason=deadline.reason(),
                deadline_limit=deadline.limit,
            )
        init_uri = storage.join(folder, "init.pt")
        if init_weights is not None:  # in storage: rank 0 may be on any machine
            import io

            buffer = io.BytesIO()
            torch.save(init_weights, buffer)
            storage.write_bytes(init_uri, buffer.getvalue())
            job["init_weights"] = init_uri
        job_uri = storage.join(folder, "job.json")
        storage.write_text(job_uri, json.dumps(job))
        follower = Follower(job["events"], callbacks)
        log(f"training in {size} processes ({compute.nodes} node(s) x {compute.processes_per_node}): torchrun")
        try:
            if launcher:
                return on_launcher(compute, job, job_uri, follower, log, deadline)
            return on_this_machine(compute, job, job_uri, follower, tmp, grace, log)
        finally:
            if init_weights is not None:  # no copy of a parent's weights is left in the run's folder
                storage.delete(init_uri)


def on_this_machine(
    compute: ComputeConfig, job: dict, job_uri: str, follower: Follower, tmp: str, grace: int, log
) -> FitResult:
    """This task's own agent (node 0), and on several machines the rendezvous' store and nodes 1..M-1 as flow runs
    of the node deployment."""
    from shardline.launch.nodes import NodeRuns

    store = Store(compute) if compute.nodes > 1 else None
    nodes = NodeRuns(compute, log) if store is not None else None
    record = str(Path(tmp) / "error-record.json")
    output = Path(tmp) / "torchrun.log"
    code, forwarded = None, None
    try:
        if nodes is not None:
            nodes.start(job_uri, store.endpoint, grace)
        command = [
            *torchrun_command(grace, record, str(Path(tmp) / "agent")),
            *agent_args(job, store and store.endpoint, False if store else None),
        ]
        code, forwarded = start_agent(command, job_uri, output, follower, grace)
    finally:
        if nodes is not None:  # they end with node 0's agent (on a failure at once: the store is gone first)
            if code != 0:
                store.close()  # agents still waiting in a round fail at once
            nodes.finish(wait=FINISH_SECONDS if code == 0 else FAILED_FINISH_SECONDS)
            store.close()
    said = output.read_text(errors="replace")
    records = [json.loads(Path(record).read_text())] if Path(record).exists() else []
    return outcome(job, records, code, forwarded, grace, said, nodes.report() if nodes is not None else "")


def launched(name: str, launch: int) -> str:
    """The name of a launch's own result or errors under a launcher: the first launch's plain, the next numbered."""
    return f"{name}-{launch}" if launch else name


def on_launcher(compute: ComputeConfig, job: dict, job_uri: str, follower: Follower, log, deadline=None) -> FitResult:
    """`compute.launch_command` starts the machines, each running `shardline node JOB`; this task follows the
    training in storage until rank 0's result is there, or every agent has failed and none started again within
    the join timeout (the launcher did not restart them). A training stopped by a notice to one of its machines (a
    spot machine reclaimed: every rank checkpoints, and every machine's `shardline node` exits) is launched again,
    up to `compute.max_preemptions` times, and resumes from its newest checkpoint: a new rendezvous, its own result
    and errors (a machine of the stopped launch may still be reading or writing the old ones)."""
    wait = compute.join_timeout_seconds
    folder = job_uri.rsplit("/", 1)[0]

    def over() -> bool:
        if present(job["result"]):
            return True
        failed = error_records(job)
        if failed and not storage.names(job["events"]) and all(waited_in_vain(r) for r in failed):
            return True  # no rank ever started, and every agent that came gave up waiting for the others
        # every agent that came failed, and none has said anything for the join timeout since
        return bool(failed) and time.time() - max(r.get("at", 0) for r in failed) > wait and follower.quiet(wait)

    for launch in range(compute.max_preemptions + 1):
        if launch:
            r = job["rendezvous"]
            job = {
                **job,
                "result": storage.join(folder, launched("result", launch) + ".json"),
                "errors": storage.join(folder, launched("errors", launch)),
                "rendezvous": {**r, "id": f"{r['id'].rsplit('-', 1)[0]}-{uuid.uuid4().hex[:8]}"},
            }
            if deadline is not None:
                job["deadline_seconds"] = max(0.0, deadline.at - time.monotonic())
            storage.write_text(job_uri, json.dumps(job))
        run = job["rendezvous"]["id"]
        command = [part.replace("{job}", job_uri).replace("{run}", run) for part in compute.launch_command]
        if command:
            log(f"starting the training's machines: {' '.join(command)}")
            done = subprocess.run(command, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(
                    f"compute.launch_command exited with status {done.returncode}: "
                    + (done.stderr or done.stdout).strip()[-2000:]
                )
        else:
            log(f"waiting for a launcher to run, on each of {compute.nodes} machine(s): shardline node {job_uri}")
        follower.follow(None, 0, done=over)
        try:
            return outcome(job, [], None, None, 0, "", "")
        except Preempted as stopped:
            if launch == compute.max_preemptions:
                raise
            log(
                f"the training stopped on a notice to one of its machines ({stopped.signal_name}; checkpoint "
                f"{stopped.checkpoint}): launching it again ({launch + 1} of compute.max_preemptions="
                f"{compute.max_preemptions})"
            )


def waited_in_vain(record: dict) -> bool:
    """Whether an agent's error record says it gave up waiting for the other machines (torch's rendezvous)."""
    return record.get("agent", {}).get("error", "").startswith("Rendezvous")


class Follower:
    """Rank 0's events (chunks in the job's events folder) handed to `fit`'s callbacks, each step and epoch once
    (a restart round replays the steps after its checkpoint)."""

    def __init__(self, folder: str | None, cb: Callbacks):
        self.folder = folder
        self.seen: set[str] = set()
        self.step, self.epoch = -1, -1
        self.last = time.monotonic()
        self.handlers = {
            "log": lambda e: cb.log(e["message"]),
            "step": lambda e: cb.on_step and self._once("step", e["step"], lambda: cb.on_step(e["step"], e["metrics"])),
            "epoch": lambda e: (
                cb.on_epoch and self._once("epoch", e["epoch"], lambda: cb.on_epoch(e["epoch"], e["metrics"]))
            ),
            "checkpoint": lambda e: cb.on_checkpoint and cb.on_checkpoint(e["uri"], e.get("age", 0.0)),
            "progress": lambda e: cb.on_progress and cb.on_progress(e["progress"]),
        }

    def _once(self, kind: str, number: int, call) -> None:
        if number > getattr(self, kind):
            setattr(self, kind, number)
            call()

    def quiet(self, seconds: float) -> bool:
        return time.monotonic() - self.last > seconds

    def read(self) -> None:
        if self.folder is None:
            return
        for name in sorted(set(storage.names(self.folder)) - self.seen):
            if not name.endswith(".jsonl"):
                continue
            text = storage.read_text(storage.join(self.folder, name))
            self.seen.add(name)
            self.last = time.monotonic()
            for line in text.splitlines():
                if line.strip():
                    event = json.loads(line)
                    self.handlers[event["kind"]](event)

    def follow(self, proc, grace: int, done: Callable[[], bool] | None = None) -> tuple[int | None, str | None]:
        """Read the events until `proc` (an agent) exits, or `done()`; a SIGTERM/SIGINT to this process goes to
        `proc`, which passes it to its ranks. Returns the agent's exit status and the signal passed on, if one
        was."""
        forwarded = None

        def forward(signum, frame):
            nonlocal forwarded
            forwarded = signal.Signals(signum).name
            proc.send_signal(signal.SIGTERM)

        with on_stop_signals(forward if proc is not None else None):
            try:
                while True:
                    finished = proc.poll() is not None if proc is not None else done()
                    self.read()
                    if finished:
                        self.read()  # what was written while it ended
                        return (proc.returncode if proc is not None else None), forwarded
                    time.sleep(POLL_SECONDS)
            except BaseException:
                if proc is not None:
                    proc.terminate()  # a callback failed (the lease lost, ...): the ranks stop with a checkpoint
                    try:
                        proc.wait(grace + 30)  # torchrun kills its ranks after `grace` seconds, then exits
                    except subprocess.TimeoutExpired:
                        proc.kill()
                raise


def error_records(job: dict) -> list[dict]:
    """torch's error records the other machines' agents wrote in the job's `errors` folder."""
    found = []
    folder = job["errors"]
    for name in storage.names(folder):
        try:
            found.append(json.loads(storage.read_text(storage.join(folder, name))))
        except (OSError, ValueError):
            continue  # being written
    return found


def outcome(
    job: dict, records: list[dict], code: int | None, forwarded: str | None, grace: int, said: str, nodes: str
) -> FitResult:
    """What the training came to: rank 0's result, else the error that torch's error records (this agent's and
    the other machines') name as the root cause."""
    result = json.loads(storage.read_text(job["result"])) if present(job["result"]) else None
    status = (result or {}).get("status")
    if status == "finished":
        return FitResult(**result["fit"])
    if status == "preempted":
        raise Preempted(result["checkpoint"], result["signal"])
    if status == "budget":
        raise BudgetExceeded(result["message"], result["checkpoint"])
    records = list({json.dumps(r, sort_keys=True): r for r in records + error_records(job)}.values())  # each once
    ckpt = job["ckpt_dir"]
    nodes_wanted = job["rendezvous"]["nodes"]
    why, raised, killed, agents = root_cause(records, forwarded, grace)
    if raised and not killed and not raised[0]["error"].get("collective"):  # a rank raised: its error here
        e = raised[0]["error"]
        if infrastructure_by_names(e["bases"]):  # its storage or network: retried, as in one process
            raise RankFailed(f"{why}; the newest checkpoint in {ckpt} is where a retry resumes")
        raise (ValueError if "ValueError" in e["bases"] else RuntimeError)(why)
    if agents and not killed and not raised and not storage.names(job["events"]):  # no rank ever started
        came = sorted(a["host"] for a in agents if a["error"].startswith("Rendezvous"))
        hint = (
            "as many as compute.nodes came: do they all meet at the same rendezvous endpoint (the launcher's "
            "PET_RDZV_ENDPOINT or MASTER_ADDR and MASTER_PORT, or `shardline node --endpoint`)?"
            if len(came) >= nodes_wanted
            else "is a machine of each node free (a worker of the node deployment's pool, the launcher's pods)?"
        )
        raise NodesMissing(
            f"compute.nodes={nodes_wanted}, but the training's rendezvous did not complete within "
            f"compute.join_timeout_seconds={job['rendezvous']['join_timeout']:g}: "
            f"{len(came)} node(s) came and waited ({', '.join(came) or 'none'}){nodes}. No training started; {hint}"
        )
    tail = "\n".join(said.splitlines()[-TAIL_LINES:]) if said and not records else ""
    raise RankFailed(
        f"the training processes failed (torchrun exit status {code}): {why}; the newest checkpoint in {ckpt} is "
        f"where a retry resumes{nodes}" + (f". torchrun said:\n{tail}" if tail else "")
    )


def root_cause(records: list[dict], forwarded: str | None, grace: int) -> tuple[str, list, list, list]:
    """What torch's error records say failed first, in words; the ranks that raised (earliest first), killed, and
    the agents that failed, each with its host."""
    raised, killed, agents = [], [], []
    for record in records:
        for f in record.get("failures", []):
            f = {**f, "host": record.get("host")}
            (raised if f.get("error") else killed).append(f)
        if "agent" in record:
            agents.append({**record["agent"], "host": record.get("host"), "at": record.get("at")})
    raised.sort(key=lambda f: f["error"].get("at", 0))
    # the first to go: the agent stopped the others after it, with a SIGTERM (then a SIGKILL past its grace). torch
    # stamps each failure to the second, so a rank it stopped often shares the first one's second: it comes after
    killed.sort(key=lambda f: (f.get("timestamp") or 0, f.get("signal") == "SIGTERM"))
    why = "a rank or a machine was lost and torch's agent could not mend it"
    if killed:
        k = killed[0]
        how = f"was killed by {k['signal']}" if k.get("signal") else f"exited with status {k['exitcode']}"
        why = f"training process {k['rank']} (on {k['host']}) {how}"
        if forwarded and k.get("signal") == "SIGKILL":
            why += (
                f" after {forwarded} was passed on: it did not checkpoint and stop within torchrun's shutdown timeout"
                f" ({grace} s, TORCH_ELASTIC_SHUTDOWN_TIMEOUT; a long validation pass or checkpoint write outlasts it)"
            )
    elif raised:
        f, e = raised[0], raised[0]["error"]
        why = f"{e['error']} in training process {f['rank']} (on {f['host']}): {e['message']}"
        if e.get("collective"):
            why = f"training process {f['rank']} lost its peers in a collective ({e['error']}: {e['message']})"
    elif agents:
        a = agents[0]
        why = f"the agent on {a['host']} failed: {a['error']}" + (f": {a['message']}" if a["message"] else "")
        if a["error"].startswith("Rendezvous"):
            why = f"the agent on {a['host']} gave up waiting for the other machines ({a['error']})"
    return why, raised, killed, agents


def present(uri: str) -> bool:
    """Whether `uri` is there now (listed afresh: an object store's client may have cached an older listing)."""
    folder, _, name = uri.rpartition("/")
    return name in storage.names(folder)


def start_agent(command: list[str], job_uri: str, output: Path, follower: Follower, grace: int):
    """Run torch's agent (`command`) on the job until it ends, its output in `output`, its events to `follower`
    (it gets SIGTERM when this process dies, so its ranks checkpoint and stop instead of training on unwatched).
    The agent's exit status and the signal passed on to it, if one was."""
    with open(output, "w") as out:
        proc = subprocess.Popen(
            [*command, "-m", "shardline.trainer.ddp_run", job_uri],
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=lambda: signal_on_parent_death(signal.SIGTERM),
        )
        return follower.follow(proc, grace)


def run_node(job_uri: str, endpoint: str, shutdown_seconds: int, log: Callable[[str], None] = print) -> str:
    """One machine's agent of the training `job_uri` (a node flow run, or `shardline node` under a launcher), meeting
    the others at `endpoint` (HOST:PORT), until it ends: 'finished', or 'stopped' when the training stopped
    (preempted or out of budget: rank 0 says so in the job's result). A failure raises with torch's account of it,
    which is also written to the job's `errors` folder, where the training task reads it."""
    host, _, port = endpoint.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"shardline node: the rendezvous endpoint {endpoint!r} is not HOST:PORT: give its port too")
    job = json.loads(storage.read_text(job_uri))
    r = job["rendezvous"]
    if r["nodes"] < 2:
        raise ValueError(f"{job_uri}: a training on one machine (compute.nodes=1) runs no node of its own")
    record = storage.join(job["errors"], f"{socket.gethostname()}-{os.getpid()}.json")
    log(
        f"node of a training on {r['nodes']} machines ({r['processes_per_node']} process(es) each): rendezvous "
        f"{r['id']} at {endpoint}"
    )
    with tempfile.TemporaryDirectory(prefix="shardline-node-") as tmp:
        command = [
            *torchrun_command(shutdown_seconds, record, str(Path(tmp) / "agent")),
            *agent_args(job, endpoint, None),
        ]
        output = Path(tmp) / "torchrun.log"
        code, forwarded = start_agent(command, job_uri, output, Follower(None, Callbacks(log=log)), shutdown_seconds)
        said = output.read_text(errors="replace")
    result = json.loads(storage.read_text(job["result"])) if present(job["result"]) else {}
    if result.get("status") in ("preempted", "budget"):  # its ranks exited 0 (ddp_run) or were told to stop
        log(f"this node's processes stopped with the training ({result['status']}; rank 0 checkpointed)")
        return "stopped"
    if code == 0:
        log("this node's processes finished")
        return "finished"
    if result.get("status") == "finished":  # a machine more than compute.nodes, or one that came too late
        log(f"the training finished on {r['nodes']} machines without this one (compute.nodes={r['nodes']})")
        return "finished"
    try:
        found = [json.loads(storage.read_text(record))]
    except (OSError, ValueError):
        found = []
    why, _, _, agents = root_cause(found, forwarded, shutdown_seconds)
    if agents and agents[0]["error"] == "SignalException":  # this machine was told to stop (a notice)
        log("this node's agent was stopped by a signal: its processes stopped with a checkpoint")
        return "stopped"
    if agents and waited_in_vain(found[0]) and not storage.names(job["events"]):
        raise NodesMissing(
            f"{why}: the rendezvous {r['id']} at {endpoint} did not gather compute.nodes={r['nodes']} machines "
            f"within compute.join_timeout_seconds={r['join_timeout']:g}; does every machine run `shardline node` "
            "on this job, meeting at this endpoint?"
        )
    if found:
        raise RankFailed(f"on this node: {why}")
    tail = "\n".join(said.splitlines()[-TAIL_LINES:])
    raise RankFailed(f"torchrun exit status {code}" + (f" after {forwarded}" if forwarded else "") + f":\n{tail}")
