"""The team loop on 127.0.0.1: a Prefect server, a process worker for the CPU pool and two for the GPU
pool, deployments from prefect.yaml, the storage root in S3 (moto's server, through s3fs), MLflow on
SQLite with its artifacts in that S3. Run alone with `pytest -m remote`.

1. `prefect deployment run pipeline/pipeline` trains in the GPU pool's worker, registers a model whose
   artifacts are in S3 (downloaded back here), and a second run is fully cached.
2. The training flow's process is SIGKILLed mid-run, as a reclaimed spot instance would be, then the
   second attempt's machine goes silent: the pipeline dispatches it again each time, it resumes from
   its checkpoint in S3, and ends with the same weights as the uninterrupted run of test 1.
3. Several machines (`compute.nodes: 2`, torch's elastic agents at one c10d rendezvous): together, then a node
   lost whole (the training fails within the join timeout and is dispatched again); a node that never starts;
   rehearse (node 0 preempted).
4. `shardline doctor` on the cluster: the GPU probe runs on the GPU pool; a pool with no live worker is named.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
from pathlib import Path

import httpx
import pytest
import yaml

from tests.cluster import BIN, BUCKET, REPO, Cluster, wait_until
from tests.conftest import tiny_config
from tests.test_doctor import doctor

pytestmark = [pytest.mark.e2e, pytest.mark.remote]


def write_config(c: Cluster, name: str, **over) -> Path:
    cfg = tiny_config(f"s3://{BUCKET}/raw/*.parquet", f"s3://{BUCKET}/{name}", **{"training.epochs": 3, **over})
    cfg["mlflow"] = {
        "tracking_uri": f"sqlite:///{c.base / name}-mlflow.db",
        "experiment": name,
        "model_name": f"{name}-model",
    }
    cfg["compute"] = {
        "train_on": "deployment",
        "train_deployment": "train/train",
        "poll_seconds": 1,
        "max_preemptions": 2,
        "dispatch_timeout_seconds": 400,
        **cfg.get("compute", {}),
    }
    path = c.base / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_pipeline(c: Cluster, config: Path) -> dict:
    """`prefect deployment run pipeline/pipeline -p config=...`, watched to its end; the pipeline's flow run."""
    before = {r["id"] for r in c.flow_runs()}
    c.prefect(
        "deployment",
        "run",
        "pipeline/pipeline",
        "-p",
        f"config={config}",
        "--watch",
        "--watch-interval",
        "1",
        timeout=600,
    )
    new = [r for r in c.flow_runs() if r["id"] not in before]
    (pipeline_run,) = [r for r in new if r["work_pool_name"] == "cpu-pool"]
    assert pipeline_run["state_type"] == "COMPLETED", (pipeline_run["state"], c.tail_logs())
    return {"run": pipeline_run, "new": new}


def s3_env(monkeypatch, c: Cluster) -> None:
    for k in (
        "AWS_ENDPOINT_URL",
        "MLFLOW_S3_ENDPOINT_URL",
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_DEFAULT_REGION",
    ):
        monkeypatch.setenv(k, c.env[k])


# planted in the uninterrupted run's training job (test_planted_secrets_never_leave_the_process_on_the_cluster)
SECRET, LABEL, MARKER = "PLANTED-CLUSTER-SECRET-5151", "PLANTED-RUN-LABEL-6262", "public-cluster-marker-77"


@pytest.fixture(scope="module")
def reference(cluster):
    """The uninterrupted run: its pipeline flow run and the run's final checkpoint in S3. Its config's name is a
    public marker, and its training job's environment (the config's job variables) holds two values that are
    secrets, whatever their names say."""
    config = write_config(
        cluster, "store-a", compute={"job_variables": {"env": {"PLANTED_API_TOKEN": SECRET, "RUN_LABEL": LABEL}}}
    )
    cfg = yaml.safe_load(config.read_text())
    config.write_text(yaml.safe_dump({**cfg, "name": MARKER}))
    return run_pipeline(cluster, config)


