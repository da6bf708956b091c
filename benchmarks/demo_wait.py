"""Where the demo's input wait goes (issue #47): one `shardline demo`, run in this process, with its fetches timed.

    python benchmarks/demo_wait.py [shardline demo's arguments: --home DIR --games N --set training.device=cuda ...]

The training loop counts a step's fetch as waiting for data: from before it asks the loader for the step's batches
to after it holds them (`data_wait_fraction`, of step time: the fetch, the step and its saver's poll, not the
callbacks and checks between steps). On the CPU the loader's `next()` is nearly all of the fetch. On an H200
(2026-12-04) the loader's `next()` held 0.09 s of the demo's 2,547 steps, a quarter of the wait the loop's fractions
give if its step time is the epoch's training time. This prints, per epoch, the epoch's training time (its wall
time less validation), the loop's step time, its count of the wait and the count's parts:
  - next():   the loader's own work and the hand-over from its threads (waiting for data);
  - list:     the step's list built around it (`list(islice(...))`: the generators resumed);
  - the rest: the loader's offset read, and what else the fetch holds;
and, apart, the step's batches let go right after its step (in the loop they go at the next fetch, inside its
count: on a GPU a page-locked chunk goes back to torch's host allocator with its last batch): with them out of the
fetch, the loop's count here is what it would be if they went after the step;
and the cycle collector's collections during the fit (a full one holds the GIL that the loader's threads need).
Nothing in shardline changes: its loader class, the loop's `list` and `Pace`, and `Step.__call__` are wrapped in this
process only.
"""

from __future__ import annotations

import atexit
import gc
import itertools
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

from gpu_train import TimedLoader  # noqa: E402  (its loader, timing each batch's next())

from shardline.trainer import loop  # noqa: E402
from shardline.trainer.state import Pace  # noqa: E402
from shardline.trainer.step import Step  # noqa: E402

paces: list[Pace] = []  # every Pace the loop made, in order
epochs: dict[int, dict] = defaultdict(lambda: defaultdict(float))  # epoch -> its Pace, seconds by part, batches let go
collections: list[tuple[float, int, float]] = []  # (seconds into the fit, generation, seconds)
now = {"epoch": None, "fit_at": None, "gc_at": 0.0}


class CountedPace(Pace):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        paces.append(self)


class EpochLoader(TimedLoader):
    """gpu_train.py's loader, each batch's `next()` timed per epoch, with the epoch's own Pace noted."""

    def __iter__(self):
        if self.shuffle:  # the training split's epoch: the Pace made just before is the epoch's own
            now["epoch"] = self.epoch
            epochs[self.epoch]["pace"] = paces[-1] if paces else None
        return super().__iter__()


def timed_step(self, micro: list, n_step: int, number: int):
    """The step, then its batches let go here, timed (in the loop they go at the next fetch, inside its count)."""
    out = step_call(self, micro, n_step, number)
    if now["epoch"] is not None:
        e, held, t = epochs[now["epoch"]], len(micro), time.perf_counter()
        micro.clear()
        e["release"] += time.perf_counter() - t
        e["let_go"] += held - len(micro)
    return out


def timed_list(x=(), /):
    if not isinstance(x, itertools.islice) or now["epoch"] is None:
        return list(x)
    t = time.perf_counter()
    out = list(x)
    epochs[now["epoch"]]["list"] += time.perf_counter() - t
    return out


def on_gc(phase: str, info: dict) -> None:
    if now["fit_at"] is None:
        return
    if phase == "start":
        now["gc_at"] = time.perf_counter()
    elif info["generation"] == 2 or time.perf_counter() - now["gc_at"] > 0.005:
        collections.append((now["gc_at"] - now["fit_at"], info["generation"], time.perf_counter() - now["gc_at"]))


fit = loop.fit
step_call = Step.__call__


def timed_fit(*a, **k):
    now["fit_at"] = time.perf_counter()
    try:
        result = fit(*a, **k)
        now["history"] = result.history
        return result
    finally:
        now["fit_at"], now["epoch"] = None, None


def report() -> str:
    """The table of the fits timed so far, and the cycle collector's collections in them."""
    lines = [
        "| epoch | batches | training s | step s | the loop's data wait | next() | list | the rest "
        "| the step's batches let go (after the step, outside the wait) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    trained = {h["epoch"]: h["seconds"] - h["val_seconds"] for h in now.get("history") or []}
    for epoch, e in sorted(epochs.items()):
        pace = e.get("pace")
        if pace is None or not pace.step_s:
            continue
        in_next, batches = TimedLoader.by_epoch.get(epoch, (0.0, 0))
        listed = e["list"] - in_next  # list() holds next(): its own part is what is left
        rest = pace.wait_s - e["list"]
        cells = [pace.wait_s, in_next, listed, rest, e["release"]]
        lines.append(
            f"| {epoch + 1} | {batches:,} | {trained.get(epoch, float('nan')):.3f} | {pace.step_s:.3f} | "
            + " | ".join(f"{s * 1e3:.1f} ms ({s / pace.step_s:.1%})" for s in cells)
            + " |"
        )
    full = [c for c in collections if c[1] == 2]
    lines.append(
        f"\ncycle collections in the fit: {len(full)} full"
        + "".join(f", {s * 1e3:.0f} ms at {at:.2f} s" for at, _, s in full)
        + f"; {len(collections) - len(full)} younger ones over 5 ms"
        + f"; {len(gc.get_objects()):,} objects tracked at exit"
    )
    return "\n".join(lines)


def wrapped() -> list[tuple[object, str, object]]:
    """(owner, name, replacement): each of shardline's names this wraps. The pipeline's one-process training
    imports `fit` from the loop when it trains, so it gets the wrapped one."""
    return [
        (loop, "Pace", CountedPace),
        (loop, "WindowLoader", EpochLoader),
        (loop, "fit", timed_fit),
        (loop, "list", timed_list),  # a module global: found before the builtin
        (Step, "__call__", timed_step),
    ]


if __name__ == "__main__":
    for owner, name, replacement in wrapped():
        setattr(owner, name, replacement)
    gc.callbacks.append(on_gc)
    atexit.register(lambda: print("\n" + report()))
    sys.argv = ["shardline", "demo", *sys.argv[1:]]
    from shardline.app.cli import main

    main()
