"""Kill the whole pipeline process (SIGKILL, as a reclaimed machine would) and run the same command again."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from mlflow import MlflowClient

from shardline.core.encoding.contract import contract  # noqa: F401  (import check: the package is importable)
from shardline.core.encoding.write import verify_manifest
from shardline.trainer.checkpoint import load_checkpoint
from tests.conftest import api_env, make_raw, tiny_config

pytestmark = pytest.mark.e2e
BIN = Path(sys.executable).parent / "shardline"


def start(config: Path, **extra: str) -> subprocess.Popen:
    """`shardline run CONFIG` in a session of its own (a terminal's foreground group), with Prefect's ephemeral
    API as on a laptop; every process it starts carries `SHARDLINE_TEST_RUN=<config>` in its environment."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PREFECT_SERVER_ANALYTICS_ENABLED="false", SHARDLINE_TEST_RUN=str(config), **extra)
    return subprocess.Popen(
        [str(BIN), "run", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        env=env,
    )


def processes_of(config: Path) -> list[int]:
    """The live processes `start(config)` started, found by their environment (a child in a session of its own
    too)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and f"SHARDLINE_TEST_RUN={config}".encode() in (entry / "environ").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def kill_when(proc: subprocess.Popen, ready, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if proc.poll() is not None:
            pytest.fail(f"the run ended before it could be killed:\n{proc.stdout.read()[-3000:]}")
        if time.monotonic() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            pytest.fail("timed out waiting for the moment to kill")
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)  # the flow process and its temporary Prefect server
    proc.wait()


def finish(config: Path, reference: bool = False) -> str:
    """`shardline run CONFIG` to its end, as a user reruns it (Prefect's ephemeral API); a `reference` run (the
    uninterrupted one the killed run is compared with) talks to the session's Prefect API instead (the
    prefect_api fixture): it is not what the test is about, and a temporary server costs ~5 s of CPU."""
    out = subprocess.run(
        [str(BIN), "run", str(config)],
        capture_output=True,
        text=True,
        timeout=600,
        env=api_env() if reference else {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"},
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout


def write_config(tmp_path: Path, root: str, **over) -> Path:
    cfg = tiny_config(str(tmp_path / "raw" / "*.parquet"), str(tmp_path / root), **over)
    path = tmp_path / f"{root}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_killed_during_training_resumes_to_the_same_weights(tmp_path, prefect_api):
    make_raw(tmp_path / "raw", n_seq=12, rows=300)
    over = {"training.epochs": 3, "training.batch_size": 16, "training.checkpoint_every_steps": 20, "model.hidden": 64}
    killed, clean = write_config(tmp_path, "killed", **over), write_config(tmp_path, "clean", **over)

    # first a spot notice (SIGTERM) while the training starts (its tracker, data and model set up, no step yet): it
    # stops at its first step, at a checkpoint, and exits as preempted (before, Prefect's TerminationSignal was
    # raised wherever the process was: a crash with nothing saved, or, inside a weakref's callback, dropped)
    held = tmp_path / "training-started"
    proc = start(killed, SHARDLINE_TEST_START_MARK=str(held))
    deadline = time.monotonic() + 240
    while not held.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 75, out[-3000:]
    assert "training stopped by SIGTERM; checkpoint saved at " in out and "ckpt-000000001" in out, out[-3000:]

    # then Ctrl-C: the terminal's SIGINT to the whole foreground group, Prefect's temporary API server
    # included (it used to stop with it, and the run then waited minutes on its address) -> a checkpoint
    # and the distinct "preempted" exit status within seconds, the server stopped at exit
    proc = start(killed)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:  # a checkpoint of this attempt's
        if {p.name for p in (tmp_path / "killed").glob("runs/*/checkpoints/ckpt-*.json")} - {"ckpt-000000001.json"}:
            break
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGINT)
    interrupted = time.monotonic()
    try:
        code = proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"still running 60 s after Ctrl-C:\n{proc.communicate()[0][-3000:]}")
    out = proc.stdout.read()
    assert code == 75 and time.monotonic() - interrupted < 30, (code, time.monotonic() - interrupted, out[-3000:])
    (said,) = [line for line in out.splitlines() if line.startswith("stopped: ")]  # a stop asked for: no error
    assert "training stopped by SIGINT; checkpoint saved at " in said and said.endswith("run again to resume")
    assert "Traceback" not in out, out[-3000:]  # a stop the user asked for is said once, by that line
    assert Path(said.split("checkpoint saved at ")[1].split(": run again")[0]).is_file()
    client = MlflowClient(f"sqlite:///{tmp_path / 'killed' / 'mlflow.db'}")
    (run,) = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert run.info.status == "KILLED"
    gone = time.monotonic() + 10
    while processes_of(killed) and time.monotonic() < gone:
        time.sleep(0.2)
    assert not processes_of(killed), "a process of the run (its Prefect server?) outlived it"

    # then the machine disappears: SIGKILL of the resumed run, mid-training
    proc = start(killed)
    kill_when(proc, lambda: list((tmp_path / "killed").glob("runs/*/checkpoints/ckpt-000000060.json")))
    assert not list((tmp_path / "killed").glob("runs/*/eval")), "the kill came after training: nothing was tested"
    out = finish(killed)
    assert "steps: ingest cached, encode cached, train ran, evaluate ran, register ran" in out
    finish(clean, reference=True)

    def best_weights(root: str):
        best = sorted((tmp_path / root).glob("runs/*/checkpoints/best.json"))[0]
        return load_checkpoint(str(best.parent / yaml.safe_load(best.read_text())["file"]))["model"]

    resumed, reference = best_weights("killed"), best_weights("clean")
    assert resumed.keys() == reference.keys()
    assert all(torch.equal(resumed[k], reference[k]) for k in reference)

    # one MLflow run, finished, with every step logged once
    runs = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert [r.info.status for r in runs] == ["FINISHED"]
    steps = [m.step for m in client.get_metric_history(runs[0].info.run_id, "train/train_loss")]
    assert steps == sorted(set(steps)) and len(steps) > 5
    assert [m.step for m in client.get_metric_history(runs[0].info.run_id, "epoch/val_loss")] == [1, 2, 3]


def test_killed_during_encode_leaves_nothing_a_rerun_trusts(tmp_path, prefect_api):
    make_raw(tmp_path / "raw", n_seq=120, rows=120)  # 40 files
    over = {"data.files_per_group": 1, "training.epochs": 1}
    killed, clean = write_config(tmp_path, "killed", **over), write_config(tmp_path, "clean", **over)

    proc = start(killed)
    kill_when(proc, lambda: len(list((tmp_path / "killed").glob("datasets/groups/*/*.bin.lz4"))) >= 3)
    assert not list((tmp_path / "killed").glob("datasets/*/manifest.json")), (
        "the kill came after encoding: nothing was tested"
    )
    assert len(list((tmp_path / "killed").glob("datasets/groups/*/*.bin.lz4"))) < 40 * 3

    finish(killed)
    finish(clean, reference=True)
    manifest_path = next((tmp_path / "killed").glob("datasets/*/manifest.json"))
    manifest = verify_manifest(str(manifest_path), deep=True)
    assert manifest is not None  # every shard it lists is there with its checksum
    reference = verify_manifest(str(next((tmp_path / "clean").glob("datasets/*/manifest.json"))), deep=True)
    assert [(s.path, s.sha256) for s in manifest.shards] == [(s.path, s.sha256) for s in reference.shards]
    # whatever a killed writer left behind is a temporary name no manifest lists (shards lie in the group
    # store, each group's folder holding its shards, their keys files and its record, written last)
    listed = {s.path for s in manifest.shards} | {s.keys_path for s in manifest.shards}
    listed |= {f"{p.rsplit('/', 1)[0]}/group.json" for p in listed}
    store = manifest_path.parent.parent / "groups"
    assert all(p.name == "manifest.json" or p.name.startswith(".tmp-") for p in manifest_path.parent.iterdir())
    assert all(
        f"../groups/{p.relative_to(store)}" in listed or p.name.startswith(".tmp-")
        for p in store.rglob("*")
        if p.is_file()
    )
