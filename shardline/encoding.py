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
from collections import Counter
from typing import Any

import numpy as np
import polars as pl

from shardline.config import FILE_SEQUENCE, DataConfig, stable_hash
from shardline.manifest import ContinuousStat, EncodingSpec, TargetSpec, Vocabulary

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


def partial_stats(train: pl.DataFrame, data: DataConfig) -> dict[str, Any]:
    """Sufficient statistics of one group's training rows; merged by `fit_spec`. JSON-serialisable."""
    cont = {}
    names = list(data.features.continuous)
    if names:
        agg = train.select(
            e for c in names for e in (
                pl.col(c).cast(pl.Float64).fill_nan(None).count().alias(f"{c}|n"),
                pl.col(c).cast(pl.Float64).fill_nan(None).sum().alias(f"{c}|sum"),
                (pl.col(c).cast(pl.Float64).fill_nan(None) ** 2).sum().alias(f"{c}|sumsq"),
            )
        ).row(0, named=True)
        for c in names:
            cont[c] = {"n": int(agg[f"{c}|n"]), "sum": float(agg[f"{c}|sum"] or 0.0), "sumsq": float(agg[f"{c}|sumsq"] or 0.0)}
    cats = {c: _counts(train[c]) for c in data.features.categorical}
    t = data.target.column
    if data.target.task == "classification":
        target = {"counts": _counts(train[t])}
    else:
        s = train[t].cast(pl.Float64)
        target = {"n": int(s.len()), "sum": float(s.sum() or 0.0), "sumsq": float((s * s).sum() or 0.0)}
    return {"rows": train.height, "continuous": cont, "categorical": cats, "target": target}


def _counts(series: pl.Series) -> dict[str, int]:
    """Value -> count of the non-null values, keyed by the value as text (counted on the column's own
    type, then only the distinct values are cast)."""
    vc = series.drop_nulls().value_counts()
    return dict(zip(vc[series.name].cast(pl.Utf8).to_list(), vc["count"].to_list()))


def _vocab(counts: Counter) -> list[str]:
    return [v for v, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]


def _mean_std(n: int, s: float, ss: float) -> tuple[float, float]:
    if n == 0:
        return 0.0, 1.0
    mean = s / n
    var = max(ss / n - mean * mean, 0.0)
    std = var ** 0.5
    return mean, (std if std > 1e-12 else 1.0)


def fit_spec(partials: list[dict[str, Any]], data: DataConfig) -> EncodingSpec:
    cont = []
    for c in data.features.continuous:
        n = sum(p["continuous"][c]["n"] for p in partials)
        s = sum(p["continuous"][c]["sum"] for p in partials)
        ss = sum(p["continuous"][c]["sumsq"] for p in partials)
        mean, std = _mean_std(n, s, ss)
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
        n = sum(p["target"]["n"] for p in partials)
        mean, std = _mean_std(n, sum(p["target"]["sum"] for p in partials), sum(p["target"]["sumsq"] for p in partials))
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


def _int_dtype(max_value: int) -> np.dtype:
    """The narrowest type for ids 0..max_value (ids are never negative: unsigned where torch reads it)."""
    for dt in (np.uint8, np.int16, np.int32):
        if max_value <= np.iinfo(dt).max:
            return np.dtype(dt)
    return np.dtype(np.int64)


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
