"""Kill a real training process anywhere, run it again, lose nothing.

Every run is a child process (tests/_train_child.py, one thread) on the same small shards: an uninterrupted
reference, and runs that the test kills with SIGKILL mid-epoch, right after a checkpoint, inside a checkpoint
write, twice in a row, or stops with SIGTERM. A fresh child then resumes to the end, and the result must be
the reference to the bit: every weight and optimizer tensor, the validation history, the best checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from shardline.core.config import ModelConfig
from shardline.trainer.checkpoint import latest_checkpoint, load_checkpoint
from shardline.trainer.loop import PREEMPTED_EXIT_CODE, TIMING_KEYS
from shardline.trainer.models import model_spec
from tests.conftest import list_checkpoints, write_arrays

CHILD = Path(__file__).with_name("_train_child.py")
WINDOW, HORIZON = 4, 1
CARDS = [6, 4]  # ids 1..5 and 1..3; 0 = unseen
N_CLASSES = 4
EVERY = 7  # checkpoint_every_steps of the reference run
STEPS_PER_EPOCH = 60  # 1,920 train windows / batch 32
WAIT = 60  # seconds to wait for a line from a child before failing


def make_arrays(seed: int, seg_lengths: list[int]) -> dict[str, np.ndarray]:
    """Rows whose target is a function of the previous row: learnable from a window."""
    rng = np.random.default_rng(seed)
    rows = sum(seg_lengths)
    cat = np.stack([rng.integers(1, c, rows) for c in CARDS], axis=1).astype(np.uint8)
    target = np.zeros(rows, dtype=np.int32)
    target[1:] = cat[:-1, 0] % 3 + 1
    return {
        "cont": rng.standard_normal((rows, 2)).astype(np.float32),
        "cat": cat,
        "target": target,
        "order": np.arange(rows, dtype=np.int64),
        "offsets": np.concatenate([[0], np.cumsum(seg_lengths)]).astype(np.int64),
    }


def training(**over) -> dict:
    base = dict(
        epochs=2,
        batch_size=32,
        lr=1e-2,
        warmup_steps=5,
        device="cpu",
        precision="fp32",
        seed=3,
        checkpoint_every_steps=EVERY,
        checkpoint_every_seconds=0,
        keep_checkpoints=2,
    )
    return {**base, **over}


def name(step: int) -> str:
    return f"ckpt-{step:09d}.pt"


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("kill-shards")
    specs = {
        "train.bin": write_arrays(folder / "train.bin", make_arrays(0, [484, 704, 744])),  # 1,920 windows
        "val.bin": write_arrays(folder / "val.bin", make_arrays(1, [150, 160])),
    }
    (folder / "specs.json").write_text(
        json.dumps({f: {k: v.model_dump() for k, v in s.items()} for f, s in specs.items()})
    )
    return folder


class Child:
    """A training process; its stdout and stderr are read line by line on a thread."""

    def __init__(self, tmp: Path, shards: Path, ckpt: Path, label: str, **job):
        self.result = tmp / f"{label}-result.json"
        job = {
            "shards": str(shards),
            "window": WINDOW,
            "horizon": HORIZON,
            "ckpt": str(ckpt),
            "result": str(self.result),
            "model_spec": model_spec(ModelConfig(hidden=32, layers=2, dropout=0.1), 2, CARDS, WINDOW, N_CLASSES),
            "training": training(),
            **job,
        }
        (tmp / f"{label}-job.json").write_text(json.dumps(job))
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD), str(tmp / f"{label}-job.json")],
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, line: str) -> None:
        """Read until `line` (the process keeps running)."""
        while True:
            try:
                got = self._queue.get(timeout=WAIT)
            except queue.Empty:
                pytest.fail(f"no '{line}' from the child in {WAIT}s; it said:\n" + "\n".join(self.lines[-30:]))
            if got is None:
                self.proc.wait()
                pytest.fail(
                    f"the child exited ({self.proc.returncode}) before '{line}'; it said:\n"
                    + "\n".join(self.lines[-30:])
                )
            self.lines.append(got)
            if got == line:
                return

    def send(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def kill(self) -> None:
        self.proc.kill()
        code = self.proc.wait(WAIT)
        assert code == -signal.SIGKILL, f"the child was not running when killed ({code}); it said:\n" + "\n".join(
            self.lines[-30:]
        )

    def finish(self, expect: int = 0) -> dict | None:
        try:
            code = self.proc.wait(WAIT)
        finally:
            self.proc.kill()
        while (got := self._queue.get(timeout=WAIT)) is not None:
            self.lines.append(got)
        assert code == expect, f"exit status {code}, expected {expect}; the child said:\n" + "\n".join(self.lines[-30:])
        return json.loads(self.result.read_text()) if expect == 0 else None


@pytest.fixture
def run(tmp_path, shards):
    """run(label, ckpt_folder, **job) starts a child; any child still alive at the end is killed."""
    children = []

    def start(label: str, ckpt: Path, **job) -> Child:
        children.append(Child(tmp_path, shards, ckpt, label, **job))
        return children[-1]

    yield start
    for child in children:
        child.proc.kill()
        child.proc.wait()


@pytest.fixture(scope="module")
def reference(tmp_path_factory, shards) -> tuple[dict, dict]:
    """The uninterrupted run: (its FitResult as JSON, its last checkpoint)."""
    tmp = tmp_path_factory.mktemp("reference")
    result = Child(tmp, shards, tmp / "ckpt", "reference").finish()
    assert result["steps"] == 2 * STEPS_PER_EPOCH and result["resumed_from"] is None
    return result, load_checkpoint(result["last_checkpoint"])


def assert_sound(folder: Path, finished: bool = False) -> None:
    """Every checkpoint with a sidecar is complete, best.json names a complete one, the newest loads;
    once a run has finished in the folder, no temp file of a killed write is left either."""
    for pt in list_checkpoints(str(folder)):
        side = json.loads((folder / pt).with_suffix(".json").read_text())
        data = (folder / pt).read_bytes()
        assert (hashlib.sha256(data).hexdigest(), len(data)) == (side["sha256"], side["bytes"]), pt
    if (folder / "best.json").exists():
        best = json.loads((folder / "best.json").read_text())
        assert best["sha256"] == hashlib.sha256((folder / best["file"]).read_bytes()).hexdigest()
    found = latest_checkpoint(str(folder))
    assert found is not None and load_checkpoint(found[0])["loop"]["step"] == found[1]["step"]
    if finished:
        assert not [n for n in os.listdir(folder) if n.startswith(".tmp-")]


def no_timing(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in h.items() if k not in TIMING_KEYS} for h in history]


def assert_same_as_reference(result: dict, reference: tuple[dict, dict], folder: Path) -> None:
    ref_result, ref_ckpt = reference
    ckpt = load_checkpoint(result["last_checkpoint"])
    assert ckpt["model"].keys() == ref_ckpt["model"].keys()
    for k in ref_ckpt["model"]:
        assert torch.equal(ckpt["model"][k], ref_ckpt["model"][k]), k
    assert ckpt["optimizer"]["state"].keys() == ref_ckpt["optimizer"]["state"].keys()
    for key, ref_state in ref_ckpt["optimizer"]["state"].items():
        for k, v in ref_state.items():
            assert torch.equal(ckpt["optimizer"]["state"][key][k], v), (key, k)
    assert no_timing(result["history"]) == no_timing(ref_result["history"])
    assert result["steps"] == ref_result["steps"] and result["best_score"] == ref_result["best_score"]
    assert Path(result["best_checkpoint"]).name == Path(ref_result["best_checkpoint"]).name
    assert json.loads((folder / "best.json").read_text())["file"] == Path(ref_result["best_checkpoint"]).name
    assert_sound(folder, finished=True)


def resumed(run, folder: Path, from_step: int, reference, **job) -> None:
    """A fresh child resumes from checkpoint `from_step` and must end exactly where the reference did."""
    result = run("resume", folder, **job).finish()
    assert Path(result["resumed_from"]).name == name(from_step)
    assert_same_as_reference(result, reference, folder)


# ---------------------------------------------------------------- SIGKILL


def test_kill_mid_epoch_between_checkpoints(run, tmp_path, reference):
    folder = tmp_path / "ckpt"
    child = run("killed", folder, hold_at_step=17)
    child.wait_for("held 17")
    child.kill()
    assert latest_checkpoint(str(folder))[1]["step"] == 14  # steps 15-17 are lost and redone
    assert_sound(folder)
    resumed(run, folder, 14, reference)


def test_kill_right_after_a_checkpoint(run, tmp_path, reference):
    folder = tmp_path / "ckpt"
    child = run("killed", folder, hold_after_save=name(21))
    child.wait_for(f"held {name(21)}")
    child.kill()
    assert_sound(folder)
    resumed(run, folder, 21, reference)


def test_kill_inside_a_checkpoint_write_keeps_the_previous_one(run, tmp_path, reference):
    folder = tmp_path / "ckpt"
    child = run("killed", folder, slow_write_at=28, slow_write_stage="tensors")
    child.wait_for(f"checkpoint-write-paused {name(28)} tensors")  # its .pt is written, its sidecar not yet
    child.kill()
    assert (folder / name(28)).exists() and not (folder / name(28)).with_suffix(".json").exists()
    pt, side = latest_checkpoint(str(folder))
    assert side["step"] == 21 and load_checkpoint(pt)["loop"]["step"] == 21  # the half-saved 28 is never offered
    assert_sound(folder)
    (folder / f".tmp-0123abcd-{name(35)}").write_bytes(b"what a kill inside write_bytes leaves")
    resumed(run, folder, 21, reference)


def test_two_kills_the_first_before_best_json_is_written(run, tmp_path, reference):
    """Killed between the epoch-end checkpoint's sidecar and best.json; the resume repairs the pointer (else
    pruning would delete the true best) and is killed again right after its next checkpoint."""
    folder = tmp_path / "ckpt"
    end_of_epoch = STEPS_PER_EPOCH
    child = run("killed-1", folder, slow_write_at=end_of_epoch, slow_write_stage="sidecar")
    child.wait_for(f"checkpoint-write-paused {name(end_of_epoch)} sidecar")
    child.kill()
    assert latest_checkpoint(str(folder))[1]["step"] == end_of_epoch and not (folder / "best.json").exists()
    assert_sound(folder)

    child = run("killed-2", folder, hold_after_save=name(63))
    child.wait_for(f"held {name(63)}")
    child.kill()
    assert json.loads((folder / "best.json").read_text())["file"] == name(end_of_epoch)
    assert_sound(folder)
    resumed(run, folder, 63, reference)


def test_two_kills_anywhere_with_time_based_checkpoints(run, tmp_path, reference):
    """Checkpoints every few hundredths of a second land on whatever step the clock says; the kills are sent
    while the child runs, so they land wherever it is (inside a step or a write). Then the cadence changes."""
    folder = tmp_path / "ckpt"
    timed = dict(step_sleep=0.01, training=training(checkpoint_every_steps=0, checkpoint_every_seconds=0.05))
    child = run("killed-1", folder, **timed)
    child.wait_for("step 40")
    child.kill()
    first = latest_checkpoint(str(folder))[1]["step"]
    assert any(int(n[5:14]) % STEPS_PER_EPOCH for n in list_checkpoints(str(folder)))  # taken by the clock
    assert_sound(folder)

    child = run(
        "killed-2", folder, **{**timed, "training": training(checkpoint_every_steps=0, checkpoint_every_seconds=0.03)}
    )
    child.wait_for("step 90")
    child.kill()
    second = latest_checkpoint(str(folder))[1]["step"]
    assert first < second < 2 * STEPS_PER_EPOCH
    assert_sound(folder)
    resumed(run, folder, second, reference)


# ---------------------------------------------------------------- SIGTERM


def test_sigterm_exits_preempted_then_resume_is_bit_identical(run, tmp_path, reference):
    folder = tmp_path / "ckpt"
    child = run("stopped", folder, step_sleep=0.01)
    child.wait_for("step 30")
    child.send(signal.SIGTERM)
    assert child.finish(expect=PREEMPTED_EXIT_CODE) is None
    side = latest_checkpoint(str(folder))[1]
    assert side["step"] >= 30 and not side["epoch_complete"]  # the checkpoint taken at the next step boundary
    assert_sound(folder)
    resumed(run, folder, side["step"], reference)


def test_sigterm_while_a_checkpoint_is_written_completes_it_then_stops_with_one_at_its_step(run, tmp_path, reference):
    folder = tmp_path / "ckpt"
    child = run("stopped", folder, slow_write_at=28, slow_write_seconds=0.3)
    child.wait_for(f"checkpoint-write-paused {name(28)} tensors")
    child.send(signal.SIGTERM)
    assert child.finish(expect=PREEMPTED_EXIT_CODE) is None
    # training went on while 28 was written; the signal's step boundary saves one more, after 28 is complete,
    # and the process ends once that one is written too: nothing is redone
    last = max(int(n.split()[1]) for n in child.lines if n.startswith("step "))
    assert last >= 28
    ends = [f"saved {name(28)}"] + ([f"saved {name(last)}"] if last > 28 else [])
    assert [n for n in child.lines if n.startswith("saved")][-len(ends) :] == ends
    assert latest_checkpoint(str(folder))[1]["step"] == last
    assert_sound(folder)
    resumed(run, folder, last, reference)


# ---------------------------------------------------------------- a user's own model


@pytest.fixture(scope="module")
def user_model(tmp_path_factory, shards) -> tuple[dict, tuple[dict, dict]]:
    """A user's model (tests/user_project.py, from a folder outside the repository) and its uninterrupted run."""
    from shardline.trainer.models import legacy_data_spec, model_spec_for
    from tests.user_project import write_project

    folder = tmp_path_factory.mktemp("user-repo")
    write_project(folder)
    model = ModelConfig(entrypoint="models.world:WindowGRU", params={"hidden": 16}, code_dir=str(folder))
    spec = model_spec_for(model, legacy_data_spec(2, CARDS, WINDOW, N_CLASSES))
    tmp = tmp_path_factory.mktemp("user-reference")
    result = Child(tmp, shards, tmp / "ckpt", "reference", model_spec=spec).finish()
    return spec, (result, load_checkpoint(result["last_checkpoint"]))


