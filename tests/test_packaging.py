"""`pip install .` with no constraints file, as a new user would: into a fresh environment, whatever the
registry's newest releases are today, then what the README promises of it: a small demo end to end, the same
command again from the cache, and `shardline predict` on raw rows. And the registered model names only pinned
packages (a bare name could resolve to someone else's)."""

from __future__ import annotations

import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.e2e
def test_pip_install_dot_into_a_fresh_environment_runs_the_demo(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    # --no-compile: the resolution and the install are a new user's; only the byte-compiling of every module of every
    # package (~half this test's CPU) is left to the first import, which compiles what the demo uses
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-compile"]
    # the CPU build of the torch this machine has (a bare requirement could pull a multi-GB CUDA build)
    torch = subprocess.run([*pip, f"torch=={version('torch').split('+')[0]}"], capture_output=True, text=True)
    assert torch.returncode == 0, torch.stderr[-3000:]
    install = subprocess.run([*pip, str(REPO)], capture_output=True, text=True, timeout=900)
    assert install.returncode == 0, install.stderr[-3000:]
    home = tmp_path / "home"

    def shardline(*args) -> subprocess.CompletedProcess:
        """The installed command, with a laptop's environment (Prefect's temporary API, no server)."""
        env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "PREFECT_HOME": str(tmp_path / "ph")}
        command = [str(venv / "bin" / "shardline"), *map(str, args)]
        return subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=tmp_path, env=env)

    # a demo that learns enough to beat its baseline in one epoch (the first champion must), in the same time
    demo_command = ["demo", "--home", home, "--games", "16", "--frames", "400", "--set", "training.epochs=1"]
    demo_command += ["--set", "training.warmup_steps=2"]
    demo = shardline(*demo_command)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
    assert "Registered shardline-demo version 1 as @champion" in demo.stdout
    assert f"mlflow ui --backend-store-uri sqlite:///{home / 'mlflow.db'}" in demo.stdout
    assert "Downloading artifacts" not in demo.stdout + demo.stderr  # MLflow's bars, one per download: not in the logs
    # MLflow's check of the input example (test rows) predicts them: what `predict` says of a user's input is not said
    assert "predict: column" not in demo.stdout + demo.stderr
    assert "prefect server start" in demo.stdout  # a laptop's temporary API, gone with the command: how to get a UI
    # the same command again: every step comes from the cache
    again = shardline(*demo_command)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "steps: ingest cached, encode cached, train cached, evaluate cached, register cached" in again.stdout
    assert "Registered shardline-demo version 1 as @champion" in again.stdout

    # predictions from a raw file, one per row with 8 frames of history, keyed so they join back to the input
    game = sorted((home / "data" / "raw").glob("*.parquet"))[0]
    preds_path = tmp_path / "preds.parquet"
    tracking = f"sqlite:///{home / 'mlflow.db'}"
    out = shardline("predict", "models:/shardline-demo@champion", game, "--out", preds_path, "--tracking-uri", tracking)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "Downloading artifacts" not in out.stdout + out.stderr
    import polars as pl

    preds, raw = pl.read_parquet(preds_path), pl.read_parquet(game)
    assert preds.height == raw.height - 8
    assert preds.columns == ["game_id", "frame", "prediction", "probability"]
    assert preds.join(raw, on=["game_id", "frame"], how="inner").height == preds.height
    assert preds["frame"].min() == 8

    # the registered model's requirements: every one pinned, Shardline not among them (its code travels inside)
    import mlflow

    from shardline.core.tracking.tracker import fluent_tracking_uri

    with fluent_tracking_uri(f"sqlite:///{home / 'mlflow.db'}"):
        local = Path(mlflow.pyfunc.get_model_dependencies("models:/shardline-demo/1"))
    lines = [line.strip() for line in local.read_text().splitlines() if line.strip() and not line.startswith("#")]
    assert lines and all("==" in line for line in lines), lines
    assert not any(line.split("==")[0].strip().lower() == "shardline" for line in lines), lines
