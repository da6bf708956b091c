"""The one config file: typed models, `extends:` chains, `--set` overrides, validation up front.

Everything a run does is decided by a `PipelineConfig`. It is parsed from YAML, checked before any
work starts (an error names the key, the bad value and what is allowed), and the *resolved* config
(after `extends` and `--set`) is what gets hashed, logged and stored.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, ClassVar, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializationInfo,
    SerializerFunctionWrapHandler,
    ValidationError,
    field_validator,
    model_serializer,
    model_validator,
)

FILE_SEQUENCE = "@file"  # sequence_key value meaning "each raw file is one sequence"
SPLITS = ("train", "validation", "test")


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


class ConfigError(ValueError):
    """A config the user must fix; the message names the key, the value and what is allowed."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class Features(_Strict):
    continuous: list[str] = Field(default_factory=list, description="numeric columns, standardised")
    boolean: list[str] = Field(default_factory=list, description="true/false columns")
    categorical: list[str] = Field(default_factory=list, description="columns with a vocabulary")
    text: list[str] = Field(
        default_factory=list,
        description="string columns tokenized into one token stream per sequence (data.tokenizer); not mixed with "
        "the other roles",
    )

    def all(self) -> list[str]:
        return [*self.continuous, *self.boolean, *self.categorical, *self.text]


class TokenizerConfig(_Strict):
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


class Target(_Strict):
    column: str
    task: Literal["classification", "regression", "generation"] = Field(
        description="generation: a text column the model writes after the data.features.text source (the loss on "
        "its tokens only)"
    )


TEXT_TARGET = "next_token"  # the target of text pre-training (no data.target): each position's next token


class SplitConfig(_Strict):
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


class DataConfig(_Strict):
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
        64,
        gt=0,
        description="raw MB read by one mapped encode task; each task writes one shard per split, so this sets the "
        "shard size (about 1-3x it times the split's fraction) and bounds the task's memory (about 10x it)",
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
        description="file groups encoded at once (each holds about 10x group_mb of memory while it runs); default: the "
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
        self._check_ranking()
        if self.split.method == "kfold" and self.sequence_key is None and self.group_key is None:
            raise ValueError(
                "data.split.method: kfold deals whole sequences (or, in ranking data, whole groups) into folds: it "
                f"needs data.sequence_key (a column, or '{FILE_SEQUENCE}') or data.group_key"
            )
        if self.split.method == "hash" and self.split.fractions.get("test", 0) <= 0:
            raise ValueError("data.split.fractions.test must be > 0: evaluation needs a test split")
        if self.split.method == "range" and "test" not in self.split.ranges:
            raise ValueError("data.split.ranges.test is required: evaluation needs a test split")
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
        return 1 if self.sequence_key is not None or self.features.text else 0

    def raw_columns(self) -> list[str]:
        """Every column the raw files must hold."""
        cols = list(self.features.all())
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


# the gpt family's settings under model.params (nanoGPT's names) -> the model.* key it overrides
GPT_PARAMS = {"d_model": "hidden", "n_layer": "layers", "n_head": "heads", "dropout": "dropout", "bias": None}


