"""A raw file larger than a group: its encode in parts (the default) against the same file encoded whole.

    .venv/bin/python benchmarks/large_file.py                 # a file of 12M rows (800 MB)
    .venv/bin/python benchmarks/large_file.py --rows 1000000  # a quick one

The file: a click log of sessions of 20 shown items (a session id, user and item ids, 17 numbers, a click), one
zlib parquet file in row groups of 125,000 rows (random numbers: 66 bytes a row), and the same rows in files of about
8 MB, made once into benchmarks/.data/ and reused. Config: the two-tower example's (examples/two_tower/shardline.yaml).
Each way runs `encode_dataset` (the encode step's own functions on 2 threads, no Prefect) in a child process of its
own (its peak RSS: `ru_maxrss`), best of `--rounds`:

- the file in parts (the defaults: `data.group_mb` 12, about one part per 12 MB; shardline/core/encoding/groups.py);
- the file whole: `data.group_mb` larger than the file, one group (what every file was before);
- the same rows in 8 MB files: ordinary files, one group each or two.

All three must give the same rows per split. The targets: the file in parts costs at most 1.25x the peak RSS of the
same rows in ordinary files (memory set by `data.group_mb`, not by a file's size; what grows with the data set, its
groups' statistics and codes, grows in both) and at most 1.5x their seconds (the file is read twice: cut into parts,
then each part); and at most half the whole file's peak RSS. Prints a markdown table; the exit code is 0 either way."""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / ".data"
CONFIG = ROOT / "examples" / "two_tower" / "shardline.yaml"


def make_file(rows: int) -> Path:
    import numpy as np
    import polars as pl

    path = DATA / f"clicks-{rows}.parquet"
    if path.exists():
        return path
    DATA.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    shown = 20
    sessions = rows // shown
    users, items = rng.integers(0, 400_000, sessions), rng.integers(0, 50_000, rows)
    user = np.repeat(users, shown)
    frame = pl.DataFrame(
        {
            "session_id": np.char.add("s", np.repeat(np.arange(sessions), shown).astype(str)),
            "user_id": user,
            "item_id": items,
            **{f"u_{d}": rng.normal(size=rows).astype(np.float32) for d in range(8)},
            "user_region": np.char.add("r", (user % 4).astype(str)),
            **{f"i_{d}": rng.normal(size=rows).astype(np.float32) for d in range(8)},
            "item_category": np.char.add("c", (items % 6).astype(str)),
            "item_price": rng.lognormal(3, 0.5, rows).astype(np.float32),
            "click": (rng.random(rows) < 0.2).astype(np.int64),
        }
    )
    aside = path.with_suffix(".tmp")
    frame.write_parquet(aside, compression="gzip", row_group_size=125_000)
    aside.rename(path)
    return path


def child(source: str, out: str, group_mb: str) -> None:
    """One encode, in this process: prints its seconds, rows per split and groups as JSON."""
    sys.path.insert(0, str(ROOT))
    from shardline.core.config import load_config
    from shardline.core.encoding.groups import file_groups
    from shardline.tasks.encode import encode_dataset
    from shardline.tasks.ingest import snapshot_source

    overrides = [f"data.source={source}"] + ([f"data.group_mb={group_mb}"] if group_mb else [])
    cfg = load_config(CONFIG, overrides)
    snap = snapshot_source(cfg.data)
    t = time.perf_counter()
    uri = encode_dataset(snap, cfg.data, out, threads=2)
    seconds = time.perf_counter() - t
    rows = json.loads(Path(uri).read_text())["rows"]
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"s": seconds, "rows": rows, "groups": len(file_groups(snap, cfg.data)), "rss_mb": rss}))


def run_child(source: str, out: str, group_mb: str, cache: str) -> dict:
    env = {**os.environ, "SHARDLINE_CACHE": cache, "POLARS_MAX_THREADS": "2"}
    done = subprocess.run(
        [sys.executable, __file__, "--child", source, out, group_mb], env=env, capture_output=True, text=True
    )
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def split_file(path: Path, mb: float) -> Path:
    """The same rows in files of about `mb` MB each (whole sessions), in a folder beside `path`: data as ordinary
    files, the comparison that says what a large file costs beyond its rows."""
    import polars as pl

    folder = path.with_name(f"{path.stem}-files")
    if folder.exists():
        return folder
    frame = pl.read_parquet(path)
    step = int(frame.height * mb * 1e6 / path.stat().st_size) // 20 * 20
    aside = folder.with_name(folder.name + ".tmp")
    aside.mkdir()
    for i, start in enumerate(range(0, frame.height, step)):
        frame.slice(start, step).write_parquet(aside / f"part-{i:04d}.parquet", compression="gzip")
    aside.rename(folder)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, default=12_000_000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--make", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(*args.child)
    if args.make:
        return split_file(make_file(args.make), 8)
    # made in a process of its own: a child's peak RSS starts from its parent's (Linux keeps it across exec)
    subprocess.run([sys.executable, __file__, "--make", str(args.rows)], check=True)
    path = DATA / f"clicks-{args.rows}.parquet"
    size = path.stat().st_size
    files = path.with_name(f"{path.stem}-files")
    print(f"file: {path.name}, {args.rows:,} rows, {size / 1e6:,.0f} MB", file=sys.stderr)
    ways = {
        "one file, in parts (the default)": (str(path), ""),
        "one file, whole (one group)": (str(path), str(2 * size / 1e6)),
        "the same rows in 8 MB files": (str(files / "*.parquet"), ""),
    }
    best: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="shardline-large-") as work:
        for r in range(args.rounds):
            for i, (way, (source, group_mb)) in enumerate(ways.items()):
                got = run_child(source, f"{work}/{i}-{r}", group_mb, f"{work}/cache")
                print(f"round {r + 1} {way}: {got}", file=sys.stderr)
                was = best.get(way, got)
                best[way] = min(got, was, key=lambda g: g["s"]) | {"rss_mb": min(got["rss_mb"], was["rss_mb"])}
    parts, whole, small = best.values()
    assert parts["rows"] == whole["rows"] == small["rows"], best
    print(
        f"\nOne zlib parquet file of a click log, {args.rows:,} rows, {size / 1e6:,.0f} MB; `encode_dataset` on 2 "
        "threads, best of each:\n"
    )
    print("| data | groups | seconds | peak RSS MB |")
    print("|---|---:|---:|---:|")
    for way, got in best.items():
        print(f"| {way} | {got['groups']} | {got['s']:.1f} | {got['rss_mb']:,.0f} |")
    print("\n| target | ratio | bound | |")
    print("|---|---:|---:|---|")
    for name, ratio, bound in (
        ("peak RSS: the file in parts / the same rows in files", parts["rss_mb"] / small["rss_mb"], 1.25),
        ("seconds: the file in parts / the same rows in files", parts["s"] / small["s"], 1.5),
        ("peak RSS: the file in parts / whole", parts["rss_mb"] / whole["rss_mb"], 0.5),
    ):
        print(f"| {name} | {ratio:.2f} | <= {bound} | {'PASS' if ratio <= bound else 'FAIL'} |")


if __name__ == "__main__":
    main()
