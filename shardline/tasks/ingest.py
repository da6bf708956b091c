"""Ingest: list the raw parquet files, check each one's schema from its footer, return a snapshot."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator

import pyarrow as pa
import pyarrow.parquet as pq
from prefect import task
from prefect.logging import get_run_logger

from shardline.core import layout, storage
from shardline.core.config import FILE_SEQUENCE, DataConfig, stable_hash
from shardline.core.config.data import element_of, read_names
from shardline.core.encoding.columns import DamagedFile, DataError, unreadable
from shardline.core.encoding.folders import folder_columns
from shardline.core.listing import (
    TABLE_TEXT,
    as_parquet_hint,
    list_source,
    listed_files,
    no_bucket,
    other_tables,
    source_uri,
)
from shardline.core.manifest import RawFile, RejectedFile, Snapshot
from shardline.core.memory import trim
from shardline.core.secrets import redacted_errors
from shardline.core.storage import (
    extension,
    filesystem,
    is_remote,
)
from shardline.tasks.caching import CacheRule, raw_files_key
from shardline.trainer.serving import dictionaries_as_values, naive_utc

_t = pa.types
_NUMBER = (_t.is_integer, _t.is_floating, _t.is_decimal)
_STRING = (_t.is_string, _t.is_large_string)
_KEY = ((_t.is_integer, *_STRING, _t.is_boolean), "a string, an integer or a boolean")
_TEXT = (*_STRING, _t.is_string_view)  # tokenized (shardline/core/encoding/text.py)
# role -> (the arrow types a column that plays it may have, a dictionary by its values' type; what it must be)
_ROLES = {
    # a date/time: its instant, as a number (shardline/core/encoding/columns.py)
    "continuous": ((*_NUMBER, _t.is_boolean, _t.is_temporal), "a number (int or float), a boolean or a date/time"),
    "boolean": ((_t.is_boolean,), "a boolean"),
    "categorical": _KEY,
    "classification target": _KEY,
    "sequence key": (_KEY[0], "a string or an integer"),
    "group key": _KEY,
    "item key": _KEY,
    "regression target": (_NUMBER, "a number"),
    "text": (_TEXT, "a string (text tokenized by data.tokenizer)"),
    "generation target": (_TEXT, "a string (text the model learns to write)"),
    # text: ISO-8601 date-times (or data.order_format), parsed when read
    "order": ((_t.is_integer, _t.is_temporal, *_STRING), "an integer, a date/time or ISO-8601 text"),
    "split column": ((*_NUMBER, _t.is_temporal, *_STRING), "a number, a date/time or a string"),
    "id column": ((lambda t: True,), "any type"),  # passed through to predictions as it is
}


# the setting that names a column of each role (a feature's: data.features; a target's: data.target or targets)
_SETTING = {
    "sequence key": "data.sequence_key",
    "order": "data.order_by",
    "split column": "data.split.column",
    "group key": "data.group_key",
    "item key": "data.item_key",
    "id column": "data.id_columns",
}


def expected_columns(data: DataConfig) -> dict[str, str]:
    """column -> the role it plays (used for the checks and their messages): a feature's kind, else the first
    other role that names it."""
    f = data.features
    features = {"continuous": f.continuous, "boolean": f.boolean, "categorical": f.categorical, "text": f.text}
    roles = {c: kind for kind, columns in features.items() for c in columns}
    others = [
        *((t.column, f"{t.task} target") for t in data.target_list),
        (data.sequence_key if data.sequence_key != FILE_SEQUENCE else None, "sequence key"),
        (data.order_by, "order"),
        (data.split.column if data.split.method == "range" else None, "split column"),
        (data.group_key, "group key"),
        (data.item_key, "item key"),
        *((c, "id column") for c in data.id_columns),
    ]
    for column, role in others:
        if column:
            roles.setdefault(column, role)
    return roles


def _element_problem(name: str, element: tuple[str, int], t: pa.DataType) -> str:
    """Why `name` (`vec[3]`: a continuous feature, an element of the column `vec` of type `t`) cannot be read ('' when
    it can): the column holds no list of numbers, or a fixed-size array too short for it."""
    column, i = element
    if not (pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or pa.types.is_large_list(t)):
        return f"'{name}' names an element of column '{column}', which holds {t}, not a list of numbers"
    if not any(is_type(t.value_type) for is_type in _NUMBER):
        return f"'{name}' names an element of column '{column}', whose elements are {t.value_type}, not numbers"
    if pa.types.is_fixed_size_list(t) and i >= t.list_size:
        return (
            f"'{name}' is past the end of column '{column}', which holds {t.list_size} elements a row "
            f"({column}[0:{t.list_size}] names them all)"
        )
    return ""


def _list_hint(col: str, t: pa.DataType, kind: str) -> str:
    """What to do with a list or struct column (a vector a row: an embedding, a sensor's axes; a text's pieces)."""
    listed = pa.types.is_fixed_size_list(t) or pa.types.is_list(t) or pa.types.is_large_list(t)
    if listed and kind == "text":  # elements are numbers' features only: a text column is one string a row
        return f"; join a row's pieces into one string (polars: pl.col('{col}').list.join(' '))"
    if listed:
        n = t.list_size if pa.types.is_fixed_size_list(t) else "N"
        return f"; to take its elements as features, name them: {col}[0:{n}] (elements 0 to {n} - 1)"
    if pa.types.is_struct(t):
        return f"; a feature is one value a row: name its fields as columns (polars: df.unnest('{col}'))"
    return ""


def check_schema(schema: pa.Schema, data: DataConfig, uri: str = "") -> list[str]:
    """Reasons the file `uri` cannot be used (empty when it fits the config)."""
    import difflib

    problems = []
    for col, kind in expected_columns(data).items():
        idx = schema.get_field_index(col)
        if kind == "continuous" and (e := element_of(col)):  # `vec[3]`: element 3 of the list column `vec`
            said = _element_problem(col, e, schema.field(e[0]).type) if e[0] in schema.names else (
                f"missing column '{e[0]}', whose element '{col}' is a feature (data.features.continuous)"
                + (f"; the file's column named '{col}' is not read: a name ending in [N] names a list's element, "
                   "so rename the column" if idx >= 0 else "")
            )  # fmt: skip
            problems += [said] if said and said not in problems else []
            continue
        if idx < 0:
            close = difflib.get_close_matches(col, schema.names, n=3, cutoff=0.6)
            hint = f"; did you mean {' or '.join(repr(c) for c in close)}?" if close else ""
            head, _, field = col.rpartition(".")
            if head in schema.names and pa.types.is_struct(t := schema.field(head).type):  # `pos.x` of a struct `pos`
                fields = [t.field(i).name for i in range(t.num_fields)]
                which = f"its field '{field}'" if field in fields else f"(it has no field '{field}') those you want"
                hint = (
                    f"; '{head}' is a struct ({', '.join(fields)}), and a struct's fields are not read as columns: "
                    f"write {which} as columns (polars: df.unnest('{head}'), which names them "
                    f"{', '.join(map(repr, fields))})."
                )
            if f"/{col}=" in uri:  # the same words for every such file: their reasons are said once, grouped
                hint = (
                    f"; it is in a folder name ({col}=...: a hive-style partition) above the folder of data.source "
                    f"({data.source}), and only folders below it are read as columns: name the folder that holds "
                    f"the '{col}=...' folders (or a glob from it) as data.source."
                )
            shown = ", ".join(schema.names[:30]) + (
                f", ... ({len(schema.names)} in all)" if len(schema.names) > 30 else ""
            )
            target = "data.targets" if data.targets else "data.target"  # as the config names it
            where = _SETTING.get(kind, "data.features") if "target" not in kind else target
            problems.append(f"missing column '{col}' (the {kind} in {where}){hint or '.'} The file has: {shown}")
            continue
        t = schema.field(idx).type
        types, allowed = _ROLES[kind]
        if pa.types.is_null(t):  # only nulls (a hive-style folder's null value): a column of any type; rows that
            continue  # need a value (keys, targets) are counted by the encode
        if not any(is_type(t.value_type if pa.types.is_dictionary(t) else t) for is_type in types):
            hint = _list_hint(col, t, kind)
            problems.append(f"column '{col}' has type {t}, but as the {kind} it must be {allowed}{hint}")
        elif kind == "split column" and pa.types.is_temporal(t):
            problems += _bound_problems(data, t)
    return problems


def with_folders(schema: pa.Schema, uri: str, data: DataConfig) -> pa.Schema:
    """A file's `schema` and the columns its hive-style folder names give it (shardline.core.encoding.folders)."""
    for k, value in folder_columns(uri, data.source, expected_columns(data), schema.names).items():
        schema = schema.append(pa.field(k, value.to_arrow().type))
    return schema


