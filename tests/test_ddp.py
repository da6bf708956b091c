"""Training in several processes (DDP through torchrun), on this machine's CPU: 2 gloo processes.

Real processes, real torch.distributed: `torchrun --standalone --nproc-per-node 2 tests/_ddp_child.py`
(shardline/trainer/ddp_run.py's `run_job` on two shard files). At the same global batch, the 2-process
run follows the 1-process loss curve step by step; a SIGTERM to one rank stops both with one checkpoint;
a SIGKILL of one rank loses only what followed the newest checkpoint, and the resumed 2-process run ends
with the very weights of the uninterrupted one.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from shardline.core.config import ModelConfig
from shardline.tasks.torchrun import _killed_first, outcome, stopped_elsewhere
from shardline.trainer.checkpoint import latest_checkpoint, load_checkpoint
from shardline.trainer.data import WindowLoader
from shardline.trainer.loop import ANOTHER_PROCESS, TIMING_KEYS, Preempted
from shardline.trainer.models import model_spec
from tests.test_resume_kill import CARDS, HORIZON, N_CLASSES, WINDOW, shards  # noqa: F401 (a fixture)

CHILD = Path(__file__).with_name("_ddp_child.py")
STEPS = 60  # 2 epochs x 30 steps: 1,920 train windows / global batch 64
WAIT = 90


def job(tmp: Path, folder: Path, label: str, ckpt: Path, dropout: float = 0.0) -> Path:
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
        "events": str(tmp / f"{label}-events.jsonl"),
        "result": str(tmp / f"{label}-result.json"),
        "step_every": 1,
    }
    path = tmp / f"{label}-job.json"
    path.write_text(json.dumps(spec))
    return path


def start(job_path: Path, processes: int, step_delay: float = 0.0, **env_vars: str) -> subprocess.Popen:
    env = {**os.environ, "SHARDLINE_TEST_STEP_DELAY": str(step_delay), **env_vars}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"]
    return subprocess.Popen(
        [*(launcher if processes > 1 else [sys.executable]), str(CHILD), str(job_path)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def finish(proc: subprocess.Popen, expect_ok: bool = True) -> str:
    out, _ = proc.communicate(timeout=WAIT)
    assert (proc.returncode == 0) == expect_ok, f"exit status {proc.returncode}:\n{out[-3000:]}"
    return out


def events(job_path: Path, kind: str) -> list[dict]:
    path = Path(json.loads(job_path.read_text())["events"])
    lines = path.read_text().splitlines() if path.exists() else []
    return [e for e in (json.loads(x) for x in lines if x.endswith("}")) if e["kind"] == kind]


def result(job_path: Path) -> dict:
    return json.loads(Path(json.loads(job_path.read_text())["result"]).read_text())


def wait_until(what, message: str):
    until = time.monotonic() + WAIT
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
    said = finish(proc, expect_ok=False)  # torchrun fails: its ranks exited with PREEMPTED_EXIT_CODE
    assert _killed_first(said) is None  # the training task reads the result: Preempted, not a dead rank
    stopped = result(first)
    assert stopped["status"] == "preempted" and stopped["signal"] == ANOTHER_PROCESS  # rank 0 was not signalled
    with pytest.raises(Preempted) as caught:  # what the training task makes of it
        outcome(Path(json.loads(first.read_text())["result"]), said, proc.returncode, str(ckpt))
    # on several machines, node 0 not asked to stop: retried with new node runs (RankFailed), not stopped
    assert stopped_elsewhere(caught.value, None, machines=2)
    assert not stopped_elsewhere(caught.value, "SIGTERM", machines=2)  # node 0's own notice: it stops
    assert not stopped_elsewhere(caught.value, None, machines=1)  # one machine: stopped, as it was asked
    at = latest_checkpoint(str(ckpt))[1]["step"]
    assert Path(stopped["checkpoint"]).name == f"ckpt-{at:09d}.pt" and 10 <= at < STEPS

    # resumed, then rank 1 is killed (SIGKILL) after a later checkpoint: torchrun takes rank 0 down too
    second = job(tmp_path, shards, "killed", ckpt, dropout=0.1)
    proc = start(second, 2, step_delay=0.03)
    pid = pid_of(second, 1)
    wait_until(lambda: [e for e in events(second, "checkpoint") if "ckpt-000000035" in e["uri"]], "no step 35")
    os.kill(pid, signal.SIGKILL)
    said = finish(proc, expect_ok=False)
    assert _killed_first(said) == signal.SIGKILL  # the training task raises RankFailed: retried, resumed
    said = Path(json.loads(second.read_text())["result"])
    assert not said.exists() or result(second)["status"] == "failed"  # rank 0: its peer's connection closed
    killed_at = latest_checkpoint(str(ckpt))[1]["step"]
    assert 35 <= killed_at < STEPS

    # the last attempt ends where the uninterrupted run did, to the bit
    third = job(tmp_path, shards, "resumed", ckpt, dropout=0.1)
    finish(start(third, 2))
    got, want = result(third)["fit"], result(reference)["fit"]
    assert Path(got["resumed_from"]).name == f"ckpt-{killed_at:09d}.pt"
    assert got["steps"] == want["steps"] == STEPS
    assert no_timing(got["history"]) == no_timing(want["history"])
    a, b = load_checkpoint(got["last_checkpoint"]), load_checkpoint(want["last_checkpoint"])
    for k in b["model"]:
        assert torch.equal(a["model"][k], b["model"][k]), k
    for key, state in b["optimizer"]["state"].items():
        for k, v in state.items():
            assert torch.equal(a["optimizer"]["state"][key][k], v), (key, k)


def test_an_error_in_one_rank_is_reported_as_that_rank_s_not_as_its_peers_lost_connection(tmp_path, shards):  # noqa: F811
    """Rank 1 raises (a CUDA out-of-memory, as a GPU would) at step 5: rank 0 then fails on its closed
    connection. The training task reports rank 1's error, which is the cause, and not as a dead rank."""
    from shardline.tasks.torchrun import RankFailed, outcome

    failing = job(tmp_path, shards, "failing", tmp_path / "ckpt")
    proc = start(failing, 2, SHARDLINE_TEST_RAISE_ON_RANK="1")
    said = finish(proc, expect_ok=False)
    result_file = Path(json.loads(failing.read_text())["result"])
    rank1 = json.loads(Path(f"{result_file}.rank-1").read_text())
    assert rank1["rank"] == 1 and "CUDA out of memory" in rank1["message"]
    with pytest.raises(RuntimeError, match=r"RuntimeError in training process 1: CUDA out of memory") as raised:
        outcome(result_file, said, proc.returncode, str(tmp_path / "ckpt"))
    assert not isinstance(raised.value, RankFailed)
    # a rank that was killed is a dead rank (retried), whatever the others said about their lost peer
    with pytest.raises(RankFailed, match="a rank was killed by SIGKILL"):
        outcome(result_file, said + "\nRoot Cause (first observed failure):\n  exitcode  : -9", 1, "ckpt")


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
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={processes}"]
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


