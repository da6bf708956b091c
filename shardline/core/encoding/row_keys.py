"""Ranking data's rows (`data.group_key`): each row's group, item and relevance grade, and what the
training split says about them.

A ranking data set ranks the rows of each group (a query, a user, a session) by the model's score for
its first target, the relevance. Evaluation needs, for every test row, its group and item (which the
shards do not hold: they are not features) and its true grade, so the encode keeps them, from the same
single read of the raw rows, in a *rows file* beside each shard (`<split>.rows.parquet`: columns
`group`, `item` when `data.item_key` is set, and `relevance`, one row per shard row, in the shard's
order). The group and item keep the raw column's type, so predictions carry them as the input had them.

Relevance is a grade: 0 is not relevant, 1..G are (binary clicks are 0/1, a boolean is false/true).
The target column's values must read as one: integers, booleans, whole floats or integer text, none
negative and none above `shardline.core.metrics.ranking.MAX_GRADE`; anything else is refused while the group is
encoded, naming the file and the value, before any training.

The training split's statistics (in each file group's record, merged into the manifest): its rows, the
rows of its largest group (a group key with one row per group ranks nothing: refused before training),
and the relevant rows (grade > 0) per item, the popularity baseline's scores.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import polars as pl

from shardline.core.config import DataConfig
from shardline.core.encoding.columns import DataError
from shardline.core.encoding.fit import merged_counts
from shardline.core.manifest import TargetSpec
from shardline.core.metrics.ranking import MAX_GRADE

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
    return dict(sorted(merged_counts(p["items"] for p in parts if p).items()))
