"""The encode step's encoder: a file group's rows, split (shardline.core.encoding.splits.split_rows),
coded once in the group's own codes straight into each split's shard buffer, with the training
rows' statistics that the data set's encoding is fitted from (shardline.core.encoding.fit)."""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np
import polars as pl

from shardline.core.codes import int_dtype
from shardline.core.config import DataConfig
from shardline.core.encoding.columns import ORDER, as_number
from shardline.core.encoding.fit import moments as stat_moments
from shardline.core.encoding.splits import SplitRows
from shardline.core.manifest import ArraySpec, LocalCodes, LocalVocab, pack_ints, target_array
from shardline.core.shards import allocate


class EncodedSplit(NamedTuple):
    """One split of a group, encoded: its shard file's bytes (`buffer`), their layout (`specs`), views
    of the arrays in the buffer, its sequences' keys, the group's own codes, and for the training split
    its rows' statistics (None for the others)."""

    buffer: memoryview
    specs: dict[str, ArraySpec]
    arrays: dict[str, np.ndarray]
    keys: list[str]
    codes: LocalCodes
    stats: dict | None


_torch_lock = threading.Lock()
_torch_users = 0
_torch_threads = 0


@contextmanager
def one_torch_thread():
    """Torch ops on this thread run single-threaded meanwhile. The encode's parallelism is its file
    groups: torch's own intra-op threads on top of them only spin against each other (measured:
    the encode 20-30% slower on 2 cores with them). torch keeps a thread count per thread, set
    from a process default that `set_num_threads` also changes: the default is restored for the
    threads that come later once no encode runs, and each thread restores its own on the way out.

    A thread takes its count from the process default at its first torch call that reads it (a lazy
    init that `set_num_threads` does not count as one), so a new thread's own `set_num_threads(1)` was
    overwritten by the default another thread had restored meanwhile: the group then summed its columns
    on 2 threads, in another order, and its shards' bytes depended on what ran beside it. The count is
    read first, so the thread's own count is set before it is set to 1."""
    import torch

    global _torch_users, _torch_threads
    with _torch_lock:
        mine = torch.get_num_threads()  # the lazy init, before the count is set (see above)
        if _torch_users == 0:
            _torch_threads = mine
        _torch_users += 1
        torch.set_num_threads(1)
    try:
        yield
    finally:
        with _torch_lock:
            _torch_users -= 1
            torch.set_num_threads(_torch_threads)


RANGE_IDS = 255  # integer columns spanning at most this many values are coded by arithmetic (value - min + 1)
DENSE_SPAN = 1 << 22  # wider integer ranges up to this: dense ids through a lookup table, not a hash


def _local_ids(s: pl.Series, lo, hi) -> tuple[LocalVocab, np.ndarray, int]:
    """(vocabulary, values to code, offset) such that id = value - offset (0 for null): the value
    itself for a narrow integer range, else ids 1.. of the sorted distinct values."""
    if s.dtype.is_integer() and lo is not None:
        lo, hi = int(lo), int(hi)
        x = (s.fill_null(lo - 1) if s.null_count() else s).to_numpy()
        if hi - lo < RANGE_IDS:
            return LocalVocab(start=lo, size=hi - lo + 1), x, lo - 1
        if hi - lo < DENSE_SPAN:
            at = x.astype(np.int64) - (lo - 1)  # 0 = null
            present = np.zeros(hi - lo + 2, bool)
            present[at] = True
            present[0] = False
            ids = np.cumsum(present, dtype=np.int64)
            values = np.flatnonzero(present) + (lo - 1)
            return LocalVocab.of_ints(values), ids[at], 0
    if s.dtype == pl.Utf8:  # the sorted values' positions (an Enum's codes), id = position + 1
        runs = s.rle()  # text columns mostly hold runs (a stage, a team per sequence): code each run once
        if 2 * len(runs) > len(s):
            runs = None
        vals = runs.struct.field("value") if runs is not None else s
        uniq = vals.drop_nulls().unique().sort()
        voc = LocalVocab(size=len(uniq), values=uniq.to_list())
        pos = vals.cast(pl.Enum(voc.values)).to_physical()
        pos = (pos.cast(pl.Int64).fill_null(-1) if vals.null_count() else pos).to_numpy()
        return voc, (np.repeat(pos, runs.struct.field("len").to_numpy()) if runs is not None else pos), -1
    uniq = s.drop_nulls().unique().sort()
    ids = s.replace_strict(
        uniq, pl.Series(np.arange(1, len(uniq) + 1, dtype=np.int64)), default=0, return_dtype=pl.Int64
    )
    voc = (
        LocalVocab.of_ints(uniq.to_numpy())
        if uniq.dtype.is_integer() and (uniq.dtype != pl.UInt64 or not len(uniq) or uniq.max() < 1 << 63)
        else LocalVocab(size=len(uniq), values=uniq.cast(pl.Utf8).to_list())
    )
    return voc, ids.fill_null(0).to_numpy(), 0


