"""`data:`: the raw columns, the target(s), the tokenizer, the splits (and k-fold's folds)."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    Field,
    field_serializer,
    field_validator,
    model_validator,
)

from shardline.core.config.base import FILE_SEQUENCE, SPLITS, Strict


def fold_split(i: int) -> str:
    """The split name of k-fold fold `i` (`data.split.method: kfold`): `fold0`, `fold1`, ..."""
    return f"fold{i}"


def training_splits(split: SplitConfig, fold: int | None) -> tuple[list[str], list[str]]:
    """(the splits a run trains on, the splits it validates on). k-fold data: fold `fold` validates and the
    other folds train; `fold` None trains on every fold and validates on the last one (which it also trains
    on: the final model's validation is in-sample, the test split measures it). Else train and validation."""
    if split.method != "kfold":
        return ["train"], ["validation"]
    folds = list(split.fit_splits())
    if fold is None:
        return folds, [folds[-1]]
    return [f for f in folds if f != fold_split(fold)], [fold_split(fold)]


ELEMENT = re.compile(r"^(.+)\[(\d+)\]$")  # `vec[3]`: element 3 of the list or array column `vec`
ELEMENTS = re.compile(r"^(.+)\[(\d+):(\d+)\]$")  # `vec[0:64]`: its elements 0 to 63, each a feature


def element_of(name: str) -> tuple[str, int] | None:
    """(the list or array column, the index) a continuous feature `vec[3]` names; None for a column's own name."""
    m = ELEMENT.match(name)
    return (m.group(1), int(m.group(2))) if m else None


def read_names(names: list[str]) -> list[str]:
    """The columns a file is read for `names`: an element's list column in its place, once."""
    return list(dict.fromkeys(e[0] if (e := element_of(n)) else n for n in names))


class Features(Strict):
    continuous: list[str] = Field(
        default_factory=list,
        description="numeric columns, standardised; `vec[0:64]` names elements 0-63 of a list or array column "
        "(an embedding, a sensor's axes), each a feature of its own",
    )
    boolean: list[str] = Field(default_factory=list, description="true/false columns")
    categorical: list[str] = Field(default_factory=list, description="columns with a vocabulary")
    text: list[str] = Field(
        default_factory=list,
        description="string columns tokenized into one token stream per sequence (data.tokenizer); not mixed with "
        "the other roles",
    )

    @field_validator("continuous", mode="before")
    @classmethod
    def _elements(cls, raw: Any) -> Any:
        if not isinstance(raw, list):
            return raw
        out = []
        for name in raw:
            m = ELEMENTS.match(name) if isinstance(name, str) else None
            if m is None:
                out.append(name)
                continue
            first, end = int(m.group(2)), int(m.group(3))
            if end <= first:
                raise ValueError(
                    f"'{name}': elements {first} up to (not including) {end} are none; write {m.group(1)}[0:N]"
                )
            out += [f"{m.group(1)}[{i}]" for i in range(first, end)]
        return out

    @field_serializer("continuous")
    def _compact(self, names: list[str]) -> list[str]:
        """Runs of a list column's elements written back as they are named (`vec[0:64]`): the config as the run's
        params, a flow run's parameters and the cache keys' dumps (the same names, read back)."""
        out: list[str] = []
        run: list[tuple[str, int]] = []
        for name in [*names, ""]:
            e = element_of(name)
            if run and (e is None or e[0] != run[0][0] or e[1] != run[-1][1] + 1):
                base, first, last = run[0][0], run[0][1], run[-1][1]
                out.append(f"{base}[{first}:{last + 1}]" if last > first else f"{base}[{first}]")
                run = []
            if e is not None:
                run.append(e)
            elif name:
                out.append(name)
        return out

    def all(self) -> list[str]:
        return [*self.continuous, *self.boolean, *self.categorical, *self.text]


class TokenizerConfig(Strict):
    """How text columns become token ids: a byte-level BPE trained on the training split (`kind: bpe`,
    `vocab_size`), or the user's own `tokenizer.json` (`file`, relative to the config file's folder)."""

    kind: Literal["bpe"] | None = Field(None, description="bpe: a byte-level BPE trained on the training split")
    vocab_size: int | None = Field(None, ge=259, le=1 << 24, description="bpe: ids in all, <pad> <sep> <eos> included")
    file: str | None = Field(
        None,
        description="a tokenizers-library tokenizer.json defining <pad>=0, <sep>=1, <eos>=2; nothing is downloaded",
    )

    sha256: str | None = Field(
        None,
        description="the file's sha256, filled in when the config is read where the file is (so a machine without "
        "it, a training worker, still knows which tokenizer the config means); leave it unset",
    )

    @model_validator(mode="before")
    @classmethod
    def _file_hash(cls, raw: Any) -> Any:
        if isinstance(raw, dict) and raw.get("vocab_size") is not None and raw.get("kind") is raw.get("file") is None:
            raw = {**raw, "kind": "bpe"}  # a vocabulary size is a BPE's (`--set data.tokenizer.vocab_size=500`)
        if isinstance(raw, dict) and isinstance(raw.get("file"), str) and not raw.get("sha256"):
            path = Path(raw["file"])
            if path.is_file():  # a missing file is said, naming it, by the encode (before any work)
                raw = {**raw, "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
        return raw

    @model_validator(mode="after")
    def _check(self) -> TokenizerConfig:
        if (self.kind is None) == (self.file is None):
            raise ValueError(
                "data.tokenizer takes either {kind: bpe, vocab_size: N} (trained on the training split) or "
                "{file: path/to/tokenizer.json} (yours), exactly one of them"
            )
        if self.kind == "bpe" and self.vocab_size is None:
            raise ValueError("data.tokenizer.vocab_size is required with kind: bpe (e.g. 8192)")
        if self.file is not None and self.vocab_size is not None:
            raise ValueError("data.tokenizer.vocab_size is a bpe setting: a tokenizer file has its own vocabulary")
        return self


class Target(Strict):
    column: str
    task: Literal["classification", "regression", "generation"] = Field(
        description="generation: a text column the model writes after the data.features.text source (the loss on "
        "its tokens only)"
    )


TEXT_TARGET = "next_token"  # the target of text pre-training (no data.target): each position's next token


class SplitConfig(Strict):
    method: Literal["hash", "range", "kfold"] = Field(
        "hash",
        description="hash: fractions of sequences; range: a column's value bounds; kfold: `test` of the sequences "
        "held out by hash, the rest dealt by hash into `folds` folds (splits fold0..fold{K-1}, encoded once)",
    )
    seed: int = 0
    folds: int | None = Field(None, description="kfold: the number of folds K (>= 2)")
    test: float | None = Field(None, description="kfold: the share of sequences held out as the test split, in (0, 1)")
    fractions: dict[str, float] = Field(
        default_factory=lambda: {"train": 0.8, "validation": 0.1, "test": 0.1},
        description="hash split: share of sequences per split",
    )
    column: str | None = Field(None, description="range split: the column whose value decides the split")
    ranges: dict[str, tuple[Any, Any]] = Field(
        default_factory=dict,
        description="range split: split -> [low, high], inclusive, null for open",
    )

    def names(self) -> tuple[str, ...]:
        """The splits the encode writes: train, validation, test; or (kfold) fold0..fold{K-1}, test."""
        if self.method == "kfold":
            return (*self.fit_splits(), "test")
        return SPLITS

    def fit_splits(self) -> tuple[str, ...]:
        """The splits the encoding is fitted on: train; or (kfold) every fold (all the non-test rows)."""
        if self.method == "kfold":
            return tuple(fold_split(i) for i in range(self.folds or 0))
        return ("train",)

    @model_validator(mode="after")
    def _check(self) -> SplitConfig:
        kfold_only = [k for k in ("folds", "test") if getattr(self, k) is not None]
        if self.method != "kfold" and kfold_only:
            raise ValueError(f"data.split.{kfold_only[0]} is a k-fold setting: set data.split.method: kfold too")
        if self.method == "kfold":
            if self.folds is None or self.folds < 2:
                raise ValueError(f"data.split.folds={self.folds} must be a whole number >= 2 with method: kfold")
            if self.test is None or not 0.0 < self.test < 1.0:
                raise ValueError(
                    f"data.split.test={self.test} must be a share of sequences between 0 and 1 (exclusive) with "
                    "method: kfold: the test split held out from every fold, e.g. test: 0.2"
                )
            if self.column or self.ranges:
                raise ValueError("data.split.column and data.split.ranges are range-split settings, not kfold ones")
        elif self.method == "hash":
            bad = set(self.fractions) - set(SPLITS)
            if bad:
                raise ValueError(f"data.split.fractions has unknown split(s) {sorted(bad)}; allowed: {list(SPLITS)}")
            for name in SPLITS:
                v = self.fractions.get(name, 0.0)
                if not 0.0 <= v <= 1.0:
                    raise ValueError(f"data.split.fractions.{name}={v} must be between 0 and 1")
            total = sum(self.fractions.values())
            if abs(total - 1.0) > 1e-6:
                raise ValueError(f"data.split.fractions must sum to 1, got {total:g} ({self.fractions})")
        else:
            if not self.column:
                raise ValueError("data.split.column is required when data.split.method is 'range'")
            bad = set(self.ranges) - set(SPLITS)
            if bad:
                raise ValueError(f"data.split.ranges has unknown split(s) {sorted(bad)}; allowed: {list(SPLITS)}")
            if "train" not in self.ranges:
                raise ValueError("data.split.ranges.train is required for a range split")
        return self


class DataConfig(Strict):
    source: str = Field(description="local path, glob, or fsspec URL such as s3://bucket/raw/*.parquet")
    on_bad_file: Literal["fail", "skip"] = "fail"
    on_bad_rows: Literal["error", "skip"] = Field(
        "error",
        description="text data: a row whose text column is null or empty is an error naming the file, column and "
        "count (error), or left out and counted in the encode's log (skip)",
    )
    tokenizer: TokenizerConfig | None = Field(None, description="text data: how data.features.text is tokenized")
    sequence_key: str | None = Field(
        None, description=f"column grouping rows into sequences, '{FILE_SEQUENCE}' for one sequence per file, or null"
    )
    order_by: str | None = Field(
        None,
        description="column ordering rows inside a sequence: an integer, a date/date-time (time-zone-aware ones "
        "too), or text holding ISO-8601 date-times (or in data.order_format)",
    )
    id_columns: list[str] = Field(
        default_factory=list,
        description="columns passed through to predictions as their key (a row id, a user id), never features",
    )
    order_format: str | None = Field(
        None,
        description="strftime format of a text order column (e.g. '%d/%m/%Y %H:%M'); default: ISO-8601, inferred",
    )
    group_key: str | None = Field(
        None,
        description="ranking data: the column whose rows are ranked together (a query, a user, a session) by the "
        "model's score for the first target, a relevance grade (0/1 clicks or 0..G); evaluation reports nDCG@k, "
        "MAP@k, recall@k and MRR over the test split's groups (docs/experiments.md, Ranking)",
    )
    item_key: str | None = Field(
        None,
        description="ranking data: the column naming each row's item, for the popularity baseline (items ranked by "
        "their relevant rows in the training split); unset: the baseline is a random order",
    )
    features: Features
    target: Target | None = Field(None, description="the one target (shorthand for data.targets: [target])")
    targets: list[Target] | None = Field(
        None,
        description="several targets, classification and regression mixed; none (or []) when the model defines "
        "its own loss (self-supervised)",
    )
    target_positions: Literal["last", "all"] = Field(
        "last",
        description="last: one prediction per window (its last row's, `horizon` rows on); all: one per row of the "
        "window (each row's target `horizon` rows after it)",
    )
    window: int = Field(1, ge=1, description="K: rows of history per prediction")
    horizon: int | None = Field(
        None,
        ge=0,
        description="rows after the window's last row whose target is predicted (default 1 with sequences, 0 without)",
    )
    split: SplitConfig = Field(default_factory=SplitConfig)
    continuous_dtype: Literal["float32", "float16"] = "float32"
    group_mb: float = Field(
        12,
        gt=0,
        description="raw MB read by one mapped encode task; each task writes one shard per split, so this sets the "
        "shard size (about 1-3x it times the split's fraction) and bounds the task's memory (about 17x it for "
        "zlib parquet of numbers: the decoded rows, then the shards' buffers); a larger file with a sequence or "
        "group key column is encoded in parts of about this size",
    )
    shard_compression: Literal["lz4", "zstd", "none"] = Field(
        "lz4",
        description="stored shards compressed: LZ4 frames (the default: about 2x faster to write and to unpack than "
        "zstd), zstd level 1 (about 20% smaller, for slow links to object storage), or none (a local store's shards "
        "are "
        "then memory-mapped in place); compressed shards are unpacked once into the local cache",
    )
    files_per_group: int | None = Field(
        None, ge=1, description="fixed number of raw files per encode task instead of group_mb"
    )
    encode_workers: int | None = Field(
        None,
        ge=1,
        description="file groups encoded at once (each holds about 17x group_mb of memory while it runs); default: the "
        "machine's CPU count. With a Dask or Ray task runner, set it to the cluster's worker count",
    )

    @property
    def target_list(self) -> list[Target]:
        """The targets, in order (`data.target` is the one-target shorthand); empty when there is none."""
        if self.targets is not None:
            return list(self.targets)
        return [self.target] if self.target is not None else []

    @model_validator(mode="before")
    @classmethod
    def _text_positions(cls, raw: Any) -> Any:
        """Text data predicts every position's next token: `target_positions: all` is implied."""
        if isinstance(raw, dict) and isinstance(raw.get("features"), dict) and raw["features"].get("text"):
            raw = {**raw}
            raw.setdefault("target_positions", "all")
        return raw

    @property
    def text_target(self) -> str | None:
        """Text data's one target: `next_token` (pre-training) or the generation target's column; None otherwise."""
        if not self.features.text:
            return None
        return self.target_list[0].column if self.target_list else TEXT_TARGET

    def _check_text(self) -> None:
        """Text data (`data.features.text`): its own roles, tokenizer, target and positions."""
        text = self.features.text
        generation = [t for t in self.target_list if t.task == "generation"]
        if not text:
            if generation or self.tokenizer is not None:
                raise ValueError(
                    ("data.target task: generation" if generation else "data.tokenizer")
                    + " is for text data: list the source text column(s) under data.features.text"
                )
            return
        others = [c for role in ("continuous", "boolean", "categorical") for c in getattr(self.features, role)]
        if others:
            raise ValueError(
                f"data.features.text cannot be mixed with other feature roles in this version: remove {others} "
                "(continuous/boolean/categorical) or the text columns"
            )
        if self.target_list and (len(self.target_list) > 1 or not generation):
            raise ValueError(
                "text data takes no target (pre-training: every position predicts its next token) or one target "
                "with task: generation (data.target: {column: summary, task: generation})"
            )
        if generation and generation[0].column in text:
            raise ValueError(f"data.target '{generation[0].column}' is also in data.features.text: name another column")
        if generation and self.sequence_key is not None:
            raise ValueError(
                "data.target task: generation pairs a row's source text with its target text: each row is its own "
                "sequence, so leave data.sequence_key unset"
            )
        if self.target_positions != "all":
            raise ValueError(
                "text data predicts the next token at every position: data.target_positions must be 'all' (implied)"
            )
        if self.horizon not in (None, 1):
            raise ValueError(
                f"data.horizon={self.horizon}: text data predicts the next token, horizon 1 (leave it unset)"
            )
        if self.group_key is not None or self.split.method == "range":
            raise ValueError("text data takes neither data.group_key nor a range split in this version")

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        self._check_text()
        if self.target is not None and self.targets is not None:
            raise ValueError("set data.target (one target) or data.targets (a list), not both")
        names = [t.column for t in self.target_list]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"data.targets lists {twice} more than once; each target column once")
        if not self.features.all():
            raise ValueError(
                "data.features lists no column; declare at least one continuous, boolean or categorical column"
            )
        seen: dict[str, str] = {}
        for role in ("continuous", "boolean", "categorical", "text"):
            for col in getattr(self.features, role):
                if col in seen:
                    raise ValueError(f"column '{col}' is declared twice in data.features ({seen[col]} and {role})")
                seen[col] = role
        if self.sequence_key is None and self.window > 1 and not self.features.text:
            raise ValueError(
                f"data.window={self.window} needs data.sequence_key (a column, or '{FILE_SEQUENCE}'); "
                "without sequences each row stands alone, so only window: 1 is allowed"
            )
        if self.sequence_key is not None and self.order_by is None and self.sequence_key != FILE_SEQUENCE:
            raise ValueError(
                "data.order_by is required with data.sequence_key: name the column that orders rows in a sequence"
            )
        if self.sequence_key is None and not self.features.text and (self.horizon or 0) > 0:
            raise ValueError(
                f"data.horizon={self.horizon} predicts the target {self.horizon} row(s) on in a sequence, and without "
                "data.sequence_key rows have no sequence (the next row may lie in another split): set "
                f"data.sequence_key (a column, or '{FILE_SEQUENCE}') and data.order_by, or leave data.horizon unset"
            )
        inputs = set(self.features.all())
        seen_now = [t.column for t in self.target_list if t.column in inputs and t.task != "generation"]
        if seen_now and self.effective_horizon == 0:
            raise ValueError(
                f"data.target {seen_now} is also in data.features, and data.horizon is 0: the model would read each "
                "answer in the row it is asked about; predict it rows ahead (data.horizon: 1, with data.sequence_key) "
                "or remove it from data.features"
            )
        self._check_ranking()
        if self.split.method == "kfold" and self.sequence_key is None and self.group_key is None:
            raise ValueError(
                "data.split.method: kfold deals whole sequences (or, in ranking data, whole groups) into folds: it "
                f"needs data.sequence_key (a column, or '{FILE_SEQUENCE}') or data.group_key"
            )
        need = {"train": "training needs a train split", "validation": "checkpoints are chosen on a validation split",
                "test": "evaluation needs a test split"}  # fmt: skip
        for split, why in need.items():
            if self.split.method == "hash" and self.split.fractions.get(split, 0) <= 0:
                raise ValueError(f"data.split.fractions.{split} must be > 0: {why}")
            if self.split.method == "range" and split not in self.split.ranges:
                raise ValueError(f"data.split.ranges.{split} is required: {why}")
        return self

    def _check_ranking(self) -> None:
        """Ranking data (`group_key`): a relevance target to rank by, one prediction per row."""
        if self.group_key is None:
            if self.item_key is not None:
                raise ValueError(
                    f"data.item_key='{self.item_key}' names the items of ranking data: set data.group_key too (the "
                    "column whose rows are ranked together: a query, a user, a session)"
                )
            return
        targets = self.target_list
        if not targets:
            raise ValueError(
                f"data.group_key='{self.group_key}' ranks rows by their relevance: set data.target (a 0/1 click or "
                "a grade 0..G, as classification or regression)"
            )
        if self.target_positions == "all":
            raise ValueError(
                "data.group_key ranks one prediction per row: data.target_positions must be 'last', not 'all'"
            )
        if self.horizon not in (None, 0):
            raise ValueError(
                f"data.horizon={self.horizon} with data.group_key: a ranked row is scored by its own relevance, as the "
                "last row of its window (a window of history with data.sequence_key); leave data.horizon unset (0 "
                "for ranking data)"
            )
        if self.group_key == self.item_key:
            raise ValueError(
                f"data.group_key and data.item_key are both '{self.group_key}': a group (a query, a user) ranks "
                "several items, so they are two columns"
            )
        for key in ("group_key", "item_key"):
            column = getattr(self, key)
            if column is not None and column in {t.column for t in targets}:
                raise ValueError(f"data.{key}='{column}' is a target column; name the column of the {key[:-4]}s")

    @property
    def effective_horizon(self) -> int:
        if self.horizon is not None:
            return self.horizon
        if self.group_key is not None:  # ranking: each row's own relevance, with or without a window of history
            return 0
        return 1 if self.sequence_key is not None or self.features.text else 0

    def raw_columns(self) -> list[str]:
        """Every column the raw files are read for (an element's list column in its place: `read_names`)."""
        f = self.features
        cols = list(dict.fromkeys([*read_names(f.continuous), *f.boolean, *f.categorical, *f.text]))
        for c in (
            *(t.column for t in self.target_list),
            self.order_by,
            self.sequence_key,
            self.split.column if self.split.method == "range" else None,
            self.group_key,
            self.item_key,
        ):
            if c and c != FILE_SEQUENCE and c not in cols:
                cols.append(c)
        return cols
