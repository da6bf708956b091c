"""The champion gate compares like with like.

A candidate's test metrics were computed on its own test split. When the champion was evaluated on
other data (another data fingerprint: new raw files, a changed split), its recorded metric says nothing
about this test split, so the two numbers are not compared. Instead the champion, a registered model
that takes raw rows, predicts the candidate's test rows, and both are scored on exactly the same rows
by the same function; or, when that cannot be done (a metric that needs every class's probability, a
column the champion needs and this data lacks), the gate says why and keeps the champion. What was
compared is recorded on the candidate's version (`shardline.gate`).
"""

from __future__ import annotations

import io

import polars as pl
import pyarrow.parquet as pq

from shardline.core import storage
from shardline.core.config import FILE_SEQUENCE, metric_key, stable_hash
from shardline.core.encoding.columns import ORDER, SEQ, prepare
from shardline.core.manifest import EncodingSpec, Manifest, Snapshot
from shardline.core.metrics import scores as M

# what a served prediction (the predicted value, no class distribution) can be scored on
SERVED_METRICS = {"classification": ("accuracy", "macro_f1"), "regression": ("mae", "rmse", "r2")}
# test rows the champion predicts at most (a raw file's more): its memory and time do not grow with the data
GATE_ROWS = 200_000


TOKENIZER_TAG = "shardline.tokenizer_sha256"  # a text model's: its perplexity counts the tokens of this tokenizer
PREDICTS_TAG = "shardline.predicts"  # what a version predicts (`predicts`): versions that differ in it do not compare
TEST_SPLIT_TAG = "shardline.test_split"  # the test windows a version was scored on (`test_split_id`)


def predicts(spec: EncodingSpec) -> str:
    """What a model predicts, as the gate compares it (JSON): its targets (column and task), how many rows ahead
    (the horizon), a ranking model's groups, a text model's target. Two versions that differ in it answer
    different questions: their scores say nothing of each other."""
    import json

    what: dict = {"targets": [[t.column, t.task] for t in spec.targets], "horizon": spec.horizon}
    if spec.group_key:
        what["group_key"] = spec.group_key
    if spec.text is not None:
        what["text"] = spec.text.target_name
    return json.dumps(what, sort_keys=True)


def test_split_id(manifest: Manifest) -> str:
    """The test windows a version's recorded metrics were computed on: its test shards (their rows, by checksum) and
    how windows are cut from them (window, horizon, which positions are scored). The same raw files split otherwise
    (another seed, other fractions or ranges) or windowed otherwise are other test windows: the same data fingerprint,
    yet recorded metrics that do not compare (a test split of one easy file scored 0.98 against 0.88 on ten)."""
    spec = manifest.encoding
    return stable_hash(
        {
            "shards": [s.sha256 for s in manifest.shards_of("test")],
            "window": spec.window,
            "horizon": spec.horizon,
            "positions": spec.target_positions,
        }
    )


def _said(predicted: str) -> str:
    """`predicts`' JSON, for reading: `p1_action (classification), 1 row ahead`."""
    import json

    what = json.loads(predicted)
    said = ", ".join(f"{c} ({task})" for c, task in what["targets"]) or what.get("text") or "its own loss's targets"
    said += f", {what['horizon']} row(s) ahead" if what["horizon"] else ", the row itself"
    return said + (f", ranked by {what['group_key']}" if what.get("group_key") else "")


TEXT_SCORES = ("perplexity", "loss", "accuracy")  # what a text champion is re-scored on (no generations)


def rescore_text_champion(model_uri: str, manifest: Manifest, manifest_uri: str, metric: str) -> dict:
    """Score a text champion (`model_uri`) on the candidate's test split (`manifest`'s, the same tokenizer: its
    token ids are the champion's) as evaluation scored the candidate: `{"champion_value", "rows", "on"}`, or
    `{"reason"}` when it cannot be done."""
    import math

    import torch

    from shardline.runs.model_files import load_checked
    from shardline.trainer.data import open_split
    from shardline.trainer.validate import evaluate

    if metric not in TEXT_SCORES:
        return {"reason": f"{metric} scores generations; a text champion is re-scored on {', '.join(TEXT_SCORES)}"}
    spec = manifest.encoding
    predictor = getattr(load_checked(model_uri).unwrap_python_model(), "predictor", None)
    if predictor is None or predictor.spec.text is None or predictor.spec.window != spec.window:
        return {"reason": "the champion is no text model of this data.window"}
    test = open_split(manifest, manifest_uri, "test")
    try:
        scores = evaluate(predictor.model, test, 256, torch.device("cpu"))
    finally:
        test.release()
    values = {"perplexity": scores["val_perplexity"], "accuracy": scores["val_accuracy"]}
    values["loss"] = math.log(values["perplexity"])
    return {"champion_value": values[metric], "rows": int(test.n_windows), "on": "the candidate's test split"}


