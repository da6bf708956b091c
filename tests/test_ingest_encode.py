import json
import shutil
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from shardline.core import codes
from shardline.core.codes import Globaliser
from shardline.core.config import validate_config
from shardline.core.encoding.columns import DataError, prepare
from shardline.core.encoding.frame import encode_frame
from shardline.core.encoding.write import build_manifest, encode_group_to_shards, file_groups, verify_manifest
from shardline.core.manifest import Manifest
from shardline.core.shards import read_arrays, window_starts
from shardline.core.storage import resolve, shared_cache
from shardline.tasks.encode import dataset_id, group_key
from shardline.tasks.ingest import snapshot_source
from tests.conftest import make_raw, tiny_config


def cfg_for(raw_dir, tmp_path, **over):
    return validate_config(tiny_config(str(raw_dir / "*.parquet"), str(tmp_path / "store"), **over))


def encode_all(cfg):
    snap = snapshot_source(cfg.data)
    groups = file_groups(snap, cfg.data)
    out_dir = f"{cfg.storage.root}/datasets/{dataset_id(snap, cfg.data)}"
    store = f"{cfg.storage.root}/datasets/groups"
    results = [encode_group_to_shards(g, cfg.data, store, group_key(g, cfg.data)) for g in groups]
    manifest = build_manifest(snap, results, cfg.data)  # shards listed as ../groups/<key>/...
    return snap, manifest.encoding, out_dir, manifest


def shard_arrays(manifest, out_dir, info):
    """A shard's arrays as readers see them: unpacked and written in the data set's encoding a chunk of rows
    at a time (as a streamed shard or a split pack is); the same as mapping the whole shard at once."""
    uri = resolve(out_dir, info.path)  # in the group store: ../groups/<key>/<split>.bin.lz4
    local = shared_cache().get(uri, info.sha256, info.bytes, info.compression, info.raw_bytes)
    glob = Globaliser(manifest.encoding)
    written = local.with_name(f"{local.name}.mapped")
    with open(written, "wb") as f:
        f.truncate(glob.nbytes(info))
        glob.write(local.read_bytes(), info, f.fileno())
    got = read_arrays(written, glob.specs(info))
    whole = glob.arrays(read_arrays(local, info.arrays), info.local)
    assert sorted(got) == sorted(whole)
    for name, a in whole.items():
        assert got[name].dtype == a.dtype and np.array_equal(got[name], a, equal_nan=True), (info.path, name)
    return got


def test_snapshot_lists_files_with_versions(raw_dir, tmp_path):
    snap = snapshot_source(cfg_for(raw_dir, tmp_path).data)
    assert [f.uri.rsplit("/", 1)[1] for f in snap.files] == [f"s-{i:03d}.parquet" for i in range(4)]
    assert all(f.size > 0 and f.version for f in snap.files)
    again = snapshot_source(cfg_for(raw_dir, tmp_path).data)
    assert again.fingerprint == snap.fingerprint
    make_raw(raw_dir, n_seq=3, prefix="new")
    assert snapshot_source(cfg_for(raw_dir, tmp_path).data).fingerprint != snap.fingerprint


def test_symbolic_links_to_raw_files_are_listed_as_their_files(raw_dir, tmp_path):
    """A folder of links to the raw files (a data set assembled from another's files) lists them all, each with
    its target's size."""
    linked = tmp_path / "linked"
    linked.mkdir()
    for f in sorted(raw_dir.glob("*.parquet")):
        (linked / f.name).symlink_to(f)
    snap = snapshot_source(cfg_for(linked, tmp_path).data)
    direct = snapshot_source(cfg_for(raw_dir, tmp_path).data)
    assert [f.uri.rsplit("/", 1)[1] for f in snap.files] == [f"s-{i:03d}.parquet" for i in range(4)]
    assert [f.size for f in snap.files] == [f.size for f in direct.files]


@pytest.mark.parametrize("dtype", [pl.Array(pl.Float32, 2), pl.List(pl.Float32)])
@pytest.mark.parametrize("per_group", [1, 2])  # each file read alone; the files in one scan
def test_the_elements_of_a_list_column_are_features(raw_dir, tmp_path, dtype, per_group):
    """An embedding or a sensor's axes as one list (or fixed-size array) column: `vec[0:2]` under
    data.features.continuous makes each element a feature, encoded to the very shards of the same values written
    as columns of their own; an element past a row's list is missing (as a null). Named whole, the error says how
    to name its elements; an element past a fixed-size array's end, or of a column of no numbers, is said."""
    flat = tmp_path / "flat"
    flat.mkdir()
    for f in sorted(raw_dir.glob("*.parquet")):
        df = pl.read_parquet(f)
        short = pl.col("t") == 7  # a row whose list holds one element (a list column's rows may differ)
        second = pl.when(short & (dtype == pl.List(pl.Float32))).then(None).otherwise(-pl.col("x"))
        df.with_columns(pl.col("x").alias("vec_0"), second.alias("vec_1")).write_parquet(flat / f.name)
        vec = pl.concat_list(pl.col("x"), -pl.col("x"))
        if dtype == pl.List(pl.Float32):
            vec = pl.when(short).then(pl.concat_list(pl.col("x"))).otherwise(vec)
        df.with_columns(vec.cast(dtype).alias("vec")).write_parquet(f)
    over = {"data.features.continuous": ["vec[0:2]", "y"], "data.files_per_group": per_group}
    cfg = cfg_for(raw_dir, tmp_path, **over)
    assert cfg.data.features.continuous == ["vec[0]", "vec[1]", "y"]
    assert cfg.model_dump(mode="json")["data"]["features"]["continuous"] == ["vec[0:2]", "y"]  # params, cache keys
    flat_over = {**over, "data.features.continuous": ["vec_0", "vec_1", "y"]}
    flat_cfg = validate_config(tiny_config(str(flat / "*.parquet"), str(tmp_path / "store-flat"), **flat_over))
    (_, spec, out, m), (_, flat_spec, flat_out, flat_m) = encode_all(cfg), encode_all(flat_cfg)
    assert [c.name for c in spec.continuous] == ["vec[0]", "vec[1]", "y"]
    assert [(c.mean, c.std) for c in spec.continuous] == [(c.mean, c.std) for c in flat_spec.continuous]
    for split in m.rows:
        for a, b in zip(m.shards_of(split), flat_m.shards_of(split), strict=True):
            got, want = shard_arrays(m, out, a), shard_arrays(flat_m, flat_out, b)
            assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in got), split

    def refused(continuous: list[str]) -> str:
        with pytest.raises(DataError) as e:
            snapshot_source(cfg_for(raw_dir, tmp_path, **{"data.features.continuous": continuous}).data)
        return str(e.value)

    assert "column 'vec' has type" in refused(["vec", "y"]) and "name them: vec[0:" in refused(["vec", "y"])
    if dtype == pl.Array(pl.Float32, 2):
        said = refused(["vec[0:3]"])
        assert (
            "'vec[2]' is past the end of column 'vec', which holds 2 elements a row (vec[0:2] names them all)" in said
        )
    assert "'kind[0]' names an element of column 'kind', which holds" in refused(["kind[0:1]"])
    for f in raw_dir.glob("*.parquet"):  # a column named like an element is not read as one
        pl.read_parquet(f).rename({"vec": "vec[0]"}).write_parquet(f)
    assert "the file's column named 'vec[0]' is not read: a name ending in [N] names a list's element" in refused(
        ["vec[0]"]
    )


def test_a_structs_field_named_as_a_feature_is_said_to_be_a_field_and_how_to_make_it_a_column(raw_dir, tmp_path):
    """Event logs nest their values (`pos: {x, y}`); a config naming `pos.x` was told "missing column 'pos.x'; did you
    mean 'pos'?". It is told that `pos` is a struct whose fields are not read as columns, and how to unnest it."""
    for f in raw_dir.glob("*.parquet"):
        frame = pl.read_parquet(f)
        frame.with_columns(pl.struct("x", "y").alias("pos")).drop("x", "y").write_parquet(f)
    with pytest.raises(DataError) as e:
        snapshot_source(cfg_for(raw_dir, tmp_path, **{"data.features.continuous": ["pos.x", "pos.z"]}).data)
    said = str(e.value)
    assert "missing column 'pos.x' (the continuous in data.features); 'pos' is a struct (x, y)" in said
    assert "write its field 'x' as columns (polars: df.unnest('pos'), which names them 'x', 'y')." in said
    assert "missing column 'pos.z' (the continuous in data.features); 'pos' is a struct (x, y)" in said  # no such field
    assert "write (it has no field 'z') those you want as columns (polars: df.unnest('pos')" in said


