"""Raw data in object storage: ingest and encode read s3:// through s3fs from a real (moto) S3 server."""

import os

import polars as pl
import pytest

from shardline.core.config import validate_config
from tests.conftest import make_raw, tiny_config
from tests.test_ingest_encode import encode_all


@pytest.fixture
def s3_endpoint(monkeypatch):
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    for k, v in {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(k, v)
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    yield endpoint
    s3fs.S3FileSystem.clear_instance_cache()
    server.stop()


def test_ingest_and_encode_from_s3(tmp_path, s3_endpoint):
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.mkdir("raw-bucket")
    for p in make_raw(tmp_path / "raw"):
        fs.put_file(str(p), f"raw-bucket/games/{p.name}")
    cfg = validate_config(tiny_config("s3://raw-bucket/games/*.parquet", str(tmp_path / "store")))
    snap, spec, out_dir, manifest = encode_all(cfg)
    assert [f.uri for f in snap.files] == [f"s3://raw-bucket/games/s-{i:03d}.parquet" for i in range(4)]
    assert all(f.version and f.version != "None" for f in snap.files)  # the S3 ETag
    local = encode_all(validate_config(tiny_config(str(tmp_path / "raw" / "*.parquet"), str(tmp_path / "store2"))))[3]
    # the same bytes give the same encoding, whether read from S3 or from disk
    assert manifest.encoding_hash == local.encoding_hash
    assert manifest.rows == local.rows and manifest.windows == local.windows
    # a changed object changes the snapshot's fingerprint
    fs.put_file(str(tmp_path / "raw" / "s-000.parquet"), "raw-bucket/games/s-999.parquet")
    assert encode_all(cfg)[0].fingerprint != snap.fingerprint
    # a mistyped bucket read as an empty folder: the message says the bucket is not there
    from shardline.core.encoding.columns import DataError

    typo = validate_config(tiny_config("s3://raw-bukcet/games/*.parquet", str(tmp_path / "store")))
    with pytest.raises(DataError, match=r"matched no parquet file: its bucket 'raw-bukcet' is not there"):
        encode_all(typo)
    with pytest.raises(DataError, match=r"'s3://raw-bucket/gmaes/\*.parquet' matched no parquet file; check"):
        encode_all(validate_config(tiny_config("s3://raw-bucket/gmaes/*.parquet", str(tmp_path / "store"))))


def test_shards_in_s3_are_verified_on_fetch(tmp_path, s3_endpoint, monkeypatch):
    import s3fs

    from shardline.core import storage
    from shardline.trainer.data import open_split

    monkeypatch.setenv("SHARDLINE_CACHE", str(tmp_path / "cache"))
    fs = s3fs.S3FileSystem()
    fs.mkdir("store-bucket")
    make_raw(tmp_path / "raw")
    cfg = validate_config(tiny_config(str(tmp_path / "raw" / "*.parquet"), "s3://store-bucket/root"))
    _, _, out_dir, manifest = encode_all(cfg)
    uri = storage.join(out_dir, "manifest.json")
    storage.write_text(uri, manifest.model_dump_json())
    data = open_split(manifest, uri, "train")
    assert data.n_windows == manifest.windows["train"]
    # a shard object replaced behind the manifest's back is refused, not trained on
    info = manifest.shards_of("validation")[0]
    fs.pipe_file(storage.resolve(out_dir, info.path)[len("s3://") :], b"corrupted")
    with pytest.raises(IOError, match="checksum mismatch"):
        open_split(manifest, uri, "validation")
    assert os.listdir(tmp_path / "cache")


def test_a_split_larger_than_the_cache_streams_from_s3(tmp_path, s3_endpoint, monkeypatch):
    """Training data several times the local cache cap: shards stream through the cache (LRU, read-ahead),
    the cache never holds more than its cap, and every epoch delivers every window once, in the
    loader's order, exactly as the whole split in hand would (whose loader has the same order: it never
    depends on the cache); a restored position resumes exactly."""
    import numpy as np
    import s3fs
    import torch

    from shardline.core import storage
    from shardline.trainer.data import WindowLoader, open_split

    fs = s3fs.S3FileSystem()
    fs.mkdir("big-bucket")
    make_raw(tmp_path / "raw", n_seq=72, rows=100)
    cfg = validate_config(
        tiny_config(str(tmp_path / "raw" / "*.parquet"), "s3://big-bucket/root", **{"data.files_per_group": 1})
    )
    _, _, out_dir, manifest = encode_all(cfg)
    uri = storage.join(out_dir, "manifest.json")
    storage.write_text(uri, manifest.model_dump_json())
    shards = manifest.shards_of("train")
    assert all(s.compression == "lz4" and s.raw_bytes > s.bytes for s in shards)  # stored packed, unpacked in the cache
    total, biggest = sum(s.raw_bytes for s in shards), max(s.raw_bytes for s in shards)
    cap = int(biggest * 4.5)
    assert len(shards) >= 12 and total > 2.5 * cap

    whole = open_split(manifest, uri, "train", cache=storage.ShardCache(tmp_path / "big-cache", cap_bytes=10 * total))
    assert not whole.streaming
    cache = storage.ShardCache(tmp_path / "small-cache", cap_bytes=cap)
    data = open_split(manifest, uri, "train", cache=cache)
    assert data.streaming and data.n_windows == whole.n_windows == manifest.windows["train"]

    with pytest.raises(ValueError, match="training.shuffle_shards"):  # a global shuffle needs it all in the cache
        WindowLoader(data, 16, seed=3)
    loader = WindowLoader(data, 16, seed=3, shuffle_shards=2)
    for epoch in range(2):
        loader.set_epoch(epoch)
        order = loader.order(epoch)
        assert sorted(order.tolist()) == list(range(data.n_windows))
        np.testing.assert_array_equal(order, WindowLoader(whole, 16, seed=3, shuffle_shards=2).order(epoch))
        seen = 0
        for batch in loader:
            want = whole.batch(order[seen : seen + len(batch)])
            assert (
                torch.equal(batch.cont, want.cont)
                and torch.equal(batch.cat, want.cat)
                and torch.equal(batch.target, want.target)
            )
            seen += len(batch)
            assert cache.held_bytes() <= cap
        assert seen == data.n_windows
    assert cache.evictions > 0 and cache.downloads > len(shards)  # shards left the cache and came back

    loader.set_epoch(1)
    it = iter(loader)
    for _ in range(7):
        next(it)
    state = loader.state_dict()
    rest = list(it)
    again = WindowLoader(open_split(manifest, uri, "train", cache=cache), 16, seed=3, shuffle_shards=2)
    again.load_state_dict(state)
    resumed = list(again)
    assert len(resumed) == len(rest) > 0
    assert all(torch.equal(x.cont, y.cont) and torch.equal(x.target, y.target) for x, y in zip(rest, resumed))

    # a cap below one shard is refused with what to do, not a half-written cache
    with pytest.raises(IOError, match="SHARDLINE_CACHE_MAX_GB"):
        tiny = open_split(
            manifest, uri, "train", cache=storage.ShardCache(tmp_path / "tiny-cache", cap_bytes=biggest // 2)
        )
        next(iter(WindowLoader(tiny, 16, seed=0, shuffle_shards=1)))
    assert np.all([not p.name.startswith(".tmp-") for p in (tmp_path / "tiny-cache").rglob("*")])


@pytest.mark.e2e
def test_a_pipeline_on_an_s3_root_is_cached_on_another_machine_and_evaluates_without_the_training_split(
    tmp_path, s3_endpoint, prefect_api, monkeypatch
):
    """The evaluate step's cached result points at the storage root (not at a local temporary folder), so
    a rerun on any machine that shares the root is a cache hit; and the trivial baseline comes from the
    manifest's statistics, so evaluation never reads the training split."""
    import shutil
    import tempfile

    import s3fs

    from shardline.core import storage
    from shardline.core.manifest import Manifest
    from shardline.flows.pipeline import pipeline

    s3fs.S3FileSystem().mkdir("team-bucket")
    make_raw(tmp_path / "raw", n_seq=12, rows=60)
    cfg = validate_config(
        tiny_config(
            str(tmp_path / "raw" / "*.parquet"),
            "s3://team-bucket/root",
            **{"mlflow.tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "training.epochs": 1},
        )
    )
    for machine in ("machine-a", "machine-b"):
        (tmp_path / machine).mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "machine-a"))
    first = pipeline(cfg)
    # the next day's rows in the bucket: predicted from there into it, as from and into local files
    from typer.testing import CliRunner

    from shardline.app import predict_input
    from shardline.app.cli import app

    day = make_raw(tmp_path / "day", n_seq=9, rows=30, prefix="day", seed=5)
    s3fs.S3FileSystem().put(f"{tmp_path}/day/", "team-bucket/day/", recursive=True)
    # fetched in concurrent batches (of two files here, then one): every file once, in the listing's order
    monkeypatch.setattr(predict_input, "FETCH_BYTES", int(2.5 * day[0].stat().st_size))
    model = [f"models:/{cfg.mlflow.model_name}/1"]
    tracking = ["--tracking-uri", cfg.mlflow.tracking_uri]
    for where, out in (("s3://team-bucket/day/*.parquet", "s3://team-bucket/preds/day.parquet"),
                       (f"{tmp_path}/day", f"{tmp_path}/preds.parquet")):  # fmt: skip
        done = CliRunner().invoke(app, ["predict", *model, where, "--out", out, *tracking])
        assert done.exit_code == 0 and "wrote" in done.output, done.output
    from_s3 = pl.read_parquet(storage.read_bytes("s3://team-bucket/preds/day.parquet"))
    assert from_s3.height > 0 and from_s3.equals(pl.read_parquet(tmp_path / "preds.parquet"))
    for where, out, said in (  # a bucket name's typo, either side: named, exit 2
        (
            "s3://team-bucket/day",
            "s3://team-buket/p.parquet",
            "--out s3://team-buket/p.parquet: its bucket 'team-buket'",
        ),
        (
            "s3://team-buket/day",
            f"{tmp_path}/p.parquet",
            "no parquet file in s3://team-buket/day: its bucket 'team-buket'",
        ),
        # --out one of the input's files, by any path to it: refused before a row is read, the file left as it was
        (
            "s3://team-bucket/day/*.parquet",
            f"s3://team-bucket/day/{day[0].name}",
            f"is s3://team-bucket/day/{day[0].name}, a file of the input: the predictions would replace its rows",
        ),
        (f"{tmp_path}/day", f"{tmp_path}/preds/../day/{day[1].name}", f"is {day[1]}, a file of the input"),
    ):
        done = CliRunner().invoke(app, ["predict", *model, where, "--out", out, *tracking])
        assert done.exit_code == 2 and said in done.output, done.output
    assert storage.read_bytes(f"s3://team-bucket/day/{day[0].name}") == day[0].read_bytes()
    assert pl.read_parquet(day[1]).columns == pl.read_parquet(day[2]).columns  # still the raw rows
    # "another machine": none of the first one's temporary files
    shutil.rmtree(tmp_path / "machine-a")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "machine-b"))
    again = pipeline(cfg)
    assert again["steps"] == dict.fromkeys(again["steps"], "cached"), again["steps"]
    assert again["baseline"] == first["baseline"]

    # the training split's shards gone: the evaluation still runs, its baseline from the manifest
    manifest = Manifest.model_validate_json(storage.read_text(first["manifest"]))
    assert manifest.target_stats and sum(manifest.target_stats[0]["counts"].values()) == manifest.rows["train"]
    fs = s3fs.S3FileSystem()
    folder = first["manifest"].rsplit("/", 1)[0].removeprefix("s3://")
    for info in manifest.shards_of("train"):
        fs.rm(f"{folder}/{info.path}")
    forced = pipeline(cfg, force="evaluate")
    assert forced["steps"]["evaluate"] == "ran"
    assert forced["baseline"] == pytest.approx(first["baseline"])
    assert forced["metrics"] == pytest.approx(first["metrics"])


