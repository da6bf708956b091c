"""`shardline predict`'s input: a parquet file, a folder or a glob of them, read as `shardline run` takes them; and
the registered models a URI naming none may have meant."""

from __future__ import annotations

import glob
from pathlib import Path

import polars as pl

from shardline.core.encoding.columns import DataError
from shardline.core.encoding.write import in_one_zone


def read_input(input_path: str, required: list[str] | None = None) -> pl.DataFrame:
    """`predict`'s rows: a parquet file, or every `*.parquet` of a folder (its subfolders too) or of a glob, read
    one by one and put together as `shardline run` takes them: a column one file lacks is null there, numbers
    of different types take the wider one, date-times in different zones the same instants. A file that does
    not read, or one of several that lacks a `required` column (the model takes it), is named (ValueError)."""
    path = Path(input_path)
    if path.is_dir():
        files = sorted(path.rglob("*.parquet"))
    else:
        files = sorted(map(Path, glob.glob(input_path))) if glob.has_magic(input_path) else [path]
    if not files:
        raise ValueError(f"no parquet file in {input_path}")
    frames = []
    for f in files:
        try:
            frames.append(pl.read_parquet(f))
        except Exception as e:  # noqa: BLE001 - any reader error is about the user's file: say which
            raise ValueError(f"cannot read {f}: {e}") from None
        missing = [c for c in required or [] if c not in frames[-1].columns]
        if missing and len(files) > 1:
            raise ValueError(f"{f} (of {input_path}) lacks column(s) {missing} that the model takes")
    if len(frames) == 1:
        return frames[0]
    try:
        return pl.concat(in_one_zone(frames, [str(f) for f in files]), how="diagonal_relaxed")
    except (DataError, pl.exceptions.PolarsError) as e:
        raise ValueError(f"cannot put the files of {input_path} together: {e}") from None


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
