"""Test-only: a slower optimizer step or a starved loader, for the tests that kill or watch a real training mid-way
(`SHARDLINE_TEST_STEP_DELAY` / `SHARDLINE_TEST_LOADER_DELAY`, seconds, read when a training starts), or a training
held just before its first step (`SHARDLINE_TEST_START_MARK`: a file written then, once); and each new
SQLite MLflow store filled from a copy of the first one MLflow migrated in the session.

Shardline's own code holds no test hook: this file wraps `shardline.trainer.stops.setting_hooks` (the `Callbacks`
a training started by a command, a worker or torchrun takes from its environment) with the delays. tests/conftest.py
applies it to the test process and puts this folder on PYTHONPATH, so Python loads it as `sitecustomize` in every
process the tests start (a `shardline` command, a Prefect worker's flow run, torchrun's ranks) and wraps the module
there as soon as it is imported.

The MLflow store: a session makes about 80 stores (each test's own root), and MLflow builds each new one by running
its ~50 schema migrations (~0.75 s of CPU). `mlflow.store.db.utils._initialize_tables` is wrapped to copy, into a
new store that has no table yet, the tables of the first store it migrated in this session (the same MLflow, the
same migrations: a file in `SHARDLINE_TEST_MLFLOW_TEMPLATES`), with SQLite's own backup. A store that has tables is
migrated by MLflow as before, and a `pip install .` in a fresh environment (test_packaging) migrates its own."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import time

MODULE = "shardline.trainer.stops"
MLFLOW_DB = "mlflow.store.db.utils"


def _seconds(name: str) -> float:
    return float(os.environ.get(name) or 0)


def slowed(setting_hooks):
    """`setting_hooks` with the environment's test delays added to the hooks it returns."""

    def hooks(*args, **kwargs) -> dict:
        out = dict(setting_hooks(*args, **kwargs))
        starting = os.environ.get("SHARDLINE_TEST_START_MARK")  # a training held at its start (set up, no step yet)
        if starting and not os.path.exists(starting):
            open(starting, "w").close()
            time.sleep(_seconds("SHARDLINE_TEST_START_DELAY") or 5.0)
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


TEMPLATES = "SHARDLINE_TEST_MLFLOW_TEMPLATES"  # a folder of the session's, made by tests/conftest.py


def from_template(initialize_tables):
    """`initialize_tables(engine)` that fills a new, empty SQLite store from the session's migrated one."""

    def initialize(engine) -> None:
        import sqlalchemy

        folder = os.environ.get(TEMPLATES)
        if engine.dialect.name != "sqlite" or not folder or not os.path.isdir(folder):
            return initialize_tables(engine)
        if sqlalchemy.inspect(engine).get_table_names():
            return initialize_tables(engine)  # a store with tables: MLflow migrates what is there
        import sqlite3
        import tempfile

        import mlflow

        template = os.path.join(folder, f"mlflow-{mlflow.__version__}-migrated.db")
        with engine.connect() as conn:
            store = conn.connection.driver_connection
            if os.path.exists(template):
                with sqlite3.connect(template) as src:
                    src.backup(store)
                return None
            initialize_tables(engine)
            fd, aside = tempfile.mkstemp(dir=folder, suffix=".db")
            os.close(fd)
            with sqlite3.connect(aside) as dst:
                store.backup(dst)
            os.replace(aside, template)  # whole, or not there: two processes may write it at once
        return None

    initialize.templated = True
    return initialize


def wrap(module) -> None:
    if module.__name__ == MLFLOW_DB:
        if not getattr(module._initialize_tables, "templated", False):
            module._initialize_tables = from_template(module._initialize_tables)
    elif not getattr(module.setting_hooks, "slowed", False):
        module.setting_hooks = slowed(module.setting_hooks)


class _WrapOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in (MODULE, MLFLOW_DB):
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


for _name in (MODULE, MLFLOW_DB):
    if _name in sys.modules:
        wrap(sys.modules[_name])
sys.meta_path.insert(0, _WrapOnImport())
