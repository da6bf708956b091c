"""Encode: each file group read once into shards (in the group's own codes) and its training
statistics; the data set's encoding is fitted from those and written in the manifest, last.
(How a shard's own codes map to the data set's encoding: `shardline/core/codes.py`.)

A group's shards are stored by the group's content, not the snapshot's: `datasets/groups/<group key>/`
(its files, the data settings and the encoder's version), so a snapshot that appends files finds the
shards of the groups it shares with an earlier one and encodes only its new groups; each snapshot's
manifest (`datasets/<dataset id>/manifest.json`) lists the shards where they lie."""

from __future__ import annotations

import functools
import os
import time

from prefect import task
from prefect.futures import as_completed
from prefect.logging import get_run_logger
from prefect.utilities.annotations import quote

from shardline.core import layout, storage
from shardline.core.config import DataConfig, stable_hash
from shardline.core.encoding.columns import DataError
from shardline.core.encoding.contract import contract
from shardline.core.encoding.text import sha256_text
from shardline.core.encoding.write import (
    TOKENIZER,
    build_manifest,
    check_groups,
    encode_group_to_shards,
    file_groups,
    fit_tokenizer,
    shards_intact,
    stored_group,
    stored_groups,
    verify_manifest,
)
from shardline.core.failures import retry_on_infrastructure
from shardline.core.manifest import EncodedGroup, EncodingSpec, FilePart, LocalVocab, Manifest, RawFile, Snapshot
from shardline.core.memory import return_freed_memory, trim
from shardline.core.secrets import redacted_errors
from shardline.core.version import code_version_of
from shardline.tasks.caching import CacheRule, cached, raw_files_key, run_cached
from shardline.tasks.ingest import describe_rejected

# bump when the shard layout or the encoding rules change (2: narrow target, order once per segment;
# 3: one pass, own codes per shard; since 2026-11-23 one set per group, same layout; 4: several targets,
# `target`, `target_1`, ..., and their statistics as a list; 5: each group's shards in the group store,
# `datasets/groups/<group key>/<split>.bin.lz4`, shared by every snapshot that holds the group; 7: ranking
# data (`data.group_key`) keeps each row's group, item and relevance in `<split>.rows.parquet` beside its
# shard, and its training statistics in the group's record; other data's shards are as they were; 8: a group's
# record holds its segments' lengths, and a group of other than text data is one for any window and horizon)
ENCODER_VERSION = "8"
# the data settings a group's shards are the same bytes for, so that changing one writes a manifest and encodes
# nothing: the id columns (passed through to predictions: the encode reads none) and, but for text data (whose
# tokens are laid out for its window), the window, horizon and target positions, whose windows are counted from a
# group's segment lengths where a manifest lists it (`listed`)
MANIFEST_ONLY = ("id_columns",)
WINDOW_ONLY = ("window", "horizon", "target_positions")


ENCODER = "shardline.core.encoding.write"  # the encode's body: reads the raw files, writes the shards


def encoder_code() -> str:
    """The version of the code that decides a shard's bytes: the encode's body (`shardline.core.encoding.write`: it
    reads the raw files and writes the shards) and what it imports (the encoder, `shardline.core.encoding.group`,
    ...). Part of a group's address, so an edit to that code stores new folders and never rewrites a shard that
    another snapshot's manifest lists; the step around it (this module: its tasks, retries and logs) is not: an
    edit here encodes nothing again."""
    return code_version_of(ENCODER)


def group_key(files: list[RawFile], data: DataConfig, tokenizer: str | None = None) -> str:
    """A file group's content address, its folder in the group store: its files (path, size, etag/mtime), the
    data settings that change a byte (not `MANIFEST_ONLY`'s, nor `WINDOW_ONLY`'s but for text data), the encoder's
    version and code, and for text data the tokenizer's sha256 (`tokenizer`). Not its place among the groups nor
    the rest of the snapshot, so any snapshot that holds the group finds it."""
    left_out = MANIFEST_ONLY + (WINDOW_ONLY if not data.features.text else ())
    settings = {k: v for k, v in _data_key(data).items() if k not in left_out}
    key = {"files": raw_files_key(files), "data": settings, "encoder": ENCODER_VERSION, "code": encoder_code()}
    if isinstance(files[0], FilePart):  # part of a file: which one of how many
        key["part"] = [files[0].part, files[0].parts]
    text = {"tokenizer": tokenizer, "tokenizers": tokenizers_version()} if tokenizer else {}
    return stable_hash(key | text)[:24]


