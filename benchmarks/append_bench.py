"""Appending raw files to an encoded data set (issue #17): the encode after an append against a full encode.

    .venv/bin/python benchmarks/append_bench.py                   # 400, 1,000, 2,000 games x 2,000 frames, + 5 %
    .venv/bin/python benchmarks/append_bench.py --quick           # 40 x 500: a smoke run
    .venv/bin/python benchmarks/append_bench.py --games 1000 --group-mb 64 8 --rounds 5

The demo generator's games (as `data_bench.py`: made once into benchmarks/.data/, the demo config,
float16 continuous columns). For each N and group size (`data.group_mb`), each round, in fresh folders:

- full: the first N games encoded into an empty store;
- append: N + 5 % games (the new ones after the others in the snapshot's order) encoded into the same
  store: the groups the two snapshots share are found there, only the rest are encoded;
- scratch: the same N + 5 % games into an empty store (checked to give the very shards the append
  gave, and timed: what an append cost before the group store).

Two ways for each: the encode functions alone (`encode_dataset` on 2 threads, no Prefect), and the
pipeline's encode step (`shardline.tasks.encode.encode` in a flow on a throwaway Prefect API, its
groups coming from the task cache; timed inside the flow, so a flow run's own start is not counted).
Each round runs full, append and scratch in turn; after a warm-up round, the best of `--rounds`
rounds of each counts. The ratio is append / full, in the same run; the target is <= 15 %. An append
encodes the new files and the last group of before when it was not full (the first new files fill
it up), which holds at most a sixteenth of the data before it, or group_mb / 8 (`group_budget`): the
table says how much was encoded again. Prints a markdown table; the exit code is 0 either way."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT), str(ROOT / "benchmarks")):
    if p not in sys.path:
        sys.path.insert(0, p)
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
os.environ.setdefault("POLARS_MAX_THREADS", "2")
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")

THREADS = 2
TARGET = 0.15


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def shards_of(uri: str) -> list[tuple[str, str]]:
    from shardline.core import storage
    from shardline.core.manifest import Manifest

    return [(s.path, s.sha256) for s in Manifest.model_validate_json(storage.read_text(uri)).shards]


def same_shards(appended: str, scratch: str) -> None:
    """The append's data set is the from-scratch one, shard for shard (by checksum)."""
    mine, theirs = shards_of(appended), shards_of(scratch)
    differ = [(a, b) for a, b in zip(mine, theirs) if a[1] != b[1]]
    assert len(mine) == len(theirs) and not differ, (
        f"the append's shards differ from a from-scratch encode's: {len(mine)} vs {len(theirs)} shards, "
        f"{len(differ)} differ, first {differ[:2]}"
    )


def reencoded(before, after) -> tuple[int, int]:
    """(groups, raw bytes) of the appended snapshot's grouping that the earlier one did not have."""
    old = {tuple(f.uri for f in g) for g in before}
    new = [g for g in after if tuple(f.uri for f in g) not in old]
    return len(new), sum(f.size for g in new for f in g)


def plain_round(data, small, big, work: Path) -> dict[str, float]:
    """One round of the encode functions alone: full, append (same store), scratch (another store)."""
    from shardline.tasks.encode import encode_dataset

    store = str(work / "a" / "datasets" / "groups")
    t = time.perf_counter()
    encode_dataset(small, data, str(work / "a" / "datasets" / "full"), threads=THREADS, store=store)
    full = time.perf_counter() - t
    t = time.perf_counter()
    appended = encode_dataset(big, data, str(work / "a" / "datasets" / "append"), threads=THREADS, store=store)
    append = time.perf_counter() - t
    t = time.perf_counter()
    scratch = encode_dataset(big, data, str(work / "b" / "datasets" / "scratch"), threads=THREADS)
    fresh = time.perf_counter() - t
    same_shards(appended, scratch)
    return {"full": full, "append": append, "scratch": fresh}