def _bound_problems(data: DataConfig, t: pa.DataType) -> list[str]:
    """A range split on a date/time column: every bound must read as one (said before any work)."""
    import polars as pl

    from shardline.core.encoding.splits import bound_value

    dtype = pl.from_arrow(pa.array([], type=t)).dtype
    problems = []
    for name, bounds in data.split.ranges.items():
        for b in bounds:
            try:
                bound_value(b, dtype, f"data.split.ranges.{name}")
            except DataError as e:
                problems.append(str(e))
    return problems


def needed_nulls(meta: pq.FileMetaData, data: DataConfig) -> dict[str, int]:
    """Null counts of the columns every row needs (the targets, the sequence, order, group and item keys), by
    '<column>' (<its setting>), from the footer's statistics (no data read); a column whose row groups carry no
    statistics is left to the encode, which checks the values."""
    out: dict[str, int] = {}
    names = [meta.schema.column(i).path for i in range(meta.num_columns)]
    # a text target: data.on_bad_rows decides, at the encode
    needed = {t.column: "the target" for t in data.target_list if t.task != "generation"}
    keys = ("sequence_key", "order_by", "group_key", "item_key")
    needed |= {c: f"data.{k}" for k in keys if (c := getattr(data, k))}
    for column, setting in needed.items():
        if column not in names:  # the file sequence (no key column), or a missing column: said by the schema check
            continue
        j = names.index(column)
        total = 0
        for g in range(meta.num_row_groups):
            stats = meta.row_group(g).column(j).statistics
            if stats is None or not stats.has_null_count:
                total = 0
                break
            total += stats.null_count
        if total:
            out[f"'{column}' ({setting})"] = total
    return out


