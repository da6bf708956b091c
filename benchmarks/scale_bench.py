"""The pipeline at 1x, 10x (and, with --big, 30x) the demo's data on this machine (issue #23).

    .venv/bin/python benchmarks/scale_bench.py            # 160 and 1,600 games x 2,000 frames
    .venv/bin/python benchmarks/scale_bench.py --big      # and 4,800 games
    .venv/bin/python benchmarks/scale_bench.py --quick    # 16 and 160 games: a smoke run

The demo generator's games (made once into benchmarks/.data/, shared with data_bench.py), the demo
config with one epoch at batch 1,024 of at most 300 steps (short training), its windows drawn two
shards at a time (`training.shuffle_shards: 2`: the same order whether the split is in the cache or
streams, as streaming needs). For each scale, in a
fresh home, each run in its own process (start-up included, as a user sees it), while a sampler
reads the process tree's RSS every 50 ms from /proc:

- first: the whole pipeline (ingest, encode, train, evaluate, register);
- again: the same command, every step cached;
- unbounded: training again (`force=train`) with `SHARDLINE_RESIDENT_MB=0`: the split packs' pages it
  reads stay mapped (the first run keeps them under the default bound), for the cost of the bound;
- streaming: training again (`force=train`) with an empty local shard cache capped at a quarter of the
  train split's unpacked size (`SHARDLINE_CACHE_MAX_GB`): the shards stream through the cache.

Per step: wall time (from the Prefect API's task runs), time per raw MB, peak RSS while it ran and
its anonymous part. RSS also counts the pages of the memory-mapped split packs that a step has read and
holds mapped: clean pages of the page cache, kept under `SHARDLINE_RESIDENT_MB` (128 by default).
Per scale: stored bytes, train windows/s in cache and streaming (the epoch's rate, from MLflow), the
cached rerun's wall time. The targets are ratios in the same run: whole-run peak RSS at 10x <= 1.25x
the 1x peak; encode s per raw MB at 10x <= its 1x value; streaming windows/s >= 0.8x in cache; the
cached rerun at 10x <= 0.25x its first run. Prints a markdown table; the exit code is 0 either way."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT), str(ROOT / "benchmarks")):
    if p not in sys.path:
        sys.path.insert(0, p)

from shardline.core.config.settings import SETTINGS  # noqa: E402
from shardline.core.shards import RESIDENT_ENV  # noqa: E402

RESIDENT_DEFAULT_MB = SETTINGS[RESIDENT_ENV].default

DEMO_GAMES = 160
FRAMES = 2000
STEPS = ("ingest", "encode", "train", "evaluate", "register")
STEPS_CAP = 300  # optimizer steps of the one epoch at most (1x: a whole epoch, ~160 steps; 10x: a part)
SHUFFLE_SHARDS = 2  # shards shuffled together (training.shuffle_shards): one order in cache and streaming
STREAM_ROOM = 3  # train shards a cap of a quarter of the split must hold for a streaming run (in flight, read-ahead)
TARGETS = {"rss": 1.25, "encode": 1.0, "stream": 0.8, "rerun": 0.25}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the child: one pipeline run


def child(spec: dict) -> None:
    """Run the pipeline once and print, as the last line, a JSON record: wall time, each step's task
    runs (start, end) and the training epoch's windows/s."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
    from prefect.utilities.asyncutils import run_coro_as_sync

    from shardline.core.config import load_config
    from shardline.flows.pipeline import pipeline

    config = load_config(spec["config"])
    t0 = time.time()
    state = pipeline(config, force=spec.get("force"), return_state=True)
    result = state.result()
    wall = time.time() - t0
    run_id = state.state_details.flow_run_id

    async def task_runs():
        async with get_client() as client:
            return await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[run_id])))

    # the server's task-run recorder writes task runs from events a moment after the flow returns: read until
    # two reads half a second apart agree and every run has ended (30 s at most)
    runs, deadline = run_coro_as_sync(task_runs()), time.time() + 30
    while time.time() < deadline:
        time.sleep(0.5)
        again = run_coro_as_sync(task_runs())
        ended = all(r.end_time is not None for r in again)
        if ended and {(r.id, r.end_time) for r in again} == {(r.id, r.end_time) for r in runs}:
            break
        runs = again
    spans: dict[str, list[float]] = {}
    for r in runs:
        if r.start_time is None or r.end_time is None:
            continue
        step = "encode" if r.name.startswith(("encode-group", "write-manifest")) else r.name.split("-", 1)[0]
        lo, hi = r.start_time.timestamp(), r.end_time.timestamp()
        old = spans.get(step)
        spans[step] = [min(lo, old[0]), max(hi, old[1])] if old else [lo, hi]
    wps = None
    if result["steps"]["train"] == "ran":
        import mlflow

        client = mlflow.MlflowClient(config.mlflow.tracking_uri)
        history = client.get_metric_history(result["train"]["mlflow_run_id"], "epoch/windows_per_s")
        wps = history[-1].value if history else None
    record = {"t0": t0, "wall": wall, "spans": spans, "steps": result["steps"], "wps": wps}
    print(json.dumps({**record, "manifest": result["manifest"]}), flush=True)