def _counts_of(ids: np.ndarray, voc: LocalVocab) -> dict:
    """How many rows hold each value: {value as text: count}, or for a packed vocabulary of integers the values
    counted and their counts, packed (`fit.merged_counts` reads both): a group of a click log held 35,000 item ids
    counted, ~5 MB as a dict until the manifest is written, 0.1 MB packed."""
    if ids.dtype == np.uint8:  # torch counts bytes without widening them first (2x numpy's bincount)
        import torch

        counts = torch.bincount(torch.from_numpy(ids), minlength=voc.size + 1).numpy()[1:]
    else:
        counts = np.bincount(ids, minlength=voc.size + 1)[1:]
    present = np.flatnonzero(counts)
    if voc.ints is not None:
        return {"ints": pack_ints(voc.integers()[present]), "counts": pack_ints(counts[present], deltas=False)}
    texts = voc.texts()
    return {texts[i]: int(counts[i]) for i in present}


def _column_moments(x, nan: bool, torch) -> tuple[int, float, float]:
    """(count, sum, sum of squares) over the non-NaN values of a centred float32 column."""
    if nan:
        count = int((~torch.isnan(x)).sum())
        return count, float(torch.nansum(x)), float(torch.nansum(x * x))
    return len(x), float(x.sum()), float(torch.linalg.vector_norm(x)) ** 2


def _standardise_splits(
    frame: pl.DataFrame, names: list[str], outs: list[tuple[int, int, Any]], train: tuple[int, int] | None, torch
) -> tuple[list[tuple[int, float, float]], list[tuple[float, float]]]:
    """Standardise the continuous columns `names` of a group's rows with the group's own mean and
    std, one column at a time, into each split's array: `outs` holds (first row, end row, the
    split's array [columns, rows], float16 or float32); NaN is kept (it stands for null; so does +-inf). Returns
    each column's (count, mean, variance) over the non-NaN values of the `train` rows, and the
    (mean, std) the stored values decode with: v * std + mean (the exact steps taken).

    A column is copied once out of the read's chunks (`to_numpy`), centred in place on a first
    mean and scaled straight into the splits' arrays: float32 sums in torch's cascades over a
    column that stays in cache, then the moments of the centred values, so there is no
    cancellation even for values far from zero, and one rounding to the stored type. Columns of
    any other type are centred in float64 (a timestamp or a price far from zero keeps its spread).
    Each column is copied and centred once for the whole group, not once per split."""
    n = frame.height
    tmp = None
    moments, affine = [], []
    for j, c in enumerate(names):
        s = frame[c]
        f32 = s.dtype == pl.Float32
        a = (s if f32 else frame.select(as_number(c, s.dtype)).to_series()).to_numpy()
        if not a.flags.writeable or not a.flags.c_contiguous:
            a = np.array(a)
        x = torch.from_numpy(a)
        total = float(x.sum())
        nan = False
        if total != total or total in (float("inf"), float("-inf")):
            # a NaN (a null), or an infinite value: missing too, as it has no mean (it made the column's NaN)
            x.masked_fill_(torch.isinf(x), float("nan"))
            nan = bool(torch.isnan(x).any())
        count = int((~torch.isnan(x)).sum()) if nan else n
        if nan:
            total = float(torch.nansum(x))
        live = max(count, 1)
        if f32:
            m = float(np.float32(total / live))  # the float32 the column is centred on
            xc = x.sub_(m)
        else:
            m = total / live
            tmp = torch.empty(n, dtype=torch.float32) if tmp is None else tmp
            xc = torch.sub(x, m, out=tmp)  # centred in float64, rounded once to float32
        parts = [_column_moments(xc[a0:a1], nan, torch) for a0, a1, _ in outs]  # per split: no pass twice
        r = sum(p[1] for p in parts) / live
        var = max(sum(p[2] for p in parts) / live - r * r, 0.0) if count else 0.0
        std = var**0.5
        inv = float(np.float32(1.0 / std if 1e-12 < std < float("inf") else 1.0))
        for a0, a1, out in outs:
            torch.mul(xc[a0:a1], inv, out=out[j])
        if train is not None:
            # the fitted rows: one split's, or (k-fold) the folds' laid end to end; their sums add up
            fitted = [p for p, (a0, a1, _) in zip(parts, outs) if train[0] <= a0 and a1 <= train[1]]
            tc, tr, tsq = (sum(p[k] for p in fitted) for k in range(3))
            tr /= max(tc, 1)
            # float32 columns: the mean corrected by the centred values' mean (float32 sums drift
            # on long columns); any other column: the mean of its float64 values
            tx = x[train[0] : train[1]]
            tm = m + tr if f32 else float(torch.nansum(tx) if nan else tx.sum()) / max(tc, 1)
            moments.append((tc, tm if tc else 0.0, max(tsq / max(tc, 1) - tr * tr, 0.0) if tc else 0.0))
        affine.append((m, 1.0 / inv))
    return moments, affine