def describe_rejected(rejected: list[RejectedFile], shown: int = 5) -> str:
    """The rejected files, one line a reason: files with the same reason (a typo in the config fails every
    file alike) are said once, with how many there are and the first few."""
    by_reason: dict[str, list[str]] = {}
    for r in rejected:
        by_reason.setdefault(r.reason, []).append(r.uri)
    lines = []
    for reason, uris in by_reason.items():
        if len(uris) == 1:
            lines.append(f"  - {uris[0]}: {reason}")
        else:
            more = f" and {len(uris) - shown} more" if len(uris) > shown else ""
            lines.append(f"  - {len(uris)} files ({', '.join(uris[:shown])}{more}): {reason}")
    return "\n".join(lines)


def first_file_problems(data: DataConfig) -> tuple[str | None, list[str]]:
    """(the first raw file, what in the config does not fit it): one footer read, for `check-config` and
    `doctor`, so a typo in a column name is caught before any work. (None, []) when nothing matches."""
    uris = list_source(data.source)
    if not uris:
        return None, []
    fs, path = filesystem(uris[0])
    with fs.open(path, "rb") as f:
        schema = with_folders(pq.read_schema(f), uris[0], data)
    return uris[0], check_schema(schema, data, uris[0])


def _version(info: dict) -> str:
    """An object's version in a listing: its etag (or the store's like), else its modification time."""
    for key in ("ETag", "etag", "md5", "generation", "version_id"):
        if info.get(key):
            return str(info[key]).strip('"')
    mtime = info.get("mtime") or info.get("LastModified") or info.get("last_modified") or info.get("created")
    if hasattr(mtime, "timestamp"):
        mtime = mtime.timestamp()
    return str(mtime)


