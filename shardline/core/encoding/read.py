"""Reading raw files for the encode: one file's columns the config names (`read_raw`), a group's files in one
scan where they scan as one table (`_scan_local`) else one by one (`read_group`), a part of a file too large for one
group (`read_file_part`), each with its sequence name and order (`__seq`, `__order`)."""

from __future__ import annotations

import io
from collections.abc import Callable

import polars as pl

from shardline.core import storage
from shardline.core.config import FILE_SEQUENCE, DataConfig
from shardline.core.encoding.columns import (
    ORDER,
    SEQ,
    DamagedFile,
    DataError,
    order_expr,
    parse_order,
    prepare,
    unreadable,
    with_elements,
)
from shardline.core.encoding.folders import below, folder_columns, folder_values, typed, with_columns
from shardline.core.encoding.groups import part_key, read_part, read_rows
from shardline.core.encoding.row_keys import grades
from shardline.core.encoding.splits import ROW
from shardline.core.manifest import FilePart, RawFile, RejectedFile


def sequence_name(uri: str, data: DataConfig) -> str:
    """A raw file's name as a sequence (`data.sequence_key: '@file'`, or no sequence key): its path below
    the source's folder (`2024/game-001.parquet`), not where the data set lies, so a row's split is the
    same on every machine and after the raw files move (a seeded hash of this name)."""
    return below(uri, data.source)


def target_gaps(s: pl.Series) -> str:
    """What a target column holds that no row can be learned or scored on, in words ('' when nothing): nulls, and
    in a float column NaN and infinite values (its mean and spread would be NaN)."""
    found = {"null": s.null_count()}
    if s.dtype.is_float():
        found |= {"NaN": int(s.is_nan().sum()), "infinite": int(s.is_infinite().sum())}
    return " and ".join(f"{n} {what} value(s)" for what, n in found.items() if n)


def read_raw(uri: str, data: DataConfig, raw: bytes | pl.DataFrame | None = None) -> pl.DataFrame:
    """One raw file's columns the config names, with `__seq` and `__order` added (`raw`: the file's bytes,
    already fetched, or its rows: a part of it, `groups.read_part`)."""
    columns = data.raw_columns()
    named = folder_values(uri, data.source).keys() & set(columns)

    def read(f) -> pl.DataFrame:
        if isinstance(f, pl.DataFrame):
            extra = folder_columns(uri, data.source, named, f.schema) if named else {}
            return with_columns(f.select(c for c in columns if c not in extra), extra).select(columns)
        if not named:
            return pl.read_parquet(f, columns=columns)
        # hive-style folders: a column they give and the file lacks is taken from them (shardline.core.encoding.folders)
        extra = folder_columns(uri, data.source, named, pl.read_parquet_schema(f))
        if hasattr(f, "seek"):
            f.seek(0)
        kept = pl.read_parquet(f, columns=[c for c in columns if c not in extra])
        return with_columns(kept, extra).select(columns)

    try:
        if raw is not None:
            df = read(raw if isinstance(raw, pl.DataFrame) else io.BytesIO(raw))
        elif storage.is_remote(uri):
            fs, path = storage.filesystem(uri)
            with fs.open(path, "rb") as f:
                df = read(f)
        else:
            df = read(storage.local_path(uri))
    except Exception as e:
        # not the network's: polars' own error, or any reading of bytes already fetched
        if (isinstance(e, pl.exceptions.PolarsError) and not isinstance(e, OSError)) or (
            isinstance(raw, bytes) and isinstance(e, (OSError, pl.exceptions.PolarsError))
        ):
            raise unreadable(uri, f"read columns {columns}", e, remote=False) from e
        raise DataError(f"{uri}: cannot read columns {columns}: {e}") from e
    df = with_elements(df, data.features.continuous)  # `vec[3]`: element 3 of the list column `vec`
    for target in (t.column for t in data.target_list if t.task != "generation"):  # text: data.on_bad_rows
        if gaps := target_gaps(df[target]):
            raise DataError(
                f"{uri}: the target column '{target}' has {gaps}; fill or drop those rows before training (a row "
                "without a target cannot be learned or scored)"
            )
    for key, column in (("group_key", data.group_key), ("item_key", data.item_key)):
        if column and df[column].null_count():
            raise DataError(
                f"{uri}: column '{column}' (data.{key}) has {df[column].null_count()} null value(s); every row of "
                f"ranking data needs its {key[:-4]}: fill them, or drop those rows from the file"
            )
    if data.group_key:  # the relevance must be a grade: said here, naming the file, before any training
        grades(df[data.target_list[0].column], uri)
    return prepare(df, data.sequence_key, data.order_by, uri, data.order_format, file_name=sequence_name(uri, data))