# ---------------------------------------------------------------- the parent


def tree_rss(pid: int) -> dict[int, tuple[bytes, float, float]]:
    """Each process of `pid`'s tree (from /proc): its command line, RSS and anonymous RSS in MB (without the
    pages of mapped files: the shards a split maps, which the kernel can drop and read again, count in RSS
    as they are touched)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))

    def cmdline(p: int) -> bytes:
        try:
            return Path(f"/proc/{p}/cmdline").read_bytes()
        except OSError:
            return b""

    out: dict[int, tuple[bytes, float, float]] = {}
    todo = [pid]
    while todo:
        p = todo.pop()
        # a child forked and not yet exec'd (MLflow runs `git`) shows its parent's pages as its own: not
        # counted, or a moment's fork reads as twice the memory
        todo += [c for c in children.get(p, []) if cmdline(c) != cmdline(p)]
        rss = anon = 0.0
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) / 1024
                elif line.startswith("RssAnon:"):
                    anon = int(line.split()[1]) / 1024
        except OSError:
            continue
        out[p] = (cmdline(p), rss, anon)
    return out


def tree_rss_mb(pid: int) -> tuple[float, float]:
    """The RSS of `pid` and every process below it, in MB: all of it, and its anonymous part."""
    procs = tree_rss(pid).values()
    return sum(p[1] for p in procs), sum(p[2] for p in procs)


def run_child(config: Path, home: Path, force: str | None = None, env: dict | None = None) -> dict:
    """One pipeline run in its own process, its RSS sampled every 50 ms; its record plus `samples`."""
    spec = json.dumps({"config": str(config), "force": force})
    proc = subprocess.Popen(
        [sys.executable, __file__, "--child", spec],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=home,
        env={**os.environ, "PREFECT_HOME": str(home / "prefect"), **(env or {})},
    )
    samples: list[tuple[float, float]] = []

    def sample() -> None:
        while proc.poll() is None:
            samples.append((time.time(), *tree_rss_mb(proc.pid)))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    sampler.join()
    if proc.returncode:
        sys.exit(f"the pipeline failed ({config}):\n{out[-3000:]}\n{err[-3000:]}")
    record = json.loads(out.strip().splitlines()[-1])
    record["samples"] = samples
    return record


def peak(samples, lo: float = 0.0, hi: float = float("inf"), anon: bool = False) -> float:
    return max((s[2 if anon else 1] for s in samples if lo <= s[0] <= hi), default=0.0)


def raw_folder(games: int) -> tuple[Path, float]:
    """A folder of links to the first `games` games (one generated folder serves every scale); raw MB."""
    from data_bench import DATA, demo_source

    source = Path(demo_source(games, FRAMES)).parent
    folder = DATA / f"scale-{games}x{FRAMES}"
    folder.mkdir(parents=True, exist_ok=True)
    names = [f"game-{i:05d}.parquet" for i in range(games)]
    for name in names:
        if not (folder / name).exists():
            (folder / name).symlink_to(source / name)
    return folder, sum((source / n).stat().st_size for n in names) / 1e6


def write_config(home: Path, raw: Path) -> Path:
    import yaml
    from data_bench import DEMO

    cfg = yaml.safe_load(DEMO.read_text())
    cfg["data"]["source"] = str(raw / "*.parquet")
    cfg["storage"]["root"] = str(home / "store")
    cfg["mlflow"]["tracking_uri"] = f"sqlite:///{home / 'mlflow.db'}"
    short = {"epochs": 1, "batch_size": 1024, "checkpoint_every_steps": 0, "max_steps_per_epoch": STEPS_CAP}
    cfg["training"].update(short, shuffle_shards=SHUFFLE_SHARDS)
    path = home / "scale.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def stored_mb(folder: Path) -> float:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file()) / 1e6


def train_shards(manifest_uri: str) -> list[int]:
    """The unpacked bytes of each train shard."""
    from shardline.core import storage
    from shardline.core.manifest import Manifest

    manifest = Manifest.model_validate_json(storage.read_text(manifest_uri))
    return [s.raw_bytes for s in manifest.shards_of("train")]


def measure(games: int) -> dict:
    raw, raw_mb = raw_folder(games)
    with tempfile.TemporaryDirectory(prefix=f"shardline-scale-{games}-") as tmp:
        home = Path(tmp)
        config = write_config(home, raw)
        cache = {"SHARDLINE_CACHE": str(home / "cache")}
        log(f"{games} games ({raw_mb:.0f} MB of parquet): the first run ...")
        first = run_child(config, home, env=cache)
        log(f"  {first['wall']:.1f} s; the same command again ...")
        again = run_child(config, home, env=cache)
        log(f"  {again['wall']:.1f} s; training again, its split packs' pages unbounded ({RESIDENT_ENV}=0) ...")
        unbounded = run_child(config, home, force="train", env={**cache, RESIDENT_ENV: "0"})
        shards = train_shards(first["manifest"])
        split = sum(shards)
        cap_gb = split / 4 / 1e9
        stream = None
        if max(shards) * STREAM_ROOM <= split / 4:
            log(f"  {unbounded['wall']:.1f} s; training again, streaming at a cap of {cap_gb * 1e3:.0f} MB ...")
            stream = run_child(
                config,
                home,
                force="train",
                env={"SHARDLINE_CACHE": str(home / "cache-capped"), "SHARDLINE_CACHE_MAX_GB": f"{cap_gb:.6f}"},
            )
            log(f"  {stream['wall']:.1f} s")
        else:  # a quarter of the split holds too few of its shards to stream through
            log(f"  {unbounded['wall']:.1f} s; no streaming run: {len(shards)} train shards, too few for a quarter")
        return {
            "games": games,
            "raw_mb": raw_mb,
            "first": first,
            "again": again,
            "unbounded": unbounded,
            "stream": stream,
            "stored_mb": stored_mb(home / "store" / "datasets"),
            "split_mb": split / 1e6,
            "shards": len(shards),
        }


def table(rows: list[dict]) -> str:
    lines = [
        "| games (raw MB) | step | wall s | s per raw MB | peak RSS MB while it ran | of it anonymous |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        first = r["first"]
        for step in STEPS:
            lo, hi = first["spans"].get(step, (0, 0))
            lines.append(
                f"| {r['games']} ({r['raw_mb']:.0f}) | {step} | {hi - lo:.1f} | {(hi - lo) / r['raw_mb']:.4f} | "
                f"{peak(first['samples'], lo, hi):,.0f} | {peak(first['samples'], lo, hi, anon=True):,.0f} |"
            )
        lines.append(
            f"| {r['games']} ({r['raw_mb']:.0f}) | **whole run** | {first['wall']:.1f} | "
            f"{first['wall'] / r['raw_mb']:.3f} | **{peak(first['samples']):,.0f}** | "
            f"{peak(first['samples'], anon=True):,.0f} |"
        )
    lines += ["", *stream_table(rows)]
    lines += [
        "",
        f"| games (raw MB) | train windows/s, packs' pages bounded ({RESIDENT_ENV}={RESIDENT_DEFAULT_MB:g}: default) "
        f"| unbounded ({RESIDENT_ENV}=0) | bounded / unbounded | train step's peak RSS MB, bounded | unbounded |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        wps, uwps = r["first"]["wps"] or 0, r["unbounded"]["wps"] or 0
        lo, hi = r["first"]["spans"].get("train", (0, 0))
        ulo, uhi = r["unbounded"]["spans"].get("train", (0, 0))
        lines.append(
            f"| {r['games']} ({r['raw_mb']:.0f}) | {wps:,.0f} | {uwps:,.0f} | {wps / max(uwps, 1e-9):.2f} | "
            f"{peak(r['first']['samples'], lo, hi):,.0f} | {peak(r['unbounded']['samples'], ulo, uhi):,.0f} |"
        )
    return "\n".join(lines)


def stream_table(rows: list[dict]) -> list[str]:
    lines = [
        "| games (raw MB) | stored MB (x raw) | train split unpacked MB | windows/s in cache | streaming at split/4 "
        "| streaming / in cache | cached rerun s | rerun / first |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        wps = r["first"]["wps"] or 0
        swps = f"{r['stream']['wps']:,.0f}" if r["stream"] else f"n/a ({r['shards']} shards)"
        ratio = f"{r['stream']['wps'] / max(wps, 1e-9):.2f}" if r["stream"] else "n/a"
        lines.append(
            f"| {r['games']} ({r['raw_mb']:.0f}) | {r['stored_mb']:.0f} ({r['stored_mb'] / r['raw_mb']:.2f}x) | "
            f"{r['split_mb']:.0f} in {r['shards']} shards | {wps:,.0f} | {swps} | {ratio} | "
            f"{r['again']['wall']:.1f} | {r['again']['wall'] / r['first']['wall']:.2f} |"
        )
    return lines


def verdicts(rows: list[dict]) -> str:
    base, ten = rows[0], rows[1]

    def enc(r) -> float:
        lo, hi = r["first"]["spans"]["encode"]
        return (hi - lo) / r["raw_mb"]

    checks = [
        (
            f"whole-run peak anonymous RSS at {ten['games']} games / at {base['games']}",
            peak(ten["first"]["samples"], anon=True) / peak(base["first"]["samples"], anon=True),
            TARGETS["rss"],
        ),
        (
            f"whole-run peak RSS, mapped shard pages included, at {ten['games']} games / at {base['games']}",
            peak(ten["first"]["samples"]) / peak(base["first"]["samples"]),
            TARGETS["rss"],
        ),
        (f"encode s per raw MB at {ten['games']} games / at {base['games']}", enc(ten) / enc(base), TARGETS["encode"]),
        *(
            (f"streaming / in-cache windows/s at {r['games']} games", -(r["stream"]["wps"] / r["first"]["wps"]), -0.8)
            for r in rows
            if r["stream"]
        ),
        (f"cached rerun / first run at {ten['games']} games", ten["again"]["wall"] / ten["first"]["wall"], 0.25),
    ]
    lines = ["| target | measured | bound | |", "|---|---:|---:|---|"]
    for name, value, bound in checks:
        ok = value <= bound
        shown, limit = (abs(value), f">= {abs(bound)}") if bound < 0 else (value, f"<= {bound}")
        lines.append(f"| {name} | {shown:.2f} | {limit} | {'PASS' if ok else 'FAIL'} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--big", action="store_true", help="also 30x the demo (4,800 games)")
    ap.add_argument("--quick", action="store_true", help="16 and 160 games: a smoke run")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(json.loads(a.child))
        return
    unit = DEMO_GAMES // 10 if a.quick else DEMO_GAMES
    scales = [1, 10, 30] if a.big else [1, 10]
    rows = [measure(unit * s) for s in scales]
    saved = Path(tempfile.gettempdir()) / "shardline-scale-bench.json"
    saved.write_text(json.dumps(rows))  # the measures, should a table need another look
    log(f"measures saved to {saved}")
    print(f"\nThe pipeline at {', '.join(f'{s}x' for s in scales)} the demo ({FRAMES} frames a game), 1 epoch at")
    print(f"batch 1,024, on {os.cpu_count()} cores; each run in its own process, start-up included\n")
    print(table(rows))
    print()
    print(verdicts(rows))


if __name__ == "__main__":
    main()
