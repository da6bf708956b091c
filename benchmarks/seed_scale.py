"""The first user's data at full size (issue #45): 22,000 games on S3, `shardline run` end to end.

    .venv/bin/python benchmarks/seed_scale.py                       # 22,000 games x 4,500 frames (~3.4 GB)
    .venv/bin/python benchmarks/seed_scale.py --games 240 --frames 300 --demo-games 40 \\
        --set data.files_per_group=20 --doc none                    # the CI-sized run (tests/test_seed_scale.py)

The demo generator's games (`simulate_game`, 4,500 frames: ~154 KB of zlib parquet each, so 22,000 games
are ~3.4 GB), made once into benchmarks/.data/ by 2 processes, are put into a bucket of a moto S3 server
on 127.0.0.1 (its own process; every request it serves is logged with its bytes, so the bytes each step
reads from S3 are counted where they leave the server, and a byte served twice is seen). Then, each in its
own process, its process tree's RSS sampled every 50 ms:

- floor: polars alone reading the same files' columns from the bucket (2 threads);
- demo: `shardline run` of the same config at the demo's size (160 games x 2,000 frames), for the memory;
- first: `shardline run` of the demo config on `s3://` (1 epoch of at most --steps optimizer steps at batch
  1,024, the train split streamed through a shard cache capped at a quarter of it, the whole test split
  evaluated, registration);
- stream: `fit` alone on the first run's store, --stream-steps steps (past the first shuffle blocks), the train
  split in an uncapped cache and streamed through one capped as the first run's, alternated --stream-rounds
  times: the streaming target is the best streamed / the best in cache (one run against another minutes later
  moved by up to 1.5x on a shared machine);
- dask: the encode step again (`encoded_data`, refreshed) on a local Dask cluster of 2 workers;
- in cache: the same training again (`--force train`) with the split in an uncapped cache;
- again: the first command again (every step cached);
- append: 5 % more games put into the bucket, and the first command again.

Per step (from the Prefect API's task runs): wall time, peak RSS, bytes read from S3 and the bytes of them
served twice. It prints the tables and each target's PASS/FAIL, and writes them into docs/performance.md
(--doc). Not part of CI (it takes about an hour); the CI-sized run is the same code."""

from __future__ import annotations

import argparse
import json
import os
import re
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT), str(ROOT / "benchmarks")):
    if p not in sys.path:
        sys.path.insert(0, p)

from scale_bench import STEPS, stored_mb, train_shards, tree_rss  # noqa: E402

DATA = ROOT / "benchmarks" / ".data"
DEMO = ROOT / "shardline" / "configs" / "demo.yaml"
BIN = Path(sys.executable).parent / "shardline"
BUCKET = "raw"
BATCH = 1024
TARGETS = {"encode_vs_floor": 0.5, "encode_bytes": 1.1, "rss": 1.25, "stream": 0.8, "rerun": 0.05, "append": 0.15}
MARK = ("<!-- seed_scale: written by benchmarks/seed_scale.py -->", "<!-- /seed_scale -->")


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the raw games


def _write_game(args: tuple[int, int, str]) -> None:
    import pyarrow.parquet as pq

    from shardline.app.demo_data import simulate_game

    i, frames, out = args
    path = Path(out) / f"game-{i:05d}.parquet"
    if path.exists():
        return
    table = simulate_game(0, i, frames)
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    pq.write_table(table, tmp, compression="gzip", row_group_size=table.num_rows, store_schema=True)
    os.replace(tmp, path)


def raw_games(games: int, frames: int) -> tuple[list[Path], float]:
    """The first `games` games of seed 0 as zlib parquet (game i depends only on i: one folder serves every
    count), made once by 2 processes; the paths and the seconds spent making the missing ones."""
    out = DATA / f"zlib-seed0-{frames}frames"
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / f"game-{i:05d}.parquet" for i in range(games)]
    missing = [i for i, p in enumerate(paths) if not p.exists()]
    t = time.perf_counter()
    if missing:
        log(f"generating {len(missing)} games of {frames} frames into {out} (2 processes) ...")
        with ProcessPoolExecutor(2) as pool:
            list(pool.map(_write_game, [(i, frames, str(out)) for i in missing], chunksize=16))
    return paths, time.perf_counter() - t if missing else 0.0


# ---------------------------------------------------------------- S3: a moto server that counts what it serves


def serve_moto(log_path: str) -> None:
    """Hidden mode: a moto S3 server on 127.0.0.1 (its port printed first) that appends a line per request to
    `log_path`: start time, method, object path (empty for a listing), Range header, status, body bytes."""
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    app = DomainDispatcherApplication(create_backend_app)
    out = open(log_path, "a", buffering=1)
    lock = threading.Lock()

    def counted(environ, start_response):
        t = time.time()
        status: list[str] = []

        def started(line, headers, exc_info=None):
            status.append(line.split(" ", 1)[0])
            return start_response(line, headers, exc_info)

        n = 0
        for chunk in app(environ, started):
            n += len(chunk)
            yield chunk
        key = "" if environ.get("QUERY_STRING") else environ.get("PATH_INFO", "")
        fields = (f"{t:.3f}", environ["REQUEST_METHOD"], key, environ.get("HTTP_RANGE", ""), status[0], str(n))
        with lock:
            out.write("\t".join(fields) + "\n")

    server = make_server("127.0.0.1", 0, counted, threaded=True, request_handler=MotoRequestHandler)
    print(server.server_port, flush=True)
    server.serve_forever()


