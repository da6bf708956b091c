"""Text data (`data.features.text`): the tokenizer and the token streams.

Each sequence becomes one token stream: a row's document (no `data.sequence_key`: every row is a
sequence) or a sequence key's rows in order; a row's text columns are joined with `<sep>`, rows are
separated by `<sep>` and the stream ends with `<eos>`. With a generation target (`data.target: {column:
summary, task: generation}`) a row's stream is its source columns, `<sep>`, the target's tokens, `<eos>`.
A stream is stored once, one shard row per token (`cat`, one column, uint16 below 65,536 ids), and its
targets once beside it (`target`): the token itself where it is to be predicted, 0 (ignored) elsewhere,
so with horizon 1 the window's position k predicts the token after it. A stream shorter than a window
and its next token is padded with `<pad>` (id 0: never a real token, an ignored target), so every
sequence gives at least one window.

The tokenizer (the `tokenizers` library, nothing downloaded): a byte-level BPE trained on the training
split only, deterministically (the same texts give a byte-identical tokenizer.json), or the user's
tokenizer.json. Special ids are fixed: 0 `<pad>`, 1 `<sep>`, 2 `<eos>`.
"""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Iterable
from itertools import chain
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from shardline.core.config import DataConfig
from shardline.core.encoding.columns import ORDER, SEQ, DataError
from shardline.core.encoding.fit import configured
from shardline.core.encoding.splits import SplitRows
from shardline.core.manifest import ArraySpec, EncodingSpec, TargetSpec, TextSpec
from shardline.core.shards import allocate

