"""`shardline gc`: real pipeline runs (a real Prefect API, a real MLflow SQLite store), then gc.

One set of runs for the module: config A (model `gc-model`), config B (other raw files, another window,
model `gc-other`), then A again with `--force train` (a fresh run folder). Their files are aged (A's
first run 3 days, B 2 days, A's second run 1 day), then the registered model `gc-other` is deleted:
B's run and data set are referenced by nothing. The tests run in file order; the last two delete.
"""

import json
import os
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import polars as pl
import pytest
import yaml
from mlflow import MlflowClient
from typer.testing import CliRunner

from shardline.app.cli import app
from shardline.app.gc import Item, deletion_order, plan_gc
from shardline.core import storage
from shardline.core.config import validate_config
from shardline.core.tracking.tracker import fluent_tracking_uri
from tests.conftest import make_raw, tiny_config
from tests.test_s3_source import s3_endpoint  # noqa: F401 - the moto fixture

DAY = 86400
ALL_CACHED = {"ingest": "cached", "encode": "cached", "train": "cached", "evaluate": "cached", "register": "cached"}


def run(cfg: dict, force=None) -> dict:
    from shardline.flows.pipeline import pipeline

    return pipeline(validate_config(cfg), force=force)


def age(path: Path, seconds_ago: float) -> None:
    """Set the modification time of `path` and everything under it."""
    t = time.time() - seconds_ago
    for p in [path, *path.rglob("*")] if path.is_dir() else [path]:
        os.utime(p, (t, t))


def files_of(*folders: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for f in folders for p in f.rglob("*") if p.is_file()}


def gc(*args) -> SimpleNamespace:
    out = CliRunner().invoke(app, ["gc", *map(str, args)])
    return SimpleNamespace(code=out.exit_code, out=out.output, exc=out.exception)


@pytest.fixture(scope="module")
def store(tmp_path_factory, prefect_api):
    tmp = tmp_path_factory.mktemp("gc")
    make_raw(tmp / "raw-a", n_seq=12, rows=50)
    make_raw(tmp / "raw-b", n_seq=12, rows=50, seed=4, prefix="b")
    root = tmp / "store"
    a = tiny_config(str(tmp / "raw-a" / "*.parquet"), str(root), **{"mlflow.model_name": "gc-model"})
    b = tiny_config(
        str(tmp / "raw-b" / "*.parquet"),
        str(root),
        **{"mlflow.model_name": "gc-other", "data.window": 4, "training.lr": 0.02},
    )
    results = root / "prefect-results"
    first = run(a)
    before_b = {p.name for p in results.iterdir()}
    second = run(b)
    b_records = {p.name for p in results.iterdir()} - before_b
    third = run(a, force="train")
    runs = [Path(r["train"]["run_dir"]) for r in (first, second, third)]
    assert len(set(runs)) == 3 and runs[2].name.startswith(runs[0].name + "-")  # --force train: a fresh folder
    data_a, data_b = Path(first["manifest"]).parent, Path(second["manifest"]).parent
    assert data_a != data_b and Path(third["manifest"]).parent == data_a
    # the group store: each data set's shards lie in file-group folders its manifest lists
    groups_a, groups_b = groups_of(first["manifest"]), groups_of(second["manifest"]) - groups_of(first["manifest"])
    assert groups_a and groups_b
    for area in ("datasets", "runs", "prefect-results"):
        age(root / area, 4 * DAY)
    for path, days in ((runs[0], 3), (data_a, 3), (runs[1], 2), (data_b, 2), (runs[2], 1)):
        age(path, days * DAY)
    # someone else's folders under datasets/ and runs/ (a folder of photos, notes, raw parquet kept there): old,
    # referenced by nothing, and never Shardline's to delete
    foreign = [root / "datasets" / "holiday-photos", root / "runs" / "notes", root / "datasets" / "groups" / "raw-c"]
    for folder in foreign:
        folder.mkdir(parents=True)
    (foreign[0] / "beach.jpg").write_bytes(b"\xff\xd8 a photo")
    (foreign[1] / "todo.txt").write_text("compare the two runs")
    shutil.copy(sorted((tmp / "raw-a").glob("*.parquet"))[0], foreign[2] / "s-000.parquet")
    for folder in foreign:
        age(folder, 4 * DAY)
    uri = first["registered"]["tracking_uri"]
    MlflowClient(uri).delete_registered_model("gc-other")  # B retired: nothing refers to its run and data
    (tmp / "a.yaml").write_text(yaml.safe_dump(a))
    (tmp / "b.yaml").write_text(yaml.safe_dump(b))
    return SimpleNamespace(
        tmp=tmp,
        root=root,
        a=a,
        b=b,
        uri=uri,
        runs=runs,
        data_a=data_a,
        data_b=data_b,
        groups_a=sorted(groups_a),
        groups_b=sorted(groups_b),
        manifest_b=second["manifest"],
        # B's cached results that point at its folders (its ingest points at raw files, its registration
        # at a model version: neither is B's data set or run)
        b_records={n for n in b_records if not n.startswith(("ingest-", "register-"))},
        third=third,
        foreign=foreign,
    )


