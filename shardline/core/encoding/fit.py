"""The data set's encoding, fitted from every file group's training statistics (the training split
only): merged moments for the continuous columns and a regression target, merged counts for the
vocabularies (most frequent first, ties by value)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from typing import Any

from shardline.core.config import DataConfig
from shardline.core.manifest import ContinuousStat, EncodingSpec, TargetSpec, Vocabulary, unpack_ints


def moments(n: int, mean: float, m2: float) -> dict[str, float]:
    return {"n": int(n), "mean": float(mean), "m2": float(m2)}


def _merge_moments(parts: list[dict[str, float]]) -> tuple[int, float, float]:
    """(n, mean, M2) of the union of parts (Chan et al.: no sum of squares to cancel)."""
    n = sum(p["n"] for p in parts)
    if n == 0:
        return 0, 0.0, 0.0
    mean = sum(p["n"] * p["mean"] for p in parts) / n
    m2 = sum(p["m2"] + p["n"] * (p["mean"] - mean) ** 2 for p in parts)
    return n, mean, m2


def empty_stats(data: DataConfig) -> dict[str, Any]:
    """The training statistics of a group with no training row."""
    return {
        "rows": 0,
        "continuous": {c: moments(0, 0.0, 0.0) for c in data.features.continuous},
        "categorical": {c: {} for c in data.features.categorical},
        "targets": [{"counts": {}} if t.task == "classification" else moments(0, 0.0, 0.0) for t in data.target_list],
    }


def packed(part: dict) -> bool:
    """Whether a group's value counts are integers packed (`group._counts_of`), not {value as text: count}."""
    return isinstance(part.get("ints"), str) and isinstance(part.get("counts"), str)


def merged_counts(parts: Iterable[dict]) -> Counter:
    """Value counts added up over parts, {value as text: count} (a value counted 0 is kept, as `Counter.update`
    keeps it); packed parts are added up as arrays first."""
    import numpy as np

    counts: Counter = Counter()
    values, held = [], []
    for p in parts:
        if packed(p):
            values.append(unpack_ints(p["ints"]))
            held.append(unpack_ints(p["counts"], deltas=False))
        else:
            counts.update(p)
    if values:
        distinct, at = np.unique(np.concatenate(values), return_inverse=True)
        sums = np.bincount(at, weights=np.concatenate(held), minlength=len(distinct)).astype(np.int64)
        counts.update(dict(zip(map(str, distinct.tolist()), sums.tolist(), strict=True)))
    return counts


def _vocab(counts: Counter) -> list[str]:
    return [v for v, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]


def _mean_std(parts: list[dict[str, float]]) -> tuple[float, float]:
    n, mean, m2 = _merge_moments(parts)
    if n == 0:
        return 0.0, 1.0
    std = max(m2 / n, 0.0) ** 0.5
    return mean, (std if std > 1e-12 else 1.0)


def fit_spec(partials: list[dict[str, Any]], data: DataConfig) -> EncodingSpec:
    """The data set's encoding from every group's training statistics (`encode_splits`' `stats`)."""
    cont = []
    for c in data.features.continuous:
        mean, std = _mean_std([p["continuous"][c] for p in partials])
        cont.append(ContinuousStat(name=c, mean=mean, std=std))
    cats = []
    for c in data.features.categorical:
        cats.append(Vocabulary(name=c, values=_vocab(merged_counts(p["categorical"][c] for p in partials))))
    targets = []
    for i, t in enumerate(data.target_list):
        if t.task == "classification":
            classes = _vocab(merged_counts(p["targets"][i]["counts"] for p in partials))
            targets.append(TargetSpec(column=t.column, task=t.task, classes=classes))
        else:
            mean, std = _mean_std([p["targets"][i] for p in partials])
            targets.append(TargetSpec(column=t.column, task=t.task, mean=mean, std=std))
    return EncodingSpec(
        **configured(data), continuous=cont, boolean=list(data.features.boolean), categorical=cats, targets=targets
    )


# the encoding's scalar fields that the config decides alone: one name in the config (horizon: its
# effective_horizon), in the manifest's EncodingSpec and in the encoding contract (contract.py)
SCALARS = ("sequence_key", "order_by", "order_format", "window", "horizon", "target_positions", "continuous_dtype")


def scalars(data: DataConfig) -> dict[str, Any]:
    return {k: getattr(data, "effective_horizon" if k == "horizon" else k) for k in SCALARS}


def configured(data: DataConfig) -> dict[str, Any]:
    """The encoding's fields that the config decides alone (the rest is fitted from the data)."""
    return scalars(data) | {"id_columns": list(data.id_columns), "group_key": data.group_key, "item_key": data.item_key}


def target_statistics(partials: list[dict[str, Any]], data: DataConfig) -> list[dict[str, Any]]:
    """Per target, the training split's merged statistics (the manifest keeps them for the baseline):
    `{"counts": {value: n}}` for a classification target, `{"n", "mean", "m2"}` for a regression one."""
    out: list[dict[str, Any]] = []
    for i, t in enumerate(data.target_list):
        if t.task == "classification":
            out.append({"counts": dict(sorted(merged_counts(p["targets"][i]["counts"] for p in partials).items()))})
        else:
            out.append(moments(*_merge_moments([p["targets"][i] for p in partials])))
    return out
