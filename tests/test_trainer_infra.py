"""Which training failures are retried (infrastructure) and which fail at once (code, config, data)."""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed

from shardline.core.failures import Preempted, is_infrastructure_failure

FAILURES = (
    "exc, retried",
    [
        (OSError("connection reset while writing checkpoint"), True),
        (ConnectionError("s3 endpoint went away"), True),
        (TimeoutError("read timed out"), True),
        # torch 2.8 on: a lost GPU's error has its own type (before, a plain RuntimeError: not retried there)
        *(
            [(torch.AcceleratorError("CUDA error: an illegal memory access was encountered"), True)]
            if hasattr(torch, "AcceleratorError")
            else []
        ),
        (torch.distributed.DistNetworkError("connection to rank 1 lost"), True),
        # by type, never by text: a plain RuntimeError that mentions CUDA is a code error
        (RuntimeError("CUDA error: an illegal memory access was encountered"), False),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"), False),
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),  # the same next time
        (FileNotFoundError(2, "No such file or directory", "s3://bucket/raw/a.parquet"), False),
        (PermissionError(13, "Permission denied", "/data/store"), False),
        (ValueError("bad config"), False),
        (KeyError("cont"), False),
        (Preempted("ckpt-000000010.pt", "SIGTERM"), False),
    ],
)


@pytest.mark.parametrize(*FAILURES)
def test_retry_budget_is_for_infrastructure_only(exc, retried):
    assert is_infrastructure_failure(exc) is retried


# a rank stopped by a signal (Preempted) says so in its result, not as an error record
RANK_ERRORS = (FAILURES[0], [(e, r) for e, r in FAILURES[1] if not isinstance(e, Preempted)])


@pytest.mark.parametrize(*RANK_ERRORS)
def test_a_rank_of_a_training_in_several_processes_is_retried_as_one_process_would_be(tmp_path, exc, retried):
    """The same error raised by a rank under torch's agent (compute.processes_per_node or compute.nodes > 1): torch's
    error record of it (written through shardline/trainer/ddp_run.py's RankErrors) is classified as in one process:
    retried (RankFailed) or not (its own error), a CUDA failure included; rank 0's lost connection is not the cause."""
    from shardline.launch.torchrun import RankFailed, outcome

    lost = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29500")

    def error(e: BaseException, at: float, collective: bool) -> dict:  # as RankErrors writes a rank's error
        bases = [c.__name__ for c in type(e).__mro__]
        return {"error": type(e).__name__, "bases": bases, "at": at, "collective": collective, "message": str(e)}

    record = {"host": "node-1", "at": 3.0, "failures": [
        {"rank": 0, "exitcode": 1, "signal": None, "timestamp": 2, "error": error(lost, 2.0, True)},
        {"rank": 1, "exitcode": 1, "signal": None, "timestamp": 1, "error": error(exc, 1.0, False)}]}  # fmt: skip
    job = {"result": str(tmp_path / "result.json"), "errors": str(tmp_path / "errors"), "ckpt_dir": "s3://b/ckpt",
           "events": str(tmp_path / "events"), "rendezvous": {"nodes": 1, "join_timeout": 60}}  # fmt: skip
    with pytest.raises(Exception) as raised:
        outcome(job, [record], 1, None, 30, "", "")
    assert isinstance(raised.value, RankFailed) is retried, raised.value
    assert f"{type(exc).__name__} in training process 1 (on node-1)" in str(raised.value)
    assert is_infrastructure_failure(raised.value) is retried


def test_a_rank_stopped_while_it_records_its_error_still_writes_the_whole_record(tmp_path):
    """torch's agent SIGTERMs the ranks still running once one has failed, and reads each failed rank's error
    record as JSON: a rank signalled while writing its own record (here: the signal arrives as the record is made)
    must leave it whole, or the agent itself fails on the half-written file and the cause is lost."""
    child = """
import os, signal, sys
from torch.distributed.elastic.multiprocessing.errors import record
from shardline.trainer.ddp_run import RankErrors

class Lost(OSError):
    def __str__(self):  # the agent's SIGTERM arrives while the record is being written
        os.kill(os.getpid(), signal.SIGTERM)
        return "connection to rank 0 lost"

def main():
    raise Lost()

record(main, error_handler=RankErrors())()
"""
    error_file = tmp_path / "attempt_0" / "1" / "error.json"
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file)}
    done = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr  # it ended on its error, not on the signal (-15)
    written = json.loads(error_file.read_text())["message"]["extraInfo"]["shardline"]
    assert written["error"] == "Lost" and "OSError" in written["bases"]
    assert written["message"] == "connection to rank 0 lost"
    assert [p.name for p in error_file.parent.iterdir()] == ["error.json"]  # nothing half-written beside it


def test_the_rank_killed_first_is_named_not_the_peer_the_agent_stopped_after_it(tmp_path):
    """torch's agent stops the ranks still running once one is gone, and its record lists them all (by rank): a
    rank 0 that checkpointed and exited on the agent's SIGTERM two seconds after rank 1 was SIGKILLed is not the
    cause."""
    from shardline.launch.torchrun import RankFailed, outcome
    from shardline.trainer.stops import PREEMPTED_EXIT_CODE

    record = {"host": "node-0", "at": 13.0, "failures": [
        {"rank": 0, "exitcode": PREEMPTED_EXIT_CODE, "signal": None, "timestamp": 12, "error": None},
        {"rank": 1, "exitcode": -9, "signal": "SIGKILL", "timestamp": 10, "error": None}]}  # fmt: skip
    job = {"result": str(tmp_path / "result.json"), "errors": str(tmp_path / "errors"), "ckpt_dir": "s3://b/ckpt",
           "events": str(tmp_path / "events"), "rendezvous": {"nodes": 1, "join_timeout": 60}}  # fmt: skip
    with pytest.raises(RankFailed, match=r"training process 1 \(on node-0\) was killed by SIGKILL"):
        outcome(job, [record], 1, None, 30, "", "")
