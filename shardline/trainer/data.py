"""Windows over shards: a zero-copy view of a split, vectorised batch gathering, and a resumable loader.

A window is K consecutive rows [s, s+K) of one sequence segment; its target is the row
s + K - 1 + horizon (`last`), or each row's, s + k + horizon for k < K (`all`: a slice of the stored
target, as the window is of the features). A split has any number of targets (`target`, `target_1`, ...;
none for a model with its own loss). Windows are numbered across the split's shards in order (shard 0's windows
first), and that numbering is the "window order" every output of this package uses.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shardline.core.codes import Globaliser
from shardline.core.manifest import Manifest, target_array
from shardline.core.shards import (
    MappedPages,
    arrays_in,
    map_file,
    pack_layout,
    read_arrays,
    resident_budget,
    window_starts,
)
from shardline.core.storage import (
    CACHE_CAP_ENV,
    ShardCache,
    gb_at_least,
    is_remote,
    local_path,
    read_verified,
    resolve,
    shared_cache,
)

# 3: a global permutation, or shuffle blocks of `shuffle_shards` shards (in the state since; absent: a global one)
LOADER_STATE_VERSION = 3
ARRAYS = ("cont", "cat", "target", "order", "offsets")
POSITIONS = ("last", "all")


def target_names(arrays) -> list[str]:
    """The target arrays a shard holds, in order: `target`, `target_1`, ... (none without a target)."""
    names = []
    while target_array(len(names)) in arrays:
        names.append(target_array(len(names)))
    return names


CHUNK_BYTES = 2 << 20  # the loader gathers about this many bytes of windows at a time
MAX_BATCHES_PER_GATHER = 16


def _tensor(arr: np.ndarray) -> torch.Tensor:
    """A torch view of a (possibly read-only, memory-mapped) array, without copying it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only mmap: we never write through the view
        return torch.from_numpy(np.asarray(arr))


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

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.cont, self.cat, *self.targets))

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

    def pin_memory(self) -> Batch:
        # pinned for a GPU: unsigned ids widened first, so that what is pinned is what travels
        return Batch(
            self.cont.pin_memory(),
            portable(self.cat).pin_memory(),
            tuple(portable(t).pin_memory() for t in self.targets),
        )


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

    def gather(self, start: np.ndarray) -> np.ndarray:
        """[len(start), K, F] windows starting at rows `start` (a new, contiguous array)."""
        if self.records is None:
            return np.zeros((len(start), self.k, self.width), dtype=self.dtype)
        return self.records[start].view(self.dtype).reshape(len(start), self.k, self.width)


class ShardView:
    """One shard's arrays (or a split pack's joined arrays), with its window start rows; window w
    is `cont.gather(starts[w:w+1])`, its target `target[starts[w] + shift]` (`last`), or the K targets
    from `target[starts[w] + horizon]` on (`all`)."""

    def __init__(
        self,
        arrays: dict[str, np.ndarray],
        window: int,
        horizon: int,
        name: str = "shard",
        starts: np.ndarray | None = None,
        positions: str = "last",
    ):
        missing = [a for a in ("cont", "cat") + (("offsets",) if starts is None else ()) if a not in arrays]
        if missing:
            raise ValueError(f"{name} lacks the array(s) {missing}; a shard holds {list(ARRAYS)}")
        if positions not in POSITIONS:
            raise ValueError(f"positions='{positions}' is not one of {list(POSITIONS)}")
        self.arrays = arrays
        self.name = name
        self.positions = positions
        self.starts = window_starts(arrays["offsets"], window, horizon) if starts is None else starts
        self.shift = window - 1 + horizon  # (last) target row = start + shift
        self.horizon = horizon
        self.cont = Windows(np.asarray(arrays["cont"]), window)
        self.cat = Windows(np.asarray(arrays["cat"]), window)
        self.names = target_names(arrays)
        self.targets = [np.asarray(arrays[n]) for n in self.names]
        # every position: a window's targets are K consecutive rows, `horizon` rows on (a slice, as its features)
        self._target_windows = (
            [Windows(t[horizon:].reshape(-1, 1), window) for t in self.targets] if positions == "all" else None
        )

    pages: MappedPages | None = None  # the mapping the arrays are views of, when its pages are bounded
    _spans: list[tuple[int, int, int]] = []

    def bound(self, pages: MappedPages) -> None:
        """Note every gather in `pages` (the mapping these arrays are views of), which keeps the pages
        this process holds mapped under its budget."""
        spans = []
        for w in (self.cont, self.cat):  # a window: K rows from its start row
            if w.array.nbytes:
                row = w.width * w.array.dtype.itemsize
                spans.append((pages.offset_of(w.array), row, w.k * row))
        for t in self.targets:
            if t.nbytes:
                item = t.dtype.itemsize * int(np.prod(t.shape[1:], dtype=np.int64))
                if self.positions == "all":  # K targets from `horizon` rows on
                    spans.append((pages.offset_of(t) + self.horizon * item, item, self.cont.k * item))
                else:  # one, `shift` rows on
                    spans.append((pages.offset_of(t) + self.shift * item, item, item))
        self._spans, self.pages = spans, pages

    def _note(self, start: np.ndarray) -> None:
        if self.pages is not None:
            self.pages.read([(base + start * row, length) for base, row, length in self._spans])

    def gather_targets(self, start: np.ndarray) -> tuple[np.ndarray, ...]:
        if self._target_windows is not None:
            return tuple(w.gather(start)[..., 0] for w in self._target_windows)
        return tuple(t[start + self.shift] for t in self.targets)

    def gather(self, start: np.ndarray) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, ...]]:
        out = self.cont.gather(start), self.cat.gather(start), self.gather_targets(start)
        self._note(start)
        return out

    def order_of_rows(self, rows: np.ndarray) -> np.ndarray:
        """The `order` value of shard rows (-1 when the shard has none)."""
        a = self.arrays
        if "order" in a:
            return np.asarray(a["order"])[rows]
        if "order_start" in a:  # consecutive order inside each segment: stored once per segment
            offsets = np.asarray(a["offsets"])
            seg = np.searchsorted(offsets, rows, side="right") - 1
            return np.asarray(a["order_start"])[seg] + (rows - offsets[seg])
        return np.full(len(rows), -1, dtype=np.int64)


