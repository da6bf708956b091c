"""Test-only: a slower optimizer step or a starved loader, for the tests that kill or watch a real training mid-way
(`SHARDLINE_TEST_STEP_DELAY` / `SHARDLINE_TEST_LOADER_DELAY`, seconds, read when a training starts).

Shardline's own code holds no test hook: this file wraps `shardline.trainer.stops.setting_hooks` (the `Callbacks`
a training started by a command, a worker or torchrun takes from its environment) with the delays. tests/conftest.py
applies it to the test process and puts this folder on PYTHONPATH, so Python loads it as `sitecustomize` in every
process the tests start (a `shardline` command, a Prefect worker's flow run, torchrun's ranks) and wraps the module
there as soon as it is imported."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import time

MODULE = "shardline.trainer.stops"


def _seconds(name: str) -> float:
    return float(os.environ.get(name) or 0)


def slowed(setting_hooks):
    """`setting_hooks` with the environment's test delays added to the hooks it returns."""

    def hooks(*args, **kwargs) -> dict:
        out = dict(setting_hooks(*args, **kwargs))
        step_delay, loader_delay = _seconds("SHARDLINE_TEST_STEP_DELAY"), _seconds("SHARDLINE_TEST_LOADER_DELAY")
        if loader_delay:
            fetch = out.get("after_fetch")

            def after_fetch() -> None:
                time.sleep(loader_delay)
                if fetch is not None:
                    fetch()

            out["after_fetch"] = after_fetch
        if step_delay:
            step = out.get("after_step")

            def after_step(n: int, resumed: bool) -> None:
                time.sleep(step_delay)
                if step is not None:
                    step(n, resumed)

            out["after_step"] = after_step
        return out

    hooks.slowed = True
    return hooks


def wrap(module) -> None:
    if not getattr(module.setting_hooks, "slowed", False):
        module.setting_hooks = slowed(module.setting_hooks)


class _WrapOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module) -> None:
            execute(module)
            wrap(module)

        spec.loader.exec_module = exec_module
        return spec


if MODULE in sys.modules:
    wrap(sys.modules[MODULE])
else:
    sys.meta_path.insert(0, _WrapOnImport())
