"""Appending raw files encodes only the new file groups: the groups a snapshot shares with an earlier
one are found by their content in the group store (the Prefect cache hit and the bytes on storage),
the data set's encoding is refitted from every group's statistics, and the result is exactly what a
from-scratch encode of the same files gives."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import torch

from shardline.core import storage
from shardline.core.config import validate_config
from shardline.core.encoding.write import file_groups, verify_manifest
from shardline.core.manifest import Manifest, RawFile, Snapshot
from shardline.tasks.encode import encode_dataset
from shardline.tasks.ingest import snapshot_source
from tests.conftest import make_raw, tiny_config

SPLITS = ("train", "validation", "test")


def config(raw, root, **over):
    return validate_config(tiny_config(str(raw / "*.parquet"), str(root), **over))


def stored_files(root) -> dict[str, tuple[int, bytes]]:
    """Every file of the group store: its mtime and bytes."""
    store = root / "datasets" / "groups"
    return {str(p.relative_to(store)): (p.stat().st_mtime_ns, p.read_bytes()) for p in store.rglob("*") if p.is_file()}


def read_manifest(uri: str) -> Manifest:
    return Manifest.model_validate_json(storage.read_text(uri))


def assert_same_training_data(uri_a: str, uri_b: str) -> None:
    """Both data sets give the same windows, row for row, as training reads them (each shard mapped from its
    own codes to its data set's encoding): features, targets, and each window's sequence and order."""
    from shardline.trainer.data import open_split

    a, b = read_manifest(uri_a), read_manifest(uri_b)
    assert a.encoding == b.encoding and a.rows == b.rows and a.windows == b.windows
    for split in SPLITS:
        da, db = open_split(a, uri_a, split), open_split(b, uri_b, split)
        assert da.n_windows == db.n_windows == a.windows[split] > 0
        ba, bb = da.batch(np.arange(da.n_windows)), db.batch(np.arange(db.n_windows))
        assert torch.equal(ba.cont, bb.cont) and torch.equal(ba.cat, bb.cat), split
        assert all(torch.equal(x, y) for x, y in zip(ba.targets, bb.targets, strict=True)), split
        ka, kb = da.window_keys(), db.window_keys()
        assert np.array_equal(ka["order"], kb["order"]) and np.array_equal(ka["segment"], kb["segment"])


def test_appended_files_leave_every_full_group_as_it_was():
    """Group boundaries depend on a group's place and its own files, never on the files after it: a prefix
    of a snapshot is grouped as the whole snapshot's first groups, all but its last (which the appended
    files may fill up). (They used to be sized from the total, so one more file moved every boundary.)"""
    rng = np.random.default_rng(4)
    sizes = rng.integers(20_000, 400_000, size=300)
    files = [RawFile(uri=f"/raw/f-{i:04d}.parquet", size=int(s), version="1") for i, s in enumerate(sizes)]
    data = config(Path("/raw"), "/store", **{"data.files_per_group": None, "data.group_mb": 2}).data

    def snap(n: int) -> Snapshot:
        return Snapshot(source="/raw", files=files[:n], fingerprint=str(n))

    whole = file_groups(snap(len(files)), data)
    assert len(whole) > 20 and [f for g in whole for f in g] == files
    assert max(sum(f.size for f in g) for g in whole) < 2.5e6  # filled to group_mb (a file may overshoot)
    assert sum(f.size for f in whole[0]) < 1.8e6  # the first groups are 2/3 (and a file): a small data set is cut too
    assert sum(f.size for f in whole[-2]) > 1.9e6  # and they grow with the data before them
    for n in (1, 7, 40, 95, 96, 150, 299):
        part = file_groups(snap(n), data)
        assert part[:-1] == whole[: len(part) - 1], n
        assert whole[len(part) - 1][: len(part[-1])] == part[-1], n
    # a small data set still encodes in parallel
    assert len(file_groups(snap(20), data)) >= 3


@pytest.mark.parametrize("sequence_key", ["@file", "seq"])
def test_a_new_day_in_device_folders_is_appended_where_each_file_is_a_sequence(sequence_key):
    """`device=7/dt=2026-01-02/part-0.parquet`, a file a device and day: the files sorted by path put each new day
    among the old ones, and every group after the first device's was encoded again. Where each file is a
    sequence, the files are taken by their dates first: a new day leaves every full group as it was. Where a
    sequence key spans files, the order stays the paths' (it decides which rows share a group and a window)."""

    def snap(days: int) -> Snapshot:
        uris = [f"/raw/device={d}/dt=2026-01-{day:02d}/part-0.parquet" for d in range(12) for day in range(1, days + 1)]
        return Snapshot(
            source="/raw", files=[RawFile(uri=u, size=100, version="1") for u in sorted(uris)], fingerprint="x"
        )

    data = config(Path("/raw"), "/store", **{"data.sequence_key": sequence_key, "data.files_per_group": 5}).data
    before, after = file_groups(snap(9), data), file_groups(snap(10), data)
    kept = sum(a == b for a, b in zip(before, after))
    if sequence_key == "@file":
        assert kept == len(before) - 1 and len(after) == len(before) + 2  # 108 files, then 120: 22 groups, then 24
        day10 = sorted(f"/raw/device={d}/dt=2026-01-10/part-0.parquet" for d in range(12))
        assert [f.uri for g in after[-3:] for f in g][-12:] == day10  # the new day's files come last
    else:
        assert kept == 1  # the first device's 9 days and the second's first: one group alike
        assert [f.uri for g in after for f in g] == [f.uri for f in snap(10).files]


