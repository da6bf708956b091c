"""Evaluate: the best checkpoint on the test split, beside a trivial baseline, with plots; ranking data
(`data.group_key`) also by its ranking metrics, beside the popularity baseline's."""

from __future__ import annotations

import math
import os
import re
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import polars as pl
import pyarrow.parquet as pq
from prefect import task
from prefect.logging import get_run_logger

from shardline.core import storage
from shardline.core.config import (
    CLASSIFICATION_METRICS,
    FILE_SEQUENCE,
    REGRESSION_METRICS,
    PipelineConfig,
    ranking_metrics_of,
)
from shardline.core.encoding.row_keys import GROUP, ITEM, RELEVANCE
from shardline.core.manifest import Manifest
from shardline.core.metrics import report as R
from shardline.core.metrics import scores as M
from shardline.core.metrics.ranking import PopularityCounts, RankingScores
from shardline.core.metrics.split_ranking import RowKeys, SplitRanking
from shardline.core.metrics.text import text_generation_scores, unigram_perplexity
from shardline.core.secrets import redact_text, redacted_errors
from shardline.runs.result import EvalResult, Trained, TrainResult
from shardline.tasks.caching import CacheRule
from shardline.trainer.serving import data_spec, decode_truth, example_outputs, file_key, prediction_frame


class RankingEvaluation(SplitRanking):
    """Ranking data: the test split's groups ranked by the model's score for the relevance (the first target),
    as `SplitRanking` ranks them (the validation's code too), and by the popularity baseline's: its item's
    relevant rows in the training split (the manifest's `item_counts`), or, without `data.item_key`, one score
    for every row: a random order, whose expected metrics are what tied scores averaged give."""

    def __init__(self, manifest: Manifest, manifest_uri: str, ks: list[int]):
        super().__init__(manifest, manifest_uri, "test", ks)
        spec = self.spec
        if spec.item_key and manifest.item_counts is None:
            raise ValueError("the manifest has no item_counts for the popularity baseline; encode again")
        self.counts = PopularityCounts.from_counts(manifest.item_counts) if spec.item_key else None
        # ties averaged: the popularity baseline ties every item it never counted, and a stable order would
        # rank those by where the rows happen to be stored
        self.baseline = RankingScores(ks, ties="average")

    def update(self, where: dict, output: np.ndarray) -> dict[str, pl.Series]:
        """One batch: its windows' keys (`window_keys_of`) and the relevance target's outputs; returns the
        columns its predictions gain (the group, the item, the relevance, both scores)."""
        rows, score, codes = super().update(where["shard"], where["row"], output)
        groups, relevance = rows[GROUP], rows[RELEVANCE]
        if self.counts is not None:  # the manifest's counts are keyed by the item as text
            popularity = self.counts.scores(rows[ITEM].cast(pl.Utf8).to_numpy().astype(str))
        else:
            popularity = np.zeros(len(score))
        self.baseline.update(codes, popularity, relevance.to_numpy())
        columns = {self.spec.group_key: groups}
        if self.spec.item_key:
            columns[self.spec.item_key] = rows[ITEM]
        columns[RELEVANCE] = relevance
        columns["ranking_score"] = pl.Series(score)
        if self.counts is not None:
            columns["popularity"] = pl.Series(popularity)
        return columns

    def scores(self) -> tuple[dict[str, float], dict[str, float], dict]:
        """(the model's metrics, the baseline's, facts: the groups scored and which baseline it is)."""
        model, baseline = self.metrics(), self.baseline.metrics()
        facts = {k: model.pop(k) for k in ("groups", "groups_with_relevant")}
        for k in facts:
            baseline.pop(k)
        facts["baseline"] = "popularity" if self.counts is not None else "random order"
        return model, baseline, facts


