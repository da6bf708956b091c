"""A shared storage root a team can trust (issue #43): what anyone with write access to it plants there does
not decide what code runs."""

from __future__ import annotations

import sys

import pytest
import torch

from shardline.core.config import ModelConfig
from shardline.trainer.checkpoint import save_checkpoint
from shardline.trainer.inference import load_model
from shardline.trainer.models import model_from_spec, model_spec


def test_a_checkpoint_rewritten_to_name_other_code_is_refused_and_nothing_it_names_is_imported(tmp_path):
    """A run's .pt rewritten with another model entrypoint and code folder (tensors and plain values only, so
    weights_only loading accepts it, and its sidecar's checksum fixed up by the save): evaluation builds the
    model its config describes and refuses the checkpoint, naming both; the planted module is never imported."""
    spec = model_spec(ModelConfig(hidden=8, layers=1), 2, [4], 3, 3)
    model = model_from_spec(spec)
    planted = tmp_path / "planted" / "evil_model"
    planted.mkdir(parents=True)
    marker = tmp_path / "it-ran"
    (planted / "__init__.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n\ndef Net(spec):\n    pass\n")
    bad = {**spec, "model": {**spec["model"], "entrypoint": "evil_model:Net", "code_dir": str(planted.parent)}}
    uri = save_checkpoint(str(tmp_path / "ck"), 1, {"model": model.state_dict(), "model_spec": bad}, {}, True, 2)
    with pytest.raises(ValueError, match=r"saved for another model than the config describes .*evil_model:Net"):
        load_model(uri, spec)
    assert not marker.exists() and "evil_model" not in sys.modules

    # the checkpoint's code folder is not the config's (the project moved): the config's is used, the weights load
    moved = {**spec, "model": {**spec["model"], "code_dir": str(tmp_path / "old-place")}}
    uri = save_checkpoint(str(tmp_path / "moved"), 1, {"model": model.state_dict(), "model_spec": moved}, {}, True, 2)
    assert load_model(uri, spec).shardline_spec == spec
    # the same weights under the config's own spec load as that model
    good = save_checkpoint(str(tmp_path / "ok"), 1, {"model": model.state_dict(), "model_spec": spec}, {}, True, 2)
    loaded = load_model(good, spec)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))