class _Ref:
    """A shard of a split: open (arrays in hand) or to be fetched from storage through the cache."""

    def __init__(
        self, windows: int, view: ShardView | None = None, info=None, uri: str | None = None, cache=None, glob=None
    ):
        self.windows = windows
        self.view = view
        self.info = info
        self.uri = uri
        self.cache = cache
        self.pinned = False
        self.specs = (
            glob.specs(info) if glob is not None and info is not None else (info.arrays if info is not None else None)
        )
        self.derived = None  # a shard in its own codes is cached already mapped to the data set's encoding
        if glob is not None and info is not None and info.local is not None:
            from shardline.core.storage import Derived

            key = hashlib.sha256(
                json.dumps({"mapped": 1, "shard": info.sha256, "encoding": glob.spec.hash()}).encode()
            ).hexdigest()
            self.derived = Derived(key, glob.nbytes(info), lambda raw, info=info: glob.shard_bytes(raw, info))

    @property
    def name(self) -> str:
        """The shard's object in the cache."""
        return self.derived.key if self.derived is not None else self.info.sha256

    @property
    def footprint(self) -> int:
        """Bytes the shard takes in the local cache while open (0: in hand, or mapped where it lies)."""
        if self.cache is None:
            return 0
        if self.derived is not None:
            return int(self.derived.nbytes)
        if self.info.compression:
            return int(self.info.raw_bytes)
        return int(self.info.bytes) if is_remote(self.uri) else 0


def _unpin_all(refs: list[_Ref]) -> None:
    """A streamed split that is gone leaves nothing pinned in the cache."""
    for r in refs:
        if r.pinned:
            r.cache.unpin(r.name)
            r.pinned = False


