"""`shardline predict`'s input: a parquet file, a folder or a glob of them, read as `shardline run` takes them; and
the registered models a URI naming none may have meant."""

from __future__ import annotations

import io
import re

import polars as pl

from shardline.core import listing, storage
from shardline.core.encoding.columns import DataError
from shardline.core.encoding.folders import below, folder_columns, folder_values, with_columns
from shardline.core.encoding.read import in_one_zone


def read_input(input_path: str, schema=None, by_file: str | None = None) -> pl.DataFrame:
    """`predict`'s rows: a parquet file, or every `*.parquet` of a folder (its subfolders too) or of a glob, local
    or in an object store (`s3://...`: fetched in concurrent batches), read one by one and put together as
    `shardline run` takes them: a column one file lacks is null there, numbers of different types take the wider
    one, date-times in different zones the same instants. With the model's input `schema` (MLflow's), only the
    columns it takes are read (a file of the demo's 80 columns, for a model of 8, is read at a tenth of its size);
    a file that does not read, or one of several that lacks a column the model requires, is named (ValueError).
    `by_file`: a column to name each row's file in (its path below the input's folder), for a model whose sequence
    is the file (`serving.file_key`)."""
    return next(read_chunks(input_path, schema, by_file, rows=None))


def read_chunks(
    input_path: str,
    schema=None,
    by_file: str | None = None,
    rows: int | None = None,
    within=False,
    out: str | None = None,
):
    """`read_input`'s rows, whole files at a time, each chunk at least `rows` rows but for the last (None: one
    chunk): for a model whose sequence is the file, each chunk is predicted as the whole input would be. `within`
    (a model of one row a window, which predicts each row on its own): a file of more than `rows` rows is read
    `rows` at a time too (polars reads only the row groups of each). `out`: where the predictions go, refused
    (ValueError) before any row is read when it is one of the input's files."""
    listed = listing.listed_files(input_path)
    fs = storage.filesystem(input_path)[0]
    sizes = {listing.source_uri(fs, input_path, p): int(info.get("size") or 0) for p, info in listed.items()}
    files = sorted(sizes)
    if not files:
        raise ValueError(f"no parquet file in {input_path}{listing.no_bucket(input_path)}")
    if out is not None and (same := _one_of(out, files)):
        raise ValueError(
            f"--out {out} is {same}, a file of the input: the predictions would replace its rows; name another file"
        )
    wanted = schema.input_names() if schema is not None else None
    required = schema.required_input_names() if schema is not None else []
    frames, names = [], []
    for f, source in storage.fetched([(f, sizes[f]) for f in files], FETCH_BYTES):
        pieces = _pieces(source, wanted, rows if within else None)
        while True:
            try:
                frame = next(pieces, None)
                if frame is None:
                    break
                # hive-style folders (dt=.../part-0.parquet) in the file's path, INPUT's folder or above it: columns
                frame = with_columns(frame, folder_columns(f, None, wanted or folder_values(f, input_path), frame))
                if by_file:
                    frame = frame.with_columns(pl.lit(below(f, input_path), pl.String).alias(by_file))
            except Exception as e:  # noqa: BLE001 - any reader error is about the user's file: say which
                kind = storage.extension(f)
                hint = f". {listing.as_parquet_hint(kind)}, its columns typed as in training" * (
                    kind in listing.TABLE_TEXT
                )
                raise ValueError(f"cannot read {f}: {e}{hint}") from None
            missing = [c for c in required if c not in frame.columns]
            if missing and len(files) > 1:
                raise ValueError(f"{f} (of {input_path}) lacks column(s) {missing} that the model takes")
            frames.append(frame)
            names.append(f)
            if rows is not None and sum(x.height for x in frames) >= rows:
                yield _together(frames, names, input_path)
                frames, names = [], []
    if frames:  # (every file gives a frame, of no rows if it has none)
        yield _together(frames, names, input_path)


def _one_of(out: str, files: list[str]) -> str | None:
    """The input file that `out` names (the same local file by any path to it, or the same object), else None."""
    import os

    if storage.is_remote(out):
        fs, path = storage.filesystem(out)
        same = listing.source_uri(fs, out, path)
        return same if same in files else None
    mine = os.path.realpath(storage.local_path(out))
    return next(
        (f for f in files if not storage.is_remote(f) and os.path.realpath(storage.local_path(f)) == mine), None
    )