def test_the_groups_an_s3_store_holds_whole_are_found_in_one_listing(tmp_path, s3_endpoint):
    """An append's unchanged groups are found in the S3 group store without a task per group: a group
    counts as stored only with its record and every shard it lists there at the recorded size (one
    shard replaced by other bytes, or a record gone, and the group is encoded again)."""
    import s3fs

    from shardline.core import storage
    from shardline.core.encoding.write import file_groups, stored_group, stored_groups
    from shardline.tasks.encode import group_key
    from shardline.tasks.ingest import snapshot_source

    fs = s3fs.S3FileSystem()
    fs.mkdir("group-bucket")
    make_raw(tmp_path / "raw", n_seq=12)
    cfg = validate_config(
        tiny_config(str(tmp_path / "raw" / "*.parquet"), "s3://group-bucket/root", **{"data.files_per_group": 1})
    )
    store = "s3://group-bucket/root/datasets/groups"
    assert stored_groups(store, ["nothing-here"]) == {}  # no store yet
    encode_all(cfg)
    keys = [group_key(g, cfg.data) for g in file_groups(snapshot_source(cfg.data), cfg.data)]
    assert len(keys) >= 3
    found = stored_groups(store, [*keys, "not-a-group"])
    assert sorted(found) == sorted(keys)
    assert all(found[k] == stored_group(store, k) for k in keys)  # what the per-group check says

    broken, gone = keys[0], keys[1]
    shard = found[broken].shards[0]
    fs.pipe_file(storage.join(store, broken, shard.path)[len("s3://") :], b"other bytes")
    fs.rm(storage.join(store, gone, "group.json")[len("s3://") :])
    assert sorted(stored_groups(store, keys)) == sorted(keys[2:])


