"""Windows over shards: a zero-copy view of a split, vectorised batch gathering, and a resumable loader.

A window is K consecutive rows [s, s+K) of one sequence segment; its target is the row
s + K - 1 + horizon. Windows are numbered across the split's shards in order (shard 0's windows
first), and that numbering is the "window order" every output of this package uses.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from shardline.manifest import Manifest
from shardline.shards import read_arrays, window_starts
from shardline.storage import ShardCache, is_remote, join, local_path, shared_cache

LOADER_STATE_VERSION = 2  # 2: each batch's windows grouped by shard; shard-then-window order when streaming
ARRAYS = ("cont", "cat", "target", "order", "offsets")


def _tensor(arr: np.ndarray) -> torch.Tensor:
    """A torch view of a (possibly read-only, memory-mapped) array, without copying it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only mmap: we never write through the view
        return torch.from_numpy(np.asarray(arr))


def _cast(t: torch.Tensor, floating: bool) -> torch.Tensor:
    if floating:
        return t if t.dtype == torch.float32 else t.float()
    return t if t.dtype == torch.int64 else t.long()


@dataclass(frozen=True)
class Batch:
    """One batch as stored (narrow dtypes: float16/32 `cont`, int8/16/32 `cat`, the target's stored type),
    so the bytes moved to the device are the fewest; `to(device)` widens them there."""

    cont: torch.Tensor  # [B, K, n_cont]
    cat: torch.Tensor  # [B, K, n_cat]
    target: torch.Tensor  # [B] class ids or standardised values

    def __len__(self) -> int:
        return self.target.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.cont, self.cat, self.target))

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """On `device`, as the model takes it: float32 features, int64 ids, int64 classes / float32 values."""
        cont, cat, target = (t.to(device, non_blocking=non_blocking) for t in (self.cont, self.cat, self.target))
        return Batch(_cast(cont, True), _cast(cat, False), _cast(target, target.is_floating_point()))

    def pin_memory(self) -> Batch:
        return Batch(self.cont.pin_memory(), self.cat.pin_memory(), self.target.pin_memory())


class ShardView:
    """One shard's arrays, with zero-copy window views: window w of the shard is `cont_w[start[w]]`,
    K consecutive rows that are one contiguous block of memory, so gathering a batch of windows
    copies exactly what gathering materialised windows would."""

    def __init__(self, arrays: dict[str, np.ndarray], window: int, horizon: int, name: str = "shard"):
        missing = [a for a in ("cont", "cat", "target", "offsets") if a not in arrays]
        if missing:
            raise ValueError(f"{name} lacks the array(s) {missing}; a shard holds {list(ARRAYS)}")
        self.arrays = arrays
        self.name = name
        self.starts = window_starts(arrays["offsets"], window, horizon)
        self.shift = window - 1 + horizon  # target row = start + shift
        rows = int(arrays["cont"].shape[0])
        n_views = max(rows - window + 1, 0)
        self.cont_w = self._windows(np.asarray(arrays["cont"]), n_views, window)
        self.cat_w = self._windows(np.asarray(arrays["cat"]), n_views, window)
        self.target = np.asarray(arrays["target"])

    @staticmethod
    def _windows(a: np.ndarray, n: int, k: int) -> np.ndarray:
        """[n, K, F] view: row i is the K rows starting at i (one contiguous block of memory)."""
        if n == 0:
            return np.zeros((0, k, a.shape[1]), dtype=a.dtype)
        return np.lib.stride_tricks.as_strided(a, (n, k, a.shape[1]), (a.strides[0], a.strides[0], a.strides[1]), writeable=False)

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

    def __init__(self, windows: int, view: ShardView | None = None, info=None, uri: str | None = None, cache=None):
        self.windows = windows
        self.view = view
        self.info = info
        self.uri = uri
        self.cache = cache
        self.pinned = False