class ModelConfig(_Strict):
    entrypoint: str | None = Field(
        None,
        description="your own model: 'package.module:Name', a torch.nn.Module class or factory called as "
        "Name(spec, **model.params) (README: the model contract); unset: the built-in `family`",
    )
    params: dict[str, Any] = Field(
        default_factory=dict, description="keyword arguments of the entrypoint (or extra ones of a built-in family)"
    )
    code_dir: str | None = Field(
        None,
        description="the folder the entrypoint's module is imported from (default: the config file's folder; "
        "the working directory is searched too)",
    )
    family: Literal["mlp", "transformer", "gpt"] = Field(
        "mlp",
        description="mlp, transformer (windows of frames) or gpt (a decoder-only language model over one token column)",
    )
    hidden: int = Field(256, ge=1, description="MLP width / Transformer and GPT d_model")
    layers: int = Field(2, ge=1, description="MLP blocks / Transformer and GPT layers (n_layer)")
    heads: int = Field(4, ge=1, description="Transformer and GPT attention heads (n_head)")
    dropout: float = Field(0.1, ge=0.0, lt=1.0)
    embedding_dim: int | None = Field(
        None, ge=1, description="per-categorical embedding width (default: min(32, 1.6*vocab**0.56))"
    )

    @model_validator(mode="after")
    def _check(self) -> ModelConfig:
        if self.entrypoint is not None:
            module, sep, attr = self.entrypoint.partition(":")
            if not (sep and module and attr) or " " in self.entrypoint:
                raise ValueError(
                    f"model.entrypoint='{self.entrypoint}' is not 'package.module:Name' (the module, a colon, the "
                    "class or factory in it), e.g. 'models.world:WorldModel'"
                )
            return self
        if self.family == "transformer" and self.hidden % self.heads:
            raise ValueError(
                f"model.hidden={self.hidden} must be divisible by model.heads={self.heads} for a transformer"
            )
        if self.family == "gpt":
            self.gpt_params()  # checked here: an error names the key
        return self

    def gpt_params(self) -> dict:
        """The gpt family's keyword arguments: model.params under nanoGPT's names (d_model, n_layer, n_head,
        dropout, bias) where given (they win), else model.hidden, layers, heads, dropout; checked, each error
        naming its key."""
        given = dict(self.params)
        unknown = sorted(set(given) - set(GPT_PARAMS))
        if unknown:
            raise ValueError(f"model.params {unknown} are not gpt settings; allowed: {list(GPT_PARAMS)}")
        if self.embedding_dim is not None:
            raise ValueError("model.embedding_dim is not a gpt setting: its token embedding is d_model wide")
        out = {
            "d_model": given.get("d_model", self.hidden),
            "n_layer": given.get("n_layer", self.layers),
            "n_head": given.get("n_head", self.heads),
            "dropout": given.get("dropout", self.dropout),
            "bias": given.get("bias", False),
        }
        where = {k: f"model.params.{k}" if k in given else f"model.{GPT_PARAMS[k] or k}" for k in out}
        for key in ("d_model", "n_layer", "n_head"):
            if isinstance(out[key], bool) or not isinstance(out[key], int) or out[key] < 1:
                raise ValueError(f"{where[key]}={out[key]!r} must be a whole number >= 1")
        if (
            isinstance(out["dropout"], bool)
            or not isinstance(out["dropout"], int | float)
            or not 0 <= out["dropout"] < 1
        ):
            raise ValueError(f"{where['dropout']}={out['dropout']!r} must be a number in [0, 1)")
        if not isinstance(out["bias"], bool):
            raise ValueError(f"model.params.bias={out['bias']!r} must be true or false")
        if out["d_model"] % out["n_head"]:
            raise ValueError(
                f"{where['d_model']}={out['d_model']} must be divisible by {where['n_head']}={out['n_head']}: each "
                "attention head gets d_model / n_head of the width"
            )
        return out