def test_appending_encodes_only_the_new_groups_in_a_flow(tmp_path, prefect_api):
    """Through a real Prefect flow: after encoding 4 files (2 groups), 2 appended files make one new group;
    the 2 old groups come back from the cache, their shards untouched (bytes and mtimes), and the new
    manifest covers every row, exactly as a from-scratch encode of the 6 files."""
    from prefect import flow

    from shardline.tasks.encode import encode
    from tests.conftest import recorded_task_runs

    raw, root = tmp_path / "raw", tmp_path / "store"
    make_raw(raw, n_seq=12, rows=40)  # s-000 .. s-003
    cfg = config(raw, root)  # files_per_group: 2

    @flow(name="encode-append")
    def encode_only(snap: Snapshot, root: str):
        from prefect.runtime import flow_run

        return (*encode(snap, cfg.data, root), flow_run.id)

    def group_states(run_id, count: int) -> dict[int, str]:
        """The state of each encode-group task of a flow run, by the group's place in the snapshot (a group
        found in the group store is no task: it was taken from one listing)."""
        runs = recorded_task_runs(run_id, "encode-group", count=count)
        found = {r.name: r.state.name for r in runs if r.name.startswith("encode-group")}
        return {int(name.rsplit("-", 1)[1]): state for name, state in found.items()}

    first = snapshot_source(cfg.data)
    uri1, ran1, run1 = encode_only(first, str(root))
    assert ran1 and group_states(run1, 2) == {0: "Completed", 1: "Completed"}
    before = stored_files(root)
    assert len({name.split("/", 1)[0] for name in before}) == 2  # a folder per group

    make_raw(raw, n_seq=6, rows=40, prefix="t", seed=9)  # t-000, t-001: after s-* in the snapshot's order
    second = snapshot_source(cfg.data)
    assert [f.uri for f in second.files[:4]] == [f.uri for f in first.files] and len(second.files) == 6
    uri2, ran2, run2 = encode_only(second, str(root))
    assert ran2 and uri2 != uri1
    assert group_states(run2, 1) == {2: "Completed"}  # only the new group (the third) was encoded
    after = stored_files(root)
    assert {k: after[k] for k in before} == before  # the old groups' files: same bytes, never rewritten
    assert len(after) > len(before)

    m1, m2 = read_manifest(uri1), read_manifest(uri2)
    assert verify_manifest(uri2, deep=True) is not None
    old = {(s.path, s.sha256) for s in m1.shards}
    assert old < {(s.path, s.sha256) for s in m2.shards}  # the new manifest lists the old shards where they lie
    assert all(s.path.startswith("../groups/") for s in m2.shards)
    raw_rows = sum(pl.read_parquet(f.uri).height for f in second.files)
    assert sum(m2.rows.values()) == raw_rows
    assert m2.encoding != m1.encoding  # refitted from every group's statistics, the new ones included
    assert verify_manifest(uri1, deep=True) is not None  # the first snapshot's data set is still whole

    scratch = tmp_path / "scratch"
    uri3, ran3, run3 = encode_only(second, str(scratch))
    assert group_states(run3, 3) == {0: "Completed", 1: "Completed", 2: "Completed"}
    assert [(s.path, s.sha256) for s in read_manifest(uri3).shards] == [(s.path, s.sha256) for s in m2.shards]
    assert_same_training_data(uri2, uri3)

    # the same snapshot again: nothing runs
    again = encode_only(second, str(root))
    assert again[:2] == (uri2, False) and group_states(again[2], 0) == {}


