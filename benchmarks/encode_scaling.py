"""Does the encode's coding stage use more than one core? (issue #5: where the encode's time goes)

    .venv/bin/python benchmarks/encode_scaling.py            # the data_bench demo data, 400 games
    .venv/bin/python benchmarks/encode_scaling.py --rounds 8

Reads the file groups of the data set once, then times `shardline.core.encoding.group.encode_splits` (the
coding of each group's arrays: standardise, ids, counts, booleans; no read, no compression, no
write) over every group `--rounds` times: on one thread, on two threads (twice the work), and on
two spawned processes (twice the work, each with its own copy of the groups). Prints a table of
the speed-ups: ~2 means the stage scales with cores, ~1 means it is serialised.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT), str(ROOT / "benchmarks")):
    if p not in sys.path:
        sys.path.insert(0, p)
os.environ.setdefault("POLARS_MAX_THREADS", "2")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")


def _groups(sequences: int, frames: int):
    import data_bench as B

    import shardline.tasks.encode as enc
    from shardline.core.encoding.splits import split_rows

    cfg = B.load(None, [], B.demo_source(sequences, frames))
    snap = B.snapshot(cfg, sequences)
    data = cfg.data
    return data, [split_rows(enc.read_group(g, data), data) for g in enc.file_groups(snap, data)]


def _code(data, groups, rounds: int) -> None:
    from shardline.core.encoding.group import encode_splits, one_torch_thread

    with one_torch_thread():
        for _ in range(rounds):
            for frame, splits in groups:
                encode_splits(frame, splits, data)


def _child(args, barrier, queue) -> None:
    data, groups = _groups(args.sequences, args.frames)
    _code(data, groups, 1)  # warm
    barrier.wait()
    t = time.perf_counter()
    _code(data, groups, args.rounds)
    queue.put(time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sequences", type=int, default=400)
    ap.add_argument("--frames", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    data, groups = _groups(args.sequences, args.frames)
    rows = sum(f.height for f, _ in groups)
    _code(data, groups, 1)  # warm: imports, allocator
    t = time.perf_counter()
    _code(data, groups, args.rounds)
    one = time.perf_counter() - t
    with ThreadPoolExecutor(2) as pool:
        t = time.perf_counter()
        list(pool.map(lambda _: _code(data, groups, args.rounds), range(2)))
        threads = time.perf_counter() - t
    ctx = mp.get_context("spawn")  # fork after polars' and torch's threads exist can hang
    barrier, queue = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_child, args=(args, barrier, queue)) for _ in range(2)]
    for p in procs:
        p.start()
    secs = [queue.get(), queue.get()]
    for p in procs:
        p.join()
    procs_s = max(secs)

    print(f"\n# Coding stage of the encode (`encode_splits`): {len(groups)} groups, {rows:,} rows, x{args.rounds}\n")
    print("| run | work | seconds | speed-up vs 1 thread |")
    print("|---|---:|---:|---:|")
    print(f"| 1 thread | 1x | {one:.3f} | 1.00 |")
    print(f"| 2 threads | 2x | {threads:.3f} | {2 * one / threads:.2f} |")
    print(f"| 2 processes | 2x | {procs_s:.3f} | {2 * one / procs_s:.2f} |")


if __name__ == "__main__":
    main()