class TrainingConfig(_Strict):
    # settings a run may change between a checkpoint and its resume: they do not change what is trained
    # (device and precision may change the arithmetic: a resume on other hardware is allowed, not bit-exact)
    RESUMABLE_CHANGES: ClassVar[tuple[str, ...]] = (
        "device",
        "precision",
        "num_workers",
        "compile",
        "cuda_graphs",
        "deterministic",
        "checkpoint_every_steps",
        "checkpoint_every_seconds",
        "keep_checkpoints",
        # budgets stop a run cleanly at a checkpoint; raising one resumes it in the same run folder
        "max_hours",
        "max_cost",
    )

    epochs: int = Field(3, ge=1)
    batch_size: int = Field(256, ge=1)
    lr: float = Field(1e-3, gt=0)
    schedule: Literal["cosine", "constant"] = "cosine"
    warmup_steps: int = Field(50, ge=0, description="linear warm-up, in optimizer steps")
    min_lr_ratio: float = Field(0.05, ge=0, le=1, description="cosine floor as a fraction of lr")
    weight_decay: float = Field(0.01, ge=0)
    grad_clip: float | None = Field(1.0, gt=0, description="max gradient norm; null disables clipping")
    grad_accum: int = Field(1, ge=1, description="micro-batches per optimizer step")
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    seed: int = 0
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"
    checkpoint_every_steps: int = Field(0, ge=0, description="0: only at epoch end")
    checkpoint_every_seconds: float = Field(
        0, ge=0, description="also checkpoint when this long has passed since the last one; 0: off"
    )
    keep_checkpoints: int = Field(2, ge=1, description="newest checkpoints kept, besides the best")
    max_restarts: int = Field(
        2,
        ge=0,
        description=(
            "retries of the training step after an infrastructure failure (I/O, network, CUDA); code errors "
            "are never retried"
        ),
    )
    init_from: str | None = Field(
        None,
        description="start from another model's weights, matched by name and shape: a registered model "
        "(models:/name@alias, models:/name/3) or a checkpoint in storage (a .pt file or a run's checkpoint folder)",
    )
    freeze: list[str] = Field(
        default_factory=list, description="parameter name prefixes not trained (e.g. a backbone: ['encoder.'])"
    )
    loss_weights: dict[str, float] = Field(
        default_factory=dict, description="target column -> weight of its loss in the sum (default 1 each)"
    )
    max_steps_per_epoch: int | None = Field(None, ge=1, description="cap optimizer steps per epoch (quick runs)")
    max_hours: float | None = Field(
        None,
        gt=0,
        description="stop training (a checkpoint first) once the run's attempts have trained this many hours in "
        "all, time redone after an interruption included; raise it and run again to resume; null: no limit",
    )
    max_cost: float | None = Field(
        None,
        gt=0,
        description="stop training (a checkpoint first) once the run's estimated spend reaches this many USD "
        "(GPU-hours x the price table's rate: compute.provider, compute.spot); raise it and run again to resume",
    )
    select_by: str | None = Field(
        None,
        description="the validation metric that picks the best checkpoint (the one evaluated and registered), as "
        "the epoch history names it: val_loss, val_accuracy, val_mae, val_<target>/accuracy, val_<target>/mae, or "
        "val_<name> of your model's own metrics(), and on ranking data (data.group_key) val_ndcg_at_10, "
        "val_map_at_5, val_mrr, ... (evaluation.k's ranking metrics on the validation split); default: the "
        "promotion metric's validation counterpart (accuracy -> val_accuracy, mae -> val_mae, ndcg@10 -> "
        "val_ndcg_at_10), else val_loss",
    )
    select_direction: Literal["maximize", "minimize"] | None = Field(
        None,
        description="whether a higher or a lower select_by is better; default: the metric's own (loss and mae "
        "lower, accuracy higher; mlflow.promotion_direction for the promotion metric); needed only for another "
        "metric of your model's own metrics()",
    )
    num_workers: int = Field(
        0, ge=0, description="loader threads gathering the next batches while one trains (shared memory, no pickling)"
    )
    compile: bool = Field(
        False,
        description="run the training step's forward through torch.compile (for GPUs: it pays off on long runs of "
        "a fixed shape; the first steps wait for the compilation)",
    )
    cuda_graphs: bool = Field(
        False,
        description="on a CUDA device, capture the whole optimizer step (forward, loss, backward, clipping, AdamW) "
        "of full batches once as a CUDA graph and replay it: one launch a step instead of hundreds, for small "
        "models whose steps wait on Python and kernel launches. Each epoch's last, shorter batch, fp16 (its loss "
        "scaler reads the gradients back) and several processes train eagerly; a step that cannot be captured "
        "(a model that reads a value back to Python, or changes shape) says so and the run goes on eagerly. "
        "Ignored on the CPU",
    )
    deterministic: bool | None = Field(
        None,
        description="deterministic kernels, so that a run and its resume from a checkpoint end on bit-identical "
        "weights. null: on the CPU only (where they cost nothing measurable); true: on a GPU too (torch's "
        "deterministic algorithms, and cuBLAS's fixed workspace CUBLAS_WORKSPACE_CONFIG=:4096:8 when the "
        "environment sets none; some kernels are slower, an embedding's backward sorts instead of adding "
        "atomically); false: nowhere",
    )
    fold: int | None = Field(
        None,
        ge=0,
        description="k-fold data (data.split.method: kfold): train on every fold but this one and validate on it; "
        "null: train on every fold (the final model), validating on the last fold, which it also trains on",
    )
    shuffle_shards: int | None = Field(
        None,
        ge=1,
        description=(
            "shuffle the train split this many shards at a time (the shards in a permuted order, each block's "
            "windows permuted together), so a split larger than the local cache streams with the cache holding "
            "one block; null: one global shuffle, which needs the whole split in the cache. The order never "
            "depends on the cache"
        ),
    )


class EvaluationConfig(_Strict):
    k: list[int] = Field(
        default_factory=lambda: [5, 10],
        description="ranking data (data.group_key): the cutoffs of nDCG@k, MAP@k, recall@k and MRR@k",
    )

    @field_validator("k")
    @classmethod
    def _cutoffs(cls, v: list[int]) -> list[int]:
        if not v:
            raise ValueError("evaluation.k is empty: give at least one cutoff, such as [5, 10]")
        low = [k for k in v if k < 1]
        if low:
            raise ValueError(f"evaluation.k holds {low}: cutoffs are whole numbers >= 1 (the top k of a ranking)")
        return sorted(set(v))

    max_generations: int = Field(
        200,
        ge=0,
        description="a generation target (data.target.task: generation): how many test sequences are generated "
        "greedily for exact match and token F1 (the first N, in the shards' order; 0: none)",
    )
    max_new_tokens: int | None = Field(
        None,
        ge=1,
        description="a generation target: new tokens per test generation (default: the longest reference + 8, "
        "at most 256)",
    )