@pytest.mark.e2e
def test_an_object_store_that_never_answers_is_named_with_its_setting_retried_and_said_without_a_traceback(tmp_path):
    """AWS_ENDPOINT_URL at a port where nothing listens (a server down, a typo): the ingest is retried (an
    infrastructure failure), each retry said in one line, then the command's error names the endpoint and the
    variable that sets it, with no traceback of botocore's."""
    import yaml

    from tests.net import free_port
    from tests.test_cli import shardline

    endpoint = f"http://127.0.0.1:{free_port()}"
    cfg = tiny_config("s3://raw-bucket/games/*.parquet", str(tmp_path / "store"))
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
    env |= {"AWS_DEFAULT_REGION": "us-east-1", "AWS_MAX_ATTEMPTS": "1", "PREFECT_HOME": str(tmp_path / "ph")}
    env["PREFECT_LOGGING_LEVEL"] = "INFO"  # a user's default (the tests' is WARNING)
    out = shardline("run", tmp_path / "c.yaml", env=env, cwd=tmp_path)
    said = out.stdout + out.stderr
    assert out.returncode == 1, said[-3000:]
    assert f"error: cannot connect to the object store at {endpoint} (AWS_ENDPOINT_URL): is the server up" in out.stderr
    assert "shardline doctor CONFIG" in out.stderr
    assert "Retry 2/2 will start" in said  # the ingest's retries, each in a line
    assert "Traceback" not in said and "EndpointConnectionError" not in said, said[-3000:]


