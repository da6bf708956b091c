"""Training on an encoded data set, as the training flow runs it (shardline.trainer.loop.fit), measured: step rate,
how much of the wall time the loop waits for its next batch (the input-bound fraction), and whether a
run preempted mid-epoch resumes to the weights of a run that never stopped. Prints a markdown table.

    .venv/bin/python benchmarks/gpu_train.py STORE/datasets/ID/manifest.json              # CUDA if present
    .venv/bin/python benchmarks/gpu_train.py MANIFEST --families mlp transformer --workers 0 2 --epochs 2
    .venv/bin/python benchmarks/gpu_train.py MANIFEST --families mlp --modes eager compile graphs compile+graphs

--modes compares the launch-bound remedies in the same run: eager steps, `training.compile`, `training.cuda_graphs`
(the whole step captured and replayed) and both; the table gives each one's steps/s as a ratio to eager, and
the resume check runs with the last mode given: a run preempted and resumed against one that never stopped, and
a second uninterrupted run against the first (the run-to-run baseline), under each --deterministic setting
(default: `null` and `true`). With `training.deterministic: true` both differences must be 0.0 on a GPU too;
without it, CUDA's atomic adds (an embedding's backward) make even two uninterrupted runs differ a little.

Only `trainer/`, the contract types and the system-metrics sampler are imported (no Prefect, no MLflow), so it
runs on a bare GPU host with torch, numpy, fsspec, pyyaml and pydantic (psutil too for the GPU busy column). The
model and training settings are the demo config's (shardline/configs/demo.yaml) with --set overrides.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import shardline.trainer.loop as loop  # noqa: E402
from shardline.core.config import load_config  # noqa: E402
from shardline.core.manifest import Manifest  # noqa: E402
from shardline.core.tracking.system import SystemSampler  # noqa: E402
from shardline.trainer.data import WindowLoader, open_split  # noqa: E402
from shardline.trainer.data.batch import Batch, portable  # noqa: E402
from shardline.trainer.models import model_spec  # noqa: E402


class CopiedToPinned:
    """A split whose chunks are gathered into ordinary memory, then copied into page-locked memory (`--pin copy`):
    the loader's path before 2026-11-28, which pinned each gathered chunk with a second copy."""

    def __init__(self, data):
        self._data = data

    def __getattr__(self, name):
        return getattr(self._data, name)

    def batch(self, idx, pin_memory=False, release=()):
        b = self._data.batch(idx, pin_memory=False, release=release)
        pinned = [portable(t).pin_memory() for t in (b.cont, b.cat, *b.targets)]
        return Batch(pinned[0], pinned[1], tuple(pinned[2:]))


class TimedLoader(WindowLoader):
    """The loader, timing how long the training loop waits in `next()` for each training batch."""

    waited = 0.0
    waits: list[float] = []  # each training batch's wait, for where it goes (--waits)
    by_epoch: dict[int, list] = {}  # epoch -> [seconds waited, training batches] (benchmarks/demo_wait.py)
    pin = "on"  # off: the training batches are not pinned; copy: pinned by a second copy (--pin)

    def __init__(self, data, *args, **kwargs):
        super().__init__(data, *args, **kwargs)
        self.pin_memory = self.pin_memory and TimedLoader.pin != "off"
        if self.pin_memory and TimedLoader.pin == "copy":
            self.data = CopiedToPinned(data)

    def __iter__(self):
        it = super().__iter__()
        while True:
            t = time.perf_counter()
            try:
                b = next(it)
            except StopIteration:
                return
            if self.shuffle:  # training batches only (validation reads in order)
                w = time.perf_counter() - t
                TimedLoader.waited += w
                TimedLoader.waits.append(w)
                epoch = TimedLoader.by_epoch.setdefault(self.epoch, [0.0, 0])
                epoch[0], epoch[1] = epoch[0] + w, epoch[1] + 1
            yield b
            del b  # the loop's list holds the batch alone: it is let go where the loop lets it go


MODES = {
    "eager": ["training.compile=false", "training.cuda_graphs=false"],
    "compile": ["training.compile=true", "training.cuda_graphs=false"],
    "graphs": ["training.compile=false", "training.cuda_graphs=true"],
    "compile+graphs": ["training.compile=true", "training.cuda_graphs=true"],
    "default": ["training.compile=false"],  # training.cuda_graphs unset: captured on a GPU where the step can be
}