def _pieces(source, wanted: list[str] | None, rows: int | None):
    """A parquet file's rows (its columns in `wanted`): whole (`rows` None), else `rows` at a time. A large file of an
    object store, opened where it is, is read a row group at a time (pyarrow's ranged reads: polars would fetch all
    of it for each piece)."""
    if rows is None:
        yield _read(source, wanted)
        return
    if not isinstance(source, (str, io.BytesIO)):
        import pyarrow as pa
        import pyarrow.parquet as pq

        pf = pq.ParquetFile(source)
        taken = [c for c in pf.schema_arrow.names if wanted is None or c in set(wanted)]
        held: list = []
        for g in range(pf.num_row_groups):
            held.append(pf.read_row_group(g, columns=taken))
            if sum(t.num_rows for t in held) >= rows or g == pf.num_row_groups - 1:
                yield pl.from_arrow(pa.concat_tables(held))
                held = []
        if not pf.num_row_groups:
            yield pl.from_arrow(pf.schema_arrow.empty_table().select(taken))
        return

    def scan() -> pl.LazyFrame:
        if hasattr(source, "seek"):
            source.seek(0)
        return pl.scan_parquet(source)

    taken = None if wanted is None else [c for c in scan().collect_schema().names() if c in set(wanted)]
    total = scan().select(pl.len()).collect().item()
    for start in range(0, max(total, 1), rows):
        piece = scan().slice(start, rows)
        yield (piece if taken is None else piece.select(taken)).collect()


def _together(frames: list[pl.DataFrame], files: list[str], input_path: str) -> pl.DataFrame:
    if len(frames) == 1:
        return frames[0]
    try:
        return pl.concat(in_one_zone(frames, files), how="diagonal_relaxed")
    except (DataError, pl.exceptions.PolarsError) as e:
        raise ValueError(f"cannot put the files of {input_path} together: {e}") from None


class InputError(ValueError):
    """Input `predict` cannot take: the command's message, exit code 2."""


def row_wise(predictor) -> bool:
    """A Shardline model that predicts each row from that row alone (a window of one row, no sequence, no order,
    not text: a ranker's scores, a tabular classifier), so any cut of the rows gives the same predictions."""
    spec = getattr(predictor, "spec", None) if getattr(predictor, "input_types", None) else None
    return bool(spec) and spec.window == 1 and spec.text is None and not spec.sequence_key and not spec.order_by


def predict_rows() -> int:
    """Rows predicted at once where each file is a sequence (whole files a chunk) or each row is predicted alone (a
    large file cut too): the memory of a large input is this many rows' (~200-500 bytes a row as they are
    predicted), its predictions apart (`SHARDLINE_PREDICT_ROWS`)."""
    from shardline.core.config import settings

    return int(settings.number("SHARDLINE_PREDICT_ROWS"))


def write_predictions(
    model, input_path: str, model_uri: str, forecast: bool, max_tokens: int | None, out: str
) -> tuple[int, int]:
    """`shardline predict`: the predictions of the rows of `input_path` by the loaded `model`, written to `out` (whole
    or not at all); how many, and the input's row count. A model whose sequence is the file predicts whole files a
    chunk (`predict_rows`), as it would them all at once: each chunk's predictions go to a scratch file as they
    come, then into `out` in one streamed pass, so the memory is a chunk's whatever the input's size. Its notes on
    the input's rows then name each chunk's files."""
    import logging
    import tempfile

    from shardline.trainer.serving import PREDICT_LOG, file_key, kept_notes

    schema = model.metadata.get_input_schema()
    predictor = getattr(model.unwrap_python_model(), "predictor", None)
    by_file = file_key(predictor.spec) if getattr(predictor, "input_types", None) else None  # each row's file
    within = row_wise(predictor)  # rows predicted one by one: a large file a chunk of rows at a time
    limit = predict_rows()
    chunks = read_chunks(input_path, schema, by_file, limit if by_file or within else None, within=within, out=out)
    with tempfile.TemporaryDirectory(prefix="shardline-predict-") as scratch:
        results, rows, n, empty, chunked, said = [], 0, 0, None, False, {}
        while True:
            try:
                df = next(chunks, None)
            except ValueError as e:  # a file that does not read, or lacks a column (named)
                raise InputError(str(e)) from None
            if df is None:
                break
            start, rows = rows, rows + df.height
            chunked = chunked or df.height >= limit
            with kept_notes() as notes:
                try:
                    result = _predicted(model, predictor, df, by_file, forecast, max_tokens, (input_path, model_uri))
                except DataError as e:
                    if not (by_file and str(e).startswith("0 predictions")):
                        raise InputError(f"{input_path}: {e}") from None
                    empty = empty or e  # a chunk's files too short for a window: said if every file is
                    result = None
            files = sorted(df[by_file].unique().to_list()) if chunked and by_file in df.columns else []
            for note in notes:  # (as `predict_frame` says them; a chunk's name the files it read, or its rows)
                if within and chunked and _said(note, said):
                    continue
                where = f"files {files[0]} to {files[-1]}: " if files else ""
                where = f"rows {start + 1:,} to {rows:,}: " if within and chunked else where
                logging.getLogger(PREDICT_LOG).warning("predict: %s%s", where, note)
            if result is not None and within and start and "row" in result.columns:  # its place in the input
                result = result.with_columns(pl.col("row") + start)
            if result is not None:
                n += result.height
                results.append(result if not chunked else _aside(result, scratch, len(results), out))
        if not results:
            raise InputError(f"{input_path}: {empty}")
        if again := sum(said.values()):
            logging.getLogger(PREDICT_LOG).warning("predict: (notes as those above, of later rows: %d more)", again)
        try:
            if not chunked:
                write_output(results[0], out)
            else:  # the chunks' key types put together as the files' are (an int32 order in one, int64 in another)
                whole = pl.concat([pl.scan_parquet(f) for f in results], how="diagonal_relaxed")
                whole.sink_parquet(f"{scratch}/predictions.parquet")
                storage.write_file(out, f"{scratch}/predictions.parquet")
        except OSError as e:
            raise InputError(f"cannot write --out {out}: {e}") from None
    return n, rows