def final_weights(root: str):
    from shardline.trainer.checkpoint import latest_checkpoint, load_checkpoint

    (runs,) = [p for p in _ls(root + "/runs")]
    uri, side = latest_checkpoint(f"s3://{runs}/checkpoints")
    return side, load_checkpoint(uri)["model"]


def _ls(uri: str) -> list[str]:
    import s3fs

    return s3fs.S3FileSystem(skip_instance_cache=True).ls(uri.removeprefix("s3://"))


def test_deployment_run_trains_on_the_gpu_pool_registers_to_s3_and_reruns_cached(
    cluster, reference, monkeypatch, tmp_path
):
    import mlflow
    from mlflow import MlflowClient

    from shardline.core.tracking.tracker import fluent_tracking_uri

    s3_env(monkeypatch, cluster)
    first = reference
    (train_run,) = [r for r in first["new"] if r["work_pool_name"] == "gpu-pool"]
    assert train_run["state_type"] == "COMPLETED"
    assert train_run["parent_task_run_id"] is not None  # a subflow of the pipeline's train step
    assert {"shardline"} <= set(train_run["tags"])

    uri = f"sqlite:///{cluster.base / 'store-a'}-mlflow.db"
    client = MlflowClient(uri)
    version = client.get_model_version_by_alias("store-a-model", "champion")
    assert int(version.version) == 1
    logged = client.get_logged_model(version.source.removeprefix("models:/"))
    assert logged.artifact_location.startswith(f"s3://{BUCKET}/store-a/mlflow-artifacts/")
    assert "MLmodel" in {p.rsplit("/", 1)[-1] for p in _ls(logged.artifact_location)}
    run = client.get_run(version.run_id)
    assert run.info.status == "FINISHED" and run.data.metrics["test/accuracy"] > 0.9
    assert run.info.artifact_uri.startswith(f"s3://{BUCKET}/store-a/")

    # the registered model comes back from S3 and predicts raw rows
    import polars as pl

    raw = pl.read_parquet(cluster.base / "raw" / "s-000.parquet")
    with fluent_tracking_uri(uri):
        served = mlflow.pyfunc.load_model("models:/store-a-model@champion").predict(raw.drop("label").to_pandas())
    # 3 sequences in the file, each with 3 rows of history before its first prediction
    assert len(served) == raw.height - 3 * 3 and {"seq", "t", "prediction"} <= set(served.columns)

    # the same deployment run again: every step cached, no training dispatched
    second = run_pipeline(cluster, cluster.base / "store-a.yaml")
    assert [r["work_pool_name"] for r in second["new"]] == ["cpu-pool"]
    states = {t["name"].rsplit("-", 1)[0]: t["state"]["name"] for t in cluster.task_runs(second["run"]["id"], final=4)}
    assert states and set(states.values()) == {"Cached"}, states
    assert {"ingest", "train", "evaluate", "register"} <= set(states)


def slow_training_under_way(c: Cluster, name: str, **env: str) -> tuple[set, subprocess.Popen, dict, int]:
    """The pipeline started on a config whose every optimizer step sleeps 0.2 s in the training process (a test
    hook set through the job variables, with `env`), so that what the test does lands mid-run; once its
    training run is RUNNING on the GPU pool and has a checkpoint of step 10 or later in S3: the flow runs
    before it, the watcher, the training run and that checkpoint's step."""
    env = {"SHARDLINE_TEST_STEP_DELAY": "0.2", **env}
    config = write_config(c, name, **{"compute": {"job_variables": {"env": env}}})
    before = {r["id"] for r in c.flow_runs()}
    watcher = start_pipeline(c, config)

    def running_train():
        runs = [r for r in c.flow_runs() if r["id"] not in before and r["work_pool_name"] == "gpu-pool"]
        return next((r for r in runs if r["state_type"] == "RUNNING"), None)

    train_run = wait_until(running_train, 240, "the training flow run to start on the GPU pool")
    return before, watcher, train_run, checkpoint_of_step(f"s3://{BUCKET}/{name}", 10)


