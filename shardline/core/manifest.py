"""Contract types passed between steps: the ingest snapshot, the encoding spec and the shard manifest.

All are small pydantic models that serialise to JSON; bulk data stays in files under the storage root.
"""

from __future__ import annotations

import base64
import json
import zlib
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

from shardline.core.config import stable_hash

MANIFEST_VERSION = 1


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


# ---------------------------------------------------------------- ingest


class RawFile(_Model):
    uri: str
    size: int
    version: str = Field(description="etag (object stores) or mtime_ns (local disks)")


class FilePart(RawFile):
    """Part `part` (0-based) of `parts` of a raw file too large for one group: the rows whose key falls in it
    (shardline/core/encoding/groups.py). Only a group holds one; a snapshot lists whole files."""

    part: int
    parts: int


class RejectedFile(_Model):
    uri: str
    reason: str


class Snapshot(_Model):
    source: str
    files: list[RawFile]
    rejected: list[RejectedFile] = Field(default_factory=list)
    # files without rows (a day with no events, a file still being written): not in `files`, so not in the
    # fingerprint: an empty file added changes no step's input
    empty: list[str] = Field(default_factory=list)
    fingerprint: str

    @staticmethod
    def fingerprint_of(files: list[RawFile]) -> str:
        return stable_hash([f.model_dump() for f in sorted(files, key=lambda f: f.uri)])


# ---------------------------------------------------------------- encoding


class ContinuousStat(_Model):
    name: str
    mean: float
    std: float


class Vocabulary(_Model):
    name: str
    values: list[str] = Field(description="id i+1 is values[i]; id 0 is reserved for unseen and null")

    @property
    def size(self) -> int:
        return len(self.values) + 1


class TargetSpec(_Model):
    column: str
    task: Literal["classification", "regression"]
    classes: list[str] | None = Field(None, description="classification: id i+1 is classes[i]; id 0 = unseen in train")
    mean: float | None = None
    std: float | None = None
    dtype: str | None = Field(None, description="classification: the raw column's type, which predictions keep")

    @property
    def n_outputs(self) -> int:
        return len(self.classes) + 1 if self.classes is not None else 1

    def class_names(self) -> list[str]:
        """A class target's names by id: id 0, a class never seen in training, is `<unseen>`."""
        return ["<unseen>", *(self.classes or [])]


def target_array(i: int) -> str:
    """The shard array of the i-th target: `target`, then `target_1`, `target_2`, ..."""
    return "target" if i == 0 else f"target_{i}"


def _one_target_as_list(data, key: str):
    """Specs written before several targets held one `target`: read as a list of one."""
    if isinstance(data, dict) and key in data and f"{key}s" not in data:
        data = dict(data)
        one = data.pop(key)
        data[f"{key}s"] = [] if one is None else [one]
    return data


class TextSpec(_Model):
    """Text data (`data.features.text`): its columns become one token stream per sequence, the `cat` array's
    one column `tokens`, ids of the tokenizer stored beside the manifest (`Manifest.tokenizer`) and inside a
    registered model. Special ids are fixed: 0 `<pad>` (never a real token; a target of 0 is ignored by the
    loss and the metrics), 1 `<sep>` (between text columns and between rows), 2 `<eos>` (ends a stream)."""

    columns: list[str] = Field(description="the text columns, joined with <sep> in this order")
    target_column: str | None = Field(None, description="generation: the target text column; None: pre-training")
    vocab_size: int
    pad_id: int = 0
    sep_id: int = 1
    eos_id: int = 2
    tokenizer_sha256: str = Field(description="sha256 of the tokenizer.json the ids come from")
    tokenizer: dict = Field(description="what the config said: {kind: bpe, vocab_size} or {file_sha256}")
    on_bad_rows: Literal["error", "skip"] = "error"

    @property
    def target_name(self) -> str:
        return self.target_column or "next_token"


