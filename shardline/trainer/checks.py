"""The checks at a training's edge: its inputs against the model spec before any step, and a checkpoint folder
against the run that would resume from it."""

from __future__ import annotations

import json

import numpy as np

from shardline.core.config import TrainingConfig
from shardline.trainer.contract import DataSpec
from shardline.trainer.data import SplitData, target_names


def plain(obj, what: str):
    try:
        return json.loads(json.dumps(obj))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{what} must be plain JSON data (dicts, lists, strings, numbers): {e}") from None


def check_inputs(train: SplitData, val: SplitData, spec: DataSpec, task: str | None) -> None:
    kinds = [t.kind for t in spec.targets]
    if (kinds[0] if kinds else None) != task:
        raise ValueError(f"the model spec's first target is a {kinds[0] if kinds else 'none'}, task='{task}'")
    for name, data in (("train", train), ("validation", val)):
        if data.n_windows == 0:
            raise ValueError(
                f"the {name} split has no windows: each sequence needs at least window+horizon rows "
                f"(data.window={data.window}, horizon={data.horizon}); shorten data.window or add data"
            )
        if data.tasks != kinds:
            raise ValueError(
                f"the {name} split holds targets {data.tasks} but the model spec's are {kinds} "
                f"({[t.name for t in spec.targets]})"
            )
        if spec.targets and data.positions != spec.targets[0].positions:
            raise ValueError(
                f"the {name} split reads targets at positions '{data.positions}', the model spec at "
                f"'{spec.targets[0].positions}'"
            )
        if data.window != spec.window:
            raise ValueError(f"the model spec has window={spec.window} but the {name} split has window={data.window}")
        if (data.n_cont, data.n_cat) != (spec.n_cont, spec.n_cat):
            raise ValueError(
                f"the {name} split has {data.n_cont} continuous / {data.n_cat} categorical columns, "
                f"the model spec expects {spec.n_cont} / {spec.n_cat}"
            )

        def check_ids(view, s: int, name: str = name) -> None:
            arrays = view.arrays
            cat = np.asarray(arrays["cat"])
            if cat.size and (cat.max(axis=0) >= np.asarray(spec.cardinalities)).any():
                raise ValueError(
                    f"the {name} split has categorical ids beyond the spec's cardinalities {spec.cardinalities} "
                    f"({view.name})"
                )
            for t, array in zip(spec.targets, target_names(arrays)):
                y = arrays[array]
                if t.kind == "classification" and len(y) and int(np.max(y)) >= t.n_classes:
                    raise ValueError(
                        f"the {name} split has class ids of '{t.name}' >= n_classes={t.n_classes} of the model spec "
                        f"({view.name})"
                    )

        # a split in hand: every shard now; a streamed one: each shard as training or validation opens it
        # (no pass of its own before the first step: on S3 that was one more download of the split)
        data.check_each(check_ids)


def check_same_run(sidecar: dict, spec: dict, training: dict, windows: dict, ckpt_dir: str) -> None:
    hint = (
        f"delete {ckpt_dir} to train this run from scratch (calling fit() directly: pass another ckpt_dir, "
        "or resume=False to clear it)"
    )
    if sidecar.get("model_spec") != spec:
        raise ValueError(
            f"the checkpoints in {ckpt_dir} belong to another model config "
            f"(saved {sidecar.get('model_spec')}, requested {spec}); {hint}"
        )
    saved = sidecar.get("training", {})
    changed = sorted(
        k
        for k in set(saved) | set(training)
        if k not in TrainingConfig.RESUMABLE_CHANGES and saved.get(k) != training.get(k)
    )
    if changed:
        diff = ", ".join(f"training.{k}: {saved.get(k)!r} -> {training.get(k)!r}" for k in changed)
        raise ValueError(f"the checkpoints in {ckpt_dir} were trained with other settings ({diff}); {hint}")
    if sidecar.get("windows") != windows:
        raise ValueError(
            f"the checkpoints in {ckpt_dir} were trained on other data (windows {sidecar.get('windows')}, now "
            f"{windows}); {hint}"
        )