class S3:
    """The moto server's process, its request log, and the environment that points clients at it."""

    def __init__(self, work: Path):
        self.log = work / "s3-requests.tsv"
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--moto", str(self.log)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
        )
        self.endpoint = f"http://127.0.0.1:{int(self.proc.stdout.readline())}"
        self.env = {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1",
        }
        self.sizes: dict[str, int] = {}  # object path (/bucket/key) -> size

    def put(self, files: list[Path], prefix: str) -> None:
        """Upload `files` under s3://raw/<prefix>/ (their names kept)."""
        import s3fs

        os.environ.update(self.env)
        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        if not fs.exists(BUCKET):
            fs.mkdir(BUCKET)
        for i in range(0, len(files), 500):
            chunk = files[i : i + 500]
            fs.put([str(f) for f in chunk], [f"{BUCKET}/{prefix}/{f.name}" for f in chunk])
        self.sizes.update({f"/{BUCKET}/{prefix}/{f.name}": f.stat().st_size for f in files})

    def reads(self, lo: float, hi: float) -> list[tuple[str, int, int]]:
        """The object bytes served from `lo` to `hi` (epoch seconds): (object, first byte, bytes) per GET."""
        out = []
        for line in self.log.read_text().splitlines():
            t, method, key, rng, status, n = line.split("\t")
            if method != "GET" or not key or not status.startswith("2") or not lo <= float(t) <= hi:
                continue
            m = re.match(r"bytes=(\d*)-(\d*)", rng)
            if m and m.group(1):
                first = int(m.group(1))
            elif m:  # a suffix range: the last N bytes
                first = max(0, self.sizes.get(key, int(n)) - int(n))
            else:
                first = 0
            out.append((key, first, int(n)))
        return out

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


def served(reads: list[tuple[str, int, int]]) -> tuple[int, int]:
    """Bytes served, and of them bytes that had been served already (the same object's same bytes)."""
    by_key: dict[str, list[tuple[int, int]]] = {}
    for key, first, n in reads:
        by_key.setdefault(key, []).append((first, first + n))
    total = sum(n for _, _, n in reads)
    union = 0
    for spans in by_key.values():
        end = -1
        for lo, hi in sorted(spans):
            union += max(0, hi - max(lo, end))
            end = max(end, hi)
    return total, total - union


# ---------------------------------------------------------------- a measured process


def cpu_seconds(pid: int) -> float:
    """User and system CPU seconds process `pid` has used so far (0 once it is gone)."""
    import psutil

    try:
        t = psutil.Process(pid).cpu_times()
    except psutil.Error:
        return 0.0
    return t.user + t.system


def machine_busy() -> float:
    """CPU seconds the machine's cores have been busy so far, every process's (all but idle and iowait)."""
    import psutil

    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0) - getattr(t, "guest", 0.0) - getattr(t, "guest_nice", 0.0)


def sampled(cmd: list[str], env: dict, cwd: Path, stop=None, watch: dict[str, int] | None = None) -> dict:
    """Run `cmd`, its process tree's RSS sampled every 50 ms: wall time, stdout, samples (time, tree RSS) and
    each process's peak RSS (by its command line). Every second, `cpu`: (time, the CPU seconds so far of each
    process of the tree and of `watch` (name -> pid: the S3 server), the machine's busy CPU seconds). `stop()`,
    asked every second, true: SIGTERM to the command (as a spot reclaim would: it stops at a checkpoint), and
    `stopped` in the record."""
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd, env=env)
    samples: list[tuple[float, float]] = []
    cpu: list[tuple[float, dict[str, float], float]] = []
    peaks: dict[int, tuple[str, float]] = {}
    stopped: list[float] = []

    def sample() -> None:
        while proc.poll() is None:
            procs = tree_rss(proc.pid)
            samples.append((time.time(), sum(p[1] for p in procs.values())))
            for pid, (line, rss, _) in procs.items():
                # a process that has exited and not yet been reaped reads an empty command line: its name stays
                name = line.replace(b"\0", b" ").decode(errors="replace")[:120].strip() or peaks.get(pid, ("",))[0]
                peaks[pid] = (name, max(rss, peaks.get(pid, ("", 0.0))[1]))
            if len(samples) % 20 == 1:
                used = {f"{pid} {peaks[pid][0][:70].strip()}": cpu_seconds(pid) for pid in procs}
                used.update({name: cpu_seconds(pid) for name, pid in (watch or {}).items()})
                cpu.append((time.time(), used, machine_busy()))
            if stop is not None and not stopped and len(samples) % 20 == 0 and stop(t0):
                stopped.append(time.time())
                proc.terminate()
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    out, err = proc.communicate()
    sampler.join()
    wall = time.time() - t0
    if proc.returncode and not stopped:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{out[-3000:]}\n{err[-5000:]}")
    main = peaks.get(proc.pid, ("", 0.0))[1]
    others = sorted((v for pid, v in peaks.items() if pid != proc.pid), key=lambda v: -v[1])
    record = {"t0": t0, "t1": t0 + wall, "wall": wall, "out": out, "err": err, "samples": samples, "main": main}
    return {**record, "cpu": cpu, "others": others, "stopped": stopped[0] if stopped else None}


