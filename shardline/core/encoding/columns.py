"""The columns every prepared row carries: its sequence (`__seq`, a string) and its position in it
(`__order`, int64), made once from `data.sequence_key` and `data.order_by`; and `DataError`, the
error for raw data that does not fit the config."""

from __future__ import annotations

import numpy as np
import polars as pl

from shardline.core.config import FILE_SEQUENCE
from shardline.core.config.data import element_of

SEQ = "__seq"
ORDER = "__order"


class DataError(ValueError):
    """Raw data that does not fit the config; the message names the file and the column."""


class DamagedFile(DataError):
    """A raw file whose footer reads (the ingest checked it) but whose data does not: `data.on_bad_file: skip` leaves
    it out at the encode, `fail` stops there. `cause`: what the reader said, for the run's list of skipped files."""

    def __init__(self, message: str, cause: str):
        super().__init__(message)
        self.cause = cause


def unreadable(uri: str, what: str, error: Exception, remote: bool) -> Exception:
    """The error for a raw file whose footer read (the ingest checked it) but whose rows do not (pyarrow's OSError or
    ArrowException), naming it and what could not be done (`what`): on an object store an OSError (perhaps the
    network: retried, as any read is), else a `DamagedFile`."""
    e = " ".join(str(error).split())  # pyarrow's words hold line breaks
    said = f"{uri}: cannot {what}: {e}"
    if remote and isinstance(error, OSError):
        return OSError(said)
    return DamagedFile(
        f"{said}. The file is damaged (an interrupted copy?): replace it, or remove it, or set data.on_bad_file: skip "
        "to train without it",
        f"damaged: its footer reads, its data does not ({e})",
    )


def as_number(column: str, dtype: pl.DataType) -> pl.Expr:
    """A continuous feature as float64: numbers as they are; a date-time as its instant in microseconds
    since 1970 UTC (whatever its unit or zone, so training and serving agree), a date as days, a duration
    in microseconds. Standardised afterwards like any number; for calendar parts (hour, weekday), add them
    as columns of their own."""
    col = pl.col(column)
    if isinstance(dtype, pl.Datetime):
        col = col.dt.epoch("us")
    elif isinstance(dtype, pl.Duration):
        col = col.dt.total_microseconds()
    return col.cast(pl.Float64)


def element_exprs(names: list[str], schema: dict[str, pl.DataType]) -> list[pl.Expr]:
    """The continuous features `names` that are elements of a list or array column of `schema` (`vec[3]`), as
    expressions of those columns (an element past a row's list, or of a null list, is null: a missing value)."""
    exprs = []
    for name in names:
        if name in schema or (e := element_of(name)) is None or e[0] not in schema:
            continue
        col = pl.col(e[0])
        ns = col.arr if isinstance(schema[e[0]], pl.Array) else col.list
        exprs.append(ns.get(e[1], null_on_oob=True).alias(name))
    return exprs


def with_elements(frame: pl.DataFrame, names: list[str]) -> pl.DataFrame:
    """`frame` with the elements `names` name as columns (`element_exprs`), their list columns dropped where no
    other name needs them."""
    exprs = element_exprs(names, frame.schema)
    if not exprs:
        return frame
    lists = {element_of(n)[0] for n in names if n not in frame.columns and element_of(n)} - set(names)
    return frame.with_columns(exprs).drop(lists)


def order_expr(column: str) -> pl.Expr:
    """The order column as int64: integers as they are, dates and date-times as their instant (a time
    zone's as UTC). Text is parsed by `parse_order` (eagerly: polars infers a time zone only there)."""
    return pl.col(column).to_physical().cast(pl.Int64)


def parse_order(df: pl.DataFrame, column: str, order_format: str | None, file_uri: str) -> pl.Series:
    """A text order column as int64 instants: ISO-8601 date-times (a time zone's as UTC), or strictly in
    `data.order_format`; the first value that does not parse is named, with its file."""
    if order_format is None and not df[column].drop_nulls().str.contains(ISO_DATE).all():
        # polars would guess another format (01/12/2024 read day first, unsaid): ISO-8601 only, as documented
        raise _unparsed(df, column, order_format, file_uri)
    try:
        parsed = df[column].str.to_datetime(format=order_format, strict=True, time_unit="us")
    except (pl.exceptions.InvalidOperationError, pl.exceptions.ComputeError):
        raise _unparsed(df, column, order_format, file_uri) from None
    return parsed.to_physical().cast(pl.Int64)