def train_statistic(manifest: Manifest, i: int, t) -> np.ndarray | float:
    """What the i-th target's trivial baseline needs from the training split, from the manifest's statistics:
    its class counts by id (id 0: the values the encoding does not know), or its mean in raw units."""
    if manifest.target_stats is None:  # every manifest since encoder version 7 has them
        raise ValueError("the manifest has no target_stats for the trivial baseline; encode again")
    stat = manifest.target_stats[i]
    if t.task != "classification":
        return float(stat["mean"])
    ids = {v: k + 1 for k, v in enumerate(t.classes or [])}
    counts = np.zeros(t.n_outputs, np.float64)
    for value, n in stat["counts"].items():
        counts[ids.get(value, 0)] += n
    return counts


def _scores(t, train_stat) -> M.ClassificationScores | M.RegressionScores:
    """A target's metrics, and its trivial baseline's, accumulated batch by batch."""
    if t.task == "classification":
        return M.ClassificationScores(t.n_outputs, train_stat)
    return M.RegressionScores(train_stat)


def _count(t, scores, y: np.ndarray, outputs: np.ndarray) -> None:
    """One batch of a target into its scores (every position counted when it has several): class ids and
    probabilities, or values in the target's raw units."""
    if t.task == "classification":
        scores.update(y.reshape(-1).astype(np.int64), outputs.reshape(-1, outputs.shape[-1]))
    else:
        y_raw = y.reshape(-1).astype(np.float64) * t.std + t.mean
        scores.update(y_raw, outputs.reshape(-1).astype(np.float64) * t.std + t.mean)


PER_CLASS_FILE = "per_class.csv"
PER_CLASS_SHOWN = 50  # rows of a per-class table in its Prefect artifact: the classes with the most test samples


def _target_scores(t, scores, out_dir: Path, prefix: str):
    """One target's metrics, its baseline's, and its files: a plot, and for a class target its per-class table."""
    metrics, baseline = scores.metrics(), scores.baseline()
    if t.task == "classification":
        if t.n_outputs - 1 <= M.TOP_K:  # 5 classes or fewer (id 0 is 'unseen'): top-5 says nothing
            metrics.pop("top5_accuracy")
            baseline.pop("top5_accuracy")
        names = t.class_names()
        plot = R.plot_confusion_counts(scores.confusion, names, out_dir / f"{prefix}confusion_matrix.png")
        per_class = pl.DataFrame(
            M.per_class_scores(scores.confusion, names),
            schema={"class": pl.String, "support": pl.Int64, "predicted": pl.Int64}
            | {k: pl.Float64 for k in ("precision", "recall", "f1")},
        )
        table = out_dir / f"{prefix}{PER_CLASS_FILE}"
        storage.write_text(str(table), per_class.write_csv())  # atomic: a reader never sees half a table
        return metrics, baseline, [plot, table], CLASSIFICATION_METRICS
    plot = R.plot_residuals(*scores.sample.kept, out_dir / f"{prefix}residuals.png")
    return metrics, baseline, [plot], REGRESSION_METRICS


ROWS_PER_WRITE = 1 << 16


@contextmanager
def predictions_file(path: Path) -> Iterator[Callable[[pl.DataFrame], None]]:
    """A parquet file written a few batches' rows at a time (pyarrow's ParquetWriter: a row group per
    write), aside and renamed into place when complete, so its size never has to fit in memory: yields
    the function that writes a frame."""
    tmp, pending, writer = path.with_name(f".tmp-{path.name}"), [], None

    def flush() -> None:
        nonlocal writer
        table = pl.concat(pending).to_arrow()
        if writer is None:
            writer = pq.ParquetWriter(tmp, table.schema, compression="zstd")
        writer.write_table(table)
        pending.clear()

    def write(frame: pl.DataFrame) -> None:
        pending.append(frame)
        if sum(f.height for f in pending) >= ROWS_PER_WRITE:
            flush()

    try:
        yield write
        if pending or writer is None:
            flush()
        writer.close()
        os.replace(tmp, path)
    finally:
        if writer is not None:
            writer.close()
        tmp.unlink(missing_ok=True)