def test_a_batch_the_processes_cannot_share_equally_or_nodes_without_a_rendezvous_are_refused():
    from shardline.core.config import ComputeConfig, PipelineConfig
    from shardline.tasks.torchrun import launcher_args
    from tests.conftest import tiny_config

    cfg = tiny_config("raw/*.parquet", "store", **{"training.batch_size": 30})
    with pytest.raises(ValueError, match=r"training.batch_size=30 is not divisible by the world size 4 .*nodes=2"):
        PipelineConfig.model_validate({**cfg, "compute": {"processes_per_node": 2, "nodes": 2}})
    assert launcher_args(ComputeConfig(processes_per_node=2), {}) == ["--standalone", "--nproc-per-node=2"]
    with pytest.raises(ValueError, match=r"compute.nodes=2: .*MASTER_PORT, NODE_RANK is not set.*unset MASTER_ADDR"):
        launcher_args(ComputeConfig(nodes=2), {"MASTER_ADDR": "trainer-0"})  # half a launcher's rendezvous
    # no launcher: this run is node 0 and starts the others, which meet at its address
    assert launcher_args(ComputeConfig(nodes=2), {}, master=("10.0.0.5", 29400))[-4:] == [
        "--nnodes=2",
        "--node-rank=0",
        "--master-addr=10.0.0.5",
        "--master-port=29400",
    ]
    # `shardline rehearse` shrinks the batch for its short run: to a multiple of the processes' count
    from shardline.app.rehearse import size_batch

    assert size_batch(456, 32, 1, 20) == 23 and size_batch(456, 32, 1, 20, multiple=2) == 22
    assert size_batch(456, 32, 1, 500, multiple=2) is None
    jobset = {"MASTER_ADDR": "trainer-0", "MASTER_PORT": "29500", "JOB_COMPLETION_INDEX": "1"}
    assert launcher_args(ComputeConfig(nodes=2, processes_per_node=8), jobset)[-3:] == [
        "--node-rank=1",
        "--master-addr=trainer-0",
        "--master-port=29500",
    ]


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


def test_under_a_launcher_node_0_stops_its_processes_when_a_node_s_torchrun_failed_or_its_machine_went_silent(
    tmp_path,
):
    """Node 0's torchrun under a launcher is stopped (SIGTERM, then SIGKILL after the grace: its ranks may wait on
    the lost peer in a collective, which gloo gives up on after 30 minutes) when another node says its torchrun
    failed, or when that node's lease goes silent past its ttl (its machine gone); not when a node's ranks stopped
    with the training (preempted: node 0's ranks are checkpointing)."""
    from shardline.core.lease import Lease
    from shardline.tasks import launched

    deaf = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"]

    def watched(folder: Path, nodes: int = 2):
        attempt = launched.Attempt(str(folder))
        attempt.announce()
        proc = subprocess.Popen(deaf)
        said: list[str] = []
        attempt.watch(proc, nodes, said.append, grace=1.0, every=0.1)
        return attempt, proc, said

    # node 1's ranks stopped with the training: node 0 is left alone
    attempt, proc, said = watched(tmp_path / "a")
    launched.node_ended(attempt.shared, 1, 75, stopped=True)
    time.sleep(1.0)
    assert proc.poll() is None and attempt.lost is None, said
    # node 1's torchrun failed (its rank killed): node 0's deaf torchrun is killed after the grace
    began = time.monotonic()
    launched.node_ended(attempt.shared, 1, 1, stopped=False)
    assert proc.wait(timeout=30) == -signal.SIGKILL and time.monotonic() - began < 20
    assert attempt.lost == "node 1's torchrun ended with exit status 1", attempt.lost
    assert any("did not stop within 1 s of SIGTERM" in line for line in said), said
    attempt.end(-9)

    # node 2 of 3 holds its lease, then its machine is gone: the lease is no longer renewed
    attempt, proc, said = watched(tmp_path / "b", nodes=3)
    holder = {"flow_run": launched.node_holder(attempt.shared, 2)}
    lease = Lease(launched.node_lease(attempt.shared, 2), "node 2", ttl=1.5, holder=holder)
    lease.acquire()
    time.sleep(2.0)
    assert proc.poll() is None, "a renewed lease is a live node"
    lease._stop.set()  # its renewals stop, as on a frozen machine: no release
    lease._thread.join(5)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert attempt.lost.startswith("node 2: its lease in ") and "was not renewed" in attempt.lost, attempt.lost
    attempt.end(-9)


