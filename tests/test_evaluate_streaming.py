"""Evaluation streams: on small real runs (encoded shards, a trained checkpoint) it reports what the
whole-array evaluation reported, metric for metric, and writes the same predictions; on a test split whose
class probabilities alone would take over a gigabyte, a child process evaluates it in a few hundred MB."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from polars.testing import assert_frame_equal

from shardline.core import storage
from shardline.core.config import validate_config
from shardline.core.manifest import Manifest
from shardline.core.metrics import scores as M
from shardline.core.metrics.split_ranking import SplitRanking
from shardline.tasks.encode import encode_dataset
from shardline.tasks.evaluate import evaluate_model, train_statistic
from shardline.tasks.ingest import snapshot_source
from shardline.trainer.data import open_split
from shardline.trainer.inference import load_model, predict
from shardline.trainer.loop import Callbacks, FitOptions, fit
from shardline.trainer.models import model_spec_for
from shardline.trainer.serving import data_spec, prediction_frame
from tests.conftest import make_raw, split_targets, tiny_config

REPO = Path(__file__).resolve().parents[1]
EXACT = ("accuracy", "top5_accuracy", "macro_f1")


def train_run(tmp_path: Path, cfg_dict: dict) -> tuple[str, dict, object]:
    """Encode the config's raw files and train its model (no Prefect: the functions the tasks call);
    returns the manifest URI, what the train step would hand to evaluate, and the config."""
    cfg = validate_config(cfg_dict)
    uri = encode_dataset(snapshot_source(cfg.data), cfg.data, str(tmp_path / "store" / "datasets" / "d"), threads=1)
    manifest = Manifest.model_validate_json(Path(uri).read_text())
    spec = manifest.encoding
    training = cfg.training.model_copy(update={"device": "cpu", "precision": "fp32"})
    result = fit(
        open_split(manifest, uri, "train"),
        open_split(manifest, uri, "validation"),
        model_spec_for(cfg.model, data_spec(spec)),
        training,
        spec.targets[0].task if spec.targets else None,
        str(tmp_path / "checkpoints"),
        callbacks=Callbacks(log=lambda *a: None),
        options=FitOptions(ranking=SplitRanking.of_validation(manifest, uri, "validation", cfg.evaluation.k)),
    )
    return uri, result, cfg


def whole_array_evaluation(manifest_uri: str, checkpoint: str) -> tuple[dict, dict, pl.DataFrame]:
    """Evaluation as it was before it streamed, the reference: every window's outputs in memory, the
    whole-array metrics, the majority baseline as an [N, C] table, and the predictions as one frame."""
    manifest = Manifest.model_validate_json(Path(manifest_uri).read_text())
    spec = manifest.encoding
    test = open_split(manifest, manifest_uri, "test")
    outputs = predict(load_model(checkpoint), test)
    metrics, baseline = {}, {}
    for i, (t, out) in enumerate(zip(spec.targets, outputs.values())):
        stat = train_statistic(manifest, i, t)
        y = split_targets(test, i)
        if t.task == "classification":
            y, probs = y.reshape(-1).astype(np.int64), out.reshape(-1, out.shape[-1])
            m = M.classification_metrics(y, probs)
            b = M.classification_metrics(y, M.majority_baseline_probs(stat, len(y)))
            if t.n_outputs - 1 <= M.TOP_K:
                m.pop("top5_accuracy"), b.pop("top5_accuracy")
        else:
            y_raw = y.reshape(-1).astype(np.float64) * t.std + t.mean
            m = M.regression_metrics(y_raw, out.reshape(-1).astype(np.float64) * t.std + t.mean)
            b = M.regression_metrics(y_raw, np.full(len(y_raw), float(stat)))
        name = f"{t.column}/" if len(spec.targets) > 1 else ""
        metrics.update({name + k: v for k, v in m.items()})
        baseline.update({name + k: v for k, v in b.items()})
    where = test.window_keys()
    folder = manifest_uri.rsplit("/", 1)[0]
    keys = [
        pl.read_parquet(io.BytesIO(storage.read_bytes(storage.resolve(folder, s.keys_path))))["sequence"].to_list()
        for s in manifest.shards_of("test")
    ]
    # every position predicted: each position keyed by the row it predicts, K-1-p rows before the window's last
    k = spec.window if spec.target_positions == "all" else 1
    shard, segment = np.repeat(where["shard"], k), np.repeat(where["segment"], k)
    row = (where["row"][:, None] - (k - 1) + np.arange(k)).reshape(-1)
    order = np.empty_like(row)
    for s in np.unique(shard):
        order[shard == s] = test.view(int(s)).order_of_rows(row[shard == s])
    columns = {
        spec.sequence_key: [keys[s][g] for s, g in zip(shard.tolist(), segment.tolist())],
        spec.order_by: order,
    }
    return metrics, baseline, prediction_frame(spec, columns, outputs, per_position=k > 1)


def assert_same_scores(streamed: dict, reference: dict) -> None:
    assert streamed.keys() == reference.keys()
    for key, want in reference.items():
        if key.rsplit("/", 1)[-1] in EXACT:
            assert streamed[key] == want, key
        else:
            assert streamed[key] == pytest.approx(want, rel=1e-9, abs=1e-12), key


def test_window_keys_of_chosen_windows_are_those_of_the_whole_listing():
    """Evaluation looks the keys up a batch at a time; any windows, in any order, across shards."""
    from shardline.trainer.data import SplitData
    from shardline.trainer.inference import window_keys_of

    def shard(rows: int, cut: int) -> dict:
        return {
            "cont": np.zeros((rows, 2), np.float32),
            "cat": np.zeros((rows, 1), np.int16),
            "target": np.zeros(rows, np.int16),
            "offsets": np.array([0, cut, rows]),
            "order": np.arange(rows) * 10,
        }

    data = SplitData([shard(10, 6), shard(12, 5)], 3, 1)
    whole = data.window_keys()
    for idx in (np.array([7, 0, 3, 8, 2]), np.arange(data.n_windows), np.zeros(0, np.int64)):
        chosen = window_keys_of(data, idx)
        assert all(np.array_equal(chosen[k], whole[k][idx]) for k in whole)


def test_evaluations_code_is_not_part_of_what_addresses_a_training_run():
    """The train step's code version names a run's folder: an edit to evaluation's pass must not train
    every model again (nor re-run the encode)."""
    from shardline.core.version import TRAINER, module_closure

    inference = REPO / "shardline" / "trainer" / "inference.py"
    assert inference in module_closure("shardline.tasks.evaluate")
    assert all(inference not in module_closure(m) for m in TRAINER)  # what the train cache and run folder key on
    assert inference not in module_closure("shardline.core.encoding.write")  # what the encode keys on (encoder_code)


SEVERAL = {
    "data.targets": [{"column": "label", "task": "classification"}, {"column": "value", "task": "regression"}],
    "data.target_positions": "all",
    "model": {"family": "transformer", "hidden": 16, "layers": 1, "heads": 2, "dropout": 0.0},
}


@pytest.mark.parametrize(
    "over, plots",
    [
        ({}, ["confusion_matrix.png", "per_class.csv"]),
        ({"data.target": {"column": "value", "task": "regression"}}, ["residuals.png"]),
        (SEVERAL, ["label_confusion_matrix.png", "label_per_class.csv", "value_residuals.png"]),
    ],
    ids=["classification", "regression", "several-targets-every-position"],
)
def test_streamed_evaluation_reports_what_the_whole_array_evaluation_did(tmp_path, over, plots):
    make_raw(tmp_path / "raw", n_seq=15, rows=80)
    cfg = tiny_config(str(tmp_path / "raw" / "*.parquet"), str(tmp_path / "store"), **{"training.epochs": 1, **over})
    if "data.targets" in over:  # instead of the one-target shorthand
        cfg["data"].pop("target")
    uri, trained, config = train_run(tmp_path, cfg)

    result = evaluate_model(uri, trained, config, tmp_path / "eval")
    metrics, baseline, predictions = whole_array_evaluation(uri, trained.best_checkpoint)

    assert_same_scores(result["metrics"], metrics)
    assert_same_scores(result["baseline"], baseline)
    assert (
        result["test_windows"] == open_split(Manifest.model_validate_json(Path(uri).read_text()), uri, "test").n_windows
    )
    assert [Path(f).name for f in result["files"]] == ["learning_curves.png", *plots, "test_predictions.parquet"]
    written = pl.read_parquet(tmp_path / "eval" / "test_predictions.parquet")
    truth = [c for c in written.columns if c == "truth" or c.endswith("_truth")]
    assert_frame_equal(written.drop(truth), predictions)
    # beside each prediction, its row's own target as the raw file has it: a join on the keys finds the same value
    targets = config.data.target_list
    raw = pl.concat([pl.read_parquet(f) for f in sorted((tmp_path / "raw").glob("*.parquet"))])
    raw = raw.select("seq", "t", *(pl.col(t.column).alias(f"raw {t.column}") for t in targets))
    joined = written.join(raw, on=["seq", "t"], how="left")
    assert truth == (["truth"] if len(targets) == 1 else [f"{t.column}_truth" for t in targets])
    for t, name in zip(targets, truth):
        want = joined[f"raw {t.column}"]
        if t.task == "classification":
            assert joined[name].dtype == want.dtype and (joined[name] == want).all(), name
        else:
            assert np.allclose(joined[name].to_numpy(), want.to_numpy(), rtol=1e-5, atol=1e-5), name
    assert sorted(p.name for p in (tmp_path / "eval").iterdir()) == sorted(Path(f).name for f in result["files"])
    assert all(f"| {name} |" in result["table"] for name in metrics)

    # a class target's per-class table: every class (id 0 'unseen' too), most test samples first, read from the
    # same counts as its metrics (the mean of its F1s is the macro F1; its supports add up to the scored labels)
    for table in (f for f in plots if f.endswith("per_class.csv")):
        per_class = pl.read_csv(tmp_path / "eval" / table, schema_overrides={"class": pl.String})
        name = "label/" if "data.targets" in over else ""
        assert per_class.columns == ["class", "support", "predicted", "precision", "recall", "f1"]
        assert sorted(per_class["class"]) == ["<unseen>", "a", "b", "c"]
        assert per_class["support"].to_list() == sorted(per_class["support"], reverse=True)
        assert per_class["support"].sum() == per_class["predicted"].sum() > 0
        assert per_class["f1"].mean() == pytest.approx(metrics[name + "macro_f1"], rel=1e-12)


OWN_LOSS = '''
"""No target: the model learns to predict each window's last continuous features from the rows before."""

