"""Raw data in object storage: ingest and encode read s3:// through s3fs from a real (moto) S3 server."""

import os

import pytest

from shardline.config import validate_config
from tests.conftest import make_raw, tiny_config
from tests.test_ingest_encode import encode_all


@pytest.fixture
def s3_endpoint(monkeypatch):
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    for k, v in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
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


def test_shards_in_s3_are_verified_on_fetch(tmp_path, s3_endpoint, monkeypatch):
    import s3fs
    from shardline import storage
    from trainer.data import open_split

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
    fs.pipe_file(f"{out_dir[len('s3://'):]}/{info.path}", b"corrupted")
    with pytest.raises(IOError, match="checksum mismatch"):
        open_split(manifest, uri, "validation")
    assert os.listdir(tmp_path / "cache")
