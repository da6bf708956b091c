"""What a data source names: the parquet files of a path, a folder, a glob or an fsspec URL, listed once, and what
to say where it names none (another kind of table, a bucket that is not there)."""

from __future__ import annotations

import os

from shardline.core.storage import extension, filesystem, is_remote


def parquet_name(path: str) -> bool:
    """A file a folder's listing takes as parquet: `.parquet` (`.parq`, `.pq`), or a name without an extension, as
    Hive (`000000_0`), Trino and Athena (`20260101_120000_00012_x_<uuid>`) write their tables' files."""
    return extension(path) in ("", "parquet", "parq", "pq")


def listed_files(source: str) -> dict[str, dict]:
    """Every parquet file that `source` (a path, a folder, a glob or an fsspec URL) names: path -> the listing's
    details (size, etag or mtime). One listing: on an object store a page per 1,000 objects, never a request
    per file (fsspec's `info` of a listed file scans its folder's whole listing: 22,000 files took minutes)."""
    fs, path = filesystem(source)
    root, named = path, set()  # the folder searched below, and the names the source writes out itself
    if any(ch in path for ch in "*?["):
        found = fs.glob(path, detail=True)
        parts = path.split("/")
        fixed = next(i for i, part in enumerate(parts) if any(ch in part for ch in "*?["))
        root, named = "/".join(parts[:fixed]), set(parts[fixed:])
        tables = [root] if found and fs.isdir(f"{root.rstrip('/')}/_delta_log") else []
    elif fs.isdir(path):
        everything = fs.find(path, detail=True)
        found = {p: i for p, i in everything.items() if parquet_name(p)}
        tables = sorted({p.split("/_delta_log/")[0] for p in everything if "/_delta_log/" in p})
    elif fs.exists(path):
        found, tables = {path: fs.info(path)}, []
    else:
        found, tables = {}, []
    if tables:
        table = source_uri(fs, source, tables[0])
        raise ValueError(
            f"{table}: this folder is a Delta Lake table (it holds a _delta_log folder). Its parquet files are those "
            "of every version of the table, rows since deleted or rewritten included, and only its log says which are "
            "the current version's: reading them all would train on stale and repeated rows. Write the version you "
            "want out as parquet (deltalake: DeltaTable(path).to_pyarrow_dataset(), then "
            "pyarrow.dataset.write_dataset) and point data.source at that folder"
        )

    def hidden(p: str) -> bool:
        """A file or a folder below the source's folder named `.x` or `_x` (not by the source itself): a job's
        unfinished output (Spark's `_temporary/`, a `.staging/` copy) or a marker (`_SUCCESS`), never data,
        as pyarrow's and Spark's own readers take it."""
        below = p[len(root) :].strip("/").split("/") if p.startswith(root) else [os.path.basename(p)]
        return any(part.startswith((".", "_")) and part not in named for part in [*below[:-1], os.path.basename(p)])

    # a local symbolic link to a file lists as "other" (its size and times are its target's)
    return {
        p: i
        for p, i in found.items()
        if not hidden(p) and (i["type"] == "file" or (i.get("islink") and os.path.isfile(p)))
    }


def source_uri(fs, source: str, path: str) -> str:
    protocol = fs.protocol if isinstance(fs.protocol, str) else fs.protocol[0]
    return f"{protocol}://{path}" if is_remote(source) else path


def list_source(source: str) -> list[str]:
    """Every parquet file that `source` names, sorted."""
    fs = filesystem(source)[0]
    return sorted(source_uri(fs, source, p) for p in listed_files(source))


TABLE_TEXT = ("csv", "tsv", "json", "jsonl", "ndjson")  # tables written as text: read by polars, not by us


def as_parquet_hint(kind: str) -> str:
    """What to do with a table of another format (`kind`: a file name's extension) where parquet is read."""
    reader = {"tsv": "csv", "jsonl": "ndjson"}.get(kind, kind)
    return f"Shardline reads parquet: write them as parquet first (polars: pl.scan_{reader}(path).sink_parquet(out))"


def other_tables(source: str) -> str:
    """Where a folder `source` holds no parquet file: what it holds instead, when that is tables written as text
    (`: it holds 12 .csv file(s); ...`), else ''."""
    try:
        fs, path = filesystem(source)
        if any(ch in path for ch in "*?[") or not fs.isdir(path):
            return ""
        kinds: dict[str, int] = {}
        for p in fs.find(path):
            if (kind := extension(p)) in TABLE_TEXT and not os.path.basename(p).startswith((".", "_")):
                kinds[kind] = kinds.get(kind, 0) + 1
    except Exception:  # noqa: BLE001 - a question for the message, not the ingest
        return ""
    if not kinds:
        return ""
    held = ", ".join(f"{n} .{kind} file(s)" for kind, n in sorted(kinds.items(), key=lambda kv: -kv[1]))
    return f": it holds {held}; {as_parquet_hint(max(kinds, key=kinds.get))}"


def no_bucket(source: str) -> str:
    """What an object store's source that lists nothing may lack: its bucket (a typo reads as an empty folder). An
    endpoint that does not answer, credentials refused or none found are raised as what they are, each naming what
    to check: `exists` said each of them as a bucket to create (after 7 minutes of silence, for a stalled one)."""
    if not is_remote(source):
        return ""
    from shardline.core.unreachable import StorageRefused, unreachable

    fs, path = filesystem(source)
    bucket = path.split("/", 1)[0]
    fs.invalidate_cache(bucket)
    try:
        try:
            fs.ls(bucket, detail=False)
        except PermissionError:  # a policy may let these credentials list their own prefix of the bucket only
            fs.invalidate_cache(path)
            try:
                fs.ls(path.rstrip("/"), detail=False)
            except FileNotFoundError:  # nothing under it yet: the bucket is there
                pass
    except FileNotFoundError:
        return f": its bucket '{bucket}' is not there"
    except PermissionError as e:
        said = " ".join(str(e).split())[:200]
        raise StorageRefused(
            f"{source}: the object store refused these credentials on bucket '{bucket}' ({said}): check "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE), and that they may list the bucket"
        ) from None
    except Exception as e:
        if (cut := unreachable(e)) is not None:
            raise cut from None
        if type(e).__name__ in ("NoCredentialsError", "PartialCredentialsError"):
            raise StorageRefused(
                f"{source}: no S3 credentials were found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or "
                "AWS_PROFILE, or give the machine a role)"
            ) from None
        raise
    return ""