@pytest.mark.parametrize(
    "split",
    [
        {"method": "hash", "seed": 2, "fractions": {"train": 0.6, "validation": 0.2, "test": 0.2}},
        {
            "method": "range",
            "column": "season",
            "ranges": {"train": [None, 2021], "validation": [2022, 2022], "test": [2023, None]},
        },
    ],
    ids=["hash", "range"],
)
@pytest.mark.parametrize(
    "sequence_key,window", [("seq", 3), ("@file", 3), (None, 1)], ids=["by-column", "by-file", "no-sequence"]
)
def test_every_split_appends_without_moving_a_row(tmp_path, split, sequence_key, window):
    """Every split assigns a row from the row alone (a seeded hash of its sequence key, or of its file and
    row number without one; a range of its own value), never from the rest of the data set: appending
    files leaves the stored groups as they were, and the appended data set is the from-scratch one,
    shard for shard. (Without the Prefect cache: the group store alone finds the stored groups.)"""
    raw, root = tmp_path / "raw", tmp_path / "store"
    make_raw(raw, n_seq=27, rows=40)  # 9 files of ~5.4 kB
    # groups filled to 10 kB (group_mb / SMALLEST): two files each, and a last group not full
    over = {
        "data.split": split,
        "data.sequence_key": sequence_key,
        "data.window": window,
        "data.files_per_group": None,
        "data.group_mb": 0.015,
    }
    cfg = config(raw, root, **over)
    store = str(root / "datasets" / "groups")
    first = snapshot_source(cfg.data)
    encode_dataset(first, cfg.data, str(root / "datasets" / "a"), threads=2, store=store)
    before = stored_files(root)
    groups_a = file_groups(first, cfg.data)
    assert [len(g) for g in groups_a] == [2, 2, 2, 2, 1]

    make_raw(raw, n_seq=3, rows=40, prefix="t", seed=9)  # one more file, after the others
    second = snapshot_source(cfg.data)
    groups_b = file_groups(second, cfg.data)
    assert groups_b[:-1] == groups_a[:-1] and len(groups_b[-1]) == 2  # the last group filled up
    uri = encode_dataset(second, cfg.data, str(root / "datasets" / "b"), threads=2, store=store)
    after = stored_files(root)
    assert {k: after[k] for k in before} == before  # nothing stored was rewritten
    folders_before = {name.split("/", 1)[0] for name in before}
    # only the last group, filled up, was encoded
    assert len({name.split("/", 1)[0] for name in after} - folders_before) == 1
    fresh = encode_dataset(second, cfg.data, str(tmp_path / "fresh" / "datasets" / "b"), threads=2)
    assert [s.sha256 for s in read_manifest(uri).shards] == [s.sha256 for s in read_manifest(fresh).shards]
    assert_same_training_data(uri, fresh)