def source_listing(data: DataConfig) -> list[tuple[str, int, str]]:
    """What the source holds now, cheaply (a listing, no file read): (uri, size, version) per file, sorted (the
    version: mtime_ns on a local disk, the etag on an object store); the ingest step's cache key."""
    if not is_remote(data.source):
        return [(uri, (st := os.stat(uri)).st_size, str(st.st_mtime_ns)) for uri in list_source(data.source)]
    fs = filesystem(data.source)[0]
    listed = listed_files(data.source)
    return sorted((source_uri(fs, data.source, p), int(i["size"]), _version(i)) for p, i in listed.items())


FOOTER_READ = 16 << 10  # bytes read from a file's end at first: its footer (and the length that says so), mostly
FOOTERS_AT_ONCE = 256  # files whose ends are read in one concurrent batch: bounds the memory held (~140 KB a footer)


def _footer(tail: bytes, size: int) -> pq.FileMetaData | int:
    """The parquet footer in the last bytes of a file of `size` bytes, or how many last bytes it needs."""
    if len(tail) < 12 or tail[-4:] != b"PAR1":
        raise ValueError("no parquet magic bytes at the end of the file")
    need = int.from_bytes(tail[-8:-4], "little") + 8
    if need > len(tail):
        if need + 4 > size:
            raise ValueError(f"its footer claims {need} bytes of a {size}-byte file")
        return need
    return pq.ParquetFile(pa.BufferReader(b"PAR1" + tail[-need:])).metadata  # the footer alone, as a file


def _read_ends(fs, paths: list[str], sizes: list[int], lengths: list[int]) -> list:
    tails = fs.cat_ranges(paths, [s - n for s, n in zip(sizes, lengths, strict=True)], sizes, on_error="return")
    out: list = []
    for tail, size in zip(tails, sizes, strict=True):
        try:
            out.append(tail if isinstance(tail, BaseException) else _footer(tail, size))
        except Exception as e:  # noqa: BLE001 - said as the file's reason
            out.append(e)
    return out


def footers(files: list[tuple[str, int]]) -> Iterator[pq.FileMetaData | BaseException]:
    """Each file's parquet footer (or the error that stopped reading it) from ranged reads of the files'
    ends: no other byte is read, and an object store's reads of a batch go out concurrently. A batch at a
    time: a footer's parsed metadata takes ~10x its bytes (22,000 of them held at once took 3.5 GB)."""
    for i in range(0, len(files), FOOTERS_AT_ONCE):
        batch = files[i : i + FOOTERS_AT_ONCE]
        fs = filesystem(batch[0][0])[0]
        paths, sizes = [filesystem(uri)[1] for uri, _ in batch], [size for _, size in batch]
        got = _read_ends(fs, paths, sizes, [min(size, FOOTER_READ) for size in sizes])
        longer = [j for j, g in enumerate(got) if isinstance(g, int)]
        if longer:  # a footer longer than the first read: its whole length, once more
            again = _read_ends(fs, [paths[j] for j in longer], [sizes[j] for j in longer], [got[j] for j in longer])
            for j, g in zip(longer, again, strict=True):
                got[j] = ValueError("its footer is longer than it says") if isinstance(g, int) else g
        yield from got
        del got
        trim()  # the batch's parsed footers, freed among the files' records, left holes a heap keeps