def _said(note: str, said: dict[str, int]) -> bool:
    """Whether a note of its kind (its words, whatever its counts) was said for earlier rows: counted in `said`."""
    kind = re.sub(r"[\d,.]+", "#", note)
    if kind in said:
        said[kind] += 1
        return True
    said[kind] = 0
    return False


def _aside(frame: pl.DataFrame, folder: str, i: int, out: str) -> str:
    path = f"{folder}/chunk-{i:06d}.parquet"
    try:
        frame.write_parquet(path)
    except OSError as e:  # a full disk where the scratch files go
        raise InputError(f"cannot write --out {out}: its predictions so far in {folder}: {e}") from None
    return path


def _predicted(model, predictor, df: pl.DataFrame, by_file, forecast, max_tokens, names: tuple) -> pl.DataFrame:
    """One chunk's predictions (`write_predictions`), their keys in the input's own types (a join needs no cast);
    `names`: the input's and the model's, for the messages."""
    from shardline.trainer.serving import naive_utc

    (input_path, model_uri), schema = names, model.metadata.get_input_schema()
    if schema is not None:  # only the columns the model takes (no "extra inputs ignored" warning for the rest)
        missing = [c for c in schema.required_input_names() if c not in df.columns]
        if missing:
            taken = schema.input_names()
            raise InputError(
                f"{input_path} lacks column(s) {missing} that {model_uri} takes: its rows need every column it was "
                f"trained on ({len(taken)}: {', '.join(taken)})"
            )
        df = df.select([c for c in [*schema.input_names(), by_file] if c in df.columns] or df.columns)
    if getattr(predictor, "input_types", None):  # Shardline's model: the rows as read (no pandas round trip, in
        # which an integer column with a null turns float64 and MLflow refuses it), in the trained types
        params = None if max_tokens is None else {"max_tokens": max_tokens}  # generation: text models only
        result = predictor.predict_frame(df, forecast=forecast, params=params)
    elif forecast:
        raise InputError(f"--forecast: {model_uri} was registered by an older Shardline; register it again to forecast")
    else:  # a model registered before its bundle kept the input's types: MLflow's schema enforcement, through
        # pandas, which takes naive date-times only: time zones go in as UTC and come back in the input's zone
        result = pl.from_pandas(model.predict(naive_utc(df.to_pandas())))
        for c, t in df.schema.items():
            if c in result.columns and isinstance(t, pl.Datetime) and t.time_zone:
                result = result.with_columns(pl.col(c).dt.replace_time_zone("UTC").dt.convert_time_zone(t.time_zone))
    for c, dtype in df.schema.items():
        if c in result.columns and result.schema[c] != dtype:
            result = result.with_columns(pl.col(c).cast(dtype))
    return result


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
    if name in names:  # the model is there: its alias or version is not
        return _versions_of(name)
    close = difflib.get_close_matches(name, names, n=3, cutoff=0.5) or sorted(names)[:5]
    return f"; the store has {', '.join(close)}" if close else ""


def _versions_of(name: str) -> str:
    """'; NAME has versions 3 (@champion), 2, 1 (@challenger)': its newest five, each with its aliases."""
    from mlflow import MlflowClient

    try:
        client = MlflowClient()
        aliases = client.get_registered_model(name).aliases
        versions = sorted((int(v.version) for v in client.search_model_versions(f"name='{name}'")), reverse=True)
    except Exception:  # noqa: BLE001 - only a hint
        return ""
    held: dict[int, list[str]] = {}
    for alias, version in aliases.items():
        held.setdefault(int(version), []).append(f"@{alias}")
    shown = ", ".join(f"{v} ({' '.join(sorted(held[v]))})" if v in held else str(v) for v in versions[:5])
    more = f", ... ({len(versions)} in all)" if len(versions) > 5 else ""
    champion = "" if "champion" in aliases else ", none @champion (the first to beat its test baseline becomes it)"
    return f"; {name} has version(s) {shown}{more}{champion}: name one as models:/{name}/N or by an alias it has"