def champion_gate(client, name: str, metric: str, direction: str, new_value: float) -> tuple[bool, dict | None]:
    """Whether the new version beats the current champion on `metric` by their recorded values, at full
    precision (True when there is none); the champion's version, value and data fingerprint."""
    from mlflow.exceptions import MlflowException

    try:
        current = client.get_model_version_by_alias(name, "champion")
    except MlflowException:
        return True, None
    info = {
        "version": str(current.version),
        "value": recorded_value(client, current, metric),
        "data_fingerprint": current.tags.get("shardline.data_fingerprint"),
        "tokenizer": current.tags.get(TOKENIZER_TAG),
        "predicts": current.tags.get(PREDICTS_TAG),
        "test_split": current.tags.get(TEST_SPLIT_TAG),
    }
    return info["value"] is None or better(new_value, info["value"], direction), info


def recorded_value(client, version, metric: str) -> float | None:
    """A registered version's test `metric` at full precision: its run's `test/<metric>`. Its `metric.<metric>`
    tag is for reading (rounded to 4 digits: two values that differ in the 5th would compare equal); it is
    read only where the run is gone or lacks the metric (versions registered before the tags were rounded
    hold the full float there)."""
    from mlflow.exceptions import MlflowException

    if version.run_id:
        try:
            value = client.get_run(version.run_id).data.metrics.get(f"test/{metric_key(metric)}")
        except MlflowException:  # the run was deleted from the tracking store: the tag is what is left
            value = None
        if value is not None:
            return float(value)
    tag = version.tags.get(f"metric.{metric_key(metric)}")
    return float(tag) if tag is not None else None


def better(new: float, old: float, direction: str) -> bool:
    return new > old if direction == "maximize" else new < old


def _align(frame: pl.DataFrame, like: pl.DataFrame, keys: list[str]) -> pl.DataFrame:
    """`frame`'s key columns in `like`'s types (served predictions carry time zones as naive UTC)."""
    for k in keys:
        want, have = like.schema[k], frame.schema[k]
        if want == have:
            continue
        if isinstance(want, pl.Datetime) and want.time_zone:
            frame = frame.with_columns(pl.col(k).dt.replace_time_zone("UTC").dt.convert_time_zone(want.time_zone))
        frame = frame.with_columns(pl.col(k).cast(want))
    return frame


def _score(task: str, truth: pl.Series, predicted: pl.Series) -> dict[str, float]:
    if task == "regression":
        return M.regression_metrics(truth.cast(pl.Float64).to_numpy(), predicted.cast(pl.Float64).to_numpy())
    # served labels counted into a sparse confusion table (no rows x labels table, no labels x labels one: a test
    # split of millions of windows, a target of tens of thousands of classes)
    truth, predicted = truth.cast(pl.String), predicted.cast(pl.String)
    labels = pl.concat([truth, predicted]).unique().sort()
    ids = dict(zip(labels.to_list(), range(len(labels))))
    y = truth.replace_strict(ids, return_dtype=pl.Int64).to_numpy()
    pred = predicted.replace_strict(ids, return_dtype=pl.Int64).to_numpy()
    return M.label_scores(M.sparse_confusion(y, pred, len(labels)))


def _first_rows(
    snapshot: Snapshot, need: list[str], check: list[str], keep, numbered: str = ""
) -> tuple[list[pl.DataFrame], int] | str:
    """The rows `keep(frame, uri)` picks of the first raw files (columns `need`; `numbered`: a column of each row's
    number in its file), up to GATE_ROWS (the memory is bounded), and how many, their date-times in one zone where
    the files' differ; or why not: the first file that lacks a column of `check`."""
    from shardline.core.encoding.folders import folder_columns, with_columns
    from shardline.core.encoding.read import in_one_zone
    from shardline.trainer.serving import dictionaries_as_values

    frames, uris, n = [], [], 0
    for uri, handle in storage.fetched([(f.uri, f.size) for f in snapshot.files]):  # concurrent batches
        source = pq.ParquetFile(handle)
        held = source.schema_arrow.names
        extra = folder_columns(uri, snapshot.source, [*need, *check], held)  # hive-style folders' columns
        missing = [c for c in check if c not in held and c not in extra]
        if missing:
            return f"the champion needs column(s) {missing}, which {uri} does not have"
        start = 0
        for g in range(source.num_row_groups):  # a row group at a time: a large file is not read whole
            table = dictionaries_as_values(source.read_row_group(g, columns=[c for c in need if c not in extra]))
            frame = with_columns(pl.from_arrow(table), extra)
            if numbered:  # as the encode numbers the rows of data without an order column
                frame = frame.with_columns(pl.int_range(start, start + frame.height, dtype=pl.Int64).alias(numbered))
                start += frame.height
            frames.append(keep(frame, uri))
            uris.append(uri)
            n += frames[-1].height
            if n >= GATE_ROWS:
                return in_one_zone(frames, uris), n
    return in_one_zone(frames, uris), n


