"""Wall time of a fully cached rerun against the first (uncached) run: same data, same command.

    .venv/bin/python benchmarks/rerun_bench.py [--games 160] [--frames 2000] [--epochs 3]

Runs `shardline demo` twice in a fresh home (start-up included, as a user sees it) and prints a table.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent / "shardline"


def timed(args: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    out = subprocess.run([str(BIN), *args], capture_output=True, text=True)
    if out.returncode:
        sys.exit(f"shardline {' '.join(args)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-2000:]}")
    return time.perf_counter() - t0, next((line for line in out.stdout.splitlines() if line.startswith("steps:")), "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--games", type=int, default=160)
    ap.add_argument("--frames", type=int, default=2000)
    ap.add_argument("--epochs", type=int, default=3)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as home:
        args = [
            "demo",
            "--home",
            home,
            "--games",
            str(a.games),
            "--frames",
            str(a.frames),
            "--set",
            f"training.epochs={a.epochs}",
        ]
        # the data generation is not part of the pipeline: make the data first, time the pipeline runs only
        from shardline.app.demo_home import demo_raw_data

        demo_raw_data(Path(home) / "data" / "raw", a.games, a.frames, 0)
        first, steps1 = timed(args)
        second, steps2 = timed(args)
    print(f"\n{a.games} games x {a.frames} frames, {a.epochs} epochs, `shardline demo` wall time, start-up included\n")
    print("| run | wall s | ratio to first | steps |")
    print("|---|---:|---:|---|")
    print(f"| first (uncached) | {first:.1f} | 1.00 | {steps1.removeprefix('steps: ')} |")
    print(f"| same command again | {second:.1f} | {second / first:.2f} | {steps2.removeprefix('steps: ')} |")


if __name__ == "__main__":
    main()
