"""A batch of windows as tensors (`Batch`), and the arrays a shard's windows are read from (`Windows`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shardline.core.manifest import target_array

# 3: a global permutation, or shuffle blocks of `shuffle_shards` shards (in the state since; absent: a global one)
LOADER_STATE_VERSION = 3
ARRAYS = ("cont", "cat", "target", "order", "offsets")


def target_names(arrays) -> list[str]:
    """The target arrays a shard holds, in order: `target`, `target_1`, ... (none without a target)."""
    names = []
    while target_array(len(names)) in arrays:
        names.append(target_array(len(names)))
    return names


CHUNK_BYTES = 2 << 20  # the loader gathers about this many bytes of windows at a time
MAX_BATCHES_PER_GATHER = 16


def _cast(t: torch.Tensor, floating: bool) -> torch.Tensor:
    if floating:
        return t if t.dtype == torch.float32 else t.float()
    return t if t.dtype == torch.int64 else t.long()


# unsigned ids (text's uint16 / uint32 token columns) are widened on the host before they travel: torch's
# kernels for those types are few (a conversion on the device may not exist), a signed int32 is supported
_UNSIGNED = {torch.uint16: torch.int32, torch.uint32: torch.int64, torch.uint64: torch.int64}


def portable(t: torch.Tensor) -> torch.Tensor:
    """`t` in a type every device converts from: unsigned ids widened (on the host), anything else as it is."""
    wider = _UNSIGNED.get(t.dtype)
    return t if wider is None or t.device.type != "cpu" else t.to(wider)


@dataclass(frozen=True)
class Batch:
    """One batch as stored (narrow dtypes: float16/32 `cont`, int8/16/32 `cat`, each target's stored type),
    so the bytes moved to the device are the fewest; `to(device)` widens them there."""

    cont: torch.Tensor  # [B, K, n_cont]
    cat: torch.Tensor  # [B, K, n_cat]
    targets: tuple[torch.Tensor, ...] = ()  # per target: [B] (or [B, K], every position) ids or standardised values

    @property
    def target(self) -> torch.Tensor | None:
        """The first target (the only one, mostly)."""
        return self.targets[0] if self.targets else None

    def __len__(self) -> int:
        return self.cont.shape[0]

    def slice(self, lo: int, hi: int) -> Batch:
        return Batch(self.cont[lo:hi], self.cat[lo:hi], tuple(t[lo:hi] for t in self.targets))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """On `device`, as the model takes it: float32 features, int64 ids, int64 classes / float32 values."""
        host = torch.device(device).type == "cpu"
        cont, cat, *targets = (
            (t if host else portable(t)).to(device, non_blocking=non_blocking)
            for t in (self.cont, self.cat, *self.targets)
        )
        return Batch(_cast(cont, True), _cast(cat, False), tuple(_cast(t, t.is_floating_point()) for t in targets))

    @classmethod
    def empty(cls, shapes, dtypes, pin_memory: bool = False) -> Batch:
        """A batch to gather into: tensors of these shapes and stored types (cont, cat, *targets). Page-locked,
        for a GPU, in the types that travel (unsigned ids widened): the gather writes straight into the memory
        the copy to the device reads, one copy instead of a gather and a second copy to pin. Torch's caching
        host allocator hands the same page-locked blocks out again once their copies are done."""

        def one(shape, dtype):
            return torch.empty(shape, dtype=_UNSIGNED.get(dtype, dtype) if pin_memory else dtype, pin_memory=pin_memory)

        cont, cat, *targets = (one(s, d) for s, d in zip(shapes, dtypes))
        return cls(cont, cat, tuple(targets))

    def numpy(self) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, ...]]:
        """Views of the host tensors' memory (for a gather to write into)."""
        return self.cont.numpy(), self.cat.numpy(), tuple(t.numpy() for t in self.targets)


class Windows:
    """The K-row windows of a [rows, F] array. Window s is rows [s, s+K): one contiguous block of
    memory, so the array is also seen as a 1-D array of overlapping K-row records (a record starts
    at every row), and a batch of windows is one fancy index on it: one memcpy of K rows per window,
    exactly what gathering materialised windows costs, from K times fewer bytes."""

    def __init__(self, a: np.ndarray, k: int):
        a = np.ascontiguousarray(a)
        self.array, self.k, self.dtype = a, k, a.dtype
        self.width = int(a.shape[1])
        row = self.width * a.dtype.itemsize
        n = max(int(a.shape[0]) - k + 1, 0)
        self.records = None
        if row and n:
            self.records = np.ndarray((n,), dtype=np.dtype((np.void, k * row)), buffer=a, strides=(row,))

    def gather(self, start: np.ndarray, out: np.ndarray | None = None, rows: np.ndarray | None = None) -> np.ndarray:
        """[len(start), K, F] windows starting at rows `start`: a new, contiguous array, or written into `out`
        (contiguous, of this shape and type) from `rows`, each window's K row numbers end to end (`rows_of`).
        The starts are in range (the caller checked them)."""
        if out is None:
            if self.records is None:
                return np.zeros((len(start), self.k, self.width), dtype=self.dtype)
            return self.records[start].view(self.dtype).reshape(len(start), self.k, self.width)
        if self.records is None:
            out[...] = 0
        else:  # rows of the contiguous array (a take from the overlapping records would copy them all first);
            # mode="clip": numpy writes straight into `out` ("raise" gathers into a buffer, then copies)
            rows = rows_of(start, self.k) if rows is None else rows
            np.take(self.array, rows, axis=0, out=out.reshape(-1, self.width), mode="clip")
        return out


def rows_of(start: np.ndarray, k: int) -> np.ndarray:
    """The rows of the K-row windows starting at `start`, window after window."""
    return (np.asarray(start, dtype=np.int64)[:, None] + np.arange(k, dtype=np.int64)).ravel()