def reevaluate_champion(
    model_uri: str, spec: EncodingSpec, snapshot: Snapshot, predictions_uri: str, metric: str
) -> dict:
    """Score the champion (`model_uri`, raw rows in) and the candidate (its test predictions) on the
    candidate's test rows: `{"champion_value", "candidate_value", "rows", "on"}`, or `{"reason"}` when it
    cannot be done."""

    from shardline.core.encoding.folders import below
    from shardline.trainer.serving import file_key, kept_notes, naive_utc

    if len(spec.targets) != 1 or spec.target_positions == "all":
        return {"reason": "re-scoring a champion on another test split covers one target, last position only"}
    target = spec.targets[0]
    if metric not in SERVED_METRICS[target.task]:
        if "@" in metric or metric == "mrr":  # a ranking metric (data.group_key) without data.item_key
            needs = "ranks the candidate's test groups by each row's score, matched on data.item_key (not set),"
        else:
            needs = "needs every class's probability"
        return {
            "reason": f"{metric} {needs}, which a served prediction does not give; the champion can be re-scored on "
            f"{', '.join(SERVED_METRICS[target.task])} (mlflow.promotion_metric)"
        }
    by_file = file_key(spec)  # where the file is the sequence, the column of its name (as the predictions give it)
    order = spec.order_by or ("row" if by_file else None)  # without an order column: each row's number in its file
    if order is None:
        return {"reason": "the data has no order column (data.order_by) to match the champion's rows with"}
    from shardline.runs.model_files import load_checked

    model = load_checked(model_uri)  # only with the files it was registered with
    schema = model.metadata.get_input_schema()
    wanted = schema.input_names() if schema is not None else []
    # rows are matched on their sequence and order as the encoding holds them (the sequence as text, the order as
    # int64, a date-time as its instant; the candidate's test predictions hold them in the raw types), not on the id
    # columns
    # where the file is the sequence, its name (as the candidate's predictions give it) stands for a sequence key
    seq_key = spec.sequence_key if spec.sequence_key not in (None, FILE_SEQUENCE) else by_file
    raw_keys = [*([seq_key] if seq_key else []), order]
    keys = [*([SEQ] if seq_key else []), ORDER]

    def encoded(frame: pl.DataFrame, where: str) -> pl.DataFrame:
        if by_file and by_file not in frame.columns:  # a raw file's rows: its name below the source's folder
            frame = frame.with_columns(pl.lit(below(where, snapshot.source), pl.String).alias(by_file))
        return prepare(frame, seq_key, order, where, spec.order_format)

    predicted = pq.ParquetFile(io.BytesIO(storage.read_bytes(predictions_uri)))
    if any(c not in predicted.schema_arrow.names for c in [*raw_keys, "prediction"]):
        missing = [c for c in [*raw_keys, "prediction"] if c not in predicted.schema_arrow.names]
        return {"reason": f"the candidate's test predictions lack the column(s) {missing}"}
    groups = range(predicted.num_row_groups)  # a row group at a time: the test split may be millions of rows

    def candidate(i: int, columns: list[str]) -> pl.DataFrame:
        frame = pl.from_arrow(predicted.read_row_group(i, columns=columns))
        frame = frame.rename(dict(zip(raw_keys, keys))).with_columns(pl.col(ORDER).to_physical().cast(pl.Int64))
        return frame.with_columns(pl.col(SEQ).cast(pl.Utf8)) if SEQ in frame.columns else frame

    test_keys = pl.concat([candidate(i, raw_keys)[keys[0]].unique() for i in groups]).unique()
    need = list(dict.fromkeys([*wanted, *raw_keys, target.column]))
    found = _first_rows(
        snapshot, need, [*wanted, target.column],
        lambda frame, uri: encoded(frame, uri).filter(pl.col(keys[0]).is_in(test_keys.implode())),
        numbered="" if spec.order_by else order,
    )  # fmt: skip
    if isinstance(found, str):
        return {"reason": found}
    frames, n = found
    rows = pl.concat(frames, how="vertical_relaxed")

    def serve(part: pl.DataFrame) -> pl.DataFrame:  # a frame the model takes is one file where the file is the sequence
        served = pl.from_pandas(model.predict(naive_utc(part.select(wanted or part.columns).to_pandas())))
        return served.with_columns(pl.lit(part[by_file][0]).alias(by_file)) if by_file else served

    with kept_notes() as notes:  # the champion on data it never saw: its notes go in the record, not the console
        parts = rows.partition_by(by_file, maintain_order=True) if by_file else [rows]
        served = pl.concat([serve(part) for part in parts], how="vertical_relaxed")
    served = encoded(_align(served, rows, raw_keys), "the champion's predictions")
    sampled = pl.concat(  # the candidate's predictions of those rows only, a row group at a time
        [candidate(i, [*raw_keys, "prediction"]).join(rows.select(keys), on=keys, how="semi") for i in groups],
        how="vertical_relaxed",
    )
    joined = sampled.join(served.select([*keys, pl.col("prediction").alias("__champion")]), on=keys).join(
        rows.select([*keys, pl.col(target.column).alias("__truth")]), on=keys
    )
    if joined.height == 0:
        return {"reason": "the champion predicted none of the candidate's test rows"}
    return {
        "champion_value": _score(target.task, joined["__truth"], joined["__champion"])[metric],
        "candidate_value": _score(target.task, joined["__truth"], joined["prediction"])[metric],
        "rows": joined.height,
        "on": "the candidate's test split, its rows that both models predict"
        if n < GATE_ROWS
        else f"the candidate's test rows in its first {len(frames)} raw files, the first {GATE_ROWS:,} rows or more, "
        "not its whole test split",
        **({"champion_notes": notes} if notes else {}),
    }