@pytest.mark.e2e
def test_a_failed_step_s_message_holds_no_secret_in_prefect_or_the_storage_root(tmp_path, prefect_api):
    """A step fails with an error whose message carries a credential (here the data source's own path names
    one): the task run's and the flow run's state messages in the Prefect API, and every byte under the storage
    root, hold it masked; the error still fails the run."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    from shardline.core.config import validate_config
    from shardline.flows.pipeline import pipeline
    from tests.conftest import recorded_task_runs, tiny_config

    planted = "hunter2-planted-0451"
    source = tmp_path / f"MLFLOW_TRACKING_PASSWORD={planted}" / "*.parquet"  # no such folder: ingest fails
    cfg = tiny_config(str(source), str(tmp_path / "store"))
    state = pipeline(validate_config(cfg), return_state=True)
    assert state.is_failed()
    with get_client(sync_client=True) as client:
        flow_run = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
        )[0]
    task_runs = recorded_task_runs(flow_run.id, count=1)  # the failed step, once the API has recorded it
    assert any(t.state.is_failed() for t in task_runs), [t.state for t in task_runs]
    messages = [flow_run.state.message, *(t.state.message for t in task_runs if t.state)]
    assert any("MLFLOW_TRACKING_PASSWORD=***" in (m or "") for m in messages), messages
    assert not any(planted in (m or "") for m in messages), messages
    written = [p for p in (tmp_path / "store").rglob("*") if p.is_file() and planted.encode() in p.read_bytes()]
    assert written == []


@pytest.mark.e2e
def test_a_local_run_works_beside_a_prefect_database_another_version_migrated(tmp_path):
    """~/.prefect/prefect.db stamped by another Prefect version's migration (another environment on this machine
    ran a newer Prefect): `shardline run` without a server keeps its runs in a database of its own for this
    version, and leaves that one as it was."""
    import os
    import sqlite3
    import subprocess
    from pathlib import Path

    import prefect
    import yaml

    from tests.conftest import make_raw, tiny_config

    home = tmp_path / "home"
    (home / ".prefect").mkdir(parents=True)
    other = home / ".prefect" / "prefect.db"
    with sqlite3.connect(other) as db:
        db.execute("create table alembic_version (version_num varchar(32) not null primary key)")
        db.execute("insert into alembic_version values ('f0f0f0f0f0f0')")  # a revision this Prefect never had
    make_raw(tmp_path / "raw", n_seq=9, rows=40)
    cfg = tiny_config(str(tmp_path / "raw" / "*.parquet"), str(tmp_path / "store"), **{"training.epochs": 1})
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(HOME=str(home), SHARDLINE_CACHE=str(tmp_path / "cache"), PREFECT_SERVER_ANALYTICS_ENABLED="false")
    shardline = Path(sys.executable).with_name("shardline")
    out = subprocess.run(
        [str(shardline), "run", str(tmp_path / "cfg.yaml")], env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=400,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    assert "Registered tiny-model version 1" in out.stdout
    assert (tmp_path / "cache" / "prefect" / prefect.__version__ / "prefect.db").stat().st_size > 0
    with sqlite3.connect(other) as db:
        assert db.execute("select version_num from alembic_version").fetchall() == [("f0f0f0f0f0f0",)]


@pytest.mark.e2e
def test_a_registered_model_edited_in_the_storage_root_is_refused_naming_the_file(tmp_path, prefect_api, monkeypatch):
    """A registered model's code sits under the storage root's mlflow-artifacts/, where it runs when it loads:
    `shardline predict` (and the champion gate, rehearse) load a version only with the files it was registered
    with. An edited pyfunc module is refused, naming it, before anything of it runs. Neither leaves its download
    of the model behind in the temporary folder."""
    import gc
    import tempfile

    from typer.testing import CliRunner

    from shardline.app.cli import app
    from shardline.core.config import validate_config
    from shardline.flows.pipeline import pipeline
    from tests.conftest import make_raw, tiny_config

    make_raw(tmp_path / "raw", n_seq=9, rows=40)
    root = tmp_path / "store"
    cfg = tiny_config(str(tmp_path / "raw" / "*.parquet"), str(root), **{"training.epochs": 1})
    paths_before = list(sys.path)
    pipeline(validate_config(cfg))
    raw = sorted((tmp_path / "raw").glob("*.parquet"))[0]
    tracking = f"sqlite:///{root}/mlflow.db"
    out = str(tmp_path / "p.parquet")
    args = ["predict", "models:/tiny-model/1", str(raw), "--tracking-uri", tracking, "--out", out]
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    ok = CliRunner().invoke(app, args)
    assert ok.exit_code == 0, ok.output
    gc.collect()
    assert list(scratch.iterdir()) == []  # the model's download went with the model
    # logged and loaded in this process, the model's code folders (its copy of Shardline holds only what predicting
    # imports) come after this process's own on sys.path, which the processes it spawns get (Dask's workers, the
    # training's forkserver): MLflow put them first, for good
    added = [p for p in sys.path if p not in paths_before]
    assert added and sys.path == [p for p in sys.path if p in paths_before] + added
    (code,) = [p for p in (root / "mlflow-artifacts").rglob("pyfunc_model.py") if "code" not in p.parts]
    marker = tmp_path / "it-ran"
    code.write_text(code.read_text() + f"\nopen({str(marker)!r}, 'w').write('ran')\n")  # planted
    bad = CliRunner().invoke(app, args)
    assert bad.exit_code != 0
    assert "refused, its files are not the ones it was registered with" in bad.output, bad.output
    assert f"{code.name} (changed)" in bad.output and not marker.exists()
    assert list(scratch.iterdir()) == []


def test_processes_started_after_a_model_load_import_this_shardline_not_the_models_copy(tmp_path, monkeypatch):
    """MLflow leaves a loaded model's code folder first on sys.path, and a registered model carries a copy of only
    the Shardline modules predicting imports. Processes that take this process's sys.path (multiprocessing's spawn
    and fork server: Dask's local workers, a sweep's trials) are started within `spawning_this_shardline`, and
    import this Shardline, not the copy (a Dask encode after a model load failed on `shardline.core.layout`)."""
    import multiprocessing
    import runpy

    import shardline.core.layout
    from shardline.core.version import spawning_this_shardline

    copy = tmp_path / "model" / "code"  # what a model's code folder holds of Shardline, here: no `layout`
    (copy / "shardline" / "core").mkdir(parents=True)
    (copy / "shardline" / "__init__.py").write_text("")
    (copy / "shardline" / "core" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(copy))
    child = tmp_path / "child.py"
    child.write_text("import pathlib, shardline.core.layout as m\npathlib.Path(OUT).write_text(m.__file__)\n")
    spawn = multiprocessing.get_context("spawn")

    def start(out) -> int:
        p = spawn.Process(target=runpy.run_path, args=(str(child),), kwargs={"init_globals": {"OUT": str(out)}})
        p.start()
        p.join(120)
        return p.exitcode

    assert start(tmp_path / "unguarded") != 0 and not (tmp_path / "unguarded").exists()  # the copy: no layout
    with spawning_this_shardline():
        assert start(tmp_path / "guarded") == 0
    assert (tmp_path / "guarded").read_text() == shardline.core.layout.__file__
    assert sys.path[0] == str(copy)  # as it was, after the block