class EncodingSpec(_Model):
    """How raw rows become arrays: fitted on the training split only, then frozen."""

    sequence_key: str | None
    order_by: str | None
    order_format: str | None = None
    id_columns: list[str] = Field(default_factory=list, description="passed through to predictions, not encoded")
    group_key: str | None = Field(
        None, description="ranking data: the column whose rows are ranked together (kept per row in the rows files)"
    )
    item_key: str | None = Field(None, description="ranking data: the column naming each row's item")
    window: int
    horizon: int
    continuous: list[ContinuousStat]
    boolean: list[str]
    categorical: list[Vocabulary]
    targets: list[TargetSpec] = Field(default_factory=list, description="none when the model has its own loss")
    target_positions: Literal["last", "all"] = "last"
    continuous_dtype: Literal["float32", "float16"] = "float32"
    text: TextSpec | None = Field(None, description="text data: the token stream's columns and tokenizer")

    _legacy = model_validator(mode="before")(lambda data: _one_target_as_list(data, "target"))

    @property
    def target(self) -> TargetSpec | None:
        """The first target (the only one, mostly); None without a target."""
        return self.targets[0] if self.targets else None

    def hash(self) -> str:
        # `text` only when set: every encoding written before text data keeps its hash
        return stable_hash(self.model_dump(mode="json", exclude=None if self.text else {"text"}))

    @property
    def cat_cardinalities(self) -> list[int]:
        """Vocabulary size per column of the `cat` array: categoricals, then booleans (0 null, 1 false, 2 true);
        text data: the one `tokens` column's vocabulary size."""
        if self.text is not None:
            return [self.text.vocab_size]
        return [v.size for v in self.categorical] + [3] * len(self.boolean)


# ---------------------------------------------------------------- shards


class ArraySpec(_Model):
    dtype: str
    shape: list[int]
    offset: int = Field(description="byte offset of the array in the shard file")


class LocalVocab(_Model):
    """A shard's own ids for one column (the encode writes each file group's own ids, in one pass):
    id 0 is null; id i >= 1 is the integer `start + i - 1` when `start` is set (integers coded by
    arithmetic), else `values[i - 1]`. Values are compared as text, like the data set's vocabulary."""

    start: int | None = None
    size: int = Field(description="ids besides 0")
    values: list[str] | None = None
    ints: str | None = Field(
        None, description="sorted distinct integers, packed: base64 of the zlib of their int64 differences"
    )

    @classmethod
    def of_ints(cls, values) -> LocalVocab:
        """The vocabulary of sorted distinct integers (a numpy array), packed: a group of a click log's user ids
        held 8,914 of them, 80 KB of JSON as text and 3.5 KB packed (its manifest: 62 MB, 29 MB of it these)."""
        return cls(size=len(values), ints=pack_ints(values))

    def integers(self):
        """The vocabulary's values as an int64 numpy array where they are integers (by range or packed), else None."""
        import numpy as np

        if self.start is not None:
            return np.arange(self.start, self.start + self.size, dtype=np.int64)
        return unpack_ints(self.ints) if self.ints is not None else None

    def texts(self) -> list[str]:
        ints = self.integers()
        return [str(v) for v in ints.tolist()] if ints is not None else list(self.values or [])


def pack_ints(values, deltas: bool = True) -> str:
    """Integers (a numpy array) as text: base64 of the zlib of their int64s, or of their differences (`deltas`: for
    sorted values, which then take a byte or two each)."""
    import numpy as np

    x = np.asarray(values, dtype=np.int64)
    x = np.diff(x, prepend=0) if deltas else x
    return base64.b64encode(zlib.compress(x.astype("<i8").tobytes(), 6)).decode()


def unpack_ints(text: str, deltas: bool = True):
    """`pack_ints`' integers, an int64 numpy array."""
    import numpy as np

    x = np.frombuffer(zlib.decompress(base64.b64decode(text)), dtype="<i8").astype(np.int64)
    return np.cumsum(x) if deltas else x


