"""What earlier versions wrote stays readable: a model registered and a checkpoint written before the
code moved into layers (tests/data/registered-before-layers/README.md) load and predict the same."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import polars as pl
from polars.testing import assert_frame_equal

DATA = Path(__file__).resolve().parent / "data" / "registered-before-layers"


def test_a_model_registered_before_the_layers_predicts_the_same_in_a_fresh_process(tmp_path):
    """Loaded by MLflow in a fresh process, from another folder: its logged code imports
    `shardline.predicting`, which must still give the Predictor."""
    out = tmp_path / "predictions.parquet"
    code = (
        "import sys, mlflow, polars as pl\n"
        f"model = mlflow.pyfunc.load_model({str(DATA / 'model')!r})\n"
        f"frame = pl.read_parquet({str(DATA / 'input.parquet')!r}).to_pandas()\n"
        f"pl.from_pandas(model.predict(frame)).write_parquet({str(out)!r})\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert_frame_equal(pl.read_parquet(out), pl.read_parquet(DATA / "expected.parquet"))


def test_a_checkpoint_written_before_the_layers_loads_and_predicts_the_same():
    from shardline.core.manifest import EncodingSpec
    from shardline.trainer.inference import load_model
    from shardline.trainer.serving import Predictor

    bundle = json.loads((DATA / "model" / "artifacts" / "bundle.json").read_text())
    model = load_model(str(DATA / "checkpoint"))  # its best checkpoint, checked against its sidecar
    predictor = Predictor(EncodingSpec.model_validate(bundle["encoding"]), model)
    got = predictor.predict_frame(pl.read_parquet(DATA / "input.parquet"))
    assert_frame_equal(got, pl.read_parquet(DATA / "expected.parquet"))


OLD_DATASET = Path(__file__).resolve().parent / "data" / "dataset-before-group-store"


def test_a_data_set_written_before_the_group_store_reads_as_today_s_encode(tmp_path):
    """A data set of encoder version 4 (its shards beside its manifest, no group store) still verifies and
    reads, and holds, window for window, what today's encode of the same raw files gives (its groups
    stored by content in `datasets/groups/`)."""
    import shutil

    import numpy as np
    import torch

    from shardline.core.config import validate_config
    from shardline.core.encoding.write import verify_manifest
    from shardline.core.manifest import Manifest
    from shardline.tasks.encode import encode_dataset
    from shardline.tasks.ingest import snapshot_source
    from shardline.trainer.data import open_split
    from tests.conftest import tiny_config

    old_uri = str(tmp_path / "old" / "manifest.json")
    shutil.copytree(OLD_DATASET / "store" / "datasets" / "v4", tmp_path / "old")
    old = verify_manifest(old_uri, deep=True)
    assert old is not None and all("/" not in s.path for s in old.shards)

    cfg = validate_config(tiny_config(str(OLD_DATASET / "raw" / "*.parquet"), str(tmp_path / "store")))
    new_uri = encode_dataset(snapshot_source(cfg.data), cfg.data, str(tmp_path / "store" / "datasets" / "new"))
    new = Manifest.model_validate_json(Path(new_uri).read_text())
    assert all(s.path.startswith("groups/") for s in new.shards)
    assert new.encoding == old.encoding and new.rows == old.rows and new.windows == old.windows
    for split in ("train", "validation", "test"):
        a, b = open_split(old, old_uri, split), open_split(new, new_uri, split)
        assert a.n_windows == b.n_windows > 0
        ba, bb = a.batch(np.arange(a.n_windows)), b.batch(np.arange(b.n_windows))
        assert torch.equal(ba.cont, bb.cont) and torch.equal(ba.cat, bb.cat)
        assert all(torch.equal(x, y) for x, y in zip(ba.targets, bb.targets, strict=True))
