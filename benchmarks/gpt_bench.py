"""Training tokens/s of the built-in `gpt` family through Shardline's trainer against a minimal hand-written
loop of the same model on the same tokens, in the same run (issue #19). Prints a markdown table.

    .venv/bin/python benchmarks/gpt_bench.py                    # ~1M-parameter GPT, K=64, batch 16, 2 threads
    .venv/bin/python benchmarks/gpt_bench.py --quick            # a smoke run (seconds)
    .venv/bin/python benchmarks/gpt_bench.py --d-model 256 --layers 6 --window 128 --steps 60 --compile
    python benchmarks/gpt_bench.py --device cuda --precision bf16 --d-model 384 --layers 6 --heads 6 \
        --window 256 --batch 32 --compile --graphs                  # on a GPU: ~10M parameters, with MFU

On a GPU the table adds the model FLOPs utilisation (MFU: 6 x parameters + attention's 12 x layers x d_model x
K FLOPs per trained token, over the GPU's dense bf16 peak from a table of known GPUs) and --graphs times
`training.cuda_graphs: true` too.

The data: a synthetic corpus of token ids (a column `tokens` of integers, one sequence per `seq`), written as
raw parquet and encoded by the encode step's own functions (`encode_dataset`, no Prefect) into shards, as the
pipeline does today for a categorical token column (text columns tokenize into the same layout).

- shardline: `shardline.trainer.loop.fit` over those shards (the loader, the contract checks, AMP's context,
  gradient clipping, the LR schedule, per-step logging, a validation pass and a checkpoint at the epoch's end),
  timed as a whole from the call to its return; its training tokens/s leave out the validation pass and the
  checkpoint's write (the hand loop validates and saves nothing; both have their own column: a 100M-parameter
  model's checkpoint with AdamW's moments is ~1 GB, seconds of a 100-step run), and everything else counts
  (set-up, checks, the loader);
- generation: greedy tokens/s with the key/value cache against recomputing the context for every token;
- hand loop: the same model class (`model_from_spec` of the same spec, the same seed) on the train split's token
  ids as one int64 array in memory, random windows (nanoGPT's get_batch), AdamW, gradient clipping at the same
  norm, `cross_entropy` on the logits: no loader, no checkpoint, no validation, no logging.

Both train the same number of optimizer steps of the same batch and context on the same threads; the runs are
interleaved, `--repeat` times each, and the best of each counts. Wall and CPU seconds (this process's) are both
shown: on a shared machine the CPU time is the steadier one (with --threads 1 it is the work done).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

import numpy as np  # noqa: E402
import polars as pl  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def write_corpus(folder: Path, sequences: int, length: int, vocab: int, seed: int = 0) -> None:
    """Token ids with some structure (a next-token rule, one random token in eight), `sequences` rows of
    `length` tokens, in 4 parquet files."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    per_file = -(-sequences // 4)
    for f in range(4):
        seqs = range(f * per_file, min(sequences, (f + 1) * per_file))
        toks = np.empty((len(seqs), length), dtype=np.int64)
        toks[:, 0] = rng.integers(vocab, size=len(seqs))
        noise = rng.random((len(seqs), length)) < 0.125
        rand = rng.integers(vocab, size=(len(seqs), length))
        for t in range(1, length):
            toks[:, t] = np.where(noise[:, t], rand[:, t], (7 * toks[:, t - 1] + 3) % vocab)
        pl.DataFrame(
            {
                "seq": np.repeat([f"s{s:05d}" for s in seqs], length),
                "t": np.tile(np.arange(length, dtype=np.int32), len(seqs)),
                "tokens": toks.reshape(-1),
            }
        ).write_parquet(folder / f"part-{f}.parquet")


def config(source: str, root: str, args):
    from shardline.core.config import validate_config

    return validate_config(
        {
            "data": {
                "source": source,
                "sequence_key": "seq",
                "order_by": "t",
                "window": args.window,
                "horizon": 1,
                "target_positions": "all",
                "features": {"categorical": ["tokens"]},
                "target": {"column": "tokens", "task": "classification"},
                "split": {"method": "hash", "seed": 0, "fractions": {"train": 0.9, "validation": 0.05, "test": 0.05}},
            },
            "model": {
                "family": "gpt",
                "hidden": args.d_model,
                "layers": args.layers,
                "heads": args.heads,
                "dropout": 0.0,
            },
            "training": {
                "epochs": 1,
                "batch_size": args.batch,
                "lr": 1e-3,
                "warmup_steps": 0,
                "max_steps_per_epoch": args.steps,
                "device": args.device,
                "precision": args.precision,
                "compile": False,
            },
            "storage": {"root": root},
        }
    )


