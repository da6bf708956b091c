"""Several targets, every position, and no target: the loader reads each target as stored (once per
row: a window's targets at every position are a slice, as its features are), the contract checks the
shapes per target, and the whole pipeline trains, evaluates, registers and serves them."""

from __future__ import annotations

import io
import textwrap

import numpy as np
import polars as pl
import pytest
import torch

from shardline.core.config import ModelConfig, TrainingConfig, validate_config
from shardline.trainer.contract import DataSpec, ModelContractError, TargetInfo
from shardline.trainer.data import SplitData, WindowLoader
from shardline.trainer.loop import Callbacks, fit
from shardline.trainer.models import model_from_spec, model_spec_for
from tests.conftest import make_raw, split_targets, tiny_config
from tests.test_trainer import CARDS, K, make_arrays

quiet = lambda *a, **k: None


def two_targets(seed: int, lengths: list[int]) -> dict[str, np.ndarray]:
    """make_arrays' class target plus a second, regression target (`target_1`)."""
    arrays = make_arrays(seed, lengths)
    arrays["target_1"] = np.random.default_rng(seed + 100).standard_normal(sum(lengths)).astype(np.float32)
    return arrays


def test_every_position_reads_a_slice_of_each_stored_target():
    shards = [two_targets(0, [30, 25]), two_targets(1, [40])]
    h = 2
    last = SplitData(shards, K, h)
    every = SplitData(shards, K, h, positions="all")
    assert last.n_windows == every.n_windows  # the same windows: only what each one is asked changes
    assert last.tasks == every.tasks == ["classification", "regression"]
    idx = np.arange(every.n_windows)
    b_last, b_all = last.batch(idx), every.batch(idx)
    assert [tuple(t.shape) for t in b_all.targets] == [(len(idx), K), (len(idx), K)]
    assert [tuple(t.shape) for t in b_last.targets] == [(len(idx),), (len(idx),)]
    shard, start = every.locate(idx)
    for j in range(0, len(idx), 7):
        rows = start[j] + np.arange(K) + h  # position k's target: row start + k + horizon of its shard
        for i, name in enumerate(("target", "target_1")):
            np.testing.assert_array_equal(b_all.targets[i][j].numpy(), shards[shard[j]][name][rows])
        assert b_last.targets[0][j] == b_all.targets[0][j, -1]  # `last` is the last position
    # the loader hands out the same (batches are views of a gather), and targets() agrees
    loaded = torch.cat([b.targets[1] for b in WindowLoader(every, 16, seed=0, shuffle=False)])
    np.testing.assert_array_equal(loaded.numpy(), split_targets(every, 1))
    assert split_targets(every, 1).shape == (every.n_windows, K)


def _spec(positions: str) -> DataSpec:
    return DataSpec(
        continuous=["a", "b"],
        boolean=[],
        categorical=["c", "d"],
        cardinalities=list(CARDS),
        window=K,
        targets=[
            TargetInfo("target", "classification", 4, positions),
            TargetInfo("target_1", "regression", None, positions),
        ],
    )


def test_the_built_in_transformer_predicts_every_position_causally():
    spec = model_spec_for(ModelConfig(family="transformer", hidden=16, heads=4, layers=1, dropout=0.0), _spec("all"))
    model = model_from_spec(spec).eval()
    cont, cat = torch.randn(3, K, 2), torch.randint(1, 4, (3, K, 2))
    out = model(cont, cat)
    assert tuple(out["target"].shape) == (3, K, 4) and tuple(out["target_1"].shape) == (3, K)
    later = cont.clone()
    later[:, -1] += 5.0  # a change to the last frame changes no earlier position's prediction
    again = model(later, cat)
    assert torch.allclose(out["target"][:, :-1], again["target"][:, :-1], atol=1e-5)
    assert not torch.allclose(out["target"][:, -1], again["target"][:, -1])


