"""The columns every prepared row carries: its sequence (`__seq`, a string) and its position in it
(`__order`, int64), made once from `data.sequence_key` and `data.order_by`; and `DataError`, the
error for raw data that does not fit the config."""

from __future__ import annotations

import polars as pl

from shardline.core.config import FILE_SEQUENCE

SEQ = "__seq"
ORDER = "__order"


class DataError(ValueError):
    """Raw data that does not fit the config; the message names the file and the column."""


def prepare(df: pl.DataFrame, sequence_key: str | None, order_by: str | None, file_uri: str) -> pl.DataFrame:
    """Add the sequence (`__seq`, string) and order (`__order`, int64) columns used everywhere below."""
    if sequence_key is None:
        seq = pl.lit(file_uri, dtype=pl.Utf8)
    elif sequence_key == FILE_SEQUENCE:
        seq = pl.lit(file_uri, dtype=pl.Utf8)
    else:
        if df[sequence_key].null_count():
            raise DataError(
                f"{file_uri}: column '{sequence_key}' (data.sequence_key) has {df[sequence_key].null_count()} null "
                "value(s); every row needs a sequence"
            )
        seq = pl.col(sequence_key).cast(pl.Utf8)
    if order_by is None:
        order = pl.int_range(0, pl.len(), dtype=pl.Int64)
    else:
        if df[order_by].null_count():
            raise DataError(
                f"{file_uri}: column '{order_by}' (data.order_by) has {df[order_by].null_count()} null value(s); "
                "every row needs a position"
            )
        order = pl.col(order_by).to_physical().cast(pl.Int64)
    return df.with_columns(seq.alias(SEQ), order.alias(ORDER))