def _bool_codes(s: pl.Series, out: np.ndarray) -> None:
    """A boolean column's codes into `out`: 0 null, 1 false, 2 true (unpacked from arrow's bits)."""
    import pyarrow as pa

    arr = s.rechunk().to_arrow()
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    n = len(arr)
    if n == 0:
        return
    validity, bits = arr.buffers()[:2]

    def unpack(buf) -> np.ndarray:
        return np.unpackbits(np.frombuffer(buf, np.uint8), count=arr.offset + n, bitorder="little")[arr.offset :]

    np.add(unpack(bits), 1, out=out, casting="unsafe")
    if arr.null_count:
        out[unpack(validity) == 0] = 0


def _set_ids(row: np.ndarray, values: np.ndarray, shift: int) -> None:
    """row = values - shift, in row's (unsigned) type: exact whenever the result fits it (the
    arithmetic wraps modulo 2**bits on the way, as it does in any narrow integer type)."""
    u = row.view(np.dtype(f"u{row.dtype.itemsize}"))  # unsigned: wraps instead of overflowing
    u[...] = values
    if shift:
        u -= u.dtype.type(shift % (1 << (8 * u.dtype.itemsize)))


def _local_affine(mean: float, var: float) -> tuple[float, float]:
    std = var**0.5 if var == var and var > 0 else 0.0
    return (mean if mean == mean else 0.0), (std if 1e-12 < std < float("inf") else 1.0)


def order_arrays(order: np.ndarray, offsets: np.ndarray) -> dict[str, np.ndarray]:
    """How a shard stores its rows' order: an `order` that counts up by one inside each sequence
    (frame numbers, row numbers) as each sequence's first value (`order_start`), else per row."""
    if len(order):
        step = np.diff(order) == 1
        step[offsets[1:-1] - 1] = True  # a new sequence may start anywhere
        if step.all():
            return {"order_start": order[offsets[:-1]].astype(np.int64)}
    return {"order": order}