def snapshot_source(data: DataConfig, checked: Snapshot | None = None) -> Snapshot:
    """List and check the raw files (footers only); raise on a bad file unless data.on_bad_file is 'skip'.
    `checked`: an earlier snapshot of the source under this data config: a file it accepted, listed now with
    the same size and version (etag, mtime), is taken without reading its footer again."""
    listing = source_listing(data)
    known = set(raw_files_key(checked.files)) if checked else set()
    files: list[RawFile] = [RawFile(uri=u, size=n, version=v) for u, n, v in listing if (u, n, v) in known]
    listing = [entry for entry in listing if entry not in known]
    uris = [f.uri for f in files] + [uri for uri, _, _ in listing]
    if not uris:
        instead = no_bucket(data.source) or other_tables(data.source)
        raise DataError(
            f"data.source '{data.source}' matched no parquet file{instead}; check the path or glob (e.g. "
            "'data/raw/*.parquet' or 's3://bucket/raw/*.parquet')"
        )
    rejected: list[RejectedFile] = []
    empty: list[str] = []
    nulls_in: list[tuple[str, dict[str, int]]] = []
    kinds: dict[str, dict] = {}  # a date-time column -> {zoned or not: the first file}; a key column -> {text...}
    if known and listing and files:  # new files beside accepted ones: the kinds of one of those, as reference
        meta = next(footers([(files[0].uri, files[0].size)]))
        if not isinstance(meta, BaseException):
            _note_kinds(kinds, with_folders(meta.schema.to_arrow_schema(), files[0].uri, data), data, files[0].uri)
    for (uri, size, version), meta in zip(listing, footers([(uri, size) for uri, size, _ in listing]), strict=True):
        try:
            if isinstance(meta, BaseException):
                raise meta
            schema = with_folders(meta.schema.to_arrow_schema(), uri, data)
        except Exception as e:  # noqa: BLE001 - unreadable footer: a truncated or non-parquet file
            kind = extension(uri)
            reason = f"not a readable parquet file ({type(e).__name__}: {e})"
            if kind in TABLE_TEXT:  # a CSV export beside the parquet files, or instead of them
                reason = f"a .{kind} file, not parquet. {as_parquet_hint(kind)}"
            rejected.append(RejectedFile(uri=uri, reason=reason))
            continue
        problems = check_schema(schema, data, uri)
        if problems:
            rejected.append(RejectedFile(uri=uri, reason="; ".join(problems)))
        elif meta.num_rows == 0:  # nothing to train on: left out, so the data is the same data and nothing reruns
            empty.append(uri)
        else:
            files.append(RawFile(uri=uri, size=size, version=version))
            _note_kinds(kinds, schema, data, uri)
            if nulls := needed_nulls(meta, data):
                nulls_in.append((uri, nulls))
    if rejected and data.on_bad_file == "fail":
        raise DataError(
            f"{len(rejected)} of {len(uris)} raw file(s) do not match the config:\n{describe_rejected(rejected)}\n"
            + (
                "Fix the config (every file has the problem), or the files."
                if len(rejected) == len(uris)
                else "Fix or remove them, or set data.on_bad_file: skip to train without them."
            )
        )
    if not files and empty and not rejected:
        raise DataError(f"data.source '{data.source}': none of the {len(uris)} file(s) has a row")
    if not files:
        raise DataError(
            f"data.source '{data.source}': none of the {len(uris)} file(s) can be used; see the reasons above"
        )
    for c, found in kinds.items():
        if len(found) > 1 and "text" in found:  # a key or category: 5 and "5" would be two items
            (one, a), (other, b) = sorted(found.items(), key=lambda kv: str(kv[0]))[:2]
            raise DataError(
                f"column '{c}' holds {one} in {a} and {other} in {b}: the same value written both ways would be "
                "two categories (two items, two users); write it one way in every file"
            )
        if len(found) > 1:
            raise DataError(
                f"column '{c}' holds date-times without a time zone in {found[False]} and with one in {found[True]}: "
                "the same instant cannot be told from them; write every file's with a zone (or every file's without)"
            )
    if nulls_in:
        listing = "\n".join(
            f"  - {uri}: " + ", ".join(f"{n} null(s) in {c}" for c, n in nulls.items()) for uri, nulls in nulls_in
        )
        raise DataError(
            f"{len(nulls_in)} raw file(s) have rows without a value every row needs:\n{listing}\n"
            "Fill or drop those rows before training (a row without a target cannot be learned or scored; one "
            "without its sequence key, order, group or item has no place in the data)."
        )
    files.sort(key=lambda f: f.uri)
    fingerprint = Snapshot.fingerprint_of(files)
    return Snapshot(source=data.source, files=files, rejected=rejected, empty=sorted(empty), fingerprint=fingerprint)


_KEYS = ("categorical", "sequence key", "group key", "item key")  # roles whose values are compared as categories