def test_missing_column_and_wrong_dtype_are_named(raw_dir, tmp_path):
    pl.read_parquet(raw_dir / "s-000.parquet").drop("kind").write_parquet(raw_dir / "s-000.parquet")
    df = pl.read_parquet(raw_dir / "s-001.parquet")
    df.with_columns(pl.col("x").cast(pl.Utf8)).write_parquet(raw_dir / "s-001.parquet")
    with pytest.raises(DataError) as e:
        snapshot_source(cfg_for(raw_dir, tmp_path).data)
    msg = str(e.value)
    assert "s-000.parquet: missing column 'kind'" in msg
    assert "s-001.parquet: column 'x' has type large_string" in msg and "must be a number" in msg
    assert "on_bad_file: skip" in msg
    # with skip, the run goes on without them and says which were skipped
    snap = snapshot_source(cfg_for(raw_dir, tmp_path, **{"data.on_bad_file": "skip"}).data)
    assert len(snap.files) == 2
    assert sorted(r.uri.rsplit("/", 1)[1] for r in snap.rejected) == ["s-000.parquet", "s-001.parquet"]


def test_corrupt_file_is_reported(raw_dir, tmp_path):
    (raw_dir / "s-002.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match="s-002.parquet: not a readable parquet file"):
        snapshot_source(cfg_for(raw_dir, tmp_path).data)


def test_footers_are_read_from_the_files_ends(tmp_path):
    """A footer longer than the first read of a file's end is read whole the second time; a file cut short
    is an error of its own; the metadata is the file's."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from shardline.tasks.ingest import FOOTER_READ, footers

    wide = pa.table({f"column_{i:04d}": np.arange(3, dtype=np.float32) for i in range(600)})
    pq.write_table(wide, tmp_path / "wide.parquet")
    pq.write_table(wide.select(["column_0000"]), tmp_path / "narrow.parquet")
    whole = (tmp_path / "narrow.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(whole[: len(whole) // 2])
    paths = [tmp_path / f"{n}.parquet" for n in ("wide", "narrow", "cut")]
    files = [(str(p), p.stat().st_size) for p in paths]
    assert pq.read_metadata(tmp_path / "wide.parquet").serialized_size > FOOTER_READ  # two reads
    got = list(footers(files))
    assert got[0].num_columns == 600 and got[0].num_rows == 3
    assert got[0].schema.to_arrow_schema() == pq.read_schema(tmp_path / "wide.parquet")
    assert got[1].num_columns == 1
    assert isinstance(got[2], Exception)


def test_empty_source(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"data.source '.*empty/\*.parquet' matched no parquet file"):
        snapshot_source(cfg_for(tmp_path / "empty", tmp_path).data)


def test_a_file_without_rows_is_left_out_and_changes_nothing(raw_dir, tmp_path):
    """A day with no events (or a file still being written) holds no row: it was part of the data's fingerprint,
    so adding it encoded, trained and registered a twin of the last version. Left out, said; the same data."""
    cfg = cfg_for(raw_dir, tmp_path)
    before = snapshot_source(cfg.data)
    pl.read_parquet(raw_dir / "s-000.parquet").clear().write_parquet(raw_dir / "s-009.parquet")
    after = snapshot_source(cfg.data, before)
    assert after.fingerprint == before.fingerprint and after.files == before.files
    assert after.empty == [str(raw_dir / "s-009.parquet")]
    for f in raw_dir.glob("*.parquet"):
        pl.read_parquet(f).clear().write_parquet(f)
    with pytest.raises(DataError, match=r"none of the 5 file\(s\) has a row"):
        snapshot_source(cfg.data)


def test_encoding_is_fitted_on_train_only_and_shards_round_trip(raw_dir, tmp_path):
    cfg = cfg_for(raw_dir, tmp_path)
    snap, spec, out_dir, manifest = encode_all(cfg)
    # statistics come from the training rows only
    raw = pl.concat([pl.read_parquet(f.uri) for f in snap.files])
    train_keys = set()
    for info in manifest.shards_of("train"):
        train_keys |= set(pl.read_parquet(resolve(out_dir, info.keys_path))["sequence"].to_list())
    train_rows = raw.filter(pl.col("seq").is_in(list(train_keys)))
    assert spec.continuous[1].mean == pytest.approx(train_rows["y"].mean(), rel=1e-9)
    assert spec.continuous[1].mean != pytest.approx(raw["y"].mean(), rel=1e-9)
    assert sum(manifest.rows.values()) == raw.height
    assert all(manifest.windows[s] > 0 for s in ("train", "validation", "test"))
    # each shard's arrays decode back to the raw rows, sequences contiguous and ordered
    info = manifest.shards_of("train")[0]
    arrays = shard_arrays(manifest, out_dir, info)
    keys = pl.read_parquet(resolve(out_dir, info.keys_path))["sequence"].to_list()
    offsets = arrays["offsets"]
    for seg, key in enumerate(keys):
        rows = raw.filter(pl.col("seq") == key).sort("t")
        lo, hi = offsets[seg], offsets[seg + 1]
        # `t` counts up by one in each sequence: stored once per sequence, not once per row
        assert "order" not in arrays
        assert np.array_equal(arrays["order_start"][seg] + np.arange(hi - lo), rows["t"].to_numpy())
        expect_x = (rows["x"].to_numpy() - spec.continuous[0].mean) / spec.continuous[0].std
        assert np.allclose(arrays["cont"][lo:hi, 0], expect_x, atol=1e-5)
        kind_ids = {v: i + 1 for i, v in enumerate(spec.categorical[0].values)}
        assert arrays["cat"][lo:hi, 0].tolist() == [kind_ids[k] for k in rows["kind"].to_list()]
        assert arrays["cat"][lo:hi, 1].tolist() == [2 if f else 1 for f in rows["flag"].to_list()]
    # windows: K rows of history, target is the row after them
    starts = window_starts(offsets, 3, 1)
    assert len(starts) == info.windows == sum(max(0, offsets[i + 1] - offsets[i] - 3) for i in range(len(keys)))


def test_unseen_and_null_categories_get_id_zero(raw_dir, tmp_path):
    cfg = cfg_for(raw_dir, tmp_path)
    _, spec, _, _ = encode_all(cfg)
    df = pl.DataFrame(
        {
            "seq": ["q"] * 5,
            "t": [0, 1, 2, 3, 4],
            "x": [0.0, None, float("nan"), float("inf"), float("-inf")],
            "y": [1.0, 2.0, 3.0, 4.0, 5.0],
            "flag": [True, None, False, True, True],
            "kind": ["a", "zzz", None, "a", "a"],
            "label": ["a", "b", "c", "a", "a"],
        }
    )
    arrays, _ = encode_frame(prepare(df, "seq", "t", "mem"), spec)
    assert arrays["cat"][:, 0].tolist()[1:3] == [0, 0]
    assert arrays["cat"][:, 1].tolist() == [2, 0, 1, 2, 2]
    # null, NaN and infinite continuous values become the training mean: 0 after standardisation
    assert arrays["cont"][1:, 0].tolist() == [0.0, 0.0, 0.0, 0.0]


def test_target_with_nulls_names_file_and_column(raw_dir, tmp_path):
    df = pl.read_parquet(raw_dir / "s-003.parquet")
    df.with_columns(pl.when(pl.col("t") == 5).then(None).otherwise(pl.col("label")).alias("label")).write_parquet(
        raw_dir / "s-003.parquet"
    )
    df = pl.read_parquet(raw_dir / "s-001.parquet")
    df.with_columns(pl.when(pl.col("t") < 2).then(None).otherwise(pl.col("label")).alias("label")).write_parquet(
        raw_dir / "s-001.parquet"
    )
    # a row without its sequence (or its order) has no place: said the same way
    keyless = pl.read_parquet(raw_dir / "s-002.parquet")
    keyless.with_columns(pl.when(pl.col("t") == 0).then(None).otherwise(pl.col("seq")).alias("seq")).write_parquet(
        raw_dir / "s-002.parquet"
    )
    cfg = cfg_for(raw_dir, tmp_path)
    # every file with nulls is named, with its count, from the footers: before any row is encoded
    with pytest.raises(DataError) as e:
        encode_all(cfg)
    msg = str(e.value)
    assert "3 raw file(s) have rows without a value every row needs" in msg and "Fill or drop those rows" in msg
    assert "s-001.parquet: 6 null(s) in 'label' (the target)" in msg and "s-003.parquet: 3 null(s) in 'label'" in msg
    assert "s-002.parquet: 3 null(s) in 'seq' (data.sequence_key)" in msg
    assert not list(tmp_path.rglob("manifest*.json"))
    keyless.write_parquet(raw_dir / "s-002.parquet")

    # a file written without statistics: the encode finds the nulls in the values, naming file and column
    df.with_columns(pl.when(pl.col("t") < 2).then(None).otherwise(pl.col("label")).alias("label")).write_parquet(
        raw_dir / "s-001.parquet", statistics=False
    )
    for other in ("s-003.parquet",):
        pl.read_parquet(raw_dir / other).drop_nulls("label").write_parquet(raw_dir / other)
    with pytest.raises(DataError, match=r"s-001.parquet: the target column 'label' has 6 null value\(s\)"):
        encode_all(cfg)


@pytest.mark.parametrize("files_per_group", [1, 4])  # each file read alone; the files in one scan
def test_a_nan_or_an_infinite_regression_target_is_refused_naming_the_file_before_a_manifest(
    raw_dir, tmp_path, files_per_group
):
    """A NaN (not a null: the footers count none) or an infinite value in a regression target: refused at the
    encode, naming the file, the column and the count. It used to write a manifest whose target mean was NaN, and
    training then failed on it with a TypeError, or a pydantic error, from deep inside."""
    cfg = cfg_for(
        raw_dir,
        tmp_path,
        **{"data.target": {"column": "value", "task": "regression"}, "data.files_per_group": files_per_group},
    )
    nan_at = pl.col("t") == 7
    df = pl.read_parquet(raw_dir / "s-002.parquet")
    df.with_columns(pl.when(nan_at).then(float("nan")).otherwise(pl.col("value")).alias("value")).write_parquet(
        raw_dir / "s-002.parquet"
    )
    seqs = df["seq"].n_unique()
    with pytest.raises(DataError, match=rf"s-002.parquet: the target column 'value' has {seqs} NaN value\(s\); fill"):
        encode_all(cfg)
    df.with_columns(pl.when(nan_at).then(float("inf")).otherwise(pl.col("value")).alias("value")).write_parquet(
        raw_dir / "s-002.parquet"
    )
    with pytest.raises(DataError, match=rf"s-002.parquet: the target column 'value' has {seqs} infinite value\(s\)"):
        encode_all(cfg)
    assert not list(tmp_path.rglob("manifest*.json"))


def test_sequences_too_short_for_a_window_are_counted_per_split_and_said(raw_dir, tmp_path):
    """A sequence with fewer rows than data.window + data.horizon is in no window: its rows train and score nothing.
    The encode counts them per split, and says so (the train windows fell with nothing said)."""
    from shardline.tasks.encode import log_short_sequences

    df = pl.read_parquet(raw_dir / "s-001.parquet")
    cut = df["seq"].unique().sort()[0]
    df.filter((pl.col("seq") != cut) | (pl.col("t") < 2)).write_parquet(raw_dir / "s-001.parquet")
    cfg = cfg_for(raw_dir, tmp_path)
    manifest = encode_all(cfg)[3]
    short = [(s.split, s.short_segments, s.short_rows) for s in manifest.shards if s.short_segments]
    assert [(n, rows) for _, n, rows in short] == [(1, 2)], short
    said = []
    log_short_sequences(manifest, cfg.data, type("Log", (), {"warning": lambda self, *a: said.append(a[0] % a[1:])})())
    assert said == [
        "encode: sequences shorter than data.window + data.horizon = 4 rows are in no window, their rows in no "
        f"prediction or score: {short[0][0]} 1 (2 rows)"
    ]


def test_another_window_or_horizon_encodes_nothing_and_counts_its_own_windows(raw_dir, tmp_path):
    """A group's shards are the same bytes for any window and horizon, and id columns: trying another window, or
    keying predictions by a row id, finds every group in the group store (not one file written again) and its
    manifest counts that window's windows and short sequences, as an encode from nothing would (it encoded every
    group again)."""
    from shardline.tasks.encode import encode_dataset

    for f in raw_dir.glob("*.parquet"):
        pl.read_parquet(f).with_row_index("event_id").write_parquet(f)
    df = pl.read_parquet(raw_dir / "s-001.parquet")
    cut = df["seq"].unique().sort()[0]  # one sequence of 5 rows: in windows of 3 + 1, short for 5 + 2
    df.filter((pl.col("seq") != cut) | (pl.col("t") < 5)).write_parquet(raw_dir / "s-001.parquet")

    def encode(cfg, root):
        snap = snapshot_source(cfg.data)
        out = f"{root}/datasets/{dataset_id(snap, cfg.data)}"
        uri = encode_dataset(snap, cfg.data, out, threads=1, store=f"{root}/datasets/groups")
        keys = [group_key(g, cfg.data) for g in file_groups(snap, cfg.data)]
        return Manifest.model_validate_json(Path(uri).read_text()), keys, out

    def stored(root):
        return {p: p.stat().st_mtime_ns for p in (Path(root) / "datasets" / "groups").rglob("*") if p.is_file()}

    first, keys, _ = encode(cfg_for(raw_dir, tmp_path), tmp_path / "store")
    before = stored(tmp_path / "store")
    other = cfg_for(raw_dir, tmp_path, **{"data.window": 5, "data.horizon": 2, "data.id_columns": ["event_id"]})
    second, other_keys, out = encode(other, tmp_path / "store")
    assert other_keys == keys and stored(tmp_path / "store") == before  # every group found, nothing written
    fresh = encode(other, tmp_path / "fresh")[0]

    def counts(m):
        return [(s.path.split("/")[-1], s.windows, s.short_segments, s.short_rows) for s in m.shards]

    assert second.windows == fresh.windows != first.windows
    assert second.encoding.id_columns == ["event_id"] and second.encoding == fresh.encoding
    assert counts(second) == counts(fresh) != counts(first)
    assert sum(s.short_segments for s in second.shards) == 1 and not any(s.short_segments for s in first.shards)
    assert all(s.lengths is None for s in second.shards)  # the group's record holds them, not the manifest
    for s in second.shards:  # each as the trainer counts them, from the shard's own offsets
        local = shared_cache().get(resolve(out, s.path), s.sha256, s.bytes, s.compression, s.raw_bytes)
        assert len(window_starts(read_arrays(local, s.arrays)["offsets"], 5, 2)) == s.windows


def test_rows_read_twice_are_refused_naming_the_files_and_ties_of_the_order_are_kept(raw_dir, tmp_path):
    """A copy of a raw file beside it (a backup, a day uploaded twice): each row twice, interleaved with its copy in
    every window, was trained on silently. Refused, naming the files and the first repeated row; rows that only
    share their order value (two events at one instant, other values) are data, and encode. (Copies the encode reads
    in two file groups are not seen: each group is encoded on its own.)"""
    cfg = cfg_for(raw_dir, tmp_path, **{"data.files_per_group": 8})
    copy = raw_dir / "s-001-backup.parquet"
    copy.write_bytes((raw_dir / "s-001.parquet").read_bytes())
    with pytest.raises(DataError) as e:
        encode_all(cfg)
    said = str(e.value)
    assert "s-001-backup.parquet" in said and "s-001.parquet" in said, said
    assert "180 row(s) repeat another row whole" in said and "the first seq='s003' at t=0" in said, said
    assert "Remove the copies" in said
    pl.read_parquet(copy).head(5).with_columns(pl.col("x") + 1).write_parquet(copy)  # ties, not copies
    _, _, _, manifest = encode_all(cfg)
    assert sum(s.rows for s in manifest.shards) == 12 * 60 + 5


def test_split_without_test_windows_is_refused_before_the_manifest(raw_dir, tmp_path):
    cfg = cfg_for(
        raw_dir,
        tmp_path,
        **{
            "data.split": {
                "method": "range",
                "column": "season",
                "ranges": {"train": [2020, 2021], "validation": [2022, 2022], "test": [2030, None]},
            }
        },
    )
    with pytest.raises(DataError, match=r"leaves test with no window"):
        encode_all(cfg)
    # nothing that a later run would take as a complete data set
    assert not list((tmp_path / "store").rglob("manifest.json"))

    # every row its own sequence, window 1: the horizon is what no sequence has room for, and the message says so
    # with the rows and sequences (it told the user to shorten a window of 1)
    for path in raw_dir.glob("*.parquet"):
        df = pl.read_parquet(path)
        df.with_columns((pl.col("seq") + "-" + pl.col("t").cast(pl.String)).alias("row_id")).write_parquet(path)
    cfg = cfg_for(raw_dir, tmp_path, **{"data.sequence_key": "row_id", "data.window": 1})
    said = r"train: \d[\d,]* row\(s\) in \d[\d,]* sequence\(s\).*a window takes data.window=1 \+ data.horizon=1 = 2 "
    with pytest.raises(DataError, match=said + r"row\(s\) of one sequence.*shorten data.window or data.horizon"):
        encode_all(cfg)


def test_range_split_follows_values(raw_dir, tmp_path):
    cfg = cfg_for(
        raw_dir,
        tmp_path,
        **{
            "data.split": {
                "method": "range",
                "column": "season",
                "ranges": {"train": [None, 2021], "validation": [2022, 2022], "test": [2023, None]},
            }
        },
    )
    snap, spec, out_dir, manifest = encode_all(cfg)
    per_split = {s: manifest.rows[s] for s in manifest.rows}
    assert per_split == {"train": 6 * 60, "validation": 3 * 60, "test": 3 * 60}


@pytest.mark.parametrize("column", ["day", "stamp"])
def test_range_split_on_dates_and_tz_aware_datetimes_with_yaml_date_bounds(raw_dir, tmp_path, column):
    """Bounds written as YAML dates (as a user writes them) split a date column and a time-zone-aware
    datetime column; the config file goes through the loader, which used to turn dates into text."""
    import datetime as dt

    import yaml

    from shardline.core.config import load_config

    for path in raw_dir.glob("*.parquet"):
        df = pl.read_parquet(path)
        day = pl.date(pl.col("season").cast(pl.Int32), 6, 1)
        df.with_columns(
            day.alias("day"), day.cast(pl.Datetime("us")).dt.replace_time_zone("UTC").alias("stamp")
        ).write_parquet(path)
    raw = tiny_config(str(raw_dir / "*.parquet"), str(tmp_path / "store"))
    raw["data"]["split"] = {
        "method": "range",
        "column": column,
        "ranges": {
            "train": [None, dt.date(2021, 12, 31)],
            "validation": [dt.date(2022, 1, 1), dt.date(2022, 12, 31)],
            "test": [dt.date(2023, 1, 1), None],
        },
    }
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(raw))
    assert "2021-12-31" in (tmp_path / "c.yaml").read_text()  # a YAML date, not a quoted string
    cfg = load_config(tmp_path / "c.yaml")
    snap, spec, out_dir, manifest = encode_all(cfg)
    assert manifest.rows == {"train": 6 * 60, "validation": 3 * 60, "test": 3 * 60}

    bad = load_config(tmp_path / "c.yaml", ["data.split.ranges.test=[soon, null]"])
    with pytest.raises(DataError, match=r"data.split.ranges.test: bound 'soon' is not a date"):
        encode_all(bad)


def test_a_day_as_a_range_splits_upper_bound_covers_the_whole_day_of_a_date_time_column(raw_dir, tmp_path):
    """`validation: [2022-06-01, 2022-06-01]` over events stamped through the day: the whole day, as a user means it
    (a week `[.., 2022-06-07]` ends at the 7th's last instant, not its first). It held only the day's midnight, and
    the rest of the day fell in no split: out of the data, without a word. A bound with a time is that instant."""
    for path in raw_dir.glob("*.parquet"):
        df = pl.read_parquet(path)
        day = pl.datetime(pl.col("season").cast(pl.Int32), 6, 1, time_zone="Europe/Paris")
        df.with_columns((day + pl.duration(minutes=pl.col("t") * 20)).alias("stamp")).write_parquet(path)
    ranges = {"train": [None, "2021-06-01"], "validation": ["2022-06-01", "2022-06-01"], "test": ["2023-06-01", None]}
    split = {"method": "range", "column": "stamp", "ranges": ranges}
    manifest = encode_all(cfg_for(raw_dir, tmp_path / "days", **{"data.split": split}))[3]
    assert manifest.rows == {"train": 6 * 60, "validation": 3 * 60, "test": 3 * 60}  # 60 rows a day: every one
    ranges["validation"] = ["2022-06-01", "2022-06-01T10:00:00"]  # an instant: 00:00 to 10:00, its 31 rows a sequence
    manifest = encode_all(cfg_for(raw_dir, tmp_path / "instant", **{"data.split": split}))[3]
    assert manifest.rows == {"train": 6 * 60, "validation": 3 * 31, "test": 3 * 60}
    # the rows in no range are counted in the groups' records (the encode's log says how many were left out)
    records = [json.loads(p.read_text()) for p in (tmp_path / "instant").rglob("group.json")]
    assert sum(r["outside"] for r in records) == 3 * 29 and len(records) == 2


@pytest.mark.parametrize("codec", ["lz4", "zstd"])
def test_stored_shards_hold_exactly_the_compressed_bytes(raw_dir, tmp_path, codec):
    """A compressed shard's file is the codec's output and nothing more: the manifest's `bytes`,
    smaller than the unpacked size, unpacking to exactly `raw_bytes` and byte for byte what the
    codec makes of those (a compressed buffer's memory view spans its capacity, not its size:
    writing that view would pad the file with whatever the capacity held)."""
    import pyarrow as pa

    from shardline.core.shards import ZSTD_LEVEL

    cfg = cfg_for(raw_dir, tmp_path, **{"data.shard_compression": codec})
    _, _, out_dir, manifest = encode_all(cfg)
    make = pa.Codec(codec, ZSTD_LEVEL) if codec == "zstd" else pa.Codec(codec)
    for info in manifest.shards:
        stored = open(resolve(out_dir, info.path), "rb").read()
        assert info.compression == codec and info.path.endswith({"lz4": ".lz4", "zstd": ".zst"}[codec])
        assert len(stored) == info.bytes < info.raw_bytes
        unpacked = pa.Codec(codec).decompress(stored, decompressed_size=info.raw_bytes, asbytes=True)
        assert len(unpacked) == info.raw_bytes
        assert stored == make.compress(unpacked, asbytes=True)


def test_manifest_verification_rejects_missing_shard(raw_dir, tmp_path):
    from shardline.core import storage

    cfg = cfg_for(raw_dir, tmp_path)
    _, _, out_dir, manifest = encode_all(cfg)
    uri = f"{out_dir}/manifest.json"
    storage.write_text(uri, manifest.model_dump_json())
    assert verify_manifest(uri, deep=True) is not None
    Path(resolve(out_dir, manifest.shards[0].path)).unlink()
    assert verify_manifest(uri) is None
    assert Manifest.model_validate(json.loads(storage.read_text(uri))).shards  # the manifest itself is intact


def test_training_refuses_shards_encoded_for_another_config(raw_dir, tmp_path):
    from shardline.core import storage
    from shardline.runs.training_run import load_manifest

    cfg = cfg_for(raw_dir, tmp_path)
    _, _, out_dir, manifest = encode_all(cfg)
    uri = f"{out_dir}/manifest.json"
    storage.write_text(uri, manifest.model_dump_json())
    assert load_manifest(uri, cfg).encoding_hash == manifest.encoding_hash
    other = cfg_for(
        raw_dir,
        tmp_path,
        **{"data.window": 4, "data.features": {"continuous": ["x"], "boolean": ["flag"], "categorical": ["kind"]}},
    )
    with pytest.raises(ValueError) as e:
        load_manifest(uri, other)
    msg = str(e.value)
    assert "data.window: the shards were encoded with 3, the config says 4" in msg
    assert "data.continuous: the shards were encoded with ['x', 'y'], the config says ['x']" in msg


def test_stored_order_keeps_every_value(tmp_path):
    """`order` stored per sequence only when it counts up by one inside each sequence."""
    from shardline.core.encoding.group import order_arrays
    from shardline.trainer.data import ShardView

    def compact(arrays):  # a shard's arrays as the encode stores them
        return {**{k: a for k, a in arrays.items() if k != "order"}, **order_arrays(arrays["order"], arrays["offsets"])}

    base = {
        "cont": np.zeros((6, 1), np.float32),
        "cat": np.zeros((6, 1), np.int8),
        "target": np.arange(6, dtype=np.uint8) % 5,
        "offsets": np.array([0, 3, 6], np.int64),
    }
    steady = compact({**base, "order": np.array([7, 8, 9, 0, 1, 2], np.int64)})
    assert "order" not in steady and steady["order_start"].tolist() == [7, 0]
    assert ShardView(steady, 1, 0).order_of_rows(np.arange(6)).tolist() == [7, 8, 9, 0, 1, 2]
    gappy = compact({**base, "order": np.array([7, 8, 10, 0, 1, 2], np.int64)})
    assert "order_start" not in gappy and gappy["order"].tolist() == [7, 8, 10, 0, 1, 2]


def _awkward_raw(folder, n_files=4, seqs=3, rows=40, seed=7):
    """Files whose values differ per file (so each group's own codes differ from the data set's):
    nulls, NaN and infinite values in continuous columns, null booleans, null and unseen string categories, a narrow
    and a wide integer categorical, an integer target that is also a feature, a large-offset column."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for j in range(n_files):
        frames = []
        for i in range(seqs):
            n = rows
            x = rng.normal(loc=j, size=n).astype(np.float32)
            x[rng.random(n) < 0.1] = np.nan
            x[i] = (np.inf, -np.inf, np.nan)[i % 3]  # an infinite value is missing too (a sensor's 1/0)
            frames.append(
                pl.DataFrame(
                    {
                        "seq": [f"f{j}s{i}"] * n,
                        "t": np.arange(n, dtype=np.int64) * 3,  # not consecutive: stored per row
                        "x": pl.Series(x).to_list(),
                        "far": (1e6 + rng.normal(scale=0.01, size=n)),  # far from zero, tiny spread
                        "count": rng.integers(0, 5 + j, size=n, dtype=np.int32),  # continuous from integers
                        "flag": [None if v < 0.1 else bool(v > 0.5) for v in rng.random(n)],
                        "kind": [None if v < 0.05 else f"k{int(v * (3 + j))}" for v in rng.random(n)],
                        "small": rng.integers(-3 + j, 4 + j, size=n, dtype=np.int8),
                        "wide": rng.choice(
                            np.array([10**6, 10**6 + 70_000 * (j + 1), -5, 123_456], dtype=np.int64), size=n
                        ),
                        "act": rng.integers(100 * j, 100 * j + 30, size=n, dtype=np.int16),
                    }
                )
            )
        pl.concat(frames).with_columns(pl.col("x").cast(pl.Float32)).write_parquet(folder / f"w-{j:02d}.parquet")


@pytest.mark.parametrize("dtype,task", [("float16", "classification"), ("float32", "regression")])
def test_one_pass_shards_equal_the_direct_encoding(tmp_path, dtype, task, monkeypatch):
    """The encode reads each group once and stores it in the group's own codes; mapped to the data
    set's encoding (as readers do, here 6 rows at a time), every shard equals encoding its rows
    directly with the fitted spec: categorical ids, booleans and the target exactly, continuous values
    to within one rounding of the stored type."""
    monkeypatch.setattr(codes, "CHUNK_BYTES", 256)
    _awkward_raw(tmp_path / "raw")
    target = (
        {"column": "act", "task": "classification"}
        if task == "classification"
        else {"column": "far", "task": "regression"}
    )
    cfg = validate_config(
        tiny_config(
            str(tmp_path / "raw" / "*.parquet"),
            str(tmp_path / "store"),
            **{
                "data.features": {
                    "continuous": ["x", "far", "count"],
                    "boolean": ["flag"],
                    "categorical": ["kind", "small", "wide", "act"],
                },
                "data.target": target,
                "data.files_per_group": 1,
                "data.continuous_dtype": dtype,
                "data.split.fractions": {"train": 0.5, "validation": 0.25, "test": 0.25},
            },
        )
    )
    snap, spec, out_dir, manifest = encode_all(cfg)
    by_group: dict[str, set[str]] = {}
    for s in manifest.shards:
        by_group.setdefault(s.path.rsplit("/", 1)[0], set()).add(json.dumps(s.local.model_dump(), sort_keys=True))
    assert all(len(v) == 1 for v in by_group.values())  # a group's shards share the group's codes
    assert len(set.union(*by_group.values())) == len(by_group) == 4  # and each group has its own
    # written once per group (a shard names its group's by number), read back as one object per group
    written = json.loads(manifest.model_dump_json())
    assert len(written["codes"]) == 4 and not any("local" in s for s in written["shards"])
    again = Manifest.model_validate(written)
    assert again.model_dump() == manifest.model_dump() and again.hash() == manifest.hash()
    assert len({id(s.local) for s in again.shards}) == 4
    inline = {k: v for k, v in written.items() if k != "codes"}  # an earlier manifest: codes in every shard
    inline["shards"] = [
        {**{k: v for k, v in s.items() if k != "codes"}, "local": written["codes"][s["codes"]]}
        for s in written["shards"]
    ]
    assert Manifest.model_validate(inline).model_dump() == manifest.model_dump()
    written["shards"][0]["codes"] = 9
    with pytest.raises(ValueError, match=r"names codes 9, but 4 are listed"):
        Manifest.model_validate(written)
    raw = pl.concat([prepare(pl.read_parquet(f.uri), "seq", "t", f.uri) for f in snap.files])
    tol = 2e-3 if dtype == "float16" else 1e-5
    checked = 0
    for info in manifest.shards:
        got = shard_arrays(manifest, out_dir, info)
        keys = pl.read_parquet(resolve(out_dir, info.keys_path))["sequence"].to_list()
        rows = raw.filter(pl.col("__seq").is_in(keys))
        want, want_keys = encode_frame(rows, spec)
        assert want_keys == keys
        assert np.array_equal(got["offsets"], want["offsets"])
        assert np.array_equal(got["order"], want["order"])
        assert np.array_equal(got["cat"], want["cat"]), info.path
        assert got["cat"].dtype == want["cat"].dtype
        if task == "classification":
            assert np.array_equal(got["target"], want["target"])
        else:
            assert np.allclose(got["target"], want["target"], atol=1e-4)
        err = np.abs(got["cont"].astype(np.float64) - want["cont"].astype(np.float64))
        scale = np.maximum(1.0, np.abs(want["cont"].astype(np.float64)))
        assert (err / scale).max() <= tol, (info.path, float((err / scale).max()))
        assert got["cont"].dtype == want["cont"].dtype
        checked += len(keys)
    assert checked == 12
    # unseen categories in validation/test map to 0, never to another class's id
    assert 0 in np.concatenate([shard_arrays(manifest, out_dir, s)["cat"][:, 0] for s in manifest.shards])


def test_encode_leaves_torch_threads_as_they_were(raw_dir, tmp_path):
    """The encode runs torch single-threaded (its groups are its parallelism), then gives the
    process its thread count back: training after an encode in the same process uses every core."""
    import threading

    import torch

    from shardline.tasks.encode import encode_dataset

    cfg = cfg_for(raw_dir, tmp_path)
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        encode_dataset(snapshot_source(cfg.data), cfg.data, str(tmp_path / "enc"), threads=2)
        seen = []
        t = threading.Thread(target=lambda: seen.append(torch.get_num_threads()))
        t.start()
        t.join()
        assert torch.get_num_threads() == 3 and seen == [3]
    finally:
        torch.set_num_threads(before)


def test_an_encode_stays_single_threaded_when_another_ends_beside_it():
    """A thread that starts encoding while another encode runs keeps torch at one thread when that
    other one ends and gives the process its count back. (Its count used to be taken lazily from the
    process default at its first torch call, after its own set to 1: a group then summed its columns
    on several threads, in another order, and its shards' bytes depended on what ran beside it.)"""
    import threading

    import torch

    from shardline.core.encoding.group import one_torch_thread

    first_in, second_in, first_out = threading.Event(), threading.Event(), threading.Event()
    seen = []

    def first():
        with one_torch_thread():
            first_in.set()
            second_in.wait(10)
        first_out.set()

    def second():  # a new thread, entering while `first` encodes
        first_in.wait(10)
        with one_torch_thread():
            second_in.set()
            first_out.wait(10)
            seen.append(torch.get_num_threads())

    before = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        threads = [threading.Thread(target=first), threading.Thread(target=second)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        torch.set_num_threads(before)
    assert seen == [1]


@pytest.mark.parametrize("workers", [1, 2])
def test_encode_flow_holds_at_most_encode_workers_groups_at_once(raw_dir, tmp_path, prefect_api, workers):
    """Memory is bounded by the group size: the flow never runs more than data.encode_workers
    encode tasks at once, however many groups the data set has (read back from the Prefect API)."""
    from prefect import flow

    from shardline.tasks.encode import encode
    from tests.conftest import recorded_task_runs

    make_raw(raw_dir, n_seq=12, prefix="more", seed=3)
    cfg = cfg_for(raw_dir, tmp_path, **{"data.files_per_group": 1, "data.encode_workers": workers})
    snap = snapshot_source(cfg.data)

    @flow(name=f"encode-only-{workers}")
    def encode_only():
        from prefect.runtime import flow_run

        return encode(snap, cfg.data, cfg.storage.root)[0], flow_run.id

    uri, run_id = encode_only()
    assert verify_manifest(uri) is not None

    recorded = recorded_task_runs(run_id, "encode-group", count=len(snap.files))
    runs = [r for r in recorded if r.name.startswith("encode-group")]
    assert len(runs) == len(snap.files) == 8 and all(r.state.is_completed() for r in runs)
    spans = sorted((r.start_time, r.end_time) for r in runs)
    most = max(sum(1 for a, b in spans if a <= t < b) for t, _ in spans)
    assert most <= workers
    if workers == 1:  # one at a time: each starts after the previous ended
        assert all(spans[i][0] >= spans[i - 1][1] for i in range(1, len(spans)))


@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.int32, np.int64])
def test_ids_set_in_any_row_type(dtype):
    """id = value - shift in the shard's id type, for negative values and shifts too (an int16 row
    holds a narrow column beside a wide one)."""
    from shardline.core.encoding.group import _set_ids

    rng = np.random.default_rng(0)
    for src, shift in [(np.int8, -6), (np.int16, -101), (np.uint32, -1), (np.int64, 1000), (np.int64, 0)]:
        hi = min(int(np.iinfo(src).max), shift + min(int(np.iinfo(dtype).max), 200))
        values = rng.integers(max(shift, int(np.iinfo(src).min)), hi + 1, 50).astype(src)
        ids = values.astype(np.int64) - shift
        row = np.empty(50, dtype)
        _set_ids(row, values, shift)
        assert row.tolist() == ids.tolist(), (dtype, src, shift)


