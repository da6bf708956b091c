"""A user's own model, as a user runs it: `shardline run` on a config beside their code, in a folder
outside Shardline's repository (a real Prefect API, MLflow store and training). An edit to a helper
module the model imports retrains while the data steps stay cached, and the registered model predicts
raw rows in a fresh process elsewhere after the user's folder is gone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import polars as pl
import pytest
from mlflow import MlflowClient

from tests.conftest import api_env, make_raw, tiny_config
from tests.user_project import HELPERS, write_project

BIN = Path(sys.executable).with_name("shardline")


def shardline(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = api_env()  # the session's Prefect API: the test uses the prefect_api fixture
    return subprocess.run([str(BIN), *args], cwd=cwd, capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.e2e
def test_a_users_model_trains_retrains_on_a_code_edit_and_predicts_without_its_code(tmp_path, prefect_api):
    make_raw(tmp_path / "raw", n_seq=15, rows=80)
    root = tmp_path / "store"
    cfg = tiny_config(str(tmp_path / "raw" / "*.parquet"), str(root), **{"training.epochs": 3})
    project = tmp_path / "my-repo"
    config = write_project(project, cfg)

    # run from another folder: the model's module is found beside the config
    first = shardline("run", str(config), cwd=tmp_path)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "steps: ingest ran, encode ran, train ran, evaluate ran, register ran" in first.stdout
    # a Prefect server was there (the session's): its UI is named, not how to start one
    ui = api_env()["PREFECT_API_URL"].removesuffix("/api")
    assert f"{ui}/runs" in first.stdout and "prefect server start" not in first.stdout, first.stdout[-1500:]
    client = MlflowClient(f"sqlite:///{root}/mlflow.db")
    v1 = client.get_model_version("tiny-model", "1")
    assert v1.tags["shardline.model_entrypoint"] == "models.world:WindowGRU"
    # the label is the previous row's kind: the user's GRU over the window learns it, the majority class does not
    metrics = client.get_run(v1.run_id).data.metrics
    assert metrics["test/accuracy"] > 0.9 > 0.5 > metrics["test/accuracy_baseline"]
    # its params are its own: not the built-in family's (model.hidden=256 beside model.params.hidden=16)
    params = client.get_run(v1.run_id).data.params
    assert params["model.params.hidden"] == "16" and params["model.entrypoint"] == "models.world:WindowGRU"
    assert not {"model.hidden", "model.family", "model.layers", "model.dropout"} & set(params), sorted(params)

    # an edit to a helper the model imports is an edit to the model: train again, keep the data steps
    (project / "models" / "helpers.py").write_text(HELPERS.replace("return 4", "return 3"))
    second = shardline("run", str(config), cwd=tmp_path)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "steps: ingest cached, encode cached, train ran, evaluate ran, register ran" in second.stdout
    v2 = client.get_model_version("tiny-model", "2")
    assert v2.tags["shardline.model_code_version"] != v1.tags["shardline.model_code_version"]

    # a bug in the model's forward (a name mistyped): said as the error, with the user's file and line, and no
    # traceback (it was two of Prefect's, ~190 lines, then an `error:` naming no file); nothing registered
    world = project / "models" / "world.py"
    good = world.read_text()
    world.write_text(good.replace("h, _ = self.gru(x)", "h, _ = self.gru(xx)"))
    line = good.splitlines().index("        h, _ = self.gru(x)") + 1
    buggy = shardline("run", str(config), cwd=tmp_path)
    assert buggy.returncode == 1, buggy.stdout[-3000:] + buggy.stderr[-3000:]
    assert "Traceback" not in buggy.stdout + buggy.stderr, buggy.stderr[-5000:]
    assert f"error: name 'xx' is not defined (NameError raised at {world}:{line};" in buggy.stderr, buggy.stderr
    world.write_text(good)

    # the registered model carries the user's code and Shardline's: it predicts raw rows in a fresh
    # process, in another folder, with the user's repository gone
    project.rename(tmp_path / "deleted")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    raw = sorted((tmp_path / "raw").glob("*.parquet"))[0]
    code = f"""
import json, sys
import mlflow, polars as pl
mlflow.set_tracking_uri("sqlite:///{root}/mlflow.db")
# version 1 loaded first, in the same process (a champion and a challenger compared): version 2 is built from
# its own code (helpers.py edited), not from the module version 1 imported
before = mlflow.pyfunc.load_model("models:/tiny-model/1")
model = mlflow.pyfunc.load_model("models:/tiny-model/2")
rows = pl.read_parquet("{raw}")
preds = pl.from_pandas(model.predict(rows.drop("label").to_pandas()))
truth = rows.select("seq", "t", "label")
joined = preds.join(truth, on=["seq", "t"])
joined_v1 = pl.from_pandas(before.predict(rows.drop("label").to_pandas())).join(truth, on=["seq", "t"])
print(json.dumps({{
    "rows": preds.height, "accuracy": float((joined["prediction"] == joined["label"]).mean()),
    "accuracy_v1": float((joined_v1["prediction"] == joined_v1["label"]).mean()),
    "columns": preds.columns, "user_code": sys.modules["models.world"].__file__,
    "shardline": sys.modules["shardline"].__file__,
}}))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["rows"] == pl.read_parquet(raw).height - 3 * 3  # one per window: 3 sequences of 80 rows, K=3
    assert got["columns"] == ["seq", "t", "prediction", "probability"]
    assert got["accuracy"] > 0.9 and got["accuracy_v1"] > 0.9
    artifacts = str(root / "mlflow-artifacts")
    assert got["user_code"].startswith(artifacts) and got["shardline"].startswith(artifacts)
    # of Shardline, the model carries what predicting imports, not the pipeline, the CLI or the demo's generator
    package = Path(got["shardline"]).parent
    shipped = {p.relative_to(package).as_posix() for p in package.rglob("*.py")}
    assert {"runs/pyfunc_model.py", "trainer/serving.py", "trainer/data/loader.py"} <= shipped
    assert not {"app/cli.py", "app/demo_data.py", "flows/pipeline.py", "tasks/train.py"} & shipped


