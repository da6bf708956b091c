"""One writer per run folder and per registry decision, across processes and machines: a lease in the
storage root (local files and S3 through a real moto server)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from mlflow import MlflowClient

from shardline.core.lease import Lease, LeaseLost, read_current
from tests.conftest import api_env, make_raw, tiny_config
from tests.test_s3_source import s3_endpoint  # noqa: F401 - the moto fixture

BIN = Path(sys.executable).parent / "shardline"


def _exercise(folder: str) -> None:
    a = Lease(folder, "A", ttl=30)  # long enough that a loaded machine's slow S3 calls cannot expire it here
    a.acquire()
    b = Lease(folder, "B", ttl=2)
    ok, holder = b.try_acquire()
    assert not ok and holder["owner"] == a.owner
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


HOLDER = """
import sys, time
from shardline.core.lease import Lease
lease = Lease(sys.argv[1], "training x", ttl=60)
lease.acquire()
print("held", flush=True)
time.sleep(600)
"""


def _holder(folder: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, folder], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


@pytest.mark.parametrize("reaped", [True, False], ids=["reaped", "zombie"])
def test_a_holder_killed_on_this_machine_is_not_waited_out(tmp_path, reaped):
    """`shardline run` killed with SIGKILL (or by the out-of-memory killer) and run again on the same machine:
    its lease (60 s left) is taken at once, not after the expiry; a live holder still keeps it."""
    import json

    folder = str(tmp_path / "lease")
    proc = _holder(folder)
    try:
        other = Lease(folder, "training x", ttl=60)
        assert not other.try_acquire()[0], "a live holder keeps its lease"
        proc.kill()
        if reaped:
            proc.wait()
        else:  # killed, not yet reaped by its parent (this test): /proc still lists it, as a zombie
            deadline = time.monotonic() + 10
            while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
                assert time.monotonic() < deadline
                time.sleep(0.05)
        gen, record = read_current(folder)
        assert record["expires_at"] > time.time() + 30 and not record["released"]
        ok, _ = other.try_acquire()
        assert ok and other.gen == gen + 1
        assert other.taken_from["pid"] == proc.pid
    finally:
        proc.kill()
        proc.wait()

    # the same dead pid, but the record says another boot (another machine, or before a reboot): waited out
    newest = Path(folder) / f"gen-{other.gen:09d}.json"
    theirs = {**json.loads(newest.read_text()), "pid": proc.pid}
    theirs["process"] = {**theirs["process"], "boot": "another-machine"}
    newest.write_text(json.dumps(theirs))
    assert not Lease(folder, "training x").try_acquire()[0]
    # a holder that named no process (a machine without /proc): waited out
    newest.write_text(json.dumps({**theirs, "process": None}))
    assert not Lease(folder, "training x").try_acquire()[0]


@pytest.mark.e2e
def test_two_runs_of_one_config_at_once_never_write_the_same_run_folder_together(tmp_path, prefect_api):
    """Two `shardline run` of the same config on one storage root: the second waits while the first holds
    the run folder's lease, then takes its finished result; one model version, no step logged twice. The first is
    held (SIGSTOP) while the second reaches its lease (was: each of its steps slept 2.5 s to make room: 75 s)."""
    make_raw(tmp_path / "raw", n_seq=9, rows=60)
    cfg = tiny_config(str(tmp_path / "raw" / "*.parquet"), str(tmp_path / "store"), **{"training.epochs": 2})
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    env = api_env()  # the session's Prefect API, not a temporary server for each run

    def start(step_delay: str, out) -> subprocess.Popen:
        return subprocess.Popen(
            [str(BIN), "run", str(tmp_path / "cfg.yaml")],
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            env={**env, "SHARDLINE_TEST_STEP_DELAY": step_delay},
        )

    first = start("0.3", subprocess.PIPE)  # 18 steps: ~5 s of training
    deadline = time.monotonic() + 300
    while not list((tmp_path / "store" / "runs").glob("*/lease/gen-*.json")):
        assert first.poll() is None, first.stdout.read()[-3000:]
        assert time.monotonic() < deadline, "the first run never took its lease"
        time.sleep(0.2)
    # the first held (SIGSTOP: alive, its lease not yet past its ttl) until the second waits on its lease
    os.kill(first.pid, signal.SIGSTOP)
    try:
        with open(tmp_path / "second.log", "w") as log:
            second = start("0", log)
            while "is being trained by training" not in (tmp_path / "second.log").read_text():
                assert second.poll() is None, (tmp_path / "second.log").read_text()[-3000:]
                assert time.monotonic() < deadline, "the second run never reached the first run's lease"
                time.sleep(0.2)
    finally:
        os.kill(first.pid, signal.SIGCONT)
    out1, _ = first.communicate(timeout=600)
    second.wait(timeout=600)
    out2 = (tmp_path / "second.log").read_text()
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


def test_the_lease_ttl_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLINE_LEASE_TTL", "12")
    lease = Lease(str(tmp_path / "lease"), "training x", holder={"flow_run": "abc"})
    lease.acquire()
    try:
        record = read_current(str(tmp_path / "lease"))[1]
        assert record["ttl"] == 12 and record["flow_run"] == "abc"
        assert 10 < record["expires_at"] - time.time() <= 12
    finally:
        lease.release()
    monkeypatch.setenv("SHARDLINE_LEASE_TTL", "soon")
    with pytest.raises(ValueError, match="SHARDLINE_LEASE_TTL='soon' is not a number of seconds"):
        Lease(str(tmp_path / "lease"), "training x")
    monkeypatch.setenv("SHARDLINE_LEASE_TTL", "1")
    with pytest.raises(ValueError, match=r"SHARDLINE_LEASE_TTL=.1. must be 3 or more \(seconds\)"):
        Lease(str(tmp_path / "lease"), "training x")


def test_a_lease_silent_past_its_ttl_is_seen_as_a_gone_holder_by_its_flow_run_only(tmp_path):
    """What the train step and node 0 watch: the lease a flow run took, unchanged for longer than its ttl by the
    watcher's own clock (its holder renews it every third of the ttl while it lives)."""
    from shardline.core.lease import Silence

    folder = str(tmp_path / "lease")
    holder = Lease(folder, "training x", ttl=3, holder={"flow_run": "run-1"})
    holder.acquire()
    mine, other = Silence(folder, "run-1"), Silence(folder, "run-2")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:  # renewed every second: never silent
        assert mine.check() is None
        time.sleep(0.2)
    holder._stop.set()  # its process frozen: no renewal, no release
    holder._thread.join(5)
    deadline = time.monotonic() + 10
    while (said := mine.check()) is None:
        assert time.monotonic() < deadline, "the silent lease was never seen"
        time.sleep(0.2)
    assert "was not renewed for" in said and "(ttl 3 s)" in said and "training x" in said
    assert other.check() is None and other.check() is None  # another flow run's watcher: not its lease
    holder.release()  # released (its run ended): not silent
    assert mine.check() is None