ISO_DATE = r"^\d{4}-\d{2}-\d{2}(?:$|[T ]\d)"  # an ISO-8601 date, alone or before its time


def _unparsed(df: pl.DataFrame, column: str, order_format: str | None, file_uri: str) -> DataError:
    """The error for order text that does not parse: the first value that does not, and the fix."""
    values = df[column]
    try:
        if order_format is None:  # ISO-8601 only: what does not start as an ISO date does not parse
            fails = values.is_not_null() & ~values.str.contains(ISO_DATE)
            parsed = values.str.to_datetime(strict=False, time_unit="us") if not fails.any() else None
            bad = values.filter(fails) if parsed is None else values.filter(parsed.is_null() & values.is_not_null())
        else:
            parsed = values.str.to_datetime(format=order_format, strict=False, time_unit="us")
            bad = values.filter(parsed.is_null() & values.is_not_null())
    except Exception:  # noqa: BLE001 - no format read any value (or they mix time zones): the first one said
        bad = values.drop_nulls()[:1]
    first = repr(bad[0]) if len(bad) else "(a value)"
    how = f"data.order_format={order_format!r}" if order_format else "an ISO-8601 date-time (2024-03-01T12:00:00)"
    return DataError(
        f"{file_uri}: column '{column}' (data.order_by) holds text that does not read as {how}: {first}"
        + (f" and {len(bad) - 1} more" if len(bad) > 1 else "")
        + "; set data.order_format to the format the values are written in (e.g. '%d/%m/%Y %H:%M'), or fix them"
    )


def prepare(
    df: pl.DataFrame,
    sequence_key: str | None,
    order_by: str | None,
    file_uri: str,
    order_format: str | None = None,
    file_name: str | None = None,
) -> pl.DataFrame:
    """Add the sequence (`__seq`, string) and order (`__order`, int64) columns used everywhere below.
    Without a sequence key column, the file is the sequence, named `file_name` (default: `file_uri`,
    which errors name)."""
    if sequence_key is None or sequence_key == FILE_SEQUENCE:
        seq = pl.lit(file_name or file_uri, dtype=pl.Utf8)
    else:
        if df[sequence_key].null_count():
            raise DataError(
                f"{file_uri}: column '{sequence_key}' (data.sequence_key) has {df[sequence_key].null_count()} null "
                "value(s); every row needs a sequence: fill them, or drop those rows from the file"
            )
        seq = pl.col(sequence_key).cast(pl.Utf8)
    if order_by is None:
        order = pl.int_range(0, pl.len(), dtype=pl.Int64)
    else:
        if df[order_by].null_count():
            raise DataError(
                f"{file_uri}: column '{order_by}' (data.order_by) has {df[order_by].null_count()} null value(s); "
                "every row needs a position: fill them, or drop those rows from the file"
            )
        if df.schema[order_by] == pl.Utf8:
            order = pl.lit(parse_order(df, order_by, order_format, file_uri))
        else:
            order = order_expr(order_by)
    return df.with_columns(seq.alias(SEQ), order.alias(ORDER))


def refuse_copies(frame: pl.DataFrame, sequence_key: str | None, order_by: str, where: str) -> None:
    """A DataError when a row of `frame` (prepared rows, sorted: each sequence's rows together and in order)
    repeats the row before it whole: the same sequence, the same order value, every column the same. A file
    read twice (a copy or a backup beside the original) trains on each row twice and interleaves the copies
    in every window (8 rows of history would cover 4 time steps); `predict` gives two predictions a row.
    Rows that only share their order value (two events at one instant) are not copies and are kept."""
    if frame.height < 2:
        return
    tied = np.flatnonzero(np.diff(frame[ORDER].to_numpy()) == 0)  # the candidates: ties of the order, whatever
    if not len(tied):  # the sequence (compared next, with every other column, for those rows only)
        return
    copies = tied[(frame[tied].hash_rows() == frame[tied + 1].hash_rows()).to_numpy()] + 1
    if not len(copies):
        return
    first = int(copies[0])
    at = f"{order_by}={frame[order_by][first]}"
    if sequence_key not in (None, FILE_SEQUENCE):
        at = f"{sequence_key}={frame[sequence_key][first]!r} at {at}"
    raise DataError(
        f"{where}: {len(copies):,} row(s) repeat another row whole (the same sequence and {order_by}, every column "
        f"the same), the first {at}: the same rows twice, as from a file read twice (a copy or a backup of one "
        "beside it?), would be trained on twice and interleaved in every window. Remove the copies and run again"
    )
