"""Shardline's trainer: windows over shards, the built-in model families, a resumable training loop, generation.

Pure PyTorch + numpy (no Prefect, no MLflow). Names are imported lazily so `import shardline.trainer` stays cheap:
    from shardline.trainer import fit, predict, load_model, open_split, model_from_spec
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "pick_device": "device",
    "pick_precision": "device",
    "autocast": "device",
    "needs_grad_scaler": "device",
    "Batch": "data",
    "SplitData": "data",
    "WindowLoader": "data",
    "open_split": "data",
    "model_from_spec": "models",
    "model_spec": "models",
    "save_checkpoint": "checkpoint",
    "latest_checkpoint": "checkpoint",
    "best_checkpoint": "checkpoint",
    "load_checkpoint": "checkpoint",
    "fit": "loop",
    "predict": "inference",
    "load_model": "inference",
    "evaluate": "validate",
    "FitResult": "loop",
    "Callbacks": "loop",
    "FitOptions": "loop",
    "Preempted": "loop",
    "PREEMPTED_EXIT_CODE": "stops",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'shardline.trainer' has no attribute '{name}'")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
