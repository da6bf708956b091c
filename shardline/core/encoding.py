"""Raw rows -> encoded arrays. Shared by the encode step (fit on train, write shards) and by the
registered model (raw rows at prediction time), so training and serving encode identically.

Rules (documented in the README):
- continuous: (x - mean) / std with mean/std of the training split; null and NaN become the
  training mean (0 after standardisation); a constant column (std 0) gets std 1.
- boolean: 0 = null, 1 = false, 2 = true (an id in the `cat` array, embedded like a categorical).
- categorical: values compared as strings; id 0 is reserved for values unseen in training and
  for null; ids 1.. follow the training frequency (most frequent first, ties by value).
- target: classification as a vocabulary (id 0 = a class never seen in training); regression
  standardised like a continuous column. A null target is an error, never silently dropped.
"""

from __future__ import annotations

import hashlib
import threading
from collections import Counter
from contextlib import contextmanager
from typing import Any

import numpy as np
import polars as pl

from shardline.core.config import FILE_SEQUENCE, DataConfig, stable_hash
from shardline.core.codes import int_dtype
from shardline.core.manifest import ArraySpec, ContinuousStat, EncodingSpec, LocalCodes, LocalVocab, TargetSpec, Vocabulary
from shardline.core.shards import allocate

SEQ = "__seq"
ORDER = "__order"
SPLIT = "__split"
_MASK64 = (1 << 64) - 1


class DataError(ValueError):
    """Raw data that does not fit the config; the message names the file and the column."""


# ---------------------------------------------------------------- the config side of the encoding


def contract(data: DataConfig) -> dict[str, Any]:
    """What the config decides about the encoding (the fitted statistics come from the data)."""
    return {
        "sequence_key": data.sequence_key,
        "order_by": data.order_by,
        "window": data.window,
        "horizon": data.effective_horizon,
        "continuous": list(data.features.continuous),
        "boolean": list(data.features.boolean),
        "categorical": list(data.features.categorical),
        "target": {"column": data.target.column, "task": data.target.task},
        "continuous_dtype": data.continuous_dtype,
    }


def contract_of(spec: EncodingSpec) -> dict[str, Any]:
    return {
        "sequence_key": spec.sequence_key,
        "order_by": spec.order_by,
        "window": spec.window,
        "horizon": spec.horizon,
        "continuous": [c.name for c in spec.continuous],
        "boolean": list(spec.boolean),
        "categorical": [v.name for v in spec.categorical],
        "target": {"column": spec.target.column, "task": spec.target.task},
        "continuous_dtype": spec.continuous_dtype,
    }


def contract_hash(contract_dict: dict) -> str:
    return stable_hash(contract_dict)


def contract_differences(expected: dict, found: dict) -> list[str]:
    """Human-readable list of what differs between the config's contract and a manifest's."""
    out = []
    for key in sorted(set(expected) | set(found)):
        if expected.get(key) != found.get(key):
            out.append(f"data.{key}: the shards were encoded with {found.get(key)!r}, the config says {expected.get(key)!r}")
    return out


# ---------------------------------------------------------------- reading raw rows


