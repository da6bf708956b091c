"""One training process for tests/test_resume_kill.py and tests/test_streaming_cap.py, which kill it:
`python tests/_train_child.py JOB.json`.

JOB (JSON): `shards` (a folder with train.bin, val.bin and specs.json), or `manifest` (a data set's manifest:
its train and validation splits are opened through the local shard cache, `SHARDLINE_CACHE` capped by
`SHARDLINE_CACHE_MAX_GB` from the environment), `window`, `horizon`, `model_spec`,
`training` (TrainingConfig fields), `ckpt` (the checkpoint folder), `result` (where the FitResult goes, as
JSON), and optional controls that only decide WHERE the test's kill lands, never what is computed:
  hold_at_step: N       after optimizer step N, once the checkpoints taken before it are written (their writer
                        thread may lag behind the steps), print "held N" and wait to be killed
  hold_after_save: NAME after checkpoint NAME is complete, print "held NAME" and wait to be killed (the
                        checkpoint's writer thread waits: training goes on until its next save waits for it)
  slow_write_at: N      the writes of the checkpoints of step N on pause `slow_write_seconds` (default 600)
                        after the .pt and after the sidecar, or only after `slow_write_stage` ("tensors" or
                        "sidecar") (the child wraps the storage writes trainer/checkpoint.py makes, in the
                        writer's thread)
  step_sleep: S         sleep S seconds after each step, so a kill sent while it runs lands mid-run
stdout: "step N" after each optimizer step, "saved NAME" after each complete checkpoint, "done" at the end;
the checkpoint pauses are announced on stderr (merged by the test). Exit status 0 when training finished,
PREEMPTED_EXIT_CODE when SIGTERM/SIGINT stopped it after a checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import types
from pathlib import Path

import torch

torch.set_num_threads(1)  # the reference and every resumed process compute with the same thread count

import shardline.trainer.checkpoint as checkpoint  # noqa: E402
import shardline.trainer.loop as loop  # noqa: E402
import shardline.trainer.saver as saver  # noqa: E402
from shardline.core import storage  # noqa: E402
from shardline.core.config import TrainingConfig  # noqa: E402
from shardline.core.manifest import ArraySpec  # noqa: E402
from shardline.core.shards import read_arrays  # noqa: E402
from shardline.trainer.data import SplitData  # noqa: E402

HOLD_SECONDS = 600  # the test kills a held process long before this


def say(line: str, fd: int = 1) -> None:
    """One line in one write: the checkpoint's writer thread and training say theirs at once (a print can write its
    text and its newline apart, and the other thread's line lands between them)."""
    os.write(fd, (line + "\n").encode())


def hold(what: str) -> None:
    say(f"held {what}")
    time.sleep(HOLD_SECONDS)
    sys.exit(f"held at {what} for {HOLD_SECONDS}s and nobody killed this process")


def split(folder: Path, name: str, window: int, horizon: int) -> SplitData:
    specs = json.loads((folder / "specs.json").read_text())[name]
    return SplitData([read_arrays(folder / name, {k: ArraySpec(**v) for k, v in specs.items()})], window, horizon)


def main(job_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    if "manifest" in job:
        from shardline.core.manifest import Manifest
        from shardline.trainer.data import open_split

        manifest = Manifest.model_validate_json(Path(job["manifest"]).read_text())
        train = open_split(manifest, job["manifest"], "train")
        val = open_split(manifest, job["manifest"], "validation")
    else:
        shards = Path(job["shards"])
        train = split(shards, "train.bin", job["window"], job["horizon"])
        val = split(shards, "val.bin", job["window"], job["horizon"])

    save, snapshot = saver.save_checkpoint, saver.snapshot
    handed, written = [0], [0]  # checkpoints handed to the writer thread, and written by it

    def counted_snapshot(state):
        handed[0] += 1
        return snapshot(state)

    def announced_save(dir_uri, step, *args, **kwargs):
        uri = save(dir_uri, step, *args, **kwargs)
        written[0] += 1
        name = uri.rsplit("/", 1)[-1]
        say(f"saved {name}")
        if name == job.get("hold_after_save"):
            hold(name)
        return uri

    saver.save_checkpoint = announced_save  # the real save, announced once it has returned
    saver.snapshot = counted_snapshot

    # a save that pauses after its .pt ("tensors") and/or its sidecar ("sidecar"), announced on stderr, so the
    # test's kill lands inside it: the checkpoint module's own writes, wrapped here in this process
    def paused(write, stage: str):
        def write_then_pause(uri: str, data) -> None:
            write(uri, data)
            name = uri.rsplit("/", 1)[-1]
            slow = job.get("slow_write_at") is not None and job.get("slow_write_stage") in (None, stage)
            if slow and name.startswith("ckpt-") and int(name[5:14]) >= job["slow_write_at"]:
                say(f"checkpoint-write-paused {name.rsplit('.', 1)[0]}.pt {stage}", fd=2)
                time.sleep(job.get("slow_write_seconds", HOLD_SECONDS))

        return write_then_pause

    checkpoint.storage = types.SimpleNamespace(
        **{
            **vars(storage),
            "write_bytes": paused(storage.write_bytes, "tensors"),
            "write_text": paused(storage.write_text, "sidecar"),
        }
    )

    def on_step(step: int, metrics: dict) -> None:
        say(f"step {step}")
        if step == job.get("hold_at_step"):
            while written[0] < handed[0]:
                time.sleep(0.01)
            hold(str(step))
        if job.get("step_sleep"):
            time.sleep(job["step_sleep"])

    def log(message: str) -> None:
        say(message, fd=2)

    try:
        result = loop.fit(
            train,
            val,
            job["model_spec"],
            TrainingConfig(**job["training"]),
            "classification",
            job["ckpt"],
            callbacks=loop.Callbacks(on_step=on_step, log=log),
            options=loop.FitOptions(step_every=1),
        )
    except loop.Preempted as stopped:
        log(f"preempted: {stopped}")
        return loop.PREEMPTED_EXIT_CODE
    Path(job["result"]).write_text(json.dumps(dataclasses.asdict(result)))
    say("done")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