@functools.cache
def tokenizers_version() -> str:
    """The tokenizers library's version: it tokenizes (and trains the BPE), so another one is another encoding
    (read once: every group's key asks)."""
    from importlib.metadata import version

    return version("tokenizers")


def dataset_id(snapshot: Snapshot, data: DataConfig) -> str:
    """Content address of an encoded data set: the raw files' fingerprint, the data config, the encoder."""
    # not where the files are listed from, nor how many groups run at once: neither changes what they hold
    dumped = data.model_dump(mode="json", exclude={"source", "on_bad_file", "encode_workers"})
    if data.features.text:  # the user's tokenizer file by its content: an edited file is another data set
        dumped["tokenizer"] = contract(data)["tokenizer"]
        dumped["tokenizers"] = tokenizers_version()  # the library that trains and applies it
    return stable_hash({"files": snapshot.fingerprint, "data": dumped, "encoder": ENCODER_VERSION})[:20]


# ---------------------------------------------------------------- Prefect tasks


@task(
    name="encode-group",
    task_run_name="encode-group-{group}",  # its place in the snapshot's order, from 0
    retries=2,
    retry_delay_seconds=5,
    # after an I/O or network failure, never after a data error (a wrong type, an unreadable page, a null target):
    # the same bytes fail the same way, and the error is said once
    retry_condition_fn=retry_on_infrastructure,
)
@redacted_errors
def encode_group(
    files: list[RawFile],
    group: int,
    n_groups: int,
    data: DataConfig,
    store: str,
    reuse: bool = True,
    tokenizer: tuple[str, str] | None = None,
) -> EncodedGroup:
    """Encode one file group into shards (one per split) in the group store and its training statistics
    (or, with `reuse`, take the group's stored shards when they are already there); text data with the
    `tokenizer` (its URI and sha256)."""
    t0 = time.perf_counter()
    tokenizer = tuple(tokenizer) if tokenizer else None
    key = group_key(files, data, tokenizer[1] if tokenizer else None)
    stored = stored_group(store, key) if reuse else None
    result = stored or encode_group_to_shards(files, data, store, key, tokenizer=tokenizer)
    trim()  # the group's frames and buffers, freed: the holes they left in the heaps go back to the system
    get_run_logger().info(
        "encode: group %d/%d %s: %s, %d rows in %.1fs",
        group + 1,
        n_groups,
        "found in the group store" if stored else "done",
        f"part {files[0].part + 1}/{files[0].parts} of {files[0].uri}"
        if isinstance(files[0], FilePart)
        else f"{len(files)} file(s)",
        sum(result.rows.values()),
        time.perf_counter() - t0,
    )
    return result


def log_skipped_rows(groups: list[EncodedGroup], log) -> dict[str, dict[str, int]]:
    """Text data with `data.on_bad_rows: skip`: the rows left out for a null or empty text, said per file and
    column in the encode's log; returns them."""
    skipped: dict[str, dict[str, int]] = {}
    for g in groups:  # a file's rows in several groups (parts of a large file): added up
        for uri, cols in (g.train.get("skipped") or {}).items():
            for c, n in cols.items():
                skipped.setdefault(uri, {})[c] = skipped.get(uri, {}).get(c, 0) + n
    if skipped:
        total = sum(n for cols in skipped.values() for n in cols.values())
        listing = "; ".join(
            f"{uri}: " + ", ".join(f"{n} in '{c}'" for c, n in cols.items()) for uri, cols in sorted(skipped.items())
        )
        log.warning(
            "encode: left out rows with a null or empty text (data.on_bad_rows: skip), %d in all: %s", total, listing
        )
    return skipped