def _ranked(metric: str, groups: pl.Series, score: pl.Series, relevance: pl.Series) -> float:
    """`metric` (`ndcg@10`, `mrr`, ...) of rows ranked by `score` in their groups, ties averaged, as evaluation
    ranks them."""
    from shardline.core.metrics.ranking import ranking_metrics

    ks = [int(metric.split("@")[1])] if "@" in metric else [1]
    return ranking_metrics(groups.to_numpy(), score.to_numpy(), relevance.to_numpy(), ks, ties="average")[metric]


def reevaluate_ranking_champion(
    model_uri: str, spec: EncodingSpec, snapshot: Snapshot, predictions_uri: str, metric: str
) -> dict:
    """Ranking data with an item key: the champion (`model_uri`) serves the raw rows of the candidate's test
    groups, and both are scored on the rows both predicted, matched on (group, item): a ranking metric ranks
    each group by the two models' `ranking_score` against the relevance evaluation recorded; a served metric
    (`SERVED_METRICS`) compares their predictions with the raw target. `{"champion_value", "candidate_value",
    "rows", "on"}`, or `{"reason"}`."""
    from shardline.core.encoding.row_keys import RELEVANCE
    from shardline.runs.model_files import load_checked
    from shardline.trainer.serving import kept_notes, naive_utc

    target, ranking = spec.targets[0], "@" in metric or metric == "mrr"
    if not ranking and (metric not in SERVED_METRICS[target.task] or len(spec.targets) != 1):
        return {
            "reason": f"{metric} is re-scored on another test split for a ranking metric or one target's "
            f"{', '.join(SERVED_METRICS[target.task])} only"
        }
    keys = [spec.group_key, spec.item_key]
    score = "ranking_score" if ranking else "prediction"
    file = io.BytesIO(storage.read_bytes(predictions_uri))
    if any(c not in pq.read_schema(file).names for c in [*keys, RELEVANCE, score]):
        return {"reason": "the candidate's test predictions lack the group, item, relevance or score column(s)"}
    file.seek(0)
    predicted = pl.read_parquet(file, columns=[*keys, RELEVANCE, score])  # 4 columns of the test split's rows
    model = load_checked(model_uri)  # only with the files it was registered with
    schema = model.metadata.get_input_schema()
    wanted = schema.input_names() if schema is not None else []
    need = list(dict.fromkeys([*wanted, *keys, target.column]))
    test_groups = predicted[spec.group_key].unique().implode()
    found = _first_rows(snapshot, need, need, lambda frame, _: frame.filter(pl.col(spec.group_key).is_in(test_groups)))
    if isinstance(found, str):
        return {"reason": found}
    frames, n = found
    rows = pl.concat(frames, how="vertical_relaxed")
    with kept_notes() as notes:  # the champion on data it never saw: its notes go in the record, not the console
        served = pl.from_pandas(model.predict(naive_utc(rows.select(wanted or rows.columns).to_pandas())))
    if score not in served.columns or any(k not in served.columns for k in keys):
        return {
            "reason": f"the champion serves no {score} with its rows' group and item (registered by an older "
            "Shardline): it cannot rank the candidate's test groups"
        }
    served = _align(served, rows, keys)

    def once(frame: pl.DataFrame) -> pl.DataFrame:  # a (group, item) shown twice cannot be matched: left out
        return frame.filter(pl.len().over(keys) == 1)

    joined = (
        once(predicted)
        .join(once(served.select([*keys, pl.col(score).alias("__champion")])), on=keys)
        .join(once(rows.select([*keys, pl.col(target.column).alias("__truth")])), on=keys)
    )
    if joined.height == 0:
        return {"reason": "the champion predicted none of the candidate's test rows"}
    if ranking:
        values = [_ranked(metric, joined[spec.group_key], joined[s], joined[RELEVANCE]) for s in ("__champion", score)]
    else:
        values = [_score(target.task, joined["__truth"], joined[s])[metric] for s in ("__champion", score)]
    return {
        "champion_value": values[0],
        "candidate_value": values[1],
        "rows": joined.height,
        "on": "the candidate's test groups, the rows both models ranked, matched on group and item"
        if n < GATE_ROWS
        else f"the candidate's test groups in its first {len(frames)} raw files, the first {GATE_ROWS:,} rows or "
        "more, not its whole test split",
        **({"champion_notes": notes} if notes else {}),
    }