class LocalCodes(_Model):
    """How a shard's stored codes map to the data set's encoding (`EncodingSpec`): continuous columns
    were standardised with the own mean and std of the shard's file group (nulls stored as NaN),
    categorical columns and a class target hold the group's own ids (a group's shards share its
    codes). Readers apply the map when they unpack a shard."""

    cont: list[tuple[float, float]] = Field(description="(mean, std) per continuous column")
    cat: list[LocalVocab] = Field(description="per categorical column (booleans are fixed: 0 null, 1 false, 2 true)")
    targets: list[LocalVocab | tuple[float, float]] = Field(
        default_factory=list, description="per target: class ids, or (mean, std) of a regression target"
    )

    _legacy = model_validator(mode="before")(lambda data: _one_target_as_list(data, "target"))


class ShardInfo(_Model):
    """One shard file: the arrays of one group of raw files for one split.

    Arrays (rows are frames; each sequence's rows contiguous and ordered):
      cont    [rows, n_continuous]   standardised continuous features (float32/float16)
      cat     [rows, n_cat + n_bool] vocabulary ids (narrowest integer type)
      target  [rows]                 class id (narrowest integer type) or standardised value (float32);
                                     further targets as target_1, target_2, ... (none without a target)
      order   [rows]                 the order column as int64 (row number when there is none), or
      order_start [segments]         its first value per segment, when it counts up by one inside each
      offsets [segments + 1]         row offset where each sequence segment starts
    `keys` is a parquet file beside it with one row per segment: the sequence key. Ranking data
    (`data.group_key`) also has a `rows` parquet file with one row per shard row: its group, item and
    relevance grade (`shardline/core/encoding/row_keys.py`); other data has none.
    """

    path: str = Field(
        description="relative to the manifest's folder: `../groups/<group key>/train.bin.lz4` for a shard in the "
        "group store (`storage.resolve` reads the `..`), or a name beside the manifest (encoder version 4 and before)"
    )
    compression: Literal["zstd", "lz4"] | None = Field(
        None, description="how the stored object is compressed; readers unpack it into the local cache"
    )
    raw_bytes: int | None = Field(None, description="size of the unpacked shard (the memory-mappable file)")
    split: str = Field(
        pattern=r"^(train|validation|test|fold\d+)$",
        description="train, validation, test; or, for k-fold data, fold0..fold{K-1} and test",
    )
    rows: int
    segments: int
    windows: int
    short_segments: int = Field(0, description="segments shorter than window + horizon rows: in no window")
    short_rows: int = Field(0, description="the rows of those segments")
    lengths: list[list[int]] | None = Field(
        None,
        description="its segments' lengths as [length, count] pairs, in a group's record (not in a manifest): the "
        "windows, short segments and rows above for any data.window and data.horizon",
    )
    bytes: int = Field(description="size of the stored object")
    sha256: str = Field(description="checksum of the stored object")
    arrays: dict[str, ArraySpec]
    keys_path: str
    keys_sha256: str
    rows_path: str | None = Field(None, description="ranking data: the rows file (group, item, relevance per row)")
    rows_sha256: str | None = None
    local: LocalCodes | None = Field(None, description="set when the stored codes are the shard's own (see LocalCodes)")
    codes: int | None = Field(
        None,
        description="in a manifest or a group's record: which of its `codes` is this shard's `local` (a group's "
        "shards share one set, written once); set in `local` when read",
    )


class _Shards(_Model):
    """A list of shards whose own codes are written once each: `codes` in the JSON, each shard naming its own
    by number (a file group's shards share one set, and at 22,000 games the copies were 90 % of a manifest).
    In memory each shard holds them in `local` (one object for the shards that share them), `codes` empty."""

    shards: list[ShardInfo]
    codes: list[LocalCodes] = Field(default_factory=list, description="the shards' own codes, each set once")

    @model_validator(mode="after")
    def _link_codes(self):
        for s in self.shards:
            if s.codes is not None:
                if not 0 <= s.codes < len(self.codes):
                    raise ValueError(f"shard {s.path} names codes {s.codes}, but {len(self.codes)} are listed")
                s.local, s.codes = self.codes[s.codes], None
        self.codes = []
        return self

    @model_serializer(mode="wrap")
    def _codes_once(self, handler):
        out = handler(self)
        out.pop("codes", None)
        shards, codes, seen = out.pop("shards", []), [], {}
        for shard in shards:
            local = shard.pop("local", None)
            shard.pop("codes", None)
            if local is not None:  # a shard without its own codes is written as before (and hashes the same)
                key = json.dumps(local, sort_keys=True, default=str)
                shard["codes"] = seen.setdefault(key, len(codes))
                if shard["codes"] == len(codes):
                    codes.append(local)
        out["shards"] = shards
        if codes:
            out["codes"] = codes
        return out