# numbers of one column in other types in other files, read as the files put together take them (a wider type)
WIDEN = pl.ScanCastOptions(integer_cast=["upcast", "allow-float"], float_cast="upcast")


def _scan_local(uris: list[str], data: DataConfig) -> pl.DataFrame | None:
    """Several local files in one multi-threaded polars scan (the fast path); None when they do not
    scan as one table (different column types...): then each file is read alone, naming the bad one.
    (An object store's group is read file by file from its fetched bytes, each file's dropped once read: one
    query over them all held the group's bytes to its end, +130 MB of peak at 2 workers for no measured speed.)"""
    paths = [storage.local_path(u) for u in uris]
    folders = [folder_values(u, data.source) for u in uris]  # hive-style folder names (core/encoding/folders.py)
    named = set().union(*folders) & set(data.raw_columns())
    # rows need their file's name: as their sequence, for their order, or for their folders' values
    by_file = data.sequence_key in (None, FILE_SEQUENCE) or data.order_by is None or bool(named)
    name = pl.col("__file")
    if by_file:  # each file's sequence name (below the source's folder), by the path the scan read it from
        name = name.replace_strict({p: sequence_name(u, data) for p, u in zip(paths, uris)}, return_dtype=pl.Utf8)
    seq = name if data.sequence_key in (None, FILE_SEQUENCE) else pl.col(data.sequence_key).cast(pl.Utf8)
    try:  # `__seq` and `__order` made inside the scan's query: no second pass over the rows
        # the first file's footer (0.1 ms; the scan's collect_schema: 1 ms); files of other types fail the scan
        held = pl.read_parquet_schema(paths[0])
        text = data.order_by is not None and held.get(data.order_by) == pl.Utf8
        from_folders = []
        for k in named - held.keys():  # a folder's value, by the path the scan read the row from
            types = {typed(v[k]).dtype for v in folders if k in v} - {pl.Null}  # a null one fits any
            if any(k not in v for v in folders) or len(types) > 1:
                return None  # not every file's folders say it, or in different types: read file by file
            mapping = {p: typed(v[k])[0] for p, v in zip(paths, folders)}
            from_folders.append(
                pl.col("__file").replace_strict(mapping, return_dtype=next(iter(types), pl.String)).alias(k)
            )
        if data.order_by is None:
            order = pl.int_range(0, pl.len(), dtype=pl.Int64).over("__file")
        else:  # text is parsed after the scan (a time zone in it is read only eagerly)
            order = pl.lit(0, dtype=pl.Int64) if text else order_expr(data.order_by)

        def scanned(**widen) -> pl.DataFrame:
            # a column the config does not name, in some files only (one added later: a data lake's schema
            # evolution), is left unread (it failed the scan: the group was read file by file, 7x slower)
            scan = pl.scan_parquet(
                paths, extra_columns="ignore", include_file_paths="__file" if by_file else None, **widen
            )
            return (
                scan.with_columns(from_folders)
                .select([*data.raw_columns(), seq.alias(SEQ), order.alias(ORDER)])
                .collect()
            )

        try:
            df = scanned()
        except pl.exceptions.PolarsError:  # a column of other types in other files (an integer column with a null,
            # which pandas writes as floats; a type widened later): read in the type the files put together take
            wanted = set(data.raw_columns()) - set(named)
            empty = [
                pl.DataFrame(schema={c: t for c, t in pl.read_parquet_schema(p).items() if c in wanted}) for p in paths
            ]
            df = scanned(schema=pl.concat(empty, how="vertical_relaxed").schema, cast_options=WIDEN)
        if text:
            df = df.with_columns(parse_order(df, data.order_by, data.order_format, ", ".join(uris)).alias(ORDER))
    except Exception:  # noqa: BLE001 - files that do not scan as one table: read one by one, naming the bad one
        return None
    targets = [t.column for t in data.target_list if t.task != "generation"]  # text: data.on_bad_rows
    if any(target_gaps(df[c]) for c in targets):
        return None  # read file by file: the error names the file and the column
    for col in (data.sequence_key, data.order_by, data.group_key, data.item_key):
        if col and col != FILE_SEQUENCE and df[col].null_count():
            return None  # read file by file: the error names the file and the column
    if data.group_key:
        try:
            grades(df[data.target_list[0].column], "")
        except DataError:
            return None  # read file by file: the error names the file and the value
    return with_elements(df, data.features.continuous)  # `vec[3]`: element 3 of the list column `vec`