def test_a_bad_entrypoint_is_refused_before_any_work_with_exit_code_2(tmp_path, prefect_api):
    make_raw(tmp_path / "raw", n_seq=3, rows=20)
    root = tmp_path / "store"
    cfg = tiny_config(str(tmp_path / "raw" / "*.parquet"), str(root))
    config = write_project(tmp_path / "repo", cfg)
    (tmp_path / "repo" / "models" / "typo.py").write_text("class Net:\n    def __init__(self spec):\n        pass\n")
    text = config.read_text()
    for entrypoint, expect in (
        ("models.world:Missing", "has no 'Missing'; it defines ['WindowGRU'"),
        ("nothere.world:Net", "no module 'nothere' in"),
        ("models.world", "is not 'package.module:Name'"),
        ("models.typo:Net", f"importing models.typo failed ({tmp_path / 'repo' / 'models' / 'typo.py'}:2): Syntax"),
    ):
        config.write_text(text.replace("models.world:WindowGRU", entrypoint))
        out = shardline("run", str(config), cwd=tmp_path)
        assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-2000:]
        assert expect in out.stderr and "model.entrypoint" in out.stderr, out.stderr
    assert not root.exists()  # nothing was started, nothing written


ROMAN_HELPERS = """
import roman  # a package of PyPI's the user installed


def embedding_width(cardinality):
    return roman.fromRoman("IV")
"""


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.e2e
def test_a_model_importing_a_pypi_package_registers_it_pinned_and_mlflow_models_serve_answers_raw_rows(
    tmp_path, prefect_api
):
    """The user's model imports `roman`, installed from PyPI for the test (beside the environment, on
    PYTHONPATH): the registered model's requirements name it at the version installed, and MLflow's own scoring
    server (`mlflow models serve`) loads the model and answers raw rows over HTTP."""
    import os
    import time
    import urllib.request
    from importlib.metadata import version

    site = tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps"]
    got = subprocess.run([*pip, "--target", str(site), "roman==5.2"], capture_output=True, text=True, timeout=300)
    assert got.returncode == 0, got.stderr[-2000:]
    make_raw(tmp_path / "raw", n_seq=15, rows=80)
    root = tmp_path / "store"
    cfg = tiny_config(str(tmp_path / "raw" / "*.parquet"), str(root), **{"training.epochs": 1})
    config = write_project(tmp_path / "my-repo", cfg, helpers=ROMAN_HELPERS)
    env = {**api_env(), "PYTHONPATH": str(site)}
    run = subprocess.run(
        [str(BIN), "run", str(config)], cwd=tmp_path, capture_output=True, text=True, timeout=600, env=env
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]

    import mlflow

    from shardline.core.tracking.tracker import fluent_tracking_uri

    tracking = f"sqlite:///{root}/mlflow.db"
    with fluent_tracking_uri(tracking):
        lines = Path(mlflow.pyfunc.get_model_dependencies("models:/tiny-model/1")).read_text().split()
    assert "roman==5.2" in lines, lines
    assert f"torch=={version('torch').split('+')[0]}" in lines and all("==" in line for line in lines), lines
    assert not any(line.lower().startswith(("shardline", "models")) for line in lines), lines

    port = free_port()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    bin_dir = Path(sys.executable).parent  # the server runs `uvicorn` from the environment's bin
    serve_env = {
        **os.environ, "MLFLOW_TRACKING_URI": tracking, "PYTHONPATH": str(site),
        "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
    }  # fmt: skip
    mlflow_bin = bin_dir / "mlflow"
    serve = [str(mlflow_bin), "models", "serve", "-m", "models:/tiny-model/1", "--env-manager", "local"]
    server = subprocess.Popen(
        [*serve, "--host", "127.0.0.1", "--port", str(port)], cwd=elsewhere, env=serve_env,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/ping", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, server.stdout.read()[-3000:]
            time.sleep(0.5)
        raw = sorted((tmp_path / "raw").glob("*.parquet"))[0]
        rows = pl.read_parquet(raw)
        body = json.dumps({"dataframe_split": rows.drop("label").to_pandas().to_dict(orient="split")}, default=str)
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/invocations", body.encode(), {"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=120) as r:
            answer = json.loads(r.read())
    finally:
        server.terminate()
        server.wait(30)
    predictions = answer["predictions"]
    assert len(predictions) == rows.height - 3 * 3  # one per window: 3 sequences of 80 rows, K=3
    assert set(predictions[0]) == {"seq", "t", "prediction", "probability"}
    assert {p["prediction"] for p in predictions} <= set(rows["label"].unique())