def log_short_sequences(manifest: Manifest, data: DataConfig, log) -> None:
    """The sequences (segments of a split) too short for one window, said per split: their rows train and score
    nothing (a data set where every one is short fails earlier, naming the window)."""
    short: dict[str, list[int]] = {}
    for s in manifest.shards:
        if s.short_segments:
            counts = short.setdefault(s.split, [0, 0])
            counts[0] += s.short_segments
            counts[1] += s.short_rows
    if short:
        said = ", ".join(f"{split} {n} ({rows} rows)" for split, (n, rows) in short.items())
        log.warning(
            "encode: sequences shorter than data.window + data.horizon = %d rows are in no window, their rows in no "
            "prediction or score: %s",
            data.window + data.effective_horizon,
            said,
        )


UNSEEN_SHOWN = 5  # values `log_unseen_classes` names
UNSEEN_FILES = 3  # files named for each of them
UNSEEN_READS = 40  # raw files it reads a column of again, at most, to find them (a click log's 22,000 are not)


def log_unknown_to_parent(manifest: Manifest, groups: list[EncodedGroup], log) -> dict[str, int]:
    """A fine-tune's data keeps its parent's encoding: a category value the parent's training never had (a new item)
    is coded as unknown, as a null is, and the fine-tune cannot learn an id of its own for it. Said per column with
    the share of the training rows it takes. Returns {column: such rows}."""
    from shardline.core.encoding.fit import merged_counts

    said = {}
    for vocab in manifest.encoding.categorical:
        counts = merged_counts(g.train.get("categorical", {}).get(vocab.name, {}) for g in groups)
        known = set(vocab.values)
        new = {v: n for v, n in counts.items() if n and v not in known}
        if new:
            rows, total = sum(new.values()), sum(counts.values())
            log.warning(
                "encode: '%s' holds %d value(s) in %s of its %s training rows with a value (%.1f %%) that the parent "
                "model (training.init_from) never saw, e.g. %s: they are coded as unknown (as a null), one id for all "
                "of them; to learn ids of their own, train without training.init_from",
                vocab.name,
                len(new),
                f"{rows:,}",
                f"{total:,}",
                100 * rows / max(total, 1),
                ", ".join(sorted(new, key=lambda v: -new[v])[:5]),
            )
            said[vocab.name] = rows
    return said


def log_unseen_classes(
    manifest: Manifest, groups: list[EncodedGroup], snapshot: Snapshot, data: DataConfig, log, parent: bool = False
) -> dict[str, list[str]]:
    """A class target's values that the model has no class for (no training row it was fitted on has them: only
    validation and test rows do), said per target, the first few with files that hold them: the model never
    predicts them, and evaluation scores their rows as the class `<unseen>`. Ranking data's relevance grades: a
    warning (a grade outside the data's own, a click of 3 among 0/1 clicks, counted in nDCG with a gain of 7, went
    unsaid); other targets: a rare class in a long tail is as likely, said as information. `parent`: the encoding is
    a parent model's (its classes). Returns {column: the values}."""
    from shardline.core.encoding.fit import merged_counts

    targets = [(i, t) for i, t in enumerate(manifest.encoding.targets) if t.task == "classification"]
    if not targets or data.features.text:
        return {}
    unseen: dict[int, dict[str, list[str | None]]] = {}  # target -> value -> the groups holding it
    for g in groups:
        local = next((s.local for s in g.shards if s.local is not None), None)
        for i, t in targets:
            voc = local.targets[i] if local is not None and i < len(local.targets) else None
            if isinstance(voc, LocalVocab):
                known = set(t.classes or [])
                held = voc.texts() if g.unfitted is None else g.unfitted.get(i, [])  # None: an earlier encoder's
                if parent and g.unfitted is not None:  # the parent's classes: those of this data's training rows too
                    fitted = (g.train.get("targets") or [])[i : i + 1]
                    held = [*held, *merged_counts(f.get("counts", {}) for f in fitted)]
                for v in (v for v in held if v not in known):
                    unseen.setdefault(i, {}).setdefault(v, []).append(g.key)
    files: dict[str | None, list[str]] = {}  # each group's files, listed once a value's files are looked for
    reads = [UNSEEN_READS]
    whose = "the training split of the parent model (training.init_from)" if parent else "the training split"
    for i, values in unseen.items():
        column = manifest.encoding.targets[i].column
        first = sorted(values, key=_natural)[:UNSEEN_SHOWN]
        # the files of a few such values (a typo, a grade out of range) are looked for; a long tail's are not
        few = len(values) <= UNSEEN_SHOWN or data.group_key is not None
        if few and not files:
            files = {group_key(fs, data): [f.uri for f in fs] for fs in file_groups(snapshot, data)}
        uris = [u for v in first for key in values[v] for u in files.get(key, [])] if few else []
        held = _files_holding(uris, column, first, reads)
        shown = [f"{v} ({', '.join(u.rsplit('/', 1)[-1] for u in held[v])})" if held.get(v) else v for v in first]
        said = (
            f"encode: '{column}' holds {len(values)} value(s) no row of {whose} has, in its "
            f"{'rows' if parent else 'validation or test rows'}: {'; '.join(shown)}"
            f"{' ...' if len(values) > UNSEEN_SHOWN else ''}. The model never predicts them, and evaluation scores "
            "those rows as the class '<unseen>'"
        )
        if data.group_key:
            log.warning("%s; if they are mistakes, fix those files", said)
        else:
            log.info("%s", said)
    return {manifest.encoding.targets[i].column: sorted(values, key=_natural) for i, values in unseen.items()}