class StorageConfig(_Strict):
    root: str = Field("./shardline-home/store", description="local path or fsspec URL for shards, checkpoints, results")


class MlflowConfig(_Strict):
    tracking_uri: str | None = Field(None, description="default: sqlite under the storage root's parent (laptop)")
    experiment: str = "shardline"
    model_name: str = "shardline-model"
    promotion_metric: str | None = Field(None, description="default: accuracy (classification) / rmse (regression)")
    promotion_direction: Literal["maximize", "minimize"] | None = None


class ComputeConfig(_Strict):
    """Where training runs. Nothing here changes what is trained: switching it never retrains."""

    train_on: Literal["local", "deployment", "launcher"] = Field(
        "local",
        description=(
            "local: a subflow in the pipeline's process; deployment: dispatched to `train_deployment` (a GPU work "
            "pool); launcher: the pipeline runs `launch_command`, whose machines each run `shardline node JOB` (a "
            "TrainJob, JobSet, Slurm or SkyPilot job: deploy/), and follows the training in storage"
        ),
    )
    launch_command: list[str] = Field(
        default_factory=list,
        description=(
            "train_on: launcher: the command that starts the training's machines (argv; `{job}` is replaced by the "
            "job's URI in storage and `{run}` by the run's id), e.g. [sbatch, --export=ALL,SHARDLINE_JOB={job}, "
            "deploy/slurm.sh]; it returns once they are submitted"
        ),
    )
    train_deployment: str = Field(
        "train/train", description="'flow/deployment' name the pipeline dispatches training to"
    )
    job_variables: dict[str, Any] = Field(
        default_factory=dict,
        description="per-run overrides of the training deployment's job variables (env, image, resources)",
    )
    processes_per_node: int = Field(
        1,
        ge=1,
        description=(
            "training processes on each machine (DDP through torchrun: one per GPU; gloo on CPU); >1 runs the "
            "training body under `torchrun --nproc-per-node N`; training.batch_size is the global batch and must "
            "divide by nodes x processes_per_node"
        ),
    )
    nodes: int = Field(
        1,
        ge=1,
        description=(
            "machines training together, one torchrun agent each meeting at a c10d rendezvous; >1: the training run "
            "is node 0 and starts the others as flow runs of `node_deployment`, or a launcher starts them all "
            "(train_on: launcher)"
        ),
    )
    node_deployment: str = Field(
        "train-node/train-node",
        description="'flow/deployment' that runs nodes 1.. of a compute.nodes > 1 training (a GPU work pool)",
    )
    master_addr: str | None = Field(
        None,
        description=(
            "the address the other nodes reach the rendezvous at, on node 0's machine (its IP or host name); null: "
            "node 0's own IP, as its host name resolves or its default route leaves"
        ),
    )
    master_port: int | None = Field(
        None, ge=1, le=65535, description="the port node 0's rendezvous listens on; null: a free one"
    )
    join_timeout_seconds: float = Field(
        600.0,
        gt=0,
        description=(
            "how long torchrun's rendezvous waits for all `nodes` (at the start, and after a lost node for its "
            "replacement); then the training fails naming the nodes that came, and is retried whole"
        ),
    )
    collective_timeout_seconds: float = Field(
        900.0,
        gt=0,
        description=(
            "how long a training process waits in a collective for a peer (a machine gone without a word); then "
            "torch's restart round resumes from the newest checkpoint. Longer than rank 0's validation pass"
        ),
    )
    max_preemptions: int = Field(
        3,
        ge=0,
        description=(
            "re-dispatches of a training run that crashed or was preempted (its machine died); a failed run "
            "is never re-dispatched"
        ),
    )
    dispatch_timeout_seconds: float | None = Field(
        None, gt=0, description="give up waiting for one training run after this long; null: wait"
    )
    poll_seconds: float = Field(5.0, gt=0, description="how often the pipeline checks the training run's state")
    provider: str | None = Field(
        None,
        description="whose prices a run's GPU-hours are costed at (a provider of shardline/configs/prices.yaml or "
        "of your SHARDLINE_PRICES file); null: the cheapest one listed for the machine's GPU type",
    )
    spot: bool = Field(False, description="cost GPU-hours at the provider's spot (interruptible) price")
    task_runner: Literal["threads", "dask"] = Field(
        "threads",
        description=(
            "where the encode's file-group tasks run: threads (this process, data.encode_workers at once) or dask "
            "(the workers of a Dask cluster, one group per worker thread; needs `pip install shardline[dask]`)"
        ),
    )
    dask_address: str | None = Field(
        None,
        description=(
            "task_runner: dask: the scheduler of an existing Dask cluster (tcp://host:8786); null: a local cluster "
            "of dask_workers processes for the run"
        ),
    )
    dask_workers: int | None = Field(
        None, ge=1, description="the local Dask cluster's worker processes (one thread each); null: data.encode_workers"
    )

    @model_validator(mode="after")
    def _dask_settings_need_dask(self) -> ComputeConfig:
        if self.task_runner != "dask":
            for key in ("dask_address", "dask_workers"):
                if getattr(self, key) is not None:
                    raise ValueError(
                        f"compute.{key} is set but compute.task_runner is '{self.task_runner}'; "
                        "set compute.task_runner: dask, or remove it"
                    )
        if self.dask_address is not None and self.dask_workers is not None:
            raise ValueError(
                "compute.dask_workers sizes a local cluster; with compute.dask_address (an existing "
                "cluster) its workers are what that cluster has: remove compute.dask_workers"
            )
        if self.dask_address is not None and "://" not in self.dask_address:
            raise ValueError(
                f"compute.dask_address '{self.dask_address}' is not a scheduler address; write it as tcp://host:8786"
            )
        return self

    @field_validator("train_deployment")
    @classmethod
    def _flow_slash_deployment(cls, v: str) -> str:
        if v.count("/") != 1 or not all(v.split("/")):
            raise ValueError(f"'{v}' is not 'flow-name/deployment-name' (for example 'train/train')")
        return v


