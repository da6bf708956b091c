"""Fine-tuning from the registry through the real pipeline: a registered model is the starting point of
another run (`training.init_from: models:/name@alias`) with its backbone frozen; the new version is
tagged with its parent, and the frozen tensors are the parent's, bit for bit."""

import pytest
import torch
from mlflow import MlflowClient

from shardline.core import storage
from shardline.core.config import validate_config
from shardline.core.manifest import Manifest
from shardline.trainer.checkpoint import load_checkpoint
from tests.conftest import make_raw, tiny_config

pytestmark = pytest.mark.e2e


def test_fine_tune_a_registered_model_with_a_frozen_backbone(tmp_path, prefect_api):
    from shardline.flows.pipeline import pipeline

    make_raw(tmp_path / "raw", n_seq=15, rows=80)
    root = str(tmp_path / "store")
    source = str(tmp_path / "raw" / "*.parquet")
    parent = pipeline(validate_config(tiny_config(source, root)))
    assert parent["registered"]["version"] == 1

    tuned_cfg = tiny_config(
        source,
        root,
        **{
            "training.init_from": "models:/tiny-model@champion",
            "training.freeze": ["frames.", "body."],
            "training.lr": 0.02,
        },
    )
    tuned = pipeline(validate_config(tuned_cfg))
    assert tuned["steps"]["train"] == "ran"
    # the data is the parent's encoding of the same shards: nothing re-encoded, only a manifest beside
    own, reused = (Manifest.model_validate_json(storage.read_text(m["manifest"])) for m in (parent, tuned))
    assert tuned["manifest"] != parent["manifest"] and tuned["manifest"].endswith(".json")
    assert [s.sha256 for s in own.shards] == [s.sha256 for s in reused.shards]
    assert reused.encoding == own.encoding
    client = MlflowClient(tuned["registered"]["tracking_uri"])
    version = client.get_model_version("tiny-model", str(tuned["registered"]["version"]))
    assert version.tags["shardline.parent"] == "models:/tiny-model/1"  # @champion, as it was when the run began
    assert version.tags["shardline.parent_name"] == "tiny-model" and version.tags["shardline.parent_version"] == "1"
    assert version.tags["shardline.parent_run_id"] == parent["registered"]["run_id"]
    run = client.get_run(version.run_id)
    assert int(run.data.tags["shardline.init_from.loaded"]) > 0 and run.data.tags["shardline.init_from.skipped"] == "0"
    assert "init_from.json" in {a.path for a in client.list_artifacts(version.run_id)}

    before = load_checkpoint(parent["train"]["best_checkpoint"])["model"]
    after = load_checkpoint(tuned["train"]["best_checkpoint"])["model"]
    frozen = [k for k in before if k.startswith(("frames.", "body."))]
    assert frozen and all(torch.equal(before[k], after[k]) for k in frozen)
    assert not torch.equal(before["head.weight"], after["head.weight"])

    # a parent that does not exist is named, with where it was looked for
    missing = tiny_config(source, root, **{"training.init_from": "models:/no-such-model@champion"})
    with pytest.raises(ValueError, match=r"training.init_from=models:/no-such-model@champion: no such registered"):
        pipeline(validate_config(missing))


def test_a_fine_tune_encodes_new_data_with_its_parents_encoding(tmp_path, prefect_api):
    """New data (other sequences, other statistics) is encoded with the parent's scalings and
    vocabularies; a column the parent was not trained on is refused before any work, naming it."""
    from shardline.flows.pipeline import pipeline

    make_raw(tmp_path / "raw", n_seq=12, rows=60)
    make_raw(tmp_path / "new", n_seq=9, rows=60, seed=5, prefix="n")
    root = str(tmp_path / "store")
    parent = pipeline(validate_config(tiny_config(str(tmp_path / "raw" / "*.parquet"), root)))
    new_source = str(tmp_path / "new" / "*.parquet")
    fresh = pipeline(validate_config(tiny_config(new_source, root, **{"mlflow.model_name": "fresh"})))
    over = {"training.init_from": "models:/tiny-model@champion", "mlflow.model_name": "tuned"}
    tuned = pipeline(validate_config(tiny_config(new_source, root, **over)))
    first, own, reused = (
        Manifest.model_validate_json(storage.read_text(r["manifest"])).encoding for r in (parent, fresh, tuned)
    )
    assert own.continuous != first.continuous  # the new data alone would be scaled otherwise
    assert reused.continuous == first.continuous and reused.categorical == first.categorical
    assert reused.targets == first.targets

    cfg = tiny_config(new_source, root, **over)
    cfg["data"]["features"]["continuous"] = ["x", "y", "value"]
    with pytest.raises(ValueError, match=r"data.features.continuous has 'value', which the model it starts from"):
        pipeline(validate_config(cfg))
    cfg = tiny_config(new_source, root, **over)
    cfg["data"]["features"]["continuous"] = ["y", "x"]
    with pytest.raises(ValueError, match=r"is \['y', 'x'\], the encoding of .* has \['x', 'y'\] \(another order\)"):
        pipeline(validate_config(cfg))


def test_new_categories_in_a_fine_tunes_data_are_said_with_their_share_of_its_training_rows(tmp_path):
    """A fine-tune keeps its parent's vocabularies: new items in its data are all one unknown id, which it cannot
    learn apart. Said at the encode, per column, with how many training rows they take (it was silent)."""
    import polars as pl

    from shardline.core.encoding.write import stored_group
    from shardline.tasks.encode import encode_dataset, log_unknown_to_parent
    from shardline.tasks.ingest import snapshot_source

    make_raw(tmp_path / "raw", n_seq=6, rows=40)
    make_raw(tmp_path / "new", n_seq=6, rows=40, seed=5, prefix="n")
    for path in (tmp_path / "new").glob("*.parquet"):  # a kind the parent never had, in every other row
        frame = pl.read_parquet(path)
        frame.with_columns(
            pl.when(pl.int_range(pl.len()) % 2 == 0).then(pl.lit("new")).otherwise("kind").alias("kind")
        ).write_parquet(path)
    encoded = {}
    for name in ("raw", "new"):
        data = validate_config(tiny_config(str(tmp_path / name / "*.parquet"), str(tmp_path / "store"))).data
        out = tmp_path / f"enc-{name}"
        uri = encode_dataset(snapshot_source(data), data, str(out))
        groups = [stored_group(str(out / "groups"), p.name) for p in (out / "groups").iterdir()]
        encoded[name] = (Manifest.model_validate_json(storage.read_text(uri)), groups)

    class Said(list):  # what the encode's log is given
        def warning(self, text, *args):
            self.append(text % args)

    said = log = Said()
    parent, (_, new_groups) = encoded["raw"][0], encoded["new"]
    assert log_unknown_to_parent(parent, new_groups, log) == {
        "kind": pytest.approx(encoded["new"][0].rows["train"] / 2, rel=0.2)
    }
    assert len(said) == 1 and "'kind' holds 1 value(s)" in said[0] and "never saw, e.g. new:" in said[0], said
    assert log_unknown_to_parent(parent, encoded["raw"][1], log) == {}  # its own data: nothing new
