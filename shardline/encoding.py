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

from shardline.config import FILE_SEQUENCE, DataConfig, stable_hash
from shardline.codes import int_dtype
from shardline.manifest import ArraySpec, ContinuousStat, EncodingSpec, LocalCodes, LocalVocab, TargetSpec, Vocabulary
from shardline.shards import allocate

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
    """The data set's encoding from every group's training statistics (`encode_local`'s `stats`)."""
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
    seq = df[SEQ]
    change = (seq != seq.shift(1)).fill_null(True).to_numpy()
    starts = np.flatnonzero(change)
    keys = seq.gather(starts).to_list()
    if len(set(keys)) != len(keys):
        return None
    order = df[ORDER].to_numpy()
    if n > 1 and not ((np.diff(order) >= 0) | change[1:]).all():
        return None
    return starts.astype(np.int64), keys


def _hash_labels(keys: list[str], data: DataConfig) -> np.ndarray:
    """Split index (0 train, 1 validation, 2 test) per sequence key: the same draw as `assign_split`."""
    split = data.split
    if not keys:
        return np.zeros(0, np.int8)
    u = (_splitmix64(np.array([_key64(k, split.seed) for k in keys], dtype=np.uint64)) >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    f_train = split.fractions.get("train", 0.0)
    f_val = split.fractions.get("validation", 0.0)
    return np.where(u < f_train, 0, np.where(u < f_train + f_val, 1, 2)).astype(np.int8)


def split_frames(df: pl.DataFrame, data: DataConfig) -> dict[str, tuple[pl.DataFrame, np.ndarray, list[str]]]:
    """A group's prepared rows per split, each with every sequence's rows contiguous and in order,
    with the first row and the key of each sequence (the split's segments).

    Sequences split by hash (the usual case) keep their rows where they are: a split is a few
    zero-copy slices of the group when the files already hold each sequence's rows in order.
    Otherwise the rows are labelled (`assign_split`), filtered and sorted."""
    from shardline.config import SPLITS

    if data.split.method == "hash" and data.sequence_key is not None:
        runs = _runs(df)
        if runs is None:
            df = df.sort([SEQ, ORDER], maintain_order=True)
            runs = _runs(df)
        starts, keys = runs
        labels = _hash_labels(keys, data)
        ends = np.append(starts[1:], df.height).astype(np.int64)
        out = {}
        lengths = ends - starts
        for i, name in enumerate(SPLITS):
            mine = labels == i
            if not mine.any():
                continue
            picked = np.flatnonzero(mine)
            runs_here = (np.concatenate([[0], np.cumsum(lengths[picked])[:-1]]).astype(np.int64), [keys[k] for k in picked])
            edge = np.diff(np.concatenate([[0], mine.astype(np.int8), [0]]))
            first, last = np.flatnonzero(edge == 1), np.flatnonzero(edge == -1) - 1  # blocks of consecutive runs
            if len(first) <= MAX_SLICES:
                frame = pl.concat([df.slice(int(starts[a]), int(ends[b] - starts[a])) for a, b in zip(first, last)], rechunk=False)
            else:
                frame = df.filter(pl.Series(np.repeat(mine, lengths)))
            out[name] = (frame, *runs_here)
        return out
    labelled = assign_split(df, data)
    out = {}
    for name in SPLITS:
        part = labelled.filter(pl.col(SPLIT) == name).drop(SPLIT)
        if part.height:
            runs = _runs(part)
            if runs is None:
                part = part.sort([SEQ, ORDER], maintain_order=True)
                runs = _runs(part)
            out[name] = (part, *runs)
    return out


_torch_lock = threading.Lock()
_torch_users = 0
_torch_threads = 0


@contextmanager
def one_torch_thread():
    """Torch ops on this thread run single-threaded meanwhile. The encode's parallelism is its file
    groups: torch's own intra-op threads on top of them only spin against each other (measured:
    encode_local 20-30% slower on 2 cores with them). torch keeps a thread count per thread, set
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
    uniq = s.drop_nulls().unique().sort()
    if s.dtype == pl.Utf8:  # the sorted values' positions (an Enum's codes), id = position + 1
        voc = LocalVocab(size=len(uniq), values=uniq.to_list())
        pos = s.cast(pl.Enum(voc.values)).to_physical()
        return voc, (pos.cast(pl.Int64).fill_null(-1) if s.null_count() else pos).to_numpy(), -1
    else:
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


def _numpy_of(s: pl.Series) -> np.ndarray:
    """A writable contiguous numpy copy or view of a numeric series (nulls as NaN for floats)."""
    x = s.to_numpy()
    return x if x.flags.writeable and x.flags.c_contiguous else np.array(x)


def _standardise_into(part: pl.DataFrame, names: list[str], out, torch) -> tuple[list[tuple[int, float, float]], list[tuple[float, float]]]:
    """Standardise the continuous columns `names` of `part` with their own mean and std, one column
    at a time into `out` [columns, rows] (float16 or float32; NaN kept: it stands for null). Returns
    each column's (count, mean, variance) over its non-NaN values, and the (mean, std) the stored
    values decode with: v * std + mean (the exact steps taken). Two passes over a column
    that stays in cache (centre on a first mean, then the moments of the centred values), float32
    sums in torch's cascades: no cancellation even for values far from zero, and one rounding to
    the stored type."""
    n = part.height
    tmp = torch.empty(n, dtype=torch.float32)
    moments, affine = [], []
    for j, c in enumerate(names):
        s = part[c]
        # float32 columns are centred in float32 (exact near the mean); any other type in float64,
        # so that a column far from zero (timestamps, prices) keeps its spread
        x = torch.from_numpy(_numpy_of(s if s.dtype == pl.Float32 else s.cast(pl.Float64)))
        total = float(x.sum())
        nan = total != total and bool(torch.isnan(x).any())
        count = int((~torch.isnan(x)).sum()) if nan else n
        live = max(count, 1)
        if nan:
            total = float(torch.nansum(x))
        m32 = torch.tensor(total / live, dtype=x.dtype)
        torch.sub(x, m32, out=tmp)  # rounded once to float32, centred
        r = (float(torch.nansum(tmp)) if nan else float(tmp.sum())) / live
        sq = float(torch.nansum(tmp * tmp)) if nan else float(torch.linalg.vector_norm(tmp)) ** 2
        var = max(sq / live - r * r, 0.0) if count else 0.0
        std = var ** 0.5
        inv32 = torch.tensor(1.0 / std if 1e-12 < std < float("inf") else 1.0, dtype=torch.float32)
        if out.dtype == torch.float32:
            torch.mul(tmp, inv32, out=out[j])
        else:
            out[j].copy_(tmp.mul_(inv32))
        # a float64 column's mean is its float64 sum's (exact to rounding); a float32 column's is
        # corrected by the mean of its centred values (float32 sums drift on long columns)
        mean = (float(m32) if x.dtype == torch.float64 else float(m32) + r) if count else 0.0
        moments.append((count, mean, var))
        affine.append((float(m32), 1.0 / float(inv32)))
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


def encode_local(part: pl.DataFrame, data: DataConfig, with_stats: bool, runs: tuple[np.ndarray, list[str]]) -> tuple[memoryview, dict[str, ArraySpec], dict[str, np.ndarray], list[str], LocalCodes, dict | None]:
    """One split of one group and its segments' (first rows, keys), as `split_frames` gives them
    -> its shard file's bytes in the group's own codes, their layout, views of the arrays, the
    segment keys, the codes, and with `with_stats` the rows' training statistics.

    The arrays are written in place into the shard file's buffer (`shards.allocate`): the
    continuous and categorical ones column by column (`cont_cols` [columns, rows], `cat_cols`):
    that is how the columns arrive, it compresses to about half the size of rows, and readers lay
    them out as rows while mapping the codes (`shardline/codes.py`)."""
    import torch

    n = part.height
    f = data.features
    starts, keys = runs
    offsets = np.append(starts, n).astype(np.int64)
    stats: dict[str, Any] = {"rows": n, "continuous": {}, "categorical": {}, "target": {}}

    # categorical ids first (their widths size the file): this split's own ids; booleans: 0 null, 1 false, 2 true
    cats = list(f.categorical)
    schema = part.schema
    ints = [c for c in cats if schema[c].is_integer()]
    bounds = part.select([pl.col(c).min().alias(f"lo{i}") for i, c in enumerate(ints)] + [pl.col(c).max().alias(f"hi{i}") for i, c in enumerate(ints)]).row(0) if ints and n else ()
    lo = {c: bounds[i] for i, c in enumerate(ints)} if bounds else {}
    hi = {c: bounds[len(ints) + i] for i, c in enumerate(ints)} if bounds else {}
    coded = [_local_ids(part[c], lo.get(c), hi.get(c)) for c in cats]
    vocs = [voc for voc, _, _ in coded]
    width = max([voc.size for voc in vocs] + ([2] if f.boolean else []) + [1])

    # the target: a class id in this split's own ids, or a value standardised with its own mean and std
    t = data.target
    ts = part[t.column]
    tvalues = None
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
        m, v = float(y.mean() or 0.0), float(y.var(ddof=0) or 0.0)
        tcode = _local_affine(m, v)
        stats["target"] = _moments(n, m, v * n)
        tdtype = np.dtype(np.float32)

    order = order_arrays(part[ORDER].to_numpy().astype(np.int64, copy=False), offsets)
    # the small arrays in the order earlier encoders wrote them (same bytes, same checksums)
    small = {**order, "offsets": offsets} if "order" in order else {"offsets": offsets, **order}
    names = list(f.continuous)
    cont_dtype = np.dtype(np.float16 if data.continuous_dtype == "float16" else np.float32)
    buf, specs, arrays = allocate({
        "cont_cols": (cont_dtype, (len(names), n)),
        "cat_cols": (int_dtype(width), (len(cats) + len(f.boolean), n)),
        "target": (tdtype, (n,)),
        **{k: (a.dtype, a.shape) for k, a in small.items()},
    })
    for k, a in small.items():
        arrays[k][...] = a

    # continuous: standardised with this split's own mean and std (NaN for null), straight into the file
    moments, affine = _standardise_into(part, names, torch.from_numpy(arrays["cont_cols"]), torch)
    for c, (cnt, m, v) in zip(names, moments):
        stats["continuous"][c] = _moments(cnt, m, v * cnt)

    cat = arrays["cat_cols"]
    for j, (_, values, shift) in enumerate(coded):
        _set_ids(cat[j], values, shift)
    for j, b in enumerate(f.boolean, start=len(cats)):
        _bool_codes(part[b], cat[j])
    if with_stats:
        for j, (c, voc) in enumerate(zip(cats, vocs)):
            stats["categorical"][c] = _counts_of(cat[j], voc)

    target = arrays["target"]
    if t.task == "classification":
        if tvalues is None:
            target[...] = cat[cats.index(t.column)]
        else:
            _set_ids(target, tvalues, tshift)
        if with_stats:
            stats["target"] = {"counts": _counts_of(target, tvoc)}
    else:
        target[...] = ((y - tcode[0]) / tcode[1]).cast(pl.Float32).to_numpy()
    codes = LocalCodes(cont=affine, cat=vocs, target=tcode)
    return buf, specs, arrays, keys, codes, (stats if with_stats else None)