def test_shard_paths_resolve_on_every_store():
    """A manifest lists a stored group's shards as `../groups/<key>/...`: resolved in the text, since an
    object store would take `datasets/x/../groups` as a key of its own."""
    from shardline.core.storage import relative_to, resolve

    for root in ("s3://bucket/root", "file:///srv/store", "/srv/store", "store"):
        folder, store = f"{root}/datasets/0123abcd", f"{root}/datasets/groups"
        rel = relative_to(store, folder)
        assert rel == "../groups"
        assert resolve(folder, f"{rel}/k1/train.bin.lz4") == f"{root}/datasets/groups/k1/train.bin.lz4"
        assert resolve(folder, "g00000-train.bin.lz4") == f"{folder}/g00000-train.bin.lz4"  # encoder 4: beside it
    assert relative_to("s3://b/out/groups", "s3://b/out") == "groups"
    with pytest.raises(ValueError, match="not on one store"):
        relative_to("s3://b/groups", "/local/out")


def test_an_ingest_after_an_append_reads_only_the_new_files_footers(tmp_path, prefect_api):
    """The ingest step keeps its snapshot in the storage root (`snapshots/`); the next ingest of the same source
    under the same data config takes a file it accepted, listed with the same size and version, without reading
    its footer: an append of 5 % of 22,000 files reads 1,100 footers, not 23,100. A new file is still read."""
    import os

    from prefect import flow

    from shardline.core.encoding.columns import DataError
    from shardline.tasks.ingest import checked_record, ingest

    raw, root = tmp_path / "raw", tmp_path / "store"
    make_raw(raw, n_seq=12, rows=40)  # s-000 .. s-003
    cfg = config(raw, root)

    @flow(name="ingest-append")
    def ingest_only(data):
        return ingest(data, str(root))

    first = ingest_only(cfg.data)
    assert len(first.files) == 4 and Path(checked_record(str(root), cfg.data)).is_file()
    # a checked file's bytes replaced by zeros, its size and modification time kept: a footer read would refuse
    # it, so the next ingest accepting it shows that it was not read
    kept = Path(first.files[-1].uri)  # not the first: the ingest reads a sample of the first file's rows
    st = kept.stat()
    kept.write_bytes(b"\0" * st.st_size)
    os.utime(kept, ns=(st.st_atime_ns, st.st_mtime_ns))
    make_raw(raw, n_seq=6, rows=40, prefix="t", seed=9)  # t-000, t-001: appended
    second = ingest_only(cfg.data)
    assert [f.uri for f in second.files] == [f.uri for f in first.files] + sorted(str(p) for p in raw.glob("t-*"))
    assert second.files[:4] == first.files

    # without the record (here: another data setting the ingest checks), every footer is read: the zeroed file is
    # refused (a setting only the encode reads, such as data.files_per_group, keeps the record)
    assert checked_record(str(root), config(raw, root, **{"data.files_per_group": 3}).data) == checked_record(
        str(root), cfg.data
    )
    other = config(raw, root, **{"data.on_bad_rows": "skip"})
    with pytest.raises(DataError, match=kept.name):
        ingest_only(other.data)
    # a new file that does not fit the config is read, and refused naming it
    pl.DataFrame({"other": [1, 2]}).write_parquet(raw / "u-000.parquet")
    with pytest.raises(DataError, match="u-000.parquet"):
        ingest_only(cfg.data)


