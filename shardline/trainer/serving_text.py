"""A text model's predictions (`serving.Predictor.predict_text`): the rows it predicts, their prompts in sequences,
the generation params it takes, and the frame of its predictions."""

from __future__ import annotations

import math

import numpy as np
import polars as pl

from shardline.core.encoding.columns import DataError
from shardline.core.manifest import EncodingSpec

TEXT_OUTPUTS = {"prompt_tokens": pl.Int64, "next_token": pl.String, "probability": pl.Float32, "generated": pl.String}
# a text model's `predict` params (MLflow's `predict(data, params=...)`, declared in the signature): what
# `generated` is; temperature 0 is greedy, top_k 0 samples among every token
GENERATION_PARAMS = {"max_tokens": 32, "temperature": 0.0, "top_k": 0, "seed": 0}


def text_prediction_frame(keys: dict[str, object], columns: dict[str, object]) -> pl.DataFrame:
    """Text data's predictions, one row per input row: its keys, then `prompt_tokens` (the row's prompt, as
    training laid it out), `next_token` (the most likely next token, as text), its `probability`, and
    `generated` (the text the model writes after the prompt: for a generation target, the row's target)."""
    out = {name: v if isinstance(v, pl.Series) else pl.Series(name, v) for name, v in keys.items()}
    for name, dtype in TEXT_OUTPUTS.items():
        out[name] = pl.Series(name, columns[name], dtype=dtype)
    return pl.DataFrame(out)


def generation_params(params: dict | None) -> dict:
    """GENERATION_PARAMS with `params` over them, checked: a clear error naming the param that cannot work."""
    unknown = sorted(set(params or {}) - set(GENERATION_PARAMS))
    if unknown:
        raise DataError(f"unknown generation param(s) {unknown}: a text model takes {list(GENERATION_PARAMS)}")
    given = {k: v for k, v in (params or {}).items() if v is not None}
    for name, v in given.items():  # a whole number where one is meant: 2.7 tokens, or True, is a mistake
        if isinstance(GENERATION_PARAMS[name], int) and (
            isinstance(v, bool) or (isinstance(v, float) and not v.is_integer())
        ):
            raise DataError(f"generation param {name}={v!r} must be a whole number")
    p = {**GENERATION_PARAMS, **given}
    try:
        p = {k: type(GENERATION_PARAMS[k])(v) for k, v in p.items()}
    except (TypeError, ValueError, OverflowError) as e:
        raise DataError(f"generation params {params}: {e}") from None
    for name, ok, want in (
        ("max_tokens", p["max_tokens"] >= 0, "0 or more"),
        ("temperature", 0 <= p["temperature"] < math.inf, "0 (greedy) or a finite number above it"),
        ("top_k", p["top_k"] >= 0, "0 (every token) or more"),
        ("seed", -(1 << 63) <= p["seed"] < 1 << 64, "a whole number below 2**64 (what torch's generator takes)"),
    ):
        if not ok:
            raise DataError(f"generation param {name}={p[name]} must be {want}")
    return p


def in_streams(rows: list[list[int]], sequences: np.ndarray, k: int) -> tuple[list[list[int]], list[int]]:
    """Text of sequences: each row's prompt as its sequence's stream up to and with that row (the rows before it
    each ended by `<sep>`, as the encoding lays a sequence out), its last `k` tokens (what the model reads); and
    each prompt's whole length. `rows`: each row's own token ids, in the sequences' order (`sequences`: each row's)."""
    from shardline.core.encoding.text import SEP_ID

    prompts, lengths = [], []
    held: list[int] = []
    n = 0
    for i, ids in enumerate(rows):
        if i and sequences[i] == sequences[i - 1]:
            held, n = [*held, SEP_ID, *ids][-k:], n + 1 + len(ids)
        else:
            held, n = list(ids[-k:]), len(ids)
        prompts.append(held)
        lengths.append(n)
    return prompts, lengths


def check_text_types(spec: EncodingSpec, df: pl.DataFrame) -> None:
    """A text column of the input that holds no text (a list, a number) is an error naming it."""
    from shardline.core.encoding.text import reads_as_text

    t = spec.text
    wrong = {c: df.schema[c] for c in t.columns if not reads_as_text(df.schema[c])}
    if wrong:  # said naming the column, not as polars' cast error
        raise DataError(
            ", ".join(f"input column '{c}' is {dtype}, not text" for c, dtype in wrong.items())
            + f"; the model reads strings in its text columns {list(t.columns)}"
        )


def with_text(spec: EncodingSpec, df: pl.DataFrame) -> tuple[pl.DataFrame, np.ndarray | None, str | None]:
    """The rows of `df` with some text in each of the model's text columns, their row numbers in `df` and what is
    to be said of the others (None, None: every row has text). A row with a null or empty text has no prediction,
    as training refused such rows or left them out (`data.on_bad_rows`); in a sequence, a row's prompt is its
    sequence's other rows up to it. No row with text is an error."""
    check_text_types(spec, df)
    columns = spec.text.columns
    empty = df.select(
        [(pl.col(c).cast(pl.Utf8).is_null() | (pl.col(c).cast(pl.Utf8).str.len_bytes() == 0)).alias(c) for c in columns]
    )
    said = {c: np.flatnonzero(empty[c].to_numpy()) for c in columns}
    said = {c: rows for c, rows in said.items() if len(rows)}
    if not said:
        return df, None, None
    what = "; ".join(
        f"column '{c}' has {len(rows)} null or empty text(s) (row(s) {rows[:5].tolist()}"
        f"{', ...' if len(rows) > 5 else ''})"
        for c, rows in said.items()
    )
    bad = empty.select(pl.any_horizontal(columns)).to_series()
    kept = np.flatnonzero(~bad.to_numpy())
    if not len(kept):
        raise DataError(
            f"{what}: give every row some text in each of the model's text columns {list(columns)} (the model "
            "was trained on none)"
        )
    note = (
        f"{what}: those rows have no prediction (the model was trained on none); {len(kept)} of {df.height} predicted"
    )
    return df.filter(~bad), kept, note