def _natural(value: str) -> tuple:
    """Numbers in their order (2 before 10), then text."""
    try:
        return (0, float(value), "")
    except ValueError:
        return (1, 0.0, value)


def _files_holding(uris: list[str], column: str, values: list[str], reads: list[int]) -> dict[str, list[str]]:
    """For each of `values`, the first `UNSEEN_FILES` of the files `uris` whose `column` holds it (as text): that
    column read again, a file at a time, while `reads` (a budget shared by the targets said) lasts. A file that
    cannot be read now is named for each."""
    import polars as pl

    out: dict[str, list[str]] = {}
    for uri in dict.fromkeys(uris):  # a part of a large file: its file once
        if reads[0] <= 0 or all(len(out.get(v, [])) >= UNSEEN_FILES for v in values):
            break
        reads[0] -= 1
        try:
            if storage.is_remote(uri):
                fs, path = storage.filesystem(uri)
                with fs.open(path, "rb") as f:
                    held = pl.read_parquet(f, columns=[column])[column]
            else:
                held = pl.read_parquet(storage.local_path(uri), columns=[column])[column]
            there = set(held.cast(pl.Utf8).unique().drop_nulls().to_list()) & set(values)
        except Exception:  # noqa: BLE001 - named, unread
            there = set(values)
        for v in there:
            if len(out.setdefault(v, [])) < UNSEEN_FILES:
                out[v].append(uri)
    return out


@task(name="fit-tokenizer")
@redacted_errors
def fit_tokenizer_task(snapshot: Snapshot, data: DataConfig, out_dir: str) -> tuple[str, str]:
    """Text data: train (or check the user's) tokenizer, stored beside the manifest; (its URI, its sha256)."""
    t0 = time.perf_counter()
    uri, sha = fit_tokenizer(snapshot, data, out_dir)
    from shardline.core.encoding.text import vocab_size

    log, size = get_run_logger(), vocab_size(storage.read_text(uri))
    how = f"file {data.tokenizer.file}" if data.tokenizer.file else f"BPE of {size} ids"
    log.info("encode: tokenizer (%s) %s sha256 %s in %.1fs", how, uri, sha[:12], time.perf_counter() - t0)
    asked = data.tokenizer.vocab_size if not data.tokenizer.file else None
    if asked and size < asked:
        log.warning(
            "encode: data.tokenizer.vocab_size=%d, but the training split's text holds only %d distinct tokens "
            "(BPE merges run out): the tokenizer has %d ids, and a larger vocab_size gives this same tokenizer",
            asked,
            size,
            size,
        )
    return uri, sha