def groups_of(manifest: str) -> set[Path]:
    """The file-group folders (`datasets/groups/<key>/`) whose shards a manifest lists."""
    listed = json.loads(Path(manifest).read_text())["shards"]
    return {(Path(manifest).parent / s["path"]).resolve().parent for s in listed}


def planned(store, keep=1) -> dict[str, str]:
    plan = plan_gc(validate_config(store.a), keep=keep)
    return {i.uri[len(str(store.root)) + 1 :]: i.why for i in plan.delete}


def test_deletion_order_puts_the_pointers_first():
    files = [
        "r/checkpoints/ckpt-000000005.pt",
        "r/config.yaml",
        "r/checkpoints/ckpt-000000005.json",
        "r/checkpoints/best.json",
        "r/result.json",
        "r/eval/x.png",
    ]
    item = Item("run", "r", [(f, 1, 0.0) for f in files], 0.0)
    assert deletion_order(item)[:3] == ["r/result.json", "r/checkpoints/best.json", "r/checkpoints/ckpt-000000005.json"]
    ds = Item("data set", "d", [(f, 1, 0.0) for f in ("d/g0-train.bin", "d/manifest.json", "d/a.keys.parquet")], 0.0)
    assert deletion_order(ds)[0] == "d/manifest.json"


@pytest.mark.e2e
def test_dry_run_lists_the_unreferenced_and_deletes_nothing(store):
    before = files_of(store.root, store.tmp / "raw-a", store.tmp / "raw-b")
    out = gc(store.tmp / "a.yaml", "--dry-run", "--keep", "1")
    assert out.code == 0, (out.out, out.exc)
    assert files_of(store.root, store.tmp / "raw-a", store.tmp / "raw-b") == before  # not a byte changed

    expected = (
        {f"runs/{store.runs[1].name}", f"datasets/{store.data_b.name}"}
        | {f"prefect-results/{n}" for n in store.b_records}
        | {f"datasets/groups/{g.name}" for g in store.groups_b}
    )
    plan = planned(store)
    assert set(plan) == expected
    assert "no registered version's run" in plan[f"runs/{store.runs[1].name}"]
    assert "no kept run trained on it" in plan[f"datasets/{store.data_b.name}"]
    doomed = [str(store.root / e) for e in expected]
    freed = sum(
        size for path, (size, _) in before.items() if any(path == d or path.startswith(d + "/") for d in doomed)
    )
    assert f"total: {len(expected)} item(s), {freed:,} bytes" in out.out
    assert "would delete (dry run: nothing is deleted)" in out.out
    for path in expected:
        assert path in out.out
    # why the rest is kept: A's first run is the champion's, the second a registered version and the newest
    assert f"runs/{store.runs[0].name}" in out.out and "registered: gc-model v1 @champion" in out.out
    # an MLflow server that is down: said in seconds (MLflow's own retries took about 4 minutes), nothing deleted
    from tests.net import free_port
    from tests.test_cli import shardline

    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_HTTP_REQUEST")}  # a fresh shell's
    t0 = time.monotonic()
    down = shardline(
        "gc", store.tmp / "a.yaml", "--set", f"mlflow.tracking_uri=http://127.0.0.1:{free_port()}", env=env, timeout=120
    )
    assert down.returncode == 1 and "cannot read the model registry" in down.stderr, down.stderr[-2000:]
    assert time.monotonic() - t0 < 60
    assert files_of(store.root, store.tmp / "raw-a", store.tmp / "raw-b") == before


