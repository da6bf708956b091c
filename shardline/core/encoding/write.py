"""The encode's body, without Prefect: a file group read once and written as shards in the group's own codes (and
its training statistics), the groups of a snapshot, and the manifest built from the groups' records.

This module and what it imports are the code that decides a shard's bytes: their version is part of a group's
address (`shardline.tasks.encode.encoder_code`), so an edit here stores new groups, and an edit to the encode step
around it (its Prefect tasks, retries, logs: shardline/tasks/encode.py) encodes nothing again."""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import polars as pl

from shardline.core import layout, storage
from shardline.core.config import DataConfig, stable_hash
from shardline.core.encoding.columns import (
    DataError,
    refuse_copies,
)
from shardline.core.encoding.contract import contract
from shardline.core.encoding.fit import empty_stats, fit_spec, target_statistics
from shardline.core.encoding.group import encode_splits, one_torch_thread
from shardline.core.encoding.groups import file_groups
from shardline.core.encoding.read import read_group, read_raw
from shardline.core.encoding.reuse import check_parent_tokenizer, reuse_encoding
from shardline.core.encoding.row_keys import GROUP, grades, item_counts, rows_table, training_statistics
from shardline.core.encoding.splits import ROW, split_rows
from shardline.core.encoding.text import (
    as_text,
    clean_rows,
    encode_text_splits,
    merged_token_counts,
    read_tokenizer_file,
    sha256_text,
    split_texts,
    text_spec,
    train_bpe,
)
from shardline.core.manifest import (
    EncodedGroup,
    EncodingSpec,
    FilePart,
    LocalVocab,
    Manifest,
    RawFile,
    RejectedFile,
    ShardInfo,
    Snapshot,
    edited_encoding,
    target_array,
)
from shardline.core.shards import compress_bytes, segment_lengths, window_tally

GROUP_RECORD = "group.json"  # a group's `EncodedGroup`, written in its folder after its shards
TOKENIZER = "tokenizer.json"  # text data: the tokenizer, beside the manifest


def stored_group(store: str, key: str) -> EncodedGroup | None:
    """Group `key`'s record in the group store `store`, when it is there and every shard it lists is
    intact (a listing: see `shards_intact`); else None."""
    folder = storage.join(store, key)
    uri = storage.join(folder, GROUP_RECORD)
    if not storage.exists(uri):
        return None
    try:
        group = EncodedGroup.model_validate_json(storage.read_text(uri))
    except Exception:  # noqa: BLE001 - an unreadable record is no record: the group is encoded again
        return None
    return group if group.key == key and shards_intact(group.shards, folder) else None


def stored_groups(store: str, keys: list[str]) -> dict[str, EncodedGroup]:
    """The groups among `keys` that the group store `store` holds whole (as `stored_group`: the record and
    every shard it lists, by size), found together: on an object store one listing of the store and
    one concurrent read of the records, not a request per file. An append's unchanged groups are found
    here, so only the new ones become tasks (a task per group found cost ~10-15 ms of Prefect's own
    bookkeeping: more than the append's encode on a data set of hundreds of groups)."""
    wanted = set(keys)
    if not storage.is_remote(store):
        return {k: g for k in sorted(wanted) if (g := stored_group(store, k)) is not None}
    fs, root = storage.filesystem(store)
    root = root.rstrip("/")
    fs.invalidate_cache(root)
    try:
        listing = fs.find(root, detail=True)
    except FileNotFoundError:
        return {}
    sizes = {path[len(root) + 1 :]: int(info.get("size") or 0) for path, info in listing.items()}
    records = [f"{root}/{k}/{GROUP_RECORD}" for k in sorted(wanted) if f"{k}/{GROUP_RECORD}" in sizes]
    found: dict[str, EncodedGroup] = {}
    for path, raw in (fs.cat(records, on_error="return") if records else {}).items():
        if isinstance(raw, Exception):
            continue
        try:
            group = EncodedGroup.model_validate_json(raw)
        except Exception:  # noqa: BLE001 - an unreadable record is no record: the group is encoded again
            continue
        key = path[len(root) + 1 :].split("/", 1)[0]
        if group.key == key and _intact(group.shards, lambda rel: sizes.get(f"{key}/{rel}")):  # noqa: B023 - used here
            found[key] = group
    return found