@pytest.mark.parametrize("span", [10**6, 10**12], ids=["dense", "sparse"])
def test_a_group_of_integer_ids_keeps_its_vocabulary_packed(span):
    """A click log's user ids: each group's own vocabulary of them was a JSON list of texts in the manifest (a 12M-row
    log's manifest: 62 MB, 29 MB of it these). They are packed (zlib of int64 differences, base64) and read back as
    the same texts in the same order, negative values and a span past int64's half included; a manifest written
    before (texts) still reads."""
    from shardline.core.encoding.group import _local_ids
    from shardline.core.manifest import LocalVocab

    rng = np.random.default_rng(0)
    values = np.unique(rng.integers(-span, span, 20_000))
    column = pl.Series("user_id", rng.choice(values, 50_000)).append(pl.Series([None], dtype=pl.Int64))
    column = column.append(pl.Series(values))  # every value present
    voc, x, shift = _local_ids(column, column.min(), column.max())
    assert voc.ints is not None and voc.values is None and voc.size == len(values)
    assert voc.texts() == [str(v) for v in values.tolist()]
    ids = np.asarray(x) - shift
    assert ids[50_000] == 0 and [voc.texts()[i - 1] for i in ids[:5]] == [str(v) for v in column[:5].to_list()]
    again = LocalVocab.model_validate_json(voc.model_dump_json())
    as_texts = LocalVocab(size=voc.size, values=voc.texts())
    assert again.texts() == voc.texts() and len(voc.model_dump_json()) < len(as_texts.model_dump_json()) / 2
    assert LocalVocab.of_ints(np.array([-(2**62), 2**62])).texts() == [str(-(2**62)), str(2**62)]  # wraps back
    assert LocalVocab(size=2, values=["7", "9"]).texts() == ["7", "9"]
    # the group's value counts of them are packed too (~150 bytes a value as a dict), and add up as the texts' did
    from shardline.core.encoding.fit import merged_counts
    from shardline.core.encoding.group import _counts_of

    counted = _counts_of(ids.astype(np.int64), voc)
    truth = column.drop_nulls().cast(pl.Utf8).value_counts()
    want = dict(zip(truth[truth.columns[0]].to_list(), truth["count"].to_list()))
    assert set(counted) == {"ints", "counts"} and len(json.dumps(counted)) < len(json.dumps(want)) / 2
    assert merged_counts([counted, counted, {"5": 1}]) == {k: 2 * n + (k == "5") for k, n in want.items()} | (
        {} if "5" in want else {"5": 1}
    )