def _note_kinds(kinds: dict[str, dict], schema: pa.Schema, data: DataConfig, uri: str) -> None:
    """Note the file's date-time columns' zones (zoned or not) and its key and category columns' kinds (text or
    numbers), each with the first file that has it so: files that disagree are said together."""
    for c, role in expected_columns(data).items():
        t = schema.field(c).type if schema.get_field_index(c) >= 0 else None
        t = t.value_type if t is not None and pa.types.is_dictionary(t) else t
        if t is not None and pa.types.is_timestamp(t):
            kinds.setdefault(c, {}).setdefault(t.tz is not None, uri)
        elif t is not None and role in _KEYS and (pa.types.is_string(t) or pa.types.is_large_string(t)):
            kinds.setdefault(c, {}).setdefault("text", uri)
        elif t is not None and role in _KEYS and (pa.types.is_integer(t) or pa.types.is_floating(t)):
            kinds.setdefault(c, {}).setdefault("numbers", uri)


# data settings the ingest never reads (only the encode does): a change to one encodes again on the same snapshot
ENCODE_ONLY = {
    **dict.fromkeys(("tokenizer", "window", "horizon", "target_positions", "continuous_dtype", "group_mb"), True),
    **dict.fromkeys(("shard_compression", "files_per_group", "encode_workers"), True),
    "split": {"seed", "fractions", "folds", "test"},  # its method, column and ranges are checked against the files
}


def ingest_settings(data: DataConfig) -> dict:
    """The data settings a snapshot depends on: every one but `ENCODE_ONLY` (a new setting counts until listed)."""
    return data.model_dump(mode="json", exclude=ENCODE_ONLY)


def checked_record(root: str, data: DataConfig) -> str:
    """Where the last snapshot of `data.source` under these data settings is kept, for the next ingest."""
    return layout.snapshot(root, stable_hash([data.source, ingest_settings(data)]))


def last_checked(root: str, data: DataConfig) -> Snapshot | None:
    """The last snapshot of the source under this data config, if one was kept and still reads as one."""
    try:
        return Snapshot.model_validate_json(storage.read_text(checked_record(root, data)))
    except Exception:  # noqa: BLE001 - none yet, or unreadable: every footer is read, as the first time
        return None


# the raw rows (of the first file) registration's input example is taken from: the ingest checks as many
SAMPLE_ROWS = 1000


def raw_sample(sample_uri: str, columns: list[str], rows: int = 5, types: dict | None = None, source: str = ""):
    """The first `rows` rows of a raw file's `columns`, as pandas, zoned date-times as naive UTC; `types`, when
    given, gets each column's polars type as text (`Float32`, `Int16`, ...), from the same read. With the data's
    `source`, a column the file's hive-style folder names give it is taken from them. A file whose rows do not read
    is a `DamagedFile`; on an object store, one of up to 64 MB is fetched whole first, so that a failure to read it
    from memory is the file's, and a larger one's failure is an OSError, which may be the network's (retried)."""
    import io

    import polars as pl

    fs, path = filesystem(sample_uri)
    whole = is_remote(sample_uri) and fs.size(path) <= 64 << 20
    with io.BytesIO(fs.cat_file(path)) if whole else fs.open(path, "rb") as f:
        try:
            raw = pq.ParquetFile(f)
            extra = folder_columns(sample_uri, source, columns, raw.schema_arrow.names) if source else {}
            table = raw.read_row_group(0, columns=[c for c in columns if c not in extra]).slice(0, rows)
        except (OSError, pa.ArrowException) as e:
            raise unreadable(sample_uri, "read its first rows", e, is_remote(sample_uri) and not whole) from e
    for k, value in extra.items():
        table = table.append_column(k, value.new_from_index(0, table.num_rows).to_arrow())
    table = table.select(columns)
    # a decimal (Spark's prices) as a float, as the encoding reads it: pandas would hold Decimal objects, which
    # MLflow's signature takes as "any" (a served request could not send numbers for it)
    table = table.cast(pa.schema([f.with_type(pa.float64()) if _t.is_decimal(f.type) else f for f in table.schema]))
    if types is not None:
        types.update({c: str(dtype) for c, dtype in pl.from_arrow(table.schema.empty_table()).schema.items()})
    # the values' own types, not pandas' types that a file written by pandas records, nor a dictionary's
    # categorical: MLflow's signature takes neither a nullable Int64 or boolean with a null (as float64 or object
    # it does, as from any other tool) nor a category (as text it does)
    return naive_utc(dictionaries_as_values(table).to_pandas(ignore_metadata=True))