def test_under_a_launcher_a_node_stops_its_processes_when_node_0_s_torchrun_ended_or_its_machine_went_silent(
    tmp_path, monkeypatch
):
    """Node 1's torchrun is stopped (SIGTERM, then SIGKILL after the grace) when node 0's torchrun of the attempt
    ended and node 1's still runs a grace later, when node 0 began a newer attempt (its pod restarted), or when node
    0's lease of the attempt went silent past its ttl (its machine gone): its ranks could otherwise wait on node 0
    in a collective for gloo's 30 minutes, while node 0's next attempt waits for this node. Not while node 0's
    lease is renewed."""
    from shardline.tasks import launched

    monkeypatch.setenv("SHARDLINE_LEASE_TTL", "3")
    deaf = [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"]
    folder = str(tmp_path / "launches" / "x")

    def joined(number: int):
        proc = subprocess.Popen(deaf)
        said: list[str] = []
        return proc, said, launched.watch_attempt_node0(proc, folder, number, 1, said.append, grace=1.0, every=0.1)

    # node 0's torchrun of attempt 1 ended; node 1's does not end by itself: stopped after the grace
    first = launched.Attempt(folder)
    first.announce()
    proc, said, gone = joined(1)
    time.sleep(1.0)
    assert proc.poll() is None and not gone, "node 0 trains: its lease is renewed"
    began = time.monotonic()
    first.end(1)
    assert proc.wait(timeout=30) == -signal.SIGKILL and time.monotonic() - began < 20
    assert len(gone) == 1 and re.fullmatch(r"node 0's torchrun of attempt 1 ended \d+ s ago", gone[0]), gone
    assert any("node 1: node 0's torchrun of attempt 1 ended" in line for line in said), said

    # node 0's machine gone during attempt 2: its lease is no longer renewed (and no end is written)
    second = launched.Attempt(folder)
    second.announce()
    proc, said, gone = joined(2)
    second._lease._stop.set()  # its renewals stop, as on a frozen machine: no release
    second._lease._thread.join(5)
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert gone[0].startswith("node 0's lease of attempt 2: its lease in ") and "not renewed" in gone[0], gone

    # node 0's pod restarted: its new pipeline's attempt 3 while node 1 still runs attempt 2's torchrun
    proc, said, gone = joined(2)
    launched.Attempt(folder).announce()
    assert proc.wait(timeout=30) == -signal.SIGKILL
    assert len(gone) == 1 and re.fullmatch(r"node 0's torchrun of attempt 2 ended \d+ s ago", gone[0]), gone


def test_under_a_launcher_a_restarted_node_joins_no_attempt_node_0_left_and_node_0_starts_none_beside_an_old_one(
    tmp_path, monkeypatch
):
    """Pods restarted (a JobSet restarting all of them, a node's machine lost): node 0's earlier process left its
    attempt open. A node starting again must not join it (its torchrun would meet node 0's next one at the
    launch's one rendezvous address, and be stopped in it, failing that attempt too): it joins an open attempt only
    while node 0 holds its lease of it, and node 0 starting again ends the attempts left open as abandoned; a
    node's torchrun in one is stopped at once, not after the grace. Node 0 starts its next torchrun only once no
    node's torchrun of an earlier attempt runs."""
    import threading

    from shardline.core.lease import Lease
    from shardline.tasks import launched

    monkeypatch.setenv("SHARDLINE_LEASE_TTL", "3")
    folder = str(tmp_path / "launches" / "x")
    first = launched.Attempt(folder)
    first.announce()
    assert launched.to_join(folder, 0) == 1, "node 0 holds its lease of attempt 1: joined"
    first._lease._stop.set()  # node 0's machine lost: no renewal, no release, no end
    first._lease._thread.join(5)
    time.sleep(3.5)  # past the lease's expiry
    assert launched.to_join(folder, 0) is None, "node 0 is gone: its open attempt is not joined"

    # a node that joined it before node 0's lease expired: node 0 starting again ends it, and the node's torchrun is
    # stopped at once (the grace here is 30 s)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    said: list[str] = []
    gone = launched.watch_attempt_node0(sleeper, folder, 1, 1, said.append, grace=30.0, every=0.1)
    heard: list[str] = []
    began = time.monotonic()
    assert launched.begin(folder, heard.append) == [1]
    assert sleeper.wait(timeout=30) == -signal.SIGTERM and time.monotonic() - began < 10
    assert gone == ["node 0 started again and ended attempt 1, which its earlier process left"], gone
    assert "attempt(s) 1 of an earlier node 0 of this launch (its pod restarted) ended" in heard[0], heard
    assert launched.attempts(folder)[1]["abandoned"] and launched.to_join(folder, 0) is None
    assert launched.begin(folder, heard.append) == [] and len(heard) == 1, "nothing left open: nothing said"

    # node 1 (restarted) holds its place, but its torchrun of attempt 1 still holds its lease (stopping): node 0's
    # attempt 2 waits for it to end
    place = Lease(launched.presence(folder, 1), "node 1 of the launch")
    place.acquire()
    held = Lease(launched.node_lease(launched.attempt_folder(folder, 1), 1), "node 1")
    held.acquire()
    said.clear()
    with pytest.raises(launched.NodesMissing, match=r"node 1's torchrun of attempt 1 did not end within 1 s"):
        launched.wait_for_nodes(folder, 2, said.append, timeout=1.0, poll=0.1)
    threading.Timer(1.0, held.release).start()
    said.clear()
    began = time.monotonic()
    launched.wait_for_nodes(folder, 2, said.append, timeout=30, poll=0.1)
    assert time.monotonic() - began >= 0.9
    assert said[0].startswith("node 0 of a launch: waiting for node 1's torchrun of attempt 1 to end before attempt 2")
    assert "earlier torchruns have ended" in said[-1], said
    place.release()
    second = launched.Attempt(folder)
    second.announce()
    assert second.number == 2 and launched.to_join(folder, 0) == 2 and launched.to_join(folder, 2) is None
    second.end(0)


def test_under_a_launcher_node_0_waits_for_every_node_before_a_torchrun_and_names_one_that_never_came(
    tmp_path, monkeypatch
):
    """A node's pod may start minutes after node 0's (the cluster adding a GPU machine), or be restarted after its
    machine was lost: node 0 waits until every node's `shardline run` holds its place in the launch before it starts
    a torchrun (whose rendezvous would wait 10 minutes, then fail the attempt and spend a retry), and fails with
    the missing nodes named, not retried, when they do not come."""
    import threading

    from shardline.core.config import ComputeConfig
    from shardline.core.lease import Lease
    from shardline.tasks import launched, torchrun
    from shardline.tasks.nodes import nodes_seconds
    from shardline.tasks.train import is_infrastructure_failure

    monkeypatch.setenv("PET_MASTER_ADDR", "127.0.0.1")
    folder = str(tmp_path / "launches" / "x")
    said: list[str] = []
    # nobody came: node 0 says whom it waits for, then fails naming them and the setting
    with pytest.raises(launched.NodesMissing) as missing:
        launched.wait_for_nodes(folder, 3, said.append, timeout=1.0, poll=0.1, say_every=0.4)
    assert "nodes 1, 2 of the launch did not start within 1 s (SHARDLINE_NODES_TIMEOUT)" in str(missing.value)
    assert "pods pending" in str(missing.value) and not is_infrastructure_failure(missing.value)
    assert "waiting for nodes 1, 2 of 3 to start before training" in said[0], said
    assert any("still waiting for nodes 1, 2" in line for line in said), said

    # node 1's `shardline run` starts now, node 2's a second later: node 0 goes on once both hold their places
    heard: dict[int, list[str]] = {1: [], 2: []}
    codes: dict[int, int] = {}

    def node(rank: int, after: float) -> None:
        time.sleep(after)
        codes[rank] = torchrun.join_launch(ComputeConfig(nodes=3), "cpu", folder, rank, heard[rank].append, 0.1)

    nodes = [threading.Thread(target=node, args=(1, 0.0)), threading.Thread(target=node, args=(2, 1.0))]
    began = time.monotonic()
    for t in nodes:
        t.start()
    said.clear()
    launched.wait_for_nodes(folder, 3, said.append, timeout=30, poll=0.1)
    assert time.monotonic() - began >= 1.0 and launched.absent(folder, 3) == []
    assert said[-1].startswith("node 0 of a launch: all 3 nodes are running"), said
    # node 0's pipeline ends: the nodes exit with its status and give their places up
    launched.end(folder, "completed", 0)
    for t in nodes:
        t.join(30)
    assert codes == {1: 0, 2: 0}, heard
    assert launched.absent(folder, 3) == [1, 2]

    # a second `shardline run` given node 1's rank while node 1 runs waits for its place, and gives up after
    # SHARDLINE_JOIN_TIMEOUT; node 0 never sees two nodes 1
    launched.begin(folder)
    with Lease(launched.presence(folder, 1), "node 1 of the launch"):
        monkeypatch.setenv("SHARDLINE_JOIN_TIMEOUT", "1")
        heard[1].clear()
        assert torchrun.join_launch(ComputeConfig(nodes=3), "cpu", folder, 1, heard[1].append, 0.1) == 1
    assert any("node 1's place in the launch" in line and "two nodes given rank 1?" in line for line in heard[1])
    assert "node 1 of the launch cannot start" in heard[1][-1], heard[1]
    monkeypatch.setenv("SHARDLINE_NODES_TIMEOUT", "soon")
    with pytest.raises(ValueError, match=r"SHARDLINE_NODES_TIMEOUT='soon' is not a number"):
        nodes_seconds()


def test_a_launch_is_named_by_its_id_a_node_says_when_it_waits_and_the_trainjob_runs_shardline_run(
    tmp_path, monkeypatch, capsys
):
    import yaml

    from shardline.tasks import launched

    env = {"SHARDLINE_LAUNCH_ID": "5f1c-uid.2"}
    assert launched.launch_folder("s3://bucket/root", env) == "s3://bucket/root/launches/5f1c-uid.2"
    with pytest.raises(ValueError, match=r"SHARDLINE_LAUNCH_ID is 'a/b'.*the same id.*each launch its own"):
        launched.launch_folder("s3://bucket/root", {"SHARDLINE_LAUNCH_ID": "a/b"})
    assert [launched.node_rank(e) for e in ({"PET_NODE_RANK": "1"}, {"JOB_COMPLETION_INDEX": "3"}, {})] == [1, 3, 0]
    with pytest.raises(ValueError, match=r"PET_NODE_RANK='x': a node's rank is a whole number"):
        launched.node_rank({"PET_NODE_RANK": "x"})
    with pytest.raises(ValueError, match=r"SHARDLINE_JOIN_TIMEOUT='0': seconds, more than 0"):
        launched.join_seconds({"SHARDLINE_JOIN_TIMEOUT": "0"})
    # node 0's attempts: numbered on from what the folder holds (node 0's pod restarted), open until ended
    folder = str(tmp_path / "launches" / "x")
    first = launched.Attempt(folder)
    weights = first.put("init.pt", b"a parent model's weights")
    first.announce()
    assert first.number == 1 and launched.attempts(folder)[1]["ended"] is False
    first.end(1)
    assert not Path(weights).exists()  # no copy of them left in storage
    second = launched.Attempt(folder)
    assert second.number == 2 and launched.attempts(folder)[1]["ended"] is True
    launched.end(folder, "completed", 0)
    assert launched.ended(folder)["exit"] == 0
    launched.begin(folder)  # node 0's pipeline again: the old end is not the new one's
    assert launched.ended(folder) is None
    # a node that waits for a node 0 it cannot see (another storage root, a node 0 that never started) says so
    # while it waits, and ends when SHARDLINE_JOIN_TIMEOUT is up
    from shardline.core.config import ComputeConfig
    from shardline.tasks import torchrun

    for k, v in {**env, "PET_MASTER_ADDR": "127.0.0.1", "PET_NODE_RANK": "1", "SHARDLINE_JOIN_TIMEOUT": "1.5"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setattr(torchrun, "WAITING_SAY_SECONDS", 0.5)
    elsewhere = launched.launch_folder(str(tmp_path / "elsewhere"))
    said = []
    assert torchrun.join_launch(ComputeConfig(nodes=2), "cpu", elsewhere, 1, said.append, 0.1) == 1
    assert "node 1 of 2 under a launcher: joining node 0's training in" in said[0]
    assert any("still waiting for node 0's training" in m and "every node must see" in m for m in said), said
    assert "started no training and its pipeline did not end within 2 s (SHARDLINE_JOIN_TIMEOUT)" in said[-1]
    # node 0's pipeline ended with no training (every step cached): a node ends with it, having joined nothing
    launched.end(elsewhere, "completed", 0)
    said.clear()
    assert torchrun.join_launch(ComputeConfig(nodes=2), "cpu", elsewhere, 1, said.append, 0.1) == 0
    assert said[-1] == "node 1: node 0's pipeline ended (completed); 0 torchrun(s) joined"
    # `shardline run` under a launcher without an id for the launch: refused before anything starts, naming it
    import typer

    from shardline.app.cli import _under_launcher
    from shardline.core.config import validate_config
    from tests.conftest import tiny_config

    config = validate_config({**tiny_config("raw/*.parquet", str(tmp_path / "s")), "compute": {"nodes": 2}})
    monkeypatch.delenv("SHARDLINE_LAUNCH_ID")
    with pytest.raises(typer.Exit) as stopped:
        _under_launcher(config)
    assert stopped.value.exit_code == 2
    assert "SHARDLINE_LAUNCH_ID is not set" in capsys.readouterr().err
    # the TrainJob template runs that command on every node, with the launch's id
    trainer = yaml.safe_load((Path(__file__).parents[1] / "deploy" / "trainjob.yaml").read_text())["spec"]["trainer"]
    assert trainer["command"][:2] == ["shardline", "run"]
    assert "SHARDLINE_LAUNCH_ID" in {e["name"] for e in trainer["env"]}
    assert trainer["numProcPerNode"] == trainer["resourcesPerNode"]["limits"]["nvidia.com/gpu"]


def launched_node(config: Path, rank: int, port: int, launch: str, cwd: Path, **extra: str) -> subprocess.Popen:
    """`shardline run CONFIG` as a Kubeflow Trainer's node `rank` of 2 would run it: the rendezvous in PET_*."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(
        **extra,
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        PREFECT_LOGGING_LEVEL="INFO",  # what each node did, if the test fails
        PET_NNODES="2",
        PET_NPROC_PER_NODE="1",
        PET_NODE_RANK=str(rank),
        PET_MASTER_ADDR="127.0.0.1",
        PET_MASTER_PORT=str(port),
        SHARDLINE_LAUNCH_ID=launch,
    )
    return subprocess.Popen(
        [str(Path(sys.executable).parent / "shardline"), "run", str(config)],
        cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip


def ended_nodes(node0: subprocess.Popen, node1: subprocess.Popen, folder: Path, timeout: float = 400) -> tuple:
    """Both nodes' output once they have ended; if they do not within `timeout`, both are killed and the test
    fails with what each said and what the launch folder holds."""
    try:
        return node0.communicate(timeout=timeout)[0], node1.communicate(timeout=60)[0]
    except subprocess.TimeoutExpired:
        for node in (node0, node1):
            os.killpg(node.pid, signal.SIGKILL)  # with its Prefect server and torchrun
        said = [node.communicate(timeout=30)[0] for node in (node0, node1)]
        held = {str(p.relative_to(folder)): p.read_text() for p in folder.rglob("*.json")} if folder.exists() else {}
        pytest.fail(f"the nodes did not end within {timeout:.0f} s. Node 0:\n{said[0][-4000:]}\nNode 1:\n"
                    f"{said[1][-4000:]}\nThe launch folder: {held}")  # fmt: skip


def launched_ranks(launch: str, node: int) -> list[int]:
    """The training ranks (not torchrun) of node `node` of the launch `launch`, found by their environment."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
            cmd = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ours = f"SHARDLINE_LAUNCH_ID={launch}".encode() in environ and f"PET_NODE_RANK={node}".encode() in environ
        launcher = b"torch.distributed.run" in cmd or b"shardline.trainer.torchrun\0" in cmd
        if ours and b"shardline.trainer.ddp_run" in cmd and not launcher:
            found.append(int(entry.name))
    return found


def launched_attempts(folder: Path) -> list[int]:
    from shardline.tasks.launched import attempts

    found = attempts(str(folder))
    assert all(a["ended"] for a in found.values()), found
    return sorted(found)


def final_weights_of(store: Path) -> tuple[dict, dict]:
    (result_file,) = (store / "runs").glob("*/result.json")
    result = json.loads(result_file.read_text())
    return result, load_checkpoint(result["last_checkpoint"])["model"]


@pytest.mark.e2e
def test_shardline_run_with_two_processes_per_node_and_on_two_nodes_under_a_launcher(tmp_path, prefect_api):
    """The whole pipeline, its training under torchrun: rank 0's steps reach MLflow once each, its
    checkpoints say the world size, and the model is registered.

    Then the same training on 2 nodes of 1 process under a launcher (a Kubeflow TrainJob's PET_* environment),
    every node running the same `shardline run CONFIG`: node 0 runs the pipeline (ingest, encode, train,
    evaluate, register) and waits for node 1, started late, before it trains; node 1 joins its training, taking
    its job from rank 0. Node 1's rank killed mid-training, node 0's retry is joined again; node 0's machine then
    frozen in that retry (node 1 stops its processes on node 0's silent lease) and both pods restarted, the
    restarted node 1 joins the new node 0's attempt (not the one the lost node 0 left open), and the two-node run
    ends on the two-process run's weights to the bit."""
    import sqlite3

    import yaml

    from tests.conftest import api_env, make_raw, tiny_config
    from tests.net import free_port
    from tests.test_cli import shardline

    make_raw(tmp_path / "raw")
    cfg = tiny_config("raw/*.parquet", str(tmp_path / "store"), **{"training.device": "cpu"})
    (tmp_path / "c.yaml").write_text(yaml.safe_dump({**cfg, "compute": {"processes_per_node": 2}}))
    # the session's Prefect API (node 0's pod may start a temporary one, as test_cli runs it: ~5 s of CPU a command)
    api = api_env()
    out = shardline("run", tmp_path / "c.yaml", cwd=tmp_path, env=api)
    said = out.stdout + out.stderr
    assert out.returncode == 0, said[-3000:]
    assert "Registered tiny-model version 1 as @champion" in said
    result, weights = final_weights_of(tmp_path / "store")
    side = json.loads(Path(result["last_checkpoint"]).with_suffix(".json").read_text())
    assert side["world_size"] == 2 and len(result["history"]) == 2
    db = sqlite3.connect(tmp_path / "store" / "mlflow.db")
    steps = db.execute("select count(*), count(distinct step) from metrics where key = 'train/train_loss'").fetchone()
    assert steps == (result["steps"], result["steps"])  # one value a step: rank 0 alone reports

    store = tmp_path / "launched"
    cfg = tiny_config("raw/*.parquet", str(store), **{"training.device": "cpu"})
    (tmp_path / "l.yaml").write_text(yaml.safe_dump({**cfg, "compute": {"nodes": 2, "processes_per_node": 1}}))
    port = free_port()
    # room to kill node 1's rank mid-training, then to freeze node 0 after a checkpoint of the next attempt; a
    # silent lease found in seconds, and a peerless torchrun killed 3 s after SIGTERM
    slow = {"SHARDLINE_TEST_STEP_DELAY": "0.4", "SHARDLINE_LEASE_TTL": "6", "SHARDLINE_PEERLESS_SECONDS": "3"}
    on_api = {**slow, "PREFECT_API_URL": api["PREFECT_API_URL"]}  # node 0's pipeline; node 1 runs none
    node0 = launched_node(tmp_path / "l.yaml", 0, port, "job-a1", tmp_path, **on_api)
    # node 1's pod late (the cluster adding its machine): node 0 ingests and encodes, then waits for it before its
    # torchrun, whose rendezvous would otherwise give up after 10 minutes
    said_first: list[str] = []  # node 0's output so far (read by a thread: the test waits for a line of it)
    reader = threading.Thread(target=lambda: [said_first.append(line) for line in node0.stdout], daemon=True)
    reader.start()
    deadline = time.monotonic() + 240
    while not any("waiting for node 1 of 2 to start before training" in line for line in said_first):
        assert time.monotonic() < deadline and node0.poll() is None, "".join(said_first)[-3000:]
        time.sleep(0.1)
    assert list(store.glob("datasets/**/manifest.json")), "node 0 ingested and encoded first"
    time.sleep(2)
    assert not launched_attempts(store / "launches" / "job-a1"), "no torchrun before every node runs"
    node1 = launched_node(tmp_path / "l.yaml", 1, port, "job-a1", tmp_path, **slow)
    # node 1's rank killed after node 0's first checkpoint (its GPU lost, the OOM killer): node 0's training
    # fails (RankFailed), its retry is attempt 2, which node 1 joins, and it resumes from that checkpoint
    deadline = time.monotonic() + 240
    while not list(store.glob("runs/*/checkpoints/ckpt-*.json")):
        assert time.monotonic() < deadline and node0.poll() is None, "".join(said_first)[-3000:]
        time.sleep(0.1)
    (rank1,) = launched_ranks("job-a1", node=1)
    os.kill(rank1, signal.SIGKILL)
    # then node 0's whole machine silent in attempt 2 (SIGSTOP of all its processes), after attempt 2's first
    # checkpoint: node 1's ranks would wait on it in a collective for gloo's 30 minutes; node 1 sees node 0's
    # lease of the attempt go silent and stops them. Node 0's pod restarted (its processes killed, the same
    # command again): its attempt 3 resumes from the newest checkpoint, and node 1 joins it
    launch = store / "launches" / "job-a1"
    while (
        not (store_ckpt := sorted(store.glob("runs/*/checkpoints/ckpt-*.json")))
        or store_ckpt[-1].stem < "ckpt-000000010"
    ):
        assert time.monotonic() < deadline and node0.poll() is None, "".join(said_first)[-3000:]
        time.sleep(0.1)
    assert (launch / "attempt-2" / "leases" / "node-1").exists(), "node 1 trains in attempt 2"
    os.killpg(node0.pid, signal.SIGSTOP)
    while not (launch / "attempt-2" / "nodes" / "node-1.json").exists():
        assert time.monotonic() < deadline, "node 1 did not stop its processes after node 0 went silent"
        time.sleep(0.2)
    # both pods restarted (a JobSet restarting all of its pods), node 1's first: node 0 runs a pipeline before it
    # trains. The restarted node 1 does not join attempt 2, which node 0's lost process left open (it did: its
    # torchrun of "attempt 2" met node 0's attempt 3 at the one rendezvous address)
    os.killpg(node0.pid, signal.SIGKILL)
    os.killpg(node1.pid, signal.SIGKILL)
    node0.wait(timeout=30)
    reader.join(timeout=30)
    first, first1 = "".join(said_first), node1.communicate(timeout=30)[0]
    node1 = launched_node(tmp_path / "l.yaml", 1, port, "job-a1", tmp_path, **slow)
    node0 = launched_node(tmp_path / "l.yaml", 0, port, "job-a1", tmp_path, **on_api)
    said0, said1 = ended_nodes(node0, node1, launch)
    said0 = first + said0
    assert node0.returncode == 0, said0[-3000:] + said1[-3000:]
    assert node1.returncode == 0, said1[-3000:]
    assert "Registered tiny-model version 1 as @champion" in said0
    assert "waiting for node 1 of 2 to start before training" in said0 and "all 2 nodes are running" in said0
    assert "joining node 0's attempt 1" in first1 and "attempt 1: torchrun exit status" in first1, first1
    assert "joining node 0's attempt 2" in first1 and "node 1: node 0's lease of attempt 2: its lease in" in first1
    assert "attempt(s) 2 of an earlier node 0 of this launch (its pod restarted) ended" in said0
    assert "joining node 0's attempt 2" not in said1, said1
    assert "joining node 0's attempt 3" in said1 and "attempt 3: its processes finished" in said1, said1
    assert "node 0's pipeline ended (completed); 1 torchrun(s) joined" in said1
    from shardline.tasks.launched import attempts

    ended = {k: (a["ended"], a.get("abandoned", False)) for k, a in attempts(str(launch)).items()}
    assert ended == {1: (True, False), 2: (True, True), 3: (True, False)}, ended  # 2: left by the lost node 0
    # in the Prefect server both node 0s shared, the first one's runs (left Running: its process was killed) were
    # set Crashed by the second, saying why; the second's completed
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=["shardline-launch:job-a1"]))
        )
    states = sorted((r.state.name, r.state.message if r.state.is_crashed() else "") for r in runs)
    # the first node 0's pipeline and its attempt-2 training Crashed (attempt 1's training Failed: node 1's rank
    # killed); the second node 0's pipeline and training Completed; none left Running
    assert [name for name, _ in states] == ["Completed", "Completed", "Crashed", "Crashed", "Failed"], states
    assert all("node 0 of launch job-a1 started again" in m for name, m in states if name == "Crashed"), states
    assert "an earlier node 0's flow run(s)" in said0 and "set Crashed" in said0
    assert "Registered" not in said1 and not list(store.glob("runs/*/nodes"))
    launched, weights_2 = final_weights_of(store)
    side = json.loads(Path(launched["last_checkpoint"]).with_suffix(".json").read_text())
    assert side["world_size"] == 2 and launched["steps"] == result["steps"] and launched["resumed_from"]
    for k in weights:
        assert torch.equal(weights[k], weights_2[k]), k


