"""What checkpointing costs and what a preemption loses, measured in one run on synthetic shards.

    .venv/bin/python benchmarks/resume_bench.py [--quick] [--rows N] [--seed N]
    .venv/bin/python benchmarks/resume_bench.py --hidden 2048 --throughput-only   # a bigger checkpoint

Shards: `--rows` rows (default 200,000) in sequences of 2,000, 40 continuous + 15 categorical columns,
window 8, 400 classes; an MLP with hidden 256 (the demo's model; `--hidden` for a bigger state to write), batch
256, fp32 on the CPU.

1. Throughput (train windows/s from step 10 to the epoch's last step, so start-up, validation and the
   epoch-end checkpoint are left out) with mid-epoch checkpoints off, every 200 steps (the demo's cadence)
   and every 50 steps, in-process, interleaved and repeated; the best of each (the least disturbed by other
   load on the machine), as a ratio to "off"; and the cost of one checkpoint: the median time of a step that
   took one, less the median step, and the ratio that cost implies (steady and robust to noise).
2. Time lost per preemption, for a few cadences: a training process (its own child, default threads) is
   SIGKILLed at a random step; a fresh one resumes. Lost = from the kill until the new process is back at
   the killed step: start-up + restore ("restart") plus the steps redone since the last checkpoint ("redo").
   Kills are chained: each resumed process is killed again further on.
Numbers are for the machine it runs on; compare the rows with each other, not with another machine.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

SEQ_ROWS = 2_000
N_CONT, WINDOW, N_CLASSES = 40, 8, 400
CARDS = [400, 4, 30, 5, 3, 10, 60, 400, 4, 30, 5, 3, 10, 60, 30]  # 15 categoricals, id 0 = unseen
BATCH = 256
HIDDEN = [256]  # the MLP's width (--hidden; the training child gets it in its job)


# ---------------------------------------------------------------- data and training


def write_split(folder: Path, name: str, rows: int, seed: int) -> None:
    from shardline.core.shards import allocate

    rng = np.random.default_rng(seed)
    rows = max(SEQ_ROWS, rows - rows % SEQ_ROWS)
    cat = np.stack([rng.integers(1, c, rows) for c in CARDS], axis=1).astype(np.uint16)
    target = np.ones(rows, dtype=np.int32)
    target[1:] = (cat[:-1, 0].astype(np.int32) + cat[:-1, 2]) % (N_CLASSES - 1) + 1  # learnable from the window
    arrays = {
        "cont": rng.standard_normal((rows, N_CONT)).astype(np.float32),
        "cat": cat,
        "target": target,
        "order": np.arange(rows, dtype=np.int64),
        "offsets": np.arange(0, rows + 1, SEQ_ROWS, dtype=np.int64),
    }
    buf, specs, views = allocate({k: (a.dtype, a.shape) for k, a in arrays.items()})
    for k, a in arrays.items():
        views[k][...] = a
    (folder / f"{name}.bin").write_bytes(buf)
    (folder / f"{name}.json").write_text(json.dumps({k: v.model_dump() for k, v in specs.items()}))


def open_splits(folder: Path):
    from shardline.core.manifest import ArraySpec
    from shardline.core.shards import read_arrays
    from shardline.trainer.data import SplitData

    def split(name: str) -> SplitData:
        specs = {k: ArraySpec(**v) for k, v in json.loads((folder / f"{name}.json").read_text()).items()}
        return SplitData([read_arrays(folder / f"{name}.bin", specs)], WINDOW, 1)

    return split("train"), split("val")


def spec() -> dict:
    from shardline.core.config import ModelConfig
    from shardline.trainer.models import model_spec

    return model_spec(
        ModelConfig(family="mlp", hidden=HIDDEN[0], layers=2, dropout=0.1), N_CONT, CARDS, WINDOW, N_CLASSES
    )


def training(**over):
    from shardline.core.config import TrainingConfig

    base = dict(
        epochs=1,
        batch_size=BATCH,
        lr=2e-3,
        warmup_steps=50,
        device="cpu",
        precision="fp32",
        seed=0,
        checkpoint_every_steps=0,
        checkpoint_every_seconds=0,
        keep_checkpoints=2,
    )
    return TrainingConfig(**{**base, **over})


def quiet(_msg: str) -> None:
    pass


# ---------------------------------------------------------------- 1. throughput


SKIP_STEPS = 10  # a fit's first steps are slow (allocation, warm-up): not what a checkpoint costs


def throughput(shards: Path, work: Path, steps: int, repeats: int) -> list[dict]:
    from shardline.trainer.checkpoint import latest_checkpoint
    from shardline.trainer.loop import Callbacks, FitOptions, fit

    train, val = open_splits(shards)
    cadences = [("off (epoch ends only)", 0), ("every 200 steps (demo)", 200), ("every 50 steps", 50)]
    fit(
        train,
        val,
        spec(),
        training(max_steps_per_epoch=20),
        "classification",
        str(work / "warm-up"),
        callbacks=Callbacks(log=quiet),
    )
    speeds: dict[str, list[float]] = {label: [] for label, _ in cadences}
    costs: dict[str, list[float]] = {label: [] for label, _ in cadences}
    size = 0
    for r in range(repeats):
        for label, every in cadences:
            folder = work / f"throughput-{every}-{r}"
            at: dict[int, float] = {}
            fit(
                train,
                val,
                spec(),
                training(max_steps_per_epoch=steps, checkpoint_every_steps=every),
                "classification",
                str(folder),
                callbacks=Callbacks(
                    on_step=lambda step, _m, at=at: at.__setitem__(step, time.perf_counter()), log=quiet
                ),
                options=FitOptions(step_every=1, resume=False),
            )
            # a checkpoint after step k is taken between on_step(k) and on_step(k + 1): inside this span
            speeds[label].append((steps - SKIP_STEPS) * BATCH / (at[steps] - at[SKIP_STEPS]))
            took = {k: at[k + 1] - at[k] for k in range(SKIP_STEPS, steps)}
            typical = statistics.median(took.values())
            costs[label] += [took[k] - typical for k in took if every and k % every == 0]
            size = latest_checkpoint(str(folder))[1]["bytes"]
            shutil.rmtree(folder)
    base = max(speeds[cadences[0][0]])
    rows = []
    for label, every in cadences:
        wps = max(speeds[label])
        rows.append(
            {
                "cadence": label,
                "checkpoints": (steps - 1) // every if every else 0,
                "windows_per_s": wps,
                "ratio": wps / base,
                "step_ms": 1000 * BATCH / wps,
                "checkpoint_ms": 1000 * statistics.median(costs[label]) if costs[label] else None,
                "every": every,
                "all": sorted(round(x) for x in speeds[label]),
            }
        )
    return rows, size


# ---------------------------------------------------------------- 2. time lost per preemption


class Trainee:
    """A training child (this file with --child); its "step N" lines are timestamped as they arrive."""

    def __init__(self, job: Path):
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--child", str(job)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put((time.monotonic(), line.split()))
        self.lines.put((time.monotonic(), None))

    def until_step(self, step: int) -> tuple[float, float]:
        """Wait for "step `step`"; (time of the first step line, time of that one)."""
        first = None
        while True:
            at, parts = self.lines.get(timeout=600)
            if parts is None:
                raise RuntimeError(f"the training child exited ({self.proc.wait()}) before step {step}")
            if parts[0] == "step":
                first = first or at
                if int(parts[1]) >= step:
                    return first, at

    def kill(self) -> float:
        at = time.monotonic()
        self.proc.kill()
        self.proc.wait()
        return at


def preemption(shards: Path, work: Path, cadences: list[tuple[str, dict, int]], kills: int, rng) -> list[dict]:
    from shardline.trainer.checkpoint import latest_checkpoint

    rows = []
    for label, cadence, span in cadences:
        folder = work / f"preempt-{label.replace(' ', '-')}"
        job = work / f"{folder.name}.json"
        job.write_text(
            json.dumps(
                {
                    "shards": str(shards),
                    "ckpt": str(folder),
                    "training": training(epochs=50, **cadence).model_dump(mode="json"),
                    "hidden": HIDDEN[0],
                }
            )
        )
        child, at_step, lost, restart, redo, redone = Trainee(job), 0, [], [], [], []
        for _ in range(kills):
            kill_step = at_step + int(rng.integers(span // 2, span + span // 2))  # past the last restart's checkpoint
            child.until_step(kill_step)
            killed_at = child.kill()
            saved = latest_checkpoint(str(folder))
            saved_step = saved[1]["step"] if saved else 0
            child = Trainee(job)
            first, back = child.until_step(kill_step)
            lost.append(back - killed_at)
            restart.append(first - killed_at)
            redo.append(back - first)
            redone.append(max(0, kill_step - saved_step))  # < 0: the kill landed after a checkpoint past it
            at_step = kill_step
        child.kill()
        shutil.rmtree(folder, ignore_errors=True)
        rows.append(
            {
                "cadence": label,
                "kills": kills,
                "lost_s": statistics.mean(lost),
                "restart_s": statistics.mean(restart),
                "redo_s": statistics.mean(redo),
                "redone_steps": statistics.mean(redone),
                "max_lost_s": max(lost),
            }
        )
    return rows


def child(job_path: str) -> int:
    """Train until killed, printing "step N" after each optimizer step (resumes whatever the folder holds)."""
    from shardline.trainer.loop import Callbacks, FitOptions, fit

    job = json.loads(Path(job_path).read_text())
    HIDDEN[0] = job["hidden"]
    train, val = open_splits(Path(job["shards"]))

    def on_step(step: int, _metrics: dict) -> None:
        print(f"step {step}", flush=True)

    fit(
        train,
        val,
        spec(),
        training(**job["training"]),
        "classification",
        job["ckpt"],
        callbacks=Callbacks(on_step=on_step, log=quiet),
        options=FitOptions(step_every=1),
    )
    return 0


# ---------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="fewer steps, repeats and kills (about 2 minutes on 2 cores)"
    )
    parser.add_argument("--rows", type=int, default=200_000, help="train rows (default 200,000)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the kill steps")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (shards, checkpoints)")
    parser.add_argument("--hidden", type=int, default=256, help="the MLP's width (default 256, the demo's)")
    parser.add_argument("--throughput-only", action="store_true", help="part 1 alone (no preemptions)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(args.child)
    HIDDEN[0] = args.hidden

    import torch

    work = Path(tempfile.mkdtemp(prefix="resume-bench-"))
    try:
        shards = work / "shards"
        shards.mkdir()
        t0 = time.perf_counter()
        write_split(shards, "train", args.rows, seed=1)
        write_split(shards, "val", max(SEQ_ROWS, args.rows // 50), seed=2)
        train, _ = open_splits(shards)
        steps_per_epoch = -(-train.n_windows // BATCH)
        print(
            f"shards: {train.n_windows:,} train windows ({steps_per_epoch} steps of {BATCH} per epoch), "
            f"{N_CONT} continuous + {len(CARDS)} categorical, window {WINDOW}, {N_CLASSES} classes; "
            f"written in {time.perf_counter() - t0:.1f}s; torch {torch.__version__}, {torch.get_num_threads()} "
            "threads, "
            f"{os.cpu_count()} CPUs",
            flush=True,
        )

        steps, repeats = (250, 3) if args.quick else (min(600, steps_per_epoch), 5)
        rows, size = throughput(shards, work, steps, repeats)
        print(
            f"\n### 1. Training throughput vs checkpoint cadence ({steps} steps, best of {repeats}; "
            f"a checkpoint is {size / 1e6:.1f} MB)\n"
        )
        print(
            "| cadence | mid-epoch checkpoints | windows/s | ms/step | vs off | one checkpoint (ms) | vs off, from "
            "that cost | every run (windows/s) |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---|")
        for r in rows:
            cost, implied = "-", 1.0
            if r["checkpoint_ms"] is not None:
                cost = f"{r['checkpoint_ms']:.0f}"
                implied = 1 / (1 + r["checkpoint_ms"] / (r["every"] * rows[0]["step_ms"]))
            print(
                f"| {r['cadence']} | {r['checkpoints']} | {r['windows_per_s']:,.0f} | {r['step_ms']:.1f} | "
                f"{r['ratio']:.3f} | "
                f"{cost} | {implied:.3f} | {', '.join(f'{x:,}' for x in r['all'])} |"
            )
        sys.stdout.flush()
        if args.throughput_only:
            return 0

        step_s = rows[0]["step_ms"] / 1000
        ten_s = max(2, round(10 / step_s))  # steps in 10 s, to place the kills over a whole interval
        cadences = [
            ("every 50 steps", {"checkpoint_every_steps": 50}, 50),
            ("every 200 steps", {"checkpoint_every_steps": 200}, 200),
            ("every 10 s", {"checkpoint_every_seconds": 10.0}, ten_s),
        ]
        kills = 2 if args.quick else 5
        lost = preemption(shards, work, cadences, kills, np.random.default_rng(args.seed))
        print(
            f"\n### 2. Time lost per preemption (SIGKILL at a random step, {kills} kills each; "
            f"off-cadence step {1000 * step_s:.1f} ms, so 10 s ~ {ten_s} steps)\n"
        )
        print(
            "| checkpoint interval | lost per kill (s) | restart: start-up + restore (s) | redo (s) | steps redone | "
            "worst (s) | lost / restart |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|")
        for r in lost:
            print(
                f"| {r['cadence']} | {r['lost_s']:.1f} | {r['restart_s']:.1f} | {r['redo_s']:.1f} | "
                f"{r['redone_steps']:.0f} | "
                f"{r['max_lost_s']:.1f} | {r['lost_s'] / r['restart_s']:.2f} |"
            )
    finally:
        if args.keep:
            print(f"\nwork folder kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
