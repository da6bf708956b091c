"""The shard file: named arrays laid end to end, 64-byte aligned, memory-mappable.

The layout (dtype, shape, byte offset per array) lives in the manifest's `ShardInfo`, so a shard
is one plain binary file: one checksum, one atomic rename, one sequential read.
"""

from __future__ import annotations

import os
import threading
import weakref
from pathlib import Path

import numpy as np

from shardline.core.config import settings
from shardline.core.manifest import ArraySpec

ALIGN = 64


def layout(arrays: dict[str, tuple[str, list[int]]]) -> tuple[int, dict[str, ArraySpec]]:
    """Byte offsets of named arrays laid end to end, each 64-byte aligned: (total size, specs)."""
    specs: dict[str, ArraySpec] = {}
    offset = 0
    for name, (dtype, shape) in arrays.items():
        offset += (-offset) % ALIGN
        specs[name] = ArraySpec(dtype=np.dtype(dtype).str, shape=[int(d) for d in shape], offset=offset)
        offset += int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    return offset, specs


def allocate(
    arrays: dict[str, tuple[str, list[int]]],
) -> tuple[memoryview, dict[str, ArraySpec], dict[str, np.ndarray]]:
    """A shard file's buffer, its layout and a writable view of each array in it: an encoder fills
    the arrays in place, so the file's bytes exist once, never copied into a file image afterwards.
    The padding between arrays is zeroed (deterministic files); the arrays are left for the caller."""
    size, specs = layout(arrays)
    buf = np.empty(size, dtype=np.uint8)
    views: dict[str, np.ndarray] = {}
    end = 0
    for name, s in specs.items():
        buf[end : s.offset] = 0
        dt = np.dtype(s.dtype)
        n = int(np.prod(s.shape, dtype=np.int64))
        views[name] = buf[s.offset : s.offset + n * dt.itemsize].view(dt).reshape(s.shape)
        end = s.offset + n * dt.itemsize
    return memoryview(buf), specs, views


CODECS = ("lz4", "zstd")  # how a stored shard may be compressed (pyarrow's codecs: LZ4 frames, zstd level 1)
ZSTD_LEVEL = 1  # higher levels barely shrink encoded frames further


def compress_bytes(data, codec: str) -> memoryview:
    """`data` compressed with `codec`: a view of pyarrow's buffer (no copy into a bytes object),
    cut to the compressed size (the buffer's memory view spans its whole capacity)."""
    import pyarrow as pa

    out = (pa.Codec("zstd", ZSTD_LEVEL) if codec == "zstd" else pa.Codec(codec)).compress(data)
    return memoryview(out)[: out.size]


def _unpacking(what: str, codec: str, raw_bytes: int):
    """pyarrow, once `codec` is known to be one this Shardline reads; and the check of the unpacked size."""
    import pyarrow as pa

    if codec not in CODECS:
        raise ValueError(
            f"{what}: unknown shard compression {codec!r}; this Shardline reads {' or '.join(CODECS)} or none"
        )

    def check(n: int) -> None:
        if n != raw_bytes:
            raise OSError(f"{what}: unpacked to {n} bytes, the manifest says {raw_bytes}; re-run the encode step")

    return pa, check


def unpack_bytes(data: bytes, raw_bytes: int, what: str, codec: str) -> bytes:
    pa, check = _unpacking(what, codec, raw_bytes)
    out = pa.Codec(codec).decompress(data, decompressed_size=raw_bytes, asbytes=True)
    check(len(out))
    return out


def unpack_file(src: str | Path, dest: str | Path, raw_bytes: int, what: str, codec: str) -> None:
    """Unpack the compressed file `src` into `dest` a block at a time: neither is ever whole in memory."""
    pa, check = _unpacking(what, codec, raw_bytes)
    n = 0
    with pa.CompressedInputStream(str(src), codec) as stream, open(dest, "wb") as out:
        while block := stream.read(8 << 20):
            n += out.write(block)
    check(n)