class Clock:
    """Wall and CPU seconds (this process's: on a shared machine the CPU time is the steadier measure)."""

    def __init__(self):
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def read(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


VALIDATION = [0.0, 0.0]  # wall and CPU seconds in the trainer's validation passes
STEADY_FROM = 10  # the steady rate: from the end of this optimizer step to the last (the set-up and first steps out)
SAVING = [0.0, 0.0]  # wall and CPU seconds in its checkpoint writes


def timed(fn, into: list[float]):
    """`fn`, adding the wall and CPU seconds of each call to `into`."""

    def call(*args, **kwargs):
        clock = Clock()
        try:
            return fn(*args, **kwargs)
        finally:
            for i, v in enumerate(clock.read()):
                into[i] += v

    return call


class Steady:
    """Wall seconds from the end of step STEADY_FROM to the end of the last step (the device synchronised at both):
    the rate a long run keeps, without the set-up and first steps a short one pays once."""

    def __init__(self, last: int):
        self.last, self.marks = last, {}

    def __call__(self, step: int, *_) -> None:
        if step in (STEADY_FROM, self.last):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.marks[step] = time.perf_counter()

    def seconds(self) -> float:
        return self.marks.get(self.last, math.nan) - self.marks.get(STEADY_FROM, math.nan)


def shardline_run(train, val, spec, cfg, ckpt: str) -> tuple[float, ...]:
    """Seconds of the whole fit (wall, CPU), of them in the epoch's validation pass (wall, CPU) and in its
    checkpoint writes (wall, CPU), and the steady steps' wall seconds."""
    from shardline.trainer.loop import Callbacks, FitOptions, fit

    shutil.rmtree(ckpt, ignore_errors=True)
    VALIDATION[:], SAVING[:] = [0.0, 0.0], [0.0, 0.0]
    steady = Steady(cfg.max_steps_per_epoch)
    clock = Clock()
    fit(
        train,
        val,
        spec,
        cfg,
        "classification",
        ckpt,
        callbacks=Callbacks(log=lambda m: None, after_step=steady),
        options=FitOptions(resume=False),
    )
    return (*clock.read(), *VALIDATION, *SAVING, steady.seconds())


def hand_run(tokens: torch.Tensor, spec, cfg, compile_model: bool = False) -> tuple[float, ...]:
    """nanoGPT's minimal loop on the same model: random windows of the token array, AdamW, clipping (on a GPU:
    the token array on it, the same autocast precision, AdamW fused as the trainer's)."""
    from shardline.trainer.device import autocast, pick_device, pick_precision
    from shardline.trainer.models import model_from_spec

    device = pick_device(cfg.device)
    ctx = autocast(device, pick_precision(cfg.precision, device))
    torch.manual_seed(cfg.seed)
    clock = Clock()
    model = model_from_spec(spec).to(device).train()
    step = torch.compile(model.logits) if compile_model else model.logits
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, fused=device.type == "cuda")
    k, b = spec["data"]["window"], cfg.batch_size
    tokens = tokens.to(device)
    gen = torch.Generator().manual_seed(cfg.seed)
    steady = Steady(cfg.max_steps_per_epoch)
    for i in range(cfg.max_steps_per_epoch):
        start = torch.randint(len(tokens) - k - 1, (b,), generator=gen)
        rows = (start[:, None] + torch.arange(k)).to(device, non_blocking=True)
        x, y = tokens[rows], tokens[rows + 1]
        with ctx:
            logits = step(x)
        loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        steady(i + 1)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (*clock.read(), 0.0, 0.0, 0.0, 0.0, steady.seconds())


# dense bf16 peak FLOP/s of known GPUs (the vendors' figures without sparsity), for MFU
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "L40S": 362e12, "L4": 121e12, "A10": 125e12}