class PipelineConfig(_Strict):
    name: str = "shardline"
    data: DataConfig
    model: ModelConfig = Field(default_factory=ModelConfig)
    training: TrainingConfig = Field(default_factory=TrainingConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)
    compute: ComputeConfig = Field(default_factory=ComputeConfig)

    @model_validator(mode="after")
    def _defaults(self) -> PipelineConfig:
        size = self.compute.nodes * self.compute.processes_per_node
        if self.training.batch_size % size:  # several processes: each takes an equal share of a global batch
            raise ValueError(
                f"training.batch_size={self.training.batch_size} is not divisible by the world size {size} "
                f"(compute.nodes={self.compute.nodes} x compute.processes_per_node="
                f"{self.compute.processes_per_node}); use a multiple of {size}"
            )
        if self.data.features.text and self.data.tokenizer is None and not self.training.init_from:
            raise ValueError(
                "data.features.text needs data.tokenizer: {kind: bpe, vocab_size: 8192} (trained on the training "
                "split) or {file: tokenizer.json}; a fine-tune (training.init_from a text model) uses its parent's"
            )
        targets = self.data.target_list
        if self.data.text_target is not None:  # text: one target over the vocabulary, implied when pre-training
            targets = [Target(column=self.data.text_target, task="generation")]
        if not targets and not self.model.entrypoint:
            raise ValueError(
                "data.target (or data.targets) is required for the built-in model families; only a model of your "
                "own that defines loss(outputs, cont, cat, targets) trains without a target"
            )
        if self.data.target_positions == "all" and not self.model.entrypoint and self.model.family == "mlp":
            raise ValueError(
                "data.target_positions='all' needs a model that predicts every position: model.family: transformer "
                "(causal over the window), or your own model; the mlp predicts the last position only"
            )
        if not self.model.entrypoint and self.model.family == "gpt":
            self._check_gpt_data()
        metrics = metric_directions(targets, self.evaluation.k if self.data.group_key else ())
        if self.mlflow.promotion_metric is None:
            self.mlflow.promotion_metric = next(iter(metrics))
        chosen = self.mlflow.promotion_metric
        if len(targets) == 1 and chosen.startswith(f"{targets[0].column}/"):  # the one target's name is optional
            chosen = self.mlflow.promotion_metric = chosen.split("/", 1)[1]
        if chosen not in metrics and not targets:  # a metric the model's own `metrics` returns
            if self.mlflow.promotion_direction is None:
                raise ValueError(
                    f"mlflow.promotion_metric='{chosen}' is not the model's own 'loss': if your model's metrics() "
                    "returns it, set mlflow.promotion_direction (maximize or minimize) too"
                )
        elif chosen not in metrics:
            raise ValueError(
                f"mlflow.promotion_metric='{chosen}' is not a metric of "
                + (f"the targets {[t.column for t in targets]}" if targets else "a model without a target")
                + f"; allowed: {sorted(metrics)}"
                + _ranking_hint(chosen, self.data.group_key, self.evaluation.k)
            )
        if self.mlflow.promotion_direction is None:
            self.mlflow.promotion_direction = metrics[chosen]
        # the best checkpoint is chosen the way promotion decides, where validation measures the same thing
        known = validation_metrics(
            [(t.column, t.task) for t in targets], self.evaluation.k if self.data.group_key else ()
        )
        counterpart = "val_" + metric_key(chosen)  # ndcg@10 -> val_ndcg_at_10
        own = {counterpart: self.mlflow.promotion_direction} if chosen not in metrics else {}  # the model's own
        if self.training.select_by is None:
            self.training.select_by = counterpart if counterpart in known or own else "val_loss"
        self.training.select_direction = resolve_selection(
            self.training.select_by, self.training.select_direction, known, self.model.entrypoint is not None, own
        )[1]
        split = self.data.split
        if self.training.fold is not None and split.method != "kfold":
            raise ValueError(
                f"training.fold={self.training.fold} picks a fold of k-fold data: set data.split.method: kfold "
                f"(now {split.method}) and data.split.folds"
            )
        if self.training.fold is not None and self.training.fold >= (split.folds or 0):
            raise ValueError(
                f"training.fold={self.training.fold} is not a fold of data.split.folds={split.folds}: "
                f"allowed 0..{(split.folds or 0) - 1}, or null to train on every fold"
            )
        unknown = sorted(set(self.training.loss_weights) - {t.column for t in targets})
        if unknown:
            raise ValueError(
                f"training.loss_weights names {unknown}, which are not targets; the targets are "
                f"{[t.column for t in targets]}"
            )
        return self

    def _check_gpt_data(self) -> None:
        """The gpt family reads one token column and predicts the next token at every position."""
        features = self.data.features
        columns = features.all()
        if features.continuous or features.boolean or len(columns) != 1:
            raise ValueError(
                f"model.family: gpt reads exactly one token column (a categorical column of token ids, or a text "
                f"column) and no other feature; data.features lists {columns}"
            )
        if self.data.target_positions != "all":
            raise ValueError(
                "model.family: gpt predicts the next token at every position: set data.target_positions: all "
                "(and data.horizon: 1)"
            )

    @model_serializer(mode="wrap")
    def _without_secrets(self, handler: SerializerFunctionWrapHandler, info: SerializationInfo) -> dict:
        """As JSON (a Prefect flow parameter, the config stored beside a run, MLflow params, the hash), a
        config has its secrets masked (`shardline/core/secrets.py`), unless the caller asks for them:
        `model_dump(mode="json", context=KEEP_SECRETS)` (to build another config in this process)."""
        data = handler(self)
        if info.mode_is_json() and not (isinstance(info.context, dict) and info.context.get("secrets") == "keep"):
            from shardline.core.secrets import redact

            return redact(data)
        return data

    def hash(self) -> str:
        """What the config says, its secrets left out (a rotated password trains nothing again)."""
        return stable_hash(self.model_dump(mode="json"))