@pytest.mark.parametrize("sequence_key,window", [("@file", 3), (None, 1)], ids=["by-file", "no-sequence"])
def test_a_file_sequence_splits_the_same_wherever_the_raw_files_lie(tmp_path, sequence_key, window):
    """With a file as the sequence (`@file`, or no sequence key), a row's split is a seeded hash of the
    file's name below the source's folder (`2024/s-000.parquet`), not of where the files lie: the same
    files in another folder (another machine's mount, a copy) give the same shards, row for row."""
    from shardline.core.encoding.read import sequence_name

    shards = []
    for where in ("a/raw", "b/elsewhere/raw"):
        make_raw(tmp_path / where / "2024", n_seq=27, rows=40)
        cfg = validate_config(
            tiny_config(
                str(tmp_path / where / "**" / "*.parquet"),
                str(tmp_path / where / "store"),
                **{"data.sequence_key": sequence_key, "data.window": window},
            )
        )
        snap = snapshot_source(cfg.data)
        assert sequence_name(snap.files[0].uri, cfg.data) == "2024/s-000.parquet"
        shards.append([(s.split, s.rows, s.sha256) for s in encode_all(cfg)[3].shards])
    assert shards[0] == shards[1]
    assert {split for split, rows, _ in shards[0] if rows} == {"train", "validation", "test"}