def test_several_nodes_without_the_node_deployment_are_refused_naming_it(tmp_path, prefect_api):
    """compute.nodes: 2 with no launcher and a Prefect API without the node deployment (a laptop's ephemeral
    API): refused before any process starts, naming the setting and how to deploy it."""
    from shardline.core.config import ComputeConfig
    from shardline.tasks.nodes import Nodes

    with pytest.raises(ValueError, match=r"compute.node_deployment 'train-node/train-node'.*prefect.yaml"):
        Nodes(ComputeConfig(nodes=2), str(tmp_path / "nodes"), print)
    assert not (tmp_path / "nodes").exists()  # nothing written


def test_a_rank_s_own_storage_error_is_retried_and_a_peer_s_lost_connection_is_not_the_cause(tmp_path):
    """Rank 1 could not reach its storage ("Connection refused", an OSError) and rank 0 then lost its peer:
    the cause is rank 1's, said with its message, and is an infrastructure failure (retried, as one process's
    storage error is), not a code error; a missing file on a rank stays a plain error (not retried)."""
    from shardline.tasks.torchrun import RankFailed, outcome
    from shardline.tasks.train import is_infrastructure_failure

    result = tmp_path / "result.json"
    lost_peer = {"status": "failed", "rank": 0, "at": 2.0, "error": "RuntimeError",
                 "message": "[gloo] Connection closed by peer [127.0.0.1]:1234",
                 "bases": ["RuntimeError", "Exception"]}  # fmt: skip
    result.write_text(json.dumps(lost_peer))
    refused = {"status": "failed", "rank": 1, "at": 1.0, "error": "ConnectionRefusedError",
               "message": "[Errno 111] Connection refused: s3 endpoint 127.0.0.1:9",
               "bases": ["ConnectionRefusedError", "ConnectionError", "OSError", "Exception"]}  # fmt: skip
    Path(f"{result}.rank-1").write_text(json.dumps(refused))
    with pytest.raises(RankFailed, match=r"ConnectionRefusedError in training process 1: \[Errno 111\]") as raised:
        outcome(result, "torchrun: a rank failed", 1, "s3://b/ckpt")
    assert is_infrastructure_failure(raised.value)
    missing = {**refused, "error": "FileNotFoundError", "message": "s3://b/shards/x.bin: not found",
               "bases": ["FileNotFoundError", "OSError", "Exception"]}  # fmt: skip
    Path(f"{result}.rank-1").write_text(json.dumps(missing))
    with pytest.raises(RuntimeError, match="FileNotFoundError in training process 1") as raised:
        outcome(result, "torchrun: a rank failed", 1, "s3://b/ckpt")
    assert not is_infrastructure_failure(raised.value)