def test_files_are_fetched_in_batches_in_order_and_a_large_one_is_read_in_place(tmp_path, s3_endpoint):
    """`storage.fetched` (predict's input, the champion gate's rows): an object store's files in concurrent
    batches of at most the limit's bytes, each once and in the order given, beside local files; a file over the
    limit is opened where it is (read as its reader asks), not held whole."""
    import io

    import s3fs

    from shardline.core import storage

    fs = s3fs.S3FileSystem()
    fs.mkdir("fetch-bucket")
    sizes = [300, 300, 300, 2000, 100]
    blobs = {f"s3://fetch-bucket/f{i}.bin": bytes([i]) * n for i, n in enumerate(sizes)}
    fs.pipe({uri.removeprefix("s3://"): data for uri, data in blobs.items()})
    (tmp_path / "local.bin").write_bytes(b"here")
    files = [*((uri, len(data)) for uri, data in blobs.items()), (str(tmp_path / "local.bin"), 4)]
    files.insert(2, files.pop())  # a local file between two remote ones
    got = list(storage.fetched(files, limit=700))
    assert [uri for uri, _ in got] == [uri for uri, _ in files]
    for uri, source in got:
        if uri in blobs:
            large = len(blobs[uri]) > 700
            assert isinstance(source, io.BytesIO) != large and source.closed == large  # closed once passed by
        else:
            assert source == str(tmp_path / "local.bin")
    read = {}
    for uri, source in storage.fetched(files, limit=700):  # each read where it is yielded
        read[uri] = source.read() if hasattr(source, "read") else open(source, "rb").read()
    assert read == {**blobs, str(tmp_path / "local.bin"): b"here"}