def test_files_that_gained_a_column_or_a_wider_type_are_still_read_in_one_scan(raw_dir, tmp_path):
    """A data lake's schema evolution: the later files hold a column the config does not name, and wider types
    (a float64 feature that was float32, an int64 order that was int32). A group of them is still read in one scan,
    the same rows as file by file (the scan failed, and the group was read file by file: 7x slower on 100 small
    files)."""
    from shardline.core.encoding.read import _scan_local, read_raw

    paths = sorted(raw_dir.glob("*.parquet"))
    for p in paths[2:]:
        later = pl.read_parquet(p).with_columns(pl.lit(1.5).alias("new_metric"))
        later.with_columns(pl.col("x").cast(pl.Float64), pl.col("t").cast(pl.Int64)).write_parquet(p)
    cfg = cfg_for(raw_dir, tmp_path)
    for uris in ([str(p) for p in paths], [str(p) for p in paths[::-1]]):  # the new column's files last, or first
        scanned = _scan_local(uris, cfg.data)
        assert scanned is not None and "new_metric" not in scanned.columns
        by_file = pl.concat([read_raw(u, cfg.data) for u in uris], how="vertical_relaxed")
        assert scanned.equals(by_file) and scanned.schema["x"] == pl.Float64 and scanned.schema["t"] == pl.Int64