def _own_loss_scores(model, test, batch_size: int = 4096) -> dict[str, float]:
    """A model without a target: its own loss on the test split, and the means of its `metrics` (when it
    defines them), per window."""
    import torch

    from shardline.trainer.validate import evaluate as validate

    scores = validate(model, test, batch_size, torch.device("cpu"))
    return {("loss" if k == "val_loss" else k.removeprefix("val_")): v for k, v in scores.items()}


GENERATIONS_FILE = "generations.csv"
GENERATION_MARGIN = 8  # new tokens beyond the longest reference, by default
GENERATION_CAP = 256  # ... and never more than this many


def test_pairs(test, limit: int, sep_id: int, eos_id: int, prompts: bool = True) -> list[tuple[list[int], list[int]]]:
    """A generation target's (prompt, reference) token ids, per sequence of the split `test` in the shards' order,
    the first `limit`: the prompt is the sequence's tokens before its first target token (the source, `<sep>`
    included; without `prompts`, none), the reference its target tokens from there up to the `<sep>` or `<eos>`
    that ends them."""
    from shardline.trainer.data import target_names

    pairs: list[tuple[list[int], list[int]]] = []

    def per_shard(v, s):
        if len(pairs) >= limit:
            return
        tokens = np.asarray(v.arrays["cat"])[:, 0]
        target = np.asarray(v.arrays[target_names(v.arrays)[0]])
        offsets = np.asarray(v.arrays["offsets"], dtype=np.int64)
        for lo, hi in zip(offsets[:-1], offsets[1:]):
            if len(pairs) >= limit:
                return
            real = np.flatnonzero(target[lo:hi])
            if not len(real):
                continue
            first = lo + int(real[0])
            ref = []
            for t in tokens[first:hi].tolist():
                if t in (sep_id, eos_id) or not target[first + len(ref)]:
                    break
                ref.append(int(t))
            pairs.append((tokens[lo:first].astype(np.int64).tolist() if prompts else [], ref))

    test.each_shard(per_shard, until=lambda: len(pairs) >= limit)
    return pairs


MAJORITY_PAIRS = 20_000  # the training sequences whose targets the generation baseline's answer is the commonest of


def majority_answer(manifest: Manifest, manifest_uri: str, config, sep_id: int, eos_id: int) -> list[int] | None:
    """The commonest target among the first MAJORITY_PAIRS sequences of the splits training fitted on, as token ids:
    the answer the generation baseline gives every test row, as the majority class is a classifier's (a tie goes to
    the one seen first); None where they hold no target."""
    from shardline.trainer.data import open_split

    fit = [s for s in config.data.split.fit_splits() if manifest.shards_of(s)]
    if not fit:
        return None
    train = open_split(manifest, manifest_uri, fit[0] if len(fit) == 1 else fit)
    counts = Counter(tuple(r) for _, r in test_pairs(train, MAJORITY_PAIRS, sep_id, eos_id, prompts=False))
    return list(counts.most_common(1)[0][0]) if counts else None