import torch
from torch import nn


class NextRow(nn.Module):
    def __init__(self, spec):
        super().__init__()
        self.lin = nn.Linear(spec.n_cont, spec.n_cont)

    def forward(self, cont, cat):
        return {"next": self.lin(cont[:, -2])}

    def loss(self, outputs, cont, cat, targets):
        return nn.functional.mse_loss(outputs["next"], cont[:, -1].float())
'''


def test_a_model_without_a_target_is_scored_by_its_own_loss_and_its_predictions_are_the_keys(tmp_path):
    (tmp_path / "proj" / "selfsup").mkdir(parents=True)
    (tmp_path / "proj" / "selfsup" / "__init__.py").write_text("")
    (tmp_path / "proj" / "selfsup" / "next_row.py").write_text(textwrap.dedent(OWN_LOSS))
    make_raw(tmp_path / "raw", n_seq=15, rows=80)
    cfg = tiny_config(str(tmp_path / "raw" / "*.parquet"), str(tmp_path / "store"), **{"training.epochs": 1})
    cfg["data"].pop("target")
    cfg["data"]["targets"] = []
    cfg["model"] = {"entrypoint": "selfsup.next_row:NextRow", "code_dir": str(tmp_path / "proj")}
    cfg["mlflow"]["promotion_metric"] = "loss"
    try:
        uri, trained, config = train_run(tmp_path, cfg)
        result = evaluate_model(uri, trained, config, tmp_path / "eval")
        _, _, predictions = whole_array_evaluation(uri, trained.best_checkpoint)
    finally:
        for name in [m for m in sys.modules if m == "selfsup" or m.startswith("selfsup.")]:
            del sys.modules[name]
        if str(tmp_path / "proj") in sys.path:
            sys.path.remove(str(tmp_path / "proj"))
    assert set(result["metrics"]) == {"loss"} and result["metrics"]["loss"] > 0 and result["baseline"] == {}
    written = pl.read_parquet(tmp_path / "eval" / "test_predictions.parquet")
    assert written.columns == ["seq", "t"] and written.height == result["test_windows"] > 0
    assert_frame_equal(written, predictions)


# ---------------------------------------------------------------- memory: does not grow with the test split

CLASSES = 400
# the process's own high-water mark of resident memory (VmHWM: reset by exec, unlike ru_maxrss, which
# carries over the RSS of the forked parent, here pytest's); torch imported before the count starts, so it counts
# evaluation (or prediction) only
CHILD_HEAD = """
import json, sys
from pathlib import Path

from shardline.core.config import validate_config
from shardline.trainer.loop import FitResult

def high_water_kib():
    status = Path("/proc/self/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmHWM:")).split()[1])

run = json.loads(Path(sys.argv[1]).read_text())
config = validate_config(run["config"])
"""
MEMORY_CHILD = (
    CHILD_HEAD
    + """
from shardline.tasks.evaluate import evaluate_model

before = high_water_kib()
result = evaluate_model(run["manifest"], FitResult(**run["trained"]), config, Path(sys.argv[2]))
peak = high_water_kib()
print(json.dumps({"before_kib": before, "peak_kib": peak, "test_windows": result["test_windows"],
                  "metrics": result["metrics"]}))
"""
)
# `shardline predict`'s own path (the registered model's `Predictor.predict_frame`) over raw rows already read
PREDICT_CHILD = (
    CHILD_HEAD
    + """
import polars as pl

from shardline.core.manifest import Manifest
from shardline.core.storage import read_text
from shardline.trainer.inference import load_model
from shardline.trainer.models import model_spec_for
from shardline.trainer.serving import Predictor, data_spec

spec = Manifest.model_validate_json(read_text(run["manifest"])).encoding
model = load_model(run["trained"]["best_checkpoint"], model_spec_for(config.model, data_spec(spec)))
rows = pl.read_parquet(sys.argv[2])
before = high_water_kib()
predictions = Predictor(spec, model).predict_frame(rows)
peak = high_water_kib()
print(json.dumps({"before_kib": before, "peak_kib": peak, "rows": rows.height, "predictions": predictions.height}))
"""
)


def many_classes_raw(folder: Path, n_seq: int, rows: int) -> None:
    """Sequences whose `label` takes one of 400 values (skewed, as the demo's actions are)."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    names = np.array([f"c{i:03d}" for i in range(CLASSES)])
    for f in range(0, n_seq, 40):
        seqs = range(f, min(f + 40, n_seq))
        n = rows * len(seqs)
        pl.DataFrame(
            {
                "seq": np.repeat([f"s{i:04d}" for i in seqs], rows),
                "t": np.tile(np.arange(rows, dtype=np.int32), len(seqs)),
                "x": rng.normal(size=n).astype(np.float32),
                "y": rng.normal(size=n),
                "flag": rng.random(n) > 0.5,
                "kind": rng.choice(["a", "b", "c"], size=n),
                "label": names[np.minimum(rng.zipf(1.3, size=n) - 1, CLASSES - 1)],
            }
        ).write_parquet(folder / f"part-{f // 40:03d}.parquet")


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads the peak RSS from /proc (Linux)")
def test_evaluation_memory_does_not_grow_with_the_test_split(tmp_path):
    """~740k test windows x 401 classes: the probabilities alone, as the whole-array evaluation held them
    (float32), are over 1.1 GB, and it then made float64 copies of them and of a baseline table as large
    (its peak here was 8.2 GB). The streamed evaluation, in a fresh process, adds under 300 MB to what the
    process held before it started (what remains per window: a few integers of the split's index and its
    memory-mapped rows)."""
    many_classes_raw(tmp_path / "raw", n_seq=400, rows=1950)
    cfg = tiny_config(
        str(tmp_path / "raw" / "*.parquet"),
        str(tmp_path / "store"),
        **{
            "data.split.fractions": {"train": 0.03, "validation": 0.02, "test": 0.95},
            "training.batch_size": 1024,
            "training.epochs": 1,
            "training.checkpoint_every_steps": 1000,
            "model.hidden": 8,
        },
    )
    uri, trained, _ = train_run(tmp_path, cfg)
    run = {"manifest": uri, "trained": dataclasses.asdict(trained), "config": cfg}
    (tmp_path / "run.json").write_text(json.dumps(run))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}

    def child(code: str, arg: Path) -> dict:
        """`code` run in a fresh process on the run, its report."""
        done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "run.json"), str(arg)], capture_output=True,
                              text=True, env=env, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads(done.stdout.strip().splitlines()[-1])

    report = child(MEMORY_CHILD, tmp_path / "eval")

    probs_bytes = report["test_windows"] * (CLASSES + 1) * 4  # what the whole-array path held first
    assert probs_bytes > 1.1e9, report
    peak, grown = report["peak_kib"] * 1024, (report["peak_kib"] - report["before_kib"]) * 1024
    mib = lambda b: f"{b / 2**20:.0f} MiB"
    print(f"\nevaluation of {report['test_windows']} windows: peak RSS {mib(peak)}, grew {mib(grown)}")
    assert grown < 300 * 2**20, report  # measured: ~190 MiB (~130 MiB at a seventh of the windows)
    assert peak < 0.75 * probs_bytes, report  # the whole process: less than the old path's probabilities alone
    assert (
        pl.scan_parquet(tmp_path / "eval" / "test_predictions.parquet").select(pl.len()).collect().item()
        == (report["test_windows"])
    )

    # `shardline predict` over every raw row (~780k windows x 401 classes): its predictions are decoded a batch at a
    # time too (it held every window's probabilities, 1.25 GB here, and grew by 1.4 GB)
    report = child(PREDICT_CHILD, tmp_path / "raw" / "*.parquet")
    grown = (report["peak_kib"] - report["before_kib"]) * 1024
    print(f"predict over {report['rows']} rows: peak RSS {mib(report['peak_kib'] * 1024)}, grew {mib(grown)}")
    assert report["predictions"] == 400 * (1950 - cfg["data"]["window"] - cfg["data"].get("horizon", 1) + 1), report
    assert grown < 0.4 * report["predictions"] * (CLASSES + 1) * 4, report  # less than the probabilities alone
