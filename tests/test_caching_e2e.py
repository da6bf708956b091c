"""Reruns redo only what changed: each case counts which steps ran, through a real Prefect API."""

import json
from pathlib import Path

import pytest

from shardline.core.config import validate_config
from shardline.core.storage import ChecksumMismatch
from tests.conftest import make_raw, tiny_config

pytestmark = pytest.mark.e2e

ALL_CACHED = {"ingest": "cached", "encode": "cached", "train": "cached", "evaluate": "cached", "register": "cached"}


def shard_files(manifest_uri: str) -> list[Path]:
    """The shard files a manifest lists, where they lie (the group store, beside the data sets' folders)."""
    from shardline.core.manifest import Manifest
    from shardline.core.storage import resolve

    manifest = Manifest.model_validate_json(Path(manifest_uri).read_text())
    return sorted(Path(resolve(str(Path(manifest_uri).parent), s.path)) for s in manifest.shards)


def run(cfg: dict, force=None) -> dict:
    from shardline.flows.pipeline import pipeline

    return pipeline(validate_config(cfg), force=force)


@pytest.fixture
def setup(tmp_path):
    make_raw(tmp_path / "raw", n_seq=12, rows=50)
    cfg = tiny_config(
        str(tmp_path / "raw" / "*.parquet"), str(tmp_path / "store"), **{"mlflow.model_name": f"m-{tmp_path.name}"}
    )
    first = run(cfg)
    assert set(first["steps"].values()) == {"ran"}
    return tmp_path, cfg, first


def test_same_command_twice_runs_nothing(setup, prefect_api, capsys):
    tmp_path, cfg, first = setup
    second = run(cfg)
    assert second["steps"] == ALL_CACHED
    assert second["registered"]["version"] == first["registered"]["version"] == 1
    # an evaluation setting this data does not use (the ranking metrics' cutoffs): no score changes, nothing reruns
    assert run({**cfg, "evaluation": {"k": [3], "max_generations": 5}})["steps"] == ALL_CACHED
    # how often a failed training is retried or checkpointed: nothing is trained or registered again
    retried = run({**cfg, "training": {**cfg["training"], "max_restarts": 5, "checkpoint_every_steps": 7}})
    assert retried["steps"] == ALL_CACHED and retried["registered"]["version"] == 1
    assert second["metrics"] == first["metrics"]
    # results are persisted as JSON under the storage root, never pickled
    records = list((tmp_path / "store" / "prefect-results").iterdir())
    assert {r.name.split("-")[0] for r in records} >= {"ingest", "encode", "manifest", "train", "evaluate", "register"}
    for r in records:
        json.loads(r.read_text())
        assert "pickle" not in r.read_text()

    # the alias moved away in the registry since (a later version, a teammate): the cached rerun says so, and the
    # predict command it prints names the version itself, not an alias that now loads another model
    from mlflow import MlflowClient

    from shardline.app.summary import summary
    from shardline.core.tracking.tracker import tracking_uri

    config = validate_config(cfg)
    client = MlflowClient(tracking_uri(config.mlflow, config.storage.root))
    client.delete_registered_model_alias(config.mlflow.model_name, "champion")
    third = run(cfg)
    assert third["steps"] == ALL_CACHED and third["registered"]["alias"] == "none"
    summary(third)
    said = capsys.readouterr().out
    assert f"Registered {config.mlflow.model_name} version 1 (it holds no alias now)" in said
    assert f"shardline predict models:/{config.mlflow.model_name}/1 INPUT.parquet" in said
    # a model no better than its baseline on the promotion metric is said to be (this one learned: nothing said)
    from shardline.tasks.evaluate import no_better_than_baseline

    assert "no better than its baseline" not in said and third["weak"] == ""
    assert first["metrics"]["accuracy"] > first["baseline"]["accuracy"]
    weak = no_better_than_baseline(config, first["baseline"], first["metrics"])  # the two the other way round
    assert weak.startswith(f"the model is no better than its baseline on accuracy ({first['baseline']['accuracy']:.4g}")
    summary({**third, "weak": weak})
    assert f"note: {weak}" in capsys.readouterr().out
    client.set_registered_model_alias(config.mlflow.model_name, "champion", "1")
    assert run(cfg)["registered"]["alias"] == "champion"


