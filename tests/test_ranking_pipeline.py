"""Ranking data (`data.group_key`) through the product: the encode keeps each row's group, item and relevance
beside its shard and splits by group; evaluation ranks the test split's groups and reports exactly what
shardline.core.metrics.ranking computes from the predictions file it writes, against the popularity baseline
counted on the training split; nDCG@10 promotes a champion; bad input is refused before training."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pandas as pd
import polars as pl
import pytest

from shardline.core import storage
from shardline.core.config import ConfigError, validate_config
from shardline.core.encoding.columns import DataError
from shardline.core.encoding.splits import sequence_splits
from shardline.core.manifest import Manifest
from shardline.core.metrics.ranking import PopularityCounts, ranking_metrics
from shardline.tasks.encode import encode_dataset
from shardline.tasks.evaluate import evaluate_model
from shardline.tasks.ingest import snapshot_source
from tests.test_evaluate_streaming import train_run
from tests.test_s3_source import s3_endpoint  # noqa: F401 - the moto server fixture

KS = [5, 10]


def make_clicks(
    folder: Path, groups: int = 160, shown: int = 12, items: int = 40, seed: int = 0, files: int = 2
) -> pl.DataFrame:
    """A tiny click log: each query (a user with a taste) is shown `shown` of `items` items, popular ones
    more often, and clicks those its taste and the item's popularity favour; `grade` is 2 for a strong
    click, 1 for a click, 0 for none. Written as `files` parquet files; returned whole."""
    rng = np.random.default_rng(seed)
    folder.mkdir(parents=True, exist_ok=True)
    popularity, style = rng.normal(size=items), rng.normal(size=items)
    exposure = np.exp(popularity) / np.exp(popularity).sum()
    frames = []
    for g in range(groups):
        taste = rng.normal()
        item = rng.choice(items, size=shown, replace=False, p=exposure)
        affinity = 2.0 * taste * style[item] + popularity[item] - 1.5
        u = rng.random(shown)
        click = u < 1 / (1 + np.exp(-affinity))
        strong = click & (u < 0.5 / (1 + np.exp(-affinity)))
        frames.append(
            pl.DataFrame(
                {
                    "query": [f"q{g:04d}"] * shown,
                    "item": item.astype(np.int64),
                    "taste": [taste] * shown,
                    "style": style[item],
                    "click": click.astype(np.int64),
                    "grade": click.astype(np.int64) + strong,
                }
            )
        )
    data = pl.concat(frames)
    edges = np.linspace(0, data.height, files + 1).astype(int)
    for i in range(files):
        data[edges[i] : edges[i + 1]].write_parquet(folder / f"clicks-{i}.parquet")
    return data


def ranking_config(tmp_path: Path, **data) -> dict:
    root = tmp_path / "store"
    return {
        "name": "rank",
        "data": {
            "source": str(tmp_path / "raw" / "*.parquet"),
            "group_key": "query",
            "item_key": "item",
            "features": {"continuous": ["taste", "style"], "categorical": ["item"]},
            "target": {"column": "click", "task": "classification"},
            "split": {"method": "hash", "seed": 3, "fractions": {"train": 0.6, "validation": 0.15, "test": 0.25}},
            "files_per_group": 1,
            **data,
        },
        "model": {"family": "mlp", "hidden": 16, "layers": 1, "dropout": 0.0},
        "training": {"epochs": 3, "batch_size": 64, "lr": 0.01, "warmup_steps": 2},
        "evaluation": {"k": KS},
        "storage": {"root": str(root)},
        "mlflow": {
            "tracking_uri": f"sqlite:///{root}/mlflow.db",
            "experiment": "rank",
            "model_name": "rank-model",
            "promotion_metric": "ndcg@10",
        },
    }


def split_of(groups: pl.Series, config: dict) -> dict[str, str]:
    """Each group's split as the config's hash split draws it (a group is one unit, as a sequence is)."""
    from shardline.core.config import SPLITS, SplitConfig

    keys = groups.unique().cast(pl.Utf8).to_list()
    drawn = sequence_splits(keys, SplitConfig.model_validate(config["data"]["split"]))
    return {k: SPLITS[i] for k, i in zip(keys, drawn.tolist())}


def direct_scores(predictions: pl.DataFrame, group: str, score: str) -> dict[str, float]:
    """The ranking metrics of the predictions file's rows, computed here with shardline.core.metrics.ranking."""
    out = ranking_metrics(predictions[group], predictions[score], predictions["relevance"], KS, ties="average")
    return {k: v for k, v in out.items() if k not in ("groups", "groups_with_relevant")}


