"""`fit`'s checkpoints: what each one holds, when the next is due by time, and its write by a thread of its own
while training goes on (the format and its write order: `shardline.trainer.checkpoint`)."""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from shardline.core.storage import join
from shardline.trainer.checkpoint import checkpoint_name, save_checkpoint, snapshot, state_bytes
from shardline.trainer.distributed import gather_to_main
from shardline.trainer.state import TrainState, rng_state

# the loop counters a sidecar carries besides its step: what a finished run's result is read from, unloaded
SIDECAR_LOOP = ("epoch", "epoch_step", "epoch_complete", "best_score", "best_epoch", "best_checkpoint", "pruned_epoch")


class Checkpoints:
    """Saves the run (rank 0 writes; every rank hands it its RNGs) and says when the next save is due by time.

    A checkpoint is written while training goes on: `save` takes a copy of the state on the CPU (`snapshot`: a
    memory copy, or the GPU's copy to the host) and a thread of its own writes it, in the order of
    `save_checkpoint`, so a kill leaves the same files as a write in the training's own thread. Training waits
    only when the next save comes before the last write is done, and at the end: a `with` block over the loop
    waits for the write in flight on the way out, so `Preempted`, a budget stop or the result name a complete
    checkpoint, and a write's error is the run's. A state too big to copy in the memory the machine has free
    is written in the training's thread (a note says so)."""

    def __init__(self, ckpt_dir, cfg, plan, step, loader, run_meta: dict, task, on_checkpoint, log):
        self.ckpt_dir, self.cfg, self.plan, self.step, self.loader = ckpt_dir, cfg, plan, step, loader
        self.header = {"run_meta": run_meta, "model_spec": plan.spec, "training": plan.training, "task": task}
        self.on_checkpoint, self.log = on_checkpoint, log
        self.last = time.monotonic()  # checkpoint_every_seconds counts from here and from each save's copy
        self.writer: ThreadPoolExecutor | None = None
        self.writing: tuple[Future, float] | None = None  # the write in flight, and when its state was taken
        self.in_background: bool | None = None  # decided at the first save, from its size

    def due(self) -> bool:
        seconds = self.cfg.checkpoint_every_seconds
        return bool(seconds and time.monotonic() - self.last >= seconds)

    def save(self, state: TrainState, is_best: bool) -> str:
        ranks = self.plan.ranks
        state.last_checkpoint = checkpoint_name(state.step)
        if is_best:
            state.best_checkpoint = state.last_checkpoint
        rngs = gather_to_main(rng_state()) if ranks.distributed else None  # every rank's RNGs, on rank 0
        if not ranks.is_main:
            # rank 0 writes it; every rank restarts checkpoint_every_seconds' clock (one rank's `due` is all's)
            self.last = time.monotonic()
            return join(self.ckpt_dir, state.last_checkpoint)
        loop, history = state.state_dict(), state.history
        tensors = {
            "format": 1,
            **self.step.state_dict(),
            "rng": rng_state(),
            **({"rng_ranks": rngs} if rngs else {}),
            "loader": self.loader.state_dict(),
            "loop": loop,
            "history": history,
            **self.header,
        }
        meta = {
            **{k: loop[k] for k in SIDECAR_LOOP},
            "loader": self.loader.state_dict(),
            "metrics": history[-1] if history and state.epoch_complete else {},
            "history": history,
            **self.header,
            "windows": self.plan.windows,
            "device": self.plan.device.type,
            "precision": self.plan.precision,
            "steps_per_epoch": self.plan.steps_per_epoch,
            "world_size": ranks.size,
        }
        self.finish()  # the previous write first: checkpoints land in order, one copy in memory at a time
        write = (self.ckpt_dir, state.step, tensors, meta, is_best, self.cfg.keep_checkpoints)
        if self._background(tensors):
            self.writer = self.writer or ThreadPoolExecutor(1, thread_name_prefix="shardline-checkpoint")
            self.writing = (self.writer.submit(save_checkpoint, *snapshot(write)), time.monotonic())
        else:
            self._written(save_checkpoint(*write), time.monotonic())
        self.last = time.monotonic()
        return join(self.ckpt_dir, state.last_checkpoint)

    def _background(self, tensors: dict) -> bool:
        if self.in_background is None:
            size, free = state_bytes(tensors), _free_memory()
            # the copy and its serialised bytes beside the training's own memory, with room to spare
            self.in_background = 3 * size < free
            if not self.in_background:
                self.log(
                    f"note: checkpoints are written while training waits: a copy of this run's state "
                    f"({size / 1e9:.1f} GB) to write meanwhile needs more than the {free / 1e9:.1f} GB of memory free"
                )
        return self.in_background

    def poll(self) -> None:
        """A write that has finished meanwhile: reported (cheap enough for every step)."""
        if self.writing is not None and self.writing[0].done():
            self.finish()

    def finish(self) -> None:
        """Wait for the write in flight; its error is raised here, its checkpoint reported."""
        if self.writing is not None:
            (future, taken), self.writing = self.writing, None
            self._written(future.result(), taken)

    def _written(self, uri: str, taken: float) -> None:
        if self.on_checkpoint is not None:
            self.on_checkpoint(uri, time.monotonic() - taken)

    def __enter__(self) -> Checkpoints:
        return self

    def __exit__(self, kind, error, tb) -> None:
        try:
            if kind is None:
                self.finish()
            elif self.writing is not None:  # the run is failing or stopping: the write in flight still lands
                try:
                    self.finish()
                except Exception as e:  # noqa: BLE001 - the run's own error is the one raised; this one is said
                    self.log(f"the last checkpoint could not be written: {type(e).__name__}: {e}")
        finally:
            if self.writer is not None:
                self.writer.shutdown()


def _free_memory() -> int:
    """The bytes this process may still take: the machine's available memory, or less under a container's limit."""
    import psutil

    free = psutil.virtual_memory().available
    try:  # cgroup v2, as a container sees its own
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            free = min(free, int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return free