def compare_with_champion(
    previous: dict | None,
    manifest: Manifest,
    manifest_uri: str,
    snapshot: Snapshot,
    files: list,
    name: str,
    metric_name: str,
    new_value: float,
    uri: str,
) -> dict:
    """How the candidate (`manifest`'s data, its evaluation's `files`, `new_value`) is compared with the champion
    `previous` (`champion_gate`'s): by the recorded metrics (the same test windows, `test_split_id`, and the same
    tokenizer); re-scored on the candidate's test split (other test windows, or a champion that does not say which
    it was scored on: `{"champion_value", "candidate_value", ...}`); or not at all (`{"reason"}`: a text champion of
    another tokenizer, or one that cannot be re-scored)."""
    from shardline.core.secrets import redact_text
    from shardline.core.tracking.tracker import fluent_tracking_uri

    compared: dict = {"on": "the recorded test metrics (the same test split)"}
    split = test_split_id(manifest)
    champion = f"models:/{name}/{previous['version']}" if previous else None
    text = manifest.encoding.text
    tokens = text.tokenizer_sha256 if text is not None else None
    mine = predicts(manifest.encoding)
    if previous and previous.get("predicts") and previous["predicts"] != mine:
        # another target (or horizon): its score, recorded or re-scored on this test split, answers another question
        compared = {
            "reason": f"the champion predicts {_said(previous['predicts'])}; this version {_said(mine)}: they "
            f"answer different questions, so their {metric_name} do not compare. A model of another target belongs "
            "under a name of its own: set mlflow.model_name"
        }
    elif previous and tokens and previous.get("tokenizer") and previous["tokenizer"] != tokens:
        # a text champion of another tokenizer: its perplexity counts other tokens, on any data
        compared = {
            "reason": f"the champion reads another tokenizer ({previous['tokenizer'][:12]}, this version "
            f"{tokens[:12]}): their {metric_name} count other tokens and do not compare"
        }
    elif previous and previous.get("test_split") != split:
        # the champion was tested on other windows (other data, or the same split otherwise), or does not say which:
        # its number is not compared; it is re-scored on this test split
        preds = next((f for f in files if str(f).endswith("test_predictions.parquet")), None)
        try:
            with fluent_tracking_uri(uri):
                if tokens:  # text: the champion scored on the test split's tokens, as evaluation scored this one
                    compared = rescore_text_champion(champion, manifest, manifest_uri, metric_name)
                    compared.setdefault("candidate_value", new_value)
                elif preds and manifest.encoding.group_key and manifest.encoding.item_key:  # ranking data
                    compared = reevaluate_ranking_champion(champion, manifest.encoding, snapshot, preds, metric_name)
                elif preds:
                    compared = reevaluate_champion(champion, manifest.encoding, snapshot, preds, metric_name)
                else:
                    compared = {"reason": "the candidate's test predictions are not in its evaluation"}
        except Exception as e:  # noqa: BLE001 - said, and the champion kept
            compared = {"reason": f"re-scoring the champion failed: {type(e).__name__}: {redact_text(str(e))}"}
        compared["champion_data_fingerprint"] = previous.get("data_fingerprint")
        compared["champion_test_split"] = previous.get("test_split")
    return compared
