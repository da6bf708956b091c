"""benchmarks/demo_wait.py, the GPU kit's `wait` step (issue #47), off the GPU: its wrappers around the trainer's names
time a real fit (the trainer tests' shards, the loader's threads), split the loop's data wait into its parts, and
leave the trained weights as an unwrapped fit leaves them. A lent GPU's minutes go to the figures, not to finding
that a renamed trainer name broke the script."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from shardline.trainer import loop
from shardline.trainer.data import SplitData
from shardline.trainer.loop import Callbacks, FitOptions
from tests.test_trainer import H, K, make_arrays, spec_for, train_cfg, write_shard

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "demo_wait.py"


def load_script():
    spec = importlib.util.spec_from_file_location("demo_wait", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_wrapped_fit_splits_each_epochs_wait_and_trains_the_same_weights(tmp_path, monkeypatch):
    train = SplitData([write_shard(tmp_path, "t.bin", make_arrays(0, [300, 250]))], K, H)
    val = SplitData([write_shard(tmp_path, "v.bin", make_arrays(7, [120]))], K, H)
    cfg = train_cfg(epochs=2, num_workers=2, grad_accum=1, deterministic=True)

    def run(name: str):
        return loop.fit(
            train, val, spec_for(), cfg, "classification", str(tmp_path / name), Callbacks(log=lambda m: None),
            FitOptions(resume=False),
        )  # fmt: skip

    plain = run("plain")
    wait = load_script()
    for owner, name, replacement in wait.wrapped():
        monkeypatch.setattr(owner, name, replacement, raising=name != "list")  # `list`: the builtin until then
    timed = run("timed")
    monkeypatch.undo()
    assert loop.fit is not wait.timed_fit and "list" not in vars(loop), "the wrappers outlived the test"

    table = wait.report()
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r[0] for r in rows] == ["| 1", "| 2"], table
    steps = plain.history[0]["step"]  # optimizer steps in epoch 1 (grad_accum 1: one batch each)
    assert all(int(r[1].replace(",", "")) == steps for r in rows), table  # every training batch timed, per epoch

    def ms(cell: str) -> float:
        return float(cell.split(" ms")[0])

    for r in rows:
        training_s, step_s, counted, in_next = float(r[2]), float(r[3]), ms(r[4]), ms(r[5])
        assert 0 < step_s <= training_s, table
        assert 0 < in_next <= counted, table  # the loader's next() is timed inside the loop's own count
    # each step's batches were let go where the script times them, right after the step
    by_epoch = wait.TimedLoader.by_epoch  # epoch -> [seconds in next(), batches]
    assert all(e["let_go"] == by_epoch[k][1] == steps for k, e in wait.epochs.items()), (dict(wait.epochs), by_epoch)
    assert "cycle collections in the fit:" in table

    # the batches let go after the step instead of at the next fetch: the same training, weight for weight
    a = torch.load(plain.last_checkpoint, map_location="cpu", weights_only=True)["model"]
    b = torch.load(timed.last_checkpoint, map_location="cpu", weights_only=True)["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