@pytest.mark.e2e
def test_what_is_in_use_is_kept(store):
    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled, Pending, Running

    from shardline.flows.pipeline import pipeline
    from shardline.flows.train import train

    run_b, data_b = f"runs/{store.runs[1].name}", f"datasets/{store.data_b.name}"
    # modified a moment ago (a training writing its checkpoints): in use, with the data set it reads
    sidecar = sorted((store.runs[1] / "checkpoints").glob("ckpt-*.json"))[-1]
    os.utime(sidecar)
    try:
        plan = planned(store)
        assert run_b not in plan and data_b not in plan
        assert not any(n.startswith("prefect-results/") for n in plan)
        kept = {i.uri[len(str(store.root)) + 1 :]: i.why for i in plan_gc(validate_config(store.a), keep=1).keep}
        assert (
            kept[run_b].startswith("in use: modified")
            and kept[data_b] == f"kept run {store.runs[1].name} trained on it"
        )
    finally:
        age(sidecar, 2 * DAY)

    config_b = validate_config(store.b).model_dump(mode="json")
    with get_client(sync_client=True) as client:
        # a training flow run that is running (files untouched for hours: a long epoch) names its folder
        live = client.create_flow_run(
            train,
            parameters={"manifest_uri": store.manifest_b, "config": config_b, "run_folder": str(store.runs[1])},
            state=Running(),
        )
        try:
            kept = {i.uri[len(str(store.root)) + 1 :]: i.why for i in plan_gc(validate_config(store.a), keep=1).keep}
            assert kept[run_b] == f"in use by flow run {live.name} (train, Running)"
            assert kept[data_b] == kept[run_b]
        finally:
            client.set_flow_run_state(live.id, Cancelled(), force=True)
        # a pipeline about to start names only its config: what that config addresses is kept
        pending = client.create_flow_run(pipeline, parameters={"config": config_b, "force": None}, state=Pending())
        try:
            plan = planned(store)
            assert run_b not in plan and data_b not in plan
        finally:
            client.set_flow_run_state(pending.id, Cancelled(), force=True)
    assert run_b in planned(store)  # cancelled: no longer in use


@pytest.mark.e2e
def test_gc_leaves_what_it_did_not_write_and_knows_the_root_however_it_is_spelled(store):
    """A folder under datasets/ or runs/ holding no manifest, group record, shards, checkpoint or result is listed as
    left alone, never planned for deletion; the root spelled file://, with `..` or with `//` plans the very same
    deletions (compared as real paths), and the raw data stays out of them."""
    plain = planned(store)
    assert plain and not any(
        k.startswith(("datasets/holiday-photos", "runs/notes", "datasets/groups/raw-c")) for k in plain
    )
    left = {
        i.uri.rsplit("/", 1)[-1] for i in plan_gc(validate_config(store.a), keep=1).keep if "not Shardline's" in i.why
    }
    assert left == {"holiday-photos", "notes", "raw-c"}
    parent = store.root.parent
    for spelled in (f"file://{store.root}", f"{parent}/../{parent.name}/store", f"{parent}//store/"):
        cfg = {**store.a, "storage": {**store.a["storage"], "root": spelled}}
        plan = plan_gc(validate_config(cfg), keep=1)
        deleted = {os.path.realpath(storage.local_path(i.uri)) for i in plan.delete}
        assert deleted == {str(store.root / k) for k in plain}, spelled
    # the raw data under the root, spelled another way than the root: refused even if a plan named it
    from shardline.app.gc import GcError, Item, _check_inside

    raw = store.foreign[2] / "s-000.parquet"
    sneaky = Item("file group", f"file://{store.root}/datasets/groups/raw-c", [(f"file://{raw}", 1, None)], 0.0)
    with pytest.raises(GcError, match="it is raw data"):
        _check_inside(f"{parent}//store", f"{parent}/../{parent.name}/store/datasets/groups/raw-c/*.parquet", [sneaky])


def test_gc_deletes_them_and_the_champion_still_serves(store):
    import mlflow

    junk = store.root / "prefect-results" / "not-a-record"
    junk.write_text("{not json")
    age(junk, 4 * DAY)
    kept_before = files_of(
        store.runs[0], store.runs[2], store.data_a, *store.groups_a, store.tmp / "raw-a", store.tmp / "raw-b"
    )
    expected = planned(store)

    out = gc(store.tmp / "a.yaml", "--keep", "1")
    assert out.code == 0, (out.out, out.exc)
    assert "deleted:" in out.out and "bytes" in out.out and " freed" in out.out
    assert "not-a-record" in out.out and "could not be parsed" in out.out
    for path in expected:
        assert not (store.root / path).exists(), path
    assert junk.exists()  # an unparseable record is left alone
    assert not store.runs[1].exists() and not store.data_b.exists()
    assert not any(g.exists() for g in store.groups_b)  # B's shards in the group store went with it
    assert (
        files_of(store.runs[0], store.runs[2], store.data_a, *store.groups_a, store.tmp / "raw-a", store.tmp / "raw-b")
        == kept_before
    )
    assert (store.root / "mlflow.db").exists()
    assert all(folder.exists() and any(folder.iterdir()) for folder in store.foreign)  # someone else's: untouched
    assert "holiday-photos" in out.out and "not Shardline's" in out.out
    assert planned(store) == {}  # nothing left to delete

    # the champion still loads from the registry and predicts raw rows
    raw = pl.read_parquet(store.tmp / "raw-a" / "s-000.parquet")
    with fluent_tracking_uri(store.uri):
        preds = mlflow.pyfunc.load_model("models:/gc-model@champion").predict(raw.drop("label").to_pandas())
    assert len(preds) > 0 and "prediction" in preds.columns

    # A's config reruns fully from the cache
    again = run(store.a)
    assert again["steps"] == ALL_CACHED
    assert again["registered"]["version"] == store.third["registered"]["version"]