def window_rows(uri: str) -> dict[str, dict[tuple[str, int], tuple]]:
    """Per split, each window by its sequence's key and its target row's order: its features and targets."""
    from shardline.trainer.data import open_split

    manifest = read_manifest(uri)
    folder = uri.rsplit("/", 1)[0]
    out = {}
    for split in SPLITS:
        data = open_split(manifest, uri, split)
        batch, at = data.batch(np.arange(data.n_windows)), data.window_keys()
        names = [
            pl.read_parquet(storage.read_bytes(storage.resolve(folder, s.keys_path)))["sequence"].to_list()
            for s in manifest.shards_of(split)
        ]
        out[split] = {
            (names[s][g], int(o)): (batch.cont[i].numpy(), batch.cat[i].numpy(), int(batch.targets[0][i]))
            for i, (s, g, o) in enumerate(zip(at["shard"], at["segment"], at["order"]))
        }
    return out


def assert_same_windows(uri_a: str, uri_b: str) -> dict:
    """Both data sets hold the same windows (each by its sequence and order; the same features up to the rounding
    of group-local codes, the same targets), in whatever order their groups put them; the first's `window_rows`."""
    wa, wb = window_rows(uri_a), window_rows(uri_b)
    for split in SPLITS:
        assert wa[split].keys() == wb[split].keys() and wa[split], split
        for k, (cont, cat, target) in wa[split].items():
            cont_b, cat_b, target_b = wb[split][k]
            assert np.allclose(cont, cont_b, atol=1e-5) and np.array_equal(cat, cat_b) and target == target_b, k
    return wa


def one_large_file(tmp_path: Path) -> tuple[list[Path], Path, Path]:
    """30 sequences of 200 rows made as files (`made/`) and written as one file, `raw/big.parquet` (row groups of
    700 rows): (the made files, the folder, the file)."""
    made = make_raw(tmp_path / "made", n_seq=30, rows=200)
    raw = tmp_path / "raw"
    raw.mkdir()
    big = raw / "big.parquet"
    pl.concat([pl.read_parquet(p) for p in made]).write_parquet(big, row_group_size=700)
    return made, raw, big


def encoder(raw: Path, tmp_path: Path, **over):
    """`encoded(name, group_mb)`: the folder `raw` encoded (groups by size, `over` on the config) into `tmp_path/name`:
    the manifest's URI and the file groups."""

    def encoded(name: str, group_mb: float) -> tuple[str, list]:
        data = config(raw, tmp_path / name, **{"data.files_per_group": None, "data.group_mb": group_mb, **over}).data
        snap = snapshot_source(data)
        return encode_dataset(snap, data, str(tmp_path / name / "out")), file_groups(snap, data)

    return encoded