def test_a_large_file_on_s3_is_encoded_in_parts_from_ranged_reads(tmp_path, s3_endpoint):
    """A file of more than 1.5x `data.group_mb` on S3 is cut into parts from ranged reads of the object (no
    download held whole): the same windows as the same file encoded whole from a local disk."""
    import s3fs

    from shardline.core import storage
    from shardline.core.manifest import Manifest
    from shardline.tasks.encode import encode_dataset
    from shardline.tasks.ingest import snapshot_source
    from tests.test_append import assert_same_windows

    made = make_raw(tmp_path / "made", n_seq=24, rows=100)
    (tmp_path / "raw").mkdir()
    big = tmp_path / "raw" / "big.parquet"
    pl.concat([pl.read_parquet(p) for p in made]).write_parquet(big, row_group_size=300)
    fs = s3fs.S3FileSystem()
    fs.mkdir("parts-bucket")
    fs.put_file(str(big), "parts-bucket/raw/big.parquet")
    uris = {}
    for name, source, group_mb in (
        ("local", str(big), 100),
        ("s3", "s3://parts-bucket/raw/*.parquet", big.stat().st_size / 3 / 1e6),
    ):
        over = {"data.files_per_group": None, "data.group_mb": group_mb}
        cfg = validate_config(tiny_config(source, str(tmp_path / name), **over))
        uris[name] = encode_dataset(snapshot_source(cfg.data), cfg.data, str(tmp_path / name / "out"))
    parts = Manifest.model_validate_json(storage.read_text(uris["s3"]))
    assert len({s.path.split("/")[-2] for s in parts.shards}) == 3  # three groups: the file's three parts
    assert_same_windows(uris["local"], uris["s3"])


