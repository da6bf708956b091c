"""The shard file: named arrays laid end to end, 64-byte aligned, memory-mappable.

The layout (dtype, shape, byte offset per array) lives in the manifest's `ShardInfo`, so a shard
is one plain binary file: one checksum, one atomic rename, one sequential read.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shardline.manifest import ArraySpec

ALIGN = 64


def write_arrays(path: str | Path, arrays: dict[str, np.ndarray]) -> dict[str, ArraySpec]:
    """Write arrays into one file at `path` (a staging file: the caller publishes it)."""
    specs: dict[str, ArraySpec] = {}
    offset = 0
    with open(path, "wb") as f:
        for name, arr in arrays.items():
            arr = np.ascontiguousarray(arr)
            pad = (-offset) % ALIGN
            if pad:
                f.write(b"\0" * pad)
                offset += pad
            specs[name] = ArraySpec(dtype=arr.dtype.str, shape=list(arr.shape), offset=offset)
            f.write(arr.tobytes())
            offset += arr.nbytes
    return specs


ZSTD_LEVEL = 1  # ~1 GB/s to unpack; higher levels barely shrink encoded frames further


def compress_file(src: str | Path, dest: str | Path) -> None:
    import pyarrow as pa

    data = Path(src).read_bytes()
    Path(dest).write_bytes(pa.Codec("zstd", ZSTD_LEVEL).compress(data, asbytes=True))


def decompress_file(src: str | Path, dest: str | Path, raw_bytes: int) -> None:
    import pyarrow as pa

    out = pa.Codec("zstd").decompress(Path(src).read_bytes(), decompressed_size=raw_bytes, asbytes=True)
    if len(out) != raw_bytes:
        raise IOError(f"{src}: unpacked to {len(out)} bytes, the manifest says {raw_bytes}; re-run the encode step")
    with open(dest, "wb") as f:
        f.write(out)


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


def window_starts(offsets: np.ndarray, window: int, horizon: int) -> np.ndarray:
    """Start row of every window: K rows inside one segment, whose target row (start+K-1+horizon) is too."""
    offsets = np.asarray(offsets, dtype=np.int64)
    lengths = np.diff(offsets)
    span = window + horizon  # rows a window needs, target row included (horizon 0: target is the last row)
    span = max(span, window)
    counts = np.maximum(lengths - span + 1, 0)
    if counts.sum() == 0:
        return np.zeros(0, dtype=np.int64)
    seg = np.repeat(np.arange(len(lengths)), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    return offsets[:-1][seg] + (np.arange(counts.sum()) - first)
