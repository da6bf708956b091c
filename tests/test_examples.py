"""The examples run as their READMEs say, in a folder outside the repository, through the real pipeline
(Prefect, MLflow, PyTorch), and do what the READMEs claim."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from shardline.core.metrics.report import format_number
from tests.conftest import api_env

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"


def readme_commands(example: str, block: int = 0) -> list[str]:
    """The commands of the README's ```bash block number `block` (the first by default), as a user copies them."""
    text = (EXAMPLES / example / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    assert len(blocks) > block, f"examples/{example}/README.md has no ```bash block number {block + 1}"
    return [line for line in blocks[block].splitlines() if line.strip() and not line.startswith("#")]


def run_commands(commands: list[str], folder: Path, env_extra: dict | None = None) -> str:
    """Run a README's commands in `folder` as a user would; their output."""
    # the session's Prefect API (tests.conftest.api_env), not a temporary server per command
    env = api_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", **(env_extra or {}))
    env["PYTHONPATH"] = str(REPO)  # this checkout's shardline, not whichever one is installed (a worktree's)
    out = ""
    for command in commands:
        done = subprocess.run(command, shell=True, cwd=folder, env=env, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"`{command}` failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        out += done.stdout
    return out


def run_example(example: str, tmp_path: Path) -> Path:
    folder = tmp_path / example
    shutil.copytree(EXAMPLES / example, folder, ignore=shutil.ignore_patterns("data", "store", "__pycache__"))
    run_commands(readme_commands(example), folder)
    return folder


def client_for(folder: Path):
    from mlflow import MlflowClient

    return MlflowClient(f"sqlite:///{folder / 'store' / 'mlflow.db'}")


def weights_of(client, name: str, version: str, dst: Path) -> dict[str, torch.Tensor]:
    import mlflow

    mlflow.set_tracking_uri(client._tracking_client.tracking_uri)
    local = mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{name}/{version}", dst_path=str(dst))
    return torch.load(Path(local) / "artifacts" / "weights.pt", map_location="cpu", weights_only=True)


def test_world_model_example(tmp_path, prefect_api):
    folder = run_example("world_model", tmp_path)
    client = client_for(folder)
    version = client.get_model_version_by_alias("world-model", "champion")
    metrics = client.get_run(version.run_id).data.metrics
    # every target has its own metrics and baseline, named with it
    for name in ("p1_action/accuracy", "p1_x/rmse", "p1_y/r2", "p1_on_ground/accuracy"):
        assert f"test/{name}" in metrics and f"test/{name}_baseline" in metrics, name
    assert metrics["test/p1_action/accuracy"] > 3 * metrics["test/p1_action/accuracy_baseline"]
    assert metrics["test/p1_x/r2"] > 0.5 and metrics["test/p1_y/r2"] > 0.5  # the baseline's r2 is about 0
    assert metrics["test/p1_on_ground/accuracy"] > metrics["test/p1_on_ground/accuracy_baseline"]
    # the promotion metric names its target (its tag rounded for reading, the run's metric in full)
    assert version.tags["metric.p1_action/accuracy"] == format_number(metrics["test/p1_action/accuracy"])
    plots = {a.path for a in client.list_artifacts(version.run_id, "evaluation")}
    assert {
        "evaluation/p1_action_confusion_matrix.png",
        "evaluation/p1_action_per_class.csv",
        "evaluation/p1_x_residuals.png",
    } <= plots

    # the registered model predicts raw rows in a fresh process, in another folder, where models/ is not
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    script = (
        "import mlflow, polars as pl, sys\n"
        "try:\n    import models\n    sys.exit('the example folder is importable here')\n"
        "except ImportError:\n    pass\n"
        f"mlflow.set_tracking_uri('sqlite:///{folder / 'store' / 'mlflow.db'}')\n"
        "model = mlflow.pyfunc.load_model('models:/world-model@champion')\n"
        f"rows = pl.read_parquet('{folder / 'data' / 'raw' / 'game-00000.parquet'}').head(40)\n"
        "pl.from_pandas(model.predict(rows.to_pandas())).write_parquet('preds.parquet')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=elsewhere, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    import polars as pl

    preds = pl.read_parquet(elsewhere / "preds.parquet")
    assert preds.height == 40 - 8  # one per window of 8 frames with a next frame
    assert preds.columns == [
        "game_id",
        "frame",
        "p1_action",
        "p1_action_probability",
        "p1_x",
        "p1_y",
        "p1_on_ground",
        "p1_on_ground_probability",
    ]
    # classes come back in the target's own type: a join or a comparison needs no cast
    raw = pl.read_parquet(folder / "data" / "raw" / "game-00000.parquet")
    assert preds.schema["p1_on_ground"] == pl.Boolean and preds.schema["p1_action"] == raw.schema["p1_action"]
    assert preds["p1_x"].is_finite().all() and preds["p1_action_probability"].is_between(0, 1).all()


def test_pretrain_finetune_example(tmp_path, prefect_api):
    folder = run_example("pretrain_finetune", tmp_path)
    client = client_for(folder)
    parent = client.get_model_version_by_alias("masked-pretrain", "champion")
    parent_metrics = client.get_run(parent.run_id).data.metrics
    # no target: the model's own loss and metrics are its evaluation
    assert {"test/loss", "test/masked_mse", "test/masked_cross_entropy"} <= set(parent_metrics)
    assert parent_metrics["test/masked_mse"] < 0.5  # the training mean would score about 1.0
    assert parent.tags["metric.loss"] == format_number(parent_metrics["test/loss"])

    child = client.get_model_version_by_alias("p1-action-finetuned", "champion")
    assert child.tags["shardline.parent"] == "models:/masked-pretrain/1"  # @champion, as it was when the run began
    assert (child.tags["shardline.parent_name"], child.tags["shardline.parent_version"]) == (
        "masked-pretrain",
        str(parent.version),
    )
    assert child.tags["shardline.parent_run_id"] == parent.run_id
    metrics = client.get_run(child.run_id).data.metrics
    assert metrics["test/accuracy"] > 3 * metrics["test/accuracy_baseline"]

    # the frozen backbone is the parent's, bit for bit; the head is new and trained
    mine = weights_of(client, "p1-action-finetuned", child.version, tmp_path / "child")
    theirs = weights_of(client, "masked-pretrain", parent.version, tmp_path / "parent")
    backbone = [k for k in mine if k.startswith("backbone.")]
    assert backbone and all(torch.equal(mine[k], theirs[k]) for k in backbone)
    assert any(k.startswith("heads.") for k in mine) and not any(k.startswith("heads.") for k in theirs)
    init = client.download_artifacts(child.run_id, "init_from.json", str(tmp_path))
    import json

    record = json.loads(Path(init).read_text())
    assert set(backbone) <= set(record["loaded"]) and any(k.startswith("heads.") for k in record["new"])


def test_two_tower_example(tmp_path, prefect_api):
    import polars as pl

    from shardline.core.metrics.ranking import ranking_metrics

    folder = run_example("two_tower", tmp_path)
    client = client_for(folder)
    version = client.get_model_version_by_alias("two-tower", "champion")
    metrics = client.get_run(version.run_id).data.metrics
    # promoted on nDCG@10 (MLflow names spell the @ out), well above the popularity baseline
    assert version.tags["metric.ndcg_at_10"] == format_number(metrics["test/ndcg_at_10"])
    model, popularity = metrics["test/ndcg_at_10"], metrics["test/ndcg_at_10_baseline"]
    assert model > popularity + 0.1
    # popularity is a real competitor: well above a random order of each session
    predictions = pl.read_parquet(next((folder / "store" / "runs").glob("*/eval/test_predictions.parquet")))
    shuffled = ranking_metrics(
        predictions["session_id"], np.zeros(predictions.height), predictions["relevance"], [10], ties="average"
    )
    assert popularity > shuffled["ndcg@10"] + 0.08
    # the README's figures are what a run measures (to the digits another machine's arithmetic may move)
    readme = (EXAMPLES / "two_tower" / "README.md").read_text()
    shown = re.search(r"\| ndcg@10 \| ([\d.]+) \| ([\d.]+) \| model \|", readme)
    assert shown and float(shown.group(1)) == pytest.approx(model, abs=0.02)
    assert float(shown.group(2)) == pytest.approx(popularity, abs=0.02)

    # "Tuning it": the k-fold sweep of the README's second block, on the same folder and data
    out = run_commands(readme_commands("two_tower", block=1), folder)
    best = re.search(r"^  (s\d+) +([\d.]+) ± ([\d.]+) +(\S+) +<- best$", out, re.M)
    assert best and best.group(4) == re.search(r"The chosen setting is \*\*`(\S+)`\*\*", readme).group(1), out
    assert "the best setting retrained on all non-test data (training.fold: null) as trial 'final'" in out
    tuned = client.get_model_version("two-tower", "2")  # the final retrain, through the same gate
    assert tuned.tags["shardline.sweep.trial"] == "final" and tuned.tags["shardline.sweep.overrides"]
    tuned_metrics = client.get_run(tuned.run_id).data.metrics
    claimed = re.search(r"\| ndcg@10 \(tuned, 1 epoch\) \| ([\d.]+) \| ([\d.]+) \| model \|", readme)
    assert claimed and float(claimed.group(1)) == pytest.approx(tuned_metrics["test/ndcg_at_10"], abs=0.02)
    assert float(claimed.group(2)) == pytest.approx(tuned_metrics["test/ndcg_at_10_baseline"], abs=0.02)
    # as the README says: below the 2-epoch champion, so registered as the challenger, the champion kept
    assert tuned_metrics["test/ndcg_at_10"] < model
    assert client.get_model_version_by_alias("two-tower", "champion").version == version.version
    assert str(client.get_model_version_by_alias("two-tower", "challenger").version) == "2"


def test_small_lm_example(tmp_path, prefect_api):
    """The README's commands at test size (300 docstrings, 30 steps, 10 test generations: the README's own
    sizes take minutes): both models run the whole pipeline, register, and generate in a fresh process."""
    folder = tmp_path / "small_lm"
    shutil.copytree(EXAMPLES / "small_lm", folder, ignore=shutil.ignore_patterns("data", "store", "__pycache__"))
    small = " --set training.max_steps_per_epoch=30 --set evaluation.max_generations=10 --set training.warmup_steps=2"
    # the summarizer's 11 steps an epoch at this size: two epochs beat the unigram baseline (its @champion)
    epochs = {"pretrain.yaml": 1, "summarize.yaml": 2}
    commands = [
        f"{c}{small} --set training.epochs={epochs[c.split()[2]]}" if c.startswith("shardline run") else c
        for c in readme_commands("small_lm")
    ]
    assert sum(c.startswith("shardline run") for c in commands) == 2
    assert sum(c.startswith("shardline generate") for c in commands) >= 2
    generating = [c for c in commands if c.startswith("shardline generate")]
    run_commands([c for c in commands if c not in generating], folder, {"SMALL_LM_ROWS": "300"})
    client = client_for(folder)
    lm = client.get_run(client.get_model_version_by_alias("small-lm", "champion").run_id).data.metrics
    assert lm["test/perplexity"] < lm["test/perplexity_baseline"]  # below the unigram model's, even this small
    summarizer = client.get_model_version_by_alias("docstring-summarizer", "champion")
    metrics = client.get_run(summarizer.run_id).data.metrics
    assert 0 <= metrics["test/exact_match"] <= metrics["test/token_f1"] <= 1
    # beside the baseline that answers every body with the training summaries' commonest
    assert 0 <= metrics["test/exact_match_baseline"] <= metrics["test/token_f1_baseline"] <= 1
    files = {a.path for a in client.list_artifacts(summarizer.run_id, "evaluation")}
    assert "evaluation/generations.csv" in files
    # each `shardline generate`, a fresh process, prints what the registered model's predict writes for that
    # prompt and those params (a tiny model's text: poor, at this size often only line breaks)
    import shlex

    import mlflow
    import pandas as pd
    import polars as pl

    mlflow.set_tracking_uri(f"sqlite:///{folder / 'store' / 'mlflow.db'}")
    options = {"--max-tokens": "max_tokens", "--temperature": "temperature", "--top-k": "top_k", "--seed": "seed"}
    for command in generating:
        words = shlex.split(command)
        given = dict(zip(words[3::2], words[4::2]))
        model = mlflow.pyfunc.load_model(words[2])
        (column,) = model.unwrap_python_model().predictor.spec.text.columns
        params = {options[k]: float(v) if k == "--temperature" else int(v) for k, v in given.items() if k in options}
        want = model.predict(pd.DataFrame({column: [given["--prompt"]]}), params=params)["generated"][0]
        assert run_commands([command], folder) == want + "\n", command
    assert len(generating) >= 3 and any("--temperature" in c for c in generating)
    # `shardline predict` on the text model: each row's next token, and as many new tokens as --max-tokens asks
    # (0: none: scoring many rows need not generate 32 tokens for each)
    model = mlflow.pyfunc.load_model("models:/small-lm@champion")
    (column,) = model.unwrap_python_model().predictor.spec.text.columns
    rows = pd.DataFrame({column: ["def add(a, b):", "class Point:", "return the"]})
    pl.from_pandas(rows).write_parquet(folder / "rows.parquet")
    tracking = f"--tracking-uri sqlite:///{folder / 'store' / 'mlflow.db'}"
    for n in (0, 2):
        run_commands([f"shardline predict models:/small-lm@champion rows.parquet --out p{n}.parquet --max-tokens {n} "
                      f"{tracking}"], folder)  # fmt: skip
        got = pl.read_parquet(folder / f"p{n}.parquet")
        want = model.predict(rows, params={"max_tokens": n})
        assert got["generated"].to_list() == list(want["generated"]) and got["next_token"].null_count() == 0
    assert set(pl.read_parquet(folder / "p0.parquet")["generated"]) == {""}


@pytest.mark.parametrize("example", ["world_model", "pretrain_finetune", "two_tower", "small_lm"])
def test_example_readme_names_only_files_it_ships(example):
    """The configs the README runs are in the folder, and the code their entrypoints name is too."""
    import yaml

    blocks = (EXAMPLES / example / "README.md").read_text().count("```bash")
    for command in [c for b in range(blocks) for c in readme_commands(example, b)]:
        for word in command.split():
            if word.endswith(".yaml"):
                config = yaml.safe_load((EXAMPLES / example / word).read_text())
                entry = config.get("model", {}).get("entrypoint")
                if entry:
                    assert (EXAMPLES / example / (entry.split(":")[0].replace(".", "/") + ".py")).exists(), entry
