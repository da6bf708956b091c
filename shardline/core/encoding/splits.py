"""Which rows go to train, validation and test.

By hash (the default): a seeded hash of each sequence's key draws a number in [0, 1) that the
fractions cut into train, validation and test, so a sequence's rows stay together and the split is
stable across machines, versions and appended files; rows without a sequence key are drawn one by
one from their file and row number, or, in ranking data (`data.group_key`), by their group's key, so
a group's rows (a query's results) stay together. By range: a column's value bounds, per split.
K-fold (`method: kfold`): the same seeded draw holds out the top `test` share of sequences as the test
split and deals the rest into `folds` equal bands of the draw, the splits fold0..fold{K-1}, so each
sequence's fold is decided once, by its key, and stored once by the encode; in ranking data without a
sequence key, each group's (by its key, as the hash split draws it)."""

from __future__ import annotations

import datetime
import hashlib
from typing import NamedTuple

import numpy as np
import polars as pl

from shardline.core.config import SPLITS, DataConfig, SplitConfig
from shardline.core.encoding.columns import ORDER, SEQ, DataError

SPLIT = "__split"
ROW = "__row"  # a row's place in its file before any row was left out (text: data.on_bad_rows: skip)
MAX_SLICES = 256  # a split made of more separate row blocks than this is copied out with one filter


class SplitRows(NamedTuple):
    """Where one split's rows sit in a group's frame (`split_rows`): rows `first` to `end`, the first
    row of each of its sequences (counted from `first`) and their keys."""

    first: int
    end: int
    starts: np.ndarray
    keys: list[str]