class SplitData:
    """The windows of one split, over its shards' (memory-mapped) arrays, without copying them.

    Built from arrays in hand (`SplitData([arrays, ...], K, horizon)`) or, by `open_split`, from a
    manifest's shards; when the shards do not all fit in the local cache the split *streams*: a shard
    is fetched when first needed (the loader reads ahead), and released when the loader moves on.
    """

    def __init__(self, shards: list[dict[str, np.ndarray]], window: int, horizon: int):
        if window < 1 or horizon < 0:
            raise ValueError(f"window must be >= 1 and horizon >= 0, got window={window}, horizon={horizon}")
        refs = []
        for i, arrays in enumerate(shards):
            view = ShardView(arrays, window, horizon, name=f"shard {i}")
            refs.append(_Ref(len(view.starts), view))
        self._setup(refs, window, horizon, streaming=False)

    @classmethod
    def _from_refs(cls, refs: list[_Ref], window: int, horizon: int, streaming: bool) -> SplitData:
        self = cls.__new__(cls)
        self._setup(refs, window, horizon, streaming)
        return self

    def _setup(self, refs: list[_Ref], window: int, horizon: int, streaming: bool) -> None:
        import threading

        if window < 1 or horizon < 0:
            raise ValueError(f"window must be >= 1 and horizon >= 0, got window={window}, horizon={horizon}")
        self.window = window
        self.horizon = horizon
        self.streaming = streaming
        self._refs = refs
        self._lock = threading.Lock()
        counts = np.array([r.windows for r in refs], dtype=np.int64)
        self._first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)  # window number of each shard's first window
        self.n_windows = int(self._first[-1])
        self.n_shards = len(refs)
        if refs:
            cont, cat, target = self._meta(0)
            self.n_cont, self.n_cat = int(cont[1][1]), int(cat[1][1])
            self.cont_dtype, self.cat_dtype, self.target_dtype = (torch.from_numpy(np.zeros(0, np.dtype(d))).dtype for d in (cont[0], cat[0], target[0]))
            for i in range(1, len(refs)):
                c, k, t = self._meta(i)
                if c[1][1] != self.n_cont or k[1][1] != self.n_cat:
                    raise ValueError(
                        f"shard {i} has {c[1][1]} continuous / {k[1][1]} categorical columns, shard 0 has "
                        f"{self.n_cont} / {self.n_cat}: the shards of a split must share one encoding"
                    )
                if (c[0], k[0], t[0]) != (cont[0], cat[0], target[0]):
                    raise ValueError(f"shard {i} stores {c[0]}/{k[0]}/{t[0]}, shard 0 {cont[0]}/{cat[0]}/{target[0]}: one encoding per split")
        else:
            self.n_cont = self.n_cat = 0
            self.cont_dtype, self.cat_dtype, self.target_dtype = torch.float32, torch.int64, torch.int64
        self.task = "regression" if self.target_dtype.is_floating_point else "classification"

    def _meta(self, i: int) -> tuple:
        """(dtype, shape) of a shard's cont, cat and target arrays, without opening a streamed shard."""
        r = self._refs[i]
        if r.view is not None:
            a = r.view.arrays
            return tuple((np.dtype(a[n].dtype).str, list(a[n].shape)) for n in ("cont", "cat", "target"))
        spec = r.info.arrays
        missing = [a for a in ("cont", "cat", "target", "offsets") if a not in spec]
        if missing:
            raise ValueError(f"shard {r.info.path} lacks the array(s) {missing}; a shard holds {list(ARRAYS)}")
        return tuple((np.dtype(spec[n].dtype).str, list(spec[n].shape) + ([0] if len(spec[n].shape) == 1 else [])) for n in ("cont", "cat", "target"))

    def __len__(self) -> int:
        return self.n_windows

    def __repr__(self) -> str:
        return (
            f"SplitData(shards={self.n_shards}, windows={self.n_windows}, window={self.window}, horizon={self.horizon}, "
            f"n_cont={self.n_cont}, n_cat={self.n_cat}, task={self.task}{', streaming' if self.streaming else ''})"
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
                    r.cache.pin(r.info.sha256)
                    r.pinned = True
                local = r.cache.get(r.uri, r.info.sha256, r.info.bytes, r.info.compression, r.info.raw_bytes)
                v = ShardView(read_arrays(local, r.info.arrays), self.window, self.horizon, name=f"shard {r.info.path}")
                if len(v.starts) != r.windows:
                    raise ValueError(
                        f"shard {r.info.path}: the manifest lists {r.windows} windows but its offsets give {len(v.starts)} "
                        f"(window={self.window}, horizon={self.horizon}); the manifest and shard disagree: re-run the encode step"
                    )
                r.view = v
            return r.view

    def prefetch(self, s: int) -> None:
        """Start fetching streamed shard `s` in the background (no-op for shards in hand)."""
        r = self._refs[s]
        if r.view is None and r.cache is not None:
            with self._lock:
                if not r.pinned:
                    r.cache.pin(r.info.sha256)
                    r.pinned = True
            r.cache.prefetch(r.uri, r.info.sha256, r.info.bytes, r.info.compression, r.info.raw_bytes)

    def release(self, keep: set[int]) -> None:
        """Streaming: drop every shard not in `keep`, so the cache may evict it."""
        if not self.streaming:
            return
        with self._lock:
            for i, r in enumerate(self._refs):
                if i in keep or r.cache is None:
                    continue
                r.view = None
                if r.pinned:
                    r.cache.unpin(r.info.sha256)
                    r.pinned = False

    @property
    def shards(self) -> list[dict[str, np.ndarray]]:
        """Every shard's arrays (opens streamed shards: for small splits and tests)."""
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

    def _check(self, idx) -> np.ndarray:
        idx = np.asarray(idx, dtype=np.int64)
        if idx.size and (idx.min() < 0 or idx.max() >= self.n_windows):
            raise IndexError(f"window index out of range [0, {self.n_windows})")
        return idx

    def batch(self, idx: np.ndarray, pin_memory: bool = False) -> Batch:
        """Gather windows `idx` (in that order): one index_select per array per run of same-shard windows.

        The loader hands in each batch grouped by shard, so a batch costs one gather per shard it
        touches, each a contiguous K-row block copy per window (no per-window Python).
        """
        idx = self._check(idx)
        b, k = len(idx), self.window
        if b == 0:
            return Batch(
                torch.empty((0, k, self.n_cont), dtype=self.cont_dtype),
                torch.empty((0, k, self.n_cat), dtype=self.cat_dtype),
                torch.empty(0, dtype=self.target_dtype),
            )
        shard = self.shard_of(idx)
        cuts = np.flatnonzero(shard[1:] != shard[:-1]) + 1
        bounds = [0, *cuts.tolist(), b]
        parts = []
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            # numpy fancy indexing: single-threaded and outside the GIL; torch's index_select spreads a
            # small gather over OpenMP threads, which stalls ~10x when the cores are busy training
            s = int(shard[lo])
            v = self.view(s)
            start = v.starts[idx[lo:hi] - self._first[s]]
            parts.append((v.cont_w[start], v.cat_w[start], v.target[start + v.shift]))
        arrays = parts[0] if len(parts) == 1 else [np.concatenate(x) for x in zip(*parts)]
        out = Batch(*(torch.from_numpy(x) for x in arrays))
        return out.pin_memory() if pin_memory else out

    def _per_shard(self, fn) -> list:
        """fn(view, shard index) for every shard in order, releasing streamed shards as it goes."""
        out = []
        for s in range(self.n_shards):
            if s + 1 < self.n_shards:
                self.prefetch(s + 1)
            out.append(fn(self.view(s), s))
            self.release({s + 1})
        return out

    def target_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """(shard index, target row in that shard) of every window, in window order."""
        shard = np.repeat(np.arange(self.n_shards, dtype=np.int64), np.diff(self._first))
        rows = self._per_shard(lambda v, s: v.starts + v.shift)
        return shard, (np.concatenate(rows) if rows else np.zeros(0, np.int64)).astype(np.int64)

    def window_keys(self) -> dict[str, np.ndarray]:
        """Per window, in window order: its shard, the segment (sequence) of its target row in that shard,
        the target row, and that row's `order` value (-1 when the shard has no order)."""
        def keys(v: ShardView, s: int):
            row = v.starts + v.shift
            segment = np.searchsorted(np.asarray(v.arrays["offsets"]), row, side="right") - 1
            return row, segment, v.order_of_rows(row)

        parts = self._per_shard(keys)
        shard = np.repeat(np.arange(self.n_shards, dtype=np.int64), np.diff(self._first))
        cat = lambda i: np.concatenate([p[i] for p in parts]).astype(np.int64) if parts else np.zeros(0, np.int64)  # noqa: E731
        return {"shard": shard, "segment": cat(1), "row": cat(0), "order": cat(2)}

    def targets(self) -> np.ndarray:
        """The target of every window, in window order (class ids or standardised values)."""
        dtype = np.float32 if self.task == "regression" else np.int64
        parts = self._per_shard(lambda v, s: np.asarray(v.arrays["target"])[v.starts + v.shift].astype(dtype))
        return np.concatenate(parts) if parts else np.zeros(0, dtype)


def manifest_folder(manifest_uri: str) -> str:
    """The folder a manifest's relative shard paths are resolved against."""
    uri = manifest_uri.rstrip("/")
    return uri.rsplit("/", 1)[0] if "/" in uri else "."


def open_split(manifest: Manifest, manifest_uri: str, split: str, mmap: bool = True, cache: ShardCache | None = None) -> SplitData:
    """The windows of `split`. Local shards are memory-mapped in place. Remote shards go through the
    size-capped local cache (checked against their sha256): all fetched up front (in parallel) when
    the split fits in half the cache, otherwise the split streams, a few shards at a time. Compressed
    shards (the default) are unpacked into the same cache, local or not."""
    shards = manifest.shards_of(split)
    folder = manifest_folder(manifest_uri)
    enc = manifest.encoding
    uris = [join(folder, info.path) for info in shards]
    cached = any(is_remote(u) for u in uris) or any(info.compression for info in shards)  # fetched or unpacked locally
    cache = cache or (shared_cache() if cached else None)
    footprint = sum((info.raw_bytes or info.bytes) if info.compression else info.bytes for info in shards)
    if cached and footprint > cache.cap // 2:
        refs = [_Ref(info.windows, info=info, uri=u, cache=cache) for info, u in zip(shards, uris)]
        return SplitData._from_refs(refs, enc.window, enc.horizon, streaming=True)
    if cached:
        for info, u in zip(shards, uris):
            cache.pin(info.sha256)
            cache.prefetch(u, info.sha256, info.bytes, info.compression, info.raw_bytes)
    refs = []
    for info, u in zip(shards, uris):
        local = cache.get(u, info.sha256, info.bytes, info.compression, info.raw_bytes) if cached else Path(local_path(u))
        view = ShardView(read_arrays(local, info.arrays, mmap=mmap), enc.window, enc.horizon, name=f"shard {info.path}")
        if len(view.starts) != info.windows:
            raise ValueError(
                f"shard {info.path}: the manifest lists {info.windows} windows but its offsets give {len(view.starts)} "
                f"(window={enc.window}, horizon={enc.horizon}); the manifest and shard disagree: re-run the encode step"
            )
        refs.append(_Ref(info.windows, view))
    return SplitData._from_refs(refs, enc.window, enc.horizon, streaming=False)


class WindowLoader:
    """Batches of one epoch, in an order that is a pure function of (seed, epoch); resumable mid-epoch.

    Its position is a few integers (`state_dict`): the epoch and how many windows of it were already
    yielded, so a restored loader yields exactly the batches the interrupted one had not.
    `set_epoch(e)` starts epoch e from its beginning; iterating continues from the current position.

    Order: a global permutation of all windows, each batch's windows then grouped by shard (one
    gather per shard touched); a streamed split (larger than the local cache) goes shard by shard
    in a permuted shard order, windows permuted inside each shard, with the next shards read ahead.
    `num_workers` threads gather the next batches while the current one trains: they share the
    arrays (no pickling), and the gathers run outside the GIL.
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
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        self.data = data
        self.batch_size = batch_size
        self.seed = int(seed)
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.num_workers = int(num_workers)
        self.read_ahead = max(1, int(read_ahead))
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

    def shard_order(self, epoch: int) -> np.ndarray:
        """The order shards are visited in (streamed splits; in-order when not shuffling)."""
        if not self.shuffle:
            return np.arange(self.data.n_shards, dtype=np.int64)
        return np.random.default_rng([self.seed, epoch, 1]).permutation(self.data.n_shards)

    def order(self, epoch: int) -> np.ndarray:
        n, d = self.n_windows, self.data
        if not self.shuffle:
            return np.arange(n, dtype=np.int64)
        if d.streaming:
            first = d._first
            parts = [
                first[s] + np.random.default_rng([self.seed, epoch, 2, int(s)]).permutation(int(first[s + 1] - first[s]))
                for s in self.shard_order(epoch)
            ]
            return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
        perm = np.random.default_rng([self.seed, epoch]).permutation(n)
        if d.n_shards > 1:  # inside each batch, group the windows by shard: one gather per shard touched
            key = (np.arange(n, dtype=np.int64) // self.batch_size) * d.n_shards + d.shard_of(perm)
            perm = perm[np.argsort(key, kind="stable")]
        return perm

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        self.offset = 0

    def _stream_hint(self, order: np.ndarray, at: int) -> None:
        """Streaming: keep the shards of the batch at `at`, read the next ones ahead, release the rest."""
        d = self.data
        lo, hi = order[at], order[min(at + self.batch_size, len(order)) - 1]
        now = {int(d.shard_of(np.array([lo]))[0]), int(d.shard_of(np.array([hi]))[0])}
        seq = self.shard_order(self.epoch)
        pos = int(np.flatnonzero(seq == max(now, key=lambda s: int(np.flatnonzero(seq == s)[0])))[0])
        ahead = [int(s) for s in seq[pos + 1 : pos + 1 + self.read_ahead]]
        d.release(now | set(ahead))
        for s in ahead:
            d.prefetch(s)

    def __iter__(self):
        order = self.order(self.epoch)
        bs, pin = self.batch_size, self.pin_memory
        data = self.data
        if self.num_workers == 0 or data.streaming:
            while self.offset < self.end:
                if data.streaming:
                    self._stream_hint(order, self.offset)
                idx = order[self.offset : self.offset + bs]
                self.offset += len(idx)  # counted when handed out: a checkpoint after this batch resumes past it
                yield data.batch(idx, pin_memory=pin)
            return
        from collections import deque
        from concurrent.futures import ThreadPoolExecutor

        pool = ThreadPoolExecutor(self.num_workers, thread_name_prefix="shardline-loader")
        pending: deque = deque()
        nxt = self.offset
        try:
            while self.offset < self.end:
                while nxt < self.end and len(pending) < 2 * self.num_workers:
                    idx = order[nxt : nxt + bs]
                    pending.append((len(idx), pool.submit(data.batch, idx, pin)))
                    nxt += len(idx)
                size, fut = pending.popleft()
                batch = fut.result()
                self.offset += size
                yield batch
        finally:
            for _, fut in pending:
                fut.cancel()
            pool.shutdown(wait=True)

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
