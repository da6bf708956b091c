"""Ranking data's rows (`data.group_key`): each row's group, item and relevance grade, and what the
training split says about them.

A ranking data set ranks the rows of each group (a query, a user, a session) by the model's score for
its first target, the relevance. Evaluation needs, for every test row, its group and item (which the
shards do not hold: they are not features) and its true grade, so the encode keeps them, from the same
single read of the raw rows, in a *rows file* beside each shard (`<split>.rows.parquet`: columns
`group`, `item` when `data.item_key` is set, and `relevance`, one row per shard row, in the shard's
order). The group and item keep the raw column's type, so predictions carry them as the input had them.
`RowKeys` reads them back for windows' target rows, and `SplitRanking` ranks a split's groups by a model's
outputs a batch at a time: evaluation on the test split, and the training loop on the validation split
each epoch (`val_ndcg_at_10`), with the same code.

Relevance is a grade: 0 is not relevant, 1..G are (binary clicks are 0/1, a boolean is false/true).
The target column's values must read as one: integers, booleans, whole floats or integer text, none
negative and none above `shardline.core.ranking.MAX_GRADE`; anything else is refused while the group is
encoded, naming the file and the value, before any training.

The training split's statistics (in each file group's record, merged into the manifest): its rows, the
rows of its largest group (a group key with one row per group ranks nothing: refused before training),
and the relevant rows (grade > 0) per item, the popularity baseline's scores.
"""

from __future__ import annotations

import io
from collections import Counter
from collections.abc import Iterable
from typing import Any

import numpy as np
import polars as pl

from shardline.core import storage
from shardline.core.config import DataConfig
from shardline.core.encoding.columns import DataError
from shardline.core.manifest import Manifest, TargetSpec
from shardline.core.ranking import MAX_GRADE, RankingScores

GROUP, ITEM, RELEVANCE = "group", "item", "relevance"  # the rows file's columns

RULE = (
    "ranking (data.group_key) ranks by a relevance grade: 0/1 (a click, false/true) or a whole number 0..G "
    "(0 = not relevant)"
)


def grades(values: pl.Series, where: str) -> pl.Series:
    """A relevance column's grades as Int64 (0..MAX_GRADE), or a DataError naming `where`, the column and
    the first value that is not a grade."""
    column = values.name
    if isinstance(values.dtype, pl.Categorical | pl.Enum):  # dictionary-encoded text
        values = values.cast(pl.Utf8)
    dtype = values.dtype
    if dtype == pl.Boolean or dtype.is_integer():
        graded = values.cast(pl.Int64)
    elif dtype.is_float():
        whole = values.is_finite() & (values == values.round())
        bad = values.filter(~whole.fill_null(True))
        if len(bad):
            raise DataError(f"{where}: the target column '{column}' holds {bad[0]!r}, not a whole grade; {RULE}")
        graded = values.cast(pl.Int64)
    elif dtype == pl.Utf8:
        graded = values.str.strip_chars().cast(pl.Int64, strict=False)
        bad = values.filter(graded.is_null() & values.is_not_null())
        if len(bad):
            raise DataError(f"{where}: the target column '{column}' holds {bad[0]!r}, which is not a grade; {RULE}")
    else:
        raise DataError(f"{where}: the target column '{column}' is of type {dtype}, not grades; {RULE}")
    low, high = graded.min(), graded.max()
    if low is not None and low < 0:
        raise DataError(f"{where}: the target column '{column}' holds the negative grade {low}; {RULE}")
    if high is not None and high > MAX_GRADE:
        raise DataError(
            f"{where}: the target column '{column}' holds the grade {high}, above the largest usable, {MAX_GRADE}; "
            f"{RULE}"
        )
    return graded


def class_grades(target: TargetSpec) -> np.ndarray:
    """The grade of each class id of a class target (id 0, a class never seen in training: 0), float64:
    a row's score is its expected grade, the class probabilities times these."""
    texts = list(target.classes or [])
    if target.dtype == "Boolean":
        values = [1 if c == "true" else 0 for c in texts]
    else:
        try:
            values = [int(c) for c in texts]
        except ValueError:
            raise ValueError(f"the target '{target.column}' has classes {texts[:5]}, not grades; {RULE}") from None
    return np.array([0, *values], dtype=np.float64)


def rows_table(frame: pl.DataFrame, graded: pl.Series, data: DataConfig) -> pl.DataFrame:
    """A rows file's table for `frame`'s rows (a split of a file group) and their grades."""
    columns = {GROUP: frame[data.group_key]}
    if data.item_key:
        columns[ITEM] = frame[data.item_key]
    columns[RELEVANCE] = graded.cast(pl.UInt16)
    return pl.DataFrame(columns)


