"""A shard's own codes -> the data set's encoding, applied when a shard is unpacked for reading.

The encode reads every raw file once: each file group is encoded with its own statistics (mean and
std per continuous column) and its own ids (per categorical column, and for a class target), while
the training rows' sufficient statistics and value counts are gathered on the way. The data set's
encoding (`EncodingSpec`) is fitted from those once every group is done, and it maps each shard's
codes exactly: a continuous value v standardised locally as (x - m) / s becomes
v * (s / S) + (m - M) / S = (x - M) / S, and an id becomes the data set's id of the same value
(0 when training never saw it). Readers apply the map when they build a split pack or fetch a
streamed shard into the local cache; they already touch every byte there, so it costs one pass
over the arrays (`benchmarks/data_bench.py` reports it in the time to the first batch).

numpy (and torch for the float16 arithmetic) only: the training host needs neither polars nor pyarrow
to read shards.
"""

from __future__ import annotations

import mmap
import os
import warnings

import numpy as np

from shardline.core.manifest import ArraySpec, EncodingSpec, LocalCodes, LocalVocab, ShardInfo, target_array
from shardline.core.shards import arrays_in, layout

CHUNK_BYTES = 16 << 20  # rows mapped at a time when a shard is written in the data set's encoding (`write`)


def int_dtype(max_value: int) -> np.dtype:
    """The narrowest type for ids 0..max_value (ids are never negative: unsigned where torch reads it)."""
    for dt in (np.uint8, np.int16, np.int32):
        if max_value <= np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.int64)


