"""Predictions for raw rows: the encoding and the network travel together, so a registered model
takes the same raw parquet columns the pipeline was trained on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import polars as pl

from shardline.core.config import FILE_SEQUENCE
from shardline.core.encoding.columns import DataError, prepare
from shardline.core.encoding.frame import encode_frame
from shardline.core.manifest import EncodingSpec

if TYPE_CHECKING:
    from shardline.trainer.contract import DataSpec


def bundle_dict(spec: EncodingSpec, model_spec: dict, extra: dict | None = None) -> dict:
    return {"format": 1, "encoding": spec.model_dump(mode="json"), "model_spec": model_spec, **(extra or {})}


def data_spec(spec: EncodingSpec) -> DataSpec:
    """What a model sees of an encoded data set (the model contract's `spec`)."""
    # imported here: the contract imports torch, which the pipeline's import (a cached rerun) must not pay for
    from shardline.trainer.contract import DataSpec, TargetInfo

    t = spec.target
    return DataSpec(
        continuous=[c.name for c in spec.continuous],
        boolean=list(spec.boolean),
        categorical=[v.name for v in spec.categorical],
        cardinalities=spec.cat_cardinalities,
        window=spec.window,
        targets=[TargetInfo(t.column, t.task, t.n_outputs if t.task == "classification" else None)],
    )


def input_columns(spec: EncodingSpec) -> list[str]:
    """Raw columns a prediction needs (the target is not one of them)."""
    cols = [c.name for c in spec.continuous] + list(spec.boolean) + [v.name for v in spec.categorical]
    for c in (spec.sequence_key, spec.order_by):
        if c and c != FILE_SEQUENCE and c not in cols:
            cols.append(c)
    return cols


def key_columns(spec: EncodingSpec) -> list[str]:
    """Columns that identify a prediction's row in the input: sequence key and order (or `row`)."""
    keys = []
    if spec.sequence_key and spec.sequence_key != FILE_SEQUENCE:
        keys.append(spec.sequence_key)
    keys.append(spec.order_by or "row")
    return keys


def decode_outputs(spec: EncodingSpec, outputs: np.ndarray) -> dict[str, np.ndarray]:
    """Network outputs -> user-facing columns: `prediction` (+ `probability` for classes)."""
    t = spec.target
    if t.task == "classification":
        ids = outputs.argmax(axis=1)
        labels = np.array(["<unseen>", *(t.classes or [])], dtype=object)
        return {"prediction": labels[ids], "probability": outputs[np.arange(len(ids)), ids].astype(np.float32)}
    return {"prediction": (outputs[:, 0].astype(np.float64) * t.std + t.mean)}


class Predictor:
    def __init__(self, spec: EncodingSpec, model):
        self.spec = spec
        self.model = model

    @classmethod
    def from_files(cls, bundle_path: str | Path, weights_path: str | Path) -> Predictor:
        import torch

        from shardline.trainer.models import model_from_spec

        bundle = json.loads(Path(bundle_path).read_text())
        spec = EncodingSpec.model_validate(bundle["encoding"])
        model = model_from_spec(bundle["model_spec"], code_dir=None)  # the user's code travels with the model
        model.load_state_dict(torch.load(weights_path, map_location="cpu", weights_only=True))
        model.eval()
        return cls(spec, model)

    def predict_frame(self, df: pl.DataFrame, batch_size: int = 4096) -> pl.DataFrame:
        """One prediction per window the rows contain (each row with K rows of history in its sequence)."""
        from shardline.trainer.data import SplitData
        from shardline.trainer.loop import predict

        spec = self.spec
        missing = [c for c in input_columns(spec) if c not in df.columns]
        if missing:
            raise DataError(
                f"the input lacks column(s) {missing} that the model was trained on; add them (the model's "
                "signature lists every input column)"
            )
        seq_col = spec.sequence_key if spec.sequence_key not in (None, FILE_SEQUENCE) else None
        key_dtype = df[seq_col].dtype if seq_col else None
        prepared = prepare(df, spec.sequence_key, spec.order_by, "input")
        arrays, keys = encode_frame(prepared, spec, with_target=False)
        data = SplitData([arrays], spec.window, spec.horizon)
        where = data.window_keys()
        out: dict[str, object] = {}
        if seq_col:
            out[seq_col] = pl.Series(seq_col, [keys[i] for i in where["segment"].tolist()], dtype=pl.Utf8).cast(
                key_dtype
            )
        order_name = spec.order_by or "row"
        order_vals = pl.Series(order_name, where["order"])
        out[order_name] = order_vals.cast(df[spec.order_by].dtype) if spec.order_by else order_vals
        outputs = (
            predict(self.model, data, batch_size=batch_size)
            if data.n_windows
            else np.zeros((0, spec.target.n_outputs), np.float32)
        )
        out.update(decode_outputs(spec, outputs))
        return pl.DataFrame(out)