def encode_splits(frame: pl.DataFrame, splits: dict[str, SplitRows], data: DataConfig) -> dict[str, EncodedSplit]:
    """A group's rows and its splits, as `split_rows` gives them -> per split, an `EncodedSplit`: its
    shard file's bytes, their layout, views of the arrays, the segment keys, the codes, and for the
    training split its rows' statistics.

    The group has one set of own codes (a mean and std per continuous column, ids per categorical
    column), shared by its shards: each column is coded once for the whole group and written in
    place into every split's file buffer (`shards.allocate`), the continuous and categorical
    arrays column by column (`cont_cols` [columns, rows], `cat_cols`): that is how the columns
    arrive, it compresses to about half the size of rows, and readers lay them out as rows while
    mapping the codes (`shardline/core/codes.py`). The statistics come from the training rows only."""
    import torch

    n = frame.height
    f = data.features
    # the rows the encoding is fitted on: the train split, or every fold of k-fold data (laid out together)
    fit = [name for name in data.split.fit_splits() if name in splits]
    train = (min(splits[s].first for s in fit), max(splits[s].end for s in fit)) if fit else None

    # categorical ids first (their widths size the files): the group's own ids; booleans: 0 null, 1 false, 2 true
    cats = list(f.categorical)
    schema = frame.schema
    ints = [c for c in cats if schema[c].is_integer()]
    bounds = (
        frame.select(
            [pl.col(c).min().alias(f"lo{i}") for i, c in enumerate(ints)]
            + [pl.col(c).max().alias(f"hi{i}") for i, c in enumerate(ints)]
        ).row(0)
        if ints and n
        else ()
    )
    lo = {c: bounds[i] for i, c in enumerate(ints)} if bounds else {}
    hi = {c: bounds[len(ints) + i] for i, c in enumerate(ints)} if bounds else {}
    coded = [_local_ids(frame[c], lo.get(c), hi.get(c)) for c in cats]
    vocs = [voc for voc, _, _ in coded]
    width = max([voc.size for voc in vocs] + ([2] if f.boolean else []) + [1])

    # each target: a class id in the group's own ids, or a value standardised with its own mean and std
    targets = []  # per target: (code, values to set, shift, stored dtype, training moments)
    for t in data.target_list:
        ts = frame[t.column]
        if t.task == "classification":
            if t.column in cats:  # also a feature: the same ids
                tvoc, tvalues, tshift = vocs[cats.index(t.column)], ("feature", cats.index(t.column)), None
            else:
                bounded = ts.dtype.is_integer() and n
                tvoc, tvalues, tshift = _local_ids(ts, ts.min() if bounded else None, ts.max() if bounded else None)
            targets.append((tvoc, tvalues, tshift, int_dtype(tvoc.size), {}))
        else:
            y = ts.cast(pl.Float64)
            tcode = _local_affine(float(y.mean() or 0.0), float(y.var(ddof=0) or 0.0))
            tstats: dict = {}
            if train is not None:
                yt = y.slice(train[0], train[1] - train[0])
                m, v = float(yt.mean() or 0.0), float(yt.var(ddof=0) or 0.0)
                tstats = stat_moments(yt.len(), m, v * yt.len())
            yz = ((y - tcode[0]) / tcode[1]).cast(pl.Float32).to_numpy()
            targets.append((tcode, yz, None, np.dtype(np.float32), tstats))

    names = list(f.continuous)
    cont_dtype = np.dtype(np.float16 if data.continuous_dtype == "float16" else np.float32)
    order = frame[ORDER].to_numpy().astype(np.int64, copy=False)
    files: dict[str, tuple[memoryview, dict[str, ArraySpec], dict[str, np.ndarray]]] = {}
    for name, (a0, a1, starts, _) in splits.items():  # (first, end, starts, keys)
        offsets = np.append(starts, a1 - a0).astype(np.int64)
        small = order_arrays(order[a0:a1], offsets)
        # the small arrays in the order earlier encoders wrote them (same bytes, same checksums)
        small = {**small, "offsets": offsets} if "order" in small else {"offsets": offsets, **small}
        files[name] = allocate(
            {
                "cont_cols": (cont_dtype, (len(names), a1 - a0)),
                "cat_cols": (int_dtype(width), (len(cats) + len(f.boolean), a1 - a0)),
                **{target_array(i): (tg[3], (a1 - a0,)) for i, tg in enumerate(targets)},
                **{k: (v.dtype, v.shape) for k, v in small.items()},
            }
        )
        for k, v in small.items():
            files[name][2][k][...] = v
    rows = [(a0, a1, files[name][2]) for name, (a0, a1, _, _) in splits.items()]

    # continuous: standardised with the group's own mean and std (NaN for null), straight into the files
    moments, affine = _standardise_splits(
        frame, names, [(a0, a1, torch.from_numpy(arr["cont_cols"])) for a0, a1, arr in rows], train, torch
    )

    stats: dict[str, Any] = {
        "rows": (train[1] - train[0]) if train else 0,
        "continuous": {},
        "categorical": {},
        "targets": [tg[4] for tg in targets],
    }
    for c, (cnt, m, v) in zip(names, moments):
        stats["continuous"][c] = stat_moments(cnt, m, v * cnt)
    for j, (_, values, shift) in enumerate(coded):
        for a0, a1, arr in rows:
            _set_ids(arr["cat_cols"][j], values[a0:a1], shift)
    if f.boolean:
        codes_row = np.empty(n, np.uint8)
        for j, b in enumerate(f.boolean, start=len(cats)):
            _bool_codes(frame[b], codes_row)
            for a0, a1, arr in rows:
                arr["cat_cols"][j] = codes_row[a0:a1]
    for i, (code, values, shift, _, _) in enumerate(targets):
        name = target_array(i)
        for a0, a1, arr in rows:
            if isinstance(values, tuple):  # the class ids of a categorical feature
                arr[name][...] = arr["cat_cols"][values[1]]
            elif isinstance(code, LocalVocab):
                _set_ids(arr[name], values[a0:a1], shift)
            else:
                arr[name][...] = values[a0:a1]
    if train is not None:
        tarrs = [files[s][2] for s in fit]

        def fitted(name: str, j: int | None = None) -> np.ndarray:
            parts = [a[name] if j is None else a[name][j] for a in tarrs]
            return parts[0] if len(parts) == 1 else np.concatenate(parts)

        for j, (c, voc) in enumerate(zip(cats, vocs)):
            stats["categorical"][c] = _counts_of(fitted("cat_cols", j), voc)
        for i, (code, *_rest) in enumerate(targets):
            if isinstance(code, LocalVocab):
                stats["targets"][i] = {"counts": _counts_of(fitted(target_array(i)), code)}
    codes = LocalCodes(cont=affine, cat=vocs, targets=[tg[0] for tg in targets])
    return {
        name: EncodedSplit(
            *files[name], keys=splits[name].keys, codes=codes, stats=stats if fit and name == fit[0] else None
        )
        for name in splits
    }
