"""Windows over shards: a zero-copy view of a split, vectorised batch gathering, and a resumable loader.

A window is K consecutive rows [s, s+K) of one sequence segment; its target is the row
s + K - 1 + horizon. Windows are numbered across the split's shards in order (shard 0's windows
first), and that numbering is the "window order" every output of this package uses.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shardline.manifest import Manifest
from shardline.shards import read_arrays, window_starts
from shardline.storage import fetch_verified, join

LOADER_STATE_VERSION = 1
ARRAYS = ("cont", "cat", "target", "order", "offsets")


@dataclass(frozen=True)
class Batch:
    cont: torch.Tensor  # float32 [B, K, n_cont]
    cat: torch.Tensor  # int64 [B, K, n_cat]
    target: torch.Tensor  # int64 [B] (classification) or float32 [B] (regression)

    def __len__(self) -> int:
        return self.target.shape[0]

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        return Batch(*(t.to(device, non_blocking=non_blocking) for t in (self.cont, self.cat, self.target)))

    def pin_memory(self) -> Batch:
        return Batch(self.cont.pin_memory(), self.cat.pin_memory(), self.target.pin_memory())


class SplitData:
    """The windows of one split, over its shards' (memory-mapped) arrays, without copying them."""

    def __init__(self, shards: list[dict[str, np.ndarray]], window: int, horizon: int):
        if window < 1 or horizon < 0:
            raise ValueError(f"window must be >= 1 and horizon >= 0, got window={window}, horizon={horizon}")
        for i, arrays in enumerate(shards):
            missing = [a for a in ("cont", "cat", "target", "offsets") if a not in arrays]
            if missing:
                raise ValueError(f"shard {i} lacks the array(s) {missing}; a shard holds {list(ARRAYS)}")
        self.shards = shards
        self.window = window
        self.horizon = horizon
        self.starts = [window_starts(a["offsets"], window, horizon) for a in shards]
        counts = np.array([len(s) for s in self.starts], dtype=np.int64)
        self._first = np.concatenate([[0], np.cumsum(counts)])  # window number of each shard's first window
        self.n_windows = int(self._first[-1])
        first = shards[0] if shards else None
        self.n_cont = int(first["cont"].shape[1]) if first is not None else 0
        self.n_cat = int(first["cat"].shape[1]) if first is not None else 0
        target_kind = np.dtype(first["target"].dtype).kind if first is not None else "i"
        self.task = "regression" if target_kind == "f" else "classification"
        for i, a in enumerate(shards):
            if a["cont"].shape[1] != self.n_cont or a["cat"].shape[1] != self.n_cat:
                raise ValueError(
                    f"shard {i} has {a['cont'].shape[1]} continuous / {a['cat'].shape[1]} categorical columns, "
                    f"shard 0 has {self.n_cont} / {self.n_cat}: the shards of a split must share one encoding"
                )

    def __len__(self) -> int:
        return self.n_windows

    def __repr__(self) -> str:
        return (
            f"SplitData(shards={len(self.shards)}, windows={self.n_windows}, window={self.window}, "
            f"horizon={self.horizon}, n_cont={self.n_cont}, n_cat={self.n_cat}, task={self.task})"
        )

    def locate(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Window numbers -> (shard index, window start row in that shard)."""
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.n_windows):
            raise IndexError(f"window index out of range [0, {self.n_windows})")
        shard = np.searchsorted(self._first, idx, side="right") - 1
        start = np.empty(idx.shape, dtype=np.int64)
        for s in np.unique(shard):
            sel = shard == s
            start[sel] = self.starts[s][idx[sel] - self._first[s]]
        return shard, start

    def batch(self, idx: np.ndarray) -> Batch:
        """Gather windows `idx` (in that order): one fancy index per array per shard touched."""
        idx = np.asarray(idx, dtype=np.int64)
        shard, start = self.locate(idx)
        k = self.window
        b = len(idx)
        cont = np.empty((b, k, self.n_cont), dtype=np.float32)
        cat = np.empty((b, k, self.n_cat), dtype=np.int64)
        target = np.empty(b, dtype=np.float32 if self.task == "regression" else np.int64)
        steps = np.arange(k, dtype=np.int64)
        for s in np.unique(shard):
            sel = np.nonzero(shard == s)[0]
            rows = start[sel, None] + steps  # [b_s, K]
            arrays = self.shards[s]
            cont[sel] = arrays["cont"][rows]
            cat[sel] = arrays["cat"][rows]
            target[sel] = arrays["target"][rows[:, -1] + self.horizon]
        return Batch(torch.from_numpy(cont), torch.from_numpy(cat), torch.from_numpy(target))

    def target_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """(shard index, target row in that shard) of every window, in window order."""
        shard = np.repeat(np.arange(len(self.shards), dtype=np.int64), np.diff(self._first))
        row = np.concatenate([st + self.window - 1 + self.horizon for st in self.starts]) if self.shards else np.zeros(0, np.int64)
        return shard, row.astype(np.int64)

    def window_keys(self) -> dict[str, np.ndarray]:
        """Per window, in window order: its shard, the segment (sequence) of its target row in that shard,
        the target row, and that row's `order` value (-1 when the shard has no `order` array)."""
        shard, row = self.target_rows()
        segment = np.empty_like(row)
        order = np.full_like(row, -1)
        for s, arrays in enumerate(self.shards):
            sel = slice(self._first[s], self._first[s + 1])
            segment[sel] = np.searchsorted(np.asarray(arrays["offsets"]), row[sel], side="right") - 1
            if "order" in arrays:
                order[sel] = np.asarray(arrays["order"])[row[sel]]
        return {"shard": shard, "segment": segment, "row": row, "order": order}

    def targets(self) -> np.ndarray:
        """The target of every window, in window order (class ids or standardised values)."""
        shard, row = self.target_rows()
        dtype = np.float32 if self.task == "regression" else np.int64
        out = np.empty(len(row), dtype=dtype)
        for s, arrays in enumerate(self.shards):
            sel = slice(self._first[s], self._first[s + 1])
            out[sel] = arrays["target"][row[sel]]
        return out


def manifest_folder(manifest_uri: str) -> str:
    """The folder a manifest's relative shard paths are resolved against."""
    uri = manifest_uri.rstrip("/")
    return uri.rsplit("/", 1)[0] if "/" in uri else "."


def open_split(manifest: Manifest, manifest_uri: str, split: str, mmap: bool = True) -> SplitData:
    """The windows of `split`: each shard fetched (checked against its sha256 when remote) and mapped."""
    shards = manifest.shards_of(split)
    folder = manifest_folder(manifest_uri)
    enc = manifest.encoding
    arrays = []
    for info in shards:
        local = fetch_verified(join(folder, info.path), info.sha256)
        arrays.append(read_arrays(local, info.arrays, mmap=mmap))
    data = SplitData(arrays, enc.window, enc.horizon)
    for info, starts in zip(shards, data.starts):
        if len(starts) != info.windows:
            raise ValueError(
                f"shard {info.path}: the manifest lists {info.windows} windows but its offsets give {len(starts)} "
                f"(window={enc.window}, horizon={enc.horizon}); the manifest and shard disagree: re-run the encode step"
            )
    return data


class WindowLoader:
    """Batches of one epoch, in an order that is a pure function of (seed, epoch); resumable mid-epoch.

    Its position is a few integers (`state_dict`): the epoch and how many windows of it were already
    yielded, so a restored loader yields exactly the batches the interrupted one had not.
    `set_epoch(e)` starts epoch e from its beginning; iterating continues from the current position.
    """

    def __init__(
        self,
        data: SplitData,
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = False,
        pin_memory: bool = False,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.data = data
        self.batch_size = batch_size
        self.seed = int(seed)
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.epoch = 0
        self.offset = 0

    @property
    def n_windows(self) -> int:
        return self.data.n_windows

    @property
    def end(self) -> int:
        """Windows yielded in a full epoch."""
        n = self.n_windows
        return n - n % self.batch_size if self.drop_last else n

    def __len__(self) -> int:
        """Batches in a full epoch."""
        return self.end // self.batch_size if self.drop_last else -(-self.n_windows // self.batch_size)

    def order(self, epoch: int) -> np.ndarray:
        if not self.shuffle:
            return np.arange(self.n_windows, dtype=np.int64)
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_windows)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        self.offset = 0

    def __iter__(self):
        order = self.order(self.epoch)
        while self.offset < self.end:
            idx = order[self.offset : self.offset + self.batch_size]
            self.offset += len(idx)  # counted when handed out: a checkpoint after this batch resumes past it
            batch = self.data.batch(idx)
            yield batch.pin_memory() if self.pin_memory else batch

    def state_dict(self) -> dict:
        return {
            "version": LOADER_STATE_VERSION,
            "epoch": self.epoch,
            "offset": self.offset,
            "seed": self.seed,
            "n_windows": self.n_windows,
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != LOADER_STATE_VERSION:
            raise ValueError(f"loader state version {state.get('version')!r} is not supported (expected {LOADER_STATE_VERSION})")
        if state["n_windows"] != self.n_windows:
            raise ValueError(
                f"loader state was saved over {state['n_windows']} windows but this split has {self.n_windows}: "
                "the data changed since the checkpoint; resume only on the same shards"
            )
        if state["seed"] != self.seed:
            raise ValueError(
                f"loader state was saved with seed {state['seed']} but this loader has seed {self.seed} "
                "(training.seed changed): the batch order would differ"
            )
        if not 0 <= state["offset"] <= self.n_windows:
            raise ValueError(f"loader state offset {state['offset']} is outside [0, {self.n_windows}]")
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])
