"""Predictions for raw rows: the encoding and the network travel together, so a registered model
takes the same raw parquet columns the pipeline was trained on."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import polars as pl

from shardline.core.config import FILE_SEQUENCE
from shardline.core.config.data import read_names
from shardline.core.encoding.columns import ORDER, SEQ, DataError, prepare, refuse_copies, with_elements
from shardline.core.encoding.frame import encode_frame
from shardline.core.encoding.splits import sequence_runs
from shardline.core.manifest import EncodingSpec
from shardline.trainer.serving_text import (
    check_text_types,
    generation_params,
    in_streams,
    text_prediction_frame,
    with_text,
)

if TYPE_CHECKING:
    from shardline.trainer.contract import DataSpec


def bundle_dict(spec: EncodingSpec, model_spec: dict, extra: dict | None = None) -> dict:
    return {"format": 1, "encoding": spec.model_dump(mode="json"), "model_spec": model_spec, **(extra or {})}


def data_spec(spec: EncodingSpec) -> DataSpec:
    """What a model sees of an encoded data set (the model contract's `spec`)."""
    # imported here: the contract imports torch, which the pipeline's import (a cached rerun) must not pay for
    from shardline.trainer.contract import DataSpec, TargetInfo

    if spec.text is not None:  # one `tokens` column; one target over the vocabulary, at every position
        t = spec.text
        return DataSpec(
            continuous=[],
            boolean=[],
            categorical=["tokens"],
            cardinalities=[t.vocab_size],
            window=spec.window,
            targets=[TargetInfo(t.target_name, "classification", t.vocab_size, "all")],
            text=t.model_dump(include={"vocab_size", "pad_id", "sep_id", "eos_id", "target_column"}),
        )
    return DataSpec(
        continuous=[c.name for c in spec.continuous],
        boolean=list(spec.boolean),
        categorical=[v.name for v in spec.categorical],
        cardinalities=spec.cat_cardinalities,
        window=spec.window,
        targets=[
            TargetInfo(t.column, t.task, t.n_outputs if t.task == "classification" else None, spec.target_positions)
            for t in spec.targets
        ],
    )


def input_columns(spec: EncodingSpec) -> list[str]:
    """Raw columns a prediction needs (the target is not one of them), and the id columns it passes through."""
    cols = read_names([c.name for c in spec.continuous]) + list(spec.boolean) + [v.name for v in spec.categorical]
    cols += list(spec.text.columns) if spec.text is not None else []
    for c in (spec.sequence_key, spec.order_by, *spec.id_columns, *_ranked_by(spec)):
        if c and c != FILE_SEQUENCE and c not in cols:
            cols.append(c)
    return cols


def optional_columns(spec: EncodingSpec) -> list[str]:
    """The id columns (`data.id_columns`) that only pass through to the predictions: an input may lack them (rows
    scored before they have a row id), and its predictions then go without them."""
    needed = input_columns(spec.model_copy(update={"id_columns": []}))
    return [c for c in spec.id_columns if c not in needed]


def _ranked_by(spec: EncodingSpec) -> list[str]:
    """Ranking data: the group and item columns, passed through to each prediction (rows are ranked within
    their group by `ranking_score`)."""
    return [c for c in (spec.group_key, spec.item_key) if c]


def key_columns(spec: EncodingSpec) -> list[str]:
    """Columns that identify a prediction's row in the input: sequence key and order (or `row`); ranking data's
    group and item too."""
    keys = []
    if spec.sequence_key and spec.sequence_key != FILE_SEQUENCE:
        keys.append(spec.sequence_key)
    keys += [c for c in [*spec.id_columns, *_ranked_by(spec)] if c not in keys]
    keys.append(spec.order_by or "row")
    return keys


def file_key(spec: EncodingSpec) -> str | None:
    """Where the file is the sequence (`data.sequence_key` '@file', or none) and a window spans rows: the column
    that names each prediction's file, as the encode names it (its path below the source's folder): `file`, or
    `source_file` where the data has a `file` column. A frame given to `predict` is one file; `shardline predict`
    over several files, and evaluation, say which file each prediction is of. None for any other data."""
    if spec.group_key or spec.sequence_key not in (None, FILE_SEQUENCE):
        return None
    if spec.text is not None and spec.sequence_key is None:  # each row a document of its own
        return None
    return "source_file" if "file" in [*input_columns(spec), *key_columns(spec)] else "file"


_INTEGERS = {"Int8", "Int16", "Int32", "Int64", "UInt8", "UInt16", "UInt32", "UInt64"}
_FLOATS = {"Float32", "Float64"}


def class_labels(t) -> pl.Series:
    """A class target's labels by id, in the raw column's type (id 0, a class never seen in training: null
    for a typed column, `<unseen>` for text)."""
    texts = pl.Series(t.column, t.class_names(), dtype=pl.Utf8)
    if t.dtype in _INTEGERS:
        return texts.cast(getattr(pl, t.dtype), strict=False)
    if t.dtype == "Boolean":
        return pl.Series(t.column, [None, *((c == "true") for c in (t.classes or []))], dtype=pl.Boolean)
    return texts


def decoded(t, values: np.ndarray):
    """A target's encoded values as the user's: class ids as the classes in the target's own type, standardised
    values as the values."""
    if t.task == "classification":
        return class_labels(t)[values.reshape(-1).astype(np.int64)]
    return values.reshape(-1).astype(np.float64) * t.std + t.mean


def decode_outputs(spec: EncodingSpec, outputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Network outputs (`predict`: per target) -> user-facing columns, one row per window, or per window and
    position (window-major) when every position is predicted: `prediction` (the class, in the target's own
    type, or the value) and `probability` (classes) for one target; `<target>` and `<target>_probability`
    for several; `position` (0 is the window's first row) is added by `prediction_frame`."""
    cols: dict[str, np.ndarray] = {}
    # by position: the model's targets are the encoding's, in order (a model saved before the contract
    # names its one target `target`)
    for t, y in zip(spec.targets, outputs.values()):
        name = "prediction" if len(spec.targets) == 1 else t.column
        if t.task == "classification":
            y = y.reshape(-1, y.shape[-1])
            ids = y.argmax(axis=1)
            cols[name] = decoded(t, ids)
            prob = "probability" if len(spec.targets) == 1 else f"{t.column}_probability"
            cols[prob] = y[np.arange(len(ids)), ids].astype(np.float32)
        else:
            cols[name] = decoded(t, y)
    if spec.group_key and spec.targets:  # ranking: the score rows are ranked by in their group, as evaluation's
        from shardline.core.encoding.row_keys import class_grades

        t, y = spec.targets[0], next(iter(outputs.values()))
        first = "prediction" if len(spec.targets) == 1 else t.column
        grades = class_grades(t) if t.task == "classification" else None
        y = y.reshape(-1, y.shape[-1]).astype(np.float64) @ grades if grades is not None else cols[first]
        cols["ranking_score"] = np.asarray(y, dtype=np.float64)  # the expected grade (0/1: the click probability)
    return cols


def decode_truth(spec: EncodingSpec, targets: list) -> dict[str, object]:
    """The test rows' own targets beside their predictions, decoded as `decode_outputs` decodes a prediction (a
    class in the target's own type, or the value): `truth` for one target, `<target>_truth` for several. `targets`:
    a batch's (encoded) targets, one array per target, in the predictions' row order."""
    cols: dict[str, object] = {}
    for t, y in zip(spec.targets, targets):
        name = "truth" if len(spec.targets) == 1 else f"{t.column}_truth"
        cols[name] = decoded(t, np.asarray(y))
    return cols


def example_outputs(spec: EncodingSpec) -> dict[str, np.ndarray]:
    """What `predict` returns for one window (zeros, class 1 most likely): to show the predictions' columns
    and types (the registered model's signature) without a model."""
    out = {}
    lead = (1, spec.window) if spec.target_positions == "all" else (1,)
    for t in spec.targets:
        if t.task == "classification":
            y = np.zeros((*lead, t.n_outputs), np.float32)
            y[..., min(1, t.n_outputs - 1)] = 1.0
        else:
            y = np.zeros(lead if spec.target_positions == "all" else (1, 1), np.float32)
        out[t.column] = y
    return out


def prediction_frame(
    spec: EncodingSpec,
    keys: dict[str, object],
    outputs: dict[str, np.ndarray],
    per_position: bool = False,
    decoded: bool = False,
) -> pl.DataFrame:
    """Key columns beside the decoded predictions (`outputs` as `predict` gives them, or `decoded`: as
    `decode_outputs` does). When every position is predicted, one row per window and position, with `position`:
    the keys are each position's own row's (`per_position`: given so, window-major), or else each window's,
    repeated for its K positions."""
    every = spec.target_positions == "all" and spec.targets
    k = spec.window if every else 1
    out: dict[str, object] = {}
    for name, values in keys.items():
        series = values if isinstance(values, pl.Series) else pl.Series(name, values)
        out[name] = series.gather(np.repeat(np.arange(len(series)), k)) if k > 1 and not per_position else series
    if every:
        n = len(next(iter(keys.values()))) if keys else 0
        out["position"] = np.tile(np.arange(k, dtype=np.int64), n // k if per_position else n)
    out.update(outputs if decoded else decode_outputs(spec, outputs))
    return pl.DataFrame(out)


def _conformed(df: pl.DataFrame, types: dict[str, str]) -> pl.DataFrame:
    """The input's number columns in the types the model was trained on (`types`: polars' names, from the
    bundle): a wider float as float32 where training read float32 (a category's values then match as trained),
    floats holding whole numbers as integers where training read integers (pandas writes an integer column with
    a null as float64), integers as floats where it read floats. Anything else that is not a number where the
    model read numbers is said, naming the column."""
    casts, wrong = [], []
    for c, trained in types.items():
        if c not in df.columns:
            continue
        dtype = df.schema[c]
        floats, integers = trained in _FLOATS, trained in _INTEGERS
        if not (floats or integers) or dtype == getattr(pl, trained):
            continue
        if dtype == pl.Null:  # a column of nulls only: missing values of the trained type
            casts.append(pl.col(c).cast(getattr(pl, trained)))
        elif not dtype.is_numeric():
            wrong.append(f"'{c}' is {dtype}, trained as {trained}")
        elif floats:
            casts.append(pl.col(c).cast(getattr(pl, trained)))
        elif dtype.is_float():
            values = df[c].drop_nulls().drop_nans()
            fraction = values.filter(~values.is_finite() | (values != values.round()))
            if fraction.len():
                wrong.append(f"'{c}' holds {fraction[0]}, trained as whole numbers ({trained})")
            else:
                casts.append(pl.col(c).fill_nan(None).cast(pl.Int64))
    if wrong:
        raise DataError(f"input column {'; '.join(wrong)}: give numbers there, as in the rows the model was trained on")
    return df.with_columns(casts) if casts else df


@contextlib.contextmanager
def _own_code(model_spec: dict, code: Path):
    """While a registered model is built: its entrypoint's package imported from its own `code` folder (first on
    `sys.path`, another copy of that package forgotten), not from one an earlier model loaded: two versions of
    a model in one process (a champion and a challenger compared in a notebook) each run their own code."""
    import sys

    from shardline.trainer.contract import _forget_other_copy

    entrypoint = (model_spec.get("model") or {}).get("entrypoint")
    if not entrypoint or not code.is_dir():
        yield
        return
    _forget_other_copy(entrypoint.split(":")[0].split(".")[0], str(code))
    sys.path.insert(0, str(code))
    try:
        yield
    finally:
        sys.path.remove(str(code))
        if str(code) not in sys.path:
            sys.path.append(str(code))  # where MLflow put it (last: `model_files.code_paths_last`)


class Predictor:
    def __init__(
        self, spec: EncodingSpec, model, tokenizer: str | None = None, input_types: dict[str, str] | None = None
    ):
        self.spec = spec
        self.model = model
        self.tokenizer = tokenizer  # text data: the tokenizer.json text the model was trained with
        # each input column's polars type in training (models registered before this was kept: None)
        self.input_types = input_types

    @classmethod
    def from_files(
        cls, bundle_path: str | Path, weights_path: str | Path, tokenizer_path: str | Path | None = None
    ) -> Predictor:
        import torch

        from shardline.trainer.models import model_from_spec

        bundle = json.loads(Path(bundle_path).read_text())
        spec = EncodingSpec.model_validate(bundle["encoding"])
        # the user's code travels with the model (MLflow's code folder beside its artifacts): its own, also where
        # another model of a module of the same name (another version) was loaded in this process before
        with _own_code(bundle["model_spec"], Path(bundle_path).resolve().parent.parent / "code"):
            model = model_from_spec(bundle["model_spec"], code_dir=None)
        model.load_state_dict(torch.load(weights_path, map_location="cpu", weights_only=True))
        model.eval()
        tokenizer = None
        if spec.text is not None:
            if tokenizer_path is None:
                raise DataError("this text model's bundle has no tokenizer (register it again with this Shardline)")
            tokenizer = Path(tokenizer_path).read_bytes().decode()  # no newline translation: its sha256 is the file's
            got = hashlib.sha256(tokenizer.encode()).hexdigest()
            if got != spec.text.tokenizer_sha256:
                raise DataError(
                    f"the bundled tokenizer {tokenizer_path} has sha256 {got[:12]}, the model was trained with "
                    f"{spec.text.tokenizer_sha256[:12]}; register the model again"
                )
        return cls(spec, model, tokenizer, bundle.get("input_types"))

    def prompts(self, df: pl.DataFrame) -> list[list[int]]:
        """Text data: each row's prompt as token ids (its text columns joined with <sep>, then a <sep> when the
        model writes a generation target after them), tokenized with the bundled tokenizer."""
        from shardline.core.encoding.text import prompt_ids

        t = self.spec.text
        check_text_types(self.spec, df)
        texts = [df[c].cast(pl.Utf8).fill_null("").to_list() for c in t.columns]
        empty = {c: [i for i, v in enumerate(col) if not v] for c, col in zip(t.columns, texts)}
        if any(empty.values()):  # training refused such rows (data.on_bad_rows): a prompt of nothing is no input
            raise DataError(
                "; ".join(
                    f"column '{c}' has {len(rows)} null or empty text(s) (row(s) {rows[:5]}"
                    f"{', ...' if len(rows) > 5 else ''})"
                    for c, rows in empty.items()
                    if rows
                )
                + ": give every row some text in each of the model's text columns "
                + f"{list(t.columns)} (the model was trained on none)"
            )
        return prompt_ids(self.tokenizer, texts, generation=t.target_column is not None)

    def _forecast(self, prepared: pl.DataFrame, data, where: dict, seq_col: str | None, batch_size: int):
        """`predict_frame(forecast=True)`'s: each window (one a sequence, `with_rows_to_come`) keyed by its last
        input row, `horizon` rows before the one it predicts (every position predicted: the last position's)."""
        spec = self.spec
        columns = self._decoded(data, batch_size, last=spec.target_positions == "all")
        last = pl.Series(where["row"] - spec.horizon)
        keys = row_keys(prepared, last, spec, seq_col)
        keys["horizon"] = pl.Series("horizon", np.full(len(last), spec.horizon, np.int64))
        return prediction_frame(spec.model_copy(update={"target_positions": "last"}), keys, columns, decoded=True)

    def _decoded(self, data, batch_size: int, last: bool = False) -> dict[str, np.ndarray]:
        """Each window's prediction columns (`decode_outputs`), decoded a batch at a time: one batch's class
        probabilities are held, never every window's ([windows, classes] float32: 6.4 GB for 4M windows of 400
        classes). `last`: of a model that predicts every position, the last position's only."""
        from shardline.trainer.inference import predict, predict_batches

        batches = (out for _, _, out in predict_batches(self.model, data, batch_size))
        parts = [
            decode_outputs(self.spec, {k: v[:, -1] for k, v in out.items()} if last else out)
            for out in (batches if data.n_windows else [predict(self.model, data)])  # none: the empty columns
        ]
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    def predict_text(self, df: pl.DataFrame, batch_size: int = 256, params: dict | None = None) -> pl.DataFrame:
        """Text data: per row, its prompt's next token (greedy) and probability, from the prompt's last window
        (the model reads up to data.window tokens), and the text generated after the prompt (`generate`, with
        the key/value cache; `params`: GENERATION_PARAMS' keys; a generation target's text ends at its
        `<sep>` or `<eos>`)."""
        import torch

        from shardline.core.encoding.text import EOS_ID, SEP_ID, decode
        from shardline.trainer.generate import continuations

        gen = generation_params(params)

        k = self.spec.window
        df, kept, note = with_text(self.spec, df)  # a row without text: no prediction (the note says which)
        if note:
            logging.getLogger(PREDICT_LOG).warning("predict: %s", note)
        if self.spec.sequence_key is not None:  # a row's prompt: its sequence's rows up to it, as training read them
            df, seq_col = self._in_sequences(df)
            ids, lengths = in_streams(self.prompts(df), df[SEQ].to_numpy(), k)
            keys = row_keys(df, pl.Series(np.arange(df.height)), self.spec, seq_col)
        else:
            ids = self.prompts(df)
            lengths = [len(p) for p in ids]
            keys = {c: df[c] for c in self.spec.id_columns if c in df.columns} or {
                "row": np.arange(df.height) if kept is None else kept
            }
            if INPUT_ROW in df.columns:  # the pyfunc model's (`row_keys`): each row in the input's order
                keys[INPUT_ROW] = df[INPUT_ROW]
        window = np.zeros((len(ids), k), np.int64)  # right-padded with <pad>: a causal model never sees it
        last = np.zeros(len(ids), np.int64)
        for i, p in enumerate(ids):
            p = p[-k:]
            window[i, : len(p)] = p
            last[i] = max(len(p) - 1, 0)
        name = self.spec.text.target_name
        best, prob = np.zeros(len(ids), np.int64), np.zeros(len(ids), np.float32)
        with torch.inference_mode():
            for lo in range(0, len(ids), batch_size):
                cat = torch.from_numpy(window[lo : lo + batch_size, :, None])
                out = self.model(torch.zeros((*cat.shape[:2], 0)), cat)[name].float()
                out = out[torch.arange(len(cat)), torch.from_numpy(last[lo : lo + batch_size])]
                out[:, self.spec.text.pad_id] = float("-inf")
                p = torch.softmax(out, dim=-1)
                best[lo : lo + len(cat)] = p.argmax(dim=-1).numpy()
                prob[lo : lo + len(cat)] = p.max(dim=-1).values.numpy()
        generated = continuations(
            self.model,
            self.tokenizer,
            ids,
            gen["max_tokens"],
            gen["temperature"],
            gen["top_k"] or None,
            gen["seed"],
            stop_at_sep=self.spec.text.target_column is not None,
        )
        # the end of a row or of the text said as such: decoded, a special token is no text at all
        named = {SEP_ID: "<sep>", EOS_ID: "<eos>"}
        columns = {"prompt_tokens": lengths, "next_token": [named.get(b) or decode(self.tokenizer, [b]) for b in best]}
        return text_prediction_frame(keys, {**columns, "probability": prob, "generated": generated})

    def stream_text(self, df: pl.DataFrame, params: dict | None = None) -> Iterator[str]:
        """Text data: the text generated after the first row's prompt, in pieces as its tokens are drawn (the
        same text as `predict_text`'s `generated`, for `shardline generate` to print as it goes). A piece is
        given once the text so far reads whole (a character of several bytes may take several tokens); a
        tokenizer whose decoder may rewrite earlier text (not byte-level) gives it in one piece at the end."""
        from shardline.core.encoding.text import EOS_ID, SEP_ID, decode, tokenizer
        from shardline.trainer.generate import cut_whole, generate_stream

        gen = generation_params(params)
        ids = self.prompts(df.head(1))[0]
        stops = (SEP_ID,) if self.spec.text.target_column is not None else ()
        stream = generate_stream(
            self.model, ids or [SEP_ID], gen["max_tokens"], gen["temperature"], gen["top_k"] or None, gen["seed"],
            eos_id=EOS_ID, stop_ids=stops,
        )  # fmt: skip
        as_it_goes = type(tokenizer(self.tokenizer).decoder).__name__ == "ByteLevel"
        new, shown = [], ""
        for token in stream:
            new.append(token)
            text = decode(self.tokenizer, new, rows=True) if as_it_goes else ""
            if text.startswith(shown) and not text.endswith("\ufffd") and len(text) > len(shown):
                yield text[len(shown) :]
                shown = text
        text = cut_whole(decode(self.tokenizer, new, rows=True), len(new) >= gen["max_tokens"])
        if text != shown and text.startswith(shown):  # the rest: a last character's bytes, or the whole text
            yield text[len(shown) :]

    def _in_sequences(self, df: pl.DataFrame) -> tuple[pl.DataFrame, str | None]:
        """The rows as the encoding lays them out: by sequence (the sequence key; where the file is the sequence,
        the column naming each row's file, `file_key`: rows of several files, as `shardline predict` reads them; else
        the rows are one file), each in its order; and the sequence's column (None: one file)."""
        spec = self.spec
        by_file = file_key(spec)
        seq_col = spec.sequence_key if spec.sequence_key not in (None, FILE_SEQUENCE) else None
        seq_col = seq_col or (by_file if by_file in df.columns else None)
        prepared = prepare(df, seq_col or spec.sequence_key, spec.order_by, "input", spec.order_format)
        if seq_col and seq_col == by_file and spec.order_by is None:  # a row's number in its own file
            prepared = prepared.with_columns(pl.int_range(0, pl.len(), dtype=pl.Int64).over(SEQ).alias(ORDER))
        if sequence_runs(prepared) is None:  # the rows as the encoding lays them out (a sort copies every column:
            prepared = prepared.sort([SEQ, ORDER], maintain_order=True)  # rows already so are kept as they are)
        if spec.order_by is not None:  # a file given twice: two predictions a row, the copies in every window
            refuse_copies(prepared, seq_col or spec.sequence_key, spec.order_by, "the input")
        return prepared, seq_col

    def predict_frame(
        self, df: pl.DataFrame, batch_size: int = 4096, params: dict | None = None, forecast: bool = False
    ) -> pl.DataFrame:
        """One prediction per window the rows contain (each row with K rows of history in its sequence); text
        data: one per row (`predict_text`). `forecast`: instead, one per sequence, for the row `data.horizon`
        rows after its last one (which the input cannot hold yet): keyed by that last row, with `horizon`."""
        from shardline.trainer.data import SplitData
        from shardline.trainer.inference import position_rows

        spec = self.spec
        optional = optional_columns(spec)
        missing = [c for c in input_columns(spec) if c not in df.columns and c not in optional]
        if missing:
            raise DataError(
                f"the input lacks column(s) {missing} that the model was trained on; add them (the model's "
                "signature lists every input column)"
            )
        if self.input_types:
            df = _conformed(df, self.input_types)
        df = with_elements(df, [c.name for c in spec.continuous])  # `vec[3]`: element 3 of the list column `vec`
        if spec.text is not None:
            if forecast:
                raise DataError(
                    "--forecast: a text model predicts each row's next token and has no rows to come; "
                    "`shardline generate` writes on from a text"
                )
            return self.predict_text(df, params=params)
        if forecast and not rows_to_come(spec):
            what = (
                "ranking data (data.group_key) scores the rows it is given"
                if spec.group_key
                else "a model without a target predicts nothing"
                if not spec.targets
                else "with data.horizon 0 (rows without data.sequence_key have it) a window predicts its own rows, "
                "none to come"
            )
            raise DataError(f"--forecast: {what}; predict without it")
        # the sequence key; where the file is the sequence, the column naming each row's file (`file_key`: rows of
        # several files, as `shardline predict` reads them), else the rows are one file
        prepared, seq_col = self._in_sequences(df)
        if forecast:
            prepared = with_rows_to_come(prepared, spec)
        arrays, _ = encode_frame(prepared, spec, with_target=False, presorted=True)
        data = SplitData([arrays], spec.window, spec.horizon, positions=spec.target_positions)
        where = data.window_keys()
        for note in input_notes(prepared, arrays, spec, seq_col, forecast):
            logging.getLogger(PREDICT_LOG).warning("predict: %s", note)
        if not data.n_windows and df.height:
            k = spec.window + spec.horizon
            need = (
                f"{spec.window} rows (data.window)"
                if forecast
                else (f"{k} rows (data.window={spec.window} rows of history + data.horizon={spec.horizon})")
            )
            ahead = (
                ""
                if forecast or not rows_to_come(spec)
                else f"; or, to predict the row {spec.horizon} after each sequence's last from its last "
                f"{spec.window} rows, pass --forecast"
            )
            raise DataError(
                f"0 predictions: every sequence in the input has fewer than {need}; pass the history too (several "
                f"files, or a glob or a folder of them, to `shardline predict`){ahead}"
            )
        # each prediction keyed by the row it is for (every position predicted: each position's own row), in the
        # input's own types (a join needs no cast)
        every = spec.target_positions == "all" and bool(spec.targets)
        if forecast:
            return self._forecast(prepared, data, where, seq_col, batch_size)
        rows = pl.Series(position_rows(where["row"], spec.window) if every else where["row"])
        out = row_keys(prepared, rows, spec, seq_col)
        return prediction_frame(spec, out, self._decoded(data, batch_size), per_position=every, decoded=True)


# a column the MLflow model adds to its input: each row's place in the caller's frame, carried to the predictions of
# that row, which then take the frame's index labels (`shardline/runs/pyfunc_model.py`)
INPUT_ROW = "__input_row"


def row_keys(prepared: pl.DataFrame, rows: pl.Series, spec: EncodingSpec, seq_col: str | None) -> dict[str, object]:
    """The key columns of the input `rows` (of `prepared`), in the input's own types (a join needs no cast): the
    sequence key, the id columns, ranking data's group and item, and the order (else the row number, `row`)."""
    out: dict[str, object] = {}
    for c in (seq_col, *spec.id_columns, *_ranked_by(spec)):
        if c and c not in out and c in prepared.columns:  # an id column the input lacks: none (`optional_columns`)
            out[c] = prepared[c].gather(rows)
    if INPUT_ROW in prepared.columns:  # the pyfunc model's: each prediction's input row, for the frame's index
        out[INPUT_ROW] = prepared[INPUT_ROW].gather(rows)
    out[spec.order_by or "row"] = prepared[spec.order_by or ORDER].gather(rows).alias(spec.order_by or "row")
    return out


TO_COME = "__to_come"  # a row `forecast` adds after a sequence's last one: only a target, never an input


def with_rows_to_come(prepared: pl.DataFrame, spec: EncodingSpec) -> pl.DataFrame:
    """Each sequence of `prepared` (sorted) as its last `data.window` rows and `data.horizon` rows after them,
    copies of its last row marked `TO_COME`: its one window is the one that ends on its last row, whose target row
    is the one it forecasts."""
    real = prepared.with_columns(pl.lit(False).alias(TO_COME)).group_by(SEQ, maintain_order=True).tail(spec.window)
    last = real.group_by(SEQ, maintain_order=True).last().with_columns(pl.lit(True).alias(TO_COME))
    ahead = [last.with_columns(pl.col(ORDER) + step) for step in range(1, spec.horizon + 1)]
    return pl.concat([real, *ahead], how="vertical_relaxed").sort([SEQ, ORDER], maintain_order=True)


PREDICT_LOG = "shardline.predict"  # what `predict` says of its input rows: a warning per note


class _Kept(logging.Handler):
    def __init__(self, notes: list[str]):
        super().__init__(logging.WARNING)
        self.notes = notes

    def emit(self, record: logging.LogRecord) -> None:
        self.notes.append(record.getMessage().removeprefix("predict: "))


@contextlib.contextmanager
def kept_notes() -> Iterator[list[str]]:
    """Within: what `predict` notes of its input rows is kept in the list it yields instead of warned, for a caller
    that predicts rows of its own and says what matters of them itself (the champion gate re-scoring a champion on
    new data, a rehearsal, MLflow's check of the input example while a model is logged)."""
    log, notes = logging.getLogger(PREDICT_LOG), []
    kept, propagate = _Kept(notes), log.propagate
    log.addHandler(kept)
    log.propagate = False
    try:
        yield notes
    finally:
        log.removeHandler(kept)
        log.propagate = propagate


TIED = 0.5  # the share of a file's rows that tie on the order column, above which it is said (a few ties are data's)


def rows_to_come(spec) -> bool:
    """Whether a row comes after the input for `--forecast` to predict: not for ranking data (it scores the rows it is
    given), a model without a target, or `data.horizon` 0 (a window predicts its own rows)."""
    return not spec.group_key and bool(spec.horizon) and bool(spec.targets)


def input_notes(
    prepared: pl.DataFrame, arrays: dict, spec: EncodingSpec, seq_col: str | None, forecast: bool = False
) -> list[str]:
    """What of the input rows no prediction, or no prediction as trained, is made of: the sequences too short for
    one window (no prediction), the categories training never saw (read as unknown, as a null is)."""
    notes = []
    k = spec.window + spec.horizon
    lengths = np.diff(arrays["offsets"])  # a forecast's: its rows to come counted (k of them make one window)
    if seq_col and prepared.height and (lengths < k).any() and (lengths >= k).any():  # all short: an error, above
        short = np.flatnonzero(lengths < k)
        starts = pl.Series(arrays["offsets"][short])
        names = prepared[seq_col].gather(starts).cast(pl.String).to_list()
        shown = ", ".join(repr(n) for n in names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        need = (
            f"{spec.window} rows (data.window)"
            if forecast
            else (f"{k} rows (data.window={spec.window} + data.horizon={spec.horizon})")
        )
        notes.append(
            f"{len(names)} sequence(s) have fewer than {need} and get no prediction: {shown}; pass their history too"
        )
    real = ~prepared[TO_COME].to_numpy() if TO_COME in prepared.columns else True  # not a forecast's copies
    if spec.order_by and spec.sequence_key in (None, FILE_SEQUENCE) and prepared.height and not forecast:
        # where the file is the sequence, a file whose rows mostly share their order values holds several sequences
        # (a file of 40 games: frame 0 forty times): its windows mix them, with nothing else to say so
        tied = float(prepared.select(pl.struct(SEQ, ORDER).is_duplicated().mean()).item())
        if tied > TIED:
            notes.append(
                f"{tied:.0%} of the rows share their '{spec.order_by}' value with another row of their file: does a "
                "file hold several sequences? The model reads each file as one sequence (data.sequence_key: "
                "'@file'), so its windows mix them; give each sequence its own file, or train with "
                "data.sequence_key naming the column that tells them apart"
            )
    for j, v in enumerate(spec.categorical):
        unseen = (arrays["cat"][:, j] == 0) & prepared[v.name].is_not_null().to_numpy() & real
        if unseen.any():
            values = prepared[v.name].filter(pl.Series(unseen))
            notes.append(
                f"column '{v.name}' holds {values.n_unique()} value(s) training never saw, in {len(values)} row(s) "
                f"(the first value: {values[0]!r}): read as unknown, as a null is (a fine-tune knows its parent's "
                "values)"
            )
    return notes


def naive_utc(frame):
    """A pandas frame with its time-zone-aware date-time columns as naive UTC, the only date-times MLflow's
    signatures take (`shardline predict` turns them back into the input's zone in the predictions)."""
    import pandas as pd

    out = frame.copy()
    for c in out.columns:
        if isinstance(out[c].dtype, pd.DatetimeTZDtype):
            out[c] = out[c].dt.tz_convert("UTC").dt.tz_localize(None)
    return out


def dictionaries_as_values(table):
    """A pyarrow table with its dictionary columns as their values' type (a category as its text), as every
    other raw read has them (MLflow's signatures take text, not a category)."""
    import pyarrow as pa

    plain = [c.cast(c.type.value_type) if pa.types.is_dictionary(c.type) else c for c in table.columns]
    return pa.table(plain, names=table.column_names)