def _node_deployment(pool: str) -> None:
    """train-node/train-node on a process pool of the ephemeral API, with no worker: its runs stay Scheduled."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectAlreadyExists

    from shardline.flows.train import train_node

    with get_client(sync_client=True) as client:
        try:
            client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
        except ObjectAlreadyExists:
            pass
        client.create_deployment(
            flow_id=client.create_flow(train_node),
            name="train-node",
            work_pool_name=pool,
            entrypoint="shardline/flows/train.py:train_node",
        )


def test_a_stopped_attempt_on_several_nodes_leaves_no_copy_of_the_parent_weights_in_storage(tmp_path, prefect_api):
    """A training on 2 machines whose node run is cancelled (from the UI) stops naming it, and the attempt's
    job and the copy of the parent's weights it put in the run's folder for the other nodes are cleared: a
    stopped or failed attempt (a preemption, a lost node) does not leave one copy of the weights per attempt."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
    from prefect.states import Cancelled

    from shardline.core.config import ComputeConfig, TrainingConfig
    from shardline.tasks.nodes import NodeFailed
    from shardline.tasks.torchrun import fit_in_processes

    _node_deployment("gpu-nodes-test")
    shared = tmp_path / "run" / "nodes"
    said: list[str] = []

    def cancel_the_node_run():  # as from the Prefect UI, once node 0 has started it
        with get_client(sync_client=True) as client:
            for _ in range(600):
                runs = client.read_flow_runs(
                    flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=["shardline-node"]))
                )
                mine = [r for r in runs if str(shared) in r.parameters.get("job", "")]
                if mine:
                    client.set_flow_run_state(mine[0].id, Cancelled(), force=True)
                    return
                time.sleep(0.1)

    import threading

    canceller = threading.Thread(target=cancel_the_node_run, daemon=True)
    canceller.start()
    compute = ComputeConfig(nodes=2, master_addr="127.0.0.1")
    cfg = TrainingConfig(epochs=1, batch_size=8, device="cpu")
    with pytest.raises(NodeFailed, match=r"ended Cancelled"):
        fit_in_processes(
            compute, str(tmp_path / "m.json"), ["train"], ["validation"], {}, cfg, "classification",
            str(tmp_path / "ckpt"), log=said.append, init_weights={"w": torch.zeros(1000)}, shared=str(shared),
        )  # fmt: skip
    canceller.join(5)
    left = sorted(p.name for p in shared.rglob("*") if p.is_file())
    assert left == [], (left, said)