def read_text_group(
    files: list[RawFile], data: DataConfig, damaged: list[RejectedFile] | None = None
) -> tuple[pl.DataFrame, dict[str, dict[str, int]]]:
    """A text data set's file group, its rows with a null or empty text left out (`data.on_bad_rows: skip`,
    counted per file and column) or refused naming the file, the column and the count (`error`). When rows
    are left out, the others carry their place in their file as read (`__row`): a row's split is drawn from
    it, so leaving out a bad row moves no other row to another split."""
    uris = [f.uri for f in files]
    # a categorical text column is text (cast to String); another type is refused naming its file: each file
    # checked before the group's files are put together (one scan: they share their types, said together)
    damaged = [] if damaged is None else damaged  # left out (data.on_bad_file: skip): not read again below
    df = as_text(read_group(files, data, lambda frame, uri: as_text(frame, data, uri), damaged), data, ", ".join(uris))
    if isinstance(files[0], FilePart):  # a part of a file: its rows carry their place in it already
        part, dropped = clean_rows(df, data, uris[0])
        return part, ({uris[0]: dropped} if dropped else {})
    _, bad = clean_rows(df, data.model_copy(update={"on_bad_rows": "skip"}), "")
    if not bad:
        return df, {}
    del df  # the files are read again one by one: the group is not held twice
    parts, skipped = [], {}
    for uri in [u for u in uris if u not in {r.uri for r in damaged}]:  # said per file: re-read one by one
        raw = as_text(read_raw(uri, data), data, uri)
        raw = raw.with_columns(pl.int_range(0, pl.len(), dtype=pl.UInt64).alias(ROW))
        part, dropped = clean_rows(raw, data, uri)
        parts.append(part)
        if dropped:
            skipped[uri] = dropped
    return pl.concat(parts, how="vertical_relaxed"), skipped


def encode_text_group(
    files: list[RawFile], data: DataConfig, store: str, tokenizer: tuple[str, str], key: str
) -> EncodedGroup:
    """Encode a text data set's file group into token shards (`shardline/core/encoding/text.py`), written
    like any group's: each shard atomically, the group's record last. Its training statistics are the
    target token counts (the unigram baseline) and the rows left out (`skipped`, per file and column)."""
    out_dir = storage.join(store, key)
    damaged: list[RejectedFile] = []
    frame, skipped = read_text_group(files, data, damaged)
    read = frame.height
    frame, splits = split_rows(frame, data)
    encoded = encode_text_splits(frame, splits, data, storage.read_text(tokenizer[0]))
    del frame
    infos = []
    train = {"rows": 0, "token_counts": [], "skipped": skipped}
    for split in list(encoded):  # in the splits' order, as `split_rows` laid them out
        raw, specs, arrays, keys, stats = encoded.pop(split)
        if stats is not None:  # the fitted splits' counts summed (k-fold: every fold's)
            counts = train["token_counts"] or [0] * len(stats["token_counts"])
            train["token_counts"] = [a + b for a, b in zip(counts, stats["token_counts"])]
            train["rows"] += stats["rows"]
        info = _shard_info(split, raw, specs, arrays, keys, len(arrays["target"]), data)
        infos.append(ShardInfo(**info, **_store(raw, info, out_dir, keys)))
    return _write_group(out_dir, key, infos, train, splits, data, damaged, read)


def _shard_info(split: str, raw, specs: dict, arrays: dict, keys: list[str], rows: int, data: DataConfig) -> dict:
    """A shard's record, less what storing it tells (its sizes and checksums): named by its split (the
    group's folder is its address)."""
    codec = None if data.shard_compression == "none" else data.shard_compression
    lengths = segment_lengths(arrays["offsets"])
    return dict(
        path=f"{split}.bin" + {"zstd": ".zst", "lz4": ".lz4", None: ""}[codec],
        compression=codec,
        raw_bytes=len(raw),
        split=split,
        rows=rows,
        segments=len(keys),
        lengths=lengths,
        **window_tally(lengths, data.window, data.effective_horizon),
        arrays=specs,
        keys_path=f"{split}.keys.parquet",
    )


def _write_group(
    out_dir: str,
    key: str,
    infos: list[ShardInfo],
    train: dict,
    splits: dict,
    data: DataConfig,
    damaged: list[RejectedFile],
    read: int,
    cut: int = 0,
    unfitted: dict[int, list[str]] | None = None,
) -> EncodedGroup:
    """The group's record, written last in its folder: once it is there, the group is whole. `read`: the rows read,
    those in no split's range included."""
    rows = {s: (splits[s].end - splits[s].first) if s in splits else 0 for s in data.split.names()}
    outside = read - sum(rows.values())
    group = EncodedGroup(
        key=key, shards=infos, train=train, rows=rows, damaged=damaged, outside=outside, cut=cut, unfitted=unfitted
    )
    storage.write_text(storage.join(out_dir, GROUP_RECORD), group.model_dump_json())
    return group