def cores_busy(cpu: list, lo: float, hi: float) -> tuple[float, dict[str, float]] | None:
    """From `sampled`'s `cpu` samples: the machine's cores busy on average from `lo` to `hi`, and each process's
    (None with fewer than two samples in between)."""
    inside = [c for c in cpu if lo <= c[0] <= hi]
    if len(inside) < 2:
        return None
    (t0, a, m0), (t1, b, m1) = inside[0], inside[-1]
    dt = max(t1 - t0, 1e-9)
    return (m1 - m0) / dt, {k: (b[k] - a.get(k, 0.0)) / dt for k in b}  # one born in between: all its CPU


def peak(samples, lo: float = 0.0, hi: float = float("inf")) -> float:
    return max((rss for t, rss in samples if lo <= t <= hi), default=0.0)


FLOW_RUN_LINK = re.compile(r"/runs/flow-run/([0-9a-f-]{36})")


def task_runs(api: str, log: str, since: float) -> list[tuple[str, float, float | None]]:
    """(name, start, end) of the task runs of the flow runs a command's log links to ("View at .../flow-run/ID":
    its pipeline and the subflows), read through the Prefect API at `api` (one others' runs share)."""
    from prefect import get_client
    from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterFlowRunId, TaskRunFilterStartTime
    from prefect.settings import PREFECT_API_URL, temporary_settings

    ids = sorted(set(FLOW_RUN_LINK.findall(log)))
    # no log yet (a command still running): every task run since `since`, others' too on a shared API
    chosen = (
        TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=ids))
        if ids
        else TaskRunFilter(start_time=TaskRunFilterStartTime(after_=datetime.fromtimestamp(since, UTC)))
    )
    runs: list = []
    with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
        while True:  # a page at a time (the API's limit): a full-size encode is hundreds of task runs
            page = client.read_task_runs(task_run_filter=chosen, limit=200, offset=len(runs))
            runs += page
            if len(page) < 200:
                break
    return [
        (r.name, r.start_time.timestamp(), r.end_time.timestamp() if r.end_time else None)
        for r in runs
        if r.start_time is not None
    ]


def spans(
    home: Path, since: float, running: bool = False, api: str | None = None, log: str = ""
) -> dict[str, tuple[float, float]]:
    """Each step's (start, end) from the task runs since `since` (`running`: with the steps still running, until
    now): in the Prefect API's database under `home`, or with `api`, those of the flow runs `log` links to."""

    def ts(text: str) -> float:
        return datetime.fromisoformat(text).replace(tzinfo=UTC).timestamp()

    out: dict[str, tuple[float, float]] = {}
    if api:
        rows = task_runs(api, log, since)
    else:
        try:
            db = sqlite3.connect(f"file:{home / 'prefect' / 'prefect.db'}?mode=ro", uri=True)
            found = db.execute("select name, start_time, end_time from task_run where start_time is not null")
            rows = [(n, ts(lo), ts(hi) if hi else None) for n, lo, hi in found.fetchall()]
            db.close()
        except sqlite3.OperationalError:  # no API database yet
            return out
    for name, lo, hi in rows:
        if lo < since or (hi is None and not running):
            continue
        hi = hi if hi is not None else time.time()
        step = "encode" if name.startswith(("encode-group", "write-manifest")) else name.split("-", 1)[0]
        old = out.get(step)
        out[step] = (min(lo, old[0]), max(hi, old[1])) if old else (lo, hi)
    return out


def logged_steps(home: Path, since: float) -> list[tuple[int, float]]:
    """(optimizer step, when it was logged) of the training's loss points in the MLflow store since `since`."""
    db = sqlite3.connect(f"file:{home / 'mlflow.db'}?mode=ro", uri=True)
    try:
        rows = db.execute(
            "select step, timestamp from metrics where key = 'train/train_loss' and timestamp >= ? order by step",
            (int(since * 1000),),
        ).fetchall()
    except sqlite3.OperationalError:  # no store yet
        rows = []
    db.close()
    return [(s, t / 1000) for s, t in rows]


def training_figures(home: Path, since: float, batch: int) -> dict:
    """The training's windows/s between its 10th logged step and its last (so start-up and the first steps'
    warm-up are left out, and a run stopped after its steps counts as one that went on), when its first
    optimizer step was logged, and `timed`: when the steps the windows/s counts began and ended."""
    steps = logged_steps(home, since)
    if len(steps) < 12:
        return {"wps": None, "first_step": steps[0][1] if steps else None}
    (s0, t0), (s1, t1) = steps[10], steps[-1]
    wps = (s1 - s0) * batch / max(t1 - t0, 1e-9)
    return {"wps": wps, "first_step": steps[0][1], "last_step": s1, "timed": (t0, t1)}


# ---------------------------------------------------------------- the children


def child_floor(spec: dict) -> None:
    """Polars alone reading every file's columns from the bucket, a batch of files per query on 2 threads."""
    import polars as pl

    opts = {
        "aws_endpoint_url": os.environ["AWS_ENDPOINT_URL"],
        "aws_access_key_id": "test",
        "aws_secret_access_key": "test",
        "aws_region": "us-east-1",
        "aws_allow_http": "true",
    }
    rows, uris = 0, spec["uris"]
    for i in range(0, len(uris), 64):
        rows += pl.scan_parquet(uris[i : i + 64], storage_options=opts).select(spec["columns"]).collect().height
    print(json.dumps({"rows": rows}), flush=True)


