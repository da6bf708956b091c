"""Training in several processes on torch's elastic agent, on this machine's CPU: gloo processes.

Real processes, real torch.distributed: `python -m shardline.trainer.torchrun --standalone --nproc-per-node 2
tests/_ddp_child.py JOB.json` (shardline/trainer/ddp_run.py's `run_job` on two shard files), and two agents on
127.0.0.1 as two nodes meeting at a c10d rendezvous whose store this process hosts (as the training run does).
At the same global batch, the 2-process run follows the 1-process loss curve step by step; a SIGTERM to one rank
stops both with one checkpoint; a rank killed is a restart round of torch's, and a node lost whole is mended by
torch's next round with its replacement, both ending on the uninterrupted run's weights to the bit; a node that
never comes fails the training within the join timeout, naming the nodes that came.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from shardline.core.config import ComputeConfig, ModelConfig
from shardline.launch.torchrun import NodesMissing, RankFailed, Store, outcome, torchrun_command
from shardline.trainer.checkpoint import latest_checkpoint, load_checkpoint
from shardline.trainer.data import WindowLoader
from shardline.trainer.loop import ANOTHER_PROCESS, TIMING_KEYS, Preempted
from shardline.trainer.models import model_spec
from tests.net import free_port
from tests.test_resume_kill import CARDS, HORIZON, N_CLASSES, WINDOW, shards  # noqa: F401 (a fixture)

CHILD = Path(__file__).with_name("_ddp_child.py")
STEPS = 60  # 2 epochs x 30 steps: 1,920 train windows / global batch 64
WAIT = 120


def job(tmp: Path, folder: Path, label: str, ckpt: Path, dropout: float = 0.0, **rendezvous) -> Path:
    spec = {
        "shards": str(folder),
        "window": WINDOW,
        "horizon": HORIZON,
        "model_spec": model_spec(ModelConfig(hidden=32, layers=2, dropout=dropout), 2, CARDS, WINDOW, N_CLASSES),
        "training": dict(
            epochs=2,
            batch_size=64,
            lr=1e-2,
            warmup_steps=5,
            device="cpu",
            precision="fp32",
            seed=3,
            checkpoint_every_steps=7,
            checkpoint_every_seconds=0,
            keep_checkpoints=2,
        ),
        "task": "classification",
        "ckpt_dir": str(ckpt),
        "events": str(tmp / f"{label}-events"),
        "result": str(tmp / f"{label}-result.json"),
        "errors": str(tmp / f"{label}-errors"),
        "step_every": 1,
        "collective_timeout": 60,
        "rendezvous": {"nodes": 1, "processes_per_node": 2, "max_restarts": 0, "join_timeout": 20, "id": label,
                       **rendezvous},
    }  # fmt: skip
    path = tmp / f"{label}-job.json"
    path.write_text(json.dumps(spec))
    return path


def start(job_path: Path, processes: int, step_delay: float = 0.0, **env_vars: str) -> subprocess.Popen:
    env = {**os.environ, "SHARDLINE_TEST_STEP_DELAY": str(step_delay), **env_vars}
    record = str(job_path.with_suffix(".record.json"))
    agent = str(job_path.with_suffix(".agent"))
    launcher = [
        *torchrun_command(30, record, agent),
        "--standalone",
        f"--nproc-per-node={processes}",
        "--max-restarts=0",
    ]
    return subprocess.Popen(
        [*(launcher if processes > 1 else [sys.executable]), str(CHILD), str(job_path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def node(job_path: Path, endpoint: str, name: str, step_delay: float = 0.0) -> subprocess.Popen:
    """One machine's agent of the job's training on two nodes (as `shardline node` runs it), in its own session
    (killed whole, as a lost machine)."""
    spec = json.loads(job_path.read_text())
    r = spec["rendezvous"]
    record = str(Path(spec["errors"]) / f"{name}.json")
    Path(spec["errors"]).mkdir(exist_ok=True)
    conf = f"join_timeout={r['join_timeout']},is_host=false"
    agent = str(job_path.with_suffix(f".{name}.agent"))
    command = [
        *torchrun_command(30, record, agent), "--nnodes=2", "--nproc-per-node=1", f"--max-restarts={r['max_restarts']}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={r['id']}", f"--rdzv-conf={conf}",
        "--monitor-interval=0.2", str(CHILD), str(job_path),
    ]  # fmt: skip
    env = {**os.environ, "SHARDLINE_TEST_STEP_DELAY": str(step_delay)}
    log = open(job_path.parent / f"{name}.log", "w")
    return subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def finish(proc: subprocess.Popen, expect_ok: bool = True) -> str:
    out, _ = proc.communicate(timeout=WAIT)
    assert (proc.returncode == 0) == expect_ok, f"exit status {proc.returncode}:\n{out[-3000:]}"
    return out


def events(job_path: Path, kind: str) -> list[dict]:
    folder = Path(json.loads(job_path.read_text())["events"])
    # published files only: a writer's temporary file (".tmp-...") may be renamed between the listing and the read
    files = sorted(folder.glob("[!.]*.jsonl")) if folder.exists() else []
    lines = [x for f in files for x in f.read_text().splitlines()]
    return [e for e in (json.loads(x) for x in lines if x.endswith("}")) if e["kind"] == kind]


def result(job_path: Path) -> dict:
    return json.loads(Path(json.loads(job_path.read_text())["result"]).read_text())


def records(job_path: Path) -> list[dict]:
    found = [job_path.with_suffix(".record.json")]
    found += sorted(Path(json.loads(job_path.read_text())["errors"]).glob("*.json"))
    return [json.loads(p.read_text()) for p in found if p.exists()]


def what_it_came_to(job_path: Path, code: int | None = 1, forwarded: str | None = None):
    """What the training task makes of the run: `outcome` on the job, torch's error records and the exit status."""
    spec = json.loads(job_path.read_text())
    return outcome(spec, records(job_path), code, forwarded, 30, "", "")