def peak_flops(device: str) -> tuple[str, float | None]:
    if device != "cuda":
        return "cpu", None
    name = torch.cuda.get_device_name()
    return name, next((v for k, v in PEAK_BF16.items() if k in name), None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sequences", type=int, default=200)
    ap.add_argument("--length", type=int, default=1000, help="tokens per sequence")
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--window", type=int, default=64, help="K, the context length")
    ap.add_argument("--d-model", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--steps", type=int, default=60, help="optimizer steps per timed run")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", action="store_true", help="also time training.compile: true (and the hand loop's)")
    ap.add_argument("--graphs", action="store_true", help="also time training.cuda_graphs: true (GPU)")
    ap.add_argument("--device", default="cpu", help="training.device: cpu, cuda, auto")
    ap.add_argument("--precision", default="fp32", help="training.precision: fp32, bf16, fp16, auto")
    ap.add_argument("--quick", action="store_true", help="a smoke run: tiny corpus and model, few steps")
    args = ap.parse_args()
    if args.quick:
        args.sequences, args.length, args.d_model, args.layers, args.steps = 40, 300, 64, 2, STEADY_FROM + 4

    import shardline.trainer.loop as loop
    import shardline.trainer.saver as saver
    from shardline.core.manifest import Manifest
    from shardline.tasks.encode import encode_dataset
    from shardline.tasks.ingest import snapshot_source
    from shardline.trainer.data import open_split
    from shardline.trainer.device import pick_device
    from shardline.trainer.models import model_from_spec, model_spec_for
    from shardline.trainer.serving import data_spec

    loop.evaluate = timed(loop.evaluate, VALIDATION)  # fit validates through this name: its passes are timed apart
    saver.save_checkpoint = timed(saver.save_checkpoint, SAVING)  # and its checkpoints through this one
    torch.set_num_threads(args.threads)
    work = Path(tempfile.mkdtemp(prefix="shardline-gpt-bench-"))
    try:
        write_corpus(work / "raw", args.sequences, args.length, args.vocab)
        cfg = config(str(work / "raw"), str(work / "store"), args)
        t = time.perf_counter()
        uri = encode_dataset(snapshot_source(cfg.data), cfg.data, str(work / "data"), threads=args.threads)
        log(f"encoded {args.sequences * args.length:,} tokens in {time.perf_counter() - t:.1f} s")
        manifest = Manifest.model_validate_json(Path(uri).read_text())
        spec = model_spec_for(cfg.model, data_spec(manifest.encoding))
        train, val = open_split(manifest, uri, "train"), open_split(manifest, uri, "validation")
        # the hand loop's token array: the train split's ids (the very tokens the trainer's windows slice)
        tokens = torch.from_numpy(
            np.concatenate(train.each_shard(lambda v, s: np.array(v.arrays["cat"][:, 0]))).astype(np.int64)
        )
        params = sum(p.numel() for p in model_from_spec(spec).parameters())
        per_run = args.steps * args.batch * args.window
        # (wall, CPU seconds, of which validation: wall, CPU, of which checkpoints: wall, CPU): the hand loop
        # validates and saves nothing
        runs: dict[str, list[tuple[float, ...]]] = {"hand loop": [], "shardline fit (eager)": []}
        if args.compile:
            runs.update({"hand loop, compiled": [], "shardline fit, compile: true": []})
        if args.graphs:
            runs["shardline fit, cuda_graphs: true (captured)"] = []
        # the eager rows say so: training.cuda_graphs' default (null) captures the step on a GPU
        eager_cfg = cfg.training.model_copy(update={"cuda_graphs": False})
        compiled_cfg = cfg.training.model_copy(update={"compile": True, "cuda_graphs": False})
        graphs_cfg = cfg.training.model_copy(update={"cuda_graphs": True})
        warm = eager_cfg.model_copy(update={"max_steps_per_epoch": 2})
        hand_run(tokens, spec, warm)  # first calls (lazy imports, kernel set-up) out of the timed runs
        shardline_run(train, val, spec, warm, str(work / "ck"))
        for r in range(args.repeat):
            runs["hand loop"].append(hand_run(tokens, spec, cfg.training))
            runs["shardline fit (eager)"].append(shardline_run(train, val, spec, eager_cfg, str(work / "ck")))
            if args.compile:
                runs["hand loop, compiled"].append(hand_run(tokens, spec, cfg.training, compile_model=True))
                runs["shardline fit, compile: true"].append(
                    shardline_run(train, val, spec, compiled_cfg, str(work / "ck"))
                )
            if args.graphs:
                runs["shardline fit, cuda_graphs: true (captured)"].append(
                    shardline_run(train, val, spec, graphs_cfg, str(work / "ck"))
                )
            log(
                f"round {r + 1}/{args.repeat}: "
                + ", ".join(f"{k} {v[-1][0]:.2f} s ({v[-1][1]:.2f} CPU s)" for k, v in runs.items())
            )
        load = os.getloadavg()[0]
        gpu, peak = peak_flops(pick_device(args.device).type)
        # training FLOPs per token: 6 per parameter (forward and backward) + attention's scores and mixing
        flops_per_token = 6 * params + 12 * args.layers * args.d_model * args.window
        print(
            f"\ngpt {params / 1e6:.2f}M parameters (d_model {args.d_model}, {args.layers} layers, {args.heads} heads, "
            f"vocab {manifest.encoding.cat_cardinalities[0]}), K={args.window}, batch {args.batch}, {args.steps} steps "
            f"({per_run:,} tokens) a run, {args.threads} threads, torch {torch.__version__}, best of {args.repeat}, "
            f"load average {load:.1f} on {os.cpu_count()} CPUs, on {gpu} ({args.precision})\n"
        )
        print(
            f"validation split: {val.n_windows:,} windows of {args.window} tokens (every start: each token is in K "
            "windows), evaluated once at the epoch's end\n"
        )
        steady_tokens = (args.steps - STEADY_FROM) * args.batch * args.window
        print(
            "| loop | wall s | of which validation | of which checkpoint | training tokens/s (wall) "
            "| vs hand loop (wall) | training CPU s | training tokens/CPU-s | vs hand loop (CPU) | MFU "
            f"| steady tokens/s (steps {STEADY_FROM + 1}-{args.steps}) | vs hand loop (steady) |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        base_wall = min(t[0] - t[2] - t[4] for t in runs["hand loop"])
        base_cpu = min(t[1] - t[3] - t[5] for t in runs["hand loop"])
        base_steady = min(t[6] for t in runs["hand loop"])
        for name, times in runs.items():
            wall, _, val_wall, _, save_wall, _, _ = min(times, key=lambda t: t[0] - t[2] - t[4])
            cpu = min(t[1] - t[3] - t[5] for t in times)
            steady = min(t[6] for t in times)
            train_wall = wall - val_wall - save_wall
            print(
                f"| {name} | {wall:.2f} | {val_wall:.2f} | {save_wall:.2f} | {per_run / train_wall:,.0f} "
                f"| {base_wall / train_wall:.2f}x | {cpu:.2f} | {per_run / cpu:,.0f} | {base_cpu / cpu:.2f}x | "
                f"{f'{100 * flops_per_token * per_run / train_wall / peak:.1f} %' if peak else '-'} "
                + (f"| {steady_tokens / steady:,.0f} | {base_steady / steady:.2f}x |" if steady > 0 else "| - | - |")
            )
        print(generation_table(spec, args.window, pick_device(args.device).type))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def generation_table(spec: dict, window: int, device: str = "cpu") -> str:
    """Greedy generation of the last half of the context from a prompt of its first half, with the key/value
    cache and by recomputing the context for every token (`use_cache=False`): the same tokens, timed."""
    from shardline.trainer.generate import generate
    from shardline.trainer.models import model_from_spec

    torch.manual_seed(0)
    model = model_from_spec(spec).to(device).eval()
    prompt, new = list(range(1, window // 2 + 1)), window // 2
    rows, outs = [], {}
    for cache in (True, False):
        generate(model, prompt, 2, temperature=0, use_cache=cache)  # warm
        best = math.inf
        for _ in range(3):
            t = time.perf_counter()
            outs[cache] = generate(model, prompt, new, temperature=0, use_cache=cache)
            best = min(best, time.perf_counter() - t)
        rows.append((cache, best))
    same = "the same tokens" if outs[True] == outs[False] else "DIFFERENT tokens"
    lines = [
        f"\ngeneration: a {len(prompt)}-token prompt, {new} new tokens, greedy, best of 3 ({same})\n",
        "| generation | seconds | tokens/s | vs recomputing |",
        "|---|---:|---:|---:|",
    ]
    base = rows[1][1]
    for cache, secs in rows:
        name = "key/value cache" if cache else "recomputing the context"
        lines.append(f"| {name} | {secs:.3f} | {new / secs:,.0f} | {base / secs:.2f}x |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
