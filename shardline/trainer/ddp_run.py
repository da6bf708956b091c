"""One rank of a training in several processes, started by torch's elastic agent:
`python -m shardline.trainer.torchrun ... -m shardline.trainer.ddp_run JOB` (JOB: a path or a URI in storage).

The training task (shardline/launch/torchrun.py) writes JOB and starts the agent on each machine. Plain PyTorch:
no Prefect, no MLflow. Every rank trains (trainer/loop.py `fit` under DDP) and resumes from the newest checkpoint
when the agent restarts it (a restart round after a lost rank or node); rank 0, whichever machine it is on, alone
writes checkpoints and speaks for the run, in JOB's folder in storage, which the task reads:

- `events` (a folder of JSON-lines chunks, one object each, written every EVENTS_SECONDS and at every checkpoint
  and epoch): {"kind": "log"|"step"|"epoch"|"checkpoint"|"progress", ...}, what `fit`'s callbacks say;
- `result` (JSON, written atomically at the end): {"status": "finished", "fit": FitResult as a dict},
  {"status": "preempted", "checkpoint", "signal"} or {"status": "budget", "message", "checkpoint"}. A stopped
  rank exits 0 like a finished one: a stop is not a failure to torch's agent, which would otherwise start a restart
  round and wait, up to the join timeout, for the machines the notice stopped.

A rank's error is torch's own error record (`@record`, with the error's class and bases and whether it was raised
in a collective added to its `extraInfo`), which the agent reports (shardline/trainer/torchrun.py).

JOB (JSON): `manifest` (URI), `trains_on` and `validates_on` (split names), `model_spec`, `training`
(TrainingConfig fields), `task`, `ckpt_dir`, `run_meta`, `events`, `result`, optional `init_weights` (a .pt of
tensors in storage, loaded with weights_only=True) and `init_source`, `ranking_ks` (ranking data: the cutoffs of
the validation ranking), `deadline_seconds` with `deadline_reason` and `deadline_limit`, `threads` (torch's threads
per process), `step_every`, `progress_seconds`, `collective_timeout` (seconds a collective waits for a lost peer).
"""

from __future__ import annotations

import dataclasses
import json
import signal
import sys
import threading
import time
import traceback
import uuid

import torch
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record

from shardline.core import storage
from shardline.core.config import TrainingConfig
from shardline.core.parent_watch import signal_on_parent_death
from shardline.trainer.distributed import exit_now, init_from_env, leave, world

EVENTS_SECONDS = 1.0  # how often rank 0's events reach storage while it trains


class Events:
    """Rank 0's side of `fit`'s callbacks, as JSON-lines chunks in a folder of storage (an object store has no
    append): a reader lists the folder and reads the chunks it has not read yet, in name order."""

    def __init__(self, folder: str | None):
        self.folder = folder
        self._lines: list[str] = []
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._seq = 0
        self._name = f"{uuid.uuid4().hex[:8]}"

    def put(self, kind: str, **data) -> None:
        if self.folder is None:
            return
        with self._lock:
            self._lines.append(json.dumps({"kind": kind, **data}, default=float))
        if kind in ("checkpoint", "epoch") or time.monotonic() - self._last >= EVENTS_SECONDS:
            self.flush()

    def flush(self) -> None:
        with self._lock:
            lines, self._lines = self._lines, []
            self._last = time.monotonic()
            if not lines:
                return
            self._seq += 1
            name = f"{time.time_ns():020d}-{self._name}-{self._seq:06d}.jsonl"
        storage.write_text(storage.join(self.folder, name), "\n".join(lines) + "\n")


def raised_in_collective(error: BaseException) -> bool:
    """Whether `error` was raised inside torch.distributed or autograd's backward (where DDP's all-reduce runs):
    with several processes, most often a peer lost (its process killed, its machine gone) rather than an error of
    this rank's own."""
    tb, module = error.__traceback__, ""
    while tb is not None:
        module = tb.tb_frame.f_globals.get("__name__", "")
        tb = tb.tb_next
    return module.startswith(("torch.distributed", "torch.autograd", "torch.nn.parallel"))


class RankErrors(ErrorHandler):
    """torch's error record of a rank, with what the training task needs to classify it (retried or not): the
    error's class and bases, when it was raised (a float: the first of several ranks' errors is the cause) and
    whether it was raised in a collective."""

    def record_exception(self, e: BaseException) -> None:
        """Write the record whole or not at all: torch's agent stops this rank with a SIGTERM once a peer has
        failed, and it reads every failed rank's record as JSON (a half-written one fails the agent itself)."""
        file = self._get_error_file_path()
        if not file:
            return
        if threading.current_thread() is threading.main_thread():  # the only thread that may set a handler
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the rank is ending: its record is the last thing it does
        data = {
            "message": {
                "message": f"{type(e).__name__}: {e}",
                "extraInfo": {
                    "py_callstack": traceback.format_exc(),
                    "timestamp": str(int(time.time())),
                    "shardline": {
                        "error": type(e).__name__,
                        "bases": [c.__name__ for c in type(e).__mro__],
                        "message": str(e),
                        "at": time.time(),
                        "collective": world().distributed and raised_in_collective(e),
                    },
                },
            }
        }
        storage.write_text(file, json.dumps(data))