class GpuBusy:
    """The GPU's utilisation while a fit runs: the run's own system-metrics sampler (what MLflow's System metrics
    tab shows, NVML's kernel-busy share) every 0.2 s instead of every few seconds, dense enough for a fit of
    seconds. On a machine without a GPU it has no figure."""

    KEY = "system/gpu_0_utilization_percentage"

    def __init__(self):
        self.samples: list[float] = []
        self._sampler = SystemSampler(self, every=0.2)

    def log_metrics(self, values: dict, step: int) -> None:  # the sampler's tracker
        if self.KEY in values:
            self.samples.append(values[self.KEY])

    def __enter__(self):
        self._sampler.start()
        return self

    def __exit__(self, *exc):
        self._sampler.stop()

    @property
    def mean(self) -> float | None:
        return sum(self.samples) / len(self.samples) if self.samples else None


def run_fit(train, val, spec, cfg, task, ckpt, resume=True, log=lambda m: None, busy=None):
    TimedLoader.waited, TimedLoader.waits, TimedLoader.by_epoch = 0.0, [], {}
    t = time.perf_counter()
    from shardline.trainer.stops import setting_hooks  # SHARDLINE_PREEMPT_AT_STEP: the preemption resume_check asks

    callbacks = loop.Callbacks(log=log, **setting_hooks(log))
    with busy or GpuBusy():
        result = loop.fit(train, val, spec, cfg, task, ckpt, callbacks, loop.FitOptions(resume=resume))
    return result, time.perf_counter() - t, TimedLoader.waited


def weights(ckpt_uri: str) -> dict:
    state = torch.load(ckpt_uri, map_location="cpu", weights_only=True)
    return state["model"] if "model" in state else state


def max_diff(a: dict, b: dict) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a if a[k].is_floating_point())