# metric -> the direction that is better
CLASSIFICATION_METRICS = {
    "accuracy": "maximize",
    "top5_accuracy": "maximize",
    "log_loss": "minimize",
    "macro_f1": "maximize",
}
REGRESSION_METRICS = {"mae": "minimize", "rmse": "minimize", "r2": "maximize"}
SELF_SUPERVISED_METRICS = {"loss": "minimize"}  # no target: the model's own loss on the test split
# text (data.features.text): the next token's loss over the target tokens, its perplexity (exp of that mean;
# the unigram baseline's is `perplexity_baseline`), next-token accuracy; a generation target also scores its
# greedy generations (exact match, token F1)
TEXT_METRICS = {"perplexity": "minimize", "loss": "minimize", "accuracy": "maximize"}
GENERATION_METRICS = {**TEXT_METRICS, "exact_match": "maximize", "token_f1": "maximize"}


RANKING_METRICS = ("ndcg", "map", "recall", "mrr")  # each at every k of evaluation.k; mrr uncut too


def ranking_metrics_of(ks) -> dict[str, str]:
    """The ranking metrics evaluation reports at cutoffs `ks` (shardline/core/ranking.py) -> the better
    direction (every one is maximised)."""
    names = [f"{m}@{k}" for m in RANKING_METRICS[:3] for k in ks] + ["mrr"] + [f"mrr@{k}" for k in ks]
    return dict.fromkeys(names, "maximize")


def metric_key(name: str) -> str:
    """An evaluation metric's name as MLflow takes it: MLflow names hold letters, digits, `_ - . / :` and
    spaces only, so a ranking metric's `@` is spelled out (`ndcg@10` is logged as `ndcg_at_10`); every
    other name is its own."""
    return name.replace("@", "_at_")