def flow_round(data, small, big, work: Path) -> dict[str, float]:
    """One round of the pipeline's encode step, each encode in its own flow run: full, append (same
    root: the shared groups come from the task cache), scratch (another root)."""
    from prefect import flow

    from shardline.tasks.encode import encode

    @flow(name="append-bench-encode")
    def step(snap, root: str) -> tuple[str, float]:
        t = time.perf_counter()
        uri, _ = encode(snap, data, root)
        return uri, time.perf_counter() - t

    _, full = step(small, str(work / "a"))
    appended, append = step(big, str(work / "a"))
    scratch, fresh = step(big, str(work / "b"))
    same_shards(appended, scratch)
    return {"full": full, "append": append, "scratch": fresh}


def measure(run, data, small, big, rounds: int) -> dict[str, float]:
    best: dict[str, float] = {}
    for r in range(rounds + 1):  # round 0 warms up (imports, thread pools, the page cache)
        work = Path(tempfile.mkdtemp(prefix="shardline-append-"))
        try:
            got = run(data, small, big, work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        if r:
            best = {k: min(v, best.get(k, float("inf"))) for k, v in got.items()}
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--games", type=int, nargs="+", default=[400, 1000, 2000], help="N of each row")
    ap.add_argument("--frames", type=int, default=2000)
    ap.add_argument("--append", type=float, default=0.05, help="files appended, as a fraction of N")
    ap.add_argument("--group-mb", type=float, nargs="+", default=[64], help="data.group_mb of each row")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-prefect", action="store_true", help="the encode functions only")
    ap.add_argument("--quick", action="store_true", help="40 games x 500 frames, 1 round")
    args = ap.parse_args()
    if args.quick:
        args.games, args.frames, args.rounds = [40], 500, 1

    import data_bench as B

    from shardline.core.encoding.write import file_groups

    source = B.demo_source(max(n + max(1, round(n * args.append)) for n in args.games), args.frames)
    rows = []
    for n in args.games:
        extra = max(1, round(n * args.append))
        for mb in args.group_mb:
            cfg = B.load(None, [f"data.group_mb={mb}"], source)
            small, big = B.snapshot(cfg, n), B.snapshot(cfg, n + extra)
            before, after = file_groups(small, cfg.data), file_groups(big, cfg.data)
            n_new, new_bytes = reencoded(before, after)
            total = sum(f.size for f in small.files)
            ways = [("`encode_dataset`, 2 threads", plain_round)]
            if not args.no_prefect:
                ways.append(("the encode step, Prefect flow", flow_round))
            for name, run in ways:
                log(f"{n} + {extra} games, group_mb={mb:g}: {name}, {args.rounds} round(s) ...")
                if run is flow_round:
                    from prefect.testing.utilities import prefect_test_harness

                    with prefect_test_harness(server_startup_timeout=180):
                        t = measure(run, cfg.data, small, big, args.rounds)
                else:
                    t = measure(run, cfg.data, small, big, args.rounds)
                rows.append((n, extra, total / 1e6, mb, len(before), len(after), n_new, new_bytes / total, name, t))

    print(
        f"\nAppending {args.append:.0%} more games (the demo generator's, {args.frames} frames each) to N games; "
        f"best of {args.rounds} round(s), {THREADS} encode threads\n"
    )
    print(
        "| N games (raw MB) | + games | data.group_mb | groups before / after | encoded again on append | way | "
        "full encode (N) | append | from scratch (N + appended) | append / full | target <= 15 % |"
    )
    print("|---:|---:|---:|---:|---|---|---:|---:|---:|---:|---|")
    for n, extra, raw_mb, mb, nb, na, n_new, frac, name, t in rows:
        ratio = t["append"] / t["full"]
        print(
            f"| {n} ({raw_mb:.1f}) | {extra} | {mb:g} | {nb} / {na} | {n_new} group(s), {frac:.0%} of N's bytes | "
            f"{name} | {t['full']:.3f} s | {t['append']:.3f} s | {t['scratch']:.3f} s | **{ratio:.0%}** | "
            f"{'PASS' if ratio <= TARGET else 'FAIL'} |"
        )


if __name__ == "__main__":
    main()