def test_a_model_without_a_target_needs_its_own_loss_and_a_wrong_shape_names_the_positions(tmp_path):
    data = SplitData([make_arrays(0, [60, 40])], K, 1)
    del_target = [{k: v for k, v in make_arrays(s, [60, 40]).items() if k != "target"} for s in (0, 1)]
    no_target = SplitData(del_target[:1], K, 1), SplitData(del_target[1:], K, 1)
    assert no_target[0].n_targets == 0 and len(no_target[0].batch(np.arange(3)).targets) == 0
    none = DataSpec(["a", "b"], [], ["c", "d"], list(CARDS), K, [])
    cfg = TrainingConfig(epochs=1, batch_size=16, device="cpu", precision="fp32", warmup_steps=0)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "__init__.py").write_text("")
    (tmp_path / "models" / "plain.py").write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn

            class Plain(nn.Module):
                def __init__(self, spec):
                    super().__init__()
                    self.spec = spec
                    self.lin = nn.Linear(spec.n_cont, 4)

                def forward(self, cont, cat):
                    if self.spec.targets:  # [B, 4] although every position is asked: a wrong shape
                        return {"target": self.lin(cont[:, -1])}
                    return {"z": self.lin(cont)}
            """
        )
    )
    model = ModelConfig(entrypoint="models.plain:Plain", code_dir=str(tmp_path))
    with pytest.raises(ModelContractError, match="has no loss.*no target"):
        fit(*no_target, model_spec_for(model, none), cfg, None, str(tmp_path / "a"), callbacks=Callbacks(log=quiet))
    every = DataSpec(["a", "b"], [], ["c", "d"], list(CARDS), K, [TargetInfo("target", "classification", 4, "all")])
    all_data = (
        SplitData([make_arrays(0, [60, 40])], K, 1, positions="all"),
        SplitData([make_arrays(1, [50])], K, 1, positions="all"),
    )
    with pytest.raises(
        ModelContractError, match=r"'target' .* shape \[16, 4\], expected \[16, 4, 4\] .*one per position of the window"
    ):
        fit(
            *all_data,
            model_spec_for(model, every),
            cfg,
            "classification",
            str(tmp_path / "b"),
            callbacks=Callbacks(log=quiet),
        )
    # the data and the model must agree on the positions
    with pytest.raises(ValueError, match="positions 'last', the model spec at 'all'"):
        fit(
            data,
            data,
            model_spec_for(model, every),
            cfg,
            "classification",
            str(tmp_path / "c"),
            callbacks=Callbacks(log=quiet),
        )
    import sys

    sys.modules.pop("models.plain", None)
    sys.modules.pop("models", None)
    sys.path.remove(str(tmp_path))


PER_POSITION = '''
"""A GRU that predicts two targets at every position of the window (it only looks back: causal)."""

from torch import nn


class EveryStep(nn.Module):
    def __init__(self, spec, hidden=16):
        super().__init__()
        self.targets = spec.targets
        self.embed = nn.ModuleList(nn.Embedding(c, 4) for c in spec.cardinalities)
        self.gru = nn.GRU(spec.n_cont + 4 * len(spec.cardinalities), hidden, batch_first=True)
        self.heads = nn.ModuleDict(
            {t.name: nn.Linear(hidden, t.n_classes if t.kind == "classification" else 1) for t in spec.targets}
        )

    def forward(self, cont, cat):
        import torch

        h, _ = self.gru(torch.cat([cont, *(e(cat[..., i]) for i, e in enumerate(self.embed))], dim=-1))
        out = {}
        for t in self.targets:
            y = self.heads[t.name](h)  # [B, K, ...]: every position
            out[t.name] = y if t.kind == "classification" else y[..., 0]
        return out
'''


@pytest.mark.e2e
def test_several_targets_at_every_position_through_the_pipeline(tmp_path, prefect_api):
    """Two targets (a class and a value) predicted at every position of the window by a user's model:
    shards hold each target once per row, evaluation scores each target over every position against its
    baseline, and the registered model predicts one row per window and position."""
    import mlflow
    from mlflow import MlflowClient

    from shardline.core import storage
    from shardline.core.manifest import Manifest
    from shardline.flows.pipeline import pipeline

    make_raw(tmp_path / "raw", n_seq=15, rows=80)
    (tmp_path / "proj" / "models").mkdir(parents=True)
    (tmp_path / "proj" / "models" / "__init__.py").write_text("")
    (tmp_path / "proj" / "models" / "steps.py").write_text(PER_POSITION)
    root = tmp_path / "store"
    raw = tiny_config(str(tmp_path / "raw" / "*.parquet"), str(root), **{"training.epochs": 4})
    raw["data"].pop("target")
    raw["data"]["targets"] = [{"column": "label", "task": "classification"}, {"column": "value", "task": "regression"}]
    raw["data"]["target_positions"] = "all"
    raw["model"] = {"entrypoint": "models.steps:EveryStep", "code_dir": str(tmp_path / "proj")}
    raw["training"]["loss_weights"] = {"value": 0.5}
    result = pipeline(validate_config(raw))

    manifest = Manifest.model_validate_json(storage.read_text(result["manifest"]))
    assert [t.column for t in manifest.encoding.targets] == ["label", "value"]
    for info in manifest.shards:  # each target stored once per row, not once per window position
        assert info.arrays["target"].shape == [info.rows] and info.arrays["target_1"].shape == [info.rows]

    metrics = result["metrics"]
    # label is the previous row's kind: at every position the GRU has seen it; value is noise around the
    # row's own (unseen) kind
    assert metrics["label/accuracy"] > 0.9 > 0.5 > result["baseline"]["label/accuracy"]
    assert {"value/rmse", "value/mae", "value/r2", "label/log_loss"} <= set(metrics)
    assert result["registered"]["promotion_metric"] == "label/accuracy"

    client = MlflowClient(result["registered"]["tracking_uri"])
    run = client.get_run(result["registered"]["run_id"])
    assert "epoch/val_label/accuracy" in run.data.metrics and "epoch/val_value/mae" in run.data.metrics
    mlflow.set_tracking_uri(result["registered"]["tracking_uri"])
    model = mlflow.pyfunc.load_model(result["registered"]["model_uri"])
    rows = pl.read_parquet(sorted((tmp_path / "raw").glob("*.parquet"))[0]).filter(pl.col("seq") == "s000").head(10)
    preds = pl.from_pandas(model.predict(rows.drop("label", "value").to_pandas()))
    windows = 10 - K_RAW - 1 + 1  # window 3, horizon 1
    assert preds.height == windows * K_RAW
    assert preds.columns == ["seq", "t", "position", "label", "label_probability", "value"]
    assert preds["position"].to_list() == list(range(K_RAW)) * windows
    # each position keyed by the row it predicts (they all carried the window's last, so a join on the key paired
    # positions 0..K-2 with other rows): window i, position k predicts the row at t = i + horizon + k
    windows_t = [i + 1 + k for i in range(windows) for k in range(K_RAW)]
    assert preds["t"].to_list() == windows_t
    kinds = dict(zip(rows["t"].to_list(), rows["kind"].to_list()))  # label is the previous row's kind
    truth = np.array([kinds[t - 1] for t in preds["t"].to_list()])  # the label of row t, joined on its key
    assert (np.array(preds["label"].to_list()) == truth).mean() > 0.8
    written = pl.read_parquet(
        io.BytesIO(storage.read_bytes(result["train"]["run_dir"] + "/eval/test_predictions.parquet"))
    )
    assert written["position"].max() == K_RAW - 1
    # the evaluation's predictions too: within a window, the positions' rows are consecutive, the last the window's
    first = written.filter(pl.col("seq") == written["seq"][0]).head(K_RAW)
    assert first["position"].to_list() == list(range(K_RAW)) and first["t"].diff().drop_nulls().to_list() == [1] * 2


K_RAW = 3  # tiny_config's window