def validation_ranking_names(target: str, several: bool, ks) -> dict[str, str]:
    """Ranking data: each ranking metric at cutoffs `ks` (`ndcg@10`) -> its validation name, as the epoch
    history and MLflow name it (`val_ndcg_at_10`; `val_<target>/ndcg_at_10` with several targets)."""
    return {m: "val_" + metric_key(f"{target}/{m}" if several else m) for m in ranking_metrics_of(ks)}


def is_ranking_validation(name: str) -> bool:
    """Whether a validation metric's name is a ranking metric's (`val_ndcg_at_10`, `val_click/mrr`)."""
    return name.removeprefix("val_").rsplit("/", 1)[-1].partition("_at_")[0] in RANKING_METRICS


def metric_directions(targets: list[Target], ranking_ks=()) -> dict[str, str]:
    """Every evaluation metric of these targets -> the direction that is better, the default promotion
    metric first: bare names (`accuracy`) for one target, `target/metric` (`p1_action/accuracy`) for
    several, `loss` (the model's own) for none. Ranking data (`ranking_ks`: `evaluation.k` when
    `data.group_key` is set) adds the ranking metrics of the first target, the relevance (`ndcg@10`)."""
    if not targets:
        return dict(SELF_SUPERVISED_METRICS)
    out: dict[str, str] = {}
    for i, t in enumerate(targets):
        names = CLASSIFICATION_METRICS if t.task == "classification" else REGRESSION_METRICS
        first = "accuracy" if t.task == "classification" else "rmse"
        if t.task == "generation":
            names = TEXT_METRICS if t.column == TEXT_TARGET else GENERATION_METRICS
            first = "perplexity"
        if i == 0 and ranking_ks:
            names = {**names, **ranking_metrics_of(ranking_ks)}
        for m in sorted(names, key=lambda m: m != first):
            out[m if len(targets) == 1 else f"{t.column}/{m}"] = names[m]
    return out


# what the training loop validates each epoch, per target kind, and which way is better
VALIDATION_SCORES = {"classification": ("accuracy", "maximize"), "regression": ("mae", "minimize")}


def validation_name(target: str, kind: str, several: bool) -> str:
    """A target's validation score as the epoch history names it: `val_accuracy` or `val_mae` for one
    target, `val_<target>/accuracy` for several."""
    metric = VALIDATION_SCORES[kind][0]
    return f"val_{target}/{metric}" if several else f"val_{metric}"


def validation_metrics(targets: list[tuple[str, str]], ranking_ks=()) -> dict[str, str]:
    """The metrics the training loop validates for targets given as (column, kind), as the history names
    them -> the direction that is better: `val_loss`, then each target's score; ranking data (`ranking_ks`:
    `evaluation.k` when `data.group_key` is set) adds the first target's ranking metrics (`val_ndcg_at_10`,
    maximised). A model's own `metrics()` add `val_<name>` ones, known only once it runs."""
    out = {"val_loss": "minimize"}
    for name, kind in targets:
        if kind == "generation":  # text: the token-level perplexity and next-token accuracy
            out.update({"val_perplexity": "minimize", "val_accuracy": "maximize"})
            continue
        out[validation_name(name, kind, len(targets) > 1)] = VALIDATION_SCORES[kind][1]
    if targets and ranking_ks:
        out.update(
            dict.fromkeys(validation_ranking_names(targets[0][0], len(targets) > 1, ranking_ks).values(), "maximize")
        )
    return out


def resolve_selection(
    select_by: str | None,
    direction: str | None,
    known: dict[str, str],
    own_metrics: bool,
    own_directions: dict[str, str] | None = None,
) -> tuple[str, str]:
    """(metric, direction) that picks the best checkpoint: `select_by` (default val_loss) among the `known`
    validation metrics (-> direction), or, for a model with metrics of its own (`own_metrics`), a `val_<name>`
    with `direction` given or in `own_directions` (the promotion metric's). A name validation never gives, or
    a direction that contradicts the metric's, is an error naming training.select_by and what is allowed."""
    name = select_by or "val_loss"
    if name in known:
        if direction is not None and direction != known[name]:
            raise ValueError(
                f"training.select_direction={direction} contradicts training.select_by='{name}': "
                f"{'higher' if known[name] == 'maximize' else 'lower'} is better; leave select_direction unset"
            )
        return name, known[name]
    if not own_metrics or not name.startswith("val_"):
        raise ValueError(
            f"training.select_by='{name}' is not a metric the validation gives; available: {sorted(known)}"
            + (" or val_<name> of the model's own metrics()" if own_metrics else "")
        )
    direction = direction or (own_directions or {}).get(name)
    if direction is None:
        raise ValueError(
            f"training.select_by='{name}' is not one of {sorted(known)}, so it must come from the model's own "
            "metrics(): set training.select_direction (maximize or minimize) to say which way is better"
        )
    return name, direction