def publish_manifest(
    snapshot: Snapshot,
    groups: list[EncodedGroup],
    data: DataConfig,
    out_dir: str,
    store: str,
    base: tuple[EncodingSpec, str] | None = None,
) -> tuple[str, Manifest]:
    """Fit the encoding (or take the parent's: `base`), check the splits and publish the manifest (last: until it
    exists, the shards are not a data set) in `out_dir`, listing the shards of the group store `store`."""
    check_groups(groups, data, store)
    tokenizer = storage.read_text(storage.join(out_dir, TOKENIZER)) if data.features.text else None
    manifest = build_manifest(
        snapshot, groups, data, base, store=storage.relative_to(store, out_dir), tokenizer=tokenizer
    )
    # the data set's own encoding is `manifest.json`; a parent's, beside it, `manifest-<its hash>.json` (the same
    # shards: they hold their own codes)
    uri = storage.join(out_dir, "manifest.json" if base is None else f"manifest-{base[0].hash()[:16]}.json")
    storage.write_text(uri, manifest.model_dump_json(indent=1))
    return uri, manifest


@task(name="write-manifest")
@redacted_errors
def write_manifest(
    snapshot: Snapshot,
    groups: list[EncodedGroup],
    data: DataConfig,
    out_dir: str,
    base: tuple[EncodingSpec, str] | None,
    store: str,
) -> str:
    """`publish_manifest`, said in the encode's log."""
    uri, manifest = publish_manifest(snapshot, groups, data, out_dir, store, base)
    if manifest.skipped:
        get_run_logger().warning(
            "encode: %d raw file(s) damaged inside left out (data.on_bad_file: skip):\n%s",
            len(manifest.skipped),
            describe_rejected(manifest.skipped),
        )
    log_skipped_rows(groups, get_run_logger())
    if outside := sum(g.outside for g in groups):  # a range split's rows in no range: out of the data set
        read = outside + sum(manifest.rows.values())
        get_run_logger().info(
            "encode: %d of the %d rows read (%.1f %%) fall in no range of data.split.ranges (column '%s') and are "
            "left out",
            outside,
            read,
            100 * outside / read,
            data.split.column,
        )
    if cut := sum(g.cut for g in groups):  # a test query ranked without its rows in train: metrics of half-queries
        get_run_logger().warning(
            "encode: data.split.ranges over '%s' put %d group(s) of data.group_key '%s' in more than one split: each "
            "split ranks only its part of them. Split by a column each group holds one value of (its first time, "
            "as a session's start), or by hash (data.split.method: hash keeps every group whole)",
            data.split.column,
            cut,
            data.group_key,
        )
    log_short_sequences(manifest, data, get_run_logger())
    log_unseen_classes(manifest, groups, snapshot, data, get_run_logger(), parent=base is not None)
    if base is not None:
        log_unknown_to_parent(manifest, groups, get_run_logger())
    get_run_logger().info(
        "encode: manifest %s: rows %s, windows %s, %.1f MB of shards",
        uri,
        manifest.rows,
        manifest.windows,
        sum(s.bytes for s in manifest.shards) / 1e6,
    )
    return uri


def without_damaged(snapshot: Snapshot, manifest_uri: str, data: DataConfig) -> Snapshot:
    """The snapshot as its encoded data set holds it: the raw files the encode found damaged inside and left out
    (`data.on_bad_file: skip`) moved from its files to its rejected ones, which the run's summary and the registered
    version list (and the champion's gate never reads); with `fail`, an error naming them (the data set was encoded
    by a run that skipped them: a data set's address does not hold `on_bad_file`)."""
    skipped = Manifest.model_validate_json(storage.read_text(manifest_uri)).skipped
    if not skipped:
        return snapshot
    if data.on_bad_file == "fail":
        raise DataError(
            f"{len(skipped)} raw file(s) are damaged inside (their footers read, their data does not):\n"
            f"{describe_rejected(skipped)}\nReplace or remove them, or set data.on_bad_file: skip to train without them"
        )
    gone = {r.uri for r in skipped}
    kept = [f for f in snapshot.files if f.uri not in gone]
    return snapshot.model_copy(update={"files": kept, "rejected": [*snapshot.rejected, *skipped]})