def child_encode(spec: dict) -> None:
    """The encode step again (refreshed, the snapshot from the cache) on a local Dask cluster of 2 workers."""
    from prefect import flow

    from shardline.core.config import load_config
    from shardline.flows.pipeline import encoded_data

    cfg = load_config(spec["config"], ["compute.task_runner=dask", "compute.dask_workers=2", *spec["set"]])

    @flow(name="seed-scale-dask-encode")
    def run() -> str:
        return encoded_data(cfg, refresh=frozenset({"encode"}))[1]

    print(json.dumps({"manifest": run()}), flush=True)


def child_train(spec: dict) -> None:
    """`fit` alone on the home's store, `spec["steps"]` steps of the first epoch: the train split streamed through
    a fresh cache capped at `spec["cap_gb"]`, or (cap None) in the home's uncapped `cache-whole` (its pack built
    first, if it is not there). Prints windows/s and windows per CPU-second of this process from step 10 on."""
    import shutil

    from shardline.core.config import load_config
    from shardline.core.manifest import Manifest
    from shardline.core.storage import ShardCache
    from shardline.trainer.data import open_split
    from shardline.trainer.loop import Callbacks, FitOptions, fit
    from shardline.trainer.models import model_spec_for
    from shardline.trainer.serving import data_spec

    home, steps = Path(spec["home"]), spec["steps"]
    cfg = load_config(home / "run.yaml", [*spec["set"], f"training.max_steps_per_epoch={steps}"])
    uri = manifest_of(home)
    manifest = Manifest.model_validate_json(Path(uri).read_text())
    whole = ShardCache(home / "cache-whole")
    if spec["cap_gb"] is None:
        cache = whole
    else:
        shutil.rmtree(home / "cache-stream", ignore_errors=True)
        cache = ShardCache(home / "cache-stream", cap_bytes=int(spec["cap_gb"] * 1e9))
    train = open_split(manifest, uri, "train", cache=cache)
    assert train.streaming == (spec["cap_gb"] is not None), "the split streams only with a cap"
    stamps: dict[int, tuple[float, float]] = {}

    class Enough(Exception):
        pass

    def on_step(step: int, _metrics: dict) -> None:
        stamps[step] = (time.perf_counter(), time.process_time())
        if step >= steps - 1:
            raise Enough  # before the epoch's end: no validation

    training = cfg.training.model_copy(update={"checkpoint_every_steps": 0})
    try:
        fit(
            train,
            open_split(manifest, uri, "validation", cache=whole),
            model_spec_for(cfg.model, data_spec(manifest.encoding)),
            training,
            manifest.encoding.target.task if manifest.encoding.target else None,
            str(home / f"ck-stream-{os.getpid()}"),
            callbacks=Callbacks(on_step=on_step),
            options=FitOptions(resume=False, step_every=1),
        )
    except Enough:
        pass
    (lo, (t0, c0)), (hi, (t1, c1)) = sorted(stamps.items())[10], max(stamps.items())
    windows = (hi - lo) * training.batch_size
    print(json.dumps({"wps": windows / (t1 - t0), "per_cpu_s": windows / max(c1 - c0, 1e-9), "steps": hi - lo}))


# ---------------------------------------------------------------- the parent


