"""What the MLflow tracker costs a training step, with the tracking server up and with it down, in one run.

    .venv/bin/python benchmarks/tracker_bench.py [--steps 50] [--rounds 30] [--threads 1]

A small real training loop (an MLP, 512 -> 1024 -> 1024 -> 10, batch 256, AdamW, fp32 on the CPU) logs
`train/train_loss` and `train/lr` through `shardline.core.tracking.tracker.Tracker` at EVERY step (the pipeline
logs every 10th), into a real `mlflow server` on 127.0.0.1 ("up") or a closed port ("down": every
send is refused, the journal grows). Each round runs the three phases (a fresh tracker each, over
`--steps` steps; "no tracker" is the floor), the rounds going through every order of the three;
many short rounds, so that the load of a shared machine falls on every phase alike.

Printed: each phase's step time over all rounds (wall-clock: median, 10th percentile, mean; and the
training thread's CPU time) and the time of the `log_metrics` call itself, then the down/up ratios,
per round (their median and quartiles) and pooled; the target is within 1 %. On a shared machine
the wall-clock figures move with other jobs' load: compare the ratios with their quartiles.
The server runs at nice 19 and `--threads` (torch's CPU threads) is 1 by default, leaving the other
core to the server and the sender: the figure is the tracker's cost in the training process, not the
cost of a server sharing the machine (on a team it is another machine). Numbers are for the machine
it runs on.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from shardline.core.config import MlflowConfig  # noqa: E402
from shardline.core.tracking.tracker import Tracker  # noqa: E402
from tests.mlflow_server import MlflowServer, free_port  # noqa: E402


def train(steps: int, tracker: Tracker | None) -> tuple[list[float], list[float], list[float]]:
    """Per-step wall times, the training thread's CPU time per step, and the time of each `log_metrics` call."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 1024),
        torch.nn.ReLU(),
        torch.nn.Linear(1024, 10),
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x, y = torch.randn(256, 512), torch.randint(0, 10, (256,))
    step_s, cpu_s, log_s = [], [], []
    for step in range(steps):
        t0, c0 = time.perf_counter(), time.thread_time()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        value = loss.item()
        if tracker is not None:
            t1 = time.perf_counter()
            tracker.log_metrics({"train/train_loss": value, "train/lr": 1e-3}, step)
            log_s.append(time.perf_counter() - t1)
        step_s.append(time.perf_counter() - t0)
        cpu_s.append(time.thread_time() - c0)
    return step_s, cpu_s, log_s


def phase(mode: str, steps: int, uri: str, base: Path, n: int) -> tuple[list[float], list[float], list[float]]:
    if mode == "none":
        return train(steps, None)
    tracker = Tracker(
        MlflowConfig(tracking_uri=uri, experiment="tracker-bench"), str(base), run_dir=str(base / f"{mode}-{n}")
    )
    tracker.start(None, f"{mode}-{n}", {})
    out = train(steps, tracker)
    tracker.end("FINISHED", wait=30 if mode == "up" else 0)
    return out


def q(xs: list[float], p: float) -> float:
    return sorted(xs)[min(len(xs) - 1, int(p * len(xs)))]