class EncodedGroup(_Shards):
    """What encoding one file group produced: its shards (in the group's own codes) and the
    sufficient statistics of its training rows, from which the data set's encoding is fitted.

    `key` names the group's folder in the group store (its files, the data settings and the encoder's
    version: `shardline.tasks.encode.group_key`); its shards' paths are relative to that folder, and the
    manifest lists them relative to its own. Without a key (encoder version 4 and before) the shards
    lie beside the manifest."""

    key: str | None = None
    train: dict = Field(
        description="count/mean/M2 per continuous column, value counts per categorical column and of the target"
    )
    rows: dict[str, int]
    damaged: list[RejectedFile] = Field(
        default_factory=list, description="its files damaged inside, left out (data.on_bad_file: skip)"
    )
    outside: int = Field(0, description="its rows in no range of data.split.ranges: left out")
    cut: int = Field(0, description="ranking groups (data.group_key) a range split put in more than one split")
    unfitted: dict[int, list[str]] | None = Field(
        None,
        description="per class target (its index): the values its other splits' rows hold and its training rows do "
        "not (None: a group stored by an earlier encoder, whose ids of an integer range may name absent values)",
    )


def edited_encoding(text: str) -> bool:
    """Whether a manifest's encoding (its JSON `text`) is not the one its `encoding_hash` was computed on: changed
    after it was written (by hand). Hashed as stored (a `text` of none left out, as `EncodingSpec.hash` leaves it), so
    a manifest written before later fields of the encoding reads as it was written."""
    import json

    raw = json.loads(text)
    encoding = {k: v for k, v in (raw.get("encoding") or {}).items() if not (k == "text" and v is None)}
    return stable_hash(encoding) != raw.get("encoding_hash")


class Manifest(_Shards):
    version: int = MANIFEST_VERSION
    encoding: EncodingSpec
    encoding_hash: str
    contract_hash: str = Field(
        description="hash of what the config decides about the encoding (columns, window, target)"
    )
    data_fingerprint: str
    rows: dict[str, int]
    windows: dict[str, int]
    source_files: int
    target_stats: list[dict] | None = Field(
        None,
        description="per target, the training split's statistics the trivial baseline needs (so evaluation "
        "never reads the training split): class counts by raw value, or the moments n, mean, m2",
    )
    item_counts: dict[str, int] | None = Field(
        None,
        description="ranking data with data.item_key: relevant rows (grade > 0) per item in the training split, "
        "keyed by the item as text: the popularity baseline's scores",
    )
    skipped: list[RejectedFile] = Field(
        default_factory=list,
        description="raw files of the snapshot left out by the encode: damaged inside (data.on_bad_file: skip)",
    )
    tokenizer: str | None = Field(None, description="text data: the tokenizer.json, relative to the manifest's folder")
    token_counts: list[int] | None = Field(
        None,
        description="text data: how often each token id is a target (not 0) in the training split: the unigram "
        "baseline's distribution",
    )

    def shards_of(self, split: str | list[str] | tuple[str, ...]) -> list[ShardInfo]:
        """The shards of a split, or of several (k-fold training on several folds), in manifest order."""
        wanted = {split} if isinstance(split, str) else set(split)
        return [s for s in self.shards if s.split in wanted]

    def hash(self) -> str:
        text = {"tokenizer", "token_counts"} if self.tokenizer is None and self.token_counts is None else set()
        gone = set() if self.skipped else {"skipped"}
        return stable_hash(self.model_dump(mode="json", exclude=text | gone))  # earlier manifests keep their hash