class Bench:
    def __init__(self, work: Path, s3: S3, overrides: list[str], api: str | None = None):
        self.work, self.s3, self.overrides, self.api = work, s3, overrides, api

    def home(self, name: str, prefix: str) -> Path:
        """A home (store, MLflow, Prefect) for the data under s3://raw/<prefix>/, its config written."""
        import yaml

        home = self.work / name
        home.mkdir(exist_ok=True)
        cfg = yaml.safe_load(DEMO.read_text())
        cfg["data"]["source"] = f"s3://{BUCKET}/{prefix}/*.parquet"
        cfg["storage"]["root"] = str(home / "store")
        cfg["mlflow"]["tracking_uri"] = f"sqlite:///{home / 'mlflow.db'}"
        cfg["training"].update(epochs=1, batch_size=BATCH, checkpoint_every_steps=0, shuffle_shards=2)
        (home / "run.yaml").write_text(yaml.safe_dump(cfg))
        return home

    def env(self, home: Path, cache: str, cap_gb: float | None) -> dict:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "MLFLOW_", "SHARDLINE_"))}
        env.update(self.s3.env, PREFECT_HOME=str(home / "prefect"), SHARDLINE_CACHE=str(home / cache))
        env["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] = "180"
        if self.api:  # a running Prefect API rather than a temporary server per command
            env["PREFECT_API_URL"] = self.api
        if cap_gb is not None:
            env["SHARDLINE_CACHE_MAX_GB"] = f"{cap_gb:.6f}"
        return env

    def run(self, home: Path, steps_cap: int, cap_gb: float | None, cache: str = "cache", force=None, stop=None):
        """`shardline run` in its own process: wall, per-step spans, RSS, S3 bytes, training figures."""
        cmd = [str(BIN), "run", str(home / "run.yaml"), "--set", f"training.max_steps_per_epoch={steps_cap}"]
        cmd += [x for o in self.overrides for x in ("--set", o)] + (["--force", force] if force else [])
        r = sampled(cmd, self.env(home, cache, cap_gb), home, stop, watch={"the moto S3 server": self.s3.proc.pid})
        # the command's output, kept beside its home for a look afterwards (the measures drop it)
        (home / f"command-{int(r['t0'])}.log").write_text(r["out"] + "\n--- stderr ---\n" + r["err"])
        r["steps"] = next((line for line in r["out"].splitlines() if line.startswith("steps:")), "")
        r["spans"] = spans(home, r["t0"], api=self.api, log=r["out"] + r["err"])
        r.update(training_figures(home, r["t0"], BATCH))
        return self.measured(r)

    def child(self, mode: str, spec: dict, home: Path) -> dict:
        (home / f"{mode}.json").write_text(json.dumps(spec))  # 22,000 URIs do not fit a command line
        cmd = [sys.executable, __file__, f"--{mode}", str(home / f"{mode}.json")]
        env = self.env(home, "cache", None)
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
        env["POLARS_MAX_THREADS"] = "2"
        r = sampled(cmd, env, home)
        r["spans"] = spans(home, r["t0"], api=self.api, log=r["out"] + r["err"]) if mode == "encode" else {}
        out = r["out"]
        return {**self.measured(r), "out": out}

    def measured(self, r: dict) -> dict:
        time.sleep(0.2)  # the server's last log lines
        r["bytes"] = served(self.s3.reads(r["t0"], r["t1"]))
        r["step_bytes"] = {s: served(self.s3.reads(lo, hi)) for s, (lo, hi) in r["spans"].items()}
        for log_of in ("out", "err"):  # the commands' output: not kept in the measures
            r.pop(log_of, None)
        return r


def manifest_of(home: Path) -> str:
    return str(max((home / "store" / "datasets").glob("*/manifest.json"), key=lambda p: p.stat().st_mtime))


PARTS = ("floor", "demo", "first", "stream", "dask", "in cache", "again", "append")


def measure(a, saved: Path) -> dict:
    """Each part of `a.parts` in turn (the first run always); the measures so far saved to `saved` after each."""
    files, gen_s = raw_games(a.games, a.frames)
    raw_mb = sum(f.stat().st_size for f in files) / 1e6
    work = Path(tempfile.mkdtemp(prefix="shardline-seed-scale-"))
    m: dict = {"games": a.games, "frames": a.frames, "raw_mb": raw_mb, "generate_s": gen_s, "steps_cap": a.steps}
    m.update(appended=a.append, demo_frames=a.demo_frames, work=str(work), runs={}, cap_gb=None)
    s3 = S3(work)
    try:
        t = time.perf_counter()
        s3.put(files, "games")
        m["put_s"] = time.perf_counter() - t
        m["sizes"] = s3.sizes
        log(f"{len(files)} games ({raw_mb:,.0f} MB) in s3://{BUCKET}/games/ in {m['put_s']:.0f} s")
        bench = Bench(work, s3, a.set, a.prefect_api)
        home = bench.home("full", "games")
        runs = m["runs"]

        def done(name: str, r: dict) -> None:
            runs[name] = r
            saved.write_text(json.dumps(m))
            log(f"  {name}: {r['wall']:.1f} s {r.get('steps', '')}")

        if "floor" in a.parts:
            from shardline.core.config import load_config

            log("the floor: polars reading the same files from the bucket ...")
            columns = load_config(home / "run.yaml", a.set).data.raw_columns()
            uris = [f"s3://{BUCKET}/games/{f.name}" for f in files]
            done("floor", bench.child("floor", {"uris": uris, "columns": columns}, home))
        if "demo" in a.parts:
            demo_files, _ = raw_games(a.demo_games, a.demo_frames)
            m["demo_games"], m["demo_mb"] = len(demo_files), sum(f.stat().st_size for f in demo_files) / 1e6
            s3.put(demo_files, f"demo-{a.demo_frames}")
            demo_home = bench.home("demo", f"demo-{a.demo_frames}")
            log(f"the demo's size ({len(demo_files)} games, {m['demo_mb']:.0f} MB) ...")
            done("demo", bench.run(demo_home, a.steps, None))
            # the train split's unpacked bytes per frame at the demo's size (a frame unpacks to the same bytes)
            per_frame = sum(train_shards(manifest_of(demo_home))) / (len(demo_files) * a.demo_frames)
        else:
            per_frame = 130.0  # the demo's train split: ~130 unpacked bytes per frame of the data set
        # the cache cap: a quarter of the train split, its size estimated before the run (from the demo's)
        estimate = per_frame * a.games * a.frames / 4 / 1e9
        m["cap_gb"] = cap_gb = (a.cap_gb or estimate) if "in cache" in a.parts else None
        log(f"the first run{f', the shard cache capped at {cap_gb:.3f} GB' if cap_gb else ''} ...")
        done("first", bench.run(home, a.steps, cap_gb))
        shards = train_shards(manifest_of(home))
        m.update(split_mb=sum(shards) / 1e6, shards=len(shards), max_shard_mb=max(shards) / 1e6)
        m["stored_mb"] = stored_mb(home / "store" / "datasets")
        if "stream" in a.parts:
            # the stream target: fit alone, streamed and in cache alternated, each the best of its rounds (one
            # pipeline run against another minutes later moved by up to 1.5x on a shared machine, 2026-11-28)
            m["stream"] = {"streamed": [], "in cache": [], "steps": a.stream_steps}
            for r in range(a.stream_rounds):
                for mode, cap in (("in cache", None), ("streamed", cap_gb or estimate)):
                    log(f"fit alone, {mode}, round {r + 1}/{a.stream_rounds} ...")
                    spec = {"home": str(home), "steps": a.stream_steps, "cap_gb": cap, "set": a.set}
                    got = bench.child("train", spec, home)
                    m["stream"][mode].append(json.loads(got["out"].strip().splitlines()[-1]))
                    saved.write_text(json.dumps(m))
        if "dask" in a.parts:
            log("the encode on Dask (2 workers) ...")
            done("dask", bench.child("encode", {"config": str(home / "run.yaml"), "set": a.set}, home))
        if "in cache" in a.parts:
            log("training again, the split in the cache ...")
            trained = (lambda t0: len(logged_steps(home, t0)) >= a.steps) if a.short else None
            done("in cache", bench.run(home, a.steps, None, cache="cache-whole", force="train", stop=trained))
        if "again" in a.parts:
            log("the first command again ...")
            done("again", bench.run(home, a.steps, cap_gb))
        if "append" in a.parts:
            extra = raw_games(a.games + a.append, a.frames)[0][a.games :]
            m["append_mb"] = sum(f.stat().st_size for f in extra) / 1e6
            s3.put(extra, "games")
            log(f"{len(extra)} games appended ...")
            encoded = (lambda t0: "train" in spans(home, t0, running=True)) if a.short else None
            done("append", bench.run(home, a.steps, cap_gb, stop=encoded))
    finally:
        s3.stop()
    m.update(load=os.getloadavg()[0], when=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    saved.write_text(json.dumps(m))
    return m


# ---------------------------------------------------------------- the tables


def span_s(r: dict, step: str) -> float:
    lo, hi = r["spans"].get(step, (0.0, 0.0))
    return hi - lo


def figures(m: dict) -> dict[str, float | None]:
    """Each target's ratio, None where its runs were left out."""
    runs = m["runs"]
    first = runs["first"]
    enc = span_s(first, "encode")

    def ratio(part: str, value) -> float | None:
        return value() if part in runs else None

    return {
        "encode_vs_floor": ratio("floor", lambda: runs["floor"]["wall"] / enc),
        "encode_bytes": first["step_bytes"].get("encode", (0, 0))[0] / (m["raw_mb"] * 1e6),
        "rss": ratio("demo", lambda: peak(first["samples"]) / peak(runs["demo"]["samples"])),
        "stream": stream_ratio(m),
        "rerun": ratio("again", lambda: runs["again"]["wall"] / first["wall"]),
        "append": ratio("append", lambda: span_s(runs["append"], "encode") / enc),
    }


def stream_ratio(m: dict) -> float | None:
    """Training windows/s streamed / in cache: the best of each of the `stream` part's alternated rounds of `fit`
    alone, or without that part the first run against the `in cache` run."""
    if m.get("stream"):
        best = {mode: max(r["wps"] for r in m["stream"][mode]) for mode in ("streamed", "in cache")}
        return best["streamed"] / best["in cache"]
    runs = m["runs"]
    return (runs["first"]["wps"] or 0) / (runs["in cache"]["wps"] or 1e-9) if "in cache" in runs else None


def tables(m: dict) -> str:
    runs, mb, raw = m["runs"], 1e6, m["raw_mb"] * 1e6
    first = runs["first"]
    cap = f"capped at {m['cap_gb']:.2f} GB against" if m["cap_gb"] else "uncapped, with"
    demo = f"{m['demo_games']} games x {m['demo_frames']:,} frames ({m['demo_mb']:,.0f} MB)" if "demo" in runs else "-"
    lines = [
        f"{m['games']:,} games x {m['frames']:,} frames: {m['raw_mb']:,.0f} MB of zlib parquet in a moto bucket "
        f"({raw / m['games'] / 1e3:,.0f} KB a game); the demo's size: {demo}. Training: 1 epoch of at most "
        f"{m['steps_cap']} steps at batch 1,024, `training.shuffle_shards: 2`; the shard cache {cap} a train "
        f"split of {m['split_mb'] / 1e3:,.2f} GB ({m['shards']} shards of at most {m['max_shard_mb']:,.0f} MB). "
        f"{os.cpu_count()} cores, load average {m['load']:.1f} at the end; "
        f"{m['when']}; games generated in {m['generate_s']:,.0f} s "
        f"(0: made before), put into the bucket in {m['put_s']:,.0f} s.",
        "",
        "| run | step | wall s | peak RSS MB (process tree) | MB read from S3 | of it read twice MB | x raw |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, r in runs.items():
        for step in [s for s in STEPS if s in r["spans"]] + ["whole"]:
            if step == "whole":
                wall, rss, (got, twice) = r["wall"], peak(r["samples"]), r["bytes"]
            else:
                lo, hi = r["spans"][step]
                wall, rss, (got, twice) = hi - lo, peak(r["samples"], lo, hi), r["step_bytes"].get(step, (0, 0))
            label = "**command**" if step == "whole" else step
            if step == "whole" and r.get("stopped"):
                label += f" (stopped {r['stopped'] - r['t0']:,.0f} s in)"
            lines.append(
                f"| {name} | {label} | {wall:,.1f} | {rss:,.0f} | {got / mb:,.1f} | {twice / mb:,.1f} | "
                f"{got / raw:.3f} |"
            )
    lines += ["", "| run | the command's own peak RSS MB | its largest child process (MB) |", "|---|---:|---|"]
    for name, r in runs.items():
        child = f"{r['others'][0][1]:,.0f} (`{r['others'][0][0][:60].strip()}`)" if r["others"] else "-"
        lines.append(f"| {name} | {r['main']:,.0f} | {child} |")
    to_step = f"{first['first_step'] - first['t0']:,.1f} s" if first["first_step"] else "n/a"

    def get(part: str, fn) -> str:
        return f"{fn(runs[part]):,.1f}" if part in runs else "-"

    lines += [
        "",
        "| figure | value |",
        "|---|---:|",
        f"| time from the command to the first optimizer step | {to_step} |",
        f"| training windows/s, streamed (first run) / the split in the cache | {first['wps'] or 0:,.0f} / "
        f"{get('in cache', lambda r: r['wps'] or 0)} |",
        f"| stored shards / raw bytes | {m['stored_mb']:,.0f} / {m['raw_mb']:,.0f} MB = "
        f"{m['stored_mb'] / m['raw_mb']:.2f}x |",
        f"| encode MB/s (threads) / polars alone from the bucket | {m['raw_mb'] / span_s(first, 'encode'):,.1f} / "
        f"{get('floor', lambda r: m['raw_mb'] / r['wall'])} |",
        f"| encode step, Dask 2 workers / threads | {get('dask', lambda r: span_s(r, 'encode'))} / "
        f"{span_s(first, 'encode'):,.1f} s |",
        f"| ingest, per file / encode, per raw MB (first run) | {span_s(first, 'ingest') / m['games'] * 1e3:,.2f} ms / "
        f"{span_s(first, 'encode') / m['raw_mb'] * 1e3:,.1f} ms |",
        f"| cached rerun / first run | {get('again', lambda r: r['wall'])} / {first['wall']:,.1f} s |",
        f"| append ({m['appended']:,} games): its encode / the full encode | "
        f"{get('append', lambda r: span_s(r, 'encode'))} / {span_s(first, 'encode'):,.1f} s |",
        "",
        *cpu_lines(runs),
        "",
        *stream_lines(m),
        verdicts(m),
        "",
        projection(m),
    ]
    return "\n".join(lines)


def stream_lines(m: dict) -> list[str]:
    """The `stream` part's rounds: windows/s and windows per CPU-second of each, streamed and in cache."""
    if not m.get("stream"):
        return []
    st = m["stream"]
    out = [f"| `fit` alone, {st['steps']:,} steps, rounds alternated | windows/s | windows per CPU-second |"]
    out.append("|---|---:|---:|")
    for mode in ("in cache", "streamed"):
        wps = " / ".join(f"{r['wps']:,.0f}" for r in st[mode])
        per_cpu = " / ".join(f"{r['per_cpu_s']:,.0f}" for r in st[mode])
        out.append(f"| {mode} | {wps} | {per_cpu} |")
    return [*out, ""]


def cpu_lines(runs: dict) -> list[str]:
    """Where the machine's CPU went while each run's timed training steps ran: its cores busy, the processes of
    the command and the S3 server that used most, and the rest (other processes on the machine)."""

    def short(key: str) -> str:  # "PID /a/b/python /a/b/shardline run ..." -> "python shardline run"
        return " ".join(Path(w).name if "/" in w else w for w in key.split()[1:4])

    out = ["| run: while its timed training steps ran | cores busy | by process (cores) | other processes |"]
    out.append("|---|---:|---|---:|")
    for name, r in runs.items():
        got = cores_busy(r.get("cpu", []), *r["timed"]) if r.get("timed") else None
        if got is None:
            continue
        machine, per = got
        top = sorted(((v, k) for k, v in per.items() if v >= 0.01), reverse=True)[:4]
        named = "; ".join(f"{v:.2f} `{short(k)}`" for v, k in top)
        out.append(f"| {name} | {machine:.2f} | {named} | {machine - sum(per.values()):.2f} |")
    return out


BIG_GAMES, BIG_MB = 230_000, 34_000  # the user's whole data: 230K games, 34 GB


def projection(m: dict, workers: tuple[int, ...] = (8, 32)) -> str:
    """What the whole data (BIG_GAMES files, BIG_MB) would take, from this run's per-file and per-MB costs:
    ingest per file, encode and the evaluation per raw MB (windows grow with the rows), training the same
    capped steps; the encode on a Dask cluster of N workers at the per-worker rate of the 2-worker run."""
    first, runs = m["runs"]["first"], m["runs"]
    files, scale = BIG_GAMES / m["games"], BIG_MB / m["raw_mb"]
    step = {s: span_s(first, s) for s in STEPS}
    here = {
        "ingest": step["ingest"] * files,
        "encode": step["encode"] * scale,
        "train (capped steps; validation grows with the data)": step["train"] * scale,
        "evaluate": step["evaluate"] * scale,
        "register": step["register"],
    }
    lines = [
        f"| {BIG_GAMES:,} games, {BIG_MB / 1e3:,.0f} GB, from this run's costs | this machine, h | "
        + " | ".join(f"encode on {n} Dask workers, h" for n in workers)
        + " |",
        "|---|---:|" + "---:|" * len(workers),
    ]
    per_worker = span_s(runs["dask"], "encode") * 2 / m["raw_mb"] if "dask" in runs else None  # s per MB a worker
    for name, sec in here.items():
        cells = [f"{BIG_MB * per_worker / n / 3600:,.2f}" if name == "encode" and per_worker else "" for n in workers]
        lines.append(f"| {name} | {sec / 3600:,.2f} | " + " | ".join(cells) + " |")
    lines.append(
        f"| **the command** | **{sum(here.values()) / 3600:,.2f}** | " + " | ".join("" for _ in workers) + " |"
    )
    return "\n".join(lines)


def verdicts(m: dict) -> str:
    f = figures(m)
    names = {
        "encode_vs_floor": ("encode throughput / polars reading the same files from the bucket", ">="),
        "encode_bytes": ("bytes the encode reads from S3 / raw bytes", "<="),
        "rss": (f"peak RSS of the command, {m['games']:,} games / the demo's size", "<="),
        "stream": (
            "training windows/s streamed / the split in the cache"
            + (" (`fit` alone, best of each)" if m.get("stream") else " (one run each)"),
            ">=",
        ),
        "rerun": ("cached rerun / first run (wall)", "<="),
        "append": (f"{m['appended']:,} games appended: encode / the full encode", "<="),
    }
    lines = ["| target | measured | bound | |", "|---|---:|---:|---|"]
    for key, (name, op) in names.items():
        if f[key] is None:
            lines.append(f"| {name} | not run | {op} {TARGETS[key]} | - |")
            continue
        ok = f[key] >= TARGETS[key] if op == ">=" else f[key] <= TARGETS[key]
        lines.append(f"| {name} | {f[key]:.3f} | {op} {TARGETS[key]} | {'PASS' if ok else 'FAIL'} |")
    return "\n".join(lines)


def write_doc(doc: Path, text: str) -> None:
    """Put `text` between the markers in `doc` (before "## Running the benchmarks" the first time)."""
    body = doc.read_text()
    block = f"{MARK[0]}\n{text}\n{MARK[1]}"
    if MARK[0] in body:
        head, rest = body.split(MARK[0], 1)
        body = head + block + rest.split(MARK[1], 1)[1]
    else:
        head, rest = body.split("## Running the benchmarks", 1)
        body = f"{head}{block}\n\n## Running the benchmarks{rest}"
    doc.write_text(body)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--games", type=int, default=22000)
    ap.add_argument("--frames", type=int, default=4500, help="frames a game (4,500: ~154 KB of zlib parquet)")
    ap.add_argument("--append-pct", type=float, default=5.0, help="games appended, in %% of --games")
    ap.add_argument("--demo-games", type=int, default=160)
    ap.add_argument("--demo-frames", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=300, help="optimizer steps of the one epoch at most")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    ap.add_argument("--doc", default=str(ROOT / "docs" / "performance.md"), help="where to write ('none': nowhere)")
    ap.add_argument("--json", default=str(Path(tempfile.gettempdir()) / "shardline-seed-scale.json"))
    ap.add_argument("--parts", default=",".join(PARTS), help=f"which runs besides the first ({', '.join(PARTS)})")
    ap.add_argument("--cap-gb", type=float, help="the shard cache's cap (default: a quarter of the train split)")
    ap.add_argument(
        "--whole",
        dest="short",
        action="store_false",
        help="run the in-cache training and the append to their end (by default the first stops after its "
        "training steps, the second after its encode: their figures are taken by then)",
    )
    ap.add_argument(
        "--prefect-api",
        metavar="URL",
        help="a running Prefect API for every command (default: each starts a temporary one, as on a laptop)",
    )
    ap.add_argument("--table", metavar="JSON", help="print (and write) the tables of measures saved before")
    ap.add_argument("--stream-rounds", type=int, default=3, help="rounds of the stream part, alternated (default 3)")
    ap.add_argument("--stream-steps", type=int, default=1000, help="steps of each of its trainings (default 1,000)")
    for hidden in ("moto", "floor", "encode", "train"):
        ap.add_argument(f"--{hidden}", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.moto:
        return serve_moto(a.moto)
    if a.train:
        return child_train(json.loads(Path(a.train).read_text()))
    if a.floor or a.encode:
        return (
            child_floor(json.loads(Path(a.floor).read_text()))
            if a.floor
            else child_encode(json.loads(Path(a.encode).read_text()))
        )
    a.append = round(a.games * a.append_pct / 100)
    a.parts = {p.strip() for p in a.parts.split(",")}
    m = json.loads(Path(a.table).read_text()) if a.table else measure(a, Path(a.json))
    log(f"measures saved in {a.table or a.json}")
    text = tables(m)
    print("\n" + text)
    if a.doc != "none":
        write_doc(Path(a.doc), text)
        log(f"written into {a.doc}")


if __name__ == "__main__":
    main()