def test_a_training_on_several_nodes_waits_for_its_node_runs_and_names_one_that_never_started(
    tmp_path, prefect_api, monkeypatch
):
    """A node run not started (no worker of its pool free, a machine its infrastructure is still adding) is waited
    for before node 0's torchrun starts (whose rendezvous would give up after 10 minutes and spend a retry), and
    said while it is; after SHARDLINE_NODES_TIMEOUT the training fails naming it, not retried, and the node run
    is cancelled at once (it has nothing left to join)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    from shardline.core.config import ComputeConfig, TrainingConfig
    from shardline.tasks import nodes
    from shardline.tasks.torchrun import fit_in_processes
    from shardline.tasks.train import is_infrastructure_failure

    _node_deployment("gpu-nodes-test")  # no worker: its runs stay Scheduled
    monkeypatch.setenv("SHARDLINE_NODES_TIMEOUT", "4")
    monkeypatch.setattr(nodes, "NODES_SAY_SECONDS", 1.5)
    shared = tmp_path / "run" / "nodes"
    said: list[str] = []
    compute = ComputeConfig(nodes=2, master_addr="127.0.0.1")
    cfg = TrainingConfig(epochs=1, batch_size=8, device="cpu")
    began = time.monotonic()
    with pytest.raises(nodes.NodesMissing) as missing:
        fit_in_processes(
            compute, str(tmp_path / "m.json"), ["train"], ["validation"], {}, cfg, "classification",
            str(tmp_path / "ckpt"), log=said.append, shared=str(shared),
        )  # fmt: skip
    assert re.search(
        r"flow run\(s\) [\w-]+ \((Scheduled|Late)\) of train-node/train-node did not start within 4 s "
        r"\(SHARDLINE_NODES_TIMEOUT\): no training started",
        str(missing.value),
    ), missing.value
    assert "Is a worker of its pool free" in str(missing.value) and not is_infrastructure_failure(missing.value)
    assert any(
        line.startswith("waiting for flow run(s) ") and "of train-node/train-node to start" in line for line in said
    )
    assert time.monotonic() - began < 30, "a node run not started is cancelled at once, not waited for"
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=["shardline-node"])))
    mine = [r for r in runs if str(shared) in r.parameters.get("job", "")]
    assert len(mine) == 1 and mine[0].state.name == "Cancelled", [(r.name, r.state.name) for r in mine]
    assert sorted(p.name for p in shared.rglob("*") if p.is_file()) == []


@pytest.mark.parametrize("node_rank, nodes", [(2, 2), (0, 2), (1, 1)])
def test_a_node_run_started_by_hand_with_a_rank_it_cannot_have_is_refused_naming_it(
    tmp_path, prefect_api, node_rank, nodes
):
    """`train-node` run by hand (the Prefect UI's "custom run") with node_rank outside 1..nodes-1 (node 0 is the
    training run, which starts the others): the flow run fails at once naming the parameters, before any
    torchrun starts (was: its torchrun waited silently for a rendezvous that could never be, 10 minutes, holding
    the GPU machine)."""
    from shardline.flows.train import train_node

    began = time.monotonic()
    with pytest.raises(ValueError) as refused:
        train_node(
            job=f"{tmp_path}/job.json", node_rank=node_rank, nodes=nodes, processes_per_node=1,
            master_addr="127.0.0.1", master_port=29593,
        )  # fmt: skip
    said = str(refused.value)
    assert f"node_rank={node_rank}" in said and f"nodes={nodes}" in said and "1 to" in said, said
    assert time.monotonic() - began < 60


PEERS = """
import os, signal, sys, time
from pathlib import Path
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank, here = dist.get_rank(), Path(sys.argv[1])
signal.signal(signal.SIGTERM, lambda *_: (Path(here, f"term-{rank}").touch(), sys.exit(0)))
x = torch.ones(1)
dist.all_reduce(x)
Path(here, f"joined-{rank}").touch()
if rank == 1 and sys.argv[2] == "vanish":
    os.kill(os.getpid(), signal.SIGSTOP)  # its machine gone without a word: its sockets open, nothing sent