def running(pid: int) -> bool:
    """The process exists and has not exited: a node started by `sh -c ... &` is reparented when sh exits, and
    where nothing reaps orphans (pid 1 of some CI containers) an exited one stays a zombie in /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


def wait_until(what, message: str, timeout: float = WAIT):
    until = time.monotonic() + timeout
    while time.monotonic() < until:
        if got := what():
            return got
        time.sleep(0.05)
    pytest.fail(message)


def pid_of(job_path: Path, rank: int) -> int:
    path = Path(json.loads(job_path.read_text())["result"] + f".pid-{rank}")
    return int(wait_until(lambda: path.exists() and path.read_text(), f"rank {rank} never started"))


def no_timing(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in h.items() if k not in TIMING_KEYS} for h in history]


def same_weights(got: dict, want: dict) -> None:
    a, b = load_checkpoint(got["last_checkpoint"]), load_checkpoint(want["last_checkpoint"])
    assert got["steps"] == want["steps"] == STEPS
    assert no_timing(got["history"]) == no_timing(want["history"])
    for k in b["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for key, state in b["optimizer"]["state"].items():
        for k, v in state.items():
            assert torch.equal(a["optimizer"]["state"][key][k], v), (key, k)


def test_each_rank_takes_its_share_of_every_global_batch(shards):  # noqa: F811
    """In-process: the ranks' batches, put together in rank order, are the one-process batches, the uneven
    last one included (1,920 windows: by 50, 20 left for 4 ranks; by 14, 2 left for 7 ranks: empty shares,
    which train one window at weight 0)."""
    from tests._train_child import split

    data = split(shards, "train.bin", WINDOW, HORIZON)
    for batch_size, size in ((64, 2), (50, 4), (14, 7)):
        one = [b.cont for b in WindowLoader(data, batch_size, seed=3)]
        loaders = [WindowLoader(data, batch_size, seed=3, rank=r, world_size=size) for r in range(size)]
        shares = [[b.cont for b in loader] for loader in loaders]
        assert all(len(s) == len(one) for s in shares)
        for step, whole in enumerate(one):
            k = len(whole)
            parts = [shares[r][step][: k * (r + 1) // size - k * r // size] for r in range(size)]
            assert torch.equal(torch.cat(parts), whole), (batch_size, size, step)
        assert {loader.offset for loader in loaders} == {data.n_windows}  # the global position, on every rank


def test_two_processes_follow_the_one_process_curve(tmp_path, shards):  # noqa: F811
    """Without dropout (whose masks differ with the batch's shape), at the same global batch. The 2-process
    run also checkpoints by the clock (which changes nothing computed): every 0.5 s, not at every step."""
    one = job(tmp_path, shards, "one", tmp_path / "ckpt-1")
    two_job = job(tmp_path, shards, "two", tmp_path / "ckpt-2")
    spec = json.loads(two_job.read_text())
    spec["training"].update(checkpoint_every_steps=0, checkpoint_every_seconds=0.5)
    two_job.write_text(json.dumps(spec))
    finish(start(one, 1))
    began = time.monotonic()
    finish(start(two_job, 2, step_delay=0.03))
    elapsed = time.monotonic() - began
    saves = len(events(two_job, "checkpoint"))
    assert 2 <= saves <= 2 + elapsed / 0.5, (saves, elapsed)  # the epochs' ends, and one per 0.5 s at most
    two_result = result(two_job)
    curve_1 = [e["metrics"]["train_loss"] for e in events(one, "step")]
    curve_2 = [e["metrics"]["train_loss"] for e in events(two_job, "step")]
    assert len(curve_1) == len(curve_2) == STEPS  # rank 0 alone reports: each step once
    np.testing.assert_allclose(curve_2, curve_1, rtol=1e-4)
    assert curve_2[-1] < curve_2[0] / 10  # it learned: the comparison is not of two flat lines
    w1 = load_checkpoint(result(one)["fit"]["last_checkpoint"])["model"]
    ckpt = load_checkpoint(two_result["fit"]["last_checkpoint"])
    for k, v in w1.items():
        torch.testing.assert_close(ckpt["model"][k], v, rtol=1e-4, atol=1e-5)
    assert len(ckpt["rng_ranks"]) == 2 and ckpt["loader"]["offset"] == 1920
    val_1 = [h["val_loss"] for h in result(one)["fit"]["history"]]
    np.testing.assert_allclose([h["val_loss"] for h in two_result["fit"]["history"]], val_1, rtol=1e-4)


def test_sigterm_to_one_rank_stops_all_and_sigkill_resumes_exactly(tmp_path, shards):  # noqa: F811
    """With dropout: each rank's RNGs are in the checkpoint, and each rank gets its own back."""
    reference = job(tmp_path, shards, "reference", tmp_path / "ckpt-ref", dropout=0.1)
    finish(start(reference, 2))
    ckpt = tmp_path / "ckpt"
    # a SIGTERM to rank 1 only: both ranks stop at the same step, rank 0 writes one checkpoint
    first = job(tmp_path, shards, "stopped", ckpt, dropout=0.1)
    proc = start(first, 2, step_delay=0.03)
    pid = pid_of(first, 1)
    wait_until(lambda: len(events(first, "step")) >= 10, "no 10th step")
    os.kill(pid, signal.SIGTERM)
    # a stop is not a failure to torch's agent (its ranks exit 0): no restart round, which would wait for the
    # machines a notice stopped; rank 0's result says it stopped
    finish(proc)
    stopped = result(first)
    assert stopped["status"] == "preempted" and stopped["signal"] == ANOTHER_PROCESS  # rank 0 was not signalled
    with pytest.raises(Preempted):  # what the training task makes of it
        what_it_came_to(first)
    at = latest_checkpoint(str(ckpt))[1]["step"]
    assert Path(stopped["checkpoint"]).name == f"ckpt-{at:09d}.pt" and 10 <= at < STEPS

    # resumed, then rank 1 is killed (SIGKILL) after a later checkpoint, with no restarts left: torch's record
    # names the killed rank, and the training task raises RankFailed (retried whole, resumed)
    second = job(tmp_path, shards, "killed", ckpt, dropout=0.1)
    proc = start(second, 2, step_delay=0.03)
    pid = pid_of(second, 1)
    wait_until(lambda: [e for e in events(second, "checkpoint") if "ckpt-000000035" in e["uri"]], "no step 35")
    os.kill(pid, signal.SIGKILL)
    finish(proc, expect_ok=False)
    with pytest.raises(RankFailed, match=r"training process 1 \(on [^)]+\) was killed by SIGKILL"):
        what_it_came_to(second)
    killed_at = latest_checkpoint(str(ckpt))[1]["step"]
    assert 35 <= killed_at < STEPS

    # the last attempt ends where the uninterrupted run did, to the bit
    third = job(tmp_path, shards, "resumed", ckpt, dropout=0.1)
    finish(start(third, 2))
    got = result(third)["fit"]
    assert Path(got["resumed_from"]).name == f"ckpt-{killed_at:09d}.pt"
    same_weights(got, result(reference)["fit"])


def test_the_rank_killed_first_is_named_though_torch_stamps_the_rank_it_stopped_after_it_in_the_same_second(tmp_path):
    """Rank 1 SIGKILLed (the kernel's out-of-memory killer): torch's agent then stops rank 0 with a SIGTERM and
    records both, each stamped to the second. In one second, the SIGTERM is the agent's, not the cause."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from shardline.trainer.torchrun import failure_record

    stopped, lost = ProcessFailure(0, 4100, -signal.SIGTERM, ""), ProcessFailure(1, 4101, -signal.SIGKILL, "")
    stopped.timestamp = lost.timestamp = 1_700_000_000
    record = failure_record(ChildFailedError("train", {0: stopped, 1: lost}))
    spec = {"result": str(tmp_path / "result.json"), "errors": str(tmp_path / "errors"), "ckpt_dir": "ckpt",
            "rendezvous": {"nodes": 1}}  # fmt: skip
    (tmp_path / "errors").mkdir()
    with pytest.raises(RankFailed, match=r"training process 1 \(on [^)]+\) was killed by SIGKILL"):
        outcome(spec, [record], 1, None, 30, "", "")
    stopped.timestamp += 1  # a second apart, the order is the stamps'
    with pytest.raises(RankFailed, match=r"training process 1 \(on [^)]+\) was killed by SIGKILL"):
        outcome(spec, [failure_record(ChildFailedError("train", {0: stopped, 1: lost}))], 1, None, 30, "", "")


def test_an_error_in_one_rank_is_reported_as_that_rank_s_not_as_its_peers_lost_connection(tmp_path, shards):  # noqa: F811
    """Rank 1 raises (a CUDA out-of-memory, as a GPU would) at step 5: rank 0 then fails on its closed
    connection, in a collective. torch's records name both; the training task reports rank 1's error, which is
    the cause, and not as a lost rank (not retried)."""
    failing = job(tmp_path, shards, "failing", tmp_path / "ckpt")
    proc = start(failing, 2, SHARDLINE_TEST_RAISE_ON_RANK="1")
    finish(proc, expect_ok=False)
    (record,) = records(failing)
    by_rank = {f["rank"]: f for f in record["failures"]}
    assert "CUDA out of memory" in by_rank[1]["error"]["message"] and not by_rank[1]["error"]["collective"]
    with pytest.raises(RuntimeError, match=r"RuntimeError in training process 1 \(on .*\): CUDA out of memory") as e:
        what_it_came_to(failing)
    assert not isinstance(e.value, RankFailed)


def test_a_gpt_on_text_follows_the_one_process_curve_in_two_processes(tmp_path):
    """Text through DDP, as the training task runs it (`shardline.trainer.ddp_run` on a manifest of BPE token
    shards): each window's loss is the mean over its real targets (<pad> ignored), weighted so that the
    ranks' averaged gradients are the global batch's; the curve and the validation perplexity match one
    process's."""
    import polars as pl

    from shardline.core.config import validate_config
    from shardline.core.manifest import Manifest
    from shardline.tasks.encode import encode_dataset
    from shardline.tasks.ingest import snapshot_source
    from shardline.trainer.models import model_spec_for
    from shardline.trainer.serving import data_spec
    from tests.test_text_data import sentences, text_config, write

    write(tmp_path, pl.DataFrame({"body": sentences(200, seed=5, lo=3, hi=14)}))
    raw = text_config(tmp_path)
    raw["model"] = {"family": "gpt", "params": {"d_model": 32, "n_layer": 1, "n_head": 2, "dropout": 0.0}}
    cfg = validate_config(raw)
    uri = encode_dataset(snapshot_source(cfg.data), cfg.data, str(tmp_path / "data"), threads=1)
    encoding = Manifest.model_validate_json(Path(uri).read_text()).encoding
    runs = {}
    for label, processes in (("one", 1), ("two", 2)):
        spec = {
            "manifest": uri,
            "trains_on": ["train"],
            "validates_on": ["validation"],
            "model_spec": model_spec_for(cfg.model, data_spec(encoding)),
            "training": dict(epochs=1, batch_size=16, lr=1e-2, warmup_steps=2, device="cpu", precision="fp32", seed=3),
            "task": encoding.target.task if encoding.target else None,
            "ckpt_dir": str(tmp_path / f"ckpt-{label}"),
            "events": str(tmp_path / f"{label}-events.jsonl"),
            "result": str(tmp_path / f"{label}-result.json"),
            "step_every": 1,
            "threads": 1,
        }
        (tmp_path / f"{label}.json").write_text(json.dumps(spec))
        agent = str(tmp_path / f"{label}.agent")
        launcher = [*torchrun_command(30, None, agent), "--standalone", f"--nproc-per-node={processes}"]
        command = [*(launcher if processes > 1 else [sys.executable]), "-m", "shardline.trainer.ddp_run"]
        done = subprocess.run([*command, str(tmp_path / f"{label}.json")], capture_output=True, text=True, timeout=WAIT)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        runs[label] = (json.loads(Path(spec["result"]).read_text())["fit"], events(tmp_path / f"{label}.json", "step"))
    (one, one_steps), (two, two_steps) = runs["one"], runs["two"]
    curve_1, curve_2 = ([e["metrics"]["train_loss"] for e in steps] for steps in (one_steps, two_steps))
    assert len(curve_1) == len(curve_2) == one["steps"] > 40
    # a wrong weighting shows at once; float rounding (the ranks' gradients summed in another order) starts
    # near 1e-8 and grows through the steps of attention and AdamW (measured: 1e-5 by step 20, <1e-3 at 84)
    np.testing.assert_allclose(curve_2[:12], curve_1[:12], rtol=1e-6)
    np.testing.assert_allclose(curve_2, curve_1, rtol=3e-3)
    assert curve_1[-1] < curve_1[0] * 0.8  # it learned
    assert one["history"][0]["val_perplexity"] == pytest.approx(two["history"][0]["val_perplexity"], rel=3e-3)


def test_a_batch_the_processes_cannot_share_equally_or_a_node_without_a_rendezvous_are_refused():
    from shardline.core.config import PipelineConfig
    from shardline.launch.torchrun import agent_args, launcher_endpoint
    from tests.conftest import tiny_config

    cfg = tiny_config("raw/*.parquet", "store", **{"training.batch_size": 30})
    with pytest.raises(ValueError, match=r"training.batch_size=30 is not divisible by the world size 4 .*nodes=2"):
        PipelineConfig.model_validate({**cfg, "compute": {"processes_per_node": 2, "nodes": 2}})
    one = {"rendezvous": {"nodes": 1, "processes_per_node": 2, "max_restarts": 2, "join_timeout": 600, "id": "r"}}
    assert agent_args(one, None, None) == ["--standalone", "--nproc-per-node=2", "--max-restarts=2"]
    two = {"rendezvous": {**one["rendezvous"], "nodes": 2}}
    assert agent_args(two, "10.0.0.5:29400", False)[2:] == [
        "--nnodes=2",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=10.0.0.5:29400",
        "--rdzv-id=r",
        "--rdzv-conf=join_timeout=600,is_host=false",
    ]
    # under a launcher, the rendezvous address is the launcher's
    assert launcher_endpoint({"PET_RDZV_ENDPOINT": "trainer-0:29400"}) == "trainer-0:29400"
    assert launcher_endpoint({"PET_MASTER_ADDR": "t-0", "PET_MASTER_PORT": "23456"}) == "t-0:23456"
    assert launcher_endpoint({"MASTER_ADDR": "js-0", "MASTER_PORT": "29500"}) == "js-0:29500"
    with pytest.raises(ValueError, match=r"no rendezvous address.*--endpoint.*MASTER_ADDR and MASTER_PORT"):
        launcher_endpoint({"MASTER_ADDR": "js-0"})  # half a launcher's
    # `shardline rehearse` shrinks the batch for its short run: to a multiple of the processes' count
    from shardline.app.rehearse import size_batch

    assert size_batch(456, 32, 1, 20) == 23 and size_batch(456, 32, 1, 20, multiple=2) == 22
    assert size_batch(456, 32, 1, 500, multiple=2) is None


def test_more_processes_on_a_node_than_it_has_gpus_are_refused_naming_the_setting():
    """On CUDA each process needs a GPU of its own (NCCL refuses two ranks on one; a rank past the last GPU would
    fail on CUDA's "invalid device ordinal"): refused before torchrun starts, and by each rank before it picks
    its GPU. Processes on the CPU (gloo) need none."""
    from shardline.trainer.distributed import check_gpus_per_node

    with pytest.raises(ValueError, match=r"compute.processes_per_node=2, but this machine has 1 GPU\(s\).*at most 1"):
        check_gpus_per_node(2, "cuda", 1)
    with pytest.raises(ValueError, match=r"or training.device: cpu"):
        check_gpus_per_node(1, "cuda", 0)
    check_gpus_per_node(8, "cuda", 8)
    check_gpus_per_node(2, "cpu", 0)


def two_nodes(tmp_path: Path, folder: Path, label: str, ckpt: Path, **rendezvous):
    """A job for two nodes of one process each, and the rendezvous' store hosted here, as the training run
    hosts it: (job, store)."""
    store = Store(ComputeConfig(nodes=2, master_addr="127.0.0.1", master_port=free_port()))
    spec = job(tmp_path, folder, label, ckpt, dropout=0.1, nodes=2, processes_per_node=1, **rendezvous)
    return spec, store


def ended(*agents: subprocess.Popen, timeout: float = WAIT) -> list[int]:
    try:
        return [a.wait(timeout=timeout) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
                a.wait()


@pytest.fixture(scope="module")
def two_node_reference(tmp_path_factory, shards):  # noqa: F811
    """The uninterrupted two-node run (two agents, c10d) that the faults must end on, and the one-machine
    two-process run it matches."""
    tmp = tmp_path_factory.mktemp("reference")
    spec, store = two_nodes(tmp, shards, "two-nodes", tmp / "ckpt-nodes")
    try:
        assert ended(node(spec, store.endpoint, "a"), node(spec, store.endpoint, "b")) == [0, 0]
    finally:
        store.close()
    one = job(tmp, shards, "one-machine", tmp / "ckpt-one", dropout=0.1)
    finish(start(one, 2))
    return result(spec)["fit"], result(one)["fit"]


def test_two_nodes_at_a_c10d_rendezvous_end_on_the_one_machine_two_process_run_s_weights(two_node_reference):
    nodes, one_machine = two_node_reference
    same_weights(nodes, one_machine)


def test_a_rank_killed_on_two_nodes_is_torch_s_restart_round_resuming_exactly(tmp_path, shards, two_node_reference):  # noqa: F811
    """Node b's rank SIGKILLed after a checkpoint: both agents restart their workers (torch's restart round, one of
    `training.max_restarts`), which resume from the newest checkpoint and end on the uninterrupted run's weights."""
    spec, store = two_nodes(tmp_path, shards, "rank-killed", tmp_path / "ckpt", max_restarts=2)
    try:
        a, b = node(spec, store.endpoint, "a", 0.05), node(spec, store.endpoint, "b", 0.05)
        wait_until(lambda: [e for e in events(spec, "checkpoint") if "ckpt-000000014" in e["uri"]], "no step 14")
        os.kill(pid_of(spec, 1), signal.SIGKILL)
        assert ended(a, b) == [0, 0], (tmp_path / "a.log").read_text()[-3000:]
    finally:
        store.close()
    got = result(spec)["fit"]
    assert got["resumed_from"] and 14 <= int(Path(got["resumed_from"]).stem.split("-")[1]) < STEPS
    same_weights(got, two_node_reference[0])


def test_a_node_lost_whole_and_started_again_is_mended_by_torch_s_next_round(tmp_path, shards, two_node_reference):  # noqa: F811
    """Node b's agent and rank SIGKILLed together (its machine lost), a new node started 3 s later (what the
    platform's restart does): node a's rank fails on its lost peer, its agent starts the next round, which the new
    node joins (the store, hosted by the training run, outlived node b), and the training resumes from the newest
    checkpoint and ends on the uninterrupted run's weights to the bit."""
    spec, store = two_nodes(tmp_path, shards, "node-lost", tmp_path / "ckpt", max_restarts=2)
    try:
        a, b = node(spec, store.endpoint, "a", 0.05), node(spec, store.endpoint, "b", 0.05)
        wait_until(lambda: [e for e in events(spec, "checkpoint") if "ckpt-000000014" in e["uri"]], "no step 14")
        os.killpg(b.pid, signal.SIGKILL)  # its agent; its rank dies with it (ddp_run: signal_on_parent_death)
        b.wait()
        time.sleep(3)
        b2 = node(spec, store.endpoint, "b2", 0.05)
        assert ended(a, b2) == [0, 0], (tmp_path / "a.log").read_text()[-3000:]
    finally:
        store.close()
    got = result(spec)["fit"]
    assert got["resumed_from"]
    same_weights(got, two_node_reference[0])


def test_a_node_that_never_comes_fails_the_training_within_the_join_timeout_naming_the_nodes_that_came(
    tmp_path,
    shards,  # noqa: F811
):
    """One agent of two, and no other: torch's rendezvous gives up after the join timeout (here 8 s), its agent
    says so in its record, and the training fails naming compute.nodes and the node that came: no training
    started, not retried."""
    spec, store = two_nodes(tmp_path, shards, "alone", tmp_path / "ckpt", join_timeout=8)
    began = time.monotonic()
    try:
        (code,) = ended(node(spec, store.endpoint, "a"), timeout=90)
    finally:
        store.close()
    assert code != 0 and time.monotonic() - began < 60
    with pytest.raises(NodesMissing, match=r"compute.nodes=2, but .* within compute.join_timeout_seconds=8: 1 node"):
        what_it_came_to(spec)
    # under a launcher, the pipeline that follows the training says so as soon as the agent's record is there (no
    # rank ever started: no second join timeout, waiting for a restart, on top of the first)
    from shardline.launch.torchrun import Follower, on_launcher
    from shardline.trainer.loop import Callbacks

    followed = time.monotonic()
    with pytest.raises(NodesMissing, match=r"1 node\(s\) came and waited .*is a machine of each node free"):
        compute = ComputeConfig(train_on="launcher", nodes=2, join_timeout_seconds=8)
        on_launcher(compute, json.loads(spec.read_text()), str(spec), Follower(None, Callbacks()), print)
    assert time.monotonic() - followed < 5
    from shardline.core.failures import is_infrastructure_failure

    with pytest.raises(NodesMissing) as missing:
        what_it_came_to(spec)
    assert not is_infrastructure_failure(missing.value)


def test_a_peer_lost_in_a_collective_with_no_record_of_its_own_is_retried_whole(tmp_path):
    """torch's records hold only rank 0's "lost its peer in a collective" (the peer's machine went with its record):
    the training is retried whole from the newest checkpoint, said as a lost peer, not as rank 0's code error.
    (A rank's own error beside such a loss: tests/test_trainer_infra.py.)"""
    from shardline.core.failures import is_infrastructure_failure

    lost = {"error": "RuntimeError", "bases": ["RuntimeError", "Exception"], "at": 2.0, "collective": True,
            "message": "[gloo] Connection closed by peer [127.0.0.1]:1234"}  # fmt: skip
    lost_only = {"host": "h", "at": 3.0, "failures": [{"rank": 0, "exitcode": 1, "signal": None, "error": lost}]}
    spec = {"result": str(tmp_path / "result.json"), "errors": str(tmp_path / "errors"), "ckpt_dir": "s3://b/ckpt",
            "events": str(tmp_path / "events"), "rendezvous": {"nodes": 1, "join_timeout": 60}}  # fmt: skip
    with pytest.raises(RankFailed, match=r"training process 0 lost its peers in a collective") as e:
        outcome(spec, [lost_only], 1, None, 30, "", "")
    assert is_infrastructure_failure(e.value) and "s3://b/ckpt" in str(e.value)


def test_several_nodes_without_the_node_deployment_are_refused_naming_it(prefect_api):
    """compute.nodes: 2 on a Prefect API without the node deployment (a laptop's ephemeral API): refused before any
    process starts, naming the setting and how to deploy it, or to use a launcher."""
    from shardline.launch.nodes import NodeRuns

    with pytest.raises(ValueError, match=r"compute.node_deployment 'train-node/train-node'.*prefect.yaml.*launcher"):
        NodeRuns(ComputeConfig(nodes=2), print)


SLOW_TO_STOP = """
import signal, sys, time
from pathlib import Path
folder = Path(sys.argv[1])

def stop(*_):
    time.sleep(20)  # a validation pass and a checkpoint that take longer than the grace
    (folder / "finished").write_text("")
    sys.exit(0)

signal.signal(signal.SIGTERM, stop)
(folder / "started").write_text("")
time.sleep(120)
"""


def test_shardline_s_own_torchrun_options_are_found_in_any_order_and_the_grace_left_out_where_torch_lacks_it(
    monkeypatch,
):
    """The error record, the log folder, the grace and the exit barrier's timeout come in any order before torchrun's
    own arguments; where this torch's torchrun has no --shutdown-timeout (torch 2.11, the lent GPU machines'), the
    grace is taken out of what torchrun is given and set as its default instead."""
    from shardline.launch.torchrun import EXIT_BARRIER_SECONDS, torchrun_command
    from shardline.trainer import torchrun as ours

    ours_then_torchrun = torchrun_command(7, "s3://b/e.json", "/tmp/agent")[3:]  # after `python -m <module>`
    given = [*ours_then_torchrun, "--standalone", "-m", "mod", "--shutdown-timeout=1"]
    rest = ["--log-dir=/tmp/agent", "--standalone", "-m", "mod", "--shutdown-timeout=1"]  # the module's, untouched
    barrier = float(EXIT_BARRIER_SECONDS)
    assert ours.own_options(given) == ("s3://b/e.json", None, barrier, [*rest[:1], "--shutdown-timeout=7", *rest[1:]])
    monkeypatch.setattr(ours, "knows", lambda option: not option.startswith("--shutdown-timeout"))  # torch 2.11
    assert ours.own_options(given) == ("s3://b/e.json", 7, barrier, rest)


def test_torchrun_gives_the_ranks_shardline_s_grace_after_a_sigterm_on_every_torch(tmp_path):
    """Every torchrun Shardline starts goes through shardline.trainer.torchrun, which gives the ranks the grace it
    asks for whether this torch's torchrun has --shutdown-timeout (it refused the option on torch 2.11, the lent
    GPU machines', and gave a fixed 30 s) or not: a rank still busy when the grace ends is killed, and torchrun
    returns then, not after its own default."""
    from shardline.launch.torchrun import torchrun_command
    from shardline.trainer.torchrun import knows

    assert knows("--nproc-per-node=2") and not knows("--no-such-option=1")
    script = tmp_path / "slow.py"
    script.write_text(SLOW_TO_STOP)
    with (tmp_path / "torchrun.log").open("w") as log:
        proc = subprocess.Popen(
            [
                *torchrun_command(2, None, str(tmp_path / "agent")),
                "--standalone",
                "--nproc-per-node=1",
                str(script),
                str(tmp_path),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + WAIT
        while not (tmp_path / "started").exists():
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "torchrun.log").read_text()
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=15)  # the grace (2 s), not the rank's 20 s nor torchrun's default 30 s
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert code != 0
    assert not (tmp_path / "finished").exists(), "the rank outlived the grace"


def test_shardline_node_without_a_rendezvous_address_is_refused_naming_what_to_set(tmp_path):
    """`shardline node JOB` outside a launcher and without --endpoint: exit 2 before any agent starts, naming the
    option and the launcher's variables."""
    env = {k: v for k, v in os.environ.items() if "MASTER_" not in k and not k.startswith("PET_")}
    done = subprocess.run(
        [str(Path(sys.executable).parent / "shardline"), "node", str(tmp_path / "job.json")],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--endpoint HOST:PORT" in done.stderr and "MASTER_ADDR and MASTER_PORT" in done.stderr


@pytest.mark.e2e
def test_under_a_launcher_the_pipeline_starts_two_shardline_nodes_launches_again_after_a_notice_and_registers(
    tmp_path, prefect_api, monkeypatch
):
    """`compute.train_on: launcher`: the pipeline (ingest, encode, evaluate, register: here, in this process) runs
    `compute.launch_command`, which starts two `shardline node {job}` processes with a launcher's MASTER_ADDR and
    MASTER_PORT, as a JobSet or a Slurm script would on two machines. The nodes run the trainer only; the pipeline
    follows rank 0's events in storage (each epoch in MLflow once). A notice to node b (SIGTERM, a spot machine
    reclaimed) stops the training at a checkpoint and both nodes exit 0, as a launcher's pods would: the pipeline
    runs the launch command again, the new nodes resume from that checkpoint, and the two-process model is
    registered."""
    from mlflow import MlflowClient

    from shardline.core.config import validate_config
    from shardline.flows.pipeline import pipeline
    from tests.conftest import make_raw, tiny_config

    monkeypatch.setenv("SHARDLINE_TEST_STEP_DELAY", "0.05")  # time for the notice to land mid-training
    make_raw(tmp_path / "raw", n_seq=15, rows=80)
    root = tmp_path / "store"
    logs = tmp_path / "nodes"
    logs.mkdir()
    start_two = (  # each launch's node its own log ({run}: the launch's rendezvous id)
        'for n in a b; do MASTER_ADDR=127.0.0.1 MASTER_PORT="$3" "$1" node "$2" > "$4/$5-$n.log" 2>&1 & '
        'echo $! >> "$4/pids"; done'
    )
    shardline = str(Path(sys.executable).parent / "shardline")
    compute = {
        "train_on": "launcher",
        "nodes": 2,
        "launch_command": ["sh", "-c", start_two, "sh", shardline, "{job}", str(free_port()), str(logs), "{run}"],
        "join_timeout_seconds": 120,
    }
    cfg = tiny_config(str(tmp_path / "raw" / "*.parquet"), str(root), **{"training.epochs": 2, "compute": compute})

    def pids() -> list[int]:
        return [int(p) for p in (logs / "pids").read_text().split()] if (logs / "pids").exists() else []

    def notice_to_node_b() -> None:  # once the first launch has checkpointed
        wait_until(lambda: list(root.glob("runs/*/checkpoints/ckpt-*.pt")) and len(pids()) == 2, "no checkpoint")
        os.kill(pids()[1], signal.SIGTERM)

    notice = threading.Thread(target=notice_to_node_b, daemon=True)
    notice.start()
    try:
        result = pipeline(validate_config(cfg))
        notice.join(timeout=10)
        assert len(pids()) == 4, "the training was not launched again after the notice"
        for pid in pids():  # each node ends by itself once the training is over
            deadline = time.monotonic() + 60
            while running(pid) and time.monotonic() < deadline:
                time.sleep(0.2)
            assert not running(pid), "\n".join(f.read_text()[-1500:] for f in sorted(logs.glob("*.log")))
    finally:
        for pid in pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    by_launch: dict[str, list[str]] = {}  # each launch's two nodes' logs ({run}-a.log, {run}-b.log)
    for f in logs.glob("*.log"):
        by_launch.setdefault(f.name.rsplit("-", 1)[0], []).append(f.read_text().rstrip())
    assert sorted(len(v) for v in by_launch.values()) == [2, 2], by_launch
    stopped = [v for v in by_launch.values() if all(x.endswith("training stopped") for x in v)]
    finished = [v for v in by_launch.values() if all(x.endswith("training finished") for x in v)]
    assert len(stopped) == len(finished) == 1, by_launch  # node a's agent ended after torch's exit barrier
    assert all("stopped with the training (preempted" in x for x in stopped[0]), stopped
    assert result["train"]["resumed_from"], "the second launch did not resume from the first one's checkpoint"
    reg = result["registered"]
    assert reg["version"] == 1
    client = MlflowClient(reg["tracking_uri"])
    history = client.get_metric_history(reg["run_id"], "epoch/val_loss")
    assert [h.step for h in history] == [1, 2]  # rank 0's epochs, each once
    (ckpt_dir,) = list((root / "runs").glob("*/checkpoints"))
    uri, side = latest_checkpoint(str(ckpt_dir))
    assert side["world_size"] == 2
