"""The serving encoder: prepared rows (shardline.core.encoding.columns.prepare) -> shard arrays in the
data set's encoding. The registered model encodes raw rows with it at prediction time, so training
and serving encode identically."""

from __future__ import annotations

import numpy as np
import polars as pl

from shardline.core.codes import int_dtype
from shardline.core.encoding.columns import ORDER, SEQ, as_number
from shardline.core.manifest import EncodingSpec, target_array


def _finite(x: pl.Expr) -> pl.Expr:
    """A continuous value, null where it is NaN or infinite: missing, as the encode reads it (the training mean)."""
    return pl.when(x.is_finite()).then(x)


def _ids_expr(col: pl.Expr, dtype: pl.DataType, values: list[str]) -> pl.Expr:
    """Vocabulary ids of a column: values[i] -> i+1, anything else (unseen, null) -> 0.

    Values are compared as strings; a numeric or boolean column is matched on its own type (the
    vocabulary cast back to it) when that round-trips exactly, which skips casting every row to text."""
    ids = list(range(1, len(values) + 1))
    if values and dtype != pl.Utf8 and (dtype.is_integer() or dtype == pl.Boolean):
        try:
            typed = pl.Series(values, dtype=pl.Utf8).cast(dtype, strict=False)
            exact = typed.null_count() == 0 and typed.cast(pl.Utf8).to_list() == values
        except Exception:  # noqa: BLE001 - values that do not cast: compared as text
            exact = False
        if exact:
            return col.replace_strict(
                typed, pl.Series(ids, dtype=pl.Int64), default=0, return_dtype=pl.Int64
            ).fill_null(0)
    return col.cast(pl.Utf8).replace_strict(values, ids, default=0, return_dtype=pl.Int64).fill_null(0)


def encode_frame(
    df: pl.DataFrame, spec: EncodingSpec, with_target: bool = True, presorted: bool = False
) -> tuple[dict[str, np.ndarray], list[str]]:
    """Encode prepared rows (with `__seq`, `__order`) into shard arrays; returns (arrays, segment keys).

    Rows are sorted by sequence then order, so each sequence is one contiguous segment. Each array
    is computed by one polars `select` (multi-threaded over columns).
    """
    if not presorted:  # (the encode step sorts a whole group once)
        df = df.sort([SEQ, ORDER], maintain_order=True)
    n = df.height
    cont_dtype = np.float16 if spec.continuous_dtype == "float16" else np.float32
    if spec.continuous:
        pl_cont = (
            pl.Float16 if cont_dtype == np.float16 else pl.Float32
        )  # float32 first, then float16: numpy's rounding
        cont = (
            df.select(
                ((_finite(as_number(c.name, df.schema[c.name])) - c.mean) / c.std)
                .fill_null(0.0)
                .cast(pl.Float32)
                .cast(pl_cont)
                .alias(c.name)
                for c in spec.continuous
            )
            .to_numpy(order="c")
            .astype(cont_dtype, copy=False)
        )
    else:
        cont = np.zeros((n, 0), dtype=cont_dtype)
    card = spec.cat_cardinalities
    cat_dtype = int_dtype(max(card) if card else 1)
    pl_cat = {np.dtype(np.uint8): pl.UInt8, np.dtype(np.int16): pl.Int16, np.dtype(np.int32): pl.Int32}.get(
        cat_dtype, pl.Int64
    )
    cat_exprs = [
        _ids_expr(pl.col(v.name), df.schema[v.name], v.values).cast(pl_cat).alias(v.name) for v in spec.categorical
    ]
    cat_exprs += [
        (pl.col(b).cast(pl.Boolean).cast(pl_cat) + 1).fill_null(0).cast(pl_cat).alias(b) for b in spec.boolean
    ]
    cat = (
        df.select(cat_exprs).to_numpy(order="c").astype(cat_dtype, copy=False)
        if cat_exprs
        else np.zeros((n, 0), cat_dtype)
    )
    targets = {}
    for i, t in enumerate(spec.targets):
        if with_target and t.column in df.columns:
            if t.task == "classification":
                y = df.select(_ids_expr(pl.col(t.column), df.schema[t.column], t.classes or [])).to_series()
                y = y.to_numpy().astype(np.int32)
            else:
                y = ((df[t.column].cast(pl.Float64) - t.mean) / t.std).to_numpy().astype(np.float32)
        else:
            y = np.zeros(n, dtype=np.int32 if t.task == "classification" else np.float32)
        targets[target_array(i)] = y
    seq = df[SEQ]
    change = (seq != seq.shift(1)).fill_null(True).to_numpy() if n else np.zeros(0, bool)
    starts = np.flatnonzero(change)
    offsets = np.append(starts, n).astype(np.int64)
    keys = seq.gather(starts).to_list() if n else []
    arrays = {
        "cont": cont,
        "cat": cat,
        **targets,
        "order": df[ORDER].to_numpy().astype(np.int64),
        "offsets": offsets,
    }
    return arrays, keys