def prepare(df: pl.DataFrame, sequence_key: str | None, order_by: str | None, file_uri: str) -> pl.DataFrame:
    """Add the sequence (`__seq`, string) and order (`__order`, int64) columns used everywhere below."""
    if sequence_key is None:
        seq = pl.lit(file_uri, dtype=pl.Utf8)
    elif sequence_key == FILE_SEQUENCE:
        seq = pl.lit(file_uri, dtype=pl.Utf8)
    else:
        if df[sequence_key].null_count():
            raise DataError(f"{file_uri}: column '{sequence_key}' (data.sequence_key) has {df[sequence_key].null_count()} null value(s); every row needs a sequence")
        seq = pl.col(sequence_key).cast(pl.Utf8)
    if order_by is None:
        order = pl.int_range(0, pl.len(), dtype=pl.Int64)
    else:
        if df[order_by].null_count():
            raise DataError(f"{file_uri}: column '{order_by}' (data.order_by) has {df[order_by].null_count()} null value(s); every row needs a position")
        order = pl.col(order_by).to_physical().cast(pl.Int64)
    return df.with_columns(seq.alias(SEQ), order.alias(ORDER))


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint64)
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _key64(text: str, seed: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{text}".encode()).digest()[:8], "little")


def assign_split(df: pl.DataFrame, data: DataConfig) -> pl.DataFrame:
    """Add `__split`: by a seeded hash of the sequence (stable across machines and versions) or by value ranges."""
    split = data.split
    if split.method == "range":
        col = pl.col(split.column)
        expr = pl.lit(None, dtype=pl.Utf8)
        for name in reversed(("train", "validation", "test")):
            if name not in split.ranges:
                continue
            lo, hi = split.ranges[name]
            cond = pl.lit(True)
            if lo is not None:
                cond = cond & (col >= lo)
            if hi is not None:
                cond = cond & (col <= hi)
            expr = pl.when(cond).then(pl.lit(name)).otherwise(expr)
        return df.with_columns(expr.alias(SPLIT)).filter(pl.col(SPLIT).is_not_null())
    if data.sequence_key is None:  # plain rows: hash the file and the row's number in that file
        bases = {k: _key64(k, split.seed) for k in df[SEQ].unique().to_list()}
        base = df[SEQ].replace_strict(bases, return_dtype=pl.UInt64).to_numpy()
        row = df.select(pl.int_range(0, pl.len(), dtype=pl.UInt64).over(SEQ)).to_series().to_numpy()
        h = _splitmix64(base ^ row)
        u = (h >> np.uint64(11)).astype(np.float64) / float(1 << 53)
        df = df.with_columns(pl.Series("__u", u))
    f_train = split.fractions.get("train", 0.0)
    f_val = split.fractions.get("validation", 0.0)
    if data.sequence_key is not None:  # one draw per sequence: label the distinct keys, then join
        uniq = df[SEQ].unique(maintain_order=True).to_list()
        u = (_splitmix64(np.array([_key64(k, split.seed) for k in uniq], dtype=np.uint64)) >> np.uint64(11)).astype(np.float64) / float(1 << 53)
        labels = np.where(u < f_train, "train", np.where(u < f_train + f_val, "validation", "test"))
        keys = pl.DataFrame({SEQ: pl.Series(uniq, dtype=df.schema[SEQ]), SPLIT: pl.Series(labels.tolist(), dtype=pl.Utf8)})
        return df.join(keys, on=SEQ, how="left", maintain_order="left")
    expr = (
        pl.when(pl.col("__u") < f_train).then(pl.lit("train"))
        .when(pl.col("__u") < f_train + f_val).then(pl.lit("validation"))
        .otherwise(pl.lit("test"))
    )
    return df.with_columns(expr.alias(SPLIT)).drop("__u")


# ---------------------------------------------------------------- fitting (on the training split only)


def _moments(n: int, mean: float, m2: float) -> dict[str, float]:
    return {"n": int(n), "mean": float(mean), "m2": float(m2)}


def _merge_moments(parts: list[dict[str, float]]) -> tuple[int, float, float]:
    """(n, mean, M2) of the union of parts (Chan et al.: no sum of squares to cancel)."""
    n = sum(p["n"] for p in parts)
    if n == 0:
        return 0, 0.0, 0.0
    mean = sum(p["n"] * p["mean"] for p in parts) / n
    m2 = sum(p["m2"] + p["n"] * (p["mean"] - mean) ** 2 for p in parts)
    return n, mean, m2


def empty_stats(data: DataConfig) -> dict[str, Any]:
    """The training statistics of a group with no training row."""
    t = data.target
    return {
        "rows": 0,
        "continuous": {c: _moments(0, 0.0, 0.0) for c in data.features.continuous},
        "categorical": {c: {} for c in data.features.categorical},
        "target": {"counts": {}} if t.task == "classification" else _moments(0, 0.0, 0.0),
    }


def _vocab(counts: Counter) -> list[str]:
    return [v for v, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]


def _mean_std(parts: list[dict[str, float]]) -> tuple[float, float]:
    n, mean, m2 = _merge_moments(parts)
    if n == 0:
        return 0.0, 1.0
    std = max(m2 / n, 0.0) ** 0.5
    return mean, (std if std > 1e-12 else 1.0)


def fit_spec(partials: list[dict[str, Any]], data: DataConfig) -> EncodingSpec:
    """The data set's encoding from every group's training statistics (`encode_splits`' `stats`)."""
    cont = []
    for c in data.features.continuous:
        mean, std = _mean_std([p["continuous"][c] for p in partials])
        cont.append(ContinuousStat(name=c, mean=mean, std=std))
    cats = []
    for c in data.features.categorical:
        counts: Counter = Counter()
        for p in partials:
            counts.update(p["categorical"][c])
        cats.append(Vocabulary(name=c, values=_vocab(counts)))
    t = data.target
    if t.task == "classification":
        counts = Counter()
        for p in partials:
            counts.update(p["target"]["counts"])
        target = TargetSpec(column=t.column, task=t.task, classes=_vocab(counts))
    else:
        mean, std = _mean_std([p["target"] for p in partials])
        target = TargetSpec(column=t.column, task=t.task, mean=mean, std=std)
    return EncodingSpec(
        sequence_key=data.sequence_key,
        order_by=data.order_by,
        window=data.window,
        horizon=data.effective_horizon,
        continuous=cont,
        boolean=list(data.features.boolean),
        categorical=cats,
        target=target,
        continuous_dtype=data.continuous_dtype,
    )


# ---------------------------------------------------------------- encoding rows into arrays


_int_dtype = int_dtype


def _ids(series: pl.Series, values: list[str]) -> pl.Series:
    return pl.select(_ids_expr(pl.lit(series), series.dtype, values)).to_series()


def _ids_expr(col: pl.Expr, dtype: pl.DataType, values: list[str]) -> pl.Expr:
    """Vocabulary ids of a column: values[i] -> i+1, anything else (unseen, null) -> 0.

    Values are compared as strings; a numeric or boolean column is matched on its own type (the
    vocabulary cast back to it) when that round-trips exactly, which skips casting every row to text."""
    ids = list(range(1, len(values) + 1))
    if values and dtype != pl.Utf8 and (dtype.is_integer() or dtype == pl.Boolean):
        try:
            typed = pl.Series(values, dtype=pl.Utf8).cast(dtype, strict=False)
            exact = typed.null_count() == 0 and typed.cast(pl.Utf8).to_list() == values
        except Exception:
            exact = False
        if exact:
            return col.replace_strict(typed, pl.Series(ids, dtype=pl.Int64), default=0, return_dtype=pl.Int64).fill_null(0)
    return col.cast(pl.Utf8).replace_strict(values, ids, default=0, return_dtype=pl.Int64).fill_null(0)


def encode_frame(df: pl.DataFrame, spec: EncodingSpec, with_target: bool = True, presorted: bool = False) -> tuple[dict[str, np.ndarray], list[str]]:
    """Encode prepared rows (with `__seq`, `__order`) into shard arrays; returns (arrays, segment keys).

    Rows are sorted by sequence then order, so each sequence is one contiguous segment. Each array
    is computed by one polars `select` (multi-threaded over columns).
    """
    if not presorted:  # (the encode step sorts a whole group once)
        df = df.sort([SEQ, ORDER], maintain_order=True)
    n = df.height
    cont_dtype = np.float16 if spec.continuous_dtype == "float16" else np.float32
    if spec.continuous:
        pl_cont = pl.Float16 if cont_dtype == np.float16 else pl.Float32  # float32 first, then float16: numpy's rounding
        cont = df.select(
            ((pl.col(c.name).cast(pl.Float64).fill_nan(None) - c.mean) / c.std).fill_null(0.0).cast(pl.Float32).cast(pl_cont).alias(c.name)
            for c in spec.continuous
        ).to_numpy(order="c").astype(cont_dtype, copy=False)
    else:
        cont = np.zeros((n, 0), dtype=cont_dtype)
    card = spec.cat_cardinalities
    cat_dtype = _int_dtype(max(card) if card else 1)
    pl_cat = {np.dtype(np.uint8): pl.UInt8, np.dtype(np.int16): pl.Int16, np.dtype(np.int32): pl.Int32}.get(cat_dtype, pl.Int64)
    cat_exprs = [_ids_expr(pl.col(v.name), df.schema[v.name], v.values).cast(pl_cat).alias(v.name) for v in spec.categorical]
    cat_exprs += [(pl.col(b).cast(pl.Boolean).cast(pl_cat) + 1).fill_null(0).cast(pl_cat).alias(b) for b in spec.boolean]
    cat = df.select(cat_exprs).to_numpy(order="c").astype(cat_dtype, copy=False) if cat_exprs else np.zeros((n, 0), cat_dtype)
    t = spec.target
    if with_target and t.column in df.columns:
        if t.task == "classification":
            target = _ids(df[t.column], t.classes or []).to_numpy().astype(np.int32)
        else:
            target = ((df[t.column].cast(pl.Float64) - t.mean) / t.std).to_numpy().astype(np.float32)
    else:
        target = np.zeros(n, dtype=np.int32 if t.task == "classification" else np.float32)
    seq = df[SEQ]
    change = (seq != seq.shift(1)).fill_null(True).to_numpy() if n else np.zeros(0, bool)
    starts = np.flatnonzero(change)
    offsets = np.append(starts, n).astype(np.int64)
    keys = seq.gather(starts).to_list() if n else []
    arrays = {
        "cont": cont,
        "cat": cat,
        "target": target,
        "order": df[ORDER].to_numpy().astype(np.int64),
        "offsets": offsets,
    }
    return arrays, keys


# ---------------------------------------------------------------- the encode step: one pass, each group's own codes

MAX_SLICES = 256  # a split made of more separate row blocks than this is copied out with one filter


def _runs(df: pl.DataFrame) -> tuple[np.ndarray, list[str]] | None:
    """(first row of each run of equal `__seq`, the run's key) when each sequence is one run whose
    `__order` never goes down, i.e. the rows are already grouped and ordered; else None."""
    n = df.height
    if n == 0:
        return np.zeros(0, np.int64), []
    runs = df[SEQ].rle()
    keys = runs.struct.field("value").to_list()
    if len(set(keys)) != len(keys):
        return None
    lengths = runs.struct.field("len").to_numpy()
    starts = (np.cumsum(lengths) - lengths).astype(np.int64)
    if n > 1:
        up = np.diff(df[ORDER].to_numpy()) >= 0
        up[starts[1:] - 1] = True  # a new sequence may start anywhere
        if not up.all():
            return None
    return starts, keys


def _hash_labels(keys: list[str], data: DataConfig) -> np.ndarray:
    """Split index (0 train, 1 validation, 2 test) per sequence key: the same draw as `assign_split`."""
    split = data.split
    if not keys:
        return np.zeros(0, np.int8)
    u = (_splitmix64(np.array([_key64(k, split.seed) for k in keys], dtype=np.uint64)) >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    f_train = split.fractions.get("train", 0.0)
    f_val = split.fractions.get("validation", 0.0)
    return np.where(u < f_train, 0, np.where(u < f_train + f_val, 1, 2)).astype(np.int8)


Splits = dict[str, tuple[int, int, np.ndarray, list[str]]]


def split_rows(df: pl.DataFrame, data: DataConfig) -> tuple[pl.DataFrame, Splits]:
    """A group's prepared rows with each split's rows together (train, then validation, then test;
    every sequence's rows contiguous and in order), and per split present: (first row, end row,
    the first row of each of its sequences counted from the split's first row, their keys).

    Sequences split by hash (the usual case) keep their rows where they are: the frame is a few
    zero-copy slices of the group when the files already hold each sequence's rows in order, so
    the rows are copied once, by the encode, straight into the shards. Otherwise the rows are
    labelled (`assign_split`), filtered and sorted."""
    from shardline.core.config import SPLITS

    pieces: list[pl.DataFrame] = []
    splits: Splits = {}
    at = 0
    if data.split.method == "hash" and data.sequence_key is not None:
        runs = _runs(df)
        if runs is None:
            df = df.sort([SEQ, ORDER], maintain_order=True)
            runs = _runs(df)
        starts, keys = runs
        labels = _hash_labels(keys, data)
        ends = np.append(starts[1:], df.height).astype(np.int64)
        lengths = ends - starts
        for i, name in enumerate(SPLITS):
            mine = labels == i
            if not mine.any():
                continue
            picked = np.flatnonzero(mine)
            rows = int(lengths[picked].sum())
            edge = np.diff(np.concatenate([[0], mine.astype(np.int8), [0]]))
            first, last = np.flatnonzero(edge == 1), np.flatnonzero(edge == -1) - 1  # blocks of consecutive runs
            if len(first) <= MAX_SLICES:
                pieces += [df.slice(int(starts[a]), int(ends[b] - starts[a])) for a, b in zip(first, last)]
            else:
                pieces.append(df.filter(pl.Series(np.repeat(mine, lengths))))
            local = np.concatenate([[0], np.cumsum(lengths[picked])[:-1]]).astype(np.int64)
            splits[name] = (at, at + rows, local, [keys[k] for k in picked])
            at += rows
    else:
        labelled = assign_split(df, data)
        for name in SPLITS:
            part = labelled.filter(pl.col(SPLIT) == name).drop(SPLIT)
            if not part.height:
                continue
            runs = _runs(part)
            if runs is None:
                part = part.sort([SEQ, ORDER], maintain_order=True)
                runs = _runs(part)
            pieces.append(part)
            splits[name] = (at, at + part.height, *runs)
            at += part.height
    frame = pl.concat(pieces, rechunk=False) if pieces else df.clear()
    return frame, splits


_torch_lock = threading.Lock()
_torch_users = 0
_torch_threads = 0


@contextmanager
def one_torch_thread():
    """Torch ops on this thread run single-threaded meanwhile. The encode's parallelism is its file
    groups: torch's own intra-op threads on top of them only spin against each other (measured:
    the encode 20-30% slower on 2 cores with them). torch keeps a thread count per thread, set
    from a process default that `set_num_threads` also changes: the default is restored for the
    threads that come later once no encode runs, and each thread restores its own on the way out."""
    import torch

    global _torch_users, _torch_threads
    with _torch_lock:
        if _torch_users == 0:
            _torch_threads = torch.get_num_threads()
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
            return LocalVocab(size=len(values), values=[str(v) for v in values.tolist()]), ids[at], 0
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
    ids = s.replace_strict(uniq, pl.Series(np.arange(1, len(uniq) + 1, dtype=np.int64)), default=0, return_dtype=pl.Int64)
    return LocalVocab(size=len(uniq), values=uniq.cast(pl.Utf8).to_list()), ids.fill_null(0).to_numpy(), 0


def _counts_of(ids: np.ndarray, voc: LocalVocab) -> dict[str, int]:
    if ids.dtype == np.uint8:  # torch counts bytes without widening them first (2x numpy's bincount)
        import torch

        counts = torch.bincount(torch.from_numpy(ids), minlength=voc.size + 1).numpy()[1:]
    else:
        counts = np.bincount(ids, minlength=voc.size + 1)[1:]
    texts = voc.texts()
    return {texts[i]: int(counts[i]) for i in np.flatnonzero(counts)}


def _column_moments(x, nan: bool, torch) -> tuple[int, float, float]:
    """(count, sum, sum of squares) over the non-NaN values of a centred float32 column."""
    if nan:
        count = int((~torch.isnan(x)).sum())
        return count, float(torch.nansum(x)), float(torch.nansum(x * x))
    return len(x), float(x.sum()), float(torch.linalg.vector_norm(x)) ** 2


def _standardise_splits(frame: pl.DataFrame, names: list[str], outs: list[tuple[int, int, Any]], train: tuple[int, int] | None, torch) -> tuple[list[tuple[int, float, float]], list[tuple[float, float]]]:
    """Standardise the continuous columns `names` of a group's rows with the group's own mean and
    std, one column at a time, into each split's array: `outs` holds (first row, end row, the
    split's array [columns, rows], float16 or float32); NaN is kept (it stands for null). Returns
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
        a = (s if f32 else s.cast(pl.Float64)).to_numpy()
        if not a.flags.writeable or not a.flags.c_contiguous:
            a = np.array(a)
        x = torch.from_numpy(a)
        total = float(x.sum())
        nan = total != total and bool(torch.isnan(x).any())
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
        std = var ** 0.5
        inv = float(np.float32(1.0 / std if 1e-12 < std < float("inf") else 1.0))
        for a0, a1, out in outs:
            torch.mul(xc[a0:a1], inv, out=out[j])
        if train is not None:
            tc, tr, tsq = parts[[a0 for a0, _, _ in outs].index(train[0])]
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
    std = var ** 0.5 if var == var and var > 0 else 0.0
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


Encoded = tuple[memoryview, dict[str, ArraySpec], dict[str, np.ndarray], list[str], LocalCodes, dict | None]


def encode_splits(frame: pl.DataFrame, splits: Splits, data: DataConfig) -> dict[str, Encoded]:
    """A group's rows and its splits, as `split_rows` gives them -> per split: its shard file's
    bytes, their layout, views of the arrays, the segment keys, the codes, and for the training
    split its rows' statistics.

    The group has one set of own codes (a mean and std per continuous column, ids per categorical
    column), shared by its shards: each column is coded once for the whole group and written in
    place into every split's file buffer (`shards.allocate`), the continuous and categorical
    arrays column by column (`cont_cols` [columns, rows], `cat_cols`): that is how the columns
    arrive, it compresses to about half the size of rows, and readers lay them out as rows while
    mapping the codes (`shardline/codes.py`). The statistics come from the training rows only."""
    import torch

    n = frame.height
    f = data.features
    train = splits["train"][:2] if "train" in splits else None

    # categorical ids first (their widths size the files): the group's own ids; booleans: 0 null, 1 false, 2 true
    cats = list(f.categorical)
    schema = frame.schema
    ints = [c for c in cats if schema[c].is_integer()]
    bounds = frame.select([pl.col(c).min().alias(f"lo{i}") for i, c in enumerate(ints)] + [pl.col(c).max().alias(f"hi{i}") for i, c in enumerate(ints)]).row(0) if ints and n else ()
    lo = {c: bounds[i] for i, c in enumerate(ints)} if bounds else {}
    hi = {c: bounds[len(ints) + i] for i, c in enumerate(ints)} if bounds else {}
    coded = [_local_ids(frame[c], lo.get(c), hi.get(c)) for c in cats]
    vocs = [voc for voc, _, _ in coded]
    width = max([voc.size for voc in vocs] + ([2] if f.boolean else []) + [1])

    # the target: a class id in the group's own ids, or a value standardised with its own mean and std
    t = data.target
    ts = frame[t.column]
    tvalues = None
    tstats: dict = {}
    if t.task == "classification":
        if t.column in cats:  # also a feature: the same ids
            tvoc, tvalues, tshift = vocs[cats.index(t.column)], None, None
        else:
            bounded = ts.dtype.is_integer() and n
            tvoc, tvalues, tshift = _local_ids(ts, ts.min() if bounded else None, ts.max() if bounded else None)
        tcode: LocalVocab | tuple[float, float] = tvoc
        tdtype = int_dtype(tvoc.size)
    else:
        y = ts.cast(pl.Float64)
        tcode = _local_affine(float(y.mean() or 0.0), float(y.var(ddof=0) or 0.0))
        if train is not None:
            yt = y.slice(train[0], train[1] - train[0])
            m, v = float(yt.mean() or 0.0), float(yt.var(ddof=0) or 0.0)
            tstats = _moments(yt.len(), m, v * yt.len())
        tdtype = np.dtype(np.float32)

    names = list(f.continuous)
    cont_dtype = np.dtype(np.float16 if data.continuous_dtype == "float16" else np.float32)
    order = frame[ORDER].to_numpy().astype(np.int64, copy=False)
    files: dict[str, tuple[memoryview, dict[str, ArraySpec], dict[str, np.ndarray]]] = {}
    for name, (a0, a1, starts, _) in splits.items():
        offsets = np.append(starts, a1 - a0).astype(np.int64)
        small = order_arrays(order[a0:a1], offsets)
        # the small arrays in the order earlier encoders wrote them (same bytes, same checksums)
        small = {**small, "offsets": offsets} if "order" in small else {"offsets": offsets, **small}
        files[name] = allocate({
            "cont_cols": (cont_dtype, (len(names), a1 - a0)),
            "cat_cols": (int_dtype(width), (len(cats) + len(f.boolean), a1 - a0)),
            "target": (tdtype, (a1 - a0,)),
            **{k: (v.dtype, v.shape) for k, v in small.items()},
        })
        for k, v in small.items():
            files[name][2][k][...] = v
    rows = [(a0, a1, files[name][2]) for name, (a0, a1, _, _) in splits.items()]

    # continuous: standardised with the group's own mean and std (NaN for null), straight into the files
    moments, affine = _standardise_splits(frame, names, [(a0, a1, torch.from_numpy(arr["cont_cols"])) for a0, a1, arr in rows], train, torch)

    stats: dict[str, Any] = {"rows": (train[1] - train[0]) if train else 0, "continuous": {}, "categorical": {}, "target": tstats}
    for c, (cnt, m, v) in zip(names, moments):
        stats["continuous"][c] = _moments(cnt, m, v * cnt)
    for j, (_, values, shift) in enumerate(coded):
        for a0, a1, arr in rows:
            _set_ids(arr["cat_cols"][j], values[a0:a1], shift)
    if f.boolean:
        codes_row = np.empty(n, np.uint8)
        for j, b in enumerate(f.boolean, start=len(cats)):
            _bool_codes(frame[b], codes_row)
            for a0, a1, arr in rows:
                arr["cat_cols"][j] = codes_row[a0:a1]
    if t.task == "classification":
        for a0, a1, arr in rows:
            if tvalues is None:
                arr["target"][...] = arr["cat_cols"][cats.index(t.column)]
            else:
                _set_ids(arr["target"], tvalues[a0:a1], tshift)
    else:
        yz = ((y - tcode[0]) / tcode[1]).cast(pl.Float32).to_numpy()
        for a0, a1, arr in rows:
            arr["target"][...] = yz[a0:a1]
    if train is not None:
        tarr = files["train"][2]
        for j, (c, voc) in enumerate(zip(cats, vocs)):
            stats["categorical"][c] = _counts_of(tarr["cat_cols"][j], voc)
        if t.task == "classification":
            stats["target"] = {"counts": _counts_of(tarr["target"], tvoc)}
    codes = LocalCodes(cont=affine, cat=vocs, target=tcode)
    return {name: (*files[name], splits[name][3], codes, stats if name == "train" else None) for name in splits}