def check_registrable(data: DataConfig, snapshot: Snapshot) -> None:
    """Refuse, before any work, input that registration would refuse after the training: the signature
    MLflow infers from a sample of the raw columns the model takes, checked against that sample."""
    from mlflow.models import infer_signature

    f = data.features  # the columns (a list column for its elements: `vec[0:4]`) the model takes
    columns = list(dict.fromkeys([*read_names(f.continuous), *f.boolean, *f.categorical, *f.text, *data.id_columns]))
    columns += [c for c in (data.sequence_key, data.order_by) if c and c != FILE_SEQUENCE and c not in columns]
    # as many rows as registration's sample reads at most (its input example): what passes here passes there
    # the first file whose rows read (one damaged inside is the encode's to leave out, with data.on_bad_file: skip)
    for raw in snapshot.files:
        try:
            sample = raw_sample(raw.uri, columns, rows=SAMPLE_ROWS, source=snapshot.source)
            break
        except DamagedFile:
            if data.on_bad_file != "skip" or raw is snapshot.files[-1]:
                raise

    def refused(frame) -> Exception | None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                from mlflow.models.utils import _enforce_schema

                _enforce_schema(frame, infer_signature(frame).inputs)
        except Exception as e:  # noqa: BLE001 - anything MLflow refuses: said naming the columns, before training
            return e
        return None

    if (e := refused(sample)) is not None:
        bad = [c for c in columns if refused(sample[[c]]) is not None] or columns
        if isinstance(e, UnicodeDecodeError) or "codec can't decode" in str(e):  # a string column of bytes
            raise DataError(
                f"{raw.uri}: column(s) {bad} hold bytes that are not UTF-8 text in its first {len(sample):,} rows "
                f"({e}); write the text as UTF-8 (or the bytes as a binary column, which is no feature)"
            ) from None
        raise DataError(f"{raw.uri}: the registered model could not take column(s) {bad} as input ({e})") from None


@task(name="ingest", retries=2, retry_delay_seconds=[2, 10], retry_condition_fn=lambda t, r, s: _is_transient(s))
@redacted_errors
def ingest(data: DataConfig, root: str) -> Snapshot:
    """List the raw files and check their schemas; return the snapshot. The files the last ingest of this source
    and data config checked (kept in the storage `root`), unchanged since, are not read again."""
    log = get_run_logger()
    checked = last_checked(root, data)
    snap = snapshot_source(data, checked)
    check_registrable(data, snap)  # what registration would refuse, refused before any work
    storage.write_text(checked_record(root, data), snap.model_dump_json())
    reused = len(set(raw_files_key(snap.files)) & set(raw_files_key(checked.files))) if checked else 0
    log.info(
        "ingest: %d file(s), %.1f MB, fingerprint %s; %d of them unchanged since an earlier ingest checked them "
        "(their footers not read again)",
        len(snap.files),
        sum(f.size for f in snap.files) / 1e6,
        snap.fingerprint[:12],
        reused,
    )
    for r in snap.rejected:
        log.warning("ingest: skipped %s: %s", r.uri, r.reason)
    if snap.empty:
        shown = ", ".join(snap.empty[:5]) + (f" and {len(snap.empty) - 5} more" if len(snap.empty) > 5 else "")
        log.info("ingest: left out %d file(s) without rows (they add no data): %s", len(snap.empty), shown)
    return snap


def _is_transient(state) -> bool:
    """Retry I/O hiccups, never a user's mistake."""
    try:
        state.result()
    except (DataError, ValueError):
        return False
    except Exception:  # noqa: BLE001 - anything else (I/O, network) is transient: retried
        return True
    return False


# What decides the snapshot: the listing under data.source (each file's path, size and etag/mtime)
# and the data settings it is checked against (a window or a tokenizer changed: the encode's alone).
INGEST_CACHE = CacheRule(
    "ingest",
    key=lambda inputs: (source_listing(inputs["data"]), ingest_settings(inputs["data"])),
    code=(__name__,),
)