PAD, SEP, EOS = "<pad>", "<sep>", "<eos>"
SPECIALS = (PAD, SEP, EOS)  # their ids are their places: 0, 1, 2
PAD_ID, SEP_ID, EOS_ID = 0, 1, 2


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest unsigned type for token ids: uint16 up to 65,536 ids, else uint32; a vocabulary
    larger than uint32 holds is refused before any work, naming the setting."""
    if vocab_size > 1 << 32:
        raise DataError(
            f"data.tokenizer: the vocabulary has {vocab_size:,} ids, more than the largest token storage "
            f"type (uint32) holds ({1 << 32:,}); use a tokenizer with a smaller vocabulary"
        )
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


# ---------------------------------------------------------------- the tokenizer


def train_bpe(texts: Iterable[str], vocab_size: int) -> str:
    """A byte-level BPE trained on `texts` (the training split's), as tokenizer.json text: the same texts in
    the same order give the same bytes. Ids 0, 1, 2 are `<pad>`, `<sep>`, `<eos>`; every byte is in the
    vocabulary, so no text is ever out of it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    return tok.to_str()


def check_tokenizer(text: str, where: str) -> None:
    """A tokenizer.json must parse, define `<pad>` = 0, `<sep>` = 1, `<eos>` = 2 (the ids the shards and the
    loss rely on) and number its tokens 0..N-1 (an id at or past its size has no embedding row); the error
    names `where` (its path) and what to do."""
    tok = _parse(text, where)
    wrong = {s: tok.token_to_id(s) for s in SPECIALS if tok.token_to_id(s) != SPECIALS.index(s)}
    # the literal strings are text (`tokenizer`): a vocabulary that holds them as words would read them as the ids
    literal = {s: _ids_or_none(tokenizer(text), s) for s in SPECIALS} if not wrong else {}
    as_special = {s: ids for s, ids in literal.items() if set(ids) & {0, 1, 2}}
    for found, said, advice in (
        (wrong, "the tokenizer must define the special tokens <pad>=0, <sep>=1, <eos>=2; it has", (
            " (None: missing). Add them as its first added tokens (tokenizers: add_special_tokens before training)"
        )),
        (as_special, f"the text {' '.join(as_special)} tokenizes to the special id(s)", (
            ": they are words of its vocabulary, so a text holding them would read as the end of a row or of the text "
            "(or, <pad>, as nothing). Make them added special tokens only (tokenizers: special_tokens, not words of "
            "the model's vocabulary)"
        )),
    ):  # fmt: skip
        if found:
            listed = ", ".join(f"{s}={i}" for s, i in found.items())
            raise DataError(f"{where}: {said} {listed}{advice}, or use data.tokenizer: {{kind: bpe, vocab_size: N}}")
    # the model has one embedding row per id, 0 .. vocabulary size - 1: an id past it has no row
    size = int(tok.get_vocab_size(with_added_tokens=True))
    top = max(tok.get_vocab(with_added_tokens=True).values(), default=-1)
    if top >= size:
        raise DataError(
            f"{where}: its largest token id is {top:,} but its vocabulary has {size:,} tokens, so ids are not "
            f"contiguous (the model has one embedding row per id, 0..{size - 1:,}); re-number the vocabulary "
            "0..N-1 (keeping <pad>=0, <sep>=1, <eos>=2), or use data.tokenizer: {kind: bpe, vocab_size: N}"
        )


def _ids_or_none(tok, text: str) -> list[int]:
    """`text`'s ids, or none where the tokenizer cannot read it (a vocabulary without an unknown token)."""
    try:
        return tok.encode(text, add_special_tokens=False).ids
    except Exception:  # noqa: BLE001 - a text it cannot read holds no special id either
        return []


def _parse(text: str, where: str):
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_str(text)
    except Exception as e:  # noqa: BLE001 - any parse failure is the user's file: said with its path
        raise DataError(
            f"{where}: not a tokenizer.json the tokenizers library reads ({e}); fix or replace it"
        ) from None


def read_tokenizer_file(path: str, sha256: str | None = None) -> str:
    """The user's tokenizer.json (`data.tokenizer.file`), checked; refused naming the path when it is not
    there, is not the file of `sha256` (`data.tokenizer.sha256`, taken when the config was read: the data
    set's id is made from it), does not parse or lacks the special tokens."""
    from shardline.core import storage

    if not (storage.exists(path) if storage.is_remote(path) else Path(path).is_file()):
        raise DataError(f"data.tokenizer.file '{path}' does not exist; give the path of a tokenizer.json")
    raw = storage.read_bytes(path) if storage.is_remote(path) else Path(path).read_bytes()
    now = hashlib.sha256(raw).hexdigest()
    if sha256 is not None and now != sha256:
        raise DataError(
            f"data.tokenizer.file '{path}' changed since the config was read (sha256 {sha256[:12]} then, "
            f"{now[:12]} now), so the data set it names is not the one it would encode; run again (the config is "
            "read again, with the file as it is now), and leave the file as it is while the encode runs"
        )
    try:
        text = raw.decode()  # no newline translation: its sha256 is the file's
    except UnicodeDecodeError as e:
        raise DataError(f"data.tokenizer.file '{path}' is not UTF-8 text ({e}); give a tokenizer.json") from None
    check_tokenizer(text, f"data.tokenizer.file '{path}'")
    return text


@functools.lru_cache(maxsize=8)
def tokenizer(text: str):
    """The `tokenizers.Tokenizer` of a tokenizer.json text (one per distinct text in this process), with its
    truncation and padding off whatever the file says: every text is tokenized whole, for encoding and
    serving alike (a file saved with them on would otherwise cut or pad every text, silently). The literal
    strings `<pad>`, `<sep>`, `<eos>` in a text are text: only the layout puts the special ids in a stream."""
    tok = _parse(text, "the tokenizer")
    tok.no_truncation()
    tok.no_padding()
    tok.encode_special_tokens = True
    return tok


def vocab_size(text: str) -> int:
    return int(tokenizer(text).get_vocab_size(with_added_tokens=True))


def tokenizer_contract(data: DataConfig) -> dict[str, Any]:
    """What the config says about the tokenizer, as the encoding contract holds it: the BPE's settings, or
    the user's file by its content's sha256 (a changed file is another encoding)."""
    tok = data.tokenizer
    if tok is None:
        return {}
    if tok.file is not None:  # its hash as the config was read (where the file is), else the file's now
        return {"file_sha256": tok.sha256 or sha256_text(read_tokenizer_file(tok.file))}
    return {"kind": tok.kind, "vocab_size": tok.vocab_size}


# ---------------------------------------------------------------- rows


def stream_columns(data: DataConfig) -> list[str]:
    """The columns a row's stream is made of, in order: the text columns, then a generation target's."""
    return [*data.features.text, *(t.column for t in data.target_list)]


def reads_as_text(dtype: pl.DataType) -> bool:
    """Whether a column of `dtype` is text: strings, or dictionary-encoded strings (polars Categorical or Enum,
    a pandas category), or nothing at all (Null: every value null)."""
    return dtype == pl.String or dtype == pl.Null or isinstance(dtype, (pl.Categorical, pl.Enum))


def as_text(df: pl.DataFrame, data: DataConfig, where: str) -> pl.DataFrame:
    """`df` with its text columns (`stream_columns`) as strings: a dictionary-encoded one (polars Categorical
    or Enum, a pandas category) is text and is cast to String; any other non-string column is refused naming
    `where` (the file), the column and its type."""
    casts, bad = [], {}
    for c in stream_columns(data):
        dtype = df.schema[c]
        if not reads_as_text(dtype):
            bad[c] = dtype
        elif dtype != pl.String:  # Null: every value null (on_bad_rows says what becomes of those rows)
            casts.append(pl.col(c).cast(pl.String))
    if bad:
        raise DataError(
            f"{where}: "
            + ", ".join(f"text column '{c}' is {dtype}, not text" for c, dtype in bad.items())
            + "; a text column (data.features.text, a generation target) holds strings: write it as a string "
            "column, or list it under another role"
        )
    return df.with_columns(casts) if casts else df


def _empty(column: str) -> pl.Expr:
    """Whether a row's text in `column` is null or empty."""
    return pl.col(column).is_null() | (pl.col(column).str.len_bytes() == 0)


def clean_rows(df: pl.DataFrame, data: DataConfig, where: str) -> tuple[pl.DataFrame, dict[str, int]]:
    """Text rows with a null or empty text: an error naming `where` (the file), the column and the count
    (`data.on_bad_rows: error`), or left out (`skip`); returns the rows kept and the count left out per
    column (a row counted under each column it lacks)."""
    columns = stream_columns(data)
    counts = df.select([_empty(c).sum().alias(c) for c in columns])
    bad = {c: int(counts[c][0]) for c in columns if counts[c][0]}
    if not bad:
        return df, {}
    if data.on_bad_rows == "error":
        raise DataError(
            f"{where}: "
            + ", ".join(f"column '{c}' has {n} null or empty text(s)" for c, n in bad.items())
            + "; fill or drop those rows, or set data.on_bad_rows: skip to leave them out (counted in the encode's log)"
        )
    return df.filter(~pl.any_horizontal([_empty(c) for c in columns])), bad


def split_texts(frame: pl.DataFrame, splits: dict[str, SplitRows], names: tuple[str, ...], data: DataConfig):
    """The texts of the `names` splits' rows, for training a tokenizer: each row's columns in order."""
    for name in names:
        if name not in splits:
            continue
        r = splits[name]
        part = frame.slice(r.first, r.end - r.first)
        for c in stream_columns(data):
            yield from part[c].to_list()


# ---------------------------------------------------------------- the token streams


# Texts tokenized in one batch: at most this many, of about this many bytes in all (a longer text is a batch of
# its own). The tokenizer's Encoding objects and Python lists of ids cost ~40x the text's bytes, so a batch's ids
# become a numpy array (2 or 4 bytes a token) before the next one: a group's encode holds its texts, its token
# arrays and one batch, not ~130x its text as one batch of the whole group did. Large enough to keep the
# tokenizer's threads busy (benchmarks/text_bench.py).
TOKENIZE_TEXTS = 10_000
TOKENIZE_BYTES = 1 << 20


def _batches(texts: pl.Series) -> list[tuple[int, int]]:
    """(first, end) of each batch of `texts` tokenized together: `TOKENIZE_TEXTS` texts or `TOKENIZE_BYTES`."""
    n = len(texts)
    ends = np.cumsum(texts.str.len_bytes().fill_null(0).to_numpy(), dtype=np.int64)
    out, a = [], 0
    while a < n:
        before = int(ends[a - 1]) if a else 0
        b = min(a + TOKENIZE_TEXTS, int(np.searchsorted(ends, before + TOKENIZE_BYTES, side="right")))
        b = max(b, a + 1)
        out.append((a, b))
        a = b
    return out


def encoded(tok, texts: list[str], column: str) -> list[list[int]]:
    """Each text's token ids; a text the tokenizer cannot read (a vocabulary without an unknown token: a character it
    has no token for) is a `DataError` naming the column and quoting the text, not the library's bare error."""
    try:
        return [e.ids for e in tok.encode_batch_fast(texts, add_special_tokens=False)]
    except Exception as e:  # the tokenizers library's own error: which text, said below
        for text in texts:
            try:
                tok.encode(text, add_special_tokens=False)
            except Exception:  # noqa: BLE001 - the first text it cannot read
                raise DataError(
                    f"the tokenizer cannot tokenize {column}'s text {text[:60]!r}{'...' if len(text) > 60 else ''} "
                    f"({' '.join(str(e).split())}): a tokenizer without an unknown token reads only what its "
                    "vocabulary holds; give it one (its model's unk_token, in its vocabulary), or use data.tokenizer: "
                    "{kind: bpe, vocab_size: N} (byte-level: every text reads)"
                ) from None
        raise


def _ids(tok, texts: pl.Series, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
    """(every text's token ids laid end to end, each text's count) of a text column, tokenized a batch at a
    time (`_batches`), each batch's ids stored as `dtype` before the next."""
    flats, counts = [], []
    for a, b in _batches(texts):
        batch = texts[a:b].to_list()
        ids = encoded(tok, batch, texts.name)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        flats.append(np.fromiter(chain.from_iterable(ids), dtype=dtype, count=int(lengths.sum())))
        counts.append(lengths)
        del ids, batch
    if len(flats) == 1:
        return flats[0], counts[0]
    if not flats:
        return np.zeros(0, dtype), np.zeros(0, np.int64)
    return np.concatenate(flats), np.concatenate(counts)


def _rows(piece: tuple[np.ndarray, np.ndarray], a: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows a..b of a tokenized column (its ids end to end, each row's count): a slice, no copy."""
    flat, lengths = piece
    ends = np.cumsum(lengths)
    lo = int(ends[a - 1]) if a else 0
    return flat[lo : int(ends[b - 1]) if b > a else lo], lengths[a:b]


def lay_out(
    pieces: list[tuple[np.ndarray, np.ndarray]],
    n: int,
    row_starts: np.ndarray,
    window: int,
    generation: bool,
    dtype: np.dtype,
    context: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`token_stream` from tokenized columns (`pieces`: per column, its rows' ids end to end and each row's
    count; `n` rows). `context` (a generation target's data, each row its own sequence): a source longer than
    this many tokens (its `<sep>` included) keeps its last `context` only. A window of the data then reaches
    a target: the tokens left out were read by no window with a target in it (`window` + horizon - 1 tokens
    before the first target token are the most any window holding a target reads), so they cost the
    training steps and scored nothing."""
    m = len(pieces)
    lengths = np.stack([p[1] for p in pieces]) if pieces else np.zeros((0, n), np.int64)  # [m, rows]
    row_len = lengths.sum(axis=0) + m  # the columns, m - 1 <sep> between them, and the row's end
    seq_of_row = np.repeat(np.arange(len(row_starts)), np.diff(np.append(row_starts, n)))
    seq_tokens = np.bincount(seq_of_row, weights=row_len, minlength=len(row_starts)).astype(np.int64)
    pad = np.maximum(window + 1 - seq_tokens, 0)
    seq_len = seq_tokens + pad
    offsets = np.concatenate([[0], np.cumsum(seq_len)]).astype(np.int64)
    # where each row starts: its sequence's start plus the rows before it in the sequence
    before = np.cumsum(row_len) - row_len
    row_at = offsets[:-1][seq_of_row] + before - before[row_starts][seq_of_row]
    tokens = np.zeros(int(offsets[-1]), dtype=dtype)  # <pad> where nothing else goes
    targets = np.zeros_like(tokens) if generation else None
    at = row_at.copy()
    for j, (flat, lens) in enumerate(pieces):
        pos = np.repeat(at - (np.cumsum(lens) - lens), lens) + np.arange(len(flat), dtype=np.int64)
        tokens[pos] = flat
        if generation and j == m - 1:
            targets[pos] = flat
        at = at + lens
        if j < m - 1:
            tokens[at] = SEP_ID
            at = at + 1
    last = np.append(row_starts[1:], n) - 1  # each sequence's last row ends with <eos>, the others with <sep>
    tokens[at] = SEP_ID
    tokens[at[last]] = EOS_ID
    if generation:
        targets[at] = tokens[at]
        if context is not None and m > 1:
            tokens, targets, offsets = _trim_sources(tokens, targets, lengths, row_at, seq_of_row, seq_len, context)
        return tokens, targets, offsets
    return tokens, tokens, offsets


def _trim_sources(tokens, targets, lengths, row_at, seq_of_row, seq_len, context: int):
    """`lay_out`'s streams with each one-row sequence's source cut to its last `context` tokens (its columns
    and their <sep>s, the one before the target included): the positions no window with a target reads."""
    source = lengths[:-1].sum(axis=0) + (len(lengths) - 1)  # per row: the source columns and their <sep>s
    one_row = np.bincount(seq_of_row, minlength=len(seq_len)) == 1
    drop = np.where(one_row[seq_of_row], np.maximum(source - context, 0), 0).astype(np.int64)
    if not drop.any():
        return tokens, targets, np.concatenate([[0], np.cumsum(seq_len)]).astype(np.int64)
    keep = np.ones(len(tokens), dtype=bool)
    keep[np.repeat(row_at, drop) + (np.arange(int(drop.sum())) - np.repeat(np.cumsum(drop) - drop, drop))] = False
    # a trimmed row keeps `context` source tokens, its target and its end: never shorter than a window and its next
    seq_drop = np.bincount(seq_of_row, weights=drop, minlength=len(seq_len)).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(seq_len - seq_drop)]).astype(np.int64)
    return tokens[keep], targets[keep], offsets


def encode_text_splits(
    frame: pl.DataFrame, splits: dict[str, SplitRows], data: DataConfig, tokenizer_json: str
) -> dict[str, tuple[memoryview, dict[str, ArraySpec], dict[str, np.ndarray], list[str], dict | None]]:
    """A group's rows and splits (`split_rows`) -> per split, its shard file (buffer, layout, arrays), its
    sequences' keys and, for the training split, the token counts of its targets (the unigram baseline).
    Arrays: `cont` [tokens, 0], `cat` [tokens, 1] token ids, `target` [tokens] (one stored copy, 0 = no
    target), `offsets` and `order_start` (a token's order is its place in its stream). The ids are the
    tokenizer's: the data set's encoding, so a shard holds no own codes."""
    tok = tokenizer(tokenizer_json)
    v = vocab_size(tokenizer_json)
    dtype = token_dtype(v)
    columns = stream_columns(data)
    generation = bool(data.target_list)
    # each column tokenized once for the whole group (in batches of thousands of texts: the tokenizer's threads
    # stay busy, and only one batch's Python objects are held), then each split's rows are a slice of it
    whole = [_ids(tok, frame[c], dtype) for c in columns]
    out = {}
    for name, r in splits.items():
        part = frame.slice(r.first, r.end - r.first)
        starts, keys = r.starts, list(r.keys)
        if data.sequence_key is None:  # every row is a document: its own sequence, keyed by its file and row
            starts = np.arange(part.height, dtype=np.int64)
            keys = part.select(pl.col(SEQ) + "#" + pl.col(ORDER).cast(pl.Utf8)).to_series().to_list()
        pieces = [_rows(p, r.first, r.end) for p in whole]
        # a generation target's documents: the source tokens no window with a target reads are left out
        context = data.window + data.effective_horizon - 1 if generation and data.sequence_key is None else None
        tokens, targets, offsets = lay_out(pieces, part.height, starts, data.window, generation, dtype, context)
        rows, segs = len(tokens), len(offsets) - 1
        buf, specs, arrays = allocate(
            {
                "cont": (np.float32, (rows, 0)),
                "cat": (dtype, (rows, 1)),
                "target": (dtype, (rows,)),
                "offsets": (np.int64, (segs + 1,)),
                "order_start": (np.int64, (segs,)),
            }
        )
        arrays["cat"][:, 0] = tokens
        arrays["target"][...] = targets
        arrays["offsets"][...] = offsets
        arrays["order_start"][...] = 0
        stats = None
        if name in data.split.fit_splits():
            stats = {"rows": r.end - r.first, "token_counts": np.bincount(targets, minlength=v).tolist()}
        out[name] = (buf, specs, arrays, keys, stats)
    return out


def merged_token_counts(parts: list[dict], v: int) -> list[int]:
    """The training split's target token counts over every group (id 0, no target, counted as 0)."""
    total = np.zeros(v, np.int64)
    for p in parts:
        counts = p.get("token_counts")
        if counts:
            total[: len(counts)] += np.asarray(counts, np.int64)
    total[PAD_ID] = 0
    return total.tolist()


def text_spec(data: DataConfig, tokenizer_json: str) -> EncodingSpec:
    """The data set's encoding of text data: no fitted statistics, the tokenizer's vocabulary."""
    v = vocab_size(tokenizer_json)
    name = data.text_target
    return EncodingSpec(
        **configured(data),
        continuous=[],
        boolean=[],
        categorical=[],
        targets=[TargetSpec(column=name, task="classification")],
        text=TextSpec(
            columns=list(data.features.text),
            target_column=data.target_list[0].column if data.target_list else None,
            vocab_size=v,
            tokenizer_sha256=sha256_text(tokenizer_json),
            tokenizer=tokenizer_contract(data),
            on_bad_rows=data.on_bad_rows,
        ),
    )


def decode(tokenizer_json: str, ids: Iterable[int], rows: bool = False) -> str:
    """Token ids back to text (special tokens left out; with `rows`, a `<sep>`, which ends a row of a sequence or a
    text column, as a line break: a continuation that runs on into the next row reads as two lines, not one word)."""
    tok, ids = tokenizer(tokenizer_json), [int(i) for i in ids]
    if not rows or SEP_ID not in ids:
        return tok.decode(ids)
    cuts = [-1, *(j for j, i in enumerate(ids) if i == SEP_ID), len(ids)]
    return "\n".join(tok.decode(ids[a + 1 : b]) for a, b in zip(cuts, cuts[1:]))


def prompt_ids(tokenizer_json: str, texts: list[list[str]], generation: bool) -> list[list[int]]:
    """Serving: each row's prompt as token ids, as training laid it out: its text columns (`texts`, one list
    per column) joined with <sep>, and, when a generation target follows (`generation`), a <sep> after them
    (the model continues with the target's tokens). What a generation step starts from."""
    tok = tokenizer(tokenizer_json)
    cols = [encoded(tok, col, f"text column {j + 1}") for j, col in enumerate(texts)]
    out = []
    for row in zip(*cols):
        ids: list[int] = []
        for j, piece in enumerate(row):
            ids += ([SEP_ID] if j else []) + list(piece)
        out.append(ids + ([SEP_ID] if generation else []))
    return out