def arrays_in(buffer, specs: dict[str, ArraySpec]) -> dict[str, np.ndarray]:
    """Views of the arrays laid out by `specs` in `buffer` (bytes, an mmap.mmap: zero copy)."""
    out: dict[str, np.ndarray] = {}
    for name, s in specs.items():
        dt = np.dtype(s.dtype)
        n = int(np.prod(s.shape))
        out[name] = (
            np.zeros(s.shape, dtype=dt)
            if n == 0
            else np.frombuffer(buffer, dtype=dt, count=n, offset=s.offset).reshape(s.shape)
        )
    return out


def map_file(path: str | Path):
    """The whole file as a read-only, memory-mapped buffer."""
    import mmap

    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return b""
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


RESIDENT_ENV = "SHARDLINE_RESIDENT_MB"
# what one read fault may map of a file mapping: a PMD (2 MiB; a large page-cache folio is mapped whole)
# or, without large folios, the fault-around window (64 KiB): counting in 2 MiB blocks is an upper bound
FAULT_BLOCK = 2 << 20
SEQUENTIAL_KEEP = 16 << 20  # what a pass in order keeps mapped of what it has read (`MappedPages.passed`)


def resident_budget() -> int:
    """Bytes of memory-mapped split packs a process keeps mapped in (counted in its RSS):
    `SHARDLINE_RESIDENT_MB`, default 128; 0: no bound."""
    return int(settings.number(RESIDENT_ENV) * 1e6)


