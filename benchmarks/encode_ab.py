"""Is this tree's encode faster than another commit's? Paired rounds against the polars floor.

    .venv/bin/python benchmarks/encode_ab.py HEAD~1              # this tree against the previous commit
    .venv/bin/python benchmarks/encode_ab.py 537ad57 --rounds 30
    .venv/bin/python benchmarks/encode_ab.py HEAD --quick       # smoke run: 40 games x 500 frames, 2 rounds
    .venv/bin/python benchmarks/encode_ab.py HEAD --set data.group_mb=13.5   # both sides with this override

The other commit is checked out into a temporary git worktree (removed afterwards). One child
process per side imports its own tree's `shardline.tasks.encode` and waits for orders; the parent runs
them in alternating order, round after round, and each round times, inside the child, polars
reading the files (the floor, as in `data_bench.py`) and right after it that side's
`encode_dataset` on 2 threads. The ratio of the two, taken within the round, cancels the
machine's slow drift (its speed moves by ~15 % within minutes), which best-of-N of each side
does not. Prints the geometric mean of each side's per-round ratios with its standard error,
their medians, and the new side's speed-up. Same demo data as `data_bench.py` (400 games x 2,000
frames by default, made once into benchmarks/.data/). The other commit must have `encode_dataset`.
Against the same commit (an A/A run), 16 rounds read 1.016x: differences under ~5 % need more rounds.
Read the two sides against each other: the ratios themselves run lower (~1.5x) than
`data_bench.py`'s best of each side (~1.8x), whose floor is faster (README, Performance).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, shutil, sys, tempfile, time
root, data_root, overrides = sys.argv[1], sys.argv[2], sys.argv[3:]
sys.path[:0] = [root, os.path.join(root, "benchmarks")]
os.environ.setdefault("POLARS_MAX_THREADS", "2")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
import polars as pl
# the layered package (since 2026-11-23), chosen by the tree's folders: an editable install of another
# tree would answer the import of a module this tree lacks
if os.path.isdir(os.path.join(root, "shardline", "tasks")):
    import shardline.tasks.encode as enc_mod
    from shardline.core.config import load_config
    from shardline.tasks.ingest import snapshot_source
else:  # a commit from before the layers: top-level tasks/, the core in shardline/
    import tasks.encode as enc_mod
    from shardline.config import load_config
    from tasks.ingest import snapshot_source
encode_dataset = enc_mod.encode_dataset
cfg = load_config(
    os.path.join(root, "shardline/configs/demo.yaml"),
    [f"data.source={data_root}/*.parquet", "data.continuous_dtype=float16", *overrides],
)
snap = snapshot_source(cfg.data)
files, cols = [f.uri for f in snap.files], cfg.data.raw_columns()
if not os.path.realpath(enc_mod.__file__).startswith(os.path.realpath(root) + os.sep):
    sys.exit(f"{root}: imported {enc_mod.__name__} from {enc_mod.__file__}, not from this tree")
print(json.dumps({"ready": len(files)}), flush=True)
for line in sys.stdin:
    t = time.perf_counter(); pl.scan_parquet(files).select(cols).collect(); floor = time.perf_counter() - t
    out = tempfile.mkdtemp(prefix="shardline-ab-")
    t = time.perf_counter(); encode_dataset(snap, cfg.data, out, threads=2); enc = time.perf_counter() - t
    shutil.rmtree(out)
    print(json.dumps({"floor": floor, "enc": enc}), flush=True)
"""


def start(root: Path, data_root: str, overrides: list[str]) -> subprocess.Popen:
    p = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(root), data_root, *overrides],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=root,
    )
    line = p.stdout.readline()
    if not line:
        raise SystemExit(f"the encode at {root} did not start (see its error above)")
    return p


def round_trip(p: subprocess.Popen) -> dict:
    p.stdin.write("go\n")
    p.stdin.flush()
    line = p.stdout.readline()
    if not line:
        raise SystemExit("a side's encode died (see its error above)")
    return json.loads(line)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("against", help="the commit to compare this tree with (anything `git worktree add` takes)")
    ap.add_argument(
        "--rounds", type=int, default=20, help="timed rounds per side, after one warm-up round each (default 20)"
    )
    ap.add_argument("--sequences", type=int, default=400, help="demo games (default 400)")
    ap.add_argument("--frames", type=int, default=2000, help="frames per demo game (default 2000)")
    ap.add_argument("--quick", action="store_true", help="smoke run: 40 games x 500 frames, 2 rounds")
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="a config override for both sides (repeatable)"
    )
    args = ap.parse_args(argv)
    if args.quick:
        args.sequences, args.frames, args.rounds = 40, 500, 2

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import data_bench as B

    folder = Path(B.demo_source(args.sequences, args.frames)).parent
    work = Path(tempfile.mkdtemp(prefix="shardline-ab-"))
    data_root, other = work / "data", work / "tree"
    sides: dict[str, subprocess.Popen] = {}
    try:
        data_root.mkdir()  # the first --sequences games of the folder
        for i in range(args.sequences):
            os.symlink(folder / f"game-{i:05d}.parquet", data_root / f"game-{i:05d}.parquet")
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "add", "--detach", "-q", str(other), args.against], check=True
        )
        sides["this tree"] = start(ROOT, str(data_root), args.set)
        sides[args.against] = start(other, str(data_root), args.set)
        ratios: dict[str, list[float]] = {k: [] for k in sides}
        times: dict[str, list[float]] = {k: [] for k in sides}
        names = list(sides)
        for r in range(args.rounds + 1):
            B.log(f"round {r}/{args.rounds}" + (" (warm-up)" if r == 0 else ""))
            for name in names if r % 2 else names[::-1]:
                t = round_trip(sides[name])
                if r:
                    ratios[name].append(math.log(t["enc"] / t["floor"]))
                    times[name].append(t["enc"])
    finally:
        for p in sides.values():
            p.stdin.close()
            p.wait()
        if other.exists():
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(other)], check=False)
        shutil.rmtree(work, ignore_errors=True)

    print(
        f"\n# Encode A/B: paired rounds against the polars floor ({args.rounds} rounds per side, {args.sequences} "
        "games x "
        f"{args.frames:,} frames, 2 threads)\n"
    )
    print("| side | encode / floor, geometric mean of rounds | median of rounds | encode seconds, best (median) |")
    print("|---|---:|---:|---:|")
    for name in names:
        lr = ratios[name]
        se = statistics.stdev(lr) / math.sqrt(len(lr)) if len(lr) > 1 else float("nan")
        print(
            f"| {name} | {math.exp(statistics.mean(lr)):.3f} (+-{se:.1%}) | {math.exp(statistics.median(lr)):.3f} | "
            f"{min(times[name]):.3f} ({statistics.median(times[name]):.3f}) |"
        )
    gain = math.exp(statistics.mean(ratios[names[1]]) - statistics.mean(ratios[names[0]]))
    print(f"\nthis tree's encode takes {1 / gain:.3f}x the time of {args.against}'s, relative to the same floor")


if __name__ == "__main__":
    main()