# a rank's exit status after a stop (a notice, the budget): rank 0's result says which; see the module's docstring
STOPPED = 0


def run_job(job: dict, train, val, ranking=None) -> int:
    """Train `job` on the splits `train` and `val` in this process (one rank of the group torchrun made, or
    alone); rank 0 writes the events and the result. Returns the exit status."""
    from shardline.core.failures import BudgetExceeded, Preempted
    from shardline.trainer.loop import Callbacks, Deadline, FitOptions, fit
    from shardline.trainer.stops import setting_hooks

    ranks = world()
    events = Events(job.get("events") if ranks.is_main else None)
    deadline = None
    if job.get("deadline_seconds") is not None:
        reason = job.get("deadline_reason") or "the training budget is spent"
        deadline = Deadline(time.monotonic() + float(job["deadline_seconds"]), lambda: reason, job["deadline_limit"])
    init = None
    if job.get("init_weights"):  # in storage: a rank on any machine reads it
        import io

        init = torch.load(io.BytesIO(storage.read_bytes(job["init_weights"])), map_location="cpu", weights_only=True)
    result_path = job["result"]
    if ranks.is_main:  # an earlier round's (a restart round resumes from its checkpoint and speaks anew)
        storage.delete(result_path)
    # written whole (storage.write_text is atomic on a local path and an object store): a reader sees all or none
    write_result = lambda **result: storage.write_text(result_path, json.dumps(result, default=float))
    try:
        say = Callbacks(
            log=lambda message: events.put("log", message=message),
            on_step=lambda step, m: events.put("step", step=step, metrics=m),
            on_epoch=lambda epoch, m: events.put("epoch", epoch=epoch, metrics=m),
            on_checkpoint=lambda uri, age: events.put("checkpoint", uri=uri, age=age),
            on_progress=lambda p: events.put("progress", progress=p),
        )
        options = FitOptions(
            run_meta=job.get("run_meta") or {},
            step_every=job.get("step_every"),
            progress_seconds=float(job.get("progress_seconds", 5.0)),
            init_weights=init,
            init_source=job.get("init_source", ""),
            deadline=deadline,
            ranking=ranking,
        )
        cfg = TrainingConfig(**job["training"])
        callbacks = dataclasses.replace(say, **setting_hooks(say.log))
        result = fit(train, val, job["model_spec"], cfg, job.get("task"), job["ckpt_dir"], callbacks, options)
    except Preempted as stopped:
        if ranks.is_main:
            write_result(status="preempted", checkpoint=stopped.checkpoint, signal=stopped.signal_name)
        return STOPPED
    except BudgetExceeded as stopped:
        if ranks.is_main:
            write_result(status="budget", message=str(stopped), checkpoint=stopped.checkpoint)
        return STOPPED
    finally:
        events.flush()
    if ranks.is_main:
        write_result(status="finished", fit=dataclasses.asdict(result))
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(
            "usage: torchrun --nproc-per-node N -m shardline.trainer.ddp_run JOB.json (a path or a URI)",
            file=sys.stderr,
        )
        return 2
    # killed when its agent dies (its agent SIGKILLed alone, a rank would train on unwatched and keep its peers' round
    # from ending)
    signal_on_parent_death(signal.SIGKILL)
    job = json.loads(storage.read_text(argv[0]))
    if job.get("threads"):
        torch.set_num_threads(int(job["threads"]))
    init_from_env(job["training"].get("device", "auto"), job.get("collective_timeout"))
    from shardline.core.manifest import Manifest
    from shardline.trainer.data import open_split

    manifest = Manifest.model_validate_json(storage.read_text(job["manifest"]))
    train = open_split(manifest, job["manifest"], job["trains_on"])
    val = open_split(manifest, job["manifest"], job["validates_on"])
    code = 1
    ranking = None
    if job.get("ranking_ks"):  # ranking data: rank 0 ranks the validation split's groups each epoch
        from shardline.core.metrics.split_ranking import SplitRanking

        ranking = SplitRanking.of_validation(manifest, job["manifest"], job["validates_on"], job["ranking_ks"])
    try:
        code = run_job(job, train, val, ranking)
        return code
    finally:
        train.release()
        val.release()
        leave(code == 0)  # every rank finished or stopped at the same step


if __name__ == "__main__":
    exit_now(record(main, error_handler=RankErrors())(sys.argv[1:]))