def test_the_training_machine_lost_twice_its_process_killed_then_the_machine_silent_and_it_resumes_exactly(
    cluster, reference, monkeypatch
):
    """Two faults in one training, each dispatched again and resumed from the checkpoint in S3; the last attempt
    ends with the uninterrupted run's (test 1) weights to the bit.

    First the training flow's process SIGKILLed, as a reclaimed spot instance would be: the run ends Crashed.
    Then the second attempt's whole machine gone at once (a spot machine reclaimed with no notice, a host powered
    off): its flow process and its worker frozen with SIGSTOP, so that nothing exits, reports a state or renews the
    lease. Prefect keeps that run RUNNING (was: the pipeline waited for it forever). The train step sees the run's
    lease silent past its ttl (SHARDLINE_LEASE_TTL=8, through the job variables), sets the run Crashed and
    dispatches it again, to the other worker."""
    import torch

    s3_env(monkeypatch, cluster)
    root = f"s3://{BUCKET}/store-b"
    before, watcher, train_run, _ = slow_training_under_way(cluster, "store-b", SHARDLINE_LEASE_TTL="8")
    pids = processes_of_flow_run(train_run["id"])
    assert pids, "found no process running the training flow run"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)

    def running_again():
        runs = [r for r in cluster.flow_runs() if r["id"] not in before and r["work_pool_name"] == "gpu-pool"]
        return next((r for r in runs if r["state_type"] == "RUNNING" and r["id"] != train_run["id"]), None)

    second = wait_until(running_again, 240, "the training to be dispatched again after its process was killed")
    resumed_at = checkpoint_of_step(root, 0)
    frozen_after = checkpoint_of_step(root, resumed_at + 1)  # the second attempt has trained past where it resumed
    pids = processes_of_flow_run(second["id"])
    assert pids, "found no process running the second training flow run"
    workers = {parent_of(pid) for pid in pids} - set(pids)  # the worker that started the flow's process
    assert len(workers) == 1, workers
    for pid in [*pids, *workers]:
        os.kill(pid, signal.SIGSTOP)
    try:
        # the machine is gone for good once the train step has given up on it: its processes die with it. Frozen
        # longer, the flow's process might hold a write lock on this test's MLflow SQLite file, which a third
        # machine shares here only (the team setup's tracking server owns its database)
        runs = cluster.flow_runs
        wait_until(
            lambda: next((r for r in runs() if r["id"] == second["id"] and r["state_type"] == "CRASHED"), None),
            180,
            "the train step to set the silent training run Crashed",
            every=0.2,
        )
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        for pid in workers:  # back for the other tests
            os.kill(pid, signal.SIGCONT)
    out, _ = watcher.communicate(timeout=500)
    assert watcher.returncode == 0, out[-3000:] + cluster.tail_logs()
    new = [r for r in cluster.flow_runs() if r["id"] not in before]
    trains = [r for r in new if r["work_pool_name"] == "gpu-pool"]
    ends = [r["state_type"] for r in trains]
    assert ends == ["CRASHED", "CRASHED", "COMPLETED"], [(r["name"], r["state"]) for r in trains]
    assert trains[1]["id"] == second["id"]
    message = trains[1]["state"]["message"]
    assert "lease" in message and "was not renewed" in message and "ttl 8 s" in message, message
    (pipeline_run,) = [r for r in new if r["work_pool_name"] == "cpu-pool"]
    assert pipeline_run["state_type"] == "COMPLETED"

    side_b, weights_b = final_weights(root)
    side_a, weights_a = final_weights(f"s3://{BUCKET}/store-a")
    assert side_b["step"] == side_a["step"] > frozen_after
    assert weights_b.keys() == weights_a.keys()
    for k in weights_a:
        assert torch.equal(weights_a[k], weights_b[k]), k
    assert side_b["best_score"] == side_a["best_score"]
    # the last dispatch resumed from the checkpoint the frozen one left in S3
    result = json.loads(cluster.fs.cat(f"{_ls(f'{root}/runs')[0]}/result.json"))
    assert result["resumed_from"].startswith(f"{root}/runs/")


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def slow_two_nodes(c: Cluster, name: str, join_timeout_seconds: float = 600, **env: str) -> Path:
    """A config of two nodes of one process on this machine, each step 0.2 s slower (a test hook set through the
    job variables, with `env`), so that a kill lands mid-run."""
    compute = {
        "nodes": 2,
        "processes_per_node": 1,
        "master_addr": "127.0.0.1",
        "join_timeout_seconds": join_timeout_seconds,
        "job_variables": {"env": {"SHARDLINE_TEST_STEP_DELAY": "0.2", **env}},
    }
    return write_config(c, name, **{"compute": compute, "training.device": "cpu"})