def fit_tokenizer(snapshot: Snapshot, data: DataConfig, out_dir: str) -> tuple[str, str]:
    """Text data's tokenizer, written (atomically) as `tokenizer.json` in the data set's folder `out_dir`:
    a byte-level BPE trained on the training split's texts only (every file group read, in the snapshot's
    order, so the same data gives the same bytes), or the user's file (`data.tokenizer.file`), checked.
    Returns (its URI, its sha256)."""
    if data.tokenizer.file is not None:
        text = read_tokenizer_file(data.tokenizer.file, data.tokenizer.sha256)  # the file the config was read with
    else:

        def texts():
            for files in file_groups(snapshot, data):
                frame, splits = split_rows(read_text_group(files, data)[0], data)
                yield from split_texts(frame, splits, data.split.fit_splits(), data)

        text = train_bpe(texts(), data.tokenizer.vocab_size)
    uri = storage.join(out_dir, TOKENIZER)
    storage.write_text(uri, text)
    return uri, sha256_text(text)


def encode_group_to_shards(
    files: list[RawFile],
    data: DataConfig,
    store: str,
    key: str,
    tokenizer: tuple[str, str] | None = None,
) -> EncodedGroup:
    """Encode one group of raw files, read once, into one shard per split in its folder of the group
    store, `<store>/<group key>/` (each file written atomically, the group's record `group.json`
    last), in the group's own codes, and gather its training rows' statistics (a group already stored
    is the caller's to take: `stored_group`). One writer thread per shard compresses, hashes and stores
    it: the stores overlap, so the group waits for its largest shard's store, not for the sum of them
    (fsync waits included; measured 3-6 % faster than one writer in paired A/B runs: DESIGN.md, "Encode
    speed")."""
    if data.features.text:
        return encode_text_group(files, data, store, tokenizer, key)
    out_dir = storage.join(store, key)
    damaged: list[RejectedFile] = []  # files damaged inside, left out (data.on_bad_file: skip)
    held = [read_group(files, data, damaged=damaged)]
    read = held[0].height
    frame, splits = split_rows(held.pop(), data)  # held by nothing else: the rows in no range go once dropped
    if data.order_by is not None:  # each sequence's rows in order: a row that repeats the one before it whole
        names = [f.uri.rsplit("/", 1)[-1] for f in files]
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        refuse_copies(frame, data.sequence_key, data.order_by, f"raw file(s) {shown}")
    ranked = ranking_rows(frame, splits, data)
    cut = cut_groups(frame, splits, data)
    with one_torch_thread():
        encoded = encode_splits(frame, splits, data)
    del frame
    train = next((encoded[s].stats for s in data.split.fit_splits() if s in encoded), None)
    unfitted = classes_outside_training(encoded, data)
    if data.group_key:  # the training rows: the train split, or (k-fold) every fold
        fitted = [ranked[s] for s in data.split.fit_splits() if ranked.get(s) is not None]
        rows = pl.concat(fitted) if fitted else None
        train = {**(train or empty_stats(data)), "ranking": training_statistics(rows, data)}
    pending = []
    with ThreadPoolExecutor(max(1, len(encoded)), thread_name_prefix="shardline-write") as writer:
        for split in list(encoded):  # in the splits' order, as `split_rows` laid them out
            # the file's bytes were built in memory; compressed there, written once (atomically)
            raw, specs, arrays, keys, codes, _ = encoded.pop(split)  # an EncodedSplit
            info = _shard_info(split, raw, specs, arrays, keys, splits[split].end - splits[split].first, data)
            info["local"] = codes
            rows_file = None
            if data.group_key:
                info["rows_path"] = f"{split}.rows.parquet"
                rows_file = parquet_bytes(ranked.pop(split).to_arrow(), compression="zstd")
            pending.append((info, writer.submit(_store, raw, info, out_dir, keys, rows_file)))
            del raw, arrays
        infos = [ShardInfo(**info, **fut.result()) for info, fut in pending]
    return _write_group(out_dir, key, infos, train or empty_stats(data), splits, data, damaged, read, cut, unfitted)