def _ranking_hint(chosen: str, group_key: str | None, ks: list[int]) -> str:
    """What a ranking metric that is not there needs: `data.group_key`, or its cutoff in `evaluation.k`."""
    name = chosen.rsplit("/", 1)[-1]
    metric, _, k = name.partition("@")
    if metric not in RANKING_METRICS:
        return ""
    if group_key is None:
        return f" ({name} is a ranking metric: set data.group_key, the column whose rows are ranked together)"
    if k.isdigit() and int(k) not in ks:
        return f" (add {k} to evaluation.k, now {ks}, for {name})"
    return ""


def stable_hash(obj: Any) -> str:
    """sha256 of canonical JSON: the same content gives the same hash on any machine."""
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()


# ---------------------------------------------------------------- loading


def _deep_merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def _read_yaml(path: Path, chain: tuple[Path, ...] = ()) -> dict:
    path = path.resolve()
    if path in chain:
        raise ConfigError(f"config 'extends' loops: {' -> '.join(str(p) for p in (*chain, path))}")
    if not path.exists():
        where = f" (extended by {chain[-1]})" if chain else ""
        raise ConfigError(f"config file not found: {path}{where}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(
            f"{path}: the top level must be a mapping of sections (data, model, ...), got {type(raw).__name__}"
        )
    parent = raw.pop("extends", None)
    if parent is None:
        return _rebase_paths(raw, path.parent)
    base = _read_yaml((path.parent / parent), (*chain, path))
    return _deep_merge(base, _rebase_paths(raw, path.parent))


def _rebase_paths(raw: dict, folder: Path) -> dict:
    """Relative local paths in a config file are relative to that file, not to the cwd."""
    model = raw.get("model")
    if isinstance(model, dict) and model.get("entrypoint") and not model.get("code_dir"):
        raw["model"] = {**model, "code_dir": str(folder.resolve())}  # the user's code sits beside the config
    data = raw.get("data")
    tok = data.get("tokenizer") if isinstance(data, dict) else None
    if isinstance(tok, dict) and isinstance(tok.get("file"), str) and not Path(tok["file"]).is_absolute():
        raw["data"] = {**data, "tokenizer": {**tok, "file": str((folder / tok["file"]).resolve())}}
    for section, key in (("data", "source"), ("storage", "root"), ("model", "code_dir")):
        val = (raw.get(section) or {}).get(key) if isinstance(raw.get(section), dict) else None
        if isinstance(val, str) and "://" not in val and not Path(val).is_absolute():
            raw[section] = dict(raw[section])
            raw[section][key] = str((folder / val).resolve())
    return raw


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise ConfigError(f"--set '{item}': expected key.path=value, e.g. training.epochs=5")
    key, _, value = item.partition("=")
    parts = [p for p in key.strip().split(".") if p]
    if not parts:
        raise ConfigError(f"--set '{item}': the key is empty")
    return parts, yaml.safe_load(value) if value.strip() else None


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    raw = json.loads(json.dumps(raw, default=str))
    for item in overrides:
        parts, value = parse_override(item)
        node = raw
        for p in parts[:-1]:
            nxt = node.get(p)
            if nxt is None:
                nxt = node[p] = {}
            if not isinstance(nxt, dict):
                raise ConfigError(f"--set '{item}': '{p}' is a value, not a section")
            node = nxt
        node[parts[-1]] = value
    return raw


def _format_validation_error(err: ValidationError, origin: str) -> str:
    lines = [f"invalid config {origin}:"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            lines.append(f"  - unknown key '{loc}': remove it or check its spelling")
            continue
        value = e.get("input")
        shown = "" if isinstance(value, dict) or e["type"] == "missing" else f" (got {value!r})"
        lines.append(f"  - {loc or 'config'}: {msg}{shown}")
    return "\n".join(lines)


def validate_config(raw: dict, origin: str = "") -> PipelineConfig:
    try:
        return PipelineConfig.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, origin)) from None


def load_config(
    path: str | Path | None = None, overrides: list[str] | None = None, base: dict | None = None
) -> PipelineConfig:
    """Read a YAML config (following `extends:`), apply `--set` overrides, validate."""
    raw: dict = dict(base or {})
    if path is not None:
        raw = _deep_merge(raw, _read_yaml(Path(path)))
    raw = apply_overrides(raw, overrides or [])
    return validate_config(raw, f"'{path}'" if path else "")
