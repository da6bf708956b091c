"""Ranking data's splits ranked by a model, a batch at a time: evaluation ranks the test split with it, and the
training loop the validation split each epoch (`val_ndcg_at_10`), so both report the same numbers the same way.

Kept apart from `row_keys.py` on purpose: that module is part of the encoder's code version (a group's
address, `shardline/tasks/encode.py: encoder_code`), so an edit here must not encode any data again.
"""

from __future__ import annotations

import io
from collections.abc import Iterable

import numpy as np
import polars as pl

from shardline.core import storage
from shardline.core.encoding.row_keys import GROUP, RELEVANCE, class_grades
from shardline.core.manifest import Manifest
from shardline.core.metrics.ranking import RankingScores


class RowKeys:
    """Rows of the files the encode writes beside each shard of `split` (a split, or several: k-fold), by
    (shard, row): `side` "rows", each row's group, item and relevance grade (ranking data), or "keys", each
    sequence segment's key. Each file is checked against the manifest's sha256 when first needed, and only
    the last one kept: evaluation and validation ask for windows in order, so shard by shard."""

    def __init__(self, manifest: Manifest, manifest_uri: str, split: str | list[str], side: str = "rows"):
        self.folder = manifest_uri.rsplit("/", 1)[0]
        self.shards = manifest.shards_of(split)
        self.side = side
        self._held: tuple[int, pl.DataFrame] | None = None

    def _of_shard(self, s: int) -> pl.DataFrame:
        if self._held is None or self._held[0] != s:
            info = self.shards[s]
            path, digest = getattr(info, f"{self.side}_path"), getattr(info, f"{self.side}_sha256")
            if path is None or digest is None:  # a rows file: only ranking data has one
                raise ValueError(
                    f"shard {info.path} has no rows file (each row's group, item and relevance): it was encoded "
                    "without data.group_key; encode again (`shardline run CONFIG --force encode`)"
                )
            data = storage.read_verified(storage.resolve(self.folder, path), digest)
            self._held = (s, pl.read_parquet(io.BytesIO(data)))
        return self._held[1]

    def __call__(self, shard: np.ndarray, row: np.ndarray) -> pl.DataFrame:
        """The files' rows of each (shard, row) pair, in the order given (at least one)."""
        by_shard = np.argsort(shard, kind="stable")
        shard, row = shard[by_shard], row[by_shard]
        parts = [self._of_shard(int(s))[row[shard == s]] for s in np.unique(shard)]
        return pl.concat(parts)[np.argsort(by_shard, kind="stable")]


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