def test_a_file_larger_than_a_group_is_encoded_in_parts(tmp_path, monkeypatch):
    """A click log or a sensor dump written as one large file held it all in memory at once (~17x its bytes: a
    444 MB file took 5.8 GB). A file of more than 1.5x `data.group_mb` with a key column is cut into parts, each
    its own group of the rows whose key falls in it: the same windows as the file encoded whole (every sequence
    whole in one part), the parts' files gone once read; a part with no sequence is a group without rows; an
    error in a part names the file."""
    import shardline.core.encoding.groups as groups_module
    from shardline.core.encoding.columns import DataError
    from shardline.core.manifest import FilePart

    monkeypatch.setattr(groups_module, "HELD_ROWS", 1500)  # several flushes in a small file
    made, raw, big = one_large_file(tmp_path)
    size = big.stat().st_size
    encoded = encoder(raw, tmp_path)
    whole_uri, whole = encoded("whole", 10 * size / 1e6)
    parts_uri, parts = encoded("parts", size / 4 / 1e6)
    assert len(whole) == 1 and not isinstance(whole[0][0], FilePart)
    assert [(g[0].part, g[0].parts, len(g)) for g in parts] == [(j, 4, 1) for j in range(4)]
    a, b = read_manifest(whole_uri), read_manifest(parts_uri)
    assert a.rows == b.rows and a.windows == b.windows and len(b.shards) > len(a.shards)
    assert [v.values for v in a.encoding.categorical] == [v.values for v in b.encoding.categorical]
    assert [c.mean for c in a.encoding.continuous] == pytest.approx([c.mean for c in b.encoding.continuous])
    wa = assert_same_windows(whole_uri, parts_uri)
    cut = storage.cache_dir() / "parts"
    assert not [p for p in cut.rglob("*") if p.suffix != ".lock"]  # each part's file removed as it was read

    # three sequences (one a split) in eight parts: five parts or more hold none, and are groups of no rows
    three = [min(wa[split])[0] for split in SPLITS]
    pl.read_parquet(big).filter(pl.col("seq").is_in(three)).write_parquet(big)
    few_uri, few = encoded("few", big.stat().st_size / 8 / 1e6)
    assert len(few) == 8 and sum(sum(g.rows.values()) == 0 for g in read_groups(tmp_path / "few")) >= 5
    assert read_manifest(few_uri).rows == dict.fromkeys(SPLITS, 200)

    # an error found in a part's rows (a row written twice) names the file
    frame = pl.concat([pl.read_parquet(p) for p in made])
    pl.concat([frame, frame.slice(1000, 1)]).write_parquet(big)
    with pytest.raises(DataError, match=r"big\.parquet"):
        encoded("bad", size / 4 / 1e6)
    # a file whose footer reads but whose pages do not: refused as damaged, naming it
    frame.write_parquet(big, row_group_size=700, compression="zstd")
    damaged = bytearray(big.read_bytes())
    damaged[len(damaged) // 3 : len(damaged) // 3 + 2000] = bytes(2000)
    big.write_bytes(bytes(damaged))
    with pytest.raises(DataError, match=r"big\.parquet: cannot read it to encode it in parts: .*damaged"):
        encoded("damaged", size / 4 / 1e6)
    # with data.on_bad_file: skip, its parts are groups of no rows and the file is listed once; the others encode
    for p in made[:6]:
        shutil.copy(p, raw / p.name)
    data = config(raw, tmp_path / "skip", **{"data.on_bad_file": "skip", "data.group_mb": size / 4 / 1e6}).data
    skipped = read_manifest(encode_dataset(snapshot_source(data), data, str(tmp_path / "skip" / "out")))
    assert [(r.uri.rsplit("/", 1)[-1], r.reason.split(":")[0]) for r in skipped.skipped] == [("big.parquet", "damaged")]
    assert sum(skipped.rows.values()) == 6 * 3 * 200


def test_a_file_of_plain_rows_larger_than_a_group_is_encoded_in_parts_of_its_rows(tmp_path):
    """Plain rows (no sequence key, a window of one: a tabular export as one large file) were one group whatever the
    file's size. They are cut by ranges of rows, as a corpus of documents is: each row keeps its place in its file, so
    its split and its order are the file whole's, and the same windows come out."""
    from shardline.core.manifest import FilePart

    _, raw, big = one_large_file(tmp_path)
    size = big.stat().st_size
    encoded = encoder(raw, tmp_path, **{"data.sequence_key": None, "data.order_by": None, "data.window": 1})
    whole_uri, whole = encoded("whole", 10 * size / 1e6)
    parts_uri, parts = encoded("parts", size / 4 / 1e6)
    assert len(whole) == 1 and not isinstance(whole[0][0], FilePart)
    assert [(g[0].part, g[0].parts, len(g)) for g in parts] == [(j, 4, 1) for j in range(4)]
    a, b = read_manifest(whole_uri), read_manifest(parts_uri)
    assert a.rows == b.rows and a.windows == b.windows and sum(a.rows.values()) == 30 * 200
    assert assert_same_windows(whole_uri, parts_uri)


def read_groups(root: Path) -> list:
    from shardline.core.manifest import EncodedGroup

    return [EncodedGroup.model_validate_json(p.read_text()) for p in (root / "out" / "groups").glob("*/group.json")]
