"""One writer per run folder and per registry decision, across processes and machines: a lease in the
storage root (local files and S3 through a real moto server)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from shardline.core.lease import Lease, LeaseHeld, LeaseLost, read_current
from tests.conftest import make_raw, tiny_config
from tests.test_s3_source import s3_endpoint  # noqa: F401 - the moto fixture

BIN = Path(sys.executable).parent / "shardline"


def _exercise(folder: str) -> None:
    a = Lease(folder, "A", ttl=2)
    a.acquire()
    b = Lease(folder, "B", ttl=2)
    ok, holder = b.try_acquire()
    assert not ok and holder["owner"] == a.owner
    with pytest.raises(LeaseHeld, match=r"held by A by .* pid"):
        b.acquire(wait=0.5, poll=0.1)
    a.release()  # released: the next taker need not wait for the expiry
    assert b.try_acquire()[0] and read_current(folder)[1]["owner"] == b.owner
    # B stalls past its expiry without renewing (a "Crashed" run that was not dead): C takes over, B is fenced
    time.sleep(2.2)
    c = Lease(folder, "C", ttl=2)
    assert c.try_acquire()[0]
    with pytest.raises(LeaseLost):
        b.renew()
    c.release()


def test_a_lease_on_local_files(tmp_path):
    _exercise(str(tmp_path / "lease"))


def test_a_lease_on_s3(s3_endpoint):  # noqa: F811
    import s3fs

    s3fs.S3FileSystem().mkdir("lease-bucket")
    _exercise("s3://lease-bucket/runs/x/lease")


@pytest.mark.e2e
def test_two_runs_of_one_config_at_once_never_write_the_same_run_folder_together(tmp_path):
    """Two `shardline run` of the same config on one storage root: the second waits while the first holds
    the run folder's lease, then takes its finished result; one model version, no step logged twice."""
    make_raw(tmp_path / "raw", n_seq=9, rows=60)
    cfg = tiny_config(str(tmp_path / "raw" / "*.parquet"), str(tmp_path / "store"), **{"training.epochs": 2})
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}

    def start(step_delay: str) -> subprocess.Popen:
        return subprocess.Popen(
            [str(BIN), "run", str(tmp_path / "cfg.yaml")],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**env, "SHARDLINE_TEST_STEP_DELAY": step_delay},
        )

    first = start("2.5")  # 18 steps: ~45 s of training, while the second starts and reaches its train step
    deadline = time.monotonic() + 300
    while not list((tmp_path / "store" / "runs").glob("*/lease/gen-*.json")):
        assert first.poll() is None, first.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "the first run never took its lease"
        time.sleep(0.2)
    second = start("0")
    out1, _ = first.communicate(timeout=600)
    out2, _ = second.communicate(timeout=600)
    assert first.returncode == 0, out1[-3000:]
    assert second.returncode == 0, out2[-3000:]
    assert "is being trained by training" in out2, out2[-3000:]
    runs = list((tmp_path / "store" / "runs").iterdir())
    assert len(runs) == 1
    client = MlflowClient(cfg["mlflow"]["tracking_uri"])
    assert len(client.search_model_versions("name='tiny-model'")) == 1
    run_id = client.search_model_versions("name='tiny-model'")[0].run_id
    steps = [m.step for m in client.get_metric_history(run_id, "train/train_loss")]
    assert steps and len(steps) == len(set(steps))