def _data_key(data: DataConfig) -> dict:
    """The data settings that change a byte of the shards. Not where the user's tokenizer file lies (the config
    loader makes its path absolute, so another checkout or a moved project would encode every group again):
    its content is in the key, by its sha256 (here, and the group's tokenizer in `group_key`)."""
    return data.model_dump(
        mode="json",
        exclude={
            "source": True,
            "on_bad_file": True,
            "files_per_group": True,
            "group_mb": True,
            "encode_workers": True,
            "tokenizer": {"file"},
        },
    )


# What decides a group's shards: its content address (its raw files by path, size and etag/mtime, the
# data settings that change a byte, the encoder; not its place among the groups nor the rest of the
# snapshot, so a snapshot with appended files finds it) and the group store; its shards must be intact.
ENCODE_GROUP_CACHE = CacheRule(
    "encode",
    key=lambda inputs: (
        group_key(inputs["files"], inputs["data"], (inputs.get("tokenizer") or (None, None))[1]),
        inputs["store"],
    ),
    code=(ENCODER,),  # the code that writes the bytes: an edit to this step's logs or retries encodes nothing
    still_valid=lambda group, inputs: (
        group.key is not None and shards_intact(group.shards, storage.join(inputs["store"], group.key))
    ),
)
# What decides text data's tokenizer: the snapshot, the data settings (the user's file by its content) and
# where it is written; it must still be there with its sha256.
TOKENIZER_CACHE = CacheRule(
    "encode",
    key=lambda inputs: (
        "tokenizer",
        inputs["snapshot"].fingerprint,
        _data_key(inputs["data"]),
        contract(inputs["data"]).get("tokenizer"),
        inputs["out_dir"],
    ),
    code=(ENCODER,),
    still_valid=lambda result, inputs: (
        storage.exists(result[0]) and sha256_text(storage.read_text(result[0])) == result[1]
    ),
)
# What decides the manifest: the snapshot, every group's shards (where they lie, by checksum) and the
# data settings.
MANIFEST_CACHE = CacheRule(
    "manifest",
    key=lambda inputs: (
        inputs["snapshot"].fingerprint,
        [[g.key, [x.sha256 for x in g.shards]] for g in inputs["groups"]],
        _data_key(inputs["data"]),
        inputs["out_dir"],
        inputs.get("store"),
        inputs["base"][0].hash() if inputs.get("base") else None,  # the parent's encoding, when fine-tuning
    ),
    code=(__name__, "shardline.core.encoding.reuse"),
    still_valid=lambda uri, inputs: verify_manifest(uri) is not None,
)


