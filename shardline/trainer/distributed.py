"""Several training processes (DDP): who this process is, how a global batch is split among the ranks, and
the few collectives the loop needs. Plain `torch.distributed`; runnable under `torchrun` alone.

A global batch is `training.batch_size` windows of the epoch's global permutation, exactly the batch one
process would train on; rank r of W takes its windows [k*r//W, k*(r+1)//W) (k the batch's size: the
batch size, or the epoch's last, shorter batch). So N ranks together see exactly the batches one process
would, in the same order per step. A rank whose share of a short last batch is empty trains on one window
of it with weight 0 (DDP needs every rank in every step), so it adds nothing to the gradient.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def world() -> World:
    """This process's place: from the initialised process group, else one process."""
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))
    return World()


def check_gpus_per_node(processes: int, device_type: str, gpus: int) -> None:
    """A GPU for each process of a node that trains on CUDA: more processes than GPUs refused, naming the
    setting (NCCL refuses two ranks on one GPU, and a rank numbered past the last GPU fails on CUDA's
    "invalid device ordinal", which names nothing a user set)."""
    if device_type == "cuda" and processes > gpus:
        raise ValueError(
            f"compute.processes_per_node={processes}, but this machine has {gpus} GPU(s): each process trains "
            f"on a GPU of its own (NCCL does not share one between processes); set compute.processes_per_node "
            f"to at most {gpus}, or training.device: cpu to train in processes on the CPU (gloo)"
        )


def init_from_env(device: str = "auto", timeout: float | None = None) -> World:
    """Join the process group torchrun's environment describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    MASTER_PORT): NCCL on CUDA, gloo on CPU. Without WORLD_SIZE > 1 it is one process and nothing is joined.
    `timeout`: seconds a collective waits for a peer before it fails (a lost machine's ranks never answer; torch's
    default: 30 minutes for gloo, 10 for NCCL); the agent's restart round then resumes from the newest checkpoint."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1 or dist.is_initialized():
        return world()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    cuda = device in ("auto", "cuda") and torch.cuda.is_available()
    if cuda:  # this node's processes (torchrun's LOCAL_WORLD_SIZE), a GPU each
        check_gpus_per_node(int(os.environ.get("LOCAL_WORLD_SIZE", local_rank + 1)), "cuda", torch.cuda.device_count())
        torch.cuda.set_device(local_rank)  # "cuda" is then this rank's GPU
    from datetime import timedelta

    limit = {"timeout": timedelta(seconds=float(timeout))} if timeout else {}
    dist.init_process_group(backend="nccl" if cuda else "gloo", **limit)
    return world()


def check_batch_size(batch_size: int, size: int) -> None:
    if batch_size % size:
        raise ValueError(
            f"training.batch_size={batch_size} is not divisible by the world size {size} (processes in all, "
            "compute.nodes x compute.processes_per_node): each process takes an equal share of a global batch; "
            f"use a multiple of {size}"
        )


def rank_bounds(k: int, rank: int, size: int) -> tuple[int, int]:
    """Rank `rank`'s windows [lo, hi) of a global batch of `k` windows."""
    return k * rank // size, k * (rank + 1) // size


def rank_positions(lo: int, hi: int, batch_size: int, end: int, rank: int, size: int) -> list[tuple[int, int, int]]:
    """For the global batches starting at lo, lo + batch_size, ... below hi (the epoch yields `end` windows):
    (first position taken, windows taken, global batch size) of rank `rank`; an empty share takes the
    batch's first window (trained with weight 0)."""
    out = []
    for p in range(lo, hi, batch_size):
        k = min(batch_size, end - p)
        a, b = rank_bounds(k, rank, size)
        out.append((p + a, b - a, k) if b > a else (p, 1, k))
    return out


def all_sum(values: list[float], device: torch.device) -> list[float]:
    """The sum over ranks of each value (one all-reduce of a small float64 tensor)."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def gather_to_main(obj):
    """Every rank's `obj` on rank 0 (a list by rank), None on the others."""
    w = world()
    out = [None] * w.size if w.is_main else None
    dist.gather_object(obj, out, dst=0)
    return out


def from_main(obj):
    """Rank 0's `obj` on every rank."""
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def leave(ok: bool) -> None:
    """Leave the process group: after a barrier when the run ended well on every rank (gloo aborts a process
    that tears its group down while a peer still uses it); at once after a failure, whose peers may be gone."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    if ok:
        dist.barrier()
    dist.destroy_process_group()


def exit_now(code: int) -> None:
    """End a rank's process with `code`, skipping the interpreter's teardown: with a gloo group left, the
    C++ side's static destructors sometimes abort the process (`terminate called without an active
    exception`, SIGABRT) after the run has ended well, which torchrun would report as a failure."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