def read_group(
    files: list[RawFile],
    data: DataConfig,
    each: Callable[[pl.DataFrame, str], pl.DataFrame] | None = None,
    damaged: list[RejectedFile] | None = None,
) -> pl.DataFrame:
    """A file group's rows, the files in one scan when they scan as one table (same columns and types),
    else read one by one, `each` (a file's rows and its URI -> its rows) applied to each before they are
    put together. A file damaged inside is refused, or with `data.on_bad_file: skip` left out and noted in
    `damaged` (none of its rows: `_or_nothing`)."""
    uris = [f.uri for f in files]
    each = each or (lambda frame, _: frame)
    if isinstance(files[0], FilePart):  # a part of a file too large for one group
        return each(_or_nothing(files[0], data, damaged, lambda: read_file_part(files[0], data)), uris[0])
    df = _scan_local(uris, data) if len(uris) > 1 and not any(storage.is_remote(u) for u in uris) else None
    if df is None:
        fetched = _fetch_remote(uris)
        frames = [
            each(_or_nothing(f, data, damaged, lambda u=f.uri: read_raw(u, data, fetched.pop(u, None))), f.uri)
            for f in files
        ]
        df = pl.concat(in_one_zone(frames, uris), how="vertical_relaxed")
    return df


def _or_nothing(
    f: RawFile, data: DataConfig, damaged: list[RejectedFile] | None, read: Callable[[], pl.DataFrame]
) -> pl.DataFrame:
    """`read()`, the rows of `f` (a file or a part of one); where it is damaged inside and `data.on_bad_file` is
    `skip`, none of its rows, with the columns a read of it gives (its footer's types), and `f` noted in `damaged`."""
    try:
        return read()
    except DamagedFile as e:
        if data.on_bad_file != "skip":
            raise
        if damaged is not None:
            damaged.append(RejectedFile(uri=f.uri, reason=e.cause))
    if storage.is_remote(f.uri):
        fs, path = storage.filesystem(f.uri)
        with fs.open(path, "rb") as handle:
            schema = pl.read_parquet_schema(handle)
    else:
        schema = pl.read_parquet_schema(storage.local_path(f.uri))
    rows = read_raw(f.uri, data, pl.DataFrame(schema=schema))
    if isinstance(f, FilePart) and not part_key(data):  # a part of rows carries their place in their file
        rows = rows.with_columns(pl.Series(ROW, [], pl.UInt64))
    return rows


def read_file_part(f: FilePart, data: DataConfig) -> pl.DataFrame:
    """A part's rows, as `read_raw` reads a file's: by its keys (cut on this machine), or by a range of its rows, which
    keep their place in the file (`__row`, and their order where no column gives one)."""
    if part_key(data):
        return read_raw(f.uri, data, read_part(f, data))
    rows, first = read_rows(f, data)
    placed = pl.int_range(0, pl.len(), dtype=pl.UInt64) + first
    shifted = [pl.col(ORDER) + first] if data.order_by is None else []
    return read_raw(f.uri, data, rows).with_columns(placed.alias(ROW), *shifted)


def in_one_zone(frames: list[pl.DataFrame], uris: list[str]) -> list[pl.DataFrame]:
    """The files' date-time columns in one zone where their zones differ (UTC: the same instants, which is all
    the encoding reads of them); a column with a zone in one file and none in another is said, naming both."""
    zones: dict[str, dict[str | None, str]] = {}
    for frame, uri in zip(frames, uris):
        for c, dtype in frame.schema.items():
            if isinstance(dtype, pl.Datetime):
                zones.setdefault(c, {}).setdefault(dtype.time_zone, uri)
    mixed = {c: z for c, z in zones.items() if len(z) > 1}
    for c, z in mixed.items():
        if None in z:
            zoned = next(u for zone, u in z.items() if zone is not None)
            raise DataError(
                f"column '{c}' holds date-times without a time zone in {z[None]} and with one in {zoned}: the "
                "same instant cannot be told from them; write every file's with a zone (or every file's without)"
            )
    if not mixed:
        return frames
    return [f.with_columns(pl.col(c).dt.convert_time_zone("UTC") for c in mixed if c in f.columns) for f in frames]


def _fetch_remote(uris: list[str]) -> dict[str, bytes]:
    """The bytes of a group's files on an object store, fetched in one concurrent batch (a file at a time, each
    read waited for a round trip); {} for local files. A group is at most `data.group_mb` of raw bytes. Read from
    memory, a file that fails is damaged, never taken for the network's failure (nor the other way round)."""
    if not all(storage.is_remote(u) for u in uris):
        return {}
    return storage.fetch_many(uris)