def rows_parquet(table: pl.DataFrame) -> memoryview:
    """A rows file's bytes (parquet, zstd)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sink = pa.BufferOutputStream()
    pq.write_table(table.to_arrow(), sink, compression="zstd")
    out = sink.getvalue()
    return memoryview(out)[: out.size]


def training_statistics(table: pl.DataFrame | None, data: DataConfig) -> dict[str, Any]:
    """What a file group's training rows (its training split's rows table) say for ranking: `rows`, `largest`
    (the rows of its largest group) and, with an item key, `items` (relevant rows per item, as text)."""
    if table is None or table.height == 0:
        return {"rows": 0, "largest": 0, "items": {}}
    largest = int(table[GROUP].value_counts(name="n")["n"].max())
    items: dict[str, int] = {}
    if data.item_key:
        counted = (
            table.select(pl.col(ITEM).cast(pl.Utf8), (pl.col(RELEVANCE) > 0).cast(pl.Int64).alias("n"))
            .group_by(ITEM)
            .agg(pl.col("n").sum())
            .sort(ITEM)
        )
        items = dict(zip(counted[ITEM].to_list(), counted["n"].to_list()))
    return {"rows": table.height, "largest": largest, "items": items}


def item_counts(parts: list[dict[str, Any] | None]) -> dict[str, int]:
    """The training split's relevant rows per item, merged over file groups' statistics."""
    counts: Counter = Counter()
    for p in parts:
        if p:
            counts.update(p["items"])
    return dict(sorted(counts.items()))


class RowKeys:
    """The group, item and relevance grade of windows' target rows in `split` (a split, or several: k-fold),
    from the shards' rows files, each read when first needed and only the last one kept: evaluation and
    validation ask for windows in order, so shard by shard."""

    def __init__(self, manifest: Manifest, manifest_uri: str, split: str | list[str]):
        self.folder = manifest_uri.rsplit("/", 1)[0]
        self.shards = manifest.shards_of(split)
        self._held: tuple[int, pl.DataFrame] | None = None

    def _of_shard(self, s: int) -> pl.DataFrame:
        if self._held is None or self._held[0] != s:
            info = self.shards[s]
            if info.rows_path is None or info.rows_sha256 is None:
                raise ValueError(
                    f"shard {info.path} has no rows file (each row's group, item and relevance): it was encoded "
                    "without data.group_key; encode again (`shardline run CONFIG --force encode`)"
                )
            data = storage.read_verified(storage.resolve(self.folder, info.rows_path), info.rows_sha256)
            self._held = (s, pl.read_parquet(io.BytesIO(data)))
        return self._held[1]

    def __call__(self, shard: np.ndarray, row: np.ndarray) -> pl.DataFrame:
        """The rows files' rows of each (shard, row) pair, in the order given."""
        by_shard = np.argsort(shard, kind="stable")
        shard, row = shard[by_shard], row[by_shard]
        parts = [self._of_shard(int(s))[row[shard == s]] for s in np.unique(shard)]
        rows = pl.concat(parts) if len(parts) != 1 else parts[0]
        return rows[np.argsort(by_shard, kind="stable")]


class SplitRanking:
    """A split's groups ranked by a model's score for the relevance (the first target), a batch at a time
    (`RankingScores`, ties averaged: a tie's value never depends on where its rows are stored).

    The model's score of a row is its expected grade for a class target (the class probabilities times each
    class's grade: for 0/1 clicks, the probability of the click) and its predicted value for a regression
    target. `update` takes each batch's target rows (`SplitData.target_rows_of`) and the first target's
    outputs as evaluation has them (class probabilities, or standardised values); `metrics` gives
    `ranking_metrics`' keys. `begin` starts another pass (the training loop's next epoch) and keeps the
    rows file in hand. Memory: what `RankingScores` keeps, 8 bytes of group code a row, never the group keys."""

    def __init__(self, manifest: Manifest, manifest_uri: str, split: str | list[str], ks: Iterable[int]):
        spec = manifest.encoding
        if not spec.group_key or not spec.targets:
            raise ValueError("SplitRanking ranks ranking data: the manifest's encoding has no data.group_key")
        self.spec, self.target = spec, spec.targets[0]
        self.ks = list(ks)
        self.grades = class_grades(self.target) if self.target.task == "classification" else None
        self.rows = RowKeys(manifest, manifest_uri, split)
        self.begin()

    @classmethod
    def of_validation(
        cls, manifest: Manifest, manifest_uri: str, split: str | list[str], ks: Iterable[int]
    ) -> SplitRanking | None:
        """What the training loop ranks each epoch on validation split `split` (`training_splits`), at
        `evaluation.k`'s cutoffs `ks`: None for data without `data.group_key`."""
        return cls(manifest, manifest_uri, split, ks) if manifest.encoding.group_key else None

    def begin(self) -> None:
        """Forget the rows ranked so far."""
        self._codes: dict = {}  # group key -> a number: 8 bytes a row kept, not a Python string
        self.model = RankingScores(self.ks, ties="average")
        self.relevant = 0  # rows with a grade > 0: none, and no ranking metric is defined

    def update(
        self, shard: np.ndarray, row: np.ndarray, output: np.ndarray
    ) -> tuple[pl.DataFrame, np.ndarray, np.ndarray]:
        """One batch: its windows' target rows and the first target's outputs; returns the batch's rows-file
        rows, its scores and its group codes."""
        rows = self.rows(shard, row)
        if self.grades is not None:
            score = output.reshape(-1, output.shape[-1]).astype(np.float64) @ self.grades
        else:
            score = output.reshape(-1).astype(np.float64) * self.target.std + self.target.mean
        codes = self._group_codes(rows[GROUP])
        relevance = rows[RELEVANCE].to_numpy()
        self.model.update(codes, score, relevance)
        self.relevant += int(np.count_nonzero(relevance))
        return rows, score, codes

    def _group_codes(self, groups: pl.Series) -> np.ndarray:
        """Each row's group as a number, the same in every batch (a group's rows may span batches)."""
        distinct = groups.unique().to_list()
        for g in distinct:
            self._codes.setdefault(g, len(self._codes))
        ids = pl.Series([self._codes[g] for g in distinct], dtype=pl.Int64)
        return groups.replace_strict(distinct, ids, return_dtype=pl.Int64).to_numpy()

    def metrics(self) -> dict[str, float]:
        """The ranking metrics of every row given since `begin` (`ranking_metrics`' keys, counts included)."""
        return self.model.metrics()
