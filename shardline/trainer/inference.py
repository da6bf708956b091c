"""A trained model at work: loaded from a checkpoint (`load_model`), its outputs over a split (`predict`), or a
batch at a time with the keys of the batch's windows: evaluation's one pass over the test split, in memory that
does not grow with the split.

Kept apart from `loop.py` and `data.py` on purpose: those are part of the train step's code version,
which addresses a training run's folder (`shardline/runs/training_run.py: run_dir`), so an edit to
them trains every model again; this module is evaluation's alone.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch
from torch import nn

from shardline.trainer.checkpoint import best_checkpoint, latest_checkpoint, load_checkpoint
from shardline.trainer.contract import TargetInfo, as_outputs
from shardline.trainer.data import Batch, SplitData, WindowLoader
from shardline.trainer.models import data_spec_of, model_from_spec
from shardline.trainer.validate import masked_logits


def _output_shape(t: TargetInfo, n: int, window: int) -> tuple[int, ...]:
    """A target's outputs for `n` windows as `predict` gives them: the contract's shape, a value per window
    as [n, 1]."""
    shape = t.expected_shape(n, window)
    return (*shape, 1) if t.kind == "regression" and t.positions != "all" else shape


OUTPUT_VALUES = 1 << 24  # a batch's outputs at most (64 MB of float32): a target of 36,000 classes takes 466 windows


def predict_batches(
    model: nn.Module, data: SplitData, batch_size: int = 4096
) -> Iterator[tuple[int, Batch, dict[str, np.ndarray]]]:
    """The split's windows in window order, a batch at a time: (its first window's number, the batch as
    stored, each target's outputs for its windows as `predict` gives them). Only one batch's outputs are held
    at a time, of at most `OUTPUT_VALUES` values: fewer windows than `batch_size` for targets of many classes
    (whose scoring copies a batch's probabilities in float64). A model without a target is not run: it has no
    outputs to give."""
    device = next(model.parameters()).device
    spec = data_spec_of(model.shardline_spec)
    width = sum(int(np.prod(_output_shape(t, 1, spec.window))) for t in spec.targets)
    batch_size = max(1, min(batch_size, OUTPUT_VALUES // max(width, 1)))
    was_training = model.training
    model.eval()
    first = 0
    try:
        for batch in WindowLoader(data, batch_size, seed=0, shuffle=False):
            out = {}
            if spec.targets:
                b = batch.to(device)
                with torch.inference_mode():
                    outputs = as_outputs(model(b.cont, b.cat), spec)
                    for t in spec.targets:
                        y = outputs[t.name].float()
                        if t.kind == "classification":
                            y = torch.softmax(masked_logits(y), dim=-1)
                        out[t.name] = y.reshape(_output_shape(t, len(b), spec.window)).cpu().numpy()
            yield first, batch, out
            first += len(batch)
    finally:
        model.train(was_training)


def position_rows(row: np.ndarray, k: int) -> np.ndarray:
    """Each window's K predicted rows, window-major, from its last one (`row`): position p of a window that
    predicts every position predicts the row K-1-p rows before its last (the rows of one sequence)."""
    return (np.repeat(row, k) - (k - 1) + np.tile(np.arange(k, dtype=row.dtype), len(row))).astype(row.dtype)


def window_keys_of(data: SplitData, idx: np.ndarray, positions: int = 1) -> dict[str, np.ndarray]:
    """`data.window_keys()` of the windows numbered `idx` only, in that order: each one's shard, the
    segment (sequence) of its target row in that shard, the target row and that row's `order` value.
    `positions` K > 1 (every position predicted): each position's, window-major (`position_rows`)."""
    held = data.open_shards  # the loader's: left as they are
    try:
        shard, row = data.target_rows_of(idx)
        if positions > 1:
            shard, row = np.repeat(shard, positions), position_rows(row, positions)
        segment, order = np.empty_like(row), np.empty_like(row)
        for s in np.unique(shard):
            sel = shard == s
            view = data.view(int(s))
            segment[sel] = np.searchsorted(np.asarray(view.arrays["offsets"]), row[sel], side="right") - 1
            order[sel] = view.order_of_rows(row[sel])
    finally:
        # a streamed shard the loader had already let go of (it released it with the batch's gather)
        # is opened again here: released again, or a pass over a split larger than the cache fills it
        data.release(held)
    return {"shard": shard.astype(np.int64), "segment": segment, "row": row, "order": order}


def load_model(checkpoint_uri: str, spec: dict | None = None) -> nn.Module:
    """The model `spec` describes (the pipeline builds it from its config, never from what storage says: a
    checkpoint names a model entrypoint and a code folder, which would decide what code is imported), with the
    weights of a checkpoint (a .pt URI, or a checkpoint folder: its best) whose own spec must be the same; in
    eval mode. `spec` None: the checkpoint's own, only for a checkpoint the caller wrote itself (a test)."""
    if not checkpoint_uri.endswith(".pt"):
        found = best_checkpoint(checkpoint_uri) or latest_checkpoint(checkpoint_uri)
        if found is None:
            raise FileNotFoundError(f"no complete checkpoint in {checkpoint_uri}")
        checkpoint_uri = found[0]
    ckpt = load_checkpoint(checkpoint_uri)
    saved = ckpt.get("model_spec")
    spec = saved if spec is None else spec

    def where_from_aside(s: dict | None) -> dict | None:  # the folder code is imported from is the config's
        return s and {**s, "model": {k: v for k, v in s.get("model", {}).items() if k != "code_dir"}}

    if where_from_aside(saved) != where_from_aside(spec):
        said = {k: (saved or {}).get("model", {}).get(k) for k in ("entrypoint", "code_dir", "family")}
        want = {k: spec.get("model", {}).get(k) for k in ("entrypoint", "code_dir", "family")}
        raise ValueError(
            f"{checkpoint_uri} was saved for another model than the config describes (the checkpoint: {said}; the "
            f"config: {want}{'' if said != want else '; their settings or data differ'}): its weights are not "
            "loaded and nothing it names is imported. Train this config again (shardline run CONFIG --force train)"
        )
    model = model_from_spec(spec)
    model.load_state_dict(ckpt["model"])
    return model.eval()


def predict(model: nn.Module, data: SplitData, batch_size: int = 4096) -> dict[str, np.ndarray]:
    """Each target's outputs in window order, float32: class probabilities with class 0 (unseen) at 0,
    [N, n_classes] (or [N, K, n_classes] at every position), or standardised values [N, 1] (or [N, K])."""
    spec = data_spec_of(model.shardline_spec)
    out = {t.name: np.empty(_output_shape(t, data.n_windows, spec.window), np.float32) for t in spec.targets}
    for first, batch, outputs in predict_batches(model, data, batch_size):
        for name, y in outputs.items():
            out[name][first : first + len(batch)] = y
    return out