def test_a_file_damaged_inside_on_s3_is_told_from_the_network(tmp_path, s3_endpoint):
    """On an object store, a file whose footer reads but whose pages do not is damaged, not a network error: with
    data.on_bad_file: skip the ingest samples the next file and the encode leaves it out (a group of it alone, and
    among others), listing it; with fail both say it is damaged, naming it. A read that fails for the network is
    still an OSError (retried by the step), never taken for a damaged file."""
    import s3fs

    from shardline.core.encoding.columns import DamagedFile
    from shardline.core.encoding.read import read_group, read_raw
    from shardline.tasks.ingest import check_registrable, snapshot_source

    fs = s3fs.S3FileSystem()
    fs.mkdir("damaged-bucket")
    for p in make_raw(tmp_path / "raw", n_seq=30):  # 10 files of 3 sequences
        body = bytearray(p.read_bytes())
        if p.name in ("s-000.parquet", "s-002.parquet"):
            body[200:1200] = bytes(b ^ 0x5A for b in body[200:1200])
        fs.pipe_file(f"damaged-bucket/games/{p.name}", bytes(body))
    source = "s3://damaged-bucket/games/*.parquet"
    fail = validate_config(tiny_config(source, str(tmp_path / "store"), **{"data.files_per_group": 1}))
    snap = snapshot_source(fail.data)
    first = r"(?s)s3://damaged-bucket/games/s-000\.parquet: cannot read its first rows.* damaged"
    with pytest.raises(DamagedFile, match=first):
        check_registrable(fail.data, snap)
    with pytest.raises(DamagedFile, match=r"(?s)s-002\.parquet: cannot read columns .* damaged"):
        read_raw(snap.files[2].uri, fail.data)
    for per_group in (1, None):
        over = {"data.on_bad_file": "skip", "data.files_per_group": per_group}
        skip = validate_config(tiny_config(source, str(tmp_path / f"skip{per_group}"), **over))
        check_registrable(skip.data, snap)  # its sample from s-001
        manifest = encode_all(skip)[3]
        assert [r.uri.rsplit("/", 1)[-1] for r in manifest.skipped] == ["s-000.parquet", "s-002.parquet"]
    fs.rm("damaged-bucket/games/s-001.parquet")  # gone since the listing: the store's error, not a damaged file
    skip = validate_config(tiny_config(source, str(tmp_path / "gone"), **{"data.on_bad_file": "skip"}))
    with pytest.raises(OSError) as gone:
        read_group(snap.files[1:2], skip.data, damaged=[])
    assert not isinstance(gone.value, DamagedFile)


