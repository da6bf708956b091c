"""Which training failures are retried (infrastructure) and which fail at once (code, config, data)."""

import pytest

from shardline.tasks.train import is_infrastructure_failure
from shardline.trainer.loop import Preempted


@pytest.mark.parametrize(
    "exc, retried",
    [
        (OSError("connection reset while writing checkpoint"), True),
        (ConnectionError("s3 endpoint went away"), True),
        (RuntimeError("CUDA error: an illegal memory access was encountered"), True),
        (RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x3 and 5x6)"), False),
        (ValueError("bad config"), False),
        (KeyError("cont"), False),
        (Preempted("ckpt-000000010.pt", "SIGTERM"), False),
    ],
)
def test_retry_budget_is_for_infrastructure_only(exc, retried):
    assert is_infrastructure_failure(exc) is retried