def validation_ranked(manifest_uri: str, checkpoint: str, batch_size: int) -> dict[str, float]:
    """The ranking metrics of a checkpoint on the validation split, computed here: its predictions (`predict`),
    each window's target row, and that row's group and grade read straight from the rows files."""
    from shardline.trainer.data import open_split
    from shardline.trainer.inference import load_model, predict

    manifest = Manifest.model_validate_json(storage.read_text(manifest_uri))
    val = open_split(manifest, manifest_uri, "validation")
    probs = next(iter(predict(load_model(checkpoint), val, batch_size=batch_size).values()))
    grades = np.array([0, *map(int, manifest.encoding.targets[0].classes)], dtype=np.float64)
    shard, row = val.target_rows_of(np.arange(val.n_windows))
    folder = manifest_uri.rsplit("/", 1)[0]
    files = [pl.read_parquet(storage.resolve(folder, s.rows_path)) for s in manifest.shards_of("validation")]
    rows = pl.concat([files[s][int(r)] for s, r in zip(shard, row)])
    return ranking_metrics(rows["group"], probs.astype(np.float64) @ grades, rows["relevance"], KS, ties="average")


@pytest.mark.e2e
@pytest.mark.usefixtures("s3_endpoint")  # a moto server: predict from a bucket
def test_the_pipeline_ranks_test_groups_as_shardline_core_ranking_does_and_promotes_on_ndcg(
    tmp_path, prefect_api, monkeypatch
):
    from mlflow import MlflowClient

    from shardline.flows.pipeline import pipeline

    raw = make_clicks(tmp_path / "raw")
    config = ranking_config(tmp_path)
    result = pipeline(validate_config(config))

    predictions = pl.read_parquet(
        io.BytesIO(storage.read_bytes(result["train"]["run_dir"] + "/eval/test_predictions.parquet"))
    )
    # each test row with its group and item (as the raw columns had them), its true grade and both scores
    assert {"query", "item", "relevance", "ranking_score", "popularity"} <= set(predictions.columns)
    assert predictions.schema["query"] == pl.String and predictions.schema["item"] == pl.Int64
    # whole groups: the test split holds every row of the groups its hash drew, and no other
    splits = split_of(raw["query"], config)
    test_groups = {g for g, s in splits.items() if s == "test"}
    assert set(predictions["query"].unique()) == test_groups
    assert predictions.height == raw.filter(pl.col("query").is_in(list(test_groups))).height
    truth = predictions.join(raw.select("query", "item", "click"), on=["query", "item"])
    assert truth.height == predictions.height and (truth["relevance"] == truth["click"]).all()
    # the model's score of a 0/1 click is the probability of the click
    p_click = np.where(predictions["prediction"] == 1, predictions["probability"], 1 - predictions["probability"])
    np.testing.assert_allclose(predictions["ranking_score"], p_click, rtol=1e-6)

    # the metrics are what shardline.core.metrics.ranking computes from that file, ties averaged
    for name, want in direct_scores(predictions, "query", "ranking_score").items():
        assert result["metrics"][name] == pytest.approx(want, rel=1e-12), name
    # the baseline is popularity: each item's clicks in the training split's groups
    train = raw.filter(pl.col("query").is_in([g for g, s in splits.items() if s == "train"]))
    counts = PopularityCounts.from_counts(dict(train.group_by("item").agg(pl.col("click").sum()).iter_rows()))
    np.testing.assert_array_equal(predictions["popularity"], counts.scores(predictions["item"]))
    for name, want in direct_scores(predictions, "query", "popularity").items():
        assert result["baseline"][name] == pytest.approx(want, rel=1e-12), name
    assert set(KS) == {int(k.split("@")[1]) for k in result["metrics"] if k.startswith("ndcg@")}
    assert "| ndcg@10 |" in result["table"] and "| mrr |" in result["table"]

    # nDCG@10 promoted the first version to champion; MLflow names spell '@' out
    registered = result["registered"]
    assert registered["promotion_metric"] == "ndcg@10" and registered["alias"] == "champion"
    client = MlflowClient(registered["tracking_uri"])
    metrics = client.get_run(registered["run_id"]).data.metrics
    assert metrics["test/ndcg_at_10"] == result["metrics"]["ndcg@10"]
    assert metrics["test/ndcg_at_10_baseline"] == result["baseline"]["ndcg@10"]
    assert metrics["test/map_at_5"] == result["metrics"]["map@5"] and "test/mrr" in metrics
    version = client.get_model_version_by_alias("rank-model", "champion")
    assert str(version.version) == str(registered["version"]) and "metric.ndcg_at_10" in version.tags

    # served: each row with its group and item and the score evaluation ranked it by (it gave the top class's
    # probability only, and no group: the rows could not be ranked as evaluation ranked them)
    import mlflow

    mlflow.set_tracking_uri(registered["tracking_uri"])
    model = mlflow.pyfunc.load_model(registered["model_uri"])
    served = pl.from_pandas(model.predict(raw.drop("click", "grade").to_pandas()))
    assert {"query", "item", "ranking_score"} <= set(served.columns)
    both = predictions.join(
        served.select("query", "item", pl.col("ranking_score").alias("served")), on=["query", "item"]
    )
    assert both.height == predictions.height
    np.testing.assert_allclose(both["served"], both["ranking_score"], rtol=1e-5)
    # a filtered pandas frame (its index not 0..n-1), shuffled: each score comes back under its own row's label, so
    # the usual `frame.assign(score=...)` puts it beside that row (they came back numbered 0..n-1: NaN or another
    # row's score)
    frame = raw.drop("click", "grade").to_pandas()
    picked = frame[frame["query"].isin(sorted(set(frame["query"]))[1::2])].sample(frac=1.0, random_state=0)
    assert not picked.index.equals(pd.RangeIndex(len(picked)))
    scored = picked.assign(score=model.predict(picked)["ranking_score"])
    assert scored["score"].notna().all()
    mine = pl.from_pandas(scored[["query", "item", "score"]]).join(
        served.select("query", "item", "ranking_score"), on=["query", "item"]
    )
    assert mine.height == len(picked)
    np.testing.assert_allclose(mine["score"], mine["ranking_score"], rtol=1e-5)

    # `shardline predict` scores each row from that row alone (a window of one row), so a file of more rows than
    # SHARDLINE_PREDICT_ROWS is read and predicted that many at a time (a 12M-row click log took 5.7 GB at once,
    # 0.8 GB so): the same predictions, each row's number in the input included
    from typer.testing import CliRunner

    import shardline.app.predict_input as P
    from shardline.app.cli import app

    def cli_predict(out: str, source: str = str(tmp_path / "raw")) -> pl.DataFrame:
        args = ["predict", "models:/rank-model@champion", source, "--out", out]
        said = CliRunner().invoke(app, [*args, "--tracking-uri", registered["tracking_uri"]])
        assert said.exit_code == 0, said.output
        return pl.read_parquet(out)

    at_once = cli_predict(str(tmp_path / "at-once.parquet"))
    assert at_once.height == raw.height and at_once["row"].to_list() == list(range(raw.height))
    limit = raw.height // 5 + 1
    monkeypatch.setenv("SHARDLINE_PREDICT_ROWS", str(limit))
    chunks, whole = [], P._predicted
    monkeypatch.setattr(
        P, "_predicted", lambda model, predictor, df, *a: chunks.append(df.height) or whole(model, predictor, df, *a)
    )
    assert cli_predict(str(tmp_path / "chunked.parquet")).equals(at_once)
    assert len(chunks) >= 4 and sum(chunks) == raw.height and max(chunks) < 2 * limit, chunks
    # the same files in a bucket, each opened where it is (larger than a fetch): read a row group at a time
    import s3fs

    fs = s3fs.S3FileSystem()
    fs.mkdir("rank-bucket")
    for path in sorted((tmp_path / "raw").glob("*.parquet")):
        pl.read_parquet(path).write_parquet(tmp_path / "rg.parquet", row_group_size=limit // 3)
        fs.put_file(str(tmp_path / "rg.parquet"), f"rank-bucket/raw/{path.name}")
    monkeypatch.setattr(P, "FETCH_BYTES", 0)
    chunks.clear()
    assert cli_predict(str(tmp_path / "from-s3.parquet"), "s3://rank-bucket/raw").equals(at_once)
    assert len(chunks) >= 4 and sum(chunks) == raw.height, chunks
    monkeypatch.undo()

    # validation ranks the validation split's groups every epoch, and nDCG@10 (the promotion metric's
    # counterpart) picked the checkpoint: its value is what shardline.core.metrics.ranking computes for that checkpoint
    trained = result["train"]
    assert trained["select_by"] == "val_ndcg_at_10"
    direct = validation_ranked(result["manifest"], trained["best_checkpoint"], batch_size=64)
    for name in ("ndcg@10", "ndcg@5", "map@10", "recall@5", "mrr"):
        logged = client.get_metric_history(trained["mlflow_run_id"], "epoch/val_" + name.replace("@", "_at_"))
        assert [m.step for m in logged] == [1, 2, 3], name  # every epoch
        assert logged[trained["best_epoch"] - 1].value == pytest.approx(direct[name], rel=1e-9), name
        if name == "ndcg@10":  # the epoch chosen is the one with the highest
            assert trained["best_score"] == max(m.value for m in logged)

    # a new day of clicks (the nightly retrain): the champion, tested on other data, is re-scored on this run's test
    # groups by the score it serves, ranked against the relevance evaluation recorded; the gate promotes by that
    # (it said "ndcg@10 ranks the candidate's test groups by each row's score, which a served prediction does not
    # give", and every retrain stayed challenger)
    more = make_clicks(tmp_path / "more", groups=80, seed=1, files=1).with_columns(pl.format("n{}", "query"))
    more.write_parquet(tmp_path / "raw" / "clicks-2.parquet")
    second = pipeline(validate_config(config))
    compared = second["registered"]["compared"]
    assert "reason" not in compared, compared
    assert compared["on"].startswith("the candidate's test groups")
    again = pl.read_parquet(
        io.BytesIO(storage.read_bytes(second["train"]["run_dir"] + "/eval/test_predictions.parquet"))
    )
    assert compared["rows"] == again.height  # every test row, matched on (query, item)
    assert compared["candidate_value"] == pytest.approx(second["metrics"]["ndcg@10"], rel=1e-9)
    test_rows = pl.concat([raw, more]).join(again.select("query", "item", "relevance"), on=["query", "item"])
    champion = pl.from_pandas(model.predict(test_rows.drop("click", "grade", "relevance").to_pandas()))
    ranked = test_rows.join(champion.select("query", "item", "ranking_score"), on=["query", "item"])
    assert compared["champion_value"] == pytest.approx(direct_scores(ranked, "query", "ranking_score")["ndcg@10"])
    wins = compared["candidate_value"] > compared["champion_value"]
    assert second["registered"]["alias"] == ("champion" if wins else "challenger")
    # the version's description gives the numbers the gate compared, not the champion's recorded one
    described = client.get_model_version("rank-model", str(second["registered"]["version"])).description
    said = (
        "both scored on the candidate's test groups, the rows both models ranked, matched on group and item "
        f"({again.height:,} rows)"
    )
    assert said in described and "had ndcg@10" not in described, described
    # a promotion metric of the served prediction (accuracy) is compared on the same rows, against the raw target
    from shardline.runs.gate import reevaluate_ranking_champion

    manifest = Manifest.model_validate_json(storage.read_text(second["manifest"]))
    preds_uri = second["train"]["run_dir"] + "/eval/test_predictions.parquet"
    snapshot = snapshot_source(validate_config(config).data)
    served = reevaluate_ranking_champion(registered["model_uri"], manifest.encoding, snapshot, preds_uri, "accuracy")
    on_rows = ranked.join(champion.select("query", "item", pl.col("prediction").alias("served")), on=["query", "item"])
    assert served["champion_value"] == pytest.approx((on_rows["served"] == on_rows["click"]).mean())
    assert served["candidate_value"] == pytest.approx(second["metrics"]["accuracy"])


@pytest.mark.parametrize(
    "target, item_key",
    [({"column": "grade", "task": "classification"}, "item"), ({"column": "grade", "task": "regression"}, None)],
    ids=["graded-classes", "graded-values-no-item-key"],
)
def test_graded_relevance_is_ranked_by_expected_grade_or_value(tmp_path, target, item_key):
    """Grades 0..2: a class target ranks by its expected grade, a regression target by its value; without an
    item key the baseline is a random order (every row tied, the expected metrics of shuffling)."""
    make_clicks(tmp_path / "raw", groups=120)
    config = ranking_config(tmp_path, target=target, item_key=item_key)
    config["mlflow"] = {"promotion_metric": "ndcg@10"}
    uri, trained, cfg = train_run(tmp_path, config)
    result = evaluate_model(uri, trained, cfg, tmp_path / "eval")
    predictions = pl.read_parquet(tmp_path / "eval" / "test_predictions.parquet")
    assert predictions["relevance"].max() == 2
    for name, want in direct_scores(predictions, "query", "ranking_score").items():
        assert result["metrics"][name] == pytest.approx(want, rel=1e-12), name
    if target["task"] == "regression":
        np.testing.assert_allclose(predictions["ranking_score"], predictions["prediction"])
    else:
        assert predictions["ranking_score"].is_between(0, 2).all()
    if item_key is None:
        assert "popularity" not in predictions.columns and result["ranking"]["baseline"] == "random order"
        shuffled = predictions.with_columns(pl.lit(0.0).alias("tied"))
        for name, want in direct_scores(shuffled, "query", "tied").items():
            assert result["baseline"][name] == pytest.approx(want, rel=1e-12), name
    else:
        assert result["ranking"]["baseline"] == "popularity"


def test_selecting_by_validation_ndcg_without_a_relevant_validation_row_is_a_clear_error(tmp_path):
    """No click in the validation split: no ranking metric is defined there, so selecting by one says why and
    what to do, instead of keeping whichever epoch came first."""
    raw = make_clicks(tmp_path / "raw", groups=60, files=1)
    config = ranking_config(tmp_path)
    config["training"]["epochs"] = 1
    validation = [g for g, s in split_of(raw["query"], config).items() if s == "validation"]
    no_click = pl.when(pl.col("query").is_in(validation)).then(0).otherwise(pl.col("click")).alias("click")
    raw.with_columns(no_click).write_parquet(tmp_path / "raw" / "clicks-0.parquet")
    with pytest.raises(
        ValueError,
        match=r"training.select_by='val_ndcg_at_10' ranks the validation split's groups, "
        r"but none of its [\d,]+ rows is relevant .* set training.select_by: val_loss",
    ):
        train_run(tmp_path, config)


def test_a_group_key_missing_from_the_raw_files_is_named_before_any_work(tmp_path):
    make_clicks(tmp_path / "raw", groups=20)
    cfg = validate_config(ranking_config(tmp_path, group_key="session"))
    with pytest.raises(DataError, match=r"missing column 'session' \(the group key in data.group_key\)"):
        snapshot_source(cfg.data)


def test_item_ids_written_as_text_in_one_file_and_numbers_in_another_are_refused_naming_both(tmp_path):
    """One export wrote `item` as "5", another as 5: read as two categories (two items, each with half the
    clicks: the popularity baseline and the model's embeddings split), silently. Refused at ingest; an appended
    file is checked against one already ingested."""
    make_clicks(tmp_path / "raw", groups=20)
    one = tmp_path / "raw" / "clicks-1.parquet"
    cfg = validate_config(ranking_config(tmp_path))
    checked = snapshot_source(cfg.data)
    pl.read_parquet(one).with_columns(pl.col("item").cast(pl.String)).write_parquet(
        tmp_path / "raw" / "clicks-2.parquet"
    )
    said = r"column 'item' holds numbers in .*clicks-0.parquet and text in .*clicks-2.parquet: the same value"
    with pytest.raises(DataError, match=said):
        snapshot_source(cfg.data, checked)
    with pytest.raises(DataError, match=said.replace("clicks-0", "clicks-[01]")):
        snapshot_source(cfg.data)


def test_a_group_key_with_one_row_per_group_is_refused_before_training(tmp_path):
    """A row id as the group key ranks nothing: the error names the column and the groups. A group whose rows
    lie in different raw files (one in each) is still one group of several rows."""
    raw = make_clicks(tmp_path / "raw", groups=40, files=1)
    raw.with_row_index("row_id").write_parquet(tmp_path / "raw" / "clicks-0.parquet")
    cfg = validate_config(ranking_config(tmp_path, group_key="row_id"))
    out = tmp_path / "store" / "datasets" / "d"
    with pytest.raises(DataError, match=r"data.group_key 'row_id': each of the [\d,]+ groups in the training split"):
        encode_dataset(snapshot_source(cfg.data), cfg.data, str(out), threads=1)
    assert not (out / "manifest.json").exists()

    # one row of each query per file, in 3 files encoded apart: every file group's groups have one row
    spread = tmp_path / "spread"
    spread.mkdir()
    per_file = raw.with_columns(pl.int_range(pl.len()).over("query").alias("nth")).filter(pl.col("nth") < 3)
    for n in range(3):
        per_file.filter(pl.col("nth") == n).drop("nth").write_parquet(spread / f"part-{n}.parquet")
    cfg = validate_config(ranking_config(tmp_path, source=str(spread / "*.parquet")))
    uri = encode_dataset(snapshot_source(cfg.data), cfg.data, str(tmp_path / "spread-store"), threads=1)
    assert Manifest.model_validate_json(Path(uri).read_text()).encoding.group_key == "query"


@pytest.mark.parametrize(
    "column, values, task, said",
    [
        ("click", [0, 1, -1], "classification", "holds the negative grade -1"),
        ("click", [0.0, 1.0, 0.5], "regression", "holds 0.5, not a whole grade"),
        ("click", ["no", "yes", "no"], "classification", "holds 'no', which is not a grade"),
    ],
    ids=["negative", "fractional", "text"],
)
def test_a_relevance_that_is_not_a_grade_is_refused_naming_the_file_and_value(tmp_path, column, values, task, said):
    raw = make_clicks(tmp_path / "raw", groups=30, files=1)
    bad = raw.with_columns(pl.Series(column, (values * raw.height)[: raw.height]))
    bad.write_parquet(tmp_path / "raw" / "clicks-0.parquet")
    cfg = validate_config(ranking_config(tmp_path, target={"column": column, "task": task}))
    with pytest.raises(DataError, match=f"clicks-0.parquet: the target column 'click' {said}; ranking"):
        encode_dataset(snapshot_source(cfg.data), cfg.data, str(tmp_path / "store" / "datasets" / "d"), threads=1)


def test_ranking_settings_and_promotion_metrics_are_checked_with_the_config(tmp_path):
    def check(**data):
        raw = ranking_config(tmp_path, **{k: v for k, v in data.items() if k != "mlflow"})
        raw["mlflow"].update(data.get("mlflow", {}))
        return validate_config(raw)

    chosen = check()
    assert (chosen.mlflow.promotion_metric, chosen.mlflow.promotion_direction) == ("ndcg@10", "maximize")
    several = check(
        target=None,
        targets=[{"column": "click", "task": "classification"}, {"column": "style", "task": "regression"}],
        features={"continuous": ["taste"], "categorical": ["item"]},  # a target is no feature at horizon 0
        mlflow={"promotion_metric": "click/mrr@5"},
    )
    assert several.mlflow.promotion_direction == "maximize"
    # the best checkpoint is chosen by the promotion metric's validation counterpart, maximised (a sweep's trials
    # are compared the same way: by their config's select_direction)
    assert (chosen.training.select_by, chosen.training.select_direction) == ("val_ndcg_at_10", "maximize")
    assert (several.training.select_by, several.training.select_direction) == ("val_click/mrr_at_5", "maximize")
    assert check(mlflow={"promotion_metric": "log_loss"}).training.select_by == "val_loss"
    with pytest.raises(ConfigError, match=r"training.select_by='val_ndcg_at_20' is not a metric .*'val_ndcg_at_10'"):
        validate_config({**ranking_config(tmp_path), "training": {"select_by": "val_ndcg_at_20"}})
    with pytest.raises(ConfigError, match=r"promotion_metric='ndcg@10' is not a metric .* 'click/ndcg@10'"):
        check(target=None, targets=several.data.model_dump()["targets"], features={"continuous": ["taste"]})
    with pytest.raises(ConfigError, match=r"add 20 to evaluation.k, now \[5, 10\], for ndcg@20"):
        check(mlflow={"promotion_metric": "ndcg@20"})
    with pytest.raises(ConfigError, match="ndcg@10 is a ranking metric: set data.group_key"):
        check(group_key=None, item_key=None)
    with pytest.raises(ConfigError, match="data.group_key='query' ranks rows by their relevance: set data.target"):
        check(target=None, mlflow={"promotion_metric": "loss"})
    with pytest.raises(ConfigError, match="data.item_key='item' names the items of ranking data: set data.group_key"):
        check(group_key=None, mlflow={"promotion_metric": "accuracy"})
    with pytest.raises(ConfigError, match="target_positions must be 'last'"):
        check(target_positions="all")
    # a window of history (a sequence key) scores its last row, by that row's relevance: horizon 0 (it defaulted
    # to 1, so each window was scored by the next row's relevance, for an item the model never saw)
    history = check(sequence_key="user", order_by="at", window=3)
    assert history.data.effective_horizon == 0
    with pytest.raises(ConfigError, match="data.horizon=1 with data.group_key: a ranked row is scored by its own"):
        check(sequence_key="user", order_by="at", window=3, horizon=1)
    with pytest.raises(ConfigError, match="evaluation.k holds \\[0\\]"):
        validate_config({**ranking_config(tmp_path), "evaluation": {"k": [0, 5]}})


def test_a_range_split_that_cuts_queries_counts_them_and_one_by_a_value_each_query_holds_cuts_none(tmp_path):
    """A date range over ranking data is by value: a session across a bound was ranked in halves (its test rows
    without its others), silently. The encode counts such groups (said in its log with what to split by); a range
    over a value each query holds once (its start) keeps every query whole."""
    import json

    from shardline.core.config import validate_config
    from shardline.tasks.encode import encode_dataset
    from shardline.tasks.ingest import snapshot_source

    raw = make_clicks(tmp_path / "raw", groups=40, files=1)  # 12 rows a query, in query order
    raw.with_columns(
        pl.int_range(pl.len(), dtype=pl.Int64).alias("t"),
        (pl.col("query").str.slice(1).cast(pl.Int64) * 12).alias("start"),
    ).write_parquet(tmp_path / "raw" / "clicks-0.parquet")
    for column, cut in (("t", 2), ("start", 0)):  # bounds 290 and 390 fall inside queries 24 and 32
        ranges = {"train": [None, 290], "validation": [291, 390], "test": [391, None]}
        config = validate_config(
            ranking_config(tmp_path, split={"method": "range", "column": column, "ranges": ranges})
        )
        out = tmp_path / f"enc-{column}"
        manifest = json.loads(Path(encode_dataset(snapshot_source(config.data), config.data, str(out))).read_text())
        records = [json.loads(p.read_text()) for p in (out / "groups").glob("*/group.json")]
        assert sum(r["cut"] for r in records) == cut, column
        assert sum(manifest["rows"].values()) == raw.height
