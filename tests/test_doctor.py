"""`shardline doctor CONFIG`, run as a user would (the command in a subprocess), against real parts:
a laptop setup (ephemeral Prefect API, local storage, MLflow on SQLite), a broken one (a Prefect API, an
S3 endpoint and an MLflow server that all refuse connections). On the team cluster of tests/cluster.py
(Prefect server, pool workers, deployments from prefect.yaml, S3 on moto), where the GPU probe runs as a
flow run on the GPU pool, it is tested in test_remote_e2e.py, on that module's cluster.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from tests.cluster import BUCKET, REPO, free_port
from tests.conftest import make_raw, tiny_config

BIN = Path(sys.executable).parent / "shardline"
SECRET = "fake-secret-Zq9vX2wL7kP"
PASSWORD = "hunter2-doctor-pw"


def clean_env(**extra: str) -> dict:
    """This process's environment without a Prefect server, MLflow server or S3 settings from the shell."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_API", "MLFLOW_", "AWS_"))}
    env.update(PREFECT_SERVER_ANALYTICS_ENABLED="false", **extra)
    return env


def doctor(
    config: Path, env: dict, *args: str, timeout: float = 600
) -> tuple[subprocess.CompletedProcess, dict[str, str]]:
    out = subprocess.run(
        [str(BIN), "doctor", str(config), *args], capture_output=True, text=True, cwd=REPO, env=env, timeout=timeout
    )
    print(out.stdout)  # the table, in pytest's report (-rP) or on a failure
    rows = {}
    for line in out.stdout.splitlines():
        if line.startswith(("PASS  ", "FAIL  ", "SKIP  ")):
            mark, rest = line[:4], line[6:]
            rows[rest[:19].strip()] = f"{mark} {rest[19:].strip()}"
    return out, rows


def write(path: Path, cfg: dict) -> Path:
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_laptop_setup_passes(tmp_path):
    make_raw(tmp_path / "raw")
    config = write(tmp_path / "c.yaml", tiny_config(str(tmp_path / "raw" / "*.parquet"), str(tmp_path / "store")))
    # a laptop's environment: no Prefect home chosen. The temporary API keeps its runs in Shardline's own database,
    # not in ~/.prefect/prefect.db (another Prefect version's migration of that one fails every local run)
    env = {k: v for k, v in clean_env().items() if k != "PREFECT_HOME"}
    env.update(HOME=str(tmp_path / "home"), SHARDLINE_CACHE=str(tmp_path / "cache"))
    out, rows = doctor(config, env)
    assert out.returncode == 0, out.stdout + out.stderr
    assert not (tmp_path / "home" / ".prefect" / "prefect.db").exists()
    assert list((tmp_path / "cache" / "prefect").glob("*/prefect.db"))
    assert list(rows) == [
        "config",
        "prefect api",
        "train deployment",
        "pipeline deployment",
        "data source",
        "storage",
        "mlflow tracking",
        "mlflow registry",
        "torch (here)",
        "gpu probe",
    ], out.stdout
    assert all(r.startswith(("PASS", "SKIP")) for r in rows.values()), out.stdout
    assert rows["prefect api"].startswith("PASS ephemeral (no server"), rows["prefect api"]
    assert "4 parquet file(s)" in rows["data source"]
    assert rows["storage"].startswith(f"PASS {tmp_path / 'store'}: wrote, read back and deleted"), rows["storage"]
    assert not list((tmp_path / "store" / ".doctor").glob("*")) if (tmp_path / "store" / ".doctor").exists() else True
    # a store no run has made yet: said, and not made by the check (a typo in its path would be a new empty store)
    assert f"sqlite:///{tmp_path / 'store'}/mlflow.db" in rows["mlflow tracking"]
    assert "no database there yet: the first run creates it" in rows["mlflow tracking"]
    assert "model tiny-model has no version yet" in rows["mlflow registry"]
    assert not (tmp_path / "store" / "mlflow.db").exists()
    assert "torch 2." in rows["torch (here)"] and "training.device=auto -> " in rows["torch (here)"]
    assert rows["gpu probe"].startswith("SKIP compute.train_on=local")
    assert "all checks passed" in out.stdout


def test_broken_setup_fails_in_plain_words_without_leaking_secrets(tmp_path):
    make_raw(tmp_path / "raw")
    dead = free_port()  # nothing listens there
    cfg = tiny_config(str(tmp_path / "raw" / "*.parquet"), f"s3://{BUCKET}/store")
    cfg["mlflow"]["tracking_uri"] = f"http://alice:{PASSWORD}@127.0.0.1:{dead}"
    config = write(tmp_path / "c.yaml", cfg)
    env = clean_env(
        PREFECT_API_URL=f"http://127.0.0.1:{dead}/api",
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{dead}",
        AWS_ACCESS_KEY_ID="AKIADOCTORTEST",
        AWS_SECRET_ACCESS_KEY=SECRET,
        AWS_DEFAULT_REGION="us-east-1",
        AWS_MAX_ATTEMPTS="1",
        MLFLOW_HTTP_REQUEST_MAX_RETRIES="0",
        MLFLOW_HTTP_REQUEST_TIMEOUT="3",
    )
    out, rows = doctor(config, env, "--timeout", "20", timeout=120)
    assert out.returncode == 1, out.stdout + out.stderr
    assert SECRET not in out.stdout + out.stderr and PASSWORD not in out.stdout + out.stderr
    assert rows["prefect api"].startswith(
        f"FAIL cannot reach the Prefect API at http://127.0.0.1:{dead}/api: connection refused; "
        "is `prefect server start` running there?"
    ), rows["prefect api"]
    assert rows["train deployment"].startswith("SKIP needs the Prefect API")
    assert rows["data source"].startswith("PASS")
    assert rows["storage"].startswith(f"FAIL storage.root s3://{BUCKET}/store: a write, read back and delete failed"), (
        rows["storage"]
    )
    assert f"cannot connect to http://127.0.0.1:{dead}: is the server up? AWS_ENDPOINT_URL" in rows["storage"]
    assert rows["mlflow tracking"].startswith(
        f"FAIL cannot reach MLflow at http://***@127.0.0.1:{dead} (mlflow.tracking_uri): "
        "connection refused; is the MLflow server up"
    ), rows["mlflow tracking"]
    assert rows["mlflow registry"].startswith("SKIP")
    assert "3 check(s) failed: prefect api, storage, mlflow tracking" in out.stdout