class SplitData:
    """The windows of one split, over its shards' (memory-mapped) arrays, without copying them.

    Built from arrays in hand (`SplitData([arrays, ...], K, horizon)`) or, by `open_split`, from a
    manifest's shards; when the shards do not all fit in the local cache the split *streams*: a shard
    is fetched when first needed (the loader reads ahead) and released when the loader is past it, so
    the cache holds only the shards in flight and the read-ahead. Whatever looks at every shard
    (`each_shard`: checks, targets, window keys) visits them one at a time and releases each.
    """

    def __init__(self, shards: list[dict[str, np.ndarray]], window: int, horizon: int, positions: str = "last"):
        if window < 1 or horizon < 0:
            raise ValueError(f"window must be >= 1 and horizon >= 0, got window={window}, horizon={horizon}")
        refs = []
        for i, arrays in enumerate(shards):
            view = ShardView(arrays, window, horizon, name=f"shard {i}", positions=positions)
            refs.append(_Ref(len(view.starts), view))
        self._setup(refs, window, horizon, streaming=False, positions=positions)
        if len(refs) > 1:  # arrays in hand (small splits, tests): joined in memory
            names = ("cont", "cat", *target_names(shards[0]))
            joined = {n: np.concatenate([np.asarray(a[n]) for a in shards]) for n in names}
            self._join(joined, [int(np.asarray(a["cont"]).shape[0]) for a in shards])

    @classmethod
    def _from_refs(
        cls,
        refs: list[_Ref],
        window: int,
        horizon: int,
        streaming: bool,
        joined: dict | None = None,
        rows: list[int] | None = None,
        positions: str = "last",
    ) -> SplitData:
        self = cls.__new__(cls)
        self._setup(refs, window, horizon, streaming, positions)
        if joined is not None:
            self._join(joined, rows)
        return self

    def _setup(self, refs: list[_Ref], window: int, horizon: int, streaming: bool, positions: str = "last") -> None:
        import threading

        if window < 1 or horizon < 0:
            raise ValueError(f"window must be >= 1 and horizon >= 0, got window={window}, horizon={horizon}")
        self.window = window
        self.horizon = horizon
        self.positions = positions
        self.streaming = streaming
        self._refs = refs
        self._lock = threading.Lock()
        self._open: set[int] = set()  # streamed shards pinned in the cache (open or read ahead)
        self._on_open: list = []  # checks of each streamed shard as it is opened (`check_each`)
        self._pages: MappedPages | None = None  # a split pack's mapping, when its pages are bounded
        if streaming:
            weakref.finalize(self, _unpin_all, refs)
        self._joined: ShardView | None = (
            refs[0].view if len(refs) == 1 and refs[0].view is not None and not streaming else None
        )
        counts = np.array([r.windows for r in refs], dtype=np.int64)
        self._first = np.concatenate([[0], np.cumsum(counts)]).astype(
            np.int64
        )  # window number of each shard's first window
        self.n_windows = int(self._first[-1])
        self.n_shards = len(refs)
        as_torch = lambda d: torch.from_numpy(np.zeros(0, np.dtype(d))).dtype
        if refs:
            cont, cat, targets = self._meta(0)
            self.n_cont, self.n_cat = int(cont[1][1]), int(cat[1][1])
            self.cont_dtype, self.cat_dtype = as_torch(cont[0]), as_torch(cat[0])
            self.target_dtypes = [as_torch(t[0]) for t in targets]
            for i in range(1, len(refs)):
                c, k, t = self._meta(i)
                if c[1][1] != self.n_cont or k[1][1] != self.n_cat:
                    raise ValueError(
                        f"shard {i} has {c[1][1]} continuous / {k[1][1]} categorical columns, shard 0 has "
                        f"{self.n_cont} / {self.n_cat}: the shards of a split must share one encoding"
                    )
                if (c[0], k[0], [x[0] for x in t]) != (cont[0], cat[0], [x[0] for x in targets]):
                    raise ValueError(
                        f"shard {i} stores {c[0]}/{k[0]}/{[x[0] for x in t]}, shard 0 {cont[0]}/{cat[0]}/"
                        f"{[x[0] for x in targets]}: one encoding per split"
                    )
        else:
            self.n_cont = self.n_cat = 0
            self.cont_dtype, self.cat_dtype, self.target_dtypes = torch.float32, torch.int64, [torch.int64]
        self.n_targets = len(self.target_dtypes)
        # the kind of each target, as stored: class ids (integers) or standardised values (floats)
        self.tasks = ["regression" if d.is_floating_point else "classification" for d in self.target_dtypes]
        self.task = self.tasks[0] if self.tasks else None

    def _join(self, joined: dict[str, np.ndarray], rows: list[int]) -> None:
        """Every shard's cont/cat/target as one array each (the shards' rows end to end): window w
        starts at its shard's first row plus its start inside the shard, and any batch is one gather."""
        base = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64)
        starts = (
            np.concatenate([r.view.starts + b for r, b in zip(self._refs, base)])
            if self._refs
            else np.zeros(0, np.int64)
        )
        self._joined = ShardView(
            joined, self.window, self.horizon, name="split", starts=starts.astype(np.int64), positions=self.positions
        )

    def _meta(self, i: int) -> tuple:
        """(dtype, shape) of a shard's cont and cat arrays and the list of its targets', without opening a
        streamed shard."""
        r = self._refs[i]
        if r.view is not None:
            a = r.view.arrays
            meta = lambda n: (np.dtype(a[n].dtype).str, list(a[n].shape))
            return meta("cont"), meta("cat"), [meta(n) for n in target_names(a)]
        spec = r.specs
        missing = [a for a in ("cont", "cat", "offsets") if a not in spec]
        if missing:
            raise ValueError(f"shard {r.info.path} lacks the array(s) {missing}; a shard holds {list(ARRAYS)}")
        meta = lambda n: (
            np.dtype(spec[n].dtype).str,
            list(spec[n].shape) + ([0] if len(spec[n].shape) == 1 else []),
        )
        return meta("cont"), meta("cat"), [meta(n) for n in target_names(spec)]

    def __len__(self) -> int:
        return self.n_windows

    def __repr__(self) -> str:
        return (
            f"SplitData(shards={self.n_shards}, windows={self.n_windows}, window={self.window}, "
            f"horizon={self.horizon}, n_cont={self.n_cont}, n_cat={self.n_cat}, targets={self.tasks}, "
            f"positions={self.positions}{', streaming' if self.streaming else ''})"
        )

    # ------------------------------------------------------------ shards: open, read ahead, release

    def view(self, s: int) -> ShardView:
        """Shard `s`'s arrays (fetching a streamed shard through the cache if needed)."""
        r = self._refs[s]
        v = r.view
        if v is not None:
            return v
        with self._lock:
            if r.view is None:
                if not r.pinned:
                    r.cache.pin(r.name, r.footprint)
                    r.pinned = True
                    self._open.add(s)
                local = r.cache.get(r.uri, r.info.sha256, r.info.bytes, r.info.compression, r.info.raw_bytes, r.derived)
                v = ShardView(
                    read_arrays(local, r.specs),
                    self.window,
                    self.horizon,
                    name=f"shard {r.info.path}",
                    positions=self.positions,
                )
                if len(v.starts) != r.windows:
                    raise ValueError(
                        f"shard {r.info.path}: the manifest lists {r.windows} windows but its offsets give "
                        f"{len(v.starts)} (window={self.window}, horizon={self.horizon}); the manifest and shard "
                        "disagree: re-run the encode step (shardline run CONFIG --force encode)"
                    )
                for check in self._on_open:
                    check(v, s)
                r.view = v
            return r.view

    def prefetch(self, s: int) -> bool:
        """Start fetching streamed shard `s` in the background, if the cache has room for it beside what
        is pinned already (a read-ahead never takes the room of a shard in use); True when it is on its
        way or in hand, False when there was no room."""
        r = self._refs[s]
        if r.cache is None or r.view is not None:
            return True
        with self._lock:
            if not r.pinned:
                if not r.cache.pin_if_room(r.name, r.footprint):
                    return False
                r.pinned = True
                self._open.add(s)
        r.cache.prefetch(r.uri, r.info.sha256, r.info.bytes, r.info.compression, r.info.raw_bytes, r.derived)
        return True

    def release(self, keep: set[int] | frozenset[int] = frozenset()) -> None:
        """Streaming: drop every shard not in `keep`, so the cache may evict it."""
        if not self.streaming:
            return
        with self._lock:
            for i in self._open - set(keep):
                self._drop(i)

    def release_shard(self, s: int) -> None:
        """Streaming: drop shard `s`, so the cache may evict it."""
        if self.streaming:
            with self._lock:
                self._drop(s)

    def _drop(self, i: int) -> None:
        """Release streamed shard `i` (the caller holds the lock)."""
        r = self._refs[i]
        if r.cache is None:
            return
        r.view = None
        if r.pinned:
            r.cache.unpin(r.name)
            r.pinned = False
        self._open.discard(i)

    @property
    def open_shards(self) -> set[int]:
        """The streamed shards pinned in the cache now (open or read ahead)."""
        return set(self._open)

    @property
    def cache(self) -> ShardCache | None:
        """The local cache a streamed split goes through (None for a split in hand)."""
        return next((r.cache for r in self._refs if r.cache is not None), None)

    def cache_need(self, shuffle_shards: int | None = None, shuffle: bool = True) -> int:
        """Bytes of the local cache one pass over this split holds at once, read-ahead aside: none for a
        split in hand; streamed, its largest shuffle block (the `shuffle_shards` largest shards; every
        shard for a shuffle of the whole split), or its largest shard when read in order."""
        if not self.streaming:
            return 0
        sizes = sorted((r.footprint for r in self._refs), reverse=True)
        return sum(sizes[: (shuffle_shards or len(sizes)) if shuffle else 1])

    @property
    def shards(self) -> list[dict[str, np.ndarray]]:
        """Every shard's arrays (opens and keeps every streamed shard: for small splits and tests; code
        that must work on any split uses `each_shard`)."""
        return [self.view(i).arrays for i in range(self.n_shards)]

    @property
    def starts(self) -> list[np.ndarray]:
        """Every shard's window start rows (opens streamed shards)."""
        return [self.view(i).starts for i in range(self.n_shards)]

    def shard_of(self, idx: np.ndarray) -> np.ndarray:
        return np.searchsorted(self._first, idx, side="right") - 1

    # ------------------------------------------------------------ windows

    def locate(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Window numbers -> (shard index, window start row in that shard)."""
        idx = self._check(idx)
        shard = self.shard_of(idx)
        start = np.empty(idx.shape, dtype=np.int64)
        for s in np.unique(shard):
            sel = shard == s
            start[sel] = self.view(int(s)).starts[idx[sel] - self._first[s]]
        return shard, start

    def target_rows_of(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard index, target row in that shard) of the windows numbered `idx`, in that order (the row of the
        window's last position). It opens the streamed shards it needs: the caller releases them."""
        shard, start = self.locate(idx)
        return shard, start + (self.window - 1 + self.horizon)

    def _check(self, idx) -> np.ndarray:
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.n_windows):
            raise IndexError(f"window index out of range [0, {self.n_windows})")
        return idx

    def batch(self, idx: np.ndarray, pin_memory: bool = False, release=()) -> Batch:
        """Gather windows `idx` (in that order): one fancy index per array, a K-row block copy per window.

        A split in hand is one set of arrays (one shard, or its shards joined in a split pack), so a
        batch is one gather whichever shards it draws from; a streamed split gathers per shard. The
        streamed shards in `release` (none of their windows comes after these) are gathered first and
        each released at once, so a gather across two shuffle blocks holds one block at a time.
        """
        idx = self._check(idx)
        b, k = len(idx), self.window
        if b == 0:
            shape = (0, k) if self.positions == "all" else (0,)
            return Batch(
                torch.empty((0, k, self.n_cont), dtype=self.cont_dtype),
                torch.empty((0, k, self.n_cat), dtype=self.cat_dtype),
                tuple(torch.empty(shape, dtype=d) for d in self.target_dtypes),
            )
        # numpy fancy indexing: single-threaded and outside the GIL; torch's index_select spreads a
        # small gather over OpenMP threads, which stalls ~10x when the cores are busy training
        j = self._joined
        if j is not None:
            arrays = j.gather(j.starts[idx])
        else:
            shard = self.shard_of(idx)
            first = int(shard[0])
            done = {int(s) for s in release}
            if (shard == first).all():
                v = self.view(first)
                arrays = v.gather(v.starts[idx - self._first[first]])
                if first in done:
                    self.release_shard(first)
            else:
                meta = self._meta(0)
                tshape = (b, k) if self.positions == "all" else (b,)
                arrays = (
                    np.empty((b, k, self.n_cont), dtype=np.dtype(meta[0][0])),
                    np.empty((b, k, self.n_cat), dtype=np.dtype(meta[1][0])),
                    tuple(np.empty(tshape, dtype=np.dtype(t[0])) for t in meta[2]),
                )
                for s in sorted(np.unique(shard).tolist(), key=lambda s: s not in done):  # passed ones first
                    sel = np.flatnonzero(shard == s)
                    v = self.view(s)
                    cont, cat, targets = v.gather(v.starts[idx[sel] - self._first[s]])
                    arrays[0][sel], arrays[1][sel] = cont, cat
                    for out, part in zip(arrays[2], targets):
                        out[sel] = part
                    del v
                    if s in done:
                        self.release_shard(s)
        cont, cat, targets = arrays
        out = Batch(torch.from_numpy(cont), torch.from_numpy(cat), tuple(torch.from_numpy(t) for t in targets))
        return out.pin_memory() if pin_memory else out

    def check_each(self, check) -> None:
        """Run `check(view, shard index)` on every shard: now on a split in hand; as each shard is opened
        (every time) on a streamed one, so a check costs no pass of its own over a split that streams
        (on an object store: another download of the data set before the first step)."""
        if self.streaming:
            self._on_open.append(check)
            with self._lock:
                opened = [(i, r.view) for i, r in enumerate(self._refs) if r.view is not None]
            for i, v in opened:  # those opened already
                check(v, i)
        else:
            self.each_shard(check)

    def each_shard(self, fn) -> list:
        """[fn(view, shard index) for every shard, in order], one shard at a time: a streamed shard is
        released before the next is opened (which is read ahead meanwhile when the cache has room), so a
        pass over a split many times the cache holds one or two of its shards."""
        out = []
        held = self.open_shards  # a loader's, if one is under way: left as they are
        try:
            for s in range(self.n_shards):
                v = self.view(s)
                if s + 1 < self.n_shards:
                    self.prefetch(s + 1)
                out.append(fn(v, s))
                del v
                if s not in held:
                    self.release_shard(s)
                if self._pages is not None:  # a pass over whole arrays: what it read leaves the process
                    self._pages.drop()
        finally:
            self.release(held)
        return out

    def target_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """(shard index, target row in that shard) of every window, in window order."""
        shard = np.repeat(np.arange(self.n_shards, dtype=np.int64), np.diff(self._first))
        rows = self.each_shard(lambda v, s: v.starts + v.shift)
        return shard, (np.concatenate(rows) if rows else np.zeros(0, np.int64)).astype(np.int64)

    def window_keys(self) -> dict[str, np.ndarray]:
        """Per window, in window order: its shard, the segment (sequence) of its target row in that shard,
        the target row, and that row's `order` value (-1 when the shard has no order)."""

        def keys(v: ShardView, s: int):
            row = v.starts + v.shift
            segment = np.searchsorted(np.asarray(v.arrays["offsets"]), row, side="right") - 1
            return row, segment, v.order_of_rows(row)

        parts = self.each_shard(keys)
        shard = np.repeat(np.arange(self.n_shards, dtype=np.int64), np.diff(self._first))
        cat = lambda i: np.concatenate([p[i] for p in parts]).astype(np.int64) if parts else np.zeros(0, np.int64)
        return {"shard": shard, "segment": cat(1), "row": cat(0), "order": cat(2)}

    def targets(self, i: int = 0) -> np.ndarray:
        """Target `i` of every window, in window order (class ids or standardised values): [N], or [N, K]
        when every position is predicted."""
        if i >= self.n_targets:
            raise IndexError(f"target {i}: this split has {self.n_targets} target(s)")
        dtype = np.float32 if self.tasks[i] == "regression" else np.int64
        parts = self.each_shard(lambda v, s: v.gather_targets(v.starts)[i].astype(dtype))
        shape = (0, self.window) if self.positions == "all" else (0,)
        return np.concatenate(parts) if parts else np.zeros(shape, dtype)