# every order of the three, in turn: each phase follows each other one as often (what the server does
# just after an "up" phase lands on the next phase alike)
ORDERS = list(itertools.permutations(("none", "up", "down")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    logging.getLogger("shardline.core.tracking.tracker").setLevel(
        logging.ERROR
    )  # the "down" phase's warnings, by design
    os.environ["MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT"] = "true"

    base = Path(tempfile.mkdtemp(prefix="tracker-bench-"))
    # at nice 19: on a team the server is another machine; here its CPU work must not count as the tracker's
    server = MlflowServer(base / "server", nice=19)
    print(f"starting mlflow server ({server.uri}) ...", file=sys.stderr)
    server.start()
    uris = {"up": server.uri, "down": f"http://127.0.0.1:{free_port()}", "none": ""}
    times: dict[str, list[float]] = {m: [] for m in uris}
    cpu: dict[str, list[float]] = {m: [] for m in uris}
    logs: dict[str, list[float]] = {m: [] for m in uris}
    ratios: dict[str, list[float]] = {"median": [], "p10": [], "cpu": []}
    try:
        train(50, None)  # warm-up: allocator, kernels
        for r in range(args.rounds):
            got = {}
            for mode in ORDERS[r % len(ORDERS)]:
                time.sleep(0.2)  # what the previous phase left the server to do settles first
                step_s, cpu_s, log_s = phase(mode, args.steps, uris[mode], base, r)
                times[mode] += step_s
                cpu[mode] += cpu_s
                logs[mode] += log_s
                got[mode] = (statistics.median(step_s), q(step_s, 0.1), statistics.median(cpu_s))
            for i, name in enumerate(ratios):
                ratios[name].append(got["down"][i] / got["up"][i])
            print(
                f"round {r + 1}/{args.rounds}: median step none {got['none'][0] * 1e3:.2f} ms, up "
                f"{got['up'][0] * 1e3:.2f} ms, down {got['down'][0] * 1e3:.2f} ms",
                file=sys.stderr,
            )
    finally:
        server.stop()

    print(
        f"\ntracker cost per training step: {args.rounds} rounds x {args.steps} steps a phase, "
        f"log_metrics every step, torch threads {args.threads}\n"
    )
    print("| phase | median step | p10 step | mean step | training thread CPU a step | log_metrics median / p99 |")
    print("|---|---:|---:|---:|---:|---:|")
    names = {"none": "no tracker", "up": "server up", "down": "server down (refused)"}
    for mode in ("none", "up", "down"):
        t, lg = times[mode], logs[mode]
        calls = f"{statistics.median(lg) * 1e6:.0f} / {q(lg, 0.99) * 1e6:.0f} us" if lg else "-"
        print(
            f"| {names[mode]} | {statistics.median(t) * 1e3:.2f} ms | {q(t, 0.1) * 1e3:.2f} ms | "
            f"{statistics.fmean(t) * 1e3:.2f} ms | {statistics.median(cpu[mode]) * 1e3:.2f} ms | {calls} |"
        )
    print("\ndown / up, per round (median of the rounds, quartiles), and the same pooled over all steps:\n")
    print("| step time | down / up per round | quartiles | pooled | within 1 % |")
    print("|---|---:|---:|---:|---|")
    pooled = {
        "median": statistics.median(times["down"]) / statistics.median(times["up"]),
        "p10": q(times["down"], 0.1) / q(times["up"], 0.1),
        "cpu": statistics.median(cpu["down"]) / statistics.median(cpu["up"]),
    }
    labels = {
        "median": "wall, median",
        "p10": "wall, 10th percentile (least disturbed)",
        "cpu": "training thread CPU, median",
    }
    for name, xs in ratios.items():
        mid = statistics.median(xs)
        lo, _, hi = statistics.quantiles(xs, n=4) if len(xs) > 1 else (mid, mid, mid)
        print(
            f"| {labels[name]} | {mid:.3f} | {lo:.3f}-{hi:.3f} | {pooled[name]:.3f} | "
            f"{'yes' if abs(mid - 1) <= 0.01 else 'no'} |"
        )
    floor = statistics.median(times["up"]) / statistics.median(times["none"])
    share = {m: statistics.fmean(logs[m]) / statistics.fmean(times[m]) for m in ("up", "down")}
    print(
        f"\nserver up / no tracker, median step: {floor:.3f}. The log_metrics call, timed inside each step (the "
        f"training thread's whole share of the tracker): {share['up'] * 100:.2f} % of the step with the server up, "
        f"{share['down'] * 100:.2f} % with it down (logging every step; the pipeline logs every 10th)"
    )


if __name__ == "__main__":
    main()
