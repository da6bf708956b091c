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
    from shardline.trainer.loop import load_model
    from shardline.trainer.serving import Predictor

    bundle = json.loads((DATA / "model" / "artifacts" / "bundle.json").read_text())
    model = load_model(str(DATA / "checkpoint"))  # its best checkpoint, checked against its sidecar
    predictor = Predictor(EncodingSpec.model_validate(bundle["encoding"]), model)
    got = predictor.predict_frame(pl.read_parquet(DATA / "input.parquet"))
    assert_frame_equal(got, pl.read_parquet(DATA / "expected.parquet"))