@pytest.mark.parametrize("per_group", [1, 2])
def test_hive_style_folders_are_columns_as_if_written_into_the_files(raw_dir, tmp_path, per_group):
    """`season=2020/region=eu/part-0.parquet`: the folder names below data.source's folder are columns, typed as
    polars types hive partitions, and encode to the very shards of the same values written into the files (one
    file a group: read file by file; two: the group's one scan). A file holding the column itself is read from it.
    Predict's input, registration's sample and the rehearsal's copies take them the same way."""
    from shardline.app.predict_input import read_input
    from shardline.app.rehearse import copy_sample
    from shardline.core.encoding.read import _scan_local, read_group
    from shardline.tasks.ingest import raw_sample

    flat, hive = tmp_path / "flat", tmp_path / "hive"
    flat.mkdir()
    for j, f in enumerate(sorted(raw_dir.glob("*.parquet"))):
        df = pl.read_parquet(f).drop("season")
        region = ["eu", "us"][j % 2]
        df.with_columns(pl.lit(2020 + j, pl.Int64).alias("season"), pl.lit(region).alias("region")).write_parquet(
            flat / f"s-{j}.parquet"
        )
        (hive / f"season={2020 + j}" / f"region={region}").mkdir(parents=True)
        df.write_parquet(hive / f"season={2020 + j}" / f"region={region}" / "part-0.parquet")
    over = {
        "data.split": {
            "method": "range",
            "column": "season",
            "ranges": {"train": [None, 2021], "validation": [2022, 2022], "test": [2023, None]},
        },
        "data.files_per_group": per_group,
    }
    manifests = []
    for source in (str(flat / "*.parquet"), str(hive)):
        raw = tiny_config(source, str(tmp_path / f"store-{len(manifests)}"), **over)
        raw["data"]["features"]["categorical"] = ["kind", "region"]
        cfg = validate_config(raw)
        manifests.append((*encode_all(cfg), cfg))
    (_, flat_spec, flat_out, flat_m, _), (snap, spec, out, m, cfg) = manifests
    assert m.rows == flat_m.rows == {"train": 6 * 60, "validation": 3 * 60, "test": 3 * 60}
    assert spec == flat_spec and spec.categorical[1].values == ["eu", "us"]
    for split in m.rows:
        for a, b in zip(m.shards_of(split), flat_m.shards_of(split), strict=True):
            got, want = shard_arrays(m, out, a), shard_arrays(flat_m, flat_out, b)
            assert sorted(got) == sorted(want) and all(np.array_equal(got[k], want[k]) for k in got), split

    # typed as polars types them; a file holding the column itself keeps its own values
    first = snap.files[0]
    frame = read_group([first], cfg.data)
    assert frame.schema["season"] == pl.Int64 and frame["region"].unique().to_list() == ["eu"]
    scanned = _scan_local([f.uri for f in snap.files], cfg.data)  # the fast path takes them too
    assert scanned is not None and scanned["region"].to_list() == (["eu"] * 180 + ["us"] * 180) * 2
    assert scanned["season"].to_list() == [s for s in range(2020, 2024) for _ in range(180)]
    own = Path(first.uri)
    pl.read_parquet(own).with_columns(pl.lit("zz").alias("region")).write_parquet(own)
    assert read_group([first], cfg.data)["region"].unique().to_list() == ["zz"]
    assert snapshot_source(cfg.data).files[0].uri == first.uri  # accepted by the footer check either way

    # predict reads them (a folder of them, or one file below it), registration's sample too
    got = read_input(str(hive))
    assert got.height == 12 * 60 and sorted(got["region"].unique().to_list()) == ["eu", "us", "zz"]
    assert got.schema["season"] == pl.Int64 and sorted(got["season"].unique().to_list()) == [2020, 2021, 2022, 2023]
    from mlflow.types import ColSpec, Schema

    schema = Schema([ColSpec("double", "x"), ColSpec("string", "region"), ColSpec("long", "season")])
    one = read_input(snap.files[1].uri, schema)  # one file named inside the layout: the folders above it count
    assert one["region"].unique().to_list() == ["us"] and one["season"].unique().to_list() == [2021]
    sample = raw_sample(snap.files[1].uri, ["x", "region", "season"], rows=3, source=cfg.data.source)
    assert sample["region"].tolist() == ["us"] * 3 and sample["season"].tolist() == [2021] * 3
    # the rehearsal's copies keep their folders (the same file name in four folders: four files)
    copied = copy_sample(cfg, str(tmp_path / "rehearsal"), 4)
    assert len(set(copied)) == 4 and all("/raw/season=" in c for c in copied)