def test_changed_hyperparameter_reuses_ingest_and_encode(setup, prefect_api):
    tmp_path, cfg, first = setup
    cfg["training"]["lr"] = 0.02
    second = run(cfg)
    assert second["steps"] == {
        "ingest": "cached",
        "encode": "cached",
        "train": "ran",
        "evaluate": "ran",
        "register": "ran",
    }
    assert second["manifest"] == first["manifest"]
    assert second["registered"]["version"] == 2

    # a setting only the encode reads (the window, the split's seed): the raw files are not checked again
    cfg["data"] = {**cfg["data"], "window": 2, "split": {**cfg["data"]["split"], "seed": 2}}
    third = run(cfg)
    assert third["steps"] == {"ingest": "cached", **dict.fromkeys(["encode", "train", "evaluate", "register"], "ran")}
    assert third["snapshot"]["fingerprint"] == first["snapshot"]["fingerprint"]


def test_new_raw_file_is_ingested_encoded_and_trained_on(setup, prefect_api):
    tmp_path, cfg, first = setup
    make_raw(tmp_path / "raw", n_seq=3, rows=50, prefix="new", seed=9)
    second = run(cfg)
    assert second["steps"] == {"ingest": "ran", "encode": "ran", "train": "ran", "evaluate": "ran", "register": "ran"}
    assert second["snapshot"]["files"] == first["snapshot"]["files"] + 1
    assert second["manifest"] != first["manifest"]


def test_a_new_file_damaged_inside_is_left_out_and_listed_with_skip_and_refused_without(setup, prefect_api):
    """A file copied in whose footer reads but whose data does not (its pages damaged): with data.on_bad_file: skip the
    run trains without it and lists it (the summary, the MLflow run's skipped_files.json); without skip the run stops,
    naming it, before any work (it is the first file: the ingest samples its rows)."""
    from mlflow import MlflowClient

    from shardline.core.encoding.columns import DataError

    tmp_path, cfg, first = setup
    new = make_raw(tmp_path / "raw", n_seq=3, rows=50, prefix="new", seed=9)[0]
    body = bytearray(new.read_bytes())
    body[200:1200] = bytes(b ^ 0x5A for b in body[200:1200])
    new.write_bytes(bytes(body))
    second = run({**cfg, "data": {**cfg["data"], "on_bad_file": "skip"}})
    assert second["steps"]["encode"] == "ran" and second["snapshot"]["files"] == first["snapshot"]["files"]
    assert [(r["uri"], r["reason"].split(":")[0]) for r in second["snapshot"]["skipped"]] == [(str(new), "damaged")]
    client = MlflowClient(cfg["mlflow"]["tracking_uri"])
    listed = client.download_artifacts(second["registered"]["run_id"], "skipped_files.json", str(tmp_path / "dl"))
    assert [r["uri"] for r in json.loads(Path(listed).read_text())["skipped_files"]] == [str(new)]
    with pytest.raises(DataError, match=r"(?s)new-000\.parquet: cannot read its first rows: .*damaged"):
        run(cfg)


def test_deleted_shard_is_rebuilt(setup, prefect_api):
    tmp_path, cfg, first = setup
    shard = shard_files(first["manifest"])[0]
    assert shard.name.endswith(".bin.lz4")  # stored compressed
    original = shard.read_bytes()
    shard.unlink()
    second = run(cfg)
    assert second["steps"]["encode"] == "ran"
    assert shard.read_bytes() == original  # the same bytes again: downstream stays cached
    assert second["steps"]["train"] == "cached"


def test_deleted_checkpoint_is_retrained(setup, prefect_api):
    tmp_path, cfg, first = setup
    Path(first["train"]["best_checkpoint"]).unlink()
    second = run(cfg)
    assert second["steps"]["train"] == "ran"
    assert Path(second["train"]["best_checkpoint"]).exists()
    assert second["steps"]["ingest"] == second["steps"]["encode"] == "cached"