def resume_check(train, val, cfg, enc, work: Path, args) -> dict:
    """An uninterrupted run, a second one (the run-to-run baseline), and one preempted at --preempt-at and
    resumed: the largest weight difference of each pair, the steps and the val_loss."""
    spec = model_spec(cfg.model, len(enc.continuous), enc.cat_cardinalities, enc.window, enc.target.n_outputs)
    task = enc.target.task
    ref, _, _ = run_fit(train, val, spec, cfg.training, task, str(work / "ref"), resume=False)
    twin, _, _ = run_fit(train, val, spec, cfg.training, task, str(work / "twin"), resume=False)
    os.environ["SHARDLINE_PREEMPT_AT_STEP"] = str(args.preempt_at)
    t = time.perf_counter()
    try:
        run_fit(train, val, spec, cfg.training, task, str(work / "cut"), resume=False)
        preempted = "no (the run ended before the preemption step)"
    except loop.Preempted as e:
        preempted = f"yes, at step {args.preempt_at} ({e.signal_name}), checkpoint {Path(e.checkpoint).name}"
    finally:
        os.environ.pop("SHARDLINE_PREEMPT_AT_STEP", None)
    again, _, _ = run_fit(train, val, spec, cfg.training, task, str(work / "cut"), resume=True)
    lost = time.perf_counter() - t
    a = weights(ref.last_checkpoint)
    return {
        "preempted": preempted,
        "resumed_from": Path(again.resumed_from or "-").name,
        "steps": (ref.steps, again.steps),
        "val_loss": (ref.history[-1]["val_loss"], again.history[-1]["val_loss"]),
        "max_weight_diff": max_diff(a, weights(again.last_checkpoint)),
        "run_to_run_diff": max_diff(a, weights(twin.last_checkpoint)),
        "seconds": lost,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("manifest", help="an encoded data set's manifest.json (local path or URL)")
    ap.add_argument("--families", nargs="+", default=["mlp", "transformer"])
    ap.add_argument("--workers", nargs="+", type=int, default=[0, 2])
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override (repeatable)")
    ap.add_argument("--preempt-at", type=int, default=150, help="optimizer step the resume check preempts at")
    ap.add_argument("--json", metavar="PATH", help="also write the rows and the resume check to PATH as JSON")
    ap.add_argument(
        "--modes",
        nargs="+",
        default=["eager"],
        choices=sorted(MODES),
        help="step modes to compare (the resume check runs the last one)",
    )
    ap.add_argument(
        "--deterministic",
        nargs="*",
        default=["null", "true"],
        choices=["null", "true", "false"],
        help="training.deterministic settings the resume check runs under (null: the default); none given: no "
        "resume check",
    )
    ap.add_argument(
        "--switch-interval",
        nargs="+",
        type=float,
        default=[None],
        metavar="SECONDS",
        help="Python's GIL switch interval (sys.setswitchinterval) each row runs under, as a comparison (default: "
        "the interpreter's)",
    )
    ap.add_argument(
        "--pin",
        nargs="+",
        default=["on"],
        choices=["on", "off", "copy"],
        help="whether the loader pins the batches it gathers, as a comparison: on (as training does on a GPU: "
        "gathered straight into page-locked memory), off, or copy (gathered, then copied to page-locked memory: "
        "the loader before 2026-11-28)",
    )
    args = ap.parse_args()
    if "true" in args.deterministic:  # before the process's first CUDA matmul: cuBLAS reads it then
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

    loop.WindowLoader = TimedLoader  # fit builds its loaders through this name
    uri = args.manifest
    manifest = Manifest.model_validate_json(
        Path(uri).read_text() if "://" not in uri else __import__("fsspec").open(uri).open().read()
    )
    enc = manifest.encoding
    train = open_split(manifest, uri, "train")
    val = open_split(manifest, uri, "validation")
    base = load_config(
        ROOT / "shardline" / "configs" / "demo.yaml",
        [f"training.batch_size={args.batch}", f"training.epochs={args.epochs}", *args.set],
    )
    device = loop.pick_device(base.training.device)
    print(
        f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}), torch "
        f"{torch.__version__}, "
        f"train {train.n_windows:,} windows of K={enc.window}, validation {val.n_windows:,}, batch {args.batch}",
        flush=True,
    )
    work = Path(tempfile.mkdtemp(prefix="shardline-gpu-"))
    rows = []
    try:

        def config(family: str, *more: str):
            return load_config(
                ROOT / "shardline" / "configs" / "demo.yaml",
                [f"training.batch_size={args.batch}", f"training.epochs={args.epochs}", f"model.family={family}"]
                + [*args.set, *more],
            )

        if device.type == "cuda":  # one fit first, unmeasured: CUDA's and the allocator's start-up in none of the rows
            first = config(args.families[0]).training
            spec0 = model_spec(
                config(args.families[0]).model,
                len(enc.continuous),
                enc.cat_cardinalities,
                enc.window,
                enc.target.n_outputs,
            )
            run_fit(train, val, spec0, first.model_copy(update={"epochs": 1}), enc.target.task, str(work / "warm"))
        default_interval = sys.getswitchinterval()
        for family in args.families:
            cfg = config(family)
            spec = model_spec(cfg.model, len(enc.continuous), enc.cat_cardinalities, enc.window, enc.target.n_outputs)
            params = sum(p.numel() for p in loop.model_from_spec(spec).parameters())
            for w, interval, pin in [(w, i, p) for w in args.workers for i in args.switch_interval for p in args.pin]:
                eager_rate = None
                sys.setswitchinterval(interval or default_interval)
                TimedLoader.pin = pin
                for mode in args.modes:
                    tc = config(family, *MODES[mode]).training.model_copy(update={"num_workers": w})
                    said, busy = [], GpuBusy()
                    res, wall, waited = run_fit(
                        train,
                        val,
                        spec,
                        tc,
                        enc.target.task,
                        str(work / f"{family}-{w}-{mode}"),
                        resume=False,
                        log=said.append,
                        busy=busy,
                    )
                    last = res.history[-1]
                    train_s = sum(h["seconds"] for h in res.history)
                    eager_rate = last["windows_per_s"] if mode == "eager" else eager_rate
                    notes = [m for m in said if "cuda_graphs" in m]
                    rows.append(
                        {
                            "model": f"{family} ({params / 1e6:.2f}M)",
                            "workers": f"{w}"
                            + ("" if interval is None else f" (switch {interval * 1e3:g} ms)")
                            + {"on": "", "off": " (not pinned)", "copy": " (pinned by a copy)"}[pin],
                            "mode": mode,
                            "precision": res.precision,
                            "windows/s": last["windows_per_s"],
                            "steps/s": last["windows_per_s"] / args.batch,
                            "x eager": last["windows_per_s"] / eager_rate if eager_rate else float("nan"),
                            "input-bound": waited / max(train_s, 1e-9),
                            "data wait": last.get("data_wait_fraction"),
                            "val_loss": last["val_loss"],
                            "score": last.get("val_accuracy", last.get("val_mae")),
                            "wall": wall,
                            "gpu busy": busy.mean,
                        }
                    )
                    waits = np.asarray(TimedLoader.waits) * 1e6  # µs per training batch, every epoch
                    if len(waits):
                        long = waits > 300
                        print(
                            f"  waits: {len(waits)} batches, median {np.median(waits):.0f} µs, p90 "
                            f"{np.percentile(waits, 90):.0f} µs, p99 {np.percentile(waits, 99):.0f} µs; {long.sum()} "
                            f"over 300 µs hold {waits[long].sum() / max(waits.sum(), 1e-9):.0%} of the "
                            f"{waits.sum() / 1e6:.3f} s waited; the fit's data wait by epoch: "
                            + ", ".join(format(h.get("data_wait_fraction") or 0, ".1%") for h in res.history),
                            flush=True,
                        )
                    print(
                        f"  {family} workers={w} switch={sys.getswitchinterval() * 1e3:g}ms pin={pin} {mode}: "
                        f"{last['windows_per_s']:,.0f} windows/s, waited {waited:.2f}s "
                        f"of {train_s:.1f}s"
                        + (f", GPU busy {busy.mean:.0f} %" if busy.mean is not None else "")
                        + (f"; {' | '.join(notes)}" if notes else ""),
                        flush=True,
                    )

        # resume: an uninterrupted run against one preempted (SIGTERM, the spot path) at --preempt-at, then resumed;
        # and against a second uninterrupted run (the run-to-run baseline: what the kernels alone make differ),
        # under each training.deterministic setting asked for
        family = args.families[0]
        resumes = []
        for setting in args.deterministic:
            cfg = load_config(
                ROOT / "shardline" / "configs" / "demo.yaml",
                [
                    f"training.batch_size={args.batch}",
                    "training.epochs=1",
                    f"model.family={family}",
                    "training.checkpoint_every_steps=50",
                    f"training.deterministic={setting}",
                    *args.set,
                    *MODES[args.modes[-1]],
                ],
            )
            sys.setswitchinterval(default_interval)
            TimedLoader.pin = "on"
            resumes.append({"deterministic": setting, **resume_check(train, val, cfg, enc, work / setting, args)})
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(
        f"\n## Training on {device.type} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}), "
        f"{train.n_windows:,} train windows of K={enc.window}, batch {args.batch}, {args.epochs} epoch(s), last epoch\n"
    )
    print(
        "| model | loader workers | step | precision | windows/s | optimizer steps/s | x eager | input-bound (waiting "
        "for a batch, of the epoch with validation) | the fit's data wait (of step time) | GPU busy (the fit) "
        "| val_loss | val score | wall s |"
    )
    print("|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['model']} | {r['workers']} | {r['mode']} | {r['precision']} | {r['windows/s']:,.0f} | "
            f"{r['steps/s']:,.1f} | {r['x eager']:.2f} | "
            f"{100 * r['input-bound']:.1f} % | "
            f"{'-' if r['data wait'] is None else format(100 * r['data wait'], '.1f') + ' %'} | "
            f"{'-' if r['gpu busy'] is None else format(r['gpu busy'], '.0f') + ' %'} | "
            f"{r['val_loss']:.4f} | {r['score']:.4f} | {r['wall']:.1f} |"
        )
    if resumes:
        print(
            f"\n## Resume ({family}, {args.modes[-1]} steps, 1 epoch, checkpoint every 50 steps): largest weight "
            "difference to an uninterrupted run, of a second uninterrupted run and of one preempted and resumed\n"
        )
        print(
            "| training.deterministic | preempted | resumed from | steps (uninterrupted / resumed) | run to run "
            "| resumed | val_loss (uninterrupted / resumed) | preempted + resume wall s |"
        )
        print("|---|---|---|---|---:|---:|---|---:|")
        for r in resumes:
            print(
                f"| {r['deterministic']} | {r['preempted']} | {r['resumed_from']} | {r['steps'][0]} / {r['steps'][1]} "
                f"| {r['run_to_run_diff']:.3g} | {r['max_weight_diff']:.3g} "
                f"| {r['val_loss'][0]:.6f} / {r['val_loss'][1]:.6f} | {r['seconds']:.1f} |"
            )
    if args.json:
        Path(args.json).write_text(
            __import__("json").dumps(
                {
                    "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                    "torch": torch.__version__,
                    "batch": args.batch,
                    "rows": rows,
                    "resume": [{**r, "mode": args.modes[-1]} for r in resumes],
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