def generation_scores(
    model, manifest: Manifest, manifest_uri: str, test, config, out_dir: Path
) -> tuple[dict, dict, str]:
    """A generation target's exact match and token F1 (`text_generation_scores`) of greedy generations on the
    first `evaluation.max_generations` test sequences, each prompted with its source and `<sep>` (as
    training laid it out) and given `evaluation.max_new_tokens` new tokens (default: the longest reference
    plus GENERATION_MARGIN, at most GENERATION_CAP); every generation written to generations.csv (source,
    reference, output). Returns the metrics, the baseline's (the training targets' commonest answer given to
    every row: `majority_answer`) and a few examples as markdown; ({}, {}, "") for pre-training."""
    from shardline.core.encoding.text import EOS_ID, SEP_ID, decode
    from shardline.trainer.generate import continuations

    text = manifest.encoding.text
    limit = config.evaluation.max_generations
    if text.target_column is None or limit == 0:
        return {}, {}, ""
    pairs = test_pairs(test, limit, SEP_ID, EOS_ID)
    if not pairs:
        return {}, {}, ""
    tokenizer = storage.read_text(
        storage.resolve(manifest_uri.rsplit("/", 1)[0], manifest.tokenizer or "tokenizer.json")
    )
    longest = max(len(r) for _, r in pairs)
    max_new = config.evaluation.max_new_tokens or min(longest + GENERATION_MARGIN, GENERATION_CAP)
    outputs = continuations(model, tokenizer, [p for p, _ in pairs], max_new, temperature=0.0, stop_at_sep=True)
    sources = [decode(tokenizer, p) for p, _ in pairs]
    references = [decode(tokenizer, r) for _, r in pairs]
    frame = pl.DataFrame({"source": sources, "reference": references, "output": outputs})
    frame.write_csv(out_dir / GENERATIONS_FILE)
    scores = text_generation_scores(outputs, references)
    answer = majority_answer(manifest, manifest_uri, config, SEP_ID, EOS_ID)
    answer = None if answer is None else decode(tokenizer, answer)
    baseline = {} if answer is None else text_generation_scores([answer] * len(references), references)
    cut = lambda t, n=120: (t[:n] + "…" if len(t) > n else t).replace("|", "\\|").replace("\n", " ")
    rows = [f"| {cut(s)} | {cut(r)} | {cut(o)} |" for s, r, o in frame.head(3).iter_rows()]
    examples = (
        f"Greedy generations on {len(pairs)} test sequences (up to {max_new} new tokens; all in {GENERATIONS_FILE}), "
        "the first three:\n\n| source | reference | output |\n| --- | --- | --- |\n" + "\n".join(rows)
    )
    if answer is not None:
        examples += f'\n\nThe baseline answers every one with the training targets\' commonest: "{cut(answer)}".'
    return scores, baseline, examples


def evaluate_text(manifest: Manifest, manifest_uri: str, model, test, plots: list, out_dir: Path, config) -> dict:
    """Text data: on the test split's target tokens (every window's positions whose target is not <pad>), the
    model's mean token loss (`loss`), its perplexity (exp of it) and next-token accuracy, against a unigram
    model of the training split's target tokens (`perplexity_baseline`: the manifest's `token_counts`), on
    the same positions."""
    import torch

    from shardline.trainer.data import ScoredLoader
    from shardline.trainer.validate import evaluate as validate

    scores = validate(model, test, 256, torch.device("cpu"))
    text = manifest.encoding.text
    held = np.zeros(text.vocab_size, np.int64)  # the test positions' target tokens, as the model was scored
    for batch in ScoredLoader(test, 4096, stride=True, ignore=text.pad_id):  # the windows `validate` scores
        held += np.bincount(batch.targets[0].numpy().reshape(-1).astype(np.int64), minlength=text.vocab_size)
    held[text.pad_id] = 0
    baseline_ppl = unigram_perplexity(manifest.token_counts or [0] * text.vocab_size, held)
    perplexity = scores["val_perplexity"]
    metrics = {"perplexity": perplexity, "loss": math.log(perplexity), "accuracy": scores["val_accuracy"]}
    baseline = {"perplexity": baseline_ppl, "loss": math.log(baseline_ppl)}
    generated, generated_baseline, examples = generation_scores(model, manifest, manifest_uri, test, config, out_dir)
    metrics.update(generated)
    baseline.update(generated_baseline)
    directions = {k: "maximize" if k in ("accuracy", "exact_match", "token_f1") else "minimize" for k in metrics}
    table = R.format_metrics_table(metrics, baseline, directions)
    files = [str(p) for p in plots] + ([str(out_dir / GENERATIONS_FILE)] if generated else [])
    return {
        "metrics": metrics,
        "baseline": baseline,
        "table": table + (f"\n\n{examples}" if examples else ""),
        "test_windows": int(test.n_windows),
        "test_tokens": int(held.sum()),
        "files": files,
    }