def _splitmix64(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.uint64)
    with np.errstate(over="ignore"):
        x = x + np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _key64(text: str, seed: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{text}".encode()).digest()[:8], "little")


def _unit(x: np.ndarray) -> np.ndarray:
    """One number in [0, 1) per 64-bit value: the top 53 bits of its hash, the draw the split cuts."""
    return (_splitmix64(x) >> np.uint64(11)).astype(np.float64) / float(1 << 53)


def _split_index(u: np.ndarray, split: SplitConfig) -> np.ndarray:
    """0 train, 1 validation, 2 test for each draw, by the split's fractions."""
    f_train = split.fractions.get("train", 0.0)
    f_val = split.fractions.get("validation", 0.0)
    return np.where(u < f_train, 0, np.where(u < f_train + f_val, 1, 2)).astype(np.int8)


def _fold_index(u: np.ndarray, split: SplitConfig) -> np.ndarray:
    """k-fold: the fold 0..K-1 of each draw below 1 - test, K (the test split) for the rest."""
    keep = 1.0 - split.test
    fold = np.minimum((u / keep * split.folds).astype(np.int64), split.folds - 1)
    return np.where(u < keep, fold, split.folds).astype(np.int16)


def sequence_splits(keys: list[str], split: SplitConfig) -> np.ndarray:
    """The index in `split.names()` of each sequence key's split (0 train, 1 validation, 2 test; k-fold:
    its fold, K for test)."""
    if not keys:
        return np.zeros(0, np.int8)
    u = _unit(np.array([_key64(k, split.seed) for k in keys], dtype=np.uint64))
    return _fold_index(u, split) if split.method == "kfold" else _split_index(u, split)


def label_rows(df: pl.DataFrame, data: DataConfig) -> pl.DataFrame:
    """Add `__split` to rows that are not split by sequence: by value ranges, or (no sequence key) by a
    seeded hash of each row's file and its row number in that file, or of its group's key in ranking data
    (as `sequence_splits` draws a sequence's). Rows outside every range are dropped. The row number is
    the row's place in its file as read (`__row` when the frame has it: rows were left out after reading,
    so leaving out a bad row moves no other row to another split); `__row` is not kept."""
    if ROW in df.columns:
        rows, df = df[ROW].cast(pl.UInt64).to_numpy(), df.drop(ROW)
    else:
        rows = None
    split = data.split
    if split.method == "range":
        col = pl.col(split.column)
        dtype = df.schema[split.column]
        expr = pl.lit(None, dtype=pl.Utf8)
        for name in reversed(SPLITS):
            if name not in split.ranges:
                continue
            lo, hi = (bound_value(b, dtype, f"data.split.ranges.{name}") for b in split.ranges[name])
            cond = pl.lit(True)
            if lo is not None:
                cond = cond & (col >= lo)
            if hi is not None and whole_day(split.ranges[name][1], dtype):  # [.., 2026-03-07]: through the 7th
                cond = cond & (col < hi + datetime.timedelta(days=1))
            elif hi is not None:
                cond = cond & (col <= hi)
            expr = pl.when(cond).then(pl.lit(name)).otherwise(expr)
        return df.with_columns(expr.alias(SPLIT)).filter(pl.col(SPLIT).is_not_null())
    if data.group_key is not None:  # ranking: a group's rows stay together (a query is ranked whole)
        groups = df[data.group_key].cast(pl.Utf8)
        distinct = groups.unique()
        drawn = np.array(split.names(), dtype=object)[sequence_splits(distinct.to_list(), split)]  # k-fold: its fold
        labels = groups.replace_strict(distinct, pl.Series(drawn.tolist(), dtype=pl.Utf8), return_dtype=pl.Utf8)
        return df.with_columns(labels.alias(SPLIT))
    bases = {k: _key64(k, split.seed) for k in df[SEQ].unique().to_list()}
    base = df[SEQ].replace_strict(bases, return_dtype=pl.UInt64).to_numpy()
    row = (
        rows
        if rows is not None
        else df.select(pl.int_range(0, pl.len(), dtype=pl.UInt64).over(SEQ)).to_series().to_numpy()
    )
    u = _unit(base ^ row)
    names = np.array(SPLITS, dtype=object)[_split_index(u, split)]
    return df.with_columns(pl.Series(SPLIT, names.tolist(), dtype=pl.Utf8))


def whole_day(bound, dtype: pl.DataType) -> bool:
    """Whether a range split's upper bound is a day (a YAML date, or ISO-8601 text of a date alone) over a date-time
    column: it then covers that whole day, as a user writing `[2026-03-01, 2026-03-07]` for a week means, not its
    first instant (which left the 7th's rows in no split, so out of the data)."""
    if not isinstance(dtype, pl.Datetime):
        return False
    if isinstance(bound, datetime.date):
        return not isinstance(bound, datetime.datetime)
    try:
        return isinstance(bound, str) and len(bound.strip()) == 10 and bool(datetime.date.fromisoformat(bound.strip()))
    except ValueError:
        return False


def bound_value(bound, dtype: pl.DataType, key: str):
    """A range split's bound as a value of the split column's type: a date or a date-time (YAML dates, or
    ISO-8601 text such as 2024-03-01 or 2024-03-01T12:00:00) for a date/time column, in the column's time
    zone when the bound names none; numbers and text as they are."""
    import datetime as dt

    if bound is None or not dtype.is_temporal():
        return bound
    try:
        if dtype == pl.Date:
            value = bound if isinstance(bound, dt.date) else dt.date.fromisoformat(str(bound)[:10])
            return value.date() if isinstance(value, dt.datetime) else value
        value = bound if isinstance(bound, dt.datetime) else dt.datetime.fromisoformat(str(bound))
    except ValueError:
        raise DataError(
            f"{key}: bound {bound!r} is not a date or an ISO-8601 date-time, as the split column (a {dtype}) "
            "needs; write it as 2024-03-01 or 2024-03-01T12:00:00"
        ) from None
    if isinstance(value, dt.date) and not isinstance(value, dt.datetime):
        value = dt.datetime(value.year, value.month, value.day)
    tz = getattr(dtype, "time_zone", None)
    if tz and value.tzinfo is None:
        from zoneinfo import ZoneInfo

        value = value.replace(tzinfo=ZoneInfo(tz))
    elif not tz and value.tzinfo is not None:
        value = value.astimezone(dt.UTC).replace(tzinfo=None)
    return value


def sequence_runs(df: pl.DataFrame) -> tuple[np.ndarray, list[str]] | None:
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


def split_rows(df: pl.DataFrame, data: DataConfig) -> tuple[pl.DataFrame, dict[str, SplitRows]]:
    """A group's prepared rows with each split's rows together (train, then validation, then test;
    every sequence's rows contiguous and in order), and per split present: (first row, end row,
    the first row of each of its sequences counted from the split's first row, their keys).

    Sequences split by hash (the usual case) keep their rows where they are: the frame is a few
    zero-copy slices of the group when the files already hold each sequence's rows in order, so
    the rows are copied once, by the encode, straight into the shards. Otherwise the rows are
    labelled (`label_rows`), filtered and sorted."""
    pieces: list[pl.DataFrame] = []
    splits: dict[str, SplitRows] = {}
    at = 0
    if data.split.method in ("hash", "kfold") and data.sequence_key is not None:
        if ROW in df.columns:  # a sequence's rows go where its key draws: their places do not count
            df = df.drop(ROW)  # (a drop is a query of its own: ~2 ms on a group's 75 columns)
        runs = sequence_runs(df)
        if runs is None:
            df = df.sort([SEQ, ORDER], maintain_order=True)
            runs = sequence_runs(df)
        starts, keys = runs
        labels = sequence_splits(keys, data.split)
        ends = np.append(starts[1:], df.height).astype(np.int64)
        lengths = ends - starts
        for i, name in enumerate(data.split.names()):
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
            splits[name] = SplitRows(at, at + rows, local, [keys[k] for k in picked])
            at += rows
    else:
        labelled = label_rows(df, data)
        for name in data.split.names():
            part = labelled.filter(pl.col(SPLIT) == name).drop(SPLIT)
            if not part.height:
                continue
            runs = sequence_runs(part)
            if runs is None:
                part = part.sort([SEQ, ORDER], maintain_order=True)
                runs = sequence_runs(part)
            pieces.append(part)
            splits[name] = SplitRows(at, at + part.height, *runs)
            at += part.height
    frame = pl.concat(pieces, rechunk=False) if pieces else df.clear()
    return frame, splits
