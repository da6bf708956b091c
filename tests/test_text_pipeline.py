"""Text data through the whole pipeline: a text column is ingested, tokenized into token shards, a causal
`transformer` pre-trains on them (one epoch), evaluation reports its perplexity against the unigram baseline's,
and the registered model, with its tokenizer bundled, loads in-process and reads raw text rows."""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest

from shardline.core import storage
from shardline.core.config import validate_config
from shardline.core.manifest import Manifest
from tests.test_text_data import sentences


@pytest.mark.e2e
def test_a_text_column_pretrains_beats_the_unigram_baseline_and_registers_with_its_tokenizer(tmp_path, prefect_api):
    import mlflow

    from shardline.flows.pipeline import pipeline

    (tmp_path / "raw").mkdir()
    # a corpus with structure a unigram model cannot see: each sentence counts up through a fixed order of words
    bodies = [" ".join(s.split()[:1] + sorted(s.split()[1:])) for s in sentences(400, 11, 4, 12)]
    # one document a row, keyed as users' corpora are: the model's signature then also lists `doc` and `line`
    corpus = pl.DataFrame({"doc": [f"doc-{i}" for i in range(len(bodies))], "line": [0] * len(bodies), "body": bodies})
    # the file opens with two rows of no text (left out by data.on_bad_rows: skip): the registered model's input
    # example must not be made of them (the model refuses them, and MLflow predicts with it when logging)
    empty = pl.DataFrame({"doc": ["doc-empty-0", "doc-empty-1"], "line": [0, 0], "body": [None, ""]})
    corpus = pl.concat([empty, corpus])
    corpus.write_parquet(tmp_path / "raw" / "corpus.parquet")
    root = tmp_path / "store"
    config = validate_config(
        {
            "name": "text",
            "data": {
                "source": str(tmp_path / "raw" / "*.parquet"),
                "sequence_key": "doc",
                "order_by": "line",
                "features": {"text": ["body"]},
                "tokenizer": {"kind": "bpe", "vocab_size": 300},
                "window": 8,
                "on_bad_rows": "skip",
            },
            "model": {"family": "transformer", "hidden": 32, "layers": 1, "heads": 2, "dropout": 0.0},
            "training": {"epochs": 1, "batch_size": 64, "lr": 0.01, "warmup_steps": 2},
            "storage": {"root": str(root)},
            "mlflow": {"tracking_uri": f"sqlite:///{root}/mlflow.db", "experiment": "text", "model_name": "text-lm"},
        }
    )
    result = pipeline(config)

    # evaluated on the test split's tokens: perplexity is exp of the token loss, below the unigram baseline's
    metrics, baseline = result["metrics"], result["baseline"]
    assert metrics["perplexity"] == pytest.approx(math.exp(metrics["loss"]))
    assert 1.0 < metrics["perplexity"] < baseline["perplexity"] < 300
    assert "| perplexity |" in result["table"]
    assert result["train"]["select_by"] == "val_perplexity" and result["train"]["best_score"] > 1

    # registered on perplexity (lower is better), the tokenizer inside the model: it reads raw text rows
    registered = result["registered"]
    assert registered["promotion_metric"] == "perplexity" and registered["alias"] == "champion"
    manifest = Manifest.model_validate_json(storage.read_text(result["manifest"]))
    mlflow.set_tracking_uri(registered["tracking_uri"])
    model = mlflow.pyfunc.load_model(registered["model_uri"])
    bundled = model.unwrap_python_model().predictor.tokenizer
    local = mlflow.artifacts.download_artifacts(registered["model_uri"], dst_path=str(tmp_path / "registered"))
    example = mlflow.models.Model.load(local).load_input_example(local)
    assert len(example) == 3 and example["body"].map(lambda v: isinstance(v, str) and v != "").all(), example
    assert len(model.predict(example)) == 3  # the example is input the model takes
    assert hashlib.sha256(bundled.encode()).hexdigest() == manifest.encoding.text.tokenizer_sha256
    rows = pl.DataFrame({"doc": ["x", "y"], "line": [0, 0], "body": ["the quick brown", "a lazy"]}).to_pandas()
    out = model.predict(rows)
    assert list(out.columns) == ["doc", "line", "prompt_tokens", "next_token", "probability", "generated"]
    assert out["prompt_tokens"].min() >= 2 and out["next_token"].str.len().min() >= 1
    assert ((out["probability"] > 0) & (out["probability"] <= 1)).all()
    # greedy by default: the continuation starts with the most likely next token; params are the signature's (the
    # end of a row or of the text is said as `<sep>` or `<eos>`: no text of its own)
    texts = [t not in ("<sep>", "<eos>") for t in out["next_token"]]
    assert all(g.startswith(t) for g, t, text in zip(out["generated"], out["next_token"], texts) if text)
    short = model.predict(rows, params={"max_tokens": 1})["generated"]
    assert [g for g, text in zip(short, texts) if text] == [t for t, text in zip(out["next_token"], texts) if text]
    # rows of one sequence: a row's prompt is its sequence's rows up to it, each ended by <sep>, as training read
    # them (it was the row alone); each prediction keyed by the sequence and the order, in that order
    chat = pl.DataFrame({"doc": ["x", "y", "x"], "line": [1, 0, 0], "body": ["a lazy", "a lazy", "the quick brown"]})
    said = model.predict(chat.to_pandas())
    assert list(zip(said["doc"], said["line"])) == [("x", 0), ("x", 1), ("y", 0)]
    alone = dict(zip(out["doc"], out["prompt_tokens"]))  # x: "the quick brown", y: "a lazy"
    assert list(said["prompt_tokens"]) == [alone["x"], alone["x"] + 1 + alone["y"], alone["y"]]
    assert list(said.index) == [2, 0, 1]  # each prediction under its input row's label (the rows come out in order)
    assert said["probability"][1] == pytest.approx(out["probability"][1], rel=1e-5)  # "a lazy" alone, as before
    assert said["probability"][0] != pytest.approx(said["probability"][1], rel=1e-5)  # "a lazy" after its history
    drawn = [
        model.predict(rows, params={"temperature": 1.5, "seed": s, "max_tokens": 12})["generated"] for s in (1, 1, 2)
    ]
    assert list(drawn[0]) == list(drawn[1]) and list(drawn[0]) != list(drawn[2])
    # a row of no text has no prediction (training left such rows out): its sequence's other rows predict as
    # without it, each under its own label; no row with text at all is an error naming the column and the rows
    from shardline.core.encoding.columns import DataError

    gap = pl.DataFrame({"doc": ["x"], "line": [2], "body": [None]}, schema=chat.schema)
    assert model.predict(pl.concat([chat, gap]).to_pandas()).equals(said)
    with pytest.raises(DataError, match=r"column 'body' has 2 null or empty text\(s\) \(row\(s\) \[0, 1\]\)"):
        model.predict(rows.assign(body=["", None]))

    # `shardline generate` in a fresh process, in another folder, the training folder gone: the same greedy text
    # (the model's `doc` and `line` inputs, which generation does not read, are filled in)
    shutil.rmtree(tmp_path / "raw")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}  # this checkout's command
    command = [sys.executable, "-m", "shardline", "generate", "models:/text-lm@champion", "--prompt", "a lazy"]
    command += ["--tracking-uri", registered["tracking_uri"]]
    done = subprocess.run(command, cwd=elsewhere, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.rstrip("\n") == out["generated"][1]
    # which it prints as it goes: a piece as each token is drawn (it printed the whole text once generation ended)
    drawn = drawn[0][1]  # 12 tokens drawn at temperature 1.5, seed 1
    pieces = list(
        model.unwrap_python_model().predictor.stream_text(
            pl.from_pandas(rows[1:]), {"temperature": 1.5, "seed": 1, "max_tokens": 12}
        )
    )
    assert "".join(pieces) == drawn and len(pieces) > 3, pieces
    bad = subprocess.run([*command, "--temperature", "-1"], cwd=elsewhere, env=env, capture_output=True, text=True)
    assert bad.returncode == 2 and "temperature=-1.0 must be 0 (greedy) or a finite" in bad.stderr + bad.stdout
    nothing = subprocess.run([*command[:5], "--prompt", ""], cwd=elsewhere, env=env, capture_output=True, text=True)
    assert nothing.returncode == 2 and "--prompt is empty: give the text the model continues" in nothing.stderr

    # a fine-tune of the registered LM on other data with other column names: a titler (a generation target)
    # starts from its weights and reads its token ids, tokenized with the parent's tokenizer (data.tokenizer
    # unset: the parent's is used, and kept in the store under its sha256)
    (tmp_path / "pairs").mkdir()
    texts = sentences(300, 21, 3, 10)
    pairs = pl.DataFrame({"text": texts, "title": [t.split()[0] for t in texts]})
    pairs.write_parquet(tmp_path / "pairs" / "titles.parquet")
    tuned_raw = {
        "name": "titler",
        "data": {
            "source": str(tmp_path / "pairs" / "*.parquet"),
            "features": {"text": ["text"]},
            "target": {"column": "title", "task": "generation"},
            "window": 8,
        },
        "model": {"family": "transformer", "hidden": 32, "layers": 1, "heads": 2, "dropout": 0.0},
        "training": {
            "epochs": 1,
            "batch_size": 64,
            "lr": 0.01,
            "warmup_steps": 2,
            "init_from": "models:/text-lm@champion",
        },
        "storage": {"root": str(root)},
        "mlflow": {"tracking_uri": f"sqlite:///{root}/mlflow.db", "experiment": "text", "model_name": "titler"},
    }
    tuned = validate_config(tuned_raw)
    # another data.window than the parent's learned positions cover: exit 2 before any work, as a config's mistake
    # (it was said after the ingest and the encode, exit 1)
    import yaml

    wider = tmp_path / "wider.yaml"
    wider.write_text(yaml.safe_dump({**tuned_raw, "data": {**tuned_raw["data"], "window": 16}}))
    refused = subprocess.run([sys.executable, "-m", "shardline", "run", str(wider)], env=env, capture_output=True,
                             text=True, timeout=300)  # fmt: skip
    assert refused.returncode == 2, refused.stdout[-2000:] + refused.stderr[-2000:]
    assert "cover a context of 8 positions, this model's 16 (data.window)" in refused.stderr
    titled = pipeline(tuned)
    tuned_manifest = Manifest.model_validate_json(storage.read_text(titled["manifest"]))
    sha = manifest.encoding.text.tokenizer_sha256
    assert tuned_manifest.encoding.text.tokenizer_sha256 == sha and tuned_manifest.encoding.text.columns == ["text"]
    assert (root / "tokenizers" / f"{sha}.json").read_text() == bundled
    version = mlflow.MlflowClient().get_model_version("titler", titled["registered"]["version"])
    assert (version.tags["shardline.parent_name"], version.tags["shardline.parent_version"]) == ("text-lm", "1")
    assert titled["metrics"]["perplexity"] < titled["baseline"]["perplexity"]


def test_the_training_flow_refuses_a_text_fine_tune_on_shards_of_another_tokenizer(tmp_path, prefect_api):
    # the training flow is its own deployment, given a manifest: one encoded with another tokenizer than the
    # parent's (here the new data's own BPE, of the same size) would feed the parent's embeddings other words
    from shardline.core.encoding.reuse import EncodingMismatch
    from shardline.flows.train import train
    from shardline.tasks.encode import encode_dataset
    from shardline.tasks.ingest import snapshot_source

    root = tmp_path / "store"

    def config(raw: str, **training) -> dict:
        pl.DataFrame({"body": sentences(200, len(raw))}).write_parquet(tmp_path / f"{raw}.parquet")
        return {
            "data": {
                "source": str(tmp_path / f"{raw}.parquet"),
                "features": {"text": ["body"]},
                "tokenizer": {"kind": "bpe", "vocab_size": 300},
                "window": 8,
            },
            "model": {"family": "transformer", "hidden": 16, "layers": 1, "heads": 2, "dropout": 0.0},
            "training": {"epochs": 1, "batch_size": 64, **training},
            "storage": {"root": str(root)},
            "mlflow": {"tracking_uri": f"sqlite:///{root}/mlflow.db", "experiment": "text"},
        }

    def encoded(cfg) -> str:
        return encode_dataset(snapshot_source(cfg.data), cfg.data, f"{cfg.data.source}.encoded")

    lm = validate_config(config("corpus"))
    parent = train(encoded(lm), lm)
    tuned = validate_config(config("other-corpus", init_from=f"{parent.run_dir}/checkpoints"))
    manifest = encoded(tuned)  # its own BPE: not the parent's
    mine = Manifest.model_validate_json(storage.read_text(manifest)).encoding.text.tokenizer_sha256
    with pytest.raises(EncodingMismatch, match=rf"the data's tokenizer \({mine[:12]}\) is not the one"):
        train(manifest, tuned)
    assert {p.parent.parent for p in (root / "runs").glob("*/checkpoints/*.pt")} == {Path(parent.run_dir)}


@pytest.mark.e2e
def test_the_champion_gate_rescores_a_text_champion_on_new_data_and_never_compares_other_tokenizers(
    tmp_path, prefect_api
):
    """A text model retrained on appended data (its tokenizer fixed by a file, as the docs advise) is compared
    with the champion on the new test split, both scored on the same tokens (it was kept a challenger forever:
    a text evaluation has no per-row predictions to re-score on). A model of another tokenizer is never compared
    by perplexity, on any data: its perplexity counts other tokens."""
    import mlflow

    from shardline.flows.pipeline import pipeline

    (tmp_path / "raw").mkdir()
    bodies = [" ".join(s.split()[:1] + sorted(s.split()[1:])) for s in sentences(300, 11, 4, 12)]
    pl.DataFrame({"doc": [f"a-{i}" for i in range(200)], "line": [0] * 200, "body": bodies[:200]}).write_parquet(
        tmp_path / "raw" / "a.parquet"
    )
    root = tmp_path / "store"

    def config(tokenizer: dict) -> dict:
        return validate_config(
            {
                "name": "text",
                "data": {
                    "source": str(tmp_path / "raw" / "*.parquet"),
                    "sequence_key": "doc",
                    "order_by": "line",
                    "features": {"text": ["body"]},
                    "tokenizer": tokenizer,
                    "window": 8,
                },
                "model": {"family": "transformer", "hidden": 32, "layers": 1, "heads": 2, "dropout": 0.0},
                "training": {"epochs": 1, "batch_size": 64, "lr": 0.01, "warmup_steps": 2},
                "storage": {"root": str(root)},
                "mlflow": {"tracking_uri": f"sqlite:///{root}/mlflow.db", "experiment": "text", "model_name": "lm"},
            }
        )

    first = pipeline(config({"kind": "bpe", "vocab_size": 300}))
    assert first["registered"]["alias"] == "champion"
    manifest = Manifest.model_validate_json(storage.read_text(first["manifest"]))
    folder = first["manifest"].rsplit("/", 1)[0]
    fixed = tmp_path / "tokenizer.json"
    fixed.write_text(storage.read_text(storage.resolve(folder, manifest.tokenizer or "tokenizer.json")))

    # new data, the same tokenizer: the champion is scored on the new test split beside the candidate
    pl.DataFrame({"doc": [f"b-{i}" for i in range(100)], "line": [0] * 100, "body": bodies[200:]}).write_parquet(
        tmp_path / "raw" / "b.parquet"
    )
    second = pipeline(config({"file": str(fixed)}))
    compared = second["registered"]["compared"]
    assert "reason" not in compared, compared
    assert compared["on"] == "the candidate's test split" and compared["candidate_value"] == pytest.approx(
        second["metrics"]["perplexity"]
    )
    assert compared["champion_value"] != pytest.approx(first["metrics"]["perplexity"])  # scored on the new split
    wins = compared["candidate_value"] < compared["champion_value"]
    assert second["registered"]["alias"] == ("champion" if wins else "challenger")

    # another tokenizer, the same data: not compared by perplexity; the champion stays
    champion = mlflow.MlflowClient(second["registered"]["tracking_uri"]).get_model_version_by_alias("lm", "champion")
    # (a vocab_size the text cannot fill: the tokenizer has fewer ids, and the log says how many)
    state = pipeline(config({"kind": "bpe", "vocab_size": 1000}), return_state=True)
    third = state.result()
    assert "reads another tokenizer" in third["registered"]["compared"]["reason"]
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    APILogHandler().flush()
    with get_client(sync_client=True) as client:
        flow_run = LogFilterFlowRunId(any_=[state.state_details.flow_run_id])
        logs = [log.message for log in client.read_logs(log_filter=LogFilter(flow_run_id=flow_run))]
    size = Manifest.model_validate_json(storage.read_text(third["manifest"])).encoding.text.vocab_size
    said = f"data.tokenizer.vocab_size=1000, but the training split's text holds only {size} distinct tokens"
    assert size < 1000 and any(said in m for m in logs), logs
    assert third["registered"]["alias"] == "challenger"
    after = mlflow.MlflowClient(second["registered"]["tracking_uri"]).get_model_version_by_alias("lm", "champion")
    assert after.version == champion.version


@pytest.mark.e2e
def test_a_text_model_whose_files_are_its_sequences_predicts_each_row_after_its_files_rows(tmp_path, prefect_api):
    """`data.sequence_key: '@file'` text (a book a file, a line a row): `shardline predict` over a folder prompts
    each row with its file's lines up to it, as training read them, and keys each prediction by its file and line
    (each row was prompted alone, and the predictions said neither)."""
    from shardline.flows.pipeline import pipeline

    lines = sentences(240, 5, 3, 8)
    (tmp_path / "raw").mkdir()
    (tmp_path / "new").mkdir()
    for i in range(12):  # 12 books of 20 lines, written out of order
        part = pl.DataFrame({"line_no": list(range(20))[::-1], "text": lines[i * 20 : i * 20 + 20][::-1]})
        part.write_parquet(tmp_path / "raw" / f"book{i:02d}.parquet")
    for i in range(2):
        part = pl.DataFrame({"line_no": [2, 0, 1], "text": ["a lazy", "the quick brown", "a lazy"]})
        part.write_parquet(tmp_path / "new" / f"b{i}.parquet")
    root = tmp_path / "store"
    config = {
        "name": "books",
        "data": {
            "source": str(tmp_path / "raw"),
            "sequence_key": "@file",
            "order_by": "line_no",
            "features": {"text": ["text"]},
            "tokenizer": {"kind": "bpe", "vocab_size": 300},
            "window": 8,
            "split": {"method": "hash", "seed": 0, "fractions": {"train": 0.6, "validation": 0.2, "test": 0.2}},
        },
        "model": {"family": "transformer", "hidden": 16, "layers": 1, "heads": 2, "dropout": 0.0},
        "training": {"epochs": 1, "batch_size": 64, "lr": 0.01, "warmup_steps": 2},
        "storage": {"root": str(root)},
        "mlflow": {"tracking_uri": f"sqlite:///{root}/mlflow.db", "experiment": "books", "model_name": "books"},
    }
    registered = pipeline(validate_config(config))["registered"]
    out = tmp_path / "predictions.parquet"
    command = [sys.executable, "-m", "shardline", "predict", f"models:/books/{registered['version']}"]
    command += [str(tmp_path / "new"), "--out", str(out), "--max-tokens", "2"]
    command += ["--tracking-uri", registered["tracking_uri"]]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    said = pl.read_parquet(out)
    assert said.columns[:3] == ["file", "line_no", "prompt_tokens"]
    assert said["file"].to_list() == ["b0.parquet"] * 3 + ["b1.parquet"] * 3
    assert said["line_no"].to_list() == [0, 1, 2] * 2
    first, second, third = said["prompt_tokens"][:3]
    assert second > first and third == second + 1 + (second - first - 1)  # "a lazy" twice, <sep> after each line
    assert said["prompt_tokens"][3:].to_list() == said["prompt_tokens"][:3].to_list()  # each file on its own
