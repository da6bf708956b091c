"""Fine-tuning encodes new data the way the model it starts from was trained: the parent's encoding
(its scalings and vocabularies) is the data set's, so a value means to the fine-tuned model what it
meant to its parent. The shards are the same either way (each group stores its own codes; readers map
them to the data set's encoding), so reusing an encoding re-encodes nothing: only the manifest differs.

The fine-tune's feature columns must be the parent's, role by role and in the same order (a model
meets its columns by position in the `cont` and `cat` tensors); a new column, a missing one or one
whose role changed is an error naming it. Targets may differ (a fine-tune often predicts something its
parent did not): a target the parent also had, with the same task, keeps the parent's classes or
scaling; any other is fitted on the new data."""

from __future__ import annotations

from shardline.core.manifest import EncodingSpec


class EncodingMismatch(ValueError):
    """The fine-tune's columns do not fit the parent's encoding; the message names the column."""


def _roles(spec: EncodingSpec) -> dict[str, list[str]]:
    return {
        "continuous": [c.name for c in spec.continuous],
        "boolean": list(spec.boolean),
        "categorical": [v.name for v in spec.categorical],
        "text": list(spec.text.columns) if spec.text is not None else [],
    }


def check_columns(mine: dict[str, list[str]], parent: EncodingSpec, source: str) -> None:
    """Every feature column (`mine`: role -> columns, as data.features lists them) in the parent's role
    and order; the error names the column and the fix. The pipeline checks it before any work."""
    text = list(mine.get("text") or [])
    if (parent.text is not None) != bool(text):
        raise EncodingMismatch(
            f"{source} is {'a text model' if parent.text is not None else 'not a text model'} and this data "
            f"{'is' if text else 'is not'} text (data.features.text): a fine-tune reads its data as its parent did; "
            "start from a model of the same kind, or train without training.init_from"
        )
    if text:  # text columns are one token stream, whatever their names: the tokenizer is what must match
        return
    theirs = _roles(parent)
    where = {c: role for role, cols in theirs.items() for c in cols}
    for role, cols in mine.items():
        for c in cols:
            if c not in where:
                raise EncodingMismatch(
                    f"data.features.{role} has '{c}', which the model it starts from ({source}) was not trained "
                    f"on; a fine-tune encodes data with its parent's encoding: drop '{c}', or train without "
                    "training.init_from"
                )
            if where[c] != role:
                raise EncodingMismatch(
                    f"column '{c}' is {role} here but {where[c]} in the encoding of {source}: declare it under "
                    f"data.features.{where[c]}, as the parent had it"
                )
        if cols != theirs.get(role, []):  # a role the parent has no column of (text) is empty here too
            missing = [c for c in theirs.get(role, []) if c not in cols]
            raise EncodingMismatch(
                f"data.features.{role} is {cols}, the encoding of {source} has {theirs.get(role, [])}"
                + (f" (missing: {missing})" if missing else " (another order)")
                + f": list the parent's {role} columns, in its order (the model meets its columns by position)"
            )


def check_parent_tokenizer(fitted: EncodingSpec, parent: EncodingSpec, source: str) -> None:
    """The data's tokenizer (`fitted.text`, by its sha256) must be the parent's: a token id means a word only
    by its tokenizer, and another one would feed the parent's embeddings other words (silently, when both
    vocabularies have the same size). Text data for a tabular parent, or the reverse, is refused too."""
    mine, its = fitted.text, parent.text
    if (mine is None) != (its is None) or (mine and mine.tokenizer_sha256 != its.tokenizer_sha256):
        raise EncodingMismatch(
            f"the data's tokenizer ({mine.tokenizer_sha256[:12] if mine else 'none: not text data'}) is not the one "
            f"{source} was trained with ({its.tokenizer_sha256[:12] if its else 'none: not a text model'}); a "
            "fine-tune of a text model reads its parent's token ids: drop data.tokenizer (the pipeline then "
            "tokenizes with the parent's), or set it to the parent's file (the registered model's "
            "artifacts/tokenizer.json)"
        )


def reuse_encoding(fitted: EncodingSpec, parent: EncodingSpec, source: str) -> EncodingSpec:
    """`fitted` (the new data's own encoding) with the parent's scalings and vocabularies in place of its
    own, after `check_columns`."""
    check_columns(_roles(fitted), parent, source)
    check_parent_tokenizer(fitted, parent, source)
    theirs = {t.column: t for t in parent.targets}
    targets = [
        theirs[t.column] if t.column in theirs and theirs[t.column].task == t.task else t for t in fitted.targets
    ]
    return fitted.model_copy(
        update={"continuous": list(parent.continuous), "categorical": list(parent.categorical), "targets": targets}
    )