@pytest.mark.e2e
def test_a_deleted_version_frees_its_run_and_the_rerun_says_what_recomputes(store):
    """A's second run loses its registered version: gc --keep 0 deletes it and the cached results that
    point at it (the train step's among them). The champion's run stays; rerunning A finds it finished."""
    client = MlflowClient(store.uri)
    assert str(client.get_model_version_by_alias("gc-model", "champion").version) == "1"
    client.delete_model_version("gc-model", str(store.third["registered"]["version"]))
    age(store.runs[2], DAY)
    plan = planned(store, keep=0)
    assert f"runs/{store.runs[2].name}" in plan
    assert any(p.startswith("prefect-results/train-") for p in plan)  # the train step's record pointed at it
    assert f"runs/{store.runs[0].name}" not in plan and f"datasets/{store.data_a.name}" not in plan

    out = gc(store.tmp / "a.yaml", "--keep", "0")
    assert out.code == 0, (out.out, out.exc)
    assert not store.runs[2].exists() and store.runs[0].exists()

    again = run(store.a)
    # the train step's cached result went with the run it pointed at: the step runs, finds the champion's
    # run finished in its folder and returns it without training a step; everything after stays cached
    assert again["steps"] == {**ALL_CACHED, "train": "ran"}
    assert again["train"]["run_dir"] == str(store.runs[0])
    assert again["train"]["resumed_from"] is not None
    assert (again["registered"]["version"], again["registered"]["alias"]) == (1, "champion")


@pytest.fixture
def s3(s3_endpoint):  # noqa: F811 - the moto server of tests/test_s3_source.py
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.mkdir("lake")
    return fs


def test_gc_on_an_object_store(tmp_path, s3, prefect_api):
    """On S3 (a real moto server): listing, ages, what points at what, and the deletes, pointers first."""
    import json

    from shardline.app.gc import apply_plan

    root = "s3://lake/store"
    manifest = {"data_fingerprint": "f", "encoding_hash": "e", "shards": [{"path": "g0-train.bin", "sha256": "x"}]}
    files = {
        "datasets/d1/manifest.json": json.dumps(manifest),
        "datasets/d1/g0-train.bin": "0123456789",
        "runs/r1/result.json": json.dumps({"run_dir": f"{root}/runs/r1"}),
        "runs/r1/checkpoints/ckpt-000000002.json": json.dumps(
            {"run_meta": {"manifest": f"{root}/datasets/d1/manifest.json"}}
        ),
        "runs/r1/checkpoints/ckpt-000000002.pt": "weights",
        "prefect-results/train-1": json.dumps(
            {"metadata": {"serializer": {"type": "json"}}, "result": json.dumps({"run_dir": f"{root}/runs/r1"})}
        ),
        "prefect-results/ingest-1": json.dumps({"metadata": {"serializer": {"type": "json"}}, "result": "{}"}),
        "raw-not-ours/x.parquet": "raw",
    }
    for rel, text in files.items():
        s3.pipe_file(f"lake/store/{rel}", text.encode())
    cfg = validate_config(tiny_config("s3://lake/raw/*.parquet", root))
    cfg = cfg.model_copy(
        update={"mlflow": cfg.mlflow.model_copy(update={"tracking_uri": f"sqlite:///{tmp_path}/m.db"})}
    )

    assert plan_gc(cfg, keep=0).delete == []  # everything was written a moment ago: in use
    later = time.time() + 2 * DAY
    assert plan_gc(cfg, keep=1, now=later).delete == []  # the newest run and its data set
    plan = plan_gc(cfg, keep=0, now=later)
    assert [(i.kind, i.uri) for i in plan.delete] == [
        ("cached result", f"{root}/prefect-results/train-1"),
        ("run", f"{root}/runs/r1"),
        ("data set", f"{root}/datasets/d1"),
    ]
    assert plan.bytes == sum(len(t) for r, t in files.items() if not r.startswith(("raw", "prefect-results/ingest")))
    apply_plan(plan, now=later)
    left = sorted(p[len("lake/store/") :] for p in s3.find("lake/store"))
    assert left == ["prefect-results/ingest-1", "raw-not-ours/x.parquet"]


