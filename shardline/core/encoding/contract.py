"""The encoding contract: what the config decides about the encoding (columns, window, horizon, targets
and their positions, stored type), its hash (written in the manifest), and what differs between the
config's and a manifest's. Training refuses shards whose contract is not the config's
(shardline/runs/training_run.py)."""

from __future__ import annotations

from typing import Any

from shardline.core.config import DataConfig
from shardline.core.encoding.fit import SCALARS, scalars
from shardline.core.encoding.text import tokenizer_contract
from shardline.core.manifest import EncodingSpec


def contract(data: DataConfig) -> dict[str, Any]:
    """What the config decides about the encoding (the fitted statistics come from the data); text data
    adds its columns and tokenizer (the user's file by its sha256: another file is another encoding)."""
    text = (
        {"text": list(data.features.text), "tokenizer": tokenizer_contract(data), "on_bad_rows": data.on_bad_rows}
        if data.features.text
        else {}
    )
    return text | {
        **scalars(data),
        "continuous": list(data.features.continuous),
        "boolean": list(data.features.boolean),
        "categorical": list(data.features.categorical),
        "targets": [{"column": t.column, "task": t.task} for t in data.target_list],
    }


def contract_of(spec: EncodingSpec) -> dict[str, Any]:
    text = (
        {"text": list(spec.text.columns), "tokenizer": dict(spec.text.tokenizer), "on_bad_rows": spec.text.on_bad_rows}
        if spec.text
        else {}
    )
    return text | {
        **{k: getattr(spec, k) for k in SCALARS},
        "continuous": [c.name for c in spec.continuous],
        "boolean": list(spec.boolean),
        "categorical": [v.name for v in spec.categorical],
        "targets": [{"column": t.column, "task": t.task} for t in spec.targets]
        if spec.text is None
        else ([{"column": spec.text.target_column, "task": "generation"}] if spec.text.target_column else []),
    }


def contract_differences(expected: dict, found: dict) -> list[str]:
    """Human-readable list of what differs between the config's contract and a manifest's."""
    return [
        f"data.{key}: the shards were encoded with {found.get(key)!r}, the config says {expected.get(key)!r}"
        for key in sorted(set(expected) | set(found))
        if expected.get(key) != found.get(key)
    ]
