"""`shardline predict`'s input: a parquet file, a folder or a glob of them, read as `shardline run` takes them; and
the registered models a URI naming none may have meant."""

from __future__ import annotations

import io

import polars as pl

from shardline.core import storage
from shardline.core.encoding.columns import DataError
from shardline.core.encoding.folders import below, folder_columns, folder_values, with_columns
from shardline.core.encoding.write import in_one_zone


def read_input(input_path: str, schema=None, by_file: str | None = None) -> pl.DataFrame:
    """`predict`'s rows: a parquet file, or every `*.parquet` of a folder (its subfolders too) or of a glob, local
    or in an object store (`s3://...`: fetched in concurrent batches), read one by one and put together as
    `shardline run` takes them: a column one file lacks is null there, numbers of different types take the wider
    one, date-times in different zones the same instants. With the model's input `schema` (MLflow's), only the
    columns it takes are read (a file of the demo's 80 columns, for a model of 8, is read at a tenth of its size);
    a file that does not read, or one of several that lacks a column the model requires, is named (ValueError).
    `by_file`: a column to name each row's file in (its path below the input's folder), for a model whose sequence
    is the file (`serving.file_key`)."""
    listed = storage.listed_files(input_path)
    fs = storage.filesystem(input_path)[0]
    sizes = {storage.source_uri(fs, input_path, p): int(info.get("size") or 0) for p, info in listed.items()}
    files = sorted(sizes)
    if not files:
        raise ValueError(f"no parquet file in {input_path}{storage.no_bucket(input_path)}")
    wanted = schema.input_names() if schema is not None else None
    required = schema.required_input_names() if schema is not None else []
    frames = []
    for f, source in storage.fetched([(f, sizes[f]) for f in files], FETCH_BYTES):
        try:
            frame = _read(source, wanted)
            # hive-style folders (dt=.../part-0.parquet) in the file's path, INPUT's folder or above it: their columns
            frame = with_columns(frame, folder_columns(f, None, wanted or folder_values(f, input_path), frame))
            if by_file:
                frame = frame.with_columns(pl.lit(below(f, input_path), pl.String).alias(by_file))
        except Exception as e:  # noqa: BLE001 - any reader error is about the user's file: say which
            raise ValueError(f"cannot read {f}: {e}") from None
        missing = [c for c in required if c not in frame.columns]
        if missing and len(files) > 1:
            raise ValueError(f"{f} (of {input_path}) lacks column(s) {missing} that the model takes")
        frames.append(frame)
    if len(frames) == 1:
        return frames[0]
    try:
        return pl.concat(in_one_zone(frames, files), how="diagonal_relaxed")
    except (DataError, pl.exceptions.PolarsError) as e:
        raise ValueError(f"cannot put the files of {input_path} together: {e}") from None


FETCH_BYTES = 64 << 20  # an object store's input files fetched in one concurrent batch, at most (the memory held)


def _read(source, wanted: list[str] | None) -> pl.DataFrame:
    """A parquet file (a path, or its bytes), its columns in `wanted` only (None: all of them)."""
    if wanted is None:
        return pl.read_parquet(source)
    taken = set(wanted)
    names = [c for c in pl.read_parquet_schema(source) if c in taken]
    if hasattr(source, "seek"):  # (bytes fetched, or a large file opened in place)
        source.seek(0)
    return pl.read_parquet(source, columns=names)


def write_output(frame: pl.DataFrame, out: str) -> None:
    """`predict`'s predictions as the parquet file `out`, local or in an object store, written whole or not at
    all (a local file aside, then renamed; an object in one put)."""
    buf = io.BytesIO()
    frame.write_parquet(buf)
    storage.write_bytes(out, buf.getbuffer())


def placeholder(dtype) -> object:
    """A value of an MLflow column type, for an input that generation does not read."""
    import numpy as np
    import pandas as pd

    name = getattr(dtype, "name", "")
    if name == "string":
        return "-"
    if name == "datetime":
        return pd.Timestamp(0)
    if name == "binary":
        return b""
    if name == "boolean":
        return False
    return np.zeros(1, dtype=dtype.to_numpy())[0] if hasattr(dtype, "to_numpy") else 0


def registered_like(model_uri: str) -> str:
    """'; the store has models ...' naming the registered models closest to a models:/ URI's name."""
    import difflib

    import mlflow

    if not model_uri.startswith("models:/"):
        return ""
    name = model_uri.removeprefix("models:/").split("/")[0].split("@")[0]
    try:
        names = [m.name for m in mlflow.search_registered_models(max_results=1000)]
    except Exception:  # noqa: BLE001 - only a hint
        return ""
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.5) or sorted(names)[:5]
    return f"; the store has {', '.join(close)}" if close and name not in names else ""