def test_a_null_folder_beside_numbers_is_a_null_of_their_type(raw_dir, tmp_path):
    """`zone=__HIVE_DEFAULT_PARTITION__` (Spark's and Hive's null) beside `zone=1`, `zone=2`: the folder is a null
    integer, not text that the ingest refused as a category written two ways; both read paths give the same."""
    from shardline.core.encoding.read import _scan_local, read_group

    hive = tmp_path / "hive"
    zones = ["1", "2", "__HIVE_DEFAULT_PARTITION__", "3"]
    for j, f in enumerate(sorted(raw_dir.glob("*.parquet"))):
        (hive / f"zone={zones[j]}").mkdir(parents=True)
        pl.read_parquet(f).write_parquet(hive / f"zone={zones[j]}" / "part-0.parquet")
    raw = tiny_config(str(hive), str(tmp_path / "store"))
    raw["data"]["features"]["categorical"] = ["kind", "zone"]
    cfg = validate_config(raw)
    snap, spec, _, m = encode_all(cfg)  # the ingest's footer checks, then the encode
    assert sorted(spec.categorical[1].values) == ["1", "2", "3"] and sum(m.rows.values()) == 4 * 180
    uris = [f.uri for f in snap.files]
    scanned = _scan_local(uris, cfg.data)
    one_by_one = pl.concat([read_group([f], cfg.data) for f in snap.files], how="vertical_relaxed")
    assert scanned is not None and scanned.schema["zone"] == one_by_one.schema["zone"] == pl.Int64
    assert (
        scanned["zone"].to_list() == one_by_one["zone"].to_list() == [z for z in (1, 2, 3, None) for _ in range(180)]
    )  # by path


def test_a_file_damaged_inside_is_refused_or_with_skip_left_out_and_listed(tmp_path):
    """A file damaged inside (its footer intact) passes the ingest's footer checks. With data.on_bad_file: fail the
    encode refuses it, saying it is damaged and what to do; with skip it is left out (the group's other files
    encoded, a group of it alone empty) and listed in the manifest, and the run's snapshot lists it among the skipped
    files; a data set encoded so is refused by a run that says fail (a data set's address does not hold
    on_bad_file). A damaged first file, whose rows the ingest samples, is said there or passed over alike."""
    from shardline.core.encoding.columns import DamagedFile
    from shardline.core.storage import write_text
    from shardline.tasks.encode import without_damaged
    from shardline.tasks.ingest import check_registrable

    raw_dir = tmp_path / "raw"
    make_raw(raw_dir, n_seq=30)  # 10 files of 3 sequences
    whole = sum(encode_all(cfg_for(raw_dir, tmp_path / "whole"))[3].rows.values())
    for name in ("s-002.parquet", "s-000.parquet"):
        path = raw_dir / name
        body = bytearray(path.read_bytes())
        body[200:1200] = bytes(b ^ 0x5A for b in body[200:1200])
        path.write_bytes(bytes(body))
    fail = cfg_for(raw_dir, tmp_path, **{"data.files_per_group": 1})
    snap = snapshot_source(fail.data)
    assert len(snap.files) == 10  # the footers read
    with pytest.raises(
        DamagedFile, match=r"(?s)s-002\.parquet: cannot read columns .* damaged .* data.on_bad_file: skip"
    ):
        encode_group_to_shards(snap.files[2:3], fail.data, str(tmp_path / "groups"), "g")
    with pytest.raises(DamagedFile, match=r"(?s)s-000\.parquet: cannot read its first rows: .* damaged"):
        check_registrable(fail.data, snap)

    for per_group in (1, None):  # each file a group (one of nothing), and the ten in one group (the scan fails)
        skip = cfg_for(
            raw_dir, tmp_path / f"skip{per_group}", **{"data.on_bad_file": "skip", "data.files_per_group": per_group}
        )
        check_registrable(skip.data, snap)  # its sample from the first file that reads
        snap, _, out_dir, manifest = encode_all(skip)
        assert [(r.uri.rsplit("/", 1)[-1], r.reason.split(":")[0]) for r in manifest.skipped] == [
            ("s-000.parquet", "damaged"),
            ("s-002.parquet", "damaged"),
        ]
        assert sum(manifest.rows.values()) == whole - 2 * 3 * 60  # the others' rows, all of them
        uri = f"{out_dir}/manifest.json"
        write_text(uri, manifest.model_dump_json())
        seen = without_damaged(snap, uri, skip.data)
        assert [f.uri for f in seen.files] == [f.uri for f in snap.files if f.uri not in {r.uri for r in seen.rejected}]
        assert len(seen.files) == 8
        assert [r.uri for r in seen.rejected] == [r.uri for r in manifest.skipped]
        with pytest.raises(
            DataError, match=r"(?s)2 raw file\(s\) are damaged inside .*s-000\.parquet.*on_bad_file: skip"
        ):
            without_damaged(snap, uri, fail.data)
    # a manifest that left nothing out keeps the hash it had before manifests could list skipped files
    clean = Manifest.model_validate_json(manifest.model_dump_json()).model_copy(update={"skipped": []})
    from shardline.core.config import stable_hash

    before = {"skipped", "tokenizer", "token_counts"}  # none of them in a manifest of numbers, then
    assert clean.hash() == stable_hash(clean.model_dump(mode="json", exclude=before)) != manifest.hash()