while True:
    dist.all_reduce(x)  # rank 0 waits here on the vanished rank 1, deaf to SIGTERM
    time.sleep(0.05)
"""


@pytest.mark.parametrize("peer", ["vanish", "answer"])
def test_a_torchrun_whose_peer_vanished_is_killed_after_the_grace_not_torchrun_s_300_s(tmp_path, peer):
    """Node 0's or node 1's torchrun when the other machine is lost (tasks/nodes.py:stop_without_peers): its ranks
    wait in a collective on a peer that never answers and never see the SIGTERM, so after the grace every
    process under torchrun is killed (torchrun itself would wait its --shutdown-timeout, 300 s, and a rank
    left behind would hold the GPU). Ranks that can stop on SIGTERM do, and nothing is killed."""
    import psutil

    from shardline.tasks.nodes import stop_without_peers
    from shardline.tasks.torchrun import torchrun_command

    script = tmp_path / "peers.py"
    script.write_text(PEERS)
    command = [*torchrun_command(300), "--standalone", "--nproc-per-node=2"]
    log = (tmp_path / "torchrun.log").open("w")
    proc = subprocess.Popen([*command, str(script), str(tmp_path), peer], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + WAIT
        while not all((tmp_path / f"joined-{r}").exists() for r in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "torchrun.log").read_text()
            time.sleep(0.2)
        ranks = psutil.Process(proc.pid).children(recursive=True)
        assert len(ranks) >= 2
        said: list[str] = []
        stop_without_peers(proc, said.append, grace=5)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    def running(p: psutil.Process) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    assert [p.pid for p in ranks if running(p)] == [], [(p.pid, p.status(), p.cmdline()) for p in ranks if running(p)]
    if peer == "vanish":
        assert proc.returncode == -signal.SIGKILL
        assert len(said) == 1 and "did not stop within 5 s of SIGTERM" in said[0], said
        assert not (tmp_path / "term-0").exists()  # rank 0 never ran its handler: it was deaf in the collective
    else:
        assert proc.returncode != -signal.SIGKILL and said == []
        assert (tmp_path / "term-0").exists()  # rank 0 stopped by itself


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


def test_torchrun_gives_the_ranks_shardline_s_grace_after_a_sigterm_on_every_torch(tmp_path):
    """Every torchrun Shardline starts goes through shardline.trainer.torchrun, which gives the ranks the grace it
    asks for whether this torch's torchrun has --shutdown-timeout (it refused the option on torch 2.11, the lent
    GPU machines', and gave a fixed 30 s) or not: a rank still busy when the grace ends is killed, and torchrun
    returns then, not after its own default."""
    from shardline.tasks.torchrun import torchrun_command
    from shardline.trainer.torchrun import knows

    assert knows("--nproc-per-node=2") and not knows("--no-such-option=1")
    script = tmp_path / "slow.py"
    script.write_text(SLOW_TO_STOP)
    with (tmp_path / "torchrun.log").open("w") as log:
        proc = subprocess.Popen(
            [*torchrun_command(2), "--standalone", "--nproc-per-node=1", str(script), str(tmp_path)],
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
