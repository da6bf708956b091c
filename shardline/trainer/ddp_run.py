"""One training run in several processes: `torchrun --nproc-per-node N -m shardline.trainer.ddp_run JOB.json`.

The training task (shardline/tasks/training_run.py) writes JOB and starts torchrun as its child when
`compute.processes_per_node` > 1 (on each node of `compute.nodes`: tasks/nodes.py, tasks/launched.py). Plain
PyTorch: no Prefect, no MLflow. Every rank trains (trainer/loop.py `fit` under DDP);
rank 0 alone writes checkpoints and speaks for the run:

- `events` (JSON lines, appended and flushed): {"kind": "log"|"step"|"epoch"|"checkpoint"|"progress", ...},
  what `fit`'s callbacks say, read by the task (which sends them to MLflow and Prefect) while it runs;
- `result` (JSON, written atomically at the end): {"status": "finished", "fit": FitResult as a dict},
  {"status": "preempted", "checkpoint", "signal"} (exit status PREEMPTED_EXIT_CODE) or {"status": "budget",
  "message", "checkpoint"} (BUDGET_EXIT_CODE) or {"status": "failed", "error", "bases", "message"} (rank 0
  raised). torchrun itself exits 1 when any rank fails; the status says why, and no result at all means a
  rank died (killed, lost its peer): an infrastructure failure, which the task's retry resumes.

JOB (JSON): `manifest` (URI), `trains_on` and `validates_on` (split names), `model_spec`, `training`
(TrainingConfig fields), `task`, `ckpt_dir`, `run_meta`, `events`, `result`, optional `init_weights`
(a .pt of tensors, loaded with weights_only=True) and `init_source`, `ranking_ks` (ranking data: the
cutoffs of the validation ranking), `deadline_seconds` with
`deadline_reason` and `deadline_limit` (a budget: seconds left when the task started torchrun), `threads`
(torch's threads per process), `step_every`, `progress_seconds`, `failures` (a folder in storage where ranks > 0
write their errors, `rank-<r>.json`, when they are on other machines; else beside `result`).

Every rank takes rank 0's job over the process group before it trains (`agree`): a node under a launcher starts
its ranks with `{"join": true, "training": {"device": ...}, "threads": N}` alone, as it cannot know node 0's job;
a rank with a job of its own that differs from rank 0's in what is trained stops, naming the fields.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import threading
import time

import torch

from shardline.core.config import TrainingConfig
from shardline.trainer.distributed import broadcast_json, exit_now, init_from_env, leave, world
from shardline.trainer.loop import BUDGET_EXIT_CODE, PREEMPTED_EXIT_CODE


class Events:
    """Rank 0's side of `fit`'s callbacks, as JSON lines a reader may tail while they are written."""

    def __init__(self, path: str | None):
        self._f = open(path, "a", encoding="utf-8") if path else None
        self._lock = threading.Lock()

    def put(self, kind: str, **data) -> None:
        if self._f is None:
            return
        line = json.dumps({"kind": kind, **data}, default=float)
        with self._lock:
            self._f.write(line + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()


def write_json(uri: str, obj) -> None:
    """Atomically (the storage layer's write: a local path or an object store URI): a reader sees the whole
    result or none."""
    from shardline.core.storage import write_text

    write_text(uri, json.dumps(obj, default=float))


def failure_uri(job: dict, rank: int) -> str:
    """Where rank `rank` (> 0) writes its error: beside the result, or in JOB's `failures` folder in storage when
    the ranks are on several machines (the result is rank 0's, on its machine)."""
    if job.get("failures"):
        from shardline.core.storage import join

        return join(job["failures"], f"rank-{rank}.json")
    return f"{job['result']}.rank-{rank}"


def run_job(job: dict, train, val, ranking=None) -> int:
    """Train `job` on the splits `train` and `val` in this process (one rank of the group torchrun made, or
    alone); rank 0 writes the events and the result. Returns the exit status."""
    from shardline.trainer.loop import BudgetExceeded, Deadline, Preempted, fit

    ranks = world()
    events = Events(job.get("events") if ranks.is_main else None)
    deadline = None
    if job.get("deadline_seconds") is not None:
        reason = job.get("deadline_reason") or "the training budget is spent"
        deadline = Deadline(time.monotonic() + float(job["deadline_seconds"]), lambda: reason, job["deadline_limit"])
    init = None
    if job.get("init_weights"):  # a local path, or a URI in storage (nodes on other machines read it too)
        import io

        from shardline.core.storage import read_bytes

        init = torch.load(io.BytesIO(read_bytes(job["init_weights"])), map_location="cpu", weights_only=True)
    result_path = job["result"]
    try:
        result = fit(
            train,
            val,
            job["model_spec"],
            TrainingConfig(**job["training"]),
            job.get("task"),
            job["ckpt_dir"],
            on_step=lambda step, m: events.put("step", step=step, metrics=m),
            on_epoch=lambda epoch, m: events.put("epoch", epoch=epoch, metrics=m),
            on_checkpoint=lambda uri: events.put("checkpoint", uri=uri),
            on_progress=lambda p: events.put("progress", progress=p),
            progress_seconds=float(job.get("progress_seconds", 5.0)),
            run_meta=job.get("run_meta") or {},
            log=lambda message: events.put("log", message=message),
            step_every=job.get("step_every"),
            init_weights=init,
            init_source=job.get("init_source", ""),
            deadline=deadline,
            ranking=ranking,
        )
    except Preempted as stopped:
        if ranks.is_main:
            write_json(
                result_path, {"status": "preempted", "checkpoint": stopped.checkpoint, "signal": stopped.signal_name}
            )
        return PREEMPTED_EXIT_CODE
    except BudgetExceeded as stopped:
        if ranks.is_main:
            write_json(result_path, {"status": "budget", "message": str(stopped), "checkpoint": stopped.checkpoint})
        return BUDGET_EXIT_CODE
    except Exception as e:  # a code, config or data error: said to the task, which fails at once on it
        # every rank says its own (rank 0 in the result, the others beside it): when one rank fails, the
        # others' errors are mostly its consequence (their peer's connection closed), and the task reports the
        # cause (tasks/torchrun.py)
        failure = {
            "status": "failed",
            "rank": ranks.rank,
            "at": time.time(),
            "error": type(e).__name__,
            "bases": [c.__name__ for c in type(e).__mro__],
            "message": str(e),
        }
        try:
            write_json(result_path if ranks.is_main else failure_uri(job, ranks.rank), failure)
        except Exception:  # noqa: BLE001 - the storage gone too: the error itself still goes to torchrun's log
            pass
        raise
    finally:
        events.close()
    if ranks.is_main:
        write_json(result_path, {"status": "finished", "fit": dataclasses.asdict(result)})
    return 0


# what every rank must have as rank 0 has it (the rest is rank 0's alone, or each machine's own: `threads`)
_SHARED = ("manifest", "trains_on", "validates_on", "model_spec", "training", "task", "ckpt_dir", "init_weights")


def agree(job: dict) -> dict:
    """Rank 0's job, on every rank: a rank started with `{"join": true, ...}` (a node under a launcher, which
    cannot know node 0's job: tasks/launched.py) takes it whole, keeping its own `threads`; a rank started with a
    job of its own must have rank 0's in every field that decides what is trained, or it stops, naming them."""
    theirs = broadcast_json(job if world().is_main else None)
    if job.get("join"):
        return {**theirs, "threads": job.get("threads")}
    differ = [k for k in _SHARED if job.get(k) != theirs.get(k)]
    if differ:
        raise ValueError(
            f"training process {world().rank} was started with another job than process 0's ({', '.join(differ)} "
            "differ): every node must run the same job (a node left from an earlier attempt?)"
        )
    return job


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(
            "usage: torchrun --nproc-per-node N -m shardline.trainer.ddp_run JOB.json (a path or a storage URI)",
            file=sys.stderr,
        )
        return 2
    from shardline.core.storage import read_text

    job = json.loads(read_text(argv[0]))  # a local path, or a URI in storage (a multi-node launcher's)
    if job.get("threads"):
        torch.set_num_threads(int(job["threads"]))
    init_from_env(job["training"].get("device", "auto"))
    job = agree(job)
    from shardline.core.manifest import Manifest
    from shardline.trainer.data import open_split

    manifest = Manifest.model_validate_json(read_text(job["manifest"]))
    train = open_split(manifest, job["manifest"], job["trains_on"])
    val = open_split(manifest, job["manifest"], job["validates_on"])
    code = 1
    ranking = None
    if job.get("ranking_ks"):  # ranking data: rank 0 ranks the validation split's groups each epoch
        from shardline.core.split_ranking import SplitRanking

        ranking = SplitRanking.of_validation(manifest, job["manifest"], job["validates_on"], job["ranking_ks"])
    try:
        code = run_job(job, train, val, ranking)
        return code
    finally:
        train.release()
        val.release()
        leave(code in (0, PREEMPTED_EXIT_CODE, BUDGET_EXIT_CODE))  # every rank stopped at the same step


if __name__ == "__main__":
    exit_now(main(sys.argv[1:]))