def classes_outside_training(encoded: dict, data: DataConfig) -> dict[int, list[str]]:
    """Per class target (its index) coded in the group's own ids: the values that rows of its other splits hold and
    its training rows (every fold, k-fold) do not, from the ids in its shards (an integer range's ids name every
    integer between its least and its greatest, held or not: 3 and 4 of a column of 0, 1, 2, 5 and 6)."""
    fit = set(data.split.fit_splits())
    codes = next(iter(encoded.values())).codes if encoded else None
    out: dict[int, list[str]] = {}
    for i, t in enumerate(data.target_list):
        voc = codes.targets[i] if codes is not None and i < len(codes.targets) else None
        if t.task != "classification" or not isinstance(voc, LocalVocab):
            continue
        seen = {True: np.zeros(voc.size + 1, bool), False: np.zeros(voc.size + 1, bool)}  # in training rows or not
        for name, split in encoded.items():  # which ids (1..; 0 is null) each side's rows hold
            seen[name in fit][np.asarray(split.arrays[target_array(i)], dtype=np.intp)] = True
        others = np.flatnonzero(seen[False][1:] & ~seen[True][1:])
        texts = voc.texts() if len(others) else []  # (a vocabulary of 36,000 item ids: not built for nothing)
        out[i] = [texts[j] for j in others]
    return out


def _store(raw, info: dict, out_dir: str, keys: list[str], rows: memoryview | None = None) -> dict:
    """Compress, hash and write one shard, its keys file and (ranking data) its rows file's bytes `rows`, in
    `out_dir` where `info` (`_shard_info`) names them; their sizes and checksums."""
    stored = compress_bytes(raw, info["compression"]) if info["compression"] else raw
    out = {"bytes": len(stored), "sha256": hashlib.sha256(stored).hexdigest()}
    storage.write_bytes(storage.join(out_dir, info["path"]), stored)
    keys_file = keys_parquet(keys)
    out["keys_sha256"] = hashlib.sha256(keys_file).hexdigest()
    storage.write_bytes(storage.join(out_dir, info["keys_path"]), keys_file)
    if rows is not None:
        out["rows_sha256"] = hashlib.sha256(rows).hexdigest()
        storage.write_bytes(storage.join(out_dir, info["rows_path"]), rows)
    return out


def cut_groups(frame: pl.DataFrame, splits: dict, data: DataConfig) -> int:
    """How many ranking groups (`data.group_key`) a range split put in more than one split (a session across the
    bound of a date range): each split then ranks only its part of them. The hash split keeps groups whole: 0."""
    if data.group_key is None or data.split.method != "range" or len(splits) < 2:
        return 0
    which = np.concatenate([np.full(r.end - r.first, i, np.int8) for i, r in enumerate(splits.values())])
    spread = (
        frame.select(pl.col(data.group_key), pl.Series("__in", which))
        .group_by(data.group_key)
        .agg(pl.col("__in").n_unique())
    )
    return int((spread["__in"] > 1).sum())


def ranking_rows(frame: pl.DataFrame, splits: dict, data: DataConfig) -> dict[str, pl.DataFrame]:
    """Ranking data (`data.group_key`): per split, the rows file's table of its rows (group, item,
    relevance grade: `shardline/core/encoding/row_keys.py`), from the group's one read; {} for other data."""
    if data.group_key is None:
        return {}
    graded = grades(frame[data.target_list[0].column], "the encoded rows")  # each file was checked as read
    return {
        name: rows_table(frame.slice(r.first, r.end - r.first), graded.slice(r.first, r.end - r.first), data)
        for name, r in splits.items()
    }


def keys_parquet(keys: list[str]) -> memoryview:
    """A shard's keys file: a parquet table (segment int64, sequence string), one row per segment.
    Written by pyarrow: ten times cheaper than polars for a table this small (0.1 ms against 1 ms)."""
    import pyarrow as pa

    return parquet_bytes(
        pa.table({"segment": pa.array(np.arange(len(keys), dtype=np.int64)), "sequence": pa.array(keys, pa.string())})
    )