def test_a_damaged_checkpoint_is_found_where_it_is_read_and_retrained_on_the_next_run(setup, prefect_api):
    """The cache check of a training result lists the checkpoint (its size against its sidecar) instead
    of hashing it; bytes damaged in place (same size) are caught where they are read, and the next run
    retrains instead of failing the same way forever."""
    tmp_path, cfg, first = setup
    best = Path(first["train"]["best_checkpoint"])
    data = bytearray(best.read_bytes())
    data[len(data) // 2] ^= 0xFF
    best.write_bytes(bytes(data))
    with pytest.raises(OSError, match="checksum does not match its sidecar"):
        run(cfg, force="evaluate")
    second = run(cfg)
    assert second["steps"]["train"] == "ran" and second["steps"]["encode"] == "cached"
    assert second["metrics"].keys() == first["metrics"].keys()


def test_force_refreshes_a_step_and_everything_after(setup, prefect_api):
    tmp_path, cfg, first = setup
    second = run(cfg, force="evaluate")
    assert second["steps"] == {
        "ingest": "cached",
        "encode": "cached",
        "train": "cached",
        "evaluate": "ran",
        "register": "ran",
    }
    with pytest.raises(ValueError, match="force='evaluat' is not a step"):
        run(cfg, force="evaluat")


def test_force_train_trains_again_in_a_fresh_run_and_keeps_the_old(setup, prefect_api):
    """`--force train` used to rerun the task, find the finished run in its folder and return the old
    weights ("training already finished"). It trains a fresh run beside the old one, which is kept."""
    tmp_path, cfg, first = setup
    second = run(cfg, force="train")
    assert second["steps"]["train"] == "ran" and second["steps"]["encode"] == "cached"
    old, new = first["train"]["run_dir"], second["train"]["run_dir"]
    assert new != old and new.startswith(old + "-") and Path(old, "result.json").exists()
    assert (
        second["train"]["resumed_from"] is None and second["train"]["mlflow_run_id"] != first["train"]["mlflow_run_id"]
    )
    assert second["registered"]["version"] == first["registered"]["version"] + 1


def test_an_edit_to_the_training_code_addresses_another_run(setup, prefect_api, monkeypatch):
    """The code that trains is part of what addresses a run: with another version of it, the same data,
    model and settings go to another folder (a finished run's weights are not returned for new code)."""
    from shardline.core import storage, version
    from shardline.core.config import validate_config as check
    from shardline.core.manifest import Manifest
    from shardline.runs.training_run import run_dir

    tmp_path, cfg, first = setup
    config = check(cfg)
    manifest = Manifest.model_validate_json(storage.read_text(first["manifest"]))
    assert run_dir(config, manifest) == first["train"]["run_dir"]
    real = version.trainer_version
    monkeypatch.setattr(version, "trainer_version", lambda: real() + "-edited")
    assert run_dir(config, manifest) != first["train"]["run_dir"]


class _Planted:
    """What an attacker plants: decoding it would run code (here, it would write a file)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (Path(self.marker), "decoded"))


def test_a_planted_pickle_in_the_results_store_is_never_decoded(setup, prefect_api):
    """The cached results are JSON; a record naming another serializer (a pickle put in a shared store)
    is refused unread, the step recomputes and writes its own."""
    import base64
    import pickle

    tmp_path, cfg, first = setup
    marker = tmp_path / "pickle-was-decoded"
    records = sorted((tmp_path / "store" / "prefect-results").glob("train-*"))
    assert records
    for record in records:
        data = json.loads(record.read_text())
        data["metadata"]["serializer"] = {"type": "pickle", "picklelib": "pickle", "picklelib_version": None}
        data["result"] = base64.b64encode(pickle.dumps(_Planted(str(marker)))).decode()
        record.write_text(json.dumps(data))
    second = run(cfg)
    assert not marker.exists()
    assert second["steps"]["train"] == "ran" and second["steps"]["encode"] == "cached"
    for record in sorted((tmp_path / "store" / "prefect-results").glob("train-*")):
        assert json.loads(record.read_text())["metadata"]["serializer"]["type"] == "json"


def test_a_record_flipped_to_pickle_while_a_rerun_reads_it_is_never_decoded(setup, prefect_api):
    """Check-then-use: a thread flips every cached record between its JSON and a planted pickle while reruns read
    them. What is decoded is exactly the bytes that were checked, so the payload never runs; each step either
    comes from its checked record or recomputes."""
    import base64
    import os
    import pickle
    import threading

    tmp_path, cfg, first = setup
    marker = tmp_path / "pickle-was-decoded"
    results = tmp_path / "store" / "prefect-results"
    versions = []
    for record in sorted(p for p in results.iterdir() if "-" in p.name):
        good = record.read_bytes()
        bad = json.loads(good)
        bad["metadata"]["serializer"] = {"type": "pickle", "picklelib": "pickle", "picklelib_version": None}
        bad["result"] = base64.b64encode(pickle.dumps(_Planted(str(marker)))).decode()
        versions.append((record, good, json.dumps(bad).encode()))
    assert len(versions) >= 5
    stop = threading.Event()

    def flip():
        n = 0
        while not stop.is_set():
            n += 1
            for record, good, bad in versions:
                aside = record.with_name(record.name + ".flip")
                aside.write_bytes(bad if n % 2 else good)
                os.replace(aside, record)  # atomic: a reader sees one version or the other, whole
            stop.wait(0.0005)

    flipper = threading.Thread(target=flip, daemon=True)
    flipper.start()
    try:
        for _ in range(2):
            again = run(cfg)
            assert set(again["steps"].values()) <= {"ran", "cached"}
    finally:
        stop.set()
        flipper.join()
    assert not marker.exists()


def test_a_record_replaced_between_prefects_two_reads_is_used_as_checked_or_not_at_all(tmp_path):
    """Prefect reads a record twice: whether it exists, then what it holds. A record replaced by a pickle between the
    two reads hands the step the bytes the first read checked (not an error that fails the step); one refused at its
    first read is no record; one dropped as stale is no record again, whatever its copy kept."""
    import base64
    import pickle

    from prefect.results import ResultStore
    from prefect.serializers import JSONSerializer

    from shardline.tasks.caching import CheckedLocalResults, forget

    folder = tmp_path / "prefect-results"
    store = ResultStore(
        result_storage=CheckedLocalResults(basepath=str(folder)),
        serializer=JSONSerializer(),
        cache_result_in_memory=False,
    )
    marker = tmp_path / "pickle-was-decoded"
    store.write(key="train-a", obj={"best_score": 0.75})
    good = (folder / "train-a").read_bytes()
    bad = json.loads(good)
    bad["metadata"]["serializer"] = {"type": "pickle", "picklelib": "pickle", "picklelib_version": None}
    bad["result"] = base64.b64encode(pickle.dumps(_Planted(str(marker)))).decode()
    bad = json.dumps(bad).encode()

    assert store.exists("train-a")  # the first read: checked
    (folder / "train-a").write_bytes(bad)  # replaced before the second
    assert store.read("train-a").result == {"best_score": 0.75}
    assert not marker.exists()

    (folder / "train-b").write_bytes(bad)  # refused at its first read: no record, never decoded
    assert not store.exists("train-b")
    with pytest.raises(ValueError, match=r"cache record train-b refused: names serializer 'pickle'"):
        store.read("train-b")

    forget(str(folder), "train-a")  # dropped as stale: its kept copy goes with it
    assert not store.exists("train-a")
    assert not marker.exists()


def test_a_cached_rerun_lists_shards_and_reading_them_checks_their_bytes(setup, prefect_api, monkeypatch):
    """A cached rerun checks each shard's presence and size (a listing: no download of the data set on
    S3); a shard of another size is rebuilt. Bytes that changed at the same size are caught where they
    are read, by their checksum, naming the shard."""
    tmp_path, cfg, first = setup
    shards = shard_files(first["manifest"])
    original = shards[0].read_bytes()
    shards[0].write_bytes(original[:-1])  # truncated: another size
    second = run(cfg)
    assert second["steps"]["encode"] == "ran" and shards[0].read_bytes() == original

    train = next(s for s in shards if s.name.startswith("train"))
    kept = train.read_bytes()
    train.write_bytes(bytes(len(kept)))  # the same size, other bytes: not hashed by the cached rerun
    third = run(cfg)
    assert third["steps"] == ALL_CACHED
    monkeypatch.setenv("SHARDLINE_CACHE", str(tmp_path / "fresh-cache"))  # a machine that has not read them yet
    # training reads it: refused, named, not retried (the same bytes fail the same way), and deleted, so that the
    # same command again encodes its group anew (it said "re-run the encode step", which found the group stored
    # and failed the same way: only --force encode mended it, registering a new version)
    with pytest.raises(ChecksumMismatch, match=r"\.bin\.lz4: checksum mismatch .*; deleted: run the same command"):
        run(cfg, force="train")
    assert not train.exists()
    fourth = run(cfg)
    assert fourth["steps"] == {**ALL_CACHED, "encode": "ran"} and train.read_bytes() == kept


def test_a_manifest_whose_encoding_was_edited_is_written_anew_and_never_trained_on(setup, prefect_api):
    """A data set's manifest edited in the storage root (a continuous column's mean, the same size): the cached
    encode took it, and the model trained on the altered scaling and was registered, with no word. Its
    `encoding_hash` now says it is not the encoding it was written with: the encode writes it anew from the groups,
    and training refuses such a manifest wherever it reads one."""
    from shardline.runs.training_run import load_manifest

    tmp_path, cfg, first = setup
    path = Path(first["manifest"].removeprefix("file://"))
    original = path.read_text()
    manifest = json.loads(original)
    manifest["encoding"]["continuous"][0]["mean"] += 5.0
    path.write_text(json.dumps(manifest))
    with pytest.raises(
        ValueError, match=r"its encoding is not the one it was written with .* changed after the encode"
    ):
        load_manifest(str(path), validate_config(cfg))
    second = run(cfg, force="train")
    assert second["steps"]["encode"] == "ran" and json.loads(path.read_text()) == json.loads(original)
    assert second["metrics"] == first["metrics"]  # trained on the encoding the data has


def test_two_commands_starting_on_a_new_prefect_database_both_save_their_results_block(tmp_path, prefect_api):
    """Saving the results block registers its block type: Prefect reads it by slug, and creates it when the read
    finds nothing. Two commands starting at once on a new database both read nothing, and the second create is a
    409 (a user's first demo beside another command: `error: ObjectAlreadyExists`). Here the other command's
    create lands between this one's read and its create (the read answers 'not found' once, as it did for the
    second command): the step's results block is still saved, on the real API."""
    from prefect import get_client
    from prefect.blocks.core import Block
    from prefect.exceptions import ObjectNotFound

    from shardline.tasks import caching

    caching.results_storage(str(tmp_path / "a"))  # the other command: the block type is on the API now
    with get_client(sync_client=True) as client:
        client_type = type(client)
    real_read = client_type.read_block_type_by_slug
    reads = []

    def read_before_the_other_create(self, slug):
        reads.append(slug)
        if len(reads) == 1:
            raise ObjectNotFound(http_exc=Exception(f"no block type {slug} yet"))
        return real_read(self, slug)

    client_type.read_block_type_by_slug = read_before_the_other_create
    try:
        block, uri = caching.results_storage(str(tmp_path / "b"))
    finally:
        client_type.read_block_type_by_slug = real_read
    assert len(reads) >= 2, reads  # the stale read, then the one after the 409
    assert uri.endswith("results") and Path(uri).is_dir()
    assert Block.load(f"{block.get_block_type_slug()}/{block._block_document_name}").basepath == uri