def evaluate_model(
    manifest_uri: str,
    train_result: Trained,
    config: PipelineConfig,
    out_dir: Path,
    sample: tuple[str, int] | None = None,
) -> dict:
    """The best checkpoint on the test split: per target its metrics, a trivial baseline's (the training
    split's majority class or mean) and a plot (a class target also its per-class table, per_class.csv),
    named `metric` for one target and `target/metric` for several (files `target_...`); a model without a
    target: its own loss (and metrics) on the test split.

    One pass over the test split, a batch at a time: each batch's outputs are counted into the metrics
    and written to test_predictions.parquet, then dropped, so the memory it needs does not grow with the
    test split (a test split's class probabilities are windows x classes floats). Its key columns take their types
    in a raw file's schema (`sample`: one of the data's files, its URI and size), so the predictions join back to the
    raw rows."""
    from shardline.trainer.data import open_split
    from shardline.trainer.inference import load_model, predict_batches, window_keys_of
    from shardline.trainer.models import model_spec_for

    manifest = Manifest.model_validate_json(storage.read_text(manifest_uri))
    spec = manifest.encoding
    # the model the config describes, with the checkpoint's weights: never the code a checkpoint names
    model = load_model(train_result.best_checkpoint, model_spec_for(config.model, data_spec(spec)))
    test = open_split(manifest, manifest_uri, "test")
    out_dir.mkdir(parents=True, exist_ok=True)
    # epochs counted from 1, as the logs and MLflow's epoch/* steps count them; the selected one marked
    history = [{**h, "epoch": h["epoch"] + 1} for h in train_result.history]
    plots = [
        R.plot_learning_curves(
            history, out_dir / "learning_curves.png", train_result.best_epoch, train_result.select_by
        )
    ]
    if spec.text is not None:
        return evaluate_text(manifest, manifest_uri, model, test, plots, out_dir, config)
    scores = [_scores(t, train_statistic(manifest, i, t)) for i, t in enumerate(spec.targets)]
    # the sequence key, or where the file is the sequence the file's name (each prediction says which file it is of)
    seq = spec.sequence_key if spec.sequence_key and spec.sequence_key != FILE_SEQUENCE else file_key(spec)
    seq_keys = RowKeys(manifest, manifest_uri, "test", side="keys") if seq else None
    ranking = RankingEvaluation(manifest, manifest_uri, config.evaluation.k) if spec.group_key else None
    every = spec.target_positions == "all" and bool(spec.targets)  # each position keyed by its own row

    raw = raw_types(sample, [seq, spec.order_by])

    def key_columns(where: dict) -> dict:
        """The windows' key columns: the sequence key (when the data has one), then the order, in the raw types."""
        order = spec.order_by or "row"
        columns = {order: as_raw(pl.Series(order, where["order"]), raw.get(spec.order_by))}
        if seq_keys is None:
            return columns
        keys = seq_keys(where["shard"], where["segment"])["sequence"] if len(where["shard"]) else []
        return {seq: as_raw(pl.Series(seq, keys, pl.String), raw.get(seq)), **columns}

    with predictions_file(out_dir / "test_predictions.parquet") as write:
        for first, batch, outputs in predict_batches(model, test):
            for t, s, y, out in zip(spec.targets, scores, batch.targets, outputs.values()):
                _count(t, s, y.numpy(), out)
            where = window_keys_of(test, np.arange(first, first + len(batch)), spec.window if every else 1)
            frame = prediction_frame(spec, key_columns(where), outputs, per_position=every)
            frame = frame.with_columns(pl.Series(k, v) for k, v in decode_truth(spec, batch.targets).items())
            if ranking is not None:  # the group and item (unless a key already), the relevance and both scores
                extra = ranking.update(where, next(iter(outputs.values())))
                frame = frame.with_columns(v.alias(k) for k, v in extra.items() if k not in frame.columns)
            write(frame)
        if not test.n_windows:  # the columns, without rows
            empty = {name: y[:0] for name, y in example_outputs(spec).items()}
            frame = prediction_frame(spec, key_columns(window_keys_of(test, np.zeros(0, np.int64))), empty)
            truth = decode_truth(spec, [np.zeros(0, np.int64) for _ in spec.targets])
            write(frame.with_columns(pl.Series(k, v) for k, v in truth.items()))
    metrics: dict[str, float] = {}
    baseline: dict[str, float] = {}
    directions: dict[str, str] = {}
    several = len(spec.targets) > 1
    facts: dict = {}
    for i, (t, s) in enumerate(zip(spec.targets, scores)):
        name = f"{t.column}/" if several else ""
        m, b, files, d = _target_scores(t, s, out_dir, f"{t.column}_" if several else "")
        if i == 0 and ranking is not None:  # the relevance target's ranking metrics, after its own
            ranked, ranked_baseline, facts = ranking.scores()
            m, b, d = {**m, **ranked}, {**b, **ranked_baseline}, {**d, **ranking_metrics_of(config.evaluation.k)}
        metrics.update({name + k: v for k, v in m.items()})
        baseline.update({name + k: v for k, v in b.items()})
        directions.update({name + k: v for k, v in d.items()})
        plots.extend(files)
    if not spec.targets:
        metrics = _own_loss_scores(model, test)
        directions = {"loss": "minimize", config.mlflow.promotion_metric: config.mlflow.promotion_direction}
    return {
        "metrics": metrics,
        "baseline": baseline,
        "table": R.format_metrics_table(metrics, baseline, directions),
        "test_windows": int(test.n_windows),
        "files": [str(p) for p in plots] + [str(out_dir / "test_predictions.parquet")],
        **({"ranking": facts} if facts else {}),
    }