def test_kill_mid_epoch_and_resume_a_users_model_bit_identical(run, tmp_path, user_model):
    spec, reference = user_model
    folder = tmp_path / "ckpt"
    child = run("killed", folder, hold_at_step=17, model_spec=spec)
    child.wait_for("held 17")
    child.kill()
    assert latest_checkpoint(str(folder))[1]["step"] == 14
    resumed(run, folder, 14, reference, model_spec=spec)


# ---------------------------------------------------------------- text: a small GPT on token shards


def test_kill_mid_epoch_of_a_gpt_on_text_and_resume_bit_identical(tmp_path):
    """The same guarantee for text (issue #19): a gpt on BPE token shards, SIGKILLed mid-epoch between
    checkpoints, resumes in a fresh process to the uninterrupted run's weights, bit for bit."""
    import polars as pl

    from shardline.core.config import validate_config
    from shardline.core.manifest import Manifest
    from shardline.tasks.encode import encode_dataset
    from shardline.tasks.ingest import snapshot_source
    from shardline.trainer.models import model_spec_for
    from shardline.trainer.serving import data_spec
    from tests.test_text_data import sentences, text_config, write

    write(tmp_path, pl.DataFrame({"body": sentences(240, seed=4, lo=6, hi=14)}))
    raw = text_config(tmp_path)
    raw["model"] = {"family": "gpt", "params": {"d_model": 32, "n_layer": 2, "n_head": 2, "dropout": 0.1}}
    cfg = validate_config(raw)
    uri = encode_dataset(snapshot_source(cfg.data), cfg.data, str(tmp_path / "data"), threads=1)
    spec = model_spec_for(cfg.model, data_spec(Manifest.model_validate_json(Path(uri).read_text()).encoding))
    job = dict(manifest=uri, model_spec=spec, training=training(batch_size=16, checkpoint_every_steps=5))

    ref_result = Child(tmp_path, tmp_path, tmp_path / "ref", "text-reference", **job).finish()
    steps = ref_result["steps"]
    assert steps > 12 and ref_result["resumed_from"] is None, ref_result["steps"]
    reference = (ref_result, load_checkpoint(ref_result["last_checkpoint"]))

    folder = tmp_path / "ckpt"
    child = Child(tmp_path, tmp_path, folder, "text-killed", hold_at_step=12, **job)
    try:
        child.wait_for("held 12")
        child.kill()
    finally:
        child.proc.kill()
    assert latest_checkpoint(str(folder))[1]["step"] == 10  # steps 11-12 are lost and redone
    result = Child(tmp_path, tmp_path, folder, "text-resume", **job).finish()
    assert Path(result["resumed_from"]).name == name(10)
    assert_same_as_reference(result, reference, folder)