def test_several_machines_without_a_prefect_server_fail_the_node_check(tmp_path):
    """compute.nodes: 2 on a laptop (the ephemeral API): the other node could never start, said before any work."""
    make_raw(tmp_path / "raw")
    cfg = tiny_config(str(tmp_path / "raw" / "*.parquet"), str(tmp_path / "store"), **{"training.device": "cpu"})
    cfg["compute"] = {"nodes": 2}
    out, rows = doctor(write(tmp_path / "c.yaml", cfg), clean_env())
    assert out.returncode == 1, out.stdout + out.stderr
    assert rows["node deployment"].startswith(
        "FAIL compute.nodes=2: node 1 run(s) as flow runs of train-node/train-node (compute.node_deployment)"
    ), rows["node deployment"]
    assert "1 check(s) failed: node deployment" in out.stdout


def test_several_machines_on_a_pool_of_fewer_live_workers_fail_the_node_check(tmp_path, prefect_api, monkeypatch):
    """compute.nodes: 2, the training run and its node 1 on one process pool (one worker a machine) where one
    worker is live: the training could never have both machines at once (node 1 would wait for the worker the
    training run holds, until torchrun's rendezvous times out, attempt after attempt), so the node row fails,
    naming the count; with train_on: local (node 0 is this machine) the one worker is enough."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate

    from shardline.app.doctor_prefect import prefect_checks as _prefect_checks
    from shardline.core.config import PipelineConfig
    from shardline.flows.train import train, train_node

    pool = "one-worker-pool"
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
        for flow in (train, train_node):
            client.create_deployment(flow_id=client.create_flow(flow), name="one-worker", work_pool_name=pool)
        client.send_worker_heartbeat(work_pool_name=pool, worker_name="gpu-machine-1")

    def node_row(train_on: str) -> str:
        cfg = tiny_config(str(tmp_path / "raw" / "*.parquet"), str(tmp_path / "store"))
        cfg["compute"] = {
            "nodes": 2,
            "train_on": train_on,
            "train_deployment": "train/one-worker",
            "node_deployment": "train-node/one-worker",
        }
        rows: list = []
        _prefect_checks(PipelineConfig.model_validate(cfg), 30, lambda *checks: rows.extend(checks))
        (row,) = [c for c in rows if c.name == "node deployment"]
        return f"{'PASS' if row.ok else 'FAIL'} {row.detail}"

    row = node_row("deployment")
    assert row.startswith("FAIL") and "2 of its machines at once" in row and "1 live worker" in row, row
    assert "compute.nodes" in row, row
    assert node_row("local").startswith("PASS")

    # the server fails a later request (listing the node pool's workers): the row that was being read says so
    from prefect.client.orchestration import SyncPrefectClient

    def failing(self, *args, **kwargs):
        raise RuntimeError("Server error '500 Internal Server Error' for url 'http://api/work_pools/workers/filter'")

    monkeypatch.setattr(SyncPrefectClient, "read_workers_for_work_pool", failing)
    row = node_row("local")
    assert row.startswith("FAIL reading it from") and "500 Internal Server Error" in row, row


def test_a_typo_in_a_column_fails_the_data_check(tmp_path):
    make_raw(tmp_path / "raw")
    cfg = tiny_config(str(tmp_path / "raw" / "*.parquet"), str(tmp_path / "store"))
    cfg["data"]["features"]["continuous"] = ["x", "yy"]
    # a guard against a hang, not a speed: 60 s ran out once on a 2-core machine busy with other test runs
    out, rows = doctor(write(tmp_path / "c.yaml", cfg), clean_env(), timeout=300)
    assert out.returncode == 1
    assert rows["data source"].startswith("FAIL") and "missing column 'yy'" in rows["data source"]
    assert "did you mean 'y'?" in rows["data source"]


def test_bad_config_exits_2(tmp_path):
    cfg = tiny_config("raw/*.parquet", str(tmp_path / "store"))
    cfg["compute"] = {"train_on": "gpu"}
    out, rows = doctor(write(tmp_path / "c.yaml", cfg), clean_env(), timeout=120)
    assert out.returncode == 2 and not rows
    assert "compute.train_on" in out.stderr
