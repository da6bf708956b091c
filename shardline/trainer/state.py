"""What a training run is at one optimizer step boundary: the loop's counters and history (`TrainState`), every
RNG, and how fast it goes (`Pace`). A checkpoint stores the first two; restoring them (with the model, the
optimizer and the loader position) continues the run to the bit."""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, field, fields

import numpy as np
import torch

from shardline.trainer.validate import is_better


@dataclass
class TrainState:
    """The loop's counters. `history` holds one entry per validated epoch; the rest is a checkpoint's "loop"."""

    step: int = 0  # optimizer steps taken in all
    epoch: int = 0  # 0-based
    epoch_step: int = 0  # optimizer steps taken in this epoch
    epoch_complete: bool = False
    train_loss_sum: float = 0.0  # this epoch's, over its windows
    train_windows: int = 0
    best_score: float | None = None
    best_epoch: int | None = None  # 1-based, as the logs count epochs
    best_checkpoint: str | None = None  # file names in the checkpoint folder
    last_checkpoint: str | None = None
    pruned_epoch: int | None = None  # 1-based: a sweep's pruner stopped the run after this epoch
    history: list[dict] = field(default_factory=list)

    def state_dict(self) -> dict:
        """The checkpoint's "loop" (every counter, as plain data); the history is stored beside it."""
        return {k: v for k, v in asdict(self).items() if k != "history"}

    def load_state_dict(self, loop: dict, history: list[dict]) -> None:
        names = {f.name for f in fields(self)} - {"history"}
        for k, v in loop.items():
            if k in names:
                setattr(self, k, v)
        self.history = list(history)

    def start_epoch(self, epoch: int) -> None:
        self.epoch, self.epoch_step, self.epoch_complete = epoch, 0, False
        self.train_loss_sum, self.train_windows = 0.0, 0

    def mark(self, entry: dict, select_by: str, direction: str | None) -> bool:
        """Record an epoch's validation; whether it is the best so far by `select_by`."""
        self.history.append(entry)
        best = is_better(entry[select_by], self.best_score, direction)
        if best:
            self.best_score, self.best_epoch = entry[select_by], entry["epoch"] + 1
        return best


@dataclass
class Pace:
    """Windows trained, seconds spent in optimizer steps, and the part of those spent waiting for the next
    batch (in the loader's `next()`: gathering it, or waiting for its threads). On a GPU the step is not
    synchronised, so a single step's split means little; over many it is what the run spends."""

    windows: int = 0
    step_s: float = 0.0
    wait_s: float = 0.0

    def add(self, windows: int, step_s: float, wait_s: float) -> None:
        self.windows += windows
        self.step_s += step_s
        self.wait_s += wait_s

    @property
    def windows_per_s(self) -> float | None:
        return self.windows / self.step_s if self.step_s > 0 else None

    @property
    def wait_fraction(self) -> float | None:
        return self.wait_s / self.step_s if self.step_s > 0 else None


def rng_state() -> dict:
    """Every RNG as tensors and plain lists (loadable with weights_only=True)."""
    py = random.getstate()
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }
    if torch.backends.mps.is_available():
        state["mps"] = torch.mps.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    version, keys, gauss_next = state["python"]
    random.setstate((version, tuple(keys), gauss_next))
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if state.get("cuda") and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "mps" in state and torch.backends.mps.is_available():
        torch.mps.set_rng_state(state["mps"])


def seed_all(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def seed_rank(seed: int, rank: int, step: int) -> None:
    """RNGs of their own for rank `rank` > 0 (dropout masks differ between ranks, as between the rows of one
    process's batch), derived from the seed, the rank and the step they start at."""
    seed_all(int(np.random.SeedSequence([seed, rank, step]).generate_state(1)[0]))
