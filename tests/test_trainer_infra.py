"""Which training failures are retried (infrastructure) and which fail at once (code, config, data)."""

import pytest
import torch
import torch.distributed

from shardline.tasks.train import is_infrastructure_failure
from shardline.trainer.loop import Preempted


@pytest.mark.parametrize(
    "exc, retried",
    [
        (OSError("connection reset while writing checkpoint"), True),
        (ConnectionError("s3 endpoint went away"), True),
        (TimeoutError("read timed out"), True),
        (torch.AcceleratorError("CUDA error: an illegal memory access was encountered"), True),
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
def test_retry_budget_is_for_infrastructure_only(exc, retried):
    assert is_infrastructure_failure(exc) is retried
