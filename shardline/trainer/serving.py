"""Predictions for raw rows: the encoding and the network travel together, so a registered model
takes the same raw parquet columns the pipeline was trained on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import polars as pl

from shardline.core.config import FILE_SEQUENCE
from shardline.core.encoding.columns import ORDER, SEQ, DataError, prepare
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

    return DataSpec(
        continuous=[c.name for c in spec.continuous],
        boolean=list(spec.boolean),
        categorical=[v.name for v in spec.categorical],
        cardinalities=spec.cat_cardinalities,
        window=spec.window,
        targets=[
            TargetInfo(t.column, t.task, t.n_outputs if t.task == "classification" else None, spec.target_positions)
            for t in spec.targets
        ],
    )


def input_columns(spec: EncodingSpec) -> list[str]:
    """Raw columns a prediction needs (the target is not one of them), and the id columns it passes through."""
    cols = [c.name for c in spec.continuous] + list(spec.boolean) + [v.name for v in spec.categorical]
    for c in (spec.sequence_key, spec.order_by, *spec.id_columns):
        if c and c != FILE_SEQUENCE and c not in cols:
            cols.append(c)
    return cols


def key_columns(spec: EncodingSpec) -> list[str]:
    """Columns that identify a prediction's row in the input: sequence key and order (or `row`)."""
    keys = []
    if spec.sequence_key and spec.sequence_key != FILE_SEQUENCE:
        keys.append(spec.sequence_key)
    keys += [c for c in spec.id_columns if c not in keys]
    keys.append(spec.order_by or "row")
    return keys


_INTEGERS = {"Int8", "Int16", "Int32", "Int64", "UInt8", "UInt16", "UInt32", "UInt64"}


def class_labels(t) -> pl.Series:
    """A class target's labels by id, in the raw column's type (id 0, a class never seen in training: null
    for a typed column, `<unseen>` for text)."""
    texts = pl.Series(t.column, ["<unseen>", *(t.classes or [])], dtype=pl.Utf8)
    if t.dtype in _INTEGERS:
        return texts.cast(getattr(pl, t.dtype), strict=False)
    if t.dtype == "Boolean":
        return pl.Series(t.column, [None, *((c == "true") for c in (t.classes or []))], dtype=pl.Boolean)
    return texts


def decode_outputs(spec: EncodingSpec, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Network outputs (`predict`: per target) -> user-facing columns, one row per window, or per window and
    position (window-major) when every position is predicted: `prediction` (the class, in the target's own
    type, or the value) and `probability` (classes) for one target; `<target>` and `<target>_probability`
    for several; `position` (0 is the window's first row) is added by `prediction_frame`."""
    cols: dict[str, np.ndarray] = {}
    # by position: the model's targets are the encoding's, in order (a model saved before the contract
    # names its one target `target`)
    for t, y in zip(spec.targets, outputs.values()):
        name = "prediction" if len(spec.targets) == 1 else t.column
        if t.task == "classification":
            y = y.reshape(-1, y.shape[-1])
            ids = y.argmax(axis=1)
            cols[name] = class_labels(t)[ids]
            prob = "probability" if len(spec.targets) == 1 else f"{t.column}_probability"
            cols[prob] = y[np.arange(len(ids)), ids].astype(np.float32)
        else:
            cols[name] = y.reshape(-1).astype(np.float64) * t.std + t.mean
    return cols


def example_outputs(spec: EncodingSpec) -> dict[str, np.ndarray]:
    """What `predict` returns for one window (zeros, class 1 most likely): to show the predictions' columns
    and types (the registered model's signature) without a model."""
    out = {}
    lead = (1, spec.window) if spec.target_positions == "all" else (1,)
    for t in spec.targets:
        if t.task == "classification":
            y = np.zeros((*lead, t.n_outputs), np.float32)
            y[..., min(1, t.n_outputs - 1)] = 1.0
        else:
            y = np.zeros(lead if spec.target_positions == "all" else (1, 1), np.float32)
        out[t.column] = y
    return out


def prediction_frame(spec: EncodingSpec, keys: dict[str, object], outputs: dict[str, np.ndarray]) -> pl.DataFrame:
    """Key columns (one value per window) beside the decoded predictions; each window's key repeated for
    its K positions, with `position`, when every position is predicted."""
    every = spec.target_positions == "all" and spec.targets
    k = spec.window if every else 1
    out: dict[str, object] = {}
    for name, values in keys.items():
        series = values if isinstance(values, pl.Series) else pl.Series(name, values)
        out[name] = series.gather(np.repeat(np.arange(len(series)), k)) if k > 1 else series
    if every:
        n = len(next(iter(keys.values()))) if keys else 0
        out["position"] = np.tile(np.arange(k, dtype=np.int64), n)
    out.update(decode_outputs(spec, outputs))
    return pl.DataFrame(out)


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
        prepared = prepare(df, spec.sequence_key, spec.order_by, "input", spec.order_format)
        prepared = prepared.sort([SEQ, ORDER], maintain_order=True)  # the rows as the encoding lays them out
        arrays, _ = encode_frame(prepared, spec, with_target=False, presorted=True)
        data = SplitData([arrays], spec.window, spec.horizon, positions=spec.target_positions)
        where = data.window_keys()
        if not data.n_windows and df.height:
            k = spec.window + spec.horizon
            raise DataError(
                f"0 predictions: every sequence in the input has fewer than {k} rows (data.window={spec.window} "
                f"rows of history + data.horizon={spec.horizon}); pass the history too (several files, or a glob "
                "or a folder of them, to `shardline predict`)"
            )
        # each prediction keyed by the row it is for, in the input's own types (a join needs no cast)
        rows = pl.Series(where["row"])
        out: dict[str, object] = {}
        for c in (seq_col, *spec.id_columns):
            if c and c not in out:
                out[c] = prepared[c].gather(rows)
        if spec.order_by:
            out[spec.order_by] = prepared[spec.order_by].gather(rows)
        else:
            out["row"] = pl.Series("row", where["order"])
        return prediction_frame(spec, out, predict(self.model, data, batch_size=batch_size))
