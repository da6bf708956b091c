"""The shard file: named arrays laid end to end, 64-byte aligned, memory-mappable.

The layout (dtype, shape, byte offset per array) lives in the manifest's `ShardInfo`, so a shard
is one plain binary file: one checksum, one atomic rename, one sequential read.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

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


def pack_bytes(arrays: dict[str, np.ndarray]) -> tuple[memoryview, dict[str, ArraySpec]]:
    """The shard file's bytes, built in memory (one copy of each array), and its layout."""
    buf, specs, views = allocate({name: (arr.dtype, arr.shape) for name, arr in arrays.items()})
    for name, arr in arrays.items():
        views[name][...] = arr
    return buf, specs


def write_arrays(path: str | Path, arrays: dict[str, np.ndarray]) -> dict[str, ArraySpec]:
    """Write arrays into one file at `path` (a staging file: the caller publishes it)."""
    buf, specs = pack_bytes(arrays)
    with open(path, "wb") as f:
        f.write(buf)
    return specs


CODECS = ("lz4", "zstd")  # how a stored shard may be compressed (pyarrow's codecs: LZ4 frames, zstd level 1)
ZSTD_LEVEL = 1  # higher levels barely shrink encoded frames further


def compress_bytes(data, codec: str) -> memoryview:
    """`data` compressed with `codec`: a view of pyarrow's buffer (no copy into a bytes object),
    cut to the compressed size (the buffer's memory view spans its whole capacity)."""
    import pyarrow as pa

    out = (pa.Codec("zstd", ZSTD_LEVEL) if codec == "zstd" else pa.Codec(codec)).compress(data)
    return memoryview(out)[: out.size]


def decompress_file(src: str | Path, dest: str | Path, raw_bytes: int, codec: str) -> None:
    out = unpack_bytes(Path(src).read_bytes(), raw_bytes, str(src), codec)
    with open(dest, "wb") as f:
        f.write(out)


def unpack_bytes(data: bytes, raw_bytes: int, what: str, codec: str) -> bytes:
    import pyarrow as pa

    if codec not in CODECS:
        raise ValueError(
            f"{what}: unknown shard compression {codec!r}; this Shardline reads {' or '.join(CODECS)} or none"
        )
    out = pa.Codec(codec).decompress(data, decompressed_size=raw_bytes, asbytes=True)
    if len(out) != raw_bytes:
        raise OSError(f"{what}: unpacked to {len(out)} bytes, the manifest says {raw_bytes}; re-run the encode step")
    return out


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


def map_file(path: str | Path, mmap_it: bool = True):
    """The whole file as a read-only buffer: memory-mapped, or read into memory."""
    import mmap

    if not mmap_it:
        return Path(path).read_bytes()
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            return b""
        return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)


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
    offset = 0
    base: dict[tuple, int] = {}
    rows: dict[tuple, int] = {}
    for r in order:
        offset += (-offset) % ALIGN
        base[r] = offset
        n = sum(
            int(specs[r[0]].shape[0])
            for specs in shards
            if r[0] in specs and (specs[r[0]].dtype, tuple(specs[r[0]].shape[1:])) == r[1:]
        )
        rows[r] = n
        offset += n * int(np.prod(r[2], dtype=np.int64)) * np.dtype(r[1]).itemsize
    at = dict.fromkeys(order, 0)
    per_shard = []
    for specs in shards:
        mine = {}
        for name, s in specs.items():
            r = (name, s.dtype, tuple(s.shape[1:]))
            row_bytes = int(np.prod(r[2], dtype=np.int64)) * np.dtype(r[1]).itemsize
            mine[name] = ArraySpec(dtype=s.dtype, shape=list(s.shape), offset=base[r] + at[r] * row_bytes)
            at[r] += int(s.shape[0])
        per_shard.append(mine)
    joined = {r[0]: ArraySpec(dtype=r[1], shape=[rows[r], *r[2]], offset=base[r]) for r in order if rank[r] is not None}
    return offset, joined, per_shard


def read_arrays(path: str | Path, specs: dict[str, ArraySpec], mmap: bool = True) -> dict[str, np.ndarray]:
    """Open a shard's arrays: memory-mapped (zero copy) by default."""
    out: dict[str, np.ndarray] = {}
    if mmap:
        for name, s in specs.items():
            if int(np.prod(s.shape)) == 0:
                out[name] = np.zeros(s.shape, dtype=np.dtype(s.dtype))
            else:
                out[name] = np.memmap(path, dtype=np.dtype(s.dtype), mode="r", offset=s.offset, shape=tuple(s.shape))
        return out
    data = Path(path).read_bytes()
    for name, s in specs.items():
        dt = np.dtype(s.dtype)
        n = int(np.prod(s.shape))
        out[name] = np.frombuffer(data, dtype=dt, count=n, offset=s.offset).reshape(s.shape)
    return out


def _window_counts(offsets: np.ndarray, window: int, horizon: int) -> np.ndarray:
    lengths = np.diff(np.asarray(offsets, dtype=np.int64))
    span = max(window + horizon, window)  # rows a window needs, target row included (horizon 0: target is the last row)
    return np.maximum(lengths - span + 1, 0)


def window_count(offsets: np.ndarray, window: int, horizon: int) -> int:
    """How many windows `window_starts` finds, without listing them."""
    return int(_window_counts(offsets, window, horizon).sum())


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
