"""Encode wall time: the default runner (the flow's thread pool, data.encode_workers=2) against a local
Dask cluster of 2 worker processes (compute.task_runner: dask; its start-up counted), in the same run.

    .venv/bin/python benchmarks/dask_encode.py                  # 4,800 demo games (~410 MB of parquet)
    .venv/bin/python benchmarks/dask_encode.py --games 300 --rounds 2

Each round encodes the data set from scratch into a fresh storage root with each runner in turn (the
order alternates between rounds), through the pipeline's own `encoded_data` inside one flow run on
the ephemeral Prefect API, and checks that both wrote the same manifest. Prints one row per runner:
best and median wall seconds and the ratio to the thread pool (below 1: Dask was faster).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT), str(ROOT / "benchmarks")):
    if p not in sys.path:
        sys.path.insert(0, p)
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--games", type=int, default=4800)
    ap.add_argument("--frames", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--group-mb", type=float, default=None, help="data.group_mb (default: the demo config's)")
    args = ap.parse_args()

    import data_bench as B
    from prefect import flow

    from shardline.flows.pipeline import encoded_data

    games = Path(B.demo_source(args.games, args.frames)).parent
    files = sorted(games.glob("game-*.parquet"))[: args.games]
    raw_mb = sum(f.stat().st_size for f in files) / 1e6
    work = Path(tempfile.mkdtemp(prefix="dask-encode-"))
    (work / "raw").mkdir()
    for f in files:  # the first --games games (the folder may hold more), the page cache warm for both runners
        (work / "raw" / f.name).symlink_to(f)
        f.read_bytes()
    source = str(work / "raw" / "*.parquet")
    overrides = ["data.encode_workers=2"] + ([f"data.group_mb={args.group_mb}"] if args.group_mb else [])

    def config(runner: str, root: Path):
        cfg = B.load(None, overrides + [f"storage.root={root}"], source)
        if runner == "dask":
            cfg = cfg.model_copy(
                update={"compute": cfg.compute.model_copy(update={"task_runner": "dask", "dask_workers": 2})}
            )
        return cfg

    times: dict[str, list[float]] = {"threads": [], "dask": []}
    manifests: dict[str, str] = {}

    @flow(name="dask-encode-bench")
    def bench():
        for r in range(args.rounds):
            order = ["threads", "dask"] if r % 2 == 0 else ["dask", "threads"]
            for runner in order:
                root = work / f"{runner}-{r}"
                cfg = config(runner, root)
                t = time.perf_counter()
                _, uri, _, _ = encoded_data(cfg)
                times[runner].append(time.perf_counter() - t)
                manifests[runner] = Path(uri).read_text()
                shutil.rmtree(root, ignore_errors=True)

    load = os.getloadavg()
    bench()
    same = json.loads(manifests["threads"])["shards"] == json.loads(manifests["dask"])["shards"]
    groups = len(json.loads(manifests["threads"])["shards"])
    shutil.rmtree(work, ignore_errors=True)
    base = min(times["threads"])
    print(
        f"\n{args.games} games x {args.frames} frames: {len(files)} files, {raw_mb:.0f} MB of parquet, "
        f"{groups} shards; load average at start {load[0]:.1f} on {os.cpu_count()} cores; "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}"
    )
    print(f"{'runner':<34} {'best s':>8} {'median s':>9} {'vs threads':>11}")
    for runner, label in (("threads", "thread pool (encode_workers=2)"), ("dask", "Dask LocalCluster, 2 processes")):
        ts = times[runner]
        print(f"{label:<34} {min(ts):>8.1f} {statistics.median(ts):>9.1f} {min(ts) / base:>10.2f}x")
    print(f"same shards (checksums): {same}")


if __name__ == "__main__":
    main()