def per_class_artifacts(files: list, folder: str) -> None:
    """A Prefect table artifact of each per-class table's first rows (the classes with the most test samples),
    rounded for reading; its description says where the whole table is (`folder`, and the MLflow run)."""
    from prefect.artifacts import create_table_artifact

    for f in files:
        name = Path(f).name
        if not name.endswith(PER_CLASS_FILE):
            continue
        target = name.removesuffix(PER_CLASS_FILE).removesuffix("_")
        table = pl.read_csv(f, schema_overrides={"class": pl.String})
        shown = table.head(PER_CLASS_SHOWN)
        rows = [
            {k: (R.format_number(v) if isinstance(v, float) or v is None else v) for k, v in row.items()}
            for row in shown.iter_rows(named=True)
        ]
        create_table_artifact(
            key="per-class" + (f"-{re.sub(r'[^a-z0-9]+', '-', target.lower()).strip('-')}" if target else ""),
            table=rows,
            description=redact_text(
                ("`" + target + "`: " if target else "")
                + (
                    f"every class ({table.height}), most test samples first"
                    if shown.height == table.height
                    else f"the {shown.height} classes with the most test samples, of {table.height}"
                )
                + f"; the whole table is `{storage.join(folder, name)}`, and `evaluation/{name}` in the MLflow run"
            ),
        )


def raw_types(sample: tuple[str, int] | None, columns: list[str | None]) -> dict[str, pl.DataType]:
    """The types of `columns` in the schema of the raw file `sample` (its URI and size), those it holds, from a
    ranged read of its footer (the ingest's: an object store's file is not fetched whole); {} without one."""
    from shardline.tasks.ingest import footers

    if sample is None:
        return {}
    meta = next(footers([tuple(sample)]))
    if isinstance(meta, BaseException):  # a file gone or damaged since the encode: the keys keep the encoding's types
        return {}
    schema = pl.from_arrow(meta.schema.to_arrow_schema().empty_table()).schema
    return {c: schema[c] for c in columns if c and c in schema}