def test_a_storage_root_in_a_bucket_that_is_not_there_is_said_and_no_bucket_is_made(tmp_path, s3_endpoint):
    """A typo in storage.root's bucket: said before any work, naming it, the same on every try. It failed after
    three tries of a task with botocore's "The specified bucket does not exist", and Prefect, persisting the failed
    task's result through s3fs, made the bucket: the same command then ran, in a bucket of the typo's name."""
    import s3fs
    import yaml

    from tests.test_cli import shardline

    make_raw(tmp_path / "raw", n_seq=6, rows=30)
    cfg = tiny_config(
        str(tmp_path / "raw" / "*.parquet"),
        "s3://typo-bucket/shardline",
        **{"mlflow.tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "training.epochs": 1},
    )
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "ph")}
    for _ in range(2):
        out = shardline("run", tmp_path / "c.yaml", env=env, cwd=tmp_path)
        said = out.stdout + out.stderr
        assert out.returncode == 1, said[-3000:]
        assert (
            "error: storage.root s3://typo-bucket/shardline: its bucket 'typo-bucket' is not there: create it (`aws s3 "
            "mb`) or fix storage.root; nothing was run"
        ) in out.stderr, said[-3000:]
        assert "Traceback" not in said
        s3fs.S3FileSystem.clear_instance_cache()
        assert not s3fs.S3FileSystem().exists("typo-bucket")
    # no credentials at all, and an endpoint that refuses, were said as the same bucket to create
    nothing = {k: v for k, v in env.items() if k not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")}
    nothing.update(
        AWS_SHARED_CREDENTIALS_FILE="/nonexistent", AWS_CONFIG_FILE="/nonexistent", AWS_EC2_METADATA_DISABLED="true"
    )
    out = shardline("run", tmp_path / "c.yaml", env=nothing, cwd=tmp_path)
    assert out.returncode == 1, out.stderr[-3000:]
    assert "no S3 credentials were found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in out.stderr
    assert "aws s3 mb" not in out.stderr and "Traceback" not in out.stderr
    from shardline.core.listing import no_bucket
    from shardline.core.unreachable import StorageUnreachable

    with pytest.MonkeyPatch.context() as m:
        m.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
        s3fs.S3FileSystem.clear_instance_cache()
        with pytest.raises(StorageUnreachable, match=r"cannot connect to the object store at http://127.0.0.1:1"):
            no_bucket("s3://typo-bucket/shardline")
    s3fs.S3FileSystem.clear_instance_cache()


def test_an_object_store_that_takes_the_connection_and_never_answers_is_an_error_said_not_a_silent_wait(tmp_path):
    """A stalled store (a server stopped, a black-holed route behind a proxy): the connection is taken, the answer
    never comes. With botocore's 60 s read timeout under s3fs's 5 tries of botocore's attempts, one request waited
    about 30 minutes without a line; now each attempt waits SHARDLINE_STORE_READ_SECONDS, the step is retried a
    line at a time, and the error names the endpoint."""
    import socket
    import threading

    import yaml

    from tests.test_cli import shardline

    listener = socket.create_server(("127.0.0.1", 0))
    held: list[socket.socket] = []

    def take() -> None:  # accept every connection, answer none
        while True:
            try:
                held.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=take, daemon=True).start()
    endpoint = f"http://127.0.0.1:{listener.getsockname()[1]}"
    cfg = tiny_config("s3://raw-bucket/games/*.parquet", str(tmp_path / "store"))
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
    env |= {"AWS_DEFAULT_REGION": "us-east-1", "AWS_MAX_ATTEMPTS": "1", "PREFECT_HOME": str(tmp_path / "ph")}
    env |= {"SHARDLINE_STORE_READ_SECONDS": "1", "PREFECT_LOGGING_LEVEL": "INFO"}
    try:
        out = shardline("run", tmp_path / "c.yaml", env=env, cwd=tmp_path)
    finally:
        listener.close()
        for s in held:
            s.close()
    said = out.stdout + out.stderr
    assert out.returncode == 1, said[-3000:]
    assert (
        f"error: the object store at {endpoint} (AWS_ENDPOINT_URL) took the connection and did not answer any attempt "
        "in SHARDLINE_STORE_READ_SECONDS"
    ) in out.stderr, said[-3000:]
    assert "Retry 2/2 will start" in said  # the ingest's retries, each in a line
    assert "Traceback" not in said and "ReadTimeoutError" not in said, said[-3000:]


def test_an_object_another_machine_wrote_after_this_one_listed_its_folder_is_there(tmp_path, s3_endpoint):
    """s3fs answers `exists` and `info` from a folder's listing it cached: a teammate's run that wrote a group's
    keys file after this process had listed the group's folder left this one reading it as gone (its evaluate
    failed with a bare FileNotFoundError of a file that was there)."""
    import s3fs

    from shardline.core import storage

    s3fs.S3FileSystem().mkdir("listed-bucket")
    storage.write_bytes("s3://listed-bucket/groups/g1/train.bin", b"x")
    assert storage.names("s3://listed-bucket/groups/g1") == ["train.bin"]
    fs, _ = storage.filesystem("s3://listed-bucket/groups/g1")
    fs.ls("listed-bucket/groups/g1")  # this process's cached listing of the folder
    elsewhere = s3fs.S3FileSystem(skip_instance_cache=True)  # another machine
    elsewhere.pipe("listed-bucket/groups/g1/test.keys.parquet", b"abc")
    assert storage.exists("s3://listed-bucket/groups/g1/test.keys.parquet")
    assert storage.size_of("s3://listed-bucket/groups/g1/test.keys.parquet") == 3
    assert not storage.exists("s3://listed-bucket/groups/g1/none.parquet")
    assert storage.size_of("s3://listed-bucket/groups/g1/none.parquet") is None