def parquet_bytes(table, compression: str = "snappy") -> memoryview:
    """An arrow table as a parquet file's bytes, written by pyarrow."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    pq.write_table(table, sink, compression=compression)
    out = sink.getvalue()
    return memoryview(out)[: out.size]  # the file's bytes only (see `compress_bytes`)


def check_splits(windows: dict[str, int], data: DataConfig, rows: dict | None = None, sequences: dict | None = None):
    empty = [s for s in data.split.names() if windows.get(s, 0) == 0]
    if empty:
        how = {
            "hash": f"data.split.fractions={data.split.fractions}",
            "range": f"data.split.ranges={data.split.ranges}",
            "kfold": f"data.split.folds={data.split.folds}, data.split.test={data.split.test}",
        }[data.split.method]
        held = "".join(
            f"; {s}: {rows[s]:,} row(s) in {sequences[s]:,} sequence(s)" for s in empty if rows and sequences
        )
        horizon = data.effective_horizon
        if data.features.text:  # every text sequence gives a window (padded): none means no sequence reached it
            what = "every document (or sequence of rows) gives one"
            skipped = " (rows of no text left out: data.on_bad_rows)" if data.on_bad_rows == "skip" else ""
            raise DataError(
                f"the split leaves {', '.join(empty)} with no window (windows per split: {windows}{held}; {what}, "
                f"so no sequence of text{skipped} fell in it; {how}); widen that split or add data"
            )
        raise DataError(
            f"the split leaves {', '.join(empty)} with no window (windows per split: {windows}{held}; a window "
            f"takes data.window={data.window} + data.horizon={horizon} = {data.window + horizon} row(s) of one "
            "sequence; "
            f"{how}); widen that split, add data, or shorten data.window or data.horizon"
        )


def check_folds(groups: list[EncodedGroup], data: DataConfig) -> None:
    """k-fold data: refuse more folds than the non-test data has sequences, naming both counts."""
    if data.split.method != "kfold":
        return
    sequences = sum(s.segments for g in groups for s in g.shards if s.split != "test")
    if sequences < data.split.folds:
        raise DataError(
            f"data.split.folds={data.split.folds} is more folds than the {sequences} sequence(s) outside the test "
            f"split (data.split.test={data.split.test}): each fold needs at least one; lower data.split.folds"
        )


def listed(group: EncodedGroup, store: str, data: DataConfig) -> list[ShardInfo]:
    """A group's shards as a manifest lists them: their paths seen from the manifest's folder, where
    `store` is the group store (`../groups` in the pipeline's layout), and their windows for `data`'s window
    and horizon (a group encoded for another window is the same bytes: see `group_key`)."""
    at = f"{store.rstrip('/')}/{group.key}" if store else group.key
    return [
        s.model_copy(
            update={"path": f"{at}/{s.path}", "keys_path": f"{at}/{s.keys_path}", "lengths": None}
            | ({"rows_path": f"{at}/{s.rows_path}"} if s.rows_path else {})
            | (window_tally(s.lengths, data.window, data.effective_horizon) if s.lengths is not None else {})
        )
        for s in group.shards
    ]


def build_manifest(
    snapshot: Snapshot,
    groups: list[EncodedGroup],
    data: DataConfig,
    base: tuple[EncodingSpec, str] | None = None,
    store: str = f"../{layout.GROUPS}",
    tokenizer: str | None = None,
) -> Manifest:
    """Fit the data set's encoding from the groups' training statistics (or, fine-tuning, take the
    parent's: `base` is its encoding and where it came from) and list their shards, where `store` (the
    group store seen from the manifest's folder: `datasets/<id>/` beside `datasets/groups/` in the
    pipeline) says they lie; refuses a split with no window (nothing is published then)."""
    shards = [s for g in groups for s in listed(g, store, data)]
    rows = {s: sum(g.rows.get(s, 0) for g in groups) for s in data.split.names()}
    windows = {s: sum(x.windows for x in shards if x.split == s) for s in data.split.names()}
    check_folds(groups, data)
    sequences = {s: sum(x.segments for x in shards if x.split == s) for s in data.split.names()}
    check_splits(windows, data, rows, sequences)
    stats = [g.train for g in groups]
    if data.features.text:  # the tokenizer's vocabulary is the encoding: nothing fitted, nothing reused
        spec = text_spec(data, tokenizer)
        if base is not None:  # but a fine-tune's data must be tokenized as its parent's was
            check_parent_tokenizer(spec, *base)
        extra = {"tokenizer": TOKENIZER, "token_counts": merged_token_counts(stats, spec.text.vocab_size)}
    else:
        spec = fit_spec(stats, data)
        spec = spec.model_copy(update={"targets": _typed(spec.targets, snapshot.files[0].uri)})
        if base is not None:
            spec = reuse_encoding(spec, *base)
        extra = {
            "target_stats": target_statistics(stats, data),
            "item_counts": item_counts([g.train.get("ranking") for g in groups]) if data.item_key else None,
        }
    return Manifest(
        skipped=list({r.uri: r for g in groups for r in g.damaged}.values()),  # a file's parts name it once
        encoding=spec,
        encoding_hash=spec.hash(),
        contract_hash=stable_hash(contract(data)),
        data_fingerprint=snapshot.fingerprint,
        shards=shards,
        rows=rows,
        windows=windows,
        source_files=len(snapshot.files),
        **extra,
    )


def check_groups(groups: list[EncodedGroup], data: DataConfig, store: str) -> None:
    """Ranking data: refuse a group key whose every group has one row in the training split (each row
    would be ranked alone: a row id, not a query), naming the column and the groups. The file groups'
    statistics settle it when one of them has a group of several rows; else (every file group's groups
    have one row each) their rows files' group keys are compared across them, as 64-bit hashes (8 bytes
    a training row; a group may span raw files)."""
    if data.group_key is None:
        return
    parts = [g.train.get("ranking") or {} for g in groups]
    if any(p.get("largest", 0) > 1 for p in parts) or not any(p.get("rows") for p in parts):
        return  # a group of several rows; or no training row, which `check_splits` refuses
    hashes = [np.zeros(0, np.uint64)]
    for g in groups:
        for s in g.shards:
            if s.split in data.split.fit_splits() and s.rows_path and g.key is not None:
                uri = storage.resolve(storage.join(store, g.key), s.rows_path)
                table = pl.read_parquet(io.BytesIO(storage.read_verified(uri, s.rows_sha256)), columns=[GROUP])
                hashes.append(table[GROUP].hash(seed=0).to_numpy())
    keys = np.concatenate(hashes)
    if np.unique(keys).size < keys.size:
        return  # a group key in two file groups: a group of several rows
    raise DataError(
        f"data.group_key '{data.group_key}': each of the {keys.size:,} groups in the training split has one row, "
        "so there is nothing to rank within a group; ranking needs several rows per group (the items one query, "
        "user or session was shown): name the column that groups them"
    )


def verify_manifest(manifest_uri: str, deep: bool = False) -> Manifest | None:
    """The manifest at `manifest_uri` if it and every shard it lists are there (and, when deep, match
    their checksums)."""
    if not storage.exists(manifest_uri):
        return None
    try:
        text = storage.read_text(manifest_uri)
        manifest = Manifest.model_validate_json(text)
    except Exception:  # noqa: BLE001 - an unreadable manifest is no manifest
        return None
    if edited_encoding(text):  # its encoding changed after it was written (by hand)
        return None
    folder = manifest_uri.rsplit("/", 1)[0]
    for s in manifest.shards:
        for rel, digest in ((s.path, s.sha256), (s.keys_path, s.keys_sha256), (s.rows_path, s.rows_sha256)):
            if rel is None:
                continue
            uri = storage.resolve(folder, rel)
            if not storage.exists(uri) or (deep and storage.sha256_uri(uri) != digest):
                return None
    return manifest


def _typed(targets: list, sample_uri: str) -> list:
    """Each class target with its raw column's type (from a file's footer), which predictions keep: an
    integer target predicts integers, a boolean one booleans."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not any(t.task == "classification" for t in targets):
        return targets
    fs, path = storage.filesystem(sample_uri)
    with fs.open(path, "rb") as f:
        schema = pq.read_schema(f)
    out = []
    for t in targets:
        if t.task == "classification" and t.column in schema.names:
            dtype = pl.from_arrow(pa.array([], type=schema.field(t.column).type)).dtype
            t = t.model_copy(update={"dtype": str(dtype.base_type())})
        out.append(t)
    return out


def shards_intact(infos: list[ShardInfo], folder: str) -> bool:
    """Every shard listed (paths relative to `folder`) is there with its size, and its keys file is there: a
    listing, no download (on S3, hashing every shard would fetch the data set on each rerun). The bytes
    are checked against their sha256 where they are read anyway: every fetch (`read_verified`)."""
    return _intact(infos, lambda rel: storage.size_of(storage.resolve(folder, rel)))


def _intact(infos: list[ShardInfo], size: Callable[[str], int | None]) -> bool:
    """Every shard has its size and its keys and rows files are there, `size` giving a file's size by its path
    in the group's folder (None: not there)."""
    return all(
        size(s.path) == s.bytes and size(s.keys_path) is not None and (not s.rows_path or size(s.rows_path) is not None)
        for s in infos
    )