def start_pipeline(c: Cluster, config: Path) -> subprocess.Popen:
    """`prefect deployment run pipeline/pipeline -p config=... --watch`, left running."""
    command = ["deployment", "run", "pipeline/pipeline", "-p", f"config={config}", "--watch", "--watch-interval", "1"]
    return subprocess.Popen(
        [str(BIN / "prefect"), *command], cwd=REPO, env=c.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True,
    )  # fmt: skip


def checkpoint_of_step(root: str, step: int) -> int:
    """Wait for the run under `root` to have a checkpoint of `step` or later in S3; its step."""

    def newest():
        try:
            (runs,) = _ls(f"{root}/runs")
            names = [p.rsplit("/", 1)[-1] for p in _ls(f"s3://{runs}/checkpoints")]
        except (FileNotFoundError, ValueError):
            return None
        steps = [int(n[5:14]) for n in names if n.startswith("ckpt-") and n.endswith(".json")]
        return max(steps) if steps and max(steps) >= step else None

    return wait_until(newest, 240, f"a checkpoint of step >= {step} in {root}", every=0.2)


def processes_of_flow_run(flow_run_id: str) -> list[int]:
    """The pids whose environment names the flow run: the process a worker started for it."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"PREFECT__FLOW_RUN_ID={flow_run_id}".encode() in environ:
            found.append(int(entry.name))
    return found


def test_rehearse_on_two_nodes_preempts_and_resumes_both(cluster):
    """`shardline rehearse` runs the first loop on the GPU pool with a forced preemption, here of a config of two
    machines: the SIGTERM stops both nodes at one step, the training run ends Failed (Preempted) and is
    re-dispatched, which starts node 1 again and resumes from the checkpoint in S3; the checkpoint says both
    trained (world size 2)."""
    config = write_config(
        cluster, "store-rn", **{"compute": {"nodes": 2, "master_addr": "127.0.0.1"}, "training.device": "cpu"}
    )
    before = {r["id"] for r in cluster.flow_runs()}
    out = subprocess.run(
        [str(BIN / "shardline"), "rehearse", str(config), "--files", "4", "--steps", "12"],
        cwd=REPO, env=cluster.env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr[-5000:] + cluster.tail_logs()
    table = [line for line in out.stdout.splitlines() if line.startswith(("PASS", "FAIL"))]
    assert len(table) == 11 and all(line.startswith("PASS") for line in table), out.stdout
    checkpoint = next(line for line in table if line.startswith("PASS  checkpoint"))
    assert "(world size 2 of 2 node(s) x 1 process(es))" in checkpoint, checkpoint
    preemption = next(line for line in table if "preemption: SIGTERM" in line)
    assert "ended Failed at step 6; re-dispatched, resumed from s3://" in preemption, preemption
    trains = [r for r in cluster.flow_runs() if r["id"] not in before and r["work_pool_name"] == "gpu-pool"]
    trains = [r for r in trains if "endpoint" not in r["parameters"]]
    assert [r["state_type"] for r in trains] == ["FAILED", "COMPLETED"], [(r["name"], r["state"]) for r in trains]
    assert "Preempted" in trains[0]["state"]["message"]
    nodes = [r for r in cluster.flow_runs() if r["id"] not in before and "endpoint" in r["parameters"]]
    # one node 1 per attempt: stopped with node 0 at the SIGTERM (its part done), then to the end
    assert [r["state_type"] for r in nodes] == ["COMPLETED", "COMPLETED"], [(r["name"], r["state"]) for r in nodes]


def test_planted_secrets_never_leave_the_process_on_the_cluster(cluster, reference):
    """A credential in the training job's environment (the uninterrupted run's job variables): once the pipeline
    has run on the loopback cluster (Prefect server, process workers, S3), the Prefect API's objects (flow and
    task runs with their parameters and states, logs, artifacts), every object under the storage root, the
    MLflow store and the workers' output are searched for it. Job variables themselves go to the worker
    (that is how its process gets them), so that one field is left out of the search."""
    ids = [r["id"] for r in reference["new"]]
    api = [{k: v for k, v in r.items() if k != "job_variables"} for r in reference["new"]]
    api += [cluster.task_runs(i, final=0) for i in ids]  # a training flow run has no task runs
    api += cluster.post("/logs/filter", {"logs": {"flow_run_id": {"any_": ids}}})
    api += cluster.post("/artifacts/filter", {})
    places = {"Prefect API": json.dumps(api, default=str)}
    for path in cluster.fs.find(f"{BUCKET}/store-a"):
        places[f"s3://{path}"] = cluster.fs.cat(path).decode("latin-1")
    places["MLflow store"] = (cluster.base / "store-a-mlflow.db").read_bytes().decode("latin-1")
    for log in cluster.logs.glob("*.log"):
        places[log.name] = log.read_text(errors="replace")
    assert [where for where, text in places.items() if SECRET in text or LABEL in text] == []
    # the search reaches what the run wrote: the config's public name is in the training run's parameters
    assert MARKER in places["Prefect API"]
    assert any(where.startswith("s3://") and "/runs/" in where for where in places)


def test_a_sweep_deployment_dispatches_each_trial_to_the_gpu_pool_and_registers_the_best(cluster, monkeypatch):
    """`prefect deployment run sweep/sweep` on the CPU pool: each trial is a flow run of the training
    deployment on the GPU pool, the two at once on the pool's two workers (one run each), nested in MLflow
    under the sweep's run; the best is registered and tagged."""
    from datetime import datetime

    from mlflow import MlflowClient

    s3_env(monkeypatch, cluster)
    # each optimizer step sleeps 0.1 s (about 2 s a trial), so that two trials in flight are seen in flight
    slow = {"compute": {"job_variables": {"env": {"SHARDLINE_TEST_STEP_DELAY": "0.1"}}}}
    config = write_config(cluster, "store-w", **{"training.epochs": 1, **slow})
    space = cluster.base / "space-w.yaml"
    space.write_text(yaml.safe_dump({"model.hidden": [8, 32]}))
    before = {r["id"] for r in cluster.flow_runs()}
    cluster.prefect(
        "deployment", "run", "sweep/sweep", "-p", f"config={config}", "-p", f"space={space}",
        "--watch", "--watch-interval", "1", timeout=600,
    )  # fmt: skip
    new = [r for r in cluster.flow_runs() if r["id"] not in before]
    (sweep_run,) = [r for r in new if r["work_pool_name"] == "cpu-pool"]
    assert sweep_run["state_type"] == "COMPLETED", (sweep_run["state"], cluster.tail_logs())
    trains = [r for r in new if r["work_pool_name"] == "gpu-pool"]
    assert len(trains) == 2 and {r["state_type"] for r in trains} == {"COMPLETED"}
    assert all(r["parent_task_run_id"] is not None for r in trains)  # each dispatched by its trial's train step
    # two at once: each was Running while the other was, on a worker of its own
    (a_start, a_end), (b_start, b_end) = [
        (datetime.fromisoformat(r["start_time"]), datetime.fromisoformat(r["end_time"])) for r in trains
    ]
    assert a_start < b_end and b_start < a_end, [(r["name"], r["start_time"], r["end_time"]) for r in trains]
    workers = sorted(r["labels"].get("prefect.worker.name") for r in trains)
    assert workers == ["gpu-pool-w1", "gpu-pool-w2"], workers

    client = MlflowClient(f"sqlite:///{cluster.base / 'store-w'}-mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("store-w").experiment_id])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(r.data.tags["shardline.sweep.trial"] for r in children) == ["t1", "t2"]
    assert {r.info.status for r in children} == {"FINISHED"}
    assert {a.path for a in client.list_artifacts(parent.info.run_id, "sweep")} == {"sweep/comparison.png"}
    version = client.get_model_version("store-w-model", "1")
    assert version.tags["shardline.sweep"] == parent.info.run_id
    assert version.run_id in {r.info.run_id for r in children}


def test_two_nodes_train_together_then_node_1_lost_whole_fails_within_the_join_timeout_and_is_dispatched_again(
    cluster, reference, monkeypatch
):
    """compute.nodes: 2 on the GPU pool's two workers (two machines here): the training run is node 0, hosts the
    rendezvous' store and starts node 1 as a flow run of train-node/train-node; their torchrun agents meet at the
    c10d rendezvous over TCP and train one DDP run of world size 2, rank 0's events and checkpoints in S3.

    Then node 1's machine is lost mid-training (its flow process, agent and rank SIGKILLed) with no replacement on
    the pool: node 0's rank fails on its lost peer, its agent starts the next round, which no node joins, and fails
    after compute.join_timeout_seconds (45 s here: the first rendezvous waits that long too, for node 1's flow run to
    be picked up and its agent to start, which took over 15 s on a slow, loaded 2-core machine). The training run
    fails on its infrastructure, is dispatched again with a new node 1, resumes from the checkpoint in S3 and ends
    on the one-node run's curve (the same global batches: not bit-identical, two half-batch means; that a resume of
    two ranks ends on the uninterrupted run's weights to the bit is tests/test_ddp.py's). No lease, attempt or
    launch file of ours is in the storage root."""
    import time

    import torch

    s3_env(monkeypatch, cluster)
    root = f"s3://{BUCKET}/store-rk"
    config = slow_two_nodes(cluster, "store-rk", join_timeout_seconds=45)
    before = {r["id"] for r in cluster.flow_runs()}
    watcher = start_pipeline(cluster, config)

    def new_runs():
        return [r for r in cluster.flow_runs() if r["id"] not in before]

    node_run = wait_until(
        lambda: next((r for r in new_runs() if "endpoint" in r["parameters"] and r["state_type"] == "RUNNING"), None),
        240,
        "node 1's flow run to start on the GPU pool",
    )
    lost_after = checkpoint_of_step(root, 5)
    pids = processes_of_flow_run(node_run["id"])  # its flow process, its agent and its rank
    assert len(pids) >= 3, pids
    began = time.monotonic()
    # the machine lost at once: all frozen first, then killed. Killed one by one, the flow process's death could
    # reach the agent (its parent-death SIGTERM) and through it the rank, which would tell node 0 at the next
    # step that it was stopped, before the test's SIGKILL to the rank landed (a loaded machine: seen once)
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
    out, _ = watcher.communicate(timeout=500)
    assert watcher.returncode == 0, out[-3000:] + cluster.tail_logs()
    new = new_runs()
    trains = [r for r in new if r["work_pool_name"] == "gpu-pool" and "endpoint" not in r["parameters"]]
    assert [r["state_type"] for r in trains] == ["FAILED", "COMPLETED"], [(r["name"], r["state"]) for r in trains]
    said = trains[0]["state"]["message"]
    assert "RendezvousTimeoutError" in said and "where a retry resumes" in said, said
    ended = trains[0]["end_time"]
    assert ended is not None and time.monotonic() - began < 400
    nodes = [r for r in new if r["work_pool_name"] == "gpu-pool" and "endpoint" in r["parameters"]]
    assert len(nodes) == 2 and nodes[-1]["state_type"] == "COMPLETED", [(r["name"], r["state"]) for r in nodes]
    assert all(r["parameters"]["endpoint"].startswith("127.0.0.1:") for r in nodes)
    assert all(r["parent_task_run_id"] is not None for r in nodes)  # shown under the training run in the Prefect UI
    side, weights = final_weights(root)
    side_a, weights_a = final_weights(f"s3://{BUCKET}/store-a")
    assert side["world_size"] == 2 and side_a.get("world_size", 1) == 1
    assert side["step"] == side_a["step"] > lost_after  # the same global batches
    for k in weights_a:  # the same curve within float rounding
        assert torch.allclose(weights[k], weights_a[k], rtol=1e-3, atol=1e-5), k
    result = json.loads(cluster.fs.cat(f"{_ls(f'{root}/runs')[0]}/result.json"))
    assert result["resumed_from"].startswith(f"{root}/runs/")
    files = cluster.fs.find(f"{BUCKET}/store-rk")
    ours = [p for p in files if any(w in p for w in ("/leases/", "/attempt", "/launches/", "/present/", "init.pt"))]
    assert ours == [], ours
    assert [p.rsplit("/", 1)[-1] for p in files if "/lease/" in p]  # the run folder's single-writer lock only
    (ledger,) = [p for p in files if p.endswith("/cost.json")]
    assert json.loads(cluster.fs.cat(ledger))["attempts"][-1]["gpus"] == 2  # both machines' (CPUs count as one)


def test_a_node_run_that_never_starts_fails_the_training_within_the_join_timeout_naming_it(cluster):
    """Node 1's flow run crashes before its agent ever joins (here its worker's command is `false`): node 0's
    rendezvous gives up after compute.join_timeout_seconds (20 s here), and the training fails naming
    compute.nodes, the node that came and the node run that crashed; not retried. Training runs here
    (train_on: local) against the cluster's API, so only the node run gets the command."""
    import time

    config = write_config(
        cluster,
        "store-f",
        **{
            "compute": {
                "train_on": "local",
                "nodes": 2,
                "master_addr": "127.0.0.1",
                "join_timeout_seconds": 20,
                "job_variables": {"command": "false"},
            },
            "training.device": "cpu",
        },
    )
    began = time.monotonic()
    out = subprocess.run(
        [str(BIN / "shardline"), "run", str(config)], cwd=REPO, env=cluster.env, capture_output=True, text=True,
        timeout=400,
    )  # fmt: skip
    said = out.stdout + out.stderr
    assert out.returncode != 0, said[-3000:]
    assert time.monotonic() - began < 240, said[-3000:]
    assert "compute.nodes=2, but the training's rendezvous did not complete" in said, said[-3000:]
    assert "1 node(s) came and waited" in said and "Crashed" in said, said[-3000:]


# ---------------------------------------------------------------- `shardline doctor` on the cluster
# (tests/test_doctor.py has its laptop and broken setups): here, on this module's cluster, not one more


def doctor_config(c: Cluster, name: str, **compute) -> Path:
    cfg = tiny_config(f"s3://{BUCKET}/raw/*.parquet", f"s3://{BUCKET}/{name}")
    cfg["mlflow"] = {
        "tracking_uri": f"sqlite:///{c.base / name}-mlflow.db",
        "experiment": name,
        "model_name": f"{name}-model",
    }
    cfg["compute"] = {"train_on": "deployment", "train_deployment": "train/train", **compute}
    path = c.base / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_doctor_on_the_cluster_runs_the_gpu_probe_on_the_gpu_pool(cluster):
    before = {r["id"] for r in cluster.flow_runs()}
    # a training on two machines: the node deployment its other node runs as is checked too
    out, rows = doctor(doctor_config(cluster, "store-doctor", nodes=2), cluster.env, timeout=600)
    assert list(rows) == [
        "config",
        "prefect api",
        "train deployment",
        "train pool",
        "node deployment",
        "pipeline deployment",
        "pipeline pool",
        "data source",
        "storage",
        "mlflow tracking",
        "mlflow registry",
        "torch (here)",
        "gpu probe",
    ], out.stdout
    failed = {k: v for k, v in rows.items() if not v.startswith("PASS")}
    # this machine has no GPU: the probe ran on the GPU pool's worker and says so; everything else passes
    assert list(failed) == ["gpu probe"] and out.returncode == 1, out.stdout + out.stderr[-3000:] + cluster.tail_logs()
    assert rows["prefect api"].startswith(f"PASS {cluster.api}: reachable, server version 3.")
    assert rows["train deployment"].startswith("PASS train/train on pool gpu-pool")
    assert "2 live worker(s): gpu-pool-w" in rows["train pool"]
    assert rows["node deployment"].startswith("PASS train-node/train-node on pool gpu-pool: gpu-pool (process): 2 live")
    assert "1 live worker(s): cpu-pool-w1 (last heartbeat" in rows["pipeline pool"]
    assert rows["storage"].startswith(
        f"PASS s3://{BUCKET}/store-doctor via {cluster.env['AWS_ENDPOINT_URL']}: wrote, read back"
    )
    assert not cluster.fs.exists(f"{BUCKET}/store-doctor/.doctor") or not cluster.fs.ls(
        f"{BUCKET}/store-doctor/.doctor"
    )
    assert "model store-doctor-model has no version yet" in rows["mlflow registry"]
    probe = rows["gpu probe"]
    assert probe.startswith("FAIL no GPU visible on gpu-pool's worker "), probe
    # this machine's torch: the CPU build (CI), or a CUDA build on a machine with no GPU (as on a misconfigured pool)
    import torch

    build = f"built for CUDA {torch.version.cuda} but sees no device" if torch.version.cuda else "a CPU-only build"
    assert f"training will run on CPU there; torch there is {build}" in probe and "no CUDA device visible" in probe
    (run,) = [r for r in cluster.flow_runs() if r["id"] not in before]
    assert run["work_pool_name"] == "gpu-pool" and run["state_type"] == "COMPLETED" and "doctor" in run["tags"]

    # training on the CPU is what the config asks for: then a GPU-less pool is no failure
    out, rows = doctor(doctor_config(cluster, "store-doctor"), cluster.env, "--set", "training.device=cpu", timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert (
        rows["gpu probe"].startswith("PASS probe/probe on gpu-pool")
        and "training.device=cpu -> cpu in fp32" in rows["gpu probe"]
    )


def test_doctor_names_a_pool_without_a_live_worker_and_does_not_wait_for_the_probe(cluster):
    cluster.prefect("work-pool", "create", "--type", "process", "idle-pool")
    cluster.prefect("--no-prompt", "deploy", "shardline/flows/train.py:train", "--name", "idle", "--pool", "idle-pool")
    out, rows = doctor(
        doctor_config(cluster, "store-doctor-idle", train_deployment="train/idle"), cluster.env, timeout=300
    )
    assert out.returncode == 1, out.stdout + out.stderr[-3000:]
    assert rows["train deployment"].startswith("PASS train/idle on pool idle-pool")
    assert rows["train pool"].startswith(
        "FAIL no worker has polled idle-pool in the last 90 s: start one with "
        "`prefect worker start --pool idle-pool` on each GPU machine"
    ), rows["train pool"]
    assert rows["gpu probe"] == "SKIP needs a live worker on idle-pool (see above)"


def test_the_nightly_retrain_turned_on_as_the_docs_say_is_scheduled(cluster):
    """prefect.yaml's nightly retrain of the pipeline deployment, resumed with `prefect deployment schedule resume`
    (docs/team-setup.md): Prefect's scheduler makes its runs. With SQLAlchemy 2.1 the scheduler failed on every
    loop ("Can't evaluate bulk DML statement") and no run was ever made, while the schedule showed as active."""
    deployment = httpx.get(f"{cluster.api}/deployments/name/pipeline/pipeline", timeout=30).json()
    (nightly,) = [s for s in deployment["schedules"] if s["schedule"].get("cron") == "0 3 * * *"]
    assert not nightly["active"]
    cluster.prefect("deployment", "schedule", "resume", "pipeline/pipeline", nightly["id"])
    try:
        scheduled = {"deployment_id": {"any_": [deployment["id"]]}, "state": {"type": {"any_": ["SCHEDULED"]}}}
        runs = wait_until(lambda: cluster.flow_runs(**scheduled), 60, "the nightly retrain's scheduled runs")
        assert all(r["expected_start_time"][11:16] == "03:00" for r in runs), [r["expected_start_time"] for r in runs]
    finally:
        cluster.prefect("deployment", "schedule", "pause", "pipeline/pipeline", nightly["id"])
        for r in cluster.flow_runs(**scheduled):
            httpx.delete(f"{cluster.api}/flow_runs/{r['id']}", timeout=30)
    assert "bulk DML" not in (cluster.logs / "server.log").read_text()