class MappedPages:
    """The pages of read-only file mappings that this process has read, kept under one budget.

    A page of a memory-mapped file that is read stays mapped in the process, and RSS counts it, until the
    mapping is closed: a training that reads every window of a 400 MB split pack shows 400 MB more in `top`
    than one over a 40 MB pack, although they are clean pages of the page cache. Readers note what they read
    (`read`: byte ranges of the mapping, after reading them); when the blocks read since the last drop, in
    every mapping under this budget, pass the budget, each is dropped (`madvise(MADV_DONTNEED)`): the pages
    leave the process, not the page cache, and a later read maps them again from it (a minor fault). The
    mapping is read-only and shared, so what a read returns never changes, whichever thread reads it while
    another drops. The budget holds to within what one `read` call adds (a batch gather).

    A read right after a drop measures what one read maps (`footprint`). A mapping whose reads map more than
    the budget, twice in a row (a global shuffle of a pack larger than that: every batch reads all over it) is
    left alone from then on (`scattered`): dropping it would only make the next batch fault its pages in
    again, at a cost and for no lower peak. Its pages then stay mapped, as without a budget."""

    _lock = threading.Lock()
    _all: weakref.WeakSet = weakref.WeakSet()  # the mappings under the budget, in this process
    _counted = 0  # blocks read since the last drop, in all of them
    drops = 0  # how many times the budget was passed

    def __init__(self, buffer, budget: int):
        self._buffer = buffer
        self.budget = int(budget)
        self._base = int(np.frombuffer(buffer, np.uint8, count=1).__array_interface__["data"][0]) if len(buffer) else 0
        self._first = self._base // FAULT_BLOCK  # blocks are aligned in the address space, as faults map them
        self.size = len(buffer)
        self._read = np.zeros((self._base + max(self.size, 1) - 1) // FAULT_BLOCK - self._first + 1, dtype=bool)
        self.footprint = 0  # bytes one read mapped into the empty mapping (the last measure; 0: none yet)
        self.scattered = False
        self._measure = True  # the next read measures the footprint
        with MappedPages._lock:
            MappedPages._all.add(self)

    def offset_of(self, a: np.ndarray) -> int:
        """Where array `a` (a view of this mapping) starts in it, in bytes."""
        off = int(a.__array_interface__["data"][0]) - self._base
        if not 0 <= off <= self.size - a.nbytes:
            raise ValueError("the array is not a view of this mapping")
        return off

    def read(self, spans) -> None:
        """Note that bytes [start, start + length) of the mapping were read, for each (starts, length) in
        `spans` (`starts`: an array of byte offsets); drop every mapping once the budget is passed."""
        ids = []
        for starts, length in spans:
            if length <= 0 or not len(starts):
                continue
            lo = (np.asarray(starts, dtype=np.int64) + self._base) // FAULT_BLOCK - self._first
            hi = (np.asarray(starts, dtype=np.int64) + (self._base + length - 1)) // FAULT_BLOCK - self._first
            ids.append(lo)
            extra = (length - 1) // FAULT_BLOCK + 1  # blocks after the first that a range may reach
            for k in range(1, extra + 1):
                ids.append(np.minimum(lo + k, hi))
        if not ids:
            return
        ids = np.concatenate(ids)
        with MappedPages._lock:
            if self.scattered:
                return
            fresh = ids[~self._read[ids]]
            if not fresh.size:
                return
            before = int(np.count_nonzero(self._read))
            self._read[fresh] = True
            new = int(np.count_nonzero(self._read)) - before
            MappedPages._counted += new
            if self._measure:
                self._measure = False
                last, self.footprint = self.footprint, new * FAULT_BLOCK
                if min(last, self.footprint) > self.budget:  # reads map more than the budget: no drop keeps it
                    self.scattered = True
                    MappedPages._counted = max(0, MappedPages._counted - before - new)
                    self._read[:] = False
                    return
            if MappedPages._counted * FAULT_BLOCK > self.budget:
                MappedPages._drop_all()

    def passed(self) -> None:
        """A pass in order (evaluation, validation) is past what it has read of this mapping: once that is more
        than `SEQUENTIAL_KEEP` bytes, drop it. Nothing behind the pass is read again, so the pass holds that much of
        the pack mapped instead of the whole budget (a 2,000-game test split's evaluation peaked ~95 MB lower)."""
        with MappedPages._lock:
            if not self.scattered and int(np.count_nonzero(self._read)) * FAULT_BLOCK > SEQUENTIAL_KEEP:
                self._drop()

    def drop(self) -> None:
        """Drop this mapping's pages from the process (they stay in the page cache)."""
        with MappedPages._lock:
            self._drop(always=True)  # pages read without a note (a pass over whole arrays) go too

    def _drop(self, always: bool = False) -> None:
        import mmap

        n = int(np.count_nonzero(self._read))
        if (n or always) and isinstance(self._buffer, mmap.mmap) and not self._buffer.closed:
            self._buffer.madvise(mmap.MADV_DONTNEED)
        self._read[:] = False
        self._measure = True
        MappedPages._counted = max(0, MappedPages._counted - n)

    @classmethod
    def _drop_all(cls) -> None:
        for pages in list(cls._all):
            if not pages.scattered:
                pages._drop()
        cls._counted = 0
        cls.drops += 1


JOINED = ("cont", "cat", "target")


def _joined_rank(name: str) -> int | None:
    """Where a joined array goes in a split pack (cont, cat, target, target_1, ...); None: not joined."""
    if name in JOINED:
        return JOINED.index(name)
    if name.startswith("target_") and name[7:].isdigit():
        return len(JOINED) + int(name[7:])
    return None


def pack_layout(shards: list[dict[str, ArraySpec]]) -> tuple[int, dict[str, ArraySpec], list[dict[str, ArraySpec]]]:
    """Where the arrays of several shards go in one *split pack*: each array concatenated across the
    shards along its rows (cont, cat and target first), so a split's windows are one array each and
    a batch is one gather, whichever shards it draws from. Returns (file size, the joined cont/cat/
    target specs, each shard's own specs inside the pack)."""
    regions: dict[tuple, list[int]] = {}  # (name, dtype, row shape) -> rows of each shard that has it
    for specs in shards:
        for name, s in specs.items():
            regions.setdefault((name, s.dtype, tuple(s.shape[1:])), [])
    rank = {r: _joined_rank(r[0]) for r in regions}
    order = sorted(regions, key=lambda r: (rank[r] is None, rank[r] or 0, r))
    for name in {r[0] for r in order if rank[r] is not None}:
        if sum(1 for r in order if r[0] == name) > 1:
            raise ValueError(
                f"the shards store '{name}' in different types or widths; the shards of a split must share one encoding"
            )
    row_bytes = {r: int(np.prod(r[2], dtype=np.int64)) * np.dtype(r[1]).itemsize for r in order}
    offset = 0
    base: dict[tuple, int] = {}
    rows: dict[tuple, int] = {}
    for r in order:
        offset += (-offset) % ALIGN
        base[r] = offset
        rows[r] = sum(
            int(specs[r[0]].shape[0])
            for specs in shards
            if r[0] in specs and (specs[r[0]].dtype, tuple(specs[r[0]].shape[1:])) == r[1:]
        )
        offset += rows[r] * row_bytes[r]
    at = dict.fromkeys(order, 0)
    per_shard = []
    for specs in shards:
        mine = {}
        for name, s in specs.items():
            r = (name, s.dtype, tuple(s.shape[1:]))
            mine[name] = ArraySpec(dtype=s.dtype, shape=list(s.shape), offset=base[r] + at[r] * row_bytes[r])
            at[r] += int(s.shape[0])
        per_shard.append(mine)
    joined = {r[0]: ArraySpec(dtype=r[1], shape=[rows[r], *r[2]], offset=base[r]) for r in order if rank[r] is not None}
    return offset, joined, per_shard


def read_arrays(path: str | Path, specs: dict[str, ArraySpec]) -> dict[str, np.ndarray]:
    """Open a shard's arrays, memory-mapped (zero copy)."""
    return arrays_in(map_file(path), specs)


def _window_counts(offsets: np.ndarray, window: int, horizon: int) -> np.ndarray:
    lengths = np.diff(np.asarray(offsets, dtype=np.int64))
    span = window + horizon  # rows a window needs, target row included (horizon 0: target is the last row)
    return np.maximum(lengths - span + 1, 0)


def segment_lengths(offsets: np.ndarray) -> list[list[int]]:
    """A shard's segment lengths as [length, count] pairs, ascending: its windows for any window and horizon
    follow from them (`window_tally`), so its bytes need not depend on either."""
    lengths, counts = np.unique(np.diff(np.asarray(offsets, dtype=np.int64)), return_counts=True)
    return [[int(n), int(c)] for n, c in zip(lengths, counts)]


def window_tally(lengths: list[list[int]], window: int, horizon: int) -> dict[str, int]:
    """From `segment_lengths`: how many windows `window_starts` finds, and the segments too short for one and their
    rows."""
    n = np.asarray(lengths, dtype=np.int64).reshape(-1, 2)
    span = window + horizon
    long, short = n[n[:, 0] >= span], n[n[:, 0] < span]
    return {
        "windows": int(((long[:, 0] - span + 1) * long[:, 1]).sum()),
        "short_segments": int(short[:, 1].sum()),
        "short_rows": int((short[:, 0] * short[:, 1]).sum()),
    }


def window_starts(offsets: np.ndarray, window: int, horizon: int) -> np.ndarray:
    """Start row of every window: K rows inside one segment, whose target row (start+K-1+horizon) is too."""
    offsets = np.asarray(offsets, dtype=np.int64)
    counts = _window_counts(offsets, window, horizon)
    lengths = np.diff(offsets)
    if counts.sum() == 0:
        return np.zeros(0, dtype=np.int64)
    seg = np.repeat(np.arange(len(lengths)), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    return offsets[:-1][seg] + (np.arange(counts.sum()) - first)
