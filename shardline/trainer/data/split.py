"""A split: its shards opened (mapped, or streamed through the local cache), viewed as numbered windows
(`SplitData`, `open_split`), and checked against the cache's room before a run reads them."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import weakref
from pathlib import Path

import numpy as np
import torch

from shardline.core.codes import Globaliser
from shardline.core.manifest import Manifest
from shardline.core.shards import (
    MappedPages,
    _window_counts,
    arrays_in,
    map_file,
    pack_layout,
    read_arrays,
    resident_budget,
)
from shardline.core.storage import (
    ShardCache,
    is_remote,
    local_path,
    resolve,
    shared_cache,
    unpacked,
)
from shardline.trainer.data.batch import ARRAYS, Batch, Windows, rows_of, target_names


class Starts:
    """Each window's start row, worked out from the segments (sequences) it lies in: window w of a segment whose
    first window is number f starts w - f rows after the segment's first usable row. Memory per segment, not per
    window (a split of 70M windows is some 20,000 games: 0.3 MB, where a start row per window took 280 MB, twice
    when the shards were joined); a batch's starts cost one binary search over the segments."""

    def __init__(self, rows: np.ndarray, first: np.ndarray):
        self._rows = rows  # each segment's first start row (segments with a window only)
        self._first = first  # each segment's first window number, and the total last

    @classmethod
    def of(cls, offsets: np.ndarray, window: int, horizon: int) -> Starts:
        """The windows of segments at `offsets` (as `shardline.core.shards.window_starts` lists them)."""
        offsets = np.asarray(offsets, dtype=np.int64)
        counts = _window_counts(offsets, window, horizon)
        keep = counts > 0
        return cls(offsets[:-1][keep], np.concatenate([[0], np.cumsum(counts[keep])]).astype(np.int64))

    @classmethod
    def joined(cls, parts: list[tuple[Starts, int]]) -> Starts:
        """Shards' windows end to end (two or more), each shard's rows `base` rows on: [(its starts, base), ...]."""
        rows = np.concatenate([s._rows + base for s, base in parts])
        counts = np.concatenate([np.diff(s._first) for s, _ in parts])
        return cls(rows, np.concatenate([[0], np.cumsum(counts)]).astype(np.int64))

    def __len__(self) -> int:
        return int(self._first[-1])

    def __getitem__(self, idx) -> np.ndarray:
        if isinstance(idx, tuple):  # a multi-axis index (`starts[:, None]`): of the listed starts
            return np.asarray(self)[idx]
        w = np.arange(*idx.indices(len(self))) if isinstance(idx, slice) else np.asarray(idx, dtype=np.int64)
        seg = np.searchsorted(self._first, w, side="right") - 1
        return self._rows[seg] + (w - self._first[seg])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        every = self[np.arange(len(self), dtype=np.int64)]
        return every if dtype is None else every.astype(dtype, copy=False)


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
        starts: Starts | None = None,
        positions: str = "last",
    ):
        missing = [a for a in ("cont", "cat") + (("offsets",) if starts is None else ()) if a not in arrays]
        if missing:
            raise ValueError(f"{name} lacks the array(s) {missing}; a shard holds {list(ARRAYS)}")
        self.arrays = arrays
        self.name = name
        self.positions = positions
        self.starts = Starts.of(arrays["offsets"], window, horizon) if starts is None else starts
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
        if self.pages is not None:  # byte offsets: int64 (start rows are int32 while they fit; their bytes may not)
            start = np.asarray(start, dtype=np.int64)
            self.pages.read([(base + start * row, length) for base, row, length in self._spans])

    def gather_targets(self, start: np.ndarray, out=None, rows: np.ndarray | None = None) -> tuple[np.ndarray, ...]:
        if out is None:
            if self._target_windows is not None:
                return tuple(w.gather(start)[..., 0] for w in self._target_windows)
            return tuple(t[start + self.shift] for t in self.targets)
        if self._target_windows is not None:
            rows = rows_of(start, self.cont.k) if rows is None else rows
            for w, o in zip(self._target_windows, out):
                w.gather(start, o.reshape(*o.shape, 1), rows)
        else:
            for t, o in zip(self.targets, out):
                np.take(t, start + self.shift, out=o, mode="clip")
        return out

    def gather(self, start: np.ndarray, out=None) -> tuple[np.ndarray, np.ndarray, tuple[np.ndarray, ...]]:
        """The windows starting at rows `start`: (cont, cat, targets), new arrays, or written into `out`'s
        arrays where their types are those stored (otherwise gathered, then converted into them)."""
        if out is None:
            got = self.cont.gather(start), self.cat.gather(start), self.gather_targets(start)
        elif (out[0].dtype, out[1].dtype, *(o.dtype for o in out[2])) == (
            self.cont.dtype,
            self.cat.dtype,
            *(t.dtype for t in self.targets),
        ):
            rows = rows_of(start, self.cont.k)  # the windows' rows, one index for both arrays
            self.cont.gather(start, out[0], rows), self.cat.gather(start, out[1], rows)
            self.gather_targets(start, out[2], rows)
            got = out
        else:  # widened for the device (text's unsigned ids)
            cont, cat, targets = self.gather(start)
            out[0][...], out[1][...] = cont, cat
            for o, t in zip(out[2], targets):
                o[...] = t
            return out
        self._note(start)
        return got

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
        self.specs = glob.specs(info) if glob is not None else None  # the layout of a streamed shard's arrays
        self.derived = None  # a shard in its own codes is cached already mapped to the data set's encoding
        if glob is not None and info.local is not None:
            from shardline.core.storage import Derived

            key = hashlib.sha256(
                json.dumps({"mapped": 1, "shard": info.sha256, "encoding": glob.spec.hash()}).encode()
            ).hexdigest()
            self.derived = Derived(key, glob.nbytes(info), lambda raw, fd, info=info: glob.write(raw, info, fd))

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
        # window number of each shard's first window
        self._first = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
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

    def _join(self, joined: dict[str, np.ndarray], rows: list[int]) -> None:
        """Every shard's cont/cat/target as one array each (the shards' rows end to end): window w
        starts at its shard's first row plus its start inside the shard, and any batch is one gather."""
        bases = np.concatenate([[0], np.cumsum(rows)[:-1]]).astype(np.int64)
        starts = Starts.joined([(r.view.starts, int(b)) for r, b in zip(self._refs, bases, strict=True)])
        self._joined = ShardView(
            joined, self.window, self.horizon, name="split", starts=starts, positions=self.positions
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
                v = _checked_view(read_arrays(local, r.specs), r.info, self.window, self.horizon, self.positions)
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

    def batch(self, idx: np.ndarray, pin_memory: bool = False, release=(), into: bool | None = None) -> Batch:
        """Gather windows `idx` (in that order): one fancy index per array, a K-row block copy per window.

        A split in hand is one set of arrays (one shard, or its shards joined in a split pack), so a
        batch is one gather whichever shards it draws from; a streamed split gathers per shard. The
        streamed shards in `release` (none of their windows comes after these) are gathered first and
        each released at once, so a gather across two shuffle blocks holds one block at a time.

        For a GPU (`pin_memory`) the windows are gathered straight into page-locked tensors, in the types that
        travel: one copy, where pinning a gathered batch is a second (2026-11-28, docs/performance.md). On the CPU
        numpy's fancy index into a new array is the faster gather (2x for the demo's rows); `into` chooses.
        """
        idx = self._check(idx)
        b, k = len(idx), self.window
        tshape = (b, k) if self.positions == "all" else (b,)
        shapes = [(b, k, self.n_cont), (b, k, self.n_cat), *[tshape] * self.n_targets]
        dtypes = [self.cont_dtype, self.cat_dtype, *self.target_dtypes]
        if b == 0:
            return Batch.empty(shapes, dtypes)
        out = Batch.empty(shapes, dtypes, pin_memory=pin_memory) if (pin_memory if into is None else into) else None
        dst = None if out is None else out.numpy()
        # numpy fancy indexing: single-threaded and outside the GIL; torch's index_select spreads a
        # small gather over OpenMP threads, which stalls ~10x when the cores are busy training
        j = self._joined
        if j is not None:
            got = j.gather(j.starts[idx], dst)
        else:
            shard = self.shard_of(idx)
            first = int(shard[0])
            done = {int(s) for s in release}
            if (shard == first).all():
                v = self.view(first)
                got = v.gather(v.starts[idx - self._first[first]], dst)
                if first in done:
                    self.release_shard(first)
            else:
                if out is None:
                    out = Batch.empty(shapes, dtypes)
                    dst = out.numpy()
                for s in sorted(np.unique(shard).tolist(), key=lambda s: s not in done):  # passed ones first
                    sel = np.flatnonzero(shard == s)
                    v = self.view(s)
                    cont, cat, targets = v.gather(v.starts[idx[sel] - self._first[s]])
                    dst[0][sel], dst[1][sel] = cont, cat
                    for o, part in zip(dst[2], targets):
                        o[sel] = part
                    del v
                    if s in done:
                        self.release_shard(s)
                got = dst
        if out is not None:
            return out
        cont, cat, targets = got
        return Batch(torch.from_numpy(cont), torch.from_numpy(cat), tuple(torch.from_numpy(t) for t in targets))

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

    def each_shard(self, fn, until=None) -> list:
        """[fn(view, shard index) for every shard, in order], one shard at a time: a streamed shard is
        released before the next is opened (which is read ahead meanwhile when the cache has room), so a
        pass over a split many times the cache holds one or two of its shards. `until`: a function of
        nothing; once it is true, no further shard is opened."""
        out = []
        held = self.open_shards  # a loader's, if one is under way: left as they are
        try:
            for s in range(self.n_shards):
                if until is not None and until():
                    break
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

    def window_keys(self) -> dict[str, np.ndarray]:
        """Per window, in window order: its shard, the segment (sequence) of its target row in that shard,
        the target row, and that row's `order` value (-1 when the shard has no order)."""

        def keys(v: ShardView, s: int):
            row = np.asarray(v.starts) + v.shift
            segment = np.searchsorted(np.asarray(v.arrays["offsets"]), row, side="right") - 1
            return row, segment, v.order_of_rows(row)

        parts = self.each_shard(keys)
        shard = np.repeat(np.arange(self.n_shards, dtype=np.int64), np.diff(self._first))
        cat = lambda i: np.concatenate([p[i] for p in parts]).astype(np.int64) if parts else np.zeros(0, np.int64)
        return {"shard": shard, "segment": cat(1), "row": cat(0), "order": cat(2)}


def manifest_folder(manifest_uri: str) -> str:
    """The folder a manifest's relative shard paths are resolved against (`storage.resolve`: a shard in
    the group store is `../groups/<key>/<split>.bin.lz4`, an older data set's lies beside its manifest)."""
    uri = manifest_uri.rstrip("/")
    return uri.rsplit("/", 1)[0] if "/" in uri else "."


def open_split(
    manifest: Manifest,
    manifest_uri: str,
    split: str | list[str] | tuple[str, ...],
    cache: ShardCache | None = None,
) -> SplitData:
    """The windows of `split`, or of several splits as one (k-fold: the folds a run trains on).

    When the split fits in half the size-capped local cache, its shards are fetched (checked against
    their sha256), unpacked, mapped from their own codes to the data set's encoding
    (`shardline/core/codes.py`) and laid end to end into one *split pack* in the cache (built once,
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
        arrays = read_arrays(Path(local_path(uris[0])), info.arrays)
        view = _checked_view(arrays, info, enc.window, enc.horizon, enc.target_positions)
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
                with unpacked(uris[n], info.sha256, info.compression, info.raw_bytes, Path(f"{tmp}.{n}")) as raw:
                    glob.write(raw, info, fd, own_specs[n])  # the data set's encoding, as rows, a chunk at a time

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
    buffer = map_file(pack)
    refs = []
    for info, specs in zip(shards, own_specs):
        view = _checked_view(arrays_in(buffer, specs), info, enc.window, enc.horizon, enc.target_positions)
        refs.append(_Ref(info.windows, view))
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


def _checked_view(arrays: dict[str, np.ndarray], info, window: int, horizon: int, positions: str) -> ShardView:
    """A manifest's shard viewed as windows: as many as the manifest lists, or an error saying what to re-run."""
    view = ShardView(arrays, window, horizon, name=f"shard {info.path}", positions=positions)
    if len(view.starts) != info.windows:
        raise ValueError(
            f"shard {info.path}: the manifest lists {info.windows} windows but its offsets give {len(view.starts)} "
            f"(window={window}, horizon={horizon}); the manifest and shard disagree: re-run the encode step "
            "(shardline run CONFIG --force encode)"
        )
    return view