class Globaliser:
    """Maps shards' own codes to one `EncodingSpec` (build one per spec: it indexes the vocabularies)."""

    def __init__(self, spec: EncodingSpec):
        self.spec = spec
        self.cont_dtype = np.dtype(np.float16 if spec.continuous_dtype == "float16" else np.float32)
        card = spec.cat_cardinalities
        self.cat_dtype = int_dtype(max(card) if card else 1)
        self.target_dtypes = {
            target_array(i): int_dtype(t.n_outputs) if t.task == "classification" else np.dtype(np.float32)
            for i, t in enumerate(spec.targets)
        }
        self._ids = [{v: i + 1 for i, v in enumerate(voc.values)} for voc in spec.categorical]
        self._classes = [{v: i + 1 for i, v in enumerate(t.classes or [])} for t in spec.targets]

    # ------------------------------------------------------------ layout

    def specs(self, info: ShardInfo) -> dict[str, ArraySpec]:
        """The arrays of `info`'s shard as readers see them (the stored layout when it holds no own codes):
        `cont` [rows, columns] and `cat` [rows, columns] in the data set's types, the rest as stored."""
        if info.local is None:
            return info.arrays
        out: dict[str, tuple[str, list[int]]] = {}
        for name, s in info.arrays.items():
            if name == "cont_cols":
                out["cont"] = (self.cont_dtype.str, [s.shape[1], s.shape[0]])
            elif name == "cat_cols":
                out["cat"] = (self.cat_dtype.str, [s.shape[1], s.shape[0]])
            elif name in self.target_dtypes:
                out[name] = (self.target_dtypes[name].str, s.shape)
            else:
                out[name] = (s.dtype, s.shape)
        return layout(out)[1]

    def nbytes(self, info: ShardInfo) -> int:
        if info.local is None:
            return int(info.raw_bytes or info.bytes)
        return layout({n: (s.dtype, s.shape) for n, s in self.specs(info).items()})[0]

    # ------------------------------------------------------------ values

    def _remap(self, voc: LocalVocab, ids: dict[str, int], dtype: np.dtype) -> np.ndarray:
        return np.array([0, *(ids.get(t, 0) for t in voc.texts())], dtype=dtype)

    def _affine(
        self, x: np.ndarray, local: list[tuple[float, float]], stats: list[tuple[float, float]], dtype: np.dtype
    ) -> np.ndarray:
        """Columns x [columns, rows] (or one column [rows]) -> x * (s / S) + (m - M) / S as rows
        [rows, columns], NaN (a null) -> 0, computed in float32 and rounded once to `dtype`."""
        import torch

        x = np.asarray(x)
        one = x.ndim == 1
        cols = x.reshape(1, -1) if one else x
        out = torch.empty((cols.shape[1], cols.shape[0]), dtype=torch.float16 if dtype == np.float16 else torch.float32)
        if cols.size:
            scale = torch.tensor([[s / gs] for (_, s), (_, gs) in zip(local, stats)], dtype=torch.float32)
            shift = torch.tensor([[(m - gm) / gs] for (m, _), (gm, gs) in zip(local, stats)], dtype=torch.float32)
            with warnings.catch_warnings():  # a read-only (memory-mapped) array: only read here
                warnings.simplefilter("ignore", UserWarning)
                y = torch.from_numpy(cols).to(torch.float32, copy=True)
            y.mul_(scale).add_(shift)
            y.nan_to_num_(nan=0.0, posinf=float("inf"), neginf=float("-inf"))
            out.copy_(y.T)  # rows, rounded once
        return out.numpy().reshape(-1) if one else out.numpy()

    def arrays(self, arrays: dict[str, np.ndarray], codes: LocalCodes | None) -> dict[str, np.ndarray]:
        """A shard's arrays in the data set's encoding: `cont` and `cat` as rows (new arrays), the
        target mapped, the rest as stored."""
        if codes is None:
            return arrays
        spec = self.spec
        out = {k: v for k, v in arrays.items() if k not in ("cont_cols", "cat_cols")}
        out["cont"] = self._affine(
            arrays["cont_cols"], codes.cont, [(c.mean, c.std) for c in spec.continuous], self.cont_dtype
        )
        cat = np.asarray(arrays["cat_cols"])
        g = np.empty((cat.shape[1], cat.shape[0]), self.cat_dtype)
        n_cat = len(spec.categorical)
        for j, (voc, ids) in enumerate(zip(codes.cat, self._ids)):
            np.take(self._remap(voc, ids, self.cat_dtype), cat[j], out=g[:, j])
        g[:, n_cat:] = cat[n_cat:].T  # booleans: 0 null, 1 false, 2 true everywhere
        out["cat"] = g
        for i, (t, code) in enumerate(zip(spec.targets, codes.targets)):
            name = target_array(i)
            if t.task == "classification":
                out[name] = self._remap(code, self._classes[i], self.target_dtypes[name])[np.asarray(arrays[name])]
            else:
                out[name] = self._affine(arrays[name], [tuple(code)], [(t.mean, t.std)], np.dtype(np.float32))
        return out

    def write(self, raw, info: ShardInfo, fd: int, specs: dict[str, ArraySpec] | None = None) -> None:
        """Write an unpacked shard's arrays (`raw`, laid out as `info.arrays`) in the data set's encoding into
        the open file `fd`, each at its offset in `specs` (default: `specs(info)`, a file of its own) and
        `CHUNK_BYTES` of rows at a time: the mapped arrays are never whole in memory, and the pages of a
        memory-mapped `raw` leave the process after each chunk (a streamed shard is fetched while the loader
        reads the shards before it: what the fetch holds adds to what they hold)."""
        specs = specs or self.specs(info)
        arrays = arrays_in(raw, info.arrays)

        def put(name: str, a: np.ndarray, row: int) -> None:
            if a.nbytes:
                per_row = int(np.prod(specs[name].shape[1:], dtype=np.int64)) * a.itemsize
                os.pwrite(fd, np.ascontiguousarray(a).reshape(-1).view(np.uint8), specs[name].offset + row * per_row)

        mapped = () if info.local is None else ("cont_cols", "cat_cols", *self.target_dtypes)
        for name, a in arrays.items():  # offsets, order: as stored
            if name not in mapped:
                put(name, a, 0)
        if info.local is None:
            return
        cols = max([int(arrays[n].shape[0]) for n in ("cont_cols", "cat_cols") if n in arrays] + [1])
        step = max(1, CHUNK_BYTES // (8 * cols))
        for lo in range(0, int(info.rows), step):
            part = {n: a[..., lo : lo + step] for n, a in arrays.items() if n in mapped}
            for name, a in self.arrays(part, info.local).items():
                put(name, a, lo)
            if isinstance(raw, mmap.mmap):  # a mapped file: the pages read so far leave this process
                raw.madvise(mmap.MADV_DONTNEED)