def test_a_jobs_unfinished_output_and_markers_below_the_source_are_not_data(tmp_path):
    """A Spark job's output folder: its part files are the data; `_SUCCESS`, `.crc` files, a `_temporary/` folder of
    a job still writing (half-written parts) and a `.staging/` copy are not (as pyarrow's and Spark's readers take
    them). They made the ingest stop on the half-written part. A source that names such a folder itself reads it."""
    from shardline.core.listing import list_source

    out = tmp_path / "lake" / "_exports" / "out"  # a folder above the source's named so is no concern
    made = make_raw(tmp_path / "made", n_seq=9)
    for i, p in enumerate(made):
        (out / "day=1").mkdir(parents=True, exist_ok=True)
        (out / "day=1" / f"part-{i:05d}.snappy.parquet").write_bytes(p.read_bytes())
        (out / "day=1" / f".part-{i:05d}.snappy.parquet.crc").write_bytes(b"crc")
    (out / "_SUCCESS").write_bytes(b"")
    (out / "_temporary" / "0" / "task_1").mkdir(parents=True)
    (out / "_temporary" / "0" / "task_1" / "part-00009.snappy.parquet").write_bytes(made[0].read_bytes()[:300])
    (out / ".staging").mkdir()
    (out / ".staging" / "part-00010.parquet").write_bytes(made[1].read_bytes())
    parts = [str(out / "day=1" / f"part-{i:05d}.snappy.parquet") for i in range(3)]
    for source in (out, f"{out}/**/*.parquet", f"{out}/day=1"):
        assert list_source(str(source)) == parts, source
        cfg = cfg_for(out, tmp_path / "store", **{"data.source": str(source), "data.on_bad_file": "fail"})
        assert [f.uri for f in snapshot_source(cfg.data).files] == parts  # nothing half-written stops the ingest
    assert list_source(f"{out}/_temporary/**/*.parquet") == [str(out / "_temporary/0/task_1/part-00009.snappy.parquet")]
    assert list_source(f"{out}/.staging") == [str(out / ".staging" / "part-00010.parquet")]
    # a Hive or Athena table's files have no extension: a folder's listing takes them, and .parq/.pq, as parquet
    (out / "day=2").mkdir()
    for name in ("000000_0", "20260101_120000_00012_abcde_1f2e", "part-1.parq", "notes.txt"):
        (out / "day=2" / name).write_bytes(made[2].read_bytes())
    taken = [str(out / "day=2" / n) for n in ("000000_0", "20260101_120000_00012_abcde_1f2e", "part-1.parq")]
    assert list_source(f"{out}/day=2") == taken and list_source(str(out)) == parts + taken
    shutil.rmtree(out / "day=2")
    # a Delta Lake table's folder holds every version's files: refused, saying why and what to do
    (out / "day=1" / "_delta_log").mkdir()
    (out / "day=1" / "_delta_log" / "00000000000000000000.json").write_text("{}")
    for source in (f"{out}/day=1", f"{out}/day=1/*.parquet"):
        with pytest.raises(ValueError, match=r"day=1.*Delta Lake table .* stale and repeated rows.*data.source"):
            list_source(source)
    with pytest.raises(ValueError, match=r"day=1: this folder is a Delta Lake table"):
        list_source(str(out))  # a table below the source's folder too


def test_csv_exports_given_as_the_source_are_said_to_be_no_parquet_and_how_to_make_them_so(tmp_path):
    """A folder of CSV exports matched "no parquet file", and a CSV beside parquet files was "not a readable parquet
    file (ArrowInvalid: ... magic bytes ...)": both now say what the files are and how to write them as parquet."""
    made = make_raw(tmp_path / "raw", n_seq=6)
    csvs = tmp_path / "csv"
    csvs.mkdir()
    for p in made:
        pl.read_parquet(p).write_csv(csvs / p.with_suffix(".csv").name)
    with pytest.raises(DataError, match=r"matched no parquet file: it holds 2 \.csv file\(s\); .*pl\.scan_csv\(path\)"):
        snapshot_source(cfg_for(csvs, tmp_path, **{"data.source": str(csvs)}).data)
    (tmp_path / "raw" / "extra.csv").write_bytes((csvs / "s-000.csv").read_bytes())
    with pytest.raises(DataError, match=r"(?s)extra\.csv: a \.csv file, not parquet\. Shardline reads parquet"):
        snapshot_source(cfg_for(tmp_path / "raw", tmp_path, **{"data.source": str(tmp_path / "raw" / "*")}).data)


def test_a_label_only_validation_or_test_rows_hold_is_said_naming_the_value_and_its_file(raw_dir, tmp_path):
    """A class no training row has (a typo in a label, a grade outside the data's own) is never predicted and its rows
    are scored as `<unseen>`: said in the encode's log with the value and the file (it went unsaid: one click of 3
    among 0/1 clicks counted in the test split's nDCG with a gain of 7)."""
    from shardline.core.config.data import SplitConfig
    from shardline.core.encoding.splits import sequence_splits
    from shardline.tasks.encode import log_unseen_classes

    def said(cfg) -> tuple[dict, list[str]]:
        snap, _, _, manifest = encode_all(cfg)
        groups = [g for g in manifest_groups(cfg)]
        logged: list[str] = []
        found = log_unseen_classes(manifest, groups, snap, cfg.data, SimpleLog(logged))
        return found, logged

    cfg = cfg_for(raw_dir, tmp_path)
    assert said(cfg) == ({}, [])  # every label of the test rows is one training has
    split: SplitConfig = cfg.data.split
    path = sorted(raw_dir.glob("*.parquet"))[1]
    frame = pl.read_parquet(path)
    seqs = sorted(set(frame["seq"]))
    test_seq = next(s for s, i in zip(seqs, sequence_splits(seqs, split)) if i == 2)
    frame.with_columns(
        pl.when((pl.col("seq") == test_seq) & (pl.col("t") == 7)).then(pl.lit("zz")).otherwise("label").alias("label")
    ).write_parquet(path)
    found, logged = said(cfg_for(raw_dir, tmp_path))
    assert found == {"label": ["zz"]}
    assert len(logged) == 1 and "'label' holds 1 value(s) no row of the training split has" in logged[0]
    assert f"validation or test rows: zz ({path.name})" in logged[0] and "'<unseen>'" in logged[0]
    assert logged[0].startswith("info:")  # a class target's long tail is as likely: information; a grade: a warning


def test_integer_classes_between_those_the_data_holds_are_not_said_unseen(raw_dir, tmp_path):
    """An integer class target of values 0, 2 and 6 is coded by its range in each group: 1 and 3-5 were said to be
    values "no row of the training split has, in its validation or test rows", which no row held. Only a value the
    other splits' rows hold is said: a 4 in a test row."""
    from shardline.core.config.data import SplitConfig
    from shardline.core.encoding.splits import sequence_splits
    from shardline.tasks.encode import log_unseen_classes

    def said(cfg) -> tuple[dict, list[str]]:
        snap, _, _, manifest = encode_all(cfg)
        logged: list[str] = []
        return log_unseen_classes(manifest, manifest_groups(cfg), snap, cfg.data, SimpleLog(logged)), logged

    as_int = pl.col("label").replace_strict({"a": 0, "b": 2, "c": 6}, return_dtype=pl.Int16)
    for path in sorted(raw_dir.glob("*.parquet")):
        pl.read_parquet(path).with_columns(as_int).write_parquet(path)
    cfg = cfg_for(raw_dir, tmp_path)
    assert said(cfg) == ({}, [])
    split: SplitConfig = cfg.data.split
    path = sorted(raw_dir.glob("*.parquet"))[1]
    frame = pl.read_parquet(path)
    seqs = sorted(set(frame["seq"]))
    test_seq = next(s for s, i in zip(seqs, sequence_splits(seqs, split)) if i == 2)
    one = (pl.col("seq") == test_seq) & (pl.col("t") == 7)
    frame.with_columns(pl.when(one).then(pl.lit(4, pl.Int16)).otherwise("label").alias("label")).write_parquet(path)
    found, logged = said(cfg_for(raw_dir, tmp_path))
    assert found == {"label": ["4"]} and f"validation or test rows: 4 ({path.name})" in logged[0], logged


class SimpleLog:
    def __init__(self, out: list[str]):
        self.out = out

    def warning(self, msg, *args):
        self.out.append("warning: " + msg % args)

    def info(self, msg, *args):
        self.out.append("info: " + msg % args)


def manifest_groups(cfg):
    from shardline.core.manifest import EncodedGroup

    store = Path(cfg.storage.root) / "datasets" / "groups"
    return [EncodedGroup.model_validate_json(p.read_text()) for p in sorted(store.glob("*/group.json"))]