def manifest_folder(manifest_uri: str) -> str:
    """The folder a manifest's relative shard paths are resolved against (`storage.resolve`: a shard in
    the group store is `../groups/<key>/<split>.bin.lz4`, an older data set's lies beside its manifest)."""
    uri = manifest_uri.rstrip("/")
    return uri.rsplit("/", 1)[0] if "/" in uri else "."


def open_split(
    manifest: Manifest,
    manifest_uri: str,
    split: str | list[str] | tuple[str, ...],
    mmap: bool = True,
    cache: ShardCache | None = None,
) -> SplitData:
    """The windows of `split`, or of several splits as one (k-fold: the folds a run trains on).

    When the split fits in half the size-capped local cache, its shards are fetched (checked against
    their sha256), unpacked, mapped from their own codes to the data set's encoding
    (`shardline/codes.py`) and laid end to end into one *split pack* in the cache (built once,
    reused by later runs), so the split is one set of memory-mapped arrays and a batch is one
    gather. A split larger than that streams: a shard is fetched, mapped and cached when first
    needed and released when passed. Which of the two a split is never changes the batches a loader
    yields (the order is a function of the seed, the epoch and `training.shuffle_shards`, never of
    the cache). (One local, uncompressed shard of the earlier encoder, which wrote the data set's
    codes, is memory-mapped in place.)
    """
    shards = manifest.shards_of(split)
    split = split if isinstance(split, str) else "+".join(split)
    folder = manifest_folder(manifest_uri)
    enc = manifest.encoding
    glob = Globaliser(enc)
    uris = [resolve(folder, info.path) for info in shards]
    footprint = sum(glob.nbytes(info) for info in shards)
    in_place = len(shards) == 1 and not is_remote(uris[0]) and not shards[0].compression and shards[0].local is None
    if in_place:
        info = shards[0]
        arrays = read_arrays(Path(local_path(uris[0])), info.arrays, mmap=mmap)
        view = _checked_view(arrays, info, enc)
        return SplitData._from_refs(
            [_Ref(info.windows, view)], enc.window, enc.horizon, streaming=False, positions=enc.target_positions
        )
    cache = cache or shared_cache()
    if footprint > cache.cap // 2:
        refs = [_Ref(info.windows, info=info, uri=u, cache=cache, glob=glob) for info, u in zip(shards, uris)]
        return SplitData._from_refs(refs, enc.window, enc.horizon, streaming=True, positions=enc.target_positions)
    size, joined_specs, own_specs = pack_layout([glob.specs(info) for info in shards])
    mapped = any(info.local is not None for info in shards)
    key = hashlib.sha256(
        json.dumps(
            {
                "pack": 2,
                "shards": [[i.sha256, i.compression] for i in shards],
                "encoding": enc.hash() if mapped else None,
            }
        ).encode()
    ).hexdigest()

    def build(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            f.truncate(size)
        fd = os.open(tmp, os.O_WRONLY)
        try:

            def put(n: int) -> None:
                info = shards[n]
                data = read_verified(uris[n], info.sha256, info.compression, info.raw_bytes)
                arrays = glob.arrays(arrays_in(data, info.arrays), info.local)  # the data set's encoding, as rows
                for name, spec in own_specs[n].items():
                    a = np.ascontiguousarray(arrays[name])
                    if a.nbytes:
                        os.pwrite(fd, memoryview(a.reshape(-1).view(np.uint8)), spec.offset)

            from concurrent.futures import ThreadPoolExecutor

            with ThreadPoolExecutor(2, thread_name_prefix="shardline-pack") as pool:
                list(pool.map(put, range(len(shards))))  # fetch, check, unpack and map two shards at a time
        finally:
            os.close(fd)

    cache.pin(key, size)
    try:
        pack = cache.build(key, size, build, f"the {split} split pack of {manifest_uri}")
    except BaseException:
        cache.unpin(key)
        raise
    buffer = map_file(pack, mmap)
    refs = []
    for info, specs in zip(shards, own_specs):
        refs.append(_Ref(info.windows, _checked_view(arrays_in(buffer, specs), info, enc)))
    joined = arrays_in(buffer, joined_specs) if len(shards) > 1 else None
    data = SplitData._from_refs(
        refs,
        enc.window,
        enc.horizon,
        streaming=False,
        joined=joined,
        rows=[int(i.rows) for i in shards],
        positions=enc.target_positions,
    )
    budget = resident_budget()
    if budget and len(buffer) and not isinstance(buffer, bytes):
        # the pages of the pack a process reads stay mapped (RSS) until dropped: kept under the budget
        data._pages = MappedPages(buffer, budget)
        for v in {id(v): v for v in [*(r.view for r in refs), data._joined]}.values():
            v.bound(data._pages)
    weakref.finalize(data, cache.unpin, key)  # a split that is gone no longer holds its pack in the cache
    return data


def _checked_view(arrays: dict[str, np.ndarray], info, enc) -> ShardView:
    view = ShardView(arrays, enc.window, enc.horizon, name=f"shard {info.path}", positions=enc.target_positions)
    if len(view.starts) != info.windows:
        raise ValueError(
            f"shard {info.path}: the manifest lists {info.windows} windows but its offsets give {len(view.starts)} "
            f"(window={enc.window}, horizon={enc.horizon}); the manifest and shard disagree: re-run the encode step "
            "(shardline run CONFIG --force encode)"
        )
    return view


def _global_shuffle_refused(data: SplitData, name: str) -> str:
    """Why a streamed split cannot be shuffled whole, and the two ways out, with this split's numbers."""
    cache = data.cache
    sizes = sorted((r.footprint for r in data._refs), reverse=True)
    fit = max(1, int(np.searchsorted(np.cumsum(sizes), cache.cap // 2, side="right")))
    return (
        f"the {name} split is {sum(sizes) / 1e6:,.1f} MB unpacked, more than half the local shard cache's "
        f"{cache.describe_cap()}, so it streams shard by shard, but training.shuffle_shards is null: one shuffle "
        "of the whole split, which needs all of it in the cache. Set training.shuffle_shards to shuffle that "
        f"many shards at a time (here at most {fit}, for a block to fit in half the cache; the order is then "
        f"the same whatever the cache), or raise {CACHE_CAP_ENV} to at least {gb_at_least(2 * sum(sizes))} "
        "(twice the split) to keep the global shuffle"
    )


def check_cache_room(train: SplitData, val: SplitData, shuffle_shards: int | None) -> None:
    """Before training: the local cache can hold what training holds of it at once, besides the split
    packs it holds already: the train split's largest shuffle block while it streams, or the validation
    split's largest shard while it is read (never both: a loader releases its shards when its epoch
    ends). A ValueError names the setting to change and the number, so a too-small cache fails before
    the first step, never when a block of larger shards comes up mid-epoch."""
    if train.streaming and (shuffle_shards is None or shuffle_shards >= train.n_shards):
        raise ValueError(_global_shuffle_refused(train, "train"))
    needs: dict[int, list] = {}
    for name, data, what in (
        ("train", train, f"its {shuffle_shards} largest shards (training.shuffle_shards={shuffle_shards})"),
        ("validation", val, "its largest shard"),
    ):
        if data.streaming:
            need = data.cache_need(shuffle_shards) if name == "train" else data.cache_need(shuffle=False)
            needs.setdefault(id(data.cache), [data.cache, []])[1].append((need, f"the {name} split's {what}"))
    for cache, parts in needs.values():
        need, what = max(parts)
        held = cache.pinned_bytes()
        if held + need <= cache.cap:
            continue
        lower = ""
        if train.streaming and train.cache is cache:
            sizes = np.cumsum(sorted((r.footprint for r in train._refs), reverse=True))
            fit = int(np.searchsorted(sizes, cache.cap - held, side="right"))
            if 1 <= fit < shuffle_shards:
                lower = f", or lower training.shuffle_shards to {fit}"
        raise ValueError(
            f"training holds up to {need / 1e6:,.1f} MB of the local shard cache at once ({what}) besides the "
            f"{held / 1e6:,.1f} MB it holds already (split packs), but the cache is capped at "
            f"{cache.describe_cap()}: raise {CACHE_CAP_ENV} to at least {gb_at_least(held + need)}{lower}"
        )


class WindowLoader:
    """Batches of one epoch, in an order that is a pure function of (seed, epoch, shuffle_shards) and the
    split's shards, never of the local cache; resumable mid-epoch.

    Its position is a few integers (`state_dict`): the epoch and how many windows of it were already
    yielded, so a restored loader yields exactly the batches the interrupted one had not.
    `set_epoch(e)` starts epoch e from its beginning; iterating continues from the current position.

    Order: with `shuffle_shards` null, a global permutation of all windows (the split's shards are
    joined, so a batch is one gather wherever its windows live; a split too large for the cache is
    refused, as a global shuffle needs all of it). With `shuffle_shards=m`, shuffle blocks: the shards
    in a permuted order, taken m at a time, the windows of each block permuted together. A split in
    the cache and the same split streamed give the same batches; streamed, a block's shards are
    opened when the order reaches them, released when it has passed their last window, and up to
    `read_ahead` shards after them are fetched in the background while there is room in the cache.
    Batches are gathered a few at a time (about CHUNK_BYTES per fancy index) and handed out as
    views. `num_workers` threads gather the next ones while the current batch trains: they share
    the arrays (no pickling), and the gathers run outside the GIL. A streamed split is gathered by
    one thread, in order (so the shards held stay one block's), up to 2 x `num_workers` chunks ahead.
    """

    def __init__(
        self,
        data: SplitData,
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        drop_last: bool = False,
        pin_memory: bool = False,
        num_workers: int = 0,
        read_ahead: int = 2,
        shuffle_shards: int | None = None,
        rank: int = 0,
        world_size: int = 1,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if shuffle_shards is not None and shuffle_shards < 1:
            raise ValueError(f"shuffle_shards must be >= 1 or None (a global shuffle), got {shuffle_shards}")
        if shuffle and data.streaming and (shuffle_shards is None or shuffle_shards >= data.n_shards):
            raise ValueError(_global_shuffle_refused(data, "streamed"))
        self.data = data
        self.batch_size = batch_size
        self.seed = int(seed)
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.num_workers = int(num_workers)
        self.read_ahead = max(0, int(read_ahead))
        self.shuffle_shards = shuffle_shards
        self.epoch = 0
        self.offset = 0
        # several processes (DDP): each yields its share of each global batch (trainer/distributed.py); the
        # position (`offset`, `state_dict`) stays the global one, the same on every rank and for one process
        self.rank, self.world_size = int(rank), int(world_size)
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")

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

    def shard_order(self, epoch: int) -> np.ndarray:
        """The order shards are taken in, `shuffle_shards` at a time (in-order when not shuffling)."""
        if not self.shuffle:
            return np.arange(self.data.n_shards, dtype=np.int64)
        return np.random.default_rng([self.seed, epoch, 1]).permutation(self.data.n_shards)

    def order(self, epoch: int) -> np.ndarray:
        """Window numbers in the order epoch `epoch` yields them."""
        n, d, m = self.n_windows, self.data, self.shuffle_shards
        if not self.shuffle:
            return np.arange(n, dtype=np.int64)
        if m is None or m >= d.n_shards:  # one block of every shard: the global permutation
            return np.random.default_rng([self.seed, epoch]).permutation(n)
        first, seq, parts = d._first, self.shard_order(epoch), []
        for b in range(0, len(seq), m):
            ids = np.concatenate([np.arange(first[s], first[s + 1], dtype=np.int64) for s in seq[b : b + m]])
            parts.append(ids[np.random.default_rng([self.seed, epoch, 2, b // m]).permutation(len(ids))])
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        self.offset = 0

    def _per_gather(self) -> int:
        """Batches gathered by one fancy index: about CHUNK_BYTES of windows (amortises the per-call
        cost and, with workers, the hand-off between threads); each batch is then a view of it."""
        d = self.data
        per_position = d.window if d.positions == "all" else 1
        per_window = d.window * (d.n_cont * d.cont_dtype.itemsize + d.n_cat * d.cat_dtype.itemsize) + sum(
            per_position * t.itemsize for t in d.target_dtypes
        )
        return int(min(MAX_BATCHES_PER_GATHER, max(1, -(-CHUNK_BYTES // max(1, per_window * self.batch_size)))))

    def __iter__(self):
        order = self.order(self.epoch)
        bs, pin = self.batch_size, self.pin_memory
        data = self.data
        step = bs * self._per_gather()
        spans = [(lo, min(lo + step, self.end)) for lo in range(self.offset, self.end, step)]

        def batches(big: Batch):
            for lo in range(0, len(big), bs):
                b = big.slice(lo, lo + bs)
                self.offset += len(b)  # counted when handed out: a checkpoint after this batch resumes past it
                yield b  # a view of the gathered (and, for CUDA, pinned) chunk

        if self.world_size > 1:  # this rank's share of each global batch; the offset counts whole batches
            from shardline.trainer.distributed import rank_positions

            def share(lo: int, hi: int) -> tuple[np.ndarray, list[tuple[int, int, int]]]:
                parts = rank_positions(lo, hi, bs, self.end, self.rank, self.world_size)
                return np.concatenate([np.arange(p, p + n, dtype=np.int64) for p, n, _ in parts]), parts

            def batches(big: Batch, parts):  # the DDP form of the one above
                at = 0
                for _, n, k in parts:
                    b = big.slice(at, at + n)
                    at += n
                    self.offset += k
                    yield b

            stream = self._stream_gather(order, spans) if data.streaming else None

            def gather(lo: int, hi: int):
                pos, parts = share(lo, hi)
                return (stream(lo, hi, pos) if stream else data.batch(order[pos], pin_memory=pin)), parts

            threads = 1 if data.streaming else self.num_workers
            try:
                if self.num_workers == 0:
                    for lo, hi in spans:
                        yield from batches(*gather(lo, hi))
                    return
                from concurrent.futures import ThreadPoolExecutor

                with ThreadPoolExecutor(threads, thread_name_prefix="shardline-loader") as pool:
                    pending = []
                    todo = iter(spans)
                    while True:
                        while len(pending) < 2 * self.num_workers and (span := next(todo, None)) is not None:
                            pending.append(pool.submit(gather, *span))
                        if not pending:
                            break
                        yield from batches(*pending.pop(0).result())
            finally:
                data.release()
            return

        if data.streaming:
            # one thread gathers a streamed split's spans, in order, so that the shards it holds stay those of
            # one block; `num_workers` sets how far ahead it may go
            gather, threads = self._stream_gather(order, spans), 1
        else:
            gather, threads = (lambda lo, hi: data.batch(order[lo:hi], pin_memory=pin)), self.num_workers
        try:
            if self.num_workers == 0:
                for lo, hi in spans:
                    yield from batches(gather(lo, hi))
                return
            from collections import deque
            from concurrent.futures import ThreadPoolExecutor

            pool = ThreadPoolExecutor(threads, thread_name_prefix="shardline-loader")
            pending: deque = deque()
            todo = iter(spans)
            try:
                while True:
                    while len(pending) < 2 * self.num_workers:
                        span = next(todo, None)
                        if span is None:
                            break
                        pending.append(pool.submit(gather, *span))  # gathered and pinned in the worker
                    if not pending:
                        break
                    yield from batches(pending.popleft().result())
            finally:
                for fut in pending:
                    fut.cancel()
                pool.shutdown(wait=True)
        finally:
            data.release()  # streamed shards still held when the epoch ends or the loop leaves it (closed)

    def _stream_gather(self, order: np.ndarray, spans: list[tuple[int, int]]):
        """gather(lo, hi): the windows order[lo:hi] of a streamed split, for spans taken in order. A shard
        is opened when the order reaches its first window and released with the gather of its last
        (`SplitData.batch`), so the cache holds the current shuffle block; after each gather the next
        shards by first window are read ahead, in that order and only while the cache has room (a
        prefix: the shard needed next never waits behind a later one)."""
        d = self.data
        start, end = (spans[0][0], spans[-1][1]) if spans else (0, 0)
        shard = d.shard_of(order)
        # each shard's first and last position in what is left to yield (a resumed epoch: from `start`)
        pos = np.arange(start, end, dtype=np.int64)
        first = np.full(d.n_shards, end, dtype=np.int64)
        last = np.full(d.n_shards, -1, dtype=np.int64)
        np.minimum.at(first, shard[start:end], pos)
        np.maximum.at(last, shard[start:end], pos)
        by_first = np.argsort(first, kind="stable")
        firsts = first[by_first]

        def gather(lo: int, hi: int, pos: np.ndarray | None = None) -> Batch:
            here = np.unique(shard[lo:hi])
            idx = order[lo:hi] if pos is None else order[pos]  # pos: a rank's share of the span (DDP)
            passed = here[last[here] < hi]
            if pos is not None:  # passed shards this rank's share does not touch: released before it opens others
                for s in np.setdiff1d(passed, d.shard_of(idx)):
                    d.release_shard(int(s))
            big = d.batch(idx, pin_memory=self.pin_memory, release=passed)
            at = int(np.searchsorted(firsts, hi))
            for s in by_first[at : at + self.read_ahead]:
                if first[s] >= end or not d.prefetch(int(s)):
                    break
            return big

        return gather

    def state_dict(self) -> dict:
        return {
            "version": LOADER_STATE_VERSION,
            "epoch": self.epoch,
            "offset": self.offset,
            "seed": self.seed,
            "n_windows": self.n_windows,
            **({"shuffle_shards": self.shuffle_shards} if self.shuffle_shards is not None else {}),
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != LOADER_STATE_VERSION:
            raise ValueError(
                f"loader state version {state.get('version')!r} is not supported (expected {LOADER_STATE_VERSION})"
            )
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
        if state.get("shuffle_shards") != self.shuffle_shards:
            raise ValueError(
                f"loader state was saved with shuffle_shards={state.get('shuffle_shards')} but this loader has "
                f"shuffle_shards={self.shuffle_shards} (training.shuffle_shards changed): the batch order would differ"
            )
        if not 0 <= state["offset"] <= self.n_windows:
            raise ValueError(f"loader state offset {state['offset']} is outside [0, {self.n_windows}]")
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])


def scored_windows(data: SplitData) -> tuple[np.ndarray, np.ndarray]:
    """Text evaluation's windows: in each sequence segment, non-overlapping ones (a start every K tokens)
    plus the segment's last window (its tail) when it is not one of them, so each target token is scored
    once, not at up to K positions. Returns (window numbers, in window order; per window, how many of its
    first positions an earlier window scored already: 0, or the tail's overlap, whose targets are masked)."""
    k = data.window

    def per_shard(v: ShardView, s: int) -> tuple[np.ndarray, np.ndarray]:
        starts = np.asarray(v.starts, dtype=np.int64)
        if not len(starts):
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        offsets = np.asarray(v.arrays["offsets"], dtype=np.int64)
        seg = np.searchsorted(offsets, starts, side="right") - 1
        rel = starts - offsets[seg]  # the start's place in its segment
        last = np.append(seg[1:] != seg[:-1], True)  # each segment's last window
        keep = (rel % k == 0) | last
        skip = np.where(rel % k == 0, 0, (rel // k + 1) * k - rel)  # the tail's positions scored before
        return np.flatnonzero(keep) + data._first[s], skip[keep]

    parts = data.each_shard(per_shard)
    if not parts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


class ScoredLoader:
    """Evaluation's batches, in window order: every window (`WindowLoader(shuffle=False)`'s batches), or for
    text (`stride=True`: every-position targets with a <pad> id to ignore) the non-overlapping windows of
    `scored_windows`, the positions a tail window shares with the window before it given the `ignore` id as
    target, so each token counts once in a loss, perplexity or accuracy that skips that id."""

    def __init__(self, data: SplitData, batch_size: int, stride: bool = False, ignore: int = 0):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.data, self.batch_size, self.ignore = data, batch_size, ignore
        self.stride = bool(stride) and data.positions == "all"
        self.idx, self.skip = scored_windows(data) if self.stride else (None, None)

    @property
    def n_windows(self) -> int:
        return len(self.idx) if self.stride else self.data.n_windows

    def __iter__(self):
        if not self.stride:
            yield from WindowLoader(self.data, self.batch_size, seed=0, shuffle=False)
            return
        d, k = self.data, self.data.window
        shard = d.shard_of(self.idx)
        last_of = {int(s): int(np.flatnonzero(shard == s)[-1]) for s in np.unique(shard)}
        try:
            for lo in range(0, len(self.idx), self.batch_size):
                hi = min(lo + self.batch_size, len(self.idx))
                passed = [s for s in np.unique(shard[lo:hi]).tolist() if last_of[s] < hi]
                batch = d.batch(self.idx[lo:hi], release=passed)
                skip = self.skip[lo:hi]
                if skip.any():
                    mask = np.arange(k)[None, :] < skip[:, None]
                    for t in batch.targets:
                        t.numpy()[mask] = self.ignore
                yield batch
        finally:  # a pass stopped part-way (an error, a closed iterator): its shards leave the cache's hold
            d.release()
