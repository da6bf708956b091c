"""Sweeps: concurrent local trials, and a sweep against the same trials as separate runs (issue #21).

    .venv/bin/python benchmarks/sweep_bench.py                       # both parts, the defaults below
    .venv/bin/python benchmarks/sweep_bench.py --part design --at-once 2
    .venv/bin/python benchmarks/sweep_bench.py --part sweep --games 24 --frames 1000 --epochs 1

Part `design`: how should trials that share one machine run? The trainer's `fit` on the demo data,
`--at-once` trainings of the same size (no Prefect, no MLflow): one after the other with all the cores,
then with a share of them; at once in threads of one process, each setting torch to its share of the
cores; at once in spawned processes, each with its share (process start and imports included, as a
sweep pays them). The machine's load (other users) is printed: torch's threads suffer most from it.

Part `sweep`: the wall time of `shardline sweep CONFIG --grid model.hidden=128,256 --grid
training.lr=0.002,0.0005 --at-once N` against four `shardline run CONFIG --set ...` of the same four
trials one after the other, each command in a fresh home and started as a user starts it (the
ephemeral Prefect API's start-up included), on the same demo data.

Part `prune` (issue #46): a 16-trial grid of the demo (training.lr x model.hidden x model.dropout) with
`--prune hyperband` against the same 16 trials run to the end, each sweep in a fresh home: wall time (target:
at most 0.5x), the registered best trial's test metric (target: within 1 % of the full sweep's best), and the
data encoded once in each (asserted: one manifest, one encode).

    .venv/bin/python benchmarks/sweep_bench.py --part prune --epochs 9
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

BIN = Path(sys.executable).parent / "shardline"
TRIALS = [
    {"model.hidden": 128, "training.lr": 0.002},
    {"model.hidden": 128, "training.lr": 0.0005},
    {"model.hidden": 256, "training.lr": 0.002},
    {"model.hidden": 256, "training.lr": 0.0005},
]


def config_file(home: Path, raw: Path, epochs: int) -> Path:
    from shardline.core.config import read_yaml

    cfg = read_yaml(ROOT / "shardline" / "configs" / "demo.yaml")
    cfg["data"]["source"] = str(raw / "*.parquet")
    cfg["storage"] = {"root": str(home / "store")}
    cfg["mlflow"]["tracking_uri"] = f"sqlite:///{home / 'mlflow.db'}"
    cfg["training"].update(epochs=epochs, device="cpu", checkpoint_every_steps=0)
    path = home / "bench.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def make_data(folder: Path, games: int, frames: int) -> Path:
    from shardline.app.demo_data import generate_demo

    raw = folder / "raw"
    generate_demo(raw, n_games=games, frames=frames, seed=0)
    return raw


# ---------------------------------------------------------------- part design


def _encoded(config_path: Path, out: Path) -> str:
    from shardline.core.config import load_config
    from shardline.tasks.encode import encode_dataset
    from shardline.tasks.ingest import snapshot_source

    config = load_config(config_path)
    uri = out / "manifest.json"
    if not uri.exists():
        encode_dataset(snapshot_source(config.data), config.data, str(out))
    return str(uri)


def _fit(config_path: str, manifest_uri: str, ckpt: str, threads: int | None, overrides: dict) -> dict:
    """One training of a trial's config, `threads` torch threads in the calling thread (None: torch's own)."""
    import torch

    from shardline.core.config import load_config
    from shardline.core.manifest import Manifest
    from shardline.trainer.data import open_split
    from shardline.trainer.loop import Callbacks, FitOptions, fit
    from shardline.trainer.models import model_spec_for
    from shardline.trainer.serving import data_spec

    if threads:
        torch.get_num_threads()  # the thread's own count is read (a lazy init) before it is set
        torch.set_num_threads(threads)
    config = load_config(config_path, [f"{k}={v}" for k, v in overrides.items()])
    manifest = Manifest.model_validate_json(Path(manifest_uri).read_text())
    train, val = open_split(manifest, manifest_uri, "train"), open_split(manifest, manifest_uri, "validation")
    spec = model_spec_for(config.model, data_spec(manifest.encoding))
    t0 = time.perf_counter()
    result = fit(
        train,
        val,
        spec,
        config.training,
        "classification",
        ckpt,
        callbacks=Callbacks(log=lambda m: None),
        options=FitOptions(resume=False),
    )
    return {
        "seconds": time.perf_counter() - t0,
        "windows": train.n_windows * config.training.epochs,
        "steps": result.steps,
    }


def _child(args: tuple, queue) -> None:
    queue.put(_fit(*args))


def part_design(config_path: Path, work: Path, at_once: int, cores: int, rounds: int) -> list[tuple]:
    """Each way `rounds` times, the ways in a rotated order each round (the machine's load drifts):
    (name, wall seconds of each round, the fits of the median round)."""
    manifest = _encoded(config_path, work / "encoded")
    share = max(1, cores // at_once)
    trials = [TRIALS[i % len(TRIALS)] for i in range(at_once)]
    args = lambda mode, i, threads: (str(config_path), manifest, str(work / f"ckpt-{mode}-{i}"), threads, trials[i])
    _fit(
        str(config_path), manifest, str(work / "warm"), None, {"training.epochs": 1, "training.max_steps_per_epoch": 5}
    )

    def sequential(threads: int):
        return lambda: [_fit(*args(f"seq{threads}", i, threads)) for i in range(at_once)]

    def in_threads():
        fits = []
        pool = [threading.Thread(target=lambda i=i: fits.append(_fit(*args("thr", i, share)))) for i in range(at_once)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        return fits

    def in_processes():
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=_child, args=(args("proc", i, share), queue)) for i in range(at_once)]
        for p in procs:
            p.start()
        fits = [queue.get() for _ in procs]
        for p in procs:
            p.join()
        return fits

    ways = [
        ("one after the other, all cores each", sequential(cores)),
        (f"one after the other, {share} torch thread(s) each", sequential(share)),
        (f"at once, threads of one process, {share} torch thread(s) each", in_threads),
        (f"at once, a process each (start-up included), {share} torch thread(s) each", in_processes),
    ]
    walls: dict[str, list[tuple[float, list]]] = {name: [] for name, _ in ways}
    for r in range(rounds):
        for name, run in ways[r % len(ways) :] + ways[: r % len(ways)]:
            t0 = time.perf_counter()
            fits = run()
            walls[name].append((time.perf_counter() - t0, fits))
    out = []
    for name, _ in ways:
        ordered = sorted(walls[name], key=lambda w: w[0])
        out.append((name, [w for w, _ in walls[name]], ordered[len(ordered) // 2][1]))
    return out


# ---------------------------------------------------------------- part sweep


def _timed(args: list[str]) -> tuple[float, str]:
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # each command as a user starts it
    t0 = time.perf_counter()
    out = subprocess.run([str(BIN), *args], capture_output=True, text=True, env=env)
    if out.returncode:
        sys.exit(f"shardline {' '.join(args)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    steps = next((line for line in out.stdout.splitlines() if line.startswith("steps:")), "")
    return time.perf_counter() - t0, steps


def part_sweep(raw: Path, work: Path, epochs: int, at_once: int) -> list[tuple]:
    home = work / "sweep-home"
    home.mkdir(parents=True)
    cfg = config_file(home, raw, epochs)
    hidden = ",".join(dict.fromkeys(str(t["model.hidden"]) for t in TRIALS))
    lr = ",".join(dict.fromkeys(str(t["training.lr"]) for t in TRIALS))
    grid = ["--grid", f"model.hidden={hidden}", "--grid", f"training.lr={lr}"]
    swept, steps = _timed(["sweep", str(cfg), *grid, "--at-once", str(at_once)])
    rows = [(f"shardline sweep, 4 trials, --at-once {at_once}", swept, steps)]
    again, steps = _timed(["sweep", str(cfg), *grid, "--at-once", str(at_once)])
    rows.append(("the same sweep again (all cached)", again, steps))
    total, all_steps = 0.0, []
    for i, trial in enumerate(TRIALS):
        home = work / f"run-home-{i}"
        home.mkdir(parents=True)
        cfg = config_file(home, raw, epochs)
        sets = [x for k, v in trial.items() for x in ("--set", f"{k}={v}")]
        seconds, steps = _timed(["run", str(cfg), *sets])
        total += seconds
        all_steps.append(re.sub(r"\s+", " ", steps))
    each = all_steps[0] if len(set(all_steps)) == 1 else "; ".join(all_steps)
    rows.append(("4 x shardline run, one after the other", total, f"each {each.removeprefix('steps: ')}"))
    return rows


PRUNE_GRID = [
    "--grid",
    "training.lr=0.003,0.001,0.0003,0.0001",
    "--grid",
    "model.hidden=64,256",
    "--grid",
    "model.dropout=0.0,0.3",
]


def _best_test_metric(home: Path, metric: str = "accuracy") -> tuple[str, float]:
    """The registered champion's test metric, from the sweep's MLflow store."""
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{home / 'mlflow.db'}")
    version = client.get_model_version_by_alias("shardline-demo", "champion")
    return version.version, float(version.tags[f"metric.{metric}"])


def _encoded_once(home: Path) -> int:
    """How many data sets the sweep encoded: the manifests of its storage root's data sets (one data setting: must
    be 1; the registered model's copy of it, under mlflow-artifacts/, is not another)."""
    from shardline.core.layout import DATASETS

    return len(list((home / "store" / DATASETS).rglob("manifest.json")))


def part_prune(raw: Path, work: Path, epochs: int, at_once: int) -> list[tuple]:
    rows = []
    for name, extra in (("16 trials to the end", []), ("16 trials, --prune hyperband", ["--prune", "hyperband"])):
        home = work / f"prune-home-{len(rows)}"
        home.mkdir(parents=True)
        cfg = config_file(home, raw, epochs)
        seconds, steps = _timed(["sweep", str(cfg), *PRUNE_GRID, "--at-once", str(at_once), *extra])
        manifests = _encoded_once(home)
        assert manifests == 1, f"{name}: {manifests} data sets encoded, not one"
        assert "encode ran" in steps, steps
        version, metric = _best_test_metric(home)
        rows.append((name, seconds, steps, metric, version))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["design", "sweep", "prune", "both"], default="both")
    ap.add_argument("--games", type=int, default=80)
    ap.add_argument("--frames", type=int, default=2000)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--at-once", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="part design: rounds of every way, interleaved")
    a = ap.parse_args()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    with tempfile.TemporaryDirectory(prefix="sweep-bench-") as tmp:
        work = Path(tmp)
        raw = make_data(work, a.games, a.frames)
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        print(f"\ndemo data: {a.games} games x {a.frames} frames, {a.epochs} epoch(s)")
        print(f"{cores} core(s), load average {load:.1f} at the start (other users' work slows torch's threads most)")
        if a.part in ("design", "both"):
            rows = part_design(config_file(work, raw, a.epochs), work, a.at_once, cores, a.rounds)
            median = lambda xs: sorted(xs)[len(xs) // 2]
            base = median(rows[0][1])
            print(
                f"\n{a.at_once} trainings of the demo MLP (hidden 128/256, `fit` only: no Prefect, no MLflow), "
                f"{a.rounds} interleaved round(s): the median wall time, its range, each fit in the median round\n"
            )
            print("| how | wall s (median) | range | speed-up | each fit s (mean) | windows/s in all |")
            print("|---|---:|---:|---:|---:|---:|")
            for how, seconds, fits in rows:
                wall = median(seconds)
                mean = sum(f["seconds"] for f in fits) / len(fits)
                speed = sum(f["windows"] for f in fits) / wall
                span = f"{min(seconds):.1f}-{max(seconds):.1f}"
                print(f"| {how} | {wall:.1f} | {span} | {base / wall:.2f} | {mean:.1f} | {speed:,.0f} |")
            print("\n(a process's wall minus its longest fit: start-up and imports, which a sweep pays once per trial)")
        if a.part in ("sweep", "both"):
            rows = part_sweep(raw, work, a.epochs, a.at_once)
            base = rows[-1][1]
            print("\nthe same 4 trials (model.hidden x training.lr), each command started as a user starts it\n")
            print("| command | wall s | vs 4 runs | steps |")
            print("|---|---:|---:|---|")
            for how, seconds, steps in rows:
                print(f"| {how} | {seconds:.1f} | {seconds / base:.2f} | {steps.removeprefix('steps: ')} |")
        if a.part == "prune":
            rows = part_prune(raw, work, a.epochs, a.at_once)
            (_, full_s, _, full_best, _), (_, pruned_s, _, pruned_best, _) = rows
            print(
                f"\n16 trials of the demo ({a.epochs} epochs each), {a.at_once} at once, each sweep in a fresh home\n"
            )
            print("| sweep | wall s | vs to the end | best test accuracy | steps |")
            print("|---|---:|---:|---:|---|")
            for how, seconds, steps, metric, _ in rows:
                said = steps.removeprefix("steps: ")
                print(f"| {how} | {seconds:.1f} | {seconds / full_s:.2f} | {metric:.4f} | {said} |")
            gap = abs(pruned_best - full_best) / full_best
            fast, close = pruned_s <= 0.5 * full_s, gap <= 0.01
            print(
                f"\ntargets: wall {pruned_s / full_s:.2f}x (<= 0.5: {'met' if fast else 'NOT met'}); "
                f"best test accuracy {gap:.2%} from the full sweep's (<= 1 %: {'met' if close else 'NOT met'}); "
                "each sweep encoded its data once (asserted)"
            )


if __name__ == "__main__":
    main()