def encode(
    snapshot: Snapshot,
    data: DataConfig,
    storage_root: str,
    refresh: bool = False,
    base: tuple[EncodingSpec, str] | None = None,
    runner=None,
) -> tuple[str, bool]:
    """Wire the encode step (inside a flow): map the encode over file groups, then fit the encoding (or
    reuse `base`, the encoding of the model a fine-tune starts from, and where it came from) and write
    the manifest. Returns (manifest URI, whether any of its tasks ran rather than came from the cache).
    `runner`: None (the groups run on the flow's own thread pool, `data.encode_workers` at once) or a
    function opening another task runner, a context yielding (a started Prefect task runner, how many
    groups it runs at once): a Dask cluster's, shardline/flows/runners.py. It is opened only when a
    group is to be encoded (a rerun that finds every group in the store starts no cluster)."""
    from contextlib import nullcontext

    log = get_run_logger()
    out_dir = layout.dataset(storage_root, dataset_id(snapshot, data))
    store = layout.group_store(storage_root)
    groups = file_groups(snapshot, data)
    tokenizer = None
    if data.features.text:  # the tokenizer first: the groups' token ids are its
        tok_t = cached(fit_tokenizer_task, TOKENIZER_CACHE, storage_root, refresh)
        tokenizer = tuple(tok_t(quote(snapshot), data, out_dir))
    keys = [group_key(g, data, tokenizer[1] if tokenizer else None) for g in groups]
    # the groups already in the store (an append's old ones, a rerun's all) are taken from one listing;
    # only the others become tasks (`--force encode`: every group is encoded again)
    found = {} if refresh else stored_groups(store, keys)
    enc_t = cached(encode_group, ENCODE_GROUP_CACHE, storage_root, refresh)
    todo = [i for i, k in enumerate(keys) if k not in found]
    enc_futures = {}  # by the group's place in the snapshot's order
    with runner() if runner is not None and todo else nullcontext((None, encode_workers(data))) as (other, workers):
        log.info(
            "encode: %d file(s) in %d group(s), %d at a time -> %s (shards in %s)",
            len(snapshot.files),
            len(groups),
            workers,
            out_dir,
            store,
        )
        # at most `workers` groups in flight: the encode's memory is bounded by the group size times
        # that, not by the data set (a mapped task would start every group at once on a thread pool);
        # the next starts when any one ends (waiting for the oldest left a worker idle behind a slow group)
        in_flight: set = set()
        for i in todo:
            if len(in_flight) >= workers:
                in_flight.remove(next(as_completed(list(in_flight))))
            params = dict(group=i, n_groups=len(groups), store=store, reuse=not refresh, tokenizer=tokenizer)
            if other is None:  # quoted: no futures inside, and Prefect's search for them visits every field
                enc_futures[i] = enc_t.submit(quote(groups[i]), data=quote(data), **params)
            else:  # a runner given its parameters directly does not unwrap quotes
                enc_futures[i] = other.submit(enc_t, {"files": groups[i], "data": data, **params})
            in_flight.add(enc_futures[i])
        results = [found[k] if k in found else enc_futures[i].result() for i, k in enumerate(keys)]
        cached_groups = len(found) + sum(f.state.name == "Cached" for f in enc_futures.values())
    log.info(
        "encode: %d of %d group(s) found in the group store, %d encoded",
        cached_groups,
        len(groups),
        len(groups) - cached_groups,
    )
    # quoted: Prefect would visit every element of these (each shard's own codes, vocabularies included)
    # looking for futures, which cost more than the manifest itself on a data set of many groups
    uri, manifest_ran = run_cached(
        write_manifest,
        MANIFEST_CACHE,
        storage_root,
        refresh,
        quote(snapshot),
        quote(results),
        data,
        out_dir,
        base,
        store,
    )
    return uri, cached_groups < len(groups) or manifest_ran


def encode_workers(data: DataConfig) -> int:
    """How many file groups are encoded at once: `data.encode_workers`, else the CPU count."""
    return data.encode_workers or os.cpu_count() or 1


def encode_dataset(
    snapshot: Snapshot, data: DataConfig, out_dir: str, threads: int | None = None, store: str | None = None
) -> str:
    """The encode step without Prefect (benchmarks, scripts): the same per-group functions the
    tasks run, `threads` groups at once (default: `encode_workers`), the groups' shards in the group
    store `store` (default: `groups` inside `out_dir`; groups already stored there are reused) and the
    manifest in `out_dir`. Returns the manifest URI."""
    from concurrent.futures import ThreadPoolExecutor

    return_freed_memory()

    def one(files: list[RawFile]) -> EncodedGroup:
        key = group_key(files, data, sha)
        group = stored_group(store, key) or encode_group_to_shards(files, data, store, key, tokenizer=tokenizer)
        trim()
        return group

    store = store or storage.join(out_dir, layout.GROUPS)
    groups = file_groups(snapshot, data)
    tokenizer = fit_tokenizer(snapshot, data, out_dir) if data.features.text else None
    sha = tokenizer[1] if tokenizer else None
    with ThreadPoolExecutor(max(1, threads or encode_workers(data))) as pool:
        results = list(pool.map(one, groups))
    return publish_manifest(snapshot, results, data, out_dir, store)[0]
