"""Hive-style folders (`events/dt=2026-01-01/region=eu/part-0.parquet`, with `data.source: events`): the `key=value`
folder names below the source's folder are columns of every row of the files under them, typed as polars types a
hive partition (its CSV reader's inference: a date, a date-time, an integer, a float, a boolean, else text). Only the
columns the config names count, and a column the file holds itself is read from the file."""

from __future__ import annotations

import functools
import io
import os
from collections.abc import Collection
from urllib.parse import unquote

import polars as pl

from shardline.core import storage

NULL = "__HIVE_DEFAULT_PARTITION__"  # Hive's and Spark's folder name for a null value


def source_folder(source: str) -> str:
    """The folder `data.source` names files below: its path before the first wildcard (`raw/*.parquet`,
    `s3://b/raw/**/*.parquet`: `raw`, `s3://b/raw`), or the folder or file it names."""
    cut = min((source.find(ch) for ch in "*?[" if ch in source), default=-1)
    folder = source[:cut].rsplit("/", 1)[0] if cut >= 0 else source.rstrip("/")
    return folder if storage.is_remote(folder) else os.path.abspath(storage.local_path(folder))


def below(uri: str, source: str) -> str:
    """The file `uri`'s path below the folder of `source` (`2024/game-001.parquet`), or its name where `source`
    names that one file: a file's name as a sequence, the same wherever the data set lies."""
    folder = source_folder(source)
    path = uri if storage.is_remote(uri) else os.path.abspath(storage.local_path(uri))
    return path[len(folder) + 1 :] if path.startswith(folder + "/") else path.rsplit("/", 1)[-1]


def folder_values(uri: str, source: str | None) -> dict[str, str | None]:
    """The `key=value` folder names of the file `uri` below the folder of `source` (an inner one wins); None: of
    its whole path (`shardline predict`'s input, which may name a folder or a file inside the layout)."""
    if "=" not in uri:
        return {}
    out: dict[str, str | None] = {}
    for part in (below(uri, source) if source is not None else uri).split("/")[:-1]:
        key, eq, value = part.partition("=")
        if eq and key:
            out[unquote(key)] = None if value == NULL else unquote(value)
    return out


@functools.lru_cache(maxsize=4096)
def typed(value: str | None) -> pl.Series:
    """A folder's value as a one-value series of the type polars gives it as a hive partition (a null one: of no
    type, so that it joins the other folders' values in theirs)."""
    if value is None:
        return pl.Series("v", [None], dtype=pl.Null)
    quoted = value.replace('"', '""')
    return pl.read_csv(io.BytesIO(f'v\n"{quoted}"\n'.encode()), try_parse_dates=True)["v"]


def time_folders(uri: str, source: str) -> tuple[str, ...]:
    """The values of the file's date or date-time folders below the source's folder (`dt=2026-01-02`), outermost
    first: files sorted by them, then by path, put a new day's files after the old ones in any layout
    (`device=7/dt=...` as `dt=.../device=7`)."""
    return tuple(v for v in folder_values(uri, source).values() if v is not None and typed(v).dtype.is_temporal())


def folder_columns(
    uri: str, source: str | None, wanted: Collection[str], held: Collection[str]
) -> dict[str, pl.Series]:
    """The columns of `wanted` that the folder names of `uri` give and its file does not hold (`held`)."""
    return {k: typed(v) for k, v in folder_values(uri, source).items() if k in wanted and k not in held}


def with_columns(frame: pl.DataFrame, columns: dict[str, pl.Series]) -> pl.DataFrame:
    """`frame` with each folder column's value in every row."""
    if not columns:
        return frame
    return frame.with_columns(s.new_from_index(0, frame.height).alias(k) for k, s in columns.items())
