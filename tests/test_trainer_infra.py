"""Which training failures are retried (infrastructure) and which fail at once (code, config, data)."""

import pytest
import torch
import torch.distributed

from shardline.tasks.train import is_infrastructure_failure
from shardline.trainer.loop import Preempted

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
    """The same error raised by a rank under torchrun (compute.processes_per_node or compute.nodes > 1): the
    error record the rank writes (shardline/trainer/ddp_run.py) is classified as in one process: retried
    (RankFailed) or not (its own error), a CUDA failure included (was: not retried under torchrun)."""
    import json
    import time

    from shardline.tasks.torchrun import RankFailed, outcome

    result = tmp_path / "result.json"
    bases = [c.__name__ for c in type(exc).__mro__]  # as run_job writes a rank's error
    record = {"status": "failed", "rank": 1, "at": time.time(), "error": type(exc).__name__, "bases": bases}
    (tmp_path / "result.json.rank-1").write_text(json.dumps({**record, "message": str(exc)}))
    peer_lost = RuntimeError("[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:29500")
    consequence = {"error": "RuntimeError", "bases": [c.__name__ for c in type(peer_lost).__mro__]}
    result.write_text(json.dumps({**record, **consequence, "rank": 0, "at": time.time(), "message": str(peer_lost)}))
    with pytest.raises(Exception) as raised:
        outcome(result, "torchrun: exit status 1", 1, "s3://b/run/checkpoints")
    assert isinstance(raised.value, RankFailed) is retried, raised.value