def test_a_file_group_a_new_data_set_takes_while_gc_runs_is_kept(tmp_path, prefect_api):
    """Between the plan and the deletes, an encode writes a data set that takes a stored file group the plan
    deletes (the data set that listed it is going): the group stays, its shards whole; the rest goes."""
    from shardline.app.gc import apply_plan

    root = tmp_path / "store"

    def data_set(name: str, groups: list[str]) -> None:
        shards = [{"path": f"../groups/{g}/s-train.bin", "sha256": "x"} for g in groups]
        (root / "datasets" / name).mkdir(parents=True)
        manifest = {"data_fingerprint": name, "encoding_hash": "e", "shards": shards}
        (root / "datasets" / name / "manifest.json").write_text(json.dumps(manifest))

    for g in ("g1", "g2"):
        (root / "datasets" / "groups" / g).mkdir(parents=True)
        (root / "datasets" / "groups" / g / "s-train.bin").write_bytes(b"0123456789")
    data_set("d1", ["g1", "g2"])
    cfg = validate_config(tiny_config(str(tmp_path / "raw" / "*.parquet"), str(root)))
    cfg = cfg.model_copy(
        update={"mlflow": cfg.mlflow.model_copy(update={"tracking_uri": f"sqlite:///{tmp_path}/m.db"})}
    )
    later = time.time() + 2 * DAY
    plan = plan_gc(cfg, keep=0, now=later)
    assert sorted((i.kind, i.name) for i in plan.delete) == [
        ("data set", "d1"),
        ("file group", "g1"),
        ("file group", "g2"),
    ]

    data_set("d2", ["g1"])  # an encode since gc looked: the same raw files' group, another data set
    done = apply_plan(plan, now=later)
    assert sorted((i.kind, i.name) for i in done.delete) == [("data set", "d1"), ("file group", "g2")]
    kept = {i.name: i.why for i in done.keep}
    assert kept["g1"] == "data set d2 lists its shards (since gc looked): kept"
    assert (root / "datasets" / "groups" / "g1" / "s-train.bin").read_bytes() == b"0123456789"
    assert not (root / "datasets" / "d1").exists() and not (root / "datasets" / "groups" / "g2").exists()


def test_a_live_text_fine_tune_pipeline_keeps_the_data_set_it_encodes(tmp_path, prefect_api):
    # a text fine-tune's data is tokenized with its parent's tokenizer, not data.tokenizer: the data set a live
    # (or about to start) pipeline of it uses is the one its encode wrote, and gc must find that one
    from prefect import flow

    from shardline.app.gc_usage import Locator, flow_run_uses
    from shardline.flows.pipeline import encoded_data
    from shardline.flows.train import train
    from tests.test_text_data import sentences

    root = tmp_path / "store"

    def config(raw: str, **training):
        pl.DataFrame({"body": sentences(200, len(raw))}).write_parquet(tmp_path / f"{raw}.parquet")
        data = {"source": str(tmp_path / f"{raw}.parquet"), "features": {"text": ["body"]}, "window": 8}
        return validate_config(
            {
                "data": data if training else {**data, "tokenizer": {"kind": "bpe", "vocab_size": 300}},
                "model": {"family": "transformer", "hidden": 16, "layers": 1, "heads": 2, "dropout": 0.0},
                "training": {"epochs": 1, "batch_size": 64, **training},
                "storage": {"root": str(root)},
                "mlflow": {"tracking_uri": f"sqlite:///{root}/mlflow.db", "experiment": "text"},
            }
        )

    @flow(name="gc-text-encode")
    def encode(cfg):
        return encoded_data(cfg)[1]

    lm = config("corpus")
    parent = train(encode(lm), lm)
    tuned = config("other-corpus", init_from=f"{parent.run_dir}/checkpoints")
    manifest = Path(encode(tuned))
    uses = flow_run_uses({"config": tuned.model_dump(mode="json")}, str(root), Locator(str(root)))
    assert manifest.parent.name in uses[0]
