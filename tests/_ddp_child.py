"""One rank of a DDP training for tests/test_ddp.py: `python -m shardline.trainer.torchrun --standalone
--nproc-per-node N tests/_ddp_child.py JOB.json` (or two agents at one c10d rendezvous), or alone
(`python tests/_ddp_child.py JOB.json`: one process).

The same as `python -m shardline.trainer.ddp_run JOB.json`, except that the splits are two shard files
(JOB's `shards`: a folder with train.bin, val.bin and specs.json, `window`, `horizon`) instead of a
manifest. Each rank writes its pid to `<result>.pid-<rank>` so that the test can kill one of them.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch

torch.set_num_threads(1)  # every run computes with the same thread count

from _train_child import split  # noqa: E402 (this script's folder is on sys.path)
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402

from shardline.core.config import TrainingConfig  # noqa: E402
from shardline.core.parent_watch import signal_on_parent_death  # noqa: E402
from shardline.trainer.ddp_run import RankErrors, run_job  # noqa: E402
from shardline.trainer.distributed import exit_now, init_from_env, leave  # noqa: E402


def main(job_path: str) -> int:
    signal_on_parent_death(signal.SIGKILL)
    job = json.loads(Path(job_path).read_text())
    ranks = init_from_env(TrainingConfig(**job["training"]).device, job.get("collective_timeout"))
    Path(f"{job['result']}.pid-{ranks.rank}").write_text(str(os.getpid()))
    if os.environ.get("SHARDLINE_TEST_RAISE_ON_RANK") == str(ranks.rank):  # this rank fails as a GPU's would
        import shardline.trainer.step as step

        model_loss, calls = step.model_loss, []

        def failing(*args, **kwargs):
            calls.append(1)
            if len(calls) >= 5:
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB (this test's)")
            return model_loss(*args, **kwargs)

        step.model_loss = failing
    shards = Path(job["shards"])
    train = split(shards, "train.bin", job["window"], job["horizon"])
    val = split(shards, "val.bin", job["window"], job["horizon"])
    code = 1
    try:
        code = run_job(job, train, val)
        return code
    finally:
        leave(code == 0)  # every rank finished or stopped at the same step


if __name__ == "__main__":
    exit_now(record(main, error_handler=RankErrors())(sys.argv[1]))