def as_raw(values: pl.Series, dtype: pl.DataType | None) -> pl.Series:
    """Key values as the encoding keeps them (an order as int64 instants, a sequence key as text) in their raw type
    `dtype`: dates and date-times (time zone included) and integers; any other type (text an order was parsed
    from) as they are."""
    if dtype is None or dtype == values.dtype:
        return values
    if dtype.is_temporal() or dtype.is_integer():
        return values.cast(pl.Int64 if values.dtype == pl.String else values.dtype).cast(dtype)
    return values


@task(name="evaluate")
@redacted_errors
def evaluate(
    manifest_uri: str, train_result: TrainResult, config: PipelineConfig, sample: tuple[str, int] | None = None
) -> EvalResult:
    """Score the best checkpoint on the test split against the trivial baseline; write plots, tables and predictions
    (keyed in the raw types of the raw file `sample`: its URI and size)."""
    log = get_run_logger()
    folder = storage.join(train_result.run_dir, "eval")
    remote = storage.is_remote(train_result.run_dir)
    # a remote run folder: written aside, then kept beside the checkpoints in the storage root (the result points there)
    with tempfile.TemporaryDirectory(prefix="shardline-eval-") as tmp:
        out_dir = Path(tmp if remote else storage.local_path(folder))
        result = evaluate_model(manifest_uri, train_result, config, out_dir, sample)
        per_class_artifacts(result["files"], folder)
        for i, f in enumerate(result["files"] if remote else []):
            result["files"][i] = storage.join(folder, Path(f).name)
            storage.write_bytes(result["files"][i], Path(f).read_bytes())
    if "ranking" in result:
        r = result["ranking"]
        log.info(
            "evaluate: ranked %d test groups by %s (%d with a relevant row, which the ranking metrics average "
            "over); the ranking metrics' baseline is the %s",
            r["groups"],
            config.data.group_key,
            r["groups_with_relevant"],
            r["baseline"] + (f" of {config.data.item_key}" if r["baseline"] == "popularity" else ""),
        )
    log.info("evaluate: %d test windows\n%s", result["test_windows"], result["table"])
    if weak := no_better_than_baseline(config, result["metrics"], result["baseline"]):
        log.warning("evaluate: %s", weak)
    return EvalResult(**result)


def no_better_than_baseline(config: PipelineConfig, metrics: dict, baseline: dict) -> str:
    """Words for a model that does not beat the baseline on the promotion metric ('' when it does, or has none)."""
    name, direction = config.mlflow.promotion_metric, config.mlflow.promotion_direction
    model, base = metrics.get(name), baseline.get(name)
    if model is None or base is None or (model > base if direction == "maximize" else model < base):
        return ""
    return (
        f"the model is no better than its baseline on {name} ({model:.4g} against {base:.4g}): it learned nothing the "
        "test split rewards. Check that the features bear on the target, the window (data.window) and the "
        "training's length (training.epochs, training.lr)"
    )


def evaluation_settings(config: PipelineConfig) -> dict:
    """The `evaluation` settings that apply to this data: the ranking metrics' cutoffs (ranking data), how many
    test sequences are generated and how long (a generation target). The others change no score."""
    e, data = config.evaluation, config.data
    settings = {"k": e.k} if data.group_key else {}
    if any(t.task == "generation" for t in data.target_list):
        settings |= {"max_generations": e.max_generations, "max_new_tokens": e.max_new_tokens}
    return settings


# What decides the scores: the evaluated weights (the best checkpoint's checksum), the data (the
# manifest's checksum) and the targets; the plots and tables it wrote must still be there.
EVALUATE_CACHE = CacheRule(
    "evaluate",
    key=lambda inputs: (
        inputs["train_result"].best_sha256,
        storage.sha256_uri(inputs["manifest_uri"]),
        [t.model_dump() for t in inputs["config"].data.target_list],
        inputs["config"].data.target_positions,
        evaluation_settings(inputs["config"]),
    ),
    code=(__name__,),
    # what it wrote is still in the storage root (a listing: any machine that shares the root sees it)
    still_valid=lambda result, inputs: all(storage.exists(f) for f in result.files),
)
