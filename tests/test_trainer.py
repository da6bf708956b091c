"""The trainer on tiny synthetic shards: gathering, loader position, models, checkpoints, exact resume."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from shardline.core.config import ModelConfig, TrainingConfig
from shardline.core.manifest import ContinuousStat, EncodingSpec, Manifest, ShardInfo, TargetSpec, Vocabulary
from shardline.core.shards import read_arrays
from shardline.trainer.checkpoint import (
    best_checkpoint,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from shardline.trainer.data import LOADER_STATE_VERSION, SplitData, WindowLoader, open_split
from shardline.trainer.device import autocast, needs_grad_scaler, pick_device, pick_precision
from shardline.trainer.inference import load_model, predict
from shardline.trainer.loop import TIMING_KEYS, Callbacks, FitOptions, Preempted, fit
from shardline.trainer.models import model_from_spec, model_spec
from tests.conftest import list_checkpoints, split_targets, write_arrays

K, H = 4, 1
CARDS = [6, 4]  # ids 1..5 and 1..3; 0 = unseen
N_CLASSES = 4  # ids 1..3 plus the unseen id 0
TIMING = TIMING_KEYS  # measured: never the same twice


def make_arrays(seed: int, seg_lengths: list[int], task: str = "classification") -> dict[str, np.ndarray]:
    """Rows with a learnable rule: the target of row r depends on row r-1 (the window's last frame)."""
    rng = np.random.default_rng(seed)
    rows = sum(seg_lengths)
    cat = np.stack([rng.integers(1, c, rows) for c in CARDS], axis=1).astype(np.uint8)
    cont = rng.standard_normal((rows, 2)).astype(np.float32)
    if task == "classification":
        target = np.zeros(rows, dtype=np.int32)
        target[1:] = cat[:-1, 0] % 3 + 1
    else:
        target = np.zeros(rows, dtype=np.float32)
        target[1:] = 1.5 * cont[:-1, 0] - 0.5 * cont[:-1, 1]
    return {
        "cont": cont,
        "cat": cat,
        "target": target,
        "order": (np.arange(rows, dtype=np.int64) * 10 + seed),
        "offsets": np.concatenate([[0], np.cumsum(seg_lengths)]).astype(np.int64),
    }


def write_shard(folder: Path, name: str, arrays: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    path = folder / name
    specs = write_arrays(path, arrays)
    return read_arrays(path, specs)  # memory-mapped, as in training


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, SplitData]:
    folder = tmp_path_factory.mktemp("shards")
    out = {}
    for task in ("classification", "regression"):
        train = [
            write_shard(folder, f"{task}-train-{i}.bin", make_arrays(i, [200, 150, 250][: 2 + i], task))
            for i in range(2)
        ]
        val = [write_shard(folder, f"{task}-val.bin", make_arrays(7, [120, 80], task))]
        out[task] = SplitData(train, K, H)
        out[f"{task}-val"] = SplitData(val, K, H)
    return out


def spec_for(family: str = "mlp", task: str = "classification", **model) -> dict:
    cfg = ModelConfig(
        family=family, hidden=32, layers=1 if family == "transformer" else 2, heads=4, dropout=0.1, **model
    )
    return model_spec(
        cfg, n_cont=2, cat_cardinalities=CARDS, window=K, n_outputs=N_CLASSES if task == "classification" else 1
    )


def train_cfg(**over) -> TrainingConfig:
    base = dict(
        epochs=2,
        batch_size=32,
        lr=1e-2,
        warmup_steps=2,
        grad_accum=2,
        device="cpu",
        precision="fp32",
        seed=1,
        checkpoint_every_steps=3,
        keep_checkpoints=2,
    )
    return TrainingConfig(**{**base, **over})


def quiet(_msg: str) -> None:
    pass


def no_timing(history: list[dict]) -> list[dict]:
    return [{k: v for k, v in h.items() if k not in TIMING} for h in history]


# ---------------------------------------------------------------- data


def slow_windows(shards: list[dict[str, np.ndarray]]) -> list[tuple[int, int]]:
    out = []
    for s, a in enumerate(shards):
        off = a["offsets"]
        for seg in range(len(off) - 1):
            for start in range(off[seg], off[seg + 1] - K - H + 1):
                out.append((s, start))
    return out


def test_batch_gathers_the_right_rows(data):
    split = data["classification"]
    ref = slow_windows([split.view(i).arrays for i in range(split.n_shards)])
    assert split.n_windows == len(ref)
    idx = np.random.default_rng(0).permutation(split.n_windows)[:50]
    b = split.batch(idx)
    # the batch keeps the stored (narrow) types, so the fewest bytes travel; `to` widens them on the device
    assert (b.cont.dtype, b.cat.dtype, b.target.dtype) == (torch.float32, torch.uint8, torch.int32)
    wide = b.to("cpu")
    assert (wide.cont.dtype, wide.cat.dtype, wide.target.dtype) == (torch.float32, torch.int64, torch.int64)
    assert torch.equal(wide.cat, b.cat.long())
    assert tuple(b.cont.shape) == (50, K, 2) and tuple(b.cat.shape) == (50, K, 2) and tuple(b.target.shape) == (50,)
    for j, i in enumerate(idx):
        s, start = ref[i]
        a = split.view(s).arrays
        np.testing.assert_array_equal(b.cont[j].numpy(), a["cont"][start : start + K])
        np.testing.assert_array_equal(b.cat[j].numpy(), a["cat"][start : start + K])
        assert b.target[j].item() == a["target"][start + K - 1 + H]
    reg = data["regression"].batch(np.arange(5))
    assert reg.target.dtype == torch.float32 and reg.to("cpu").target.dtype == torch.float32


@pytest.mark.parametrize("positions", ["last", "all"])
def test_a_gather_writes_into_the_batch_it_is_given_and_widens_ids_for_the_device(positions):
    """On a GPU the loader gathers straight into page-locked tensors (one copy, not a gather and a second copy to
    pin them), in the types that travel: text's unsigned ids widened. The gather into given arrays is the plain
    gather, in place; into wider ones, the same values widened."""
    from shardline.trainer.data.batch import Batch
    from shardline.trainer.data.split import ShardView

    rng = np.random.default_rng(2)
    n = 400
    arrays = {
        "cont": rng.standard_normal((n, 3)).astype(np.float16),
        "cat": rng.integers(0, 60_000, (n, 2)).astype(np.uint16),
        "offsets": np.array([0, 150, 151, n], dtype=np.int64),
        "target": rng.integers(0, 60_000, n).astype(np.uint16),
    }
    view = ShardView(arrays, 6, 1, positions=positions)
    start = view.starts[rng.permutation(len(view.starts))[:40]]
    cont, cat, (target,) = view.gather(start)
    tshape = (40, 6) if positions == "all" else (40,)
    shapes = [(40, 6, 3), (40, 6, 2), tshape]
    same = Batch.empty(shapes, [torch.float16, torch.uint16, torch.uint16]).numpy()
    assert view.gather(start, same) is same  # into the arrays given
    np.testing.assert_array_equal(same[0], cont)
    np.testing.assert_array_equal(same[1], cat)
    np.testing.assert_array_equal(same[2][0], target)
    wide = Batch.empty(shapes, [torch.float16, torch.int32, torch.int32]).numpy()  # what travels to a GPU
    view.gather(start, wide)
    assert wide[1].dtype == np.int32 and wide[1].max() > 32_767
    np.testing.assert_array_equal(wide[1], cat.astype(np.int32))
    np.testing.assert_array_equal(wide[2][0], target.astype(np.int32))
    if positions == "last":
        np.testing.assert_array_equal(target, arrays["target"][start + 6])


@pytest.mark.parametrize("joined", [True, False])
def test_a_batch_gathered_into_new_tensors_as_for_a_gpu_is_the_same_batch(data, joined):
    """On a GPU a batch is gathered straight into page-locked tensors (`into`, which `pin_memory` sets; this CPU
    cannot page-lock, so the test gathers into plain ones): the same windows as the gather on the CPU, from one
    set of arrays (a split in hand) and shard by shard (a streamed split), within a shard and across them."""
    import copy

    split = data["classification"]
    if not joined:  # gathered per shard, as a streamed split is
        split = copy.copy(split)
        split._joined = None
    rng = np.random.default_rng(4)
    for idx in (rng.permutation(split.n_windows)[:70], np.arange(3, 40)):  # across shards, within the first
        plain, into = split.batch(idx), split.batch(idx, into=True)
        for a, b in zip((plain.cont, plain.cat, *plain.targets), (into.cont, into.cat, *into.targets)):
            assert a.dtype == b.dtype and torch.equal(a, b)


def test_window_keys_name_each_target_row(data):
    split = data["classification"]
    keys = split.window_keys()
    ref = slow_windows([split.view(i).arrays for i in range(split.n_shards)])
    for i in (0, 1, 195, 196, len(ref) - 1):
        s, start = ref[i]
        row = start + K - 1 + H
        a = split.view(s).arrays
        assert (keys["shard"][i], keys["row"][i]) == (s, row)
        assert keys["order"][i] == a["order"][row]
        assert a["offsets"][keys["segment"][i]] <= row < a["offsets"][keys["segment"][i] + 1]
    np.testing.assert_array_equal(split_targets(split), split.batch(np.arange(split.n_windows)).target.numpy())


def test_open_split_reads_the_manifest_shards(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDLINE_CACHE", str(tmp_path / "cache"))
    folder = tmp_path / "store" / "shards-v1"
    (folder / "train").mkdir(parents=True)
    infos = []
    for i, lengths in enumerate([[30, 40], [25]]):
        arrays = make_arrays(i, lengths)
        specs = write_arrays(folder / "train" / f"part-{i}.bin", arrays)
        raw = (folder / "train" / f"part-{i}.bin").read_bytes()
        infos.append(
            ShardInfo(
                path=f"train/part-{i}.bin",
                split="train",
                rows=sum(lengths),
                segments=len(lengths),
                windows=sum(max(0, n - K - H + 1) for n in lengths),
                bytes=len(raw),
                sha256=hashlib.sha256(raw).hexdigest(),
                arrays=specs,
                keys_path=f"train/part-{i}.keys.parquet",
                keys_sha256="0" * 64,
            )
        )
    encoding = EncodingSpec(
        sequence_key="id",
        order_by="t",
        window=K,
        horizon=H,
        continuous=[ContinuousStat(name="x", mean=0, std=1), ContinuousStat(name="y", mean=0, std=1)],
        boolean=[],
        categorical=[Vocabulary(name="a", values=list("abcde")), Vocabulary(name="b", values=list("xyz"))],
        target=TargetSpec(column="c", task="classification", classes=["1", "2", "3"]),
    )
    fields = dict(
        encoding=encoding,
        encoding_hash=encoding.hash(),
        data_fingerprint="f",
        shards=infos,
        rows={"train": 95},
        windows={"train": sum(s.windows for s in infos)},
        source_files=2,
    )
    if "contract_hash" in Manifest.model_fields:
        fields["contract_hash"] = "c"
    manifest = Manifest(**fields)
    split = open_split(manifest, str(folder / "manifest.json"), "train")
    assert split.n_windows == manifest.windows["train"] == 26 + 36 + 21
    # the two shards are laid end to end in one split pack in the local cache, built once, then reused
    from shardline.core.storage import ShardCache

    packs = [p for p in (tmp_path / "cache" / "objects").rglob("*") if p.is_file()]
    array_bytes = sum(a.nbytes for i, lengths in enumerate([[30, 40], [25]]) for a in make_arrays(i, lengths).values())
    assert len(packs) == 1 and array_bytes <= packs[0].stat().st_size < array_bytes + 64 * 8
    cache = ShardCache(tmp_path / "cache")
    again = open_split(manifest, str(folder / "manifest.json"), "train", cache=cache)
    assert cache.downloads == 0 and [p for p in (tmp_path / "cache" / "objects").rglob("*") if p.is_file()] == packs
    ref = slow_windows([make_arrays(i, lengths) for i, lengths in enumerate([[30, 40], [25]])])
    every = again.batch(np.arange(again.n_windows)[::-1])  # one gather across both shards, in the asked order
    for j, (s, start) in enumerate(reversed(ref)):
        np.testing.assert_array_equal(
            every.cat[j].numpy(), make_arrays(s, [[30, 40], [25]][s])["cat"][start : start + K]
        )
    assert encoding.cat_cardinalities == CARDS and encoding.target.n_outputs == N_CLASSES

    # the same shards through an fsspec URL: copied into the cache and checked against the manifest's sha256
    import fsspec

    mem = fsspec.filesystem("memory")
    for info in infos:
        mem.pipe_file(f"/store/{info.path}", (folder / info.path).read_bytes())
    remote = open_split(manifest, "memory://store/manifest.json", "train")
    np.testing.assert_array_equal(
        remote.batch(np.arange(remote.n_windows)).cat, split.batch(np.arange(split.n_windows)).cat
    )
    mem.pipe_file(f"/store/{infos[0].path}", b"damaged")
    monkeypatch.setenv("SHARDLINE_CACHE", str(tmp_path / "cache2"))
    with pytest.raises(IOError, match="checksum mismatch"):
        open_split(manifest, "memory://store/manifest.json", "train")
    mem.rm("/store", recursive=True)


def test_loader_order_is_a_function_of_seed_and_epoch(data):
    split = data["classification"]
    first = [b.target for b in WindowLoader(split, 64, seed=3)]
    again = [b.target for b in WindowLoader(split, 64, seed=3)]
    assert all(torch.equal(x, y) for x, y in zip(first, again)) and len(first) == len(again) == -(
        -split.n_windows // 64
    )
    loader = WindowLoader(split, 64, seed=3)
    loader.set_epoch(1)
    assert not np.array_equal(loader.order(0), loader.order(1))
    assert sorted(loader.order(1)) == list(range(split.n_windows))  # every window once per epoch
    np.testing.assert_array_equal(WindowLoader(split, 64, seed=3, shuffle=False).order(5), np.arange(split.n_windows))


def test_loader_state_round_trip_resumes_mid_epoch(data):
    split = data["classification"]
    loader = WindowLoader(split, 50, seed=11)
    loader.set_epoch(2)
    it = iter(loader)
    for _ in range(3):
        next(it)
    state = loader.state_dict()
    assert state == {"version": 3, "epoch": 2, "offset": 150, "seed": 11, "n_windows": split.n_windows}
    rest = list(it)

    restored = WindowLoader(split, 50, seed=11)
    restored.load_state_dict(json.loads(json.dumps(state)))
    again = list(restored)
    assert len(again) == len(rest) > 0
    for x, y in zip(rest, again):
        assert torch.equal(x.cont, y.cont) and torch.equal(x.cat, y.cat) and torch.equal(x.target, y.target)

    with pytest.raises(ValueError, match="seed"):
        WindowLoader(split, 50, seed=12).load_state_dict(state)
    with pytest.raises(ValueError, match="windows"):
        WindowLoader(data["classification-val"], 50, seed=11).load_state_dict(state)
    with pytest.raises(ValueError, match="version"):
        WindowLoader(split, 50, seed=11).load_state_dict({**state, "version": 99})


def test_a_batch_draws_from_every_shard_in_one_global_permutation(data):
    split = data["classification"]
    assert split.n_shards == 2
    loader = WindowLoader(split, 64, seed=5)
    order = loader.order(0)
    # a plain global permutation of seed and epoch: every window once, batches mix the shards
    np.testing.assert_array_equal(order, np.random.default_rng([5, 0]).permutation(split.n_windows))
    ref = slow_windows([split.view(i).arrays for i in range(split.n_shards)])
    batches = list(loader)
    assert len(batches) == -(-split.n_windows // 64)
    for j in (0, len(batches) - 1):
        ids = order[j * 64 : (j + 1) * 64]
        assert len(set(split.shard_of(ids).tolist())) == 2  # both shards in one batch, gathered in the stated order
        for row, i in enumerate(ids):
            s, start = ref[i]
            np.testing.assert_array_equal(batches[j].cont[row].numpy(), split.view(s).arrays["cont"][start : start + K])
            assert batches[j].target[row].item() == split.view(s).arrays["target"][start + K - 1 + H]


@pytest.mark.parametrize("workers", [1, 2])
def test_loader_threads_deliver_the_same_batches_and_resume(data, workers):
    split = data["classification"]
    ref = list(WindowLoader(split, 50, seed=4))
    loader = WindowLoader(split, 50, seed=4, num_workers=workers)
    got = list(loader)
    assert len(got) == len(ref) and loader.offset == split.n_windows
    for x, y in zip(ref, got):
        assert torch.equal(x.cont, y.cont) and torch.equal(x.cat, y.cat) and torch.equal(x.target, y.target)
    # stopped early (max_steps_per_epoch, a preemption): the position counts only what was handed out
    loader = WindowLoader(split, 50, seed=4, num_workers=workers)
    it = iter(loader)
    for _ in range(3):
        next(it)
    it.close()
    assert loader.state_dict()["offset"] == 150
    rest = list(loader)
    assert all(torch.equal(x.target, y.target) for x, y in zip(ref[3:], rest)) and len(rest) == len(ref) - 3


# ---------------------------------------------------------------- device and models


def test_device_and_precision_on_cpu():
    if not torch.cuda.is_available():
        assert pick_device("auto").type in ("cpu", "mps")
        with pytest.raises(ValueError, match=r"training\.device='cuda'.*available: .*cpu"):
            pick_device("cuda")
    assert pick_device("cpu").type == "cpu"
    cpu = torch.device("cpu")
    assert pick_precision("auto", cpu) == "fp32"
    assert pick_precision("bf16", cpu) == "bf16"
    with pytest.raises(ValueError, match=r"training\.precision='fp16' is not supported on the CPU.*fp32 or bf16"):
        pick_precision("fp16", cpu)
    assert needs_grad_scaler("fp16") and not needs_grad_scaler("bf16") and not needs_grad_scaler("fp32")
    with autocast(cpu, "bf16"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    with autocast(cpu, "fp32"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.float32


@pytest.mark.parametrize("family", ["mlp", "transformer"])
def test_models_rebuild_from_their_spec(family):
    torch.manual_seed(0)
    model = model_from_spec(model_spec(ModelConfig(family=family, hidden=16, heads=2), 2, CARDS, K, N_CLASSES))
    spec = model.shardline_spec
    assert json.loads(json.dumps(spec)) == spec and spec["version"] == 3
    twin = model_from_spec(spec)
    twin.load_state_dict(model.state_dict())
    model.eval(), twin.eval()
    cont, cat = torch.randn(3, K, 2), torch.randint(0, 4, (3, K, 2))
    out = model(cont, cat)  # the model contract: {target: tensor}
    assert list(out) == ["target"] and out["target"].shape == (3, N_CLASSES) and out["target"].dtype == torch.float32
    assert torch.equal(out["target"], twin(cont, cat)["target"])
    regression = model_from_spec(model_spec(ModelConfig(family=family, heads=2), 2, CARDS, K, 1))
    assert regression(cont, cat)["target"].shape == (3,)


def test_embeddings_of_one_width_share_a_table_and_v1_models_still_load():
    from shardline.trainer.models import FrameEncoder, embedding_width

    cards = [6, 4, 3, 3, 40, 5]  # widths 4, 3, 3, 3, 13, 4: three tables, not six
    torch.manual_seed(0)
    fused = FrameEncoder(2, cards, None)
    assert len(fused.tables) == len({embedding_width(c) for c in cards}) == 3
    per_column = FrameEncoder(2, cards, None, fused=False)
    # the same lookups: copy each column's rows of the shared table into its own embedding
    for cols, table in zip(fused.groups, fused.tables):
        at = 0
        for i in cols:
            per_column.embeddings[i].weight.data.copy_(table.weight.data[at : at + cards[i]])
            at += cards[i]
    cont = torch.randn(5, K, 2)
    cat = torch.stack([torch.randint(0, c, (5, K)) for c in cards], dim=-1)
    got, want = fused(cont, cat), per_column(cont, cat)
    assert got.shape == want.shape == (5, K, fused.width) and fused.width == 2 + sum(embedding_width(c) for c in cards)
    order = [0, 1] + [
        2 + j
        for cols in fused.groups
        for i in cols
        for j in range(sum(map(embedding_width, cards[:i])), sum(map(embedding_width, cards[: i + 1])))
    ]
    assert torch.equal(got, want[..., order])  # each column's vector, grouped by width
    # a model registered before (spec version 1: a table per column) rebuilds in its own layout
    old = {
        "version": 1,
        "model": {"family": "mlp", "hidden": 16},
        "n_cont": 2,
        "cat_cardinalities": CARDS,
        "window": K,
        "n_outputs": N_CLASSES,
    }
    v1 = model_from_spec(old)
    assert "frames.embeddings.0.weight" in v1.state_dict() and "head.weight" in v1.state_dict()
    assert v1(torch.randn(2, K, 2), torch.ones(2, K, 2, dtype=torch.long))["target"].shape == (2, N_CLASSES)


@pytest.mark.parametrize("family", ["mlp", "transformer"])
def test_both_families_learn_the_rule(data, tmp_path, family):
    cfg = train_cfg(epochs=2, grad_accum=1, checkpoint_every_steps=0)
    result = fit(
        data["classification"],
        data["classification-val"],
        spec_for(family),
        cfg,
        "classification",
        str(tmp_path / "ckpt"),
        callbacks=Callbacks(log=quiet),
    )
    losses = [h["val_loss"] for h in result.history]
    assert losses[-1] < losses[0] and losses[-1] < 0.25 * np.log(3)  # a uniform guess among the 3 classes scores ln 3
    assert result.history[-1]["val_accuracy"] > 0.9  # chance is 1/3
    assert result.history[-1]["train_loss"] < result.history[0]["train_loss"]
    assert result.best_score == min(losses) and result.device == "cpu" and result.precision == "fp32"

    model = load_model(result.best_checkpoint)
    probs = predict(model, data["classification-val"], batch_size=100)["target"]
    assert probs.shape == (data["classification-val"].n_windows, N_CLASSES) and probs.dtype == np.float32
    assert np.all(probs[:, 0] == 0) and np.allclose(probs.sum(1), 1, atol=1e-5)
    accuracy = (probs.argmax(1) == split_targets(data["classification-val"])).mean()
    assert accuracy == pytest.approx(
        next(h for h in result.history if h["val_loss"] == result.best_score)["val_accuracy"]
    )


def test_regression_trains(data, tmp_path):
    cfg = train_cfg(epochs=3, grad_accum=1, lr=5e-3, checkpoint_every_steps=0)
    result = fit(
        data["regression"],
        data["regression-val"],
        spec_for("mlp", "regression"),
        cfg,
        "regression",
        str(tmp_path / "ckpt"),
        callbacks=Callbacks(log=quiet),
    )
    val = data["regression-val"]
    baseline = np.abs(split_targets(val) - split_targets(val).mean()).mean()
    assert result.history[-1]["val_mae"] < 0.5 * baseline
    assert result.history[-1]["val_loss"] < result.history[0]["val_loss"]
    preds = predict(load_model(result.last_checkpoint), val)["target"]
    assert preds.shape == (val.n_windows, 1)
    assert np.abs(preds[:, 0] - split_targets(val)).mean() == pytest.approx(result.history[-1]["val_mae"], rel=1e-4)


def test_bf16_on_cpu_runs(data, tmp_path):
    result = fit(
        data["classification"],
        data["classification-val"],
        spec_for("mlp"),
        train_cfg(epochs=1, precision="bf16", max_steps_per_epoch=3),
        "classification",
        str(tmp_path),
        callbacks=Callbacks(log=quiet),
    )
    assert result.precision == "bf16" and result.steps == 3 and np.isfinite(result.history[0]["val_loss"])


# ---------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("where", ["local", "memory"])
def test_pruning_keeps_newest_and_best(tmp_path, where):
    folder = str(tmp_path / "ck") if where == "local" else f"memory://ckpt-test-{os.getpid()}"
    for step in range(1, 7):
        save_checkpoint(
            folder, step, {"w": torch.full((3,), float(step))}, {"best_score": 0.1 * step}, is_best=step == 2, keep=2
        )
    assert list_checkpoints(folder) == ["ckpt-000000002.pt", "ckpt-000000005.pt", "ckpt-000000006.pt"]
    pt, side = latest_checkpoint(folder)
    assert pt.endswith("ckpt-000000006.pt") and side["step"] == 6 and side["file"] == "ckpt-000000006.pt"
    assert torch.equal(load_checkpoint(pt)["w"], torch.full((3,), 6.0))
    best_pt, best_side = best_checkpoint(folder)
    assert best_pt.endswith("ckpt-000000002.pt") and best_side["best_score"] == pytest.approx(0.2)
    if where == "local":
        names = sorted(os.listdir(folder))
        assert names == ["best.json", *[f"ckpt-00000000{s}.{e}" for s in (2, 5, 6) for e in ("json", "pt")]]
    else:
        import fsspec

        fsspec.filesystem("memory").rm(folder.removeprefix("memory:/"), recursive=True)


def test_incomplete_checkpoints_are_skipped(tmp_path):
    folder = tmp_path / "ck"
    for step in (1, 2, 3, 4):
        save_checkpoint(str(folder), step, {"w": torch.arange(1000.0)}, {}, is_best=step == 1, keep=5)
    pt4 = folder / "ckpt-000000004.pt"
    pt4.write_bytes(pt4.read_bytes()[:100])  # truncated
    (folder / "ckpt-000000003.pt").unlink()  # missing
    (folder / "ckpt-000000005.pt").write_bytes(b"a save that died before its sidecar")
    (folder / ".tmp-abc-ckpt-000000006.json").write_text("{}")
    pt, side = latest_checkpoint(str(folder))
    assert pt.endswith("ckpt-000000002.pt") and side["step"] == 2
    with pytest.raises(IOError, match="checksum"):
        load_checkpoint(str(pt4))
    (folder / "ckpt-000000002.json").write_text("{not json")
    assert latest_checkpoint(str(folder))[1]["step"] == 1
    assert latest_checkpoint(str(tmp_path / "nowhere")) is None


# ---------------------------------------------------------------- exact resume


@pytest.fixture(scope="module")
def straight(data, tmp_path_factory):
    """Uninterrupted 2-epoch runs (930 windows, 30 batches of 32, 15 optimizer steps per epoch), one per family."""
    runs = {}
    for family in ("mlp", "transformer"):
        folder = str(tmp_path_factory.mktemp(f"straight-{family}"))
        result = fit(
            data["classification"],
            data["classification-val"],
            spec_for(family),
            train_cfg(),
            "classification",
            folder,
            callbacks=Callbacks(log=quiet),
        )
        runs[family] = (result, load_model(result.last_checkpoint).state_dict())
    return runs


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


class Crash(Exception):
    pass


@pytest.mark.parametrize("family,crash_at", [("mlp", 5), ("mlp", 16), ("transformer", 8)])
def test_resume_after_a_crash_is_bit_identical(data, tmp_path, straight, family, crash_at):
    reference, ref_weights = straight[family]
    assert reference.steps == 30
    folder = str(tmp_path / "ckpt")

    def crash(step, metrics):
        assert set(metrics) == {"train_loss", "lr"}
        if step == crash_at:
            raise Crash

    with pytest.raises(Crash):
        fit(
            data["classification"],
            data["classification-val"],
            spec_for(family),
            train_cfg(),
            "classification",
            folder,
            callbacks=Callbacks(on_step=crash, log=quiet),
            options=FitOptions(step_every=1, run_meta={"run_id": "abc"}),
        )
    saved = latest_checkpoint(folder)[1]
    assert saved["step"] == crash_at // 3 * 3  # the last checkpoint before the crash (15: the end of epoch 0)
    epochs = []
    result = fit(
        data["classification"],
        data["classification-val"],
        spec_for(family),
        train_cfg(),
        "classification",
        folder,
        callbacks=Callbacks(on_epoch=lambda e, m: epochs.append(e), log=quiet),
    )
    assert result.resumed_from and result.resumed_from.endswith(f"ckpt-{saved['step']:09d}.pt")
    assert result.run_meta == {"run_id": "abc"} and result.steps == 30
    assert_same_weights(load_model(result.last_checkpoint).state_dict(), ref_weights)
    assert no_timing(result.history) == no_timing(reference.history)
    assert epochs == ([1] if saved["epoch_complete"] or saved["epoch"] == 1 else [0, 1])
    assert result.best_checkpoint.rsplit("/", 1)[-1] == reference.best_checkpoint.rsplit("/", 1)[-1]


def preempt_at_step_4(data, folder: str, cfg: TrainingConfig):
    """The mlp's run of `cfg`, sent SIGTERM at its 4th step: it checkpoints there and raises Preempted."""

    def terminate(step, metrics):
        if step == 4:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(Preempted) as stopped:
        fit(
            data["classification"],
            data["classification-val"],
            spec_for("mlp"),
            cfg,
            "classification",
            folder,
            callbacks=Callbacks(on_step=terminate, log=quiet),
            options=FitOptions(step_every=1),
        )
    return stopped


def test_sigterm_checkpoints_then_resume_is_bit_identical(data, tmp_path, straight):
    reference, ref_weights = straight["mlp"]
    folder = str(tmp_path / "ckpt")
    before = signal.getsignal(signal.SIGTERM)
    # checkpoint_every_steps differs from the reference run: it does not change what is computed
    stopped = preempt_at_step_4(data, folder, train_cfg(checkpoint_every_steps=0))
    assert signal.getsignal(signal.SIGTERM) == before
    assert stopped.value.checkpoint.endswith("ckpt-000000004.pt")
    side = latest_checkpoint(folder)[1]
    assert (side["step"], side["epoch"], side["epoch_complete"]) == (4, 0, False)
    assert side["loader"]["offset"] == 4 * 2 * 32  # 4 steps of 2 micro-batches of 32
    result = fit(
        data["classification"],
        data["classification-val"],
        spec_for("mlp"),
        train_cfg(checkpoint_every_steps=0),
        "classification",
        folder,
        callbacks=Callbacks(log=quiet),
    )
    assert_same_weights(load_model(result.last_checkpoint).state_dict(), ref_weights)
    assert no_timing(result.history) == no_timing(reference.history)


def fit_mlp(data, folder: str, on_step=None):
    """The mlp's run of `train_cfg()` in `folder` (resumed from what it holds), `on_step` told of every step."""
    return fit(
        data["classification"],
        data["classification-val"],
        spec_for("mlp"),
        train_cfg(),
        "classification",
        folder,
        callbacks=Callbacks(on_step=on_step, log=quiet),
        options=FitOptions(step_every=1),
    )


def test_a_checkpoint_is_written_while_training_goes_on_and_holds_the_state_of_its_own_step(
    data, tmp_path, straight, monkeypatch
):
    """Each write of the checkpoint at step 3 waits until training has taken two more steps: with the write in the
    training's own thread that would never happen. What it writes is still step 3's state: a run resumed from it
    ends on the uninterrupted run's weights."""
    import threading

    import shardline.trainer.saver as saver

    reference, ref_weights = straight["mlp"]
    folder, reached, late = str(tmp_path / "ckpt"), {"step": 0}, []
    moved_on = threading.Condition()

    def on_step(step, metrics):
        with moved_on:
            reached["step"] = step
            moved_on.notify_all()
        if step == 5:
            raise Crash

    def save_after_two_more_steps(dir_uri, step, *args):
        with moved_on:
            if not moved_on.wait_for(lambda: reached["step"] >= step + 2, timeout=60):
                late.append(step)
        return save_checkpoint(dir_uri, step, *args)

    monkeypatch.setattr(saver, "save_checkpoint", save_after_two_more_steps)
    with pytest.raises(Crash):
        fit_mlp(data, folder, on_step)
    assert late == [], f"training waited for the checkpoint(s) of step(s) {late}"
    assert latest_checkpoint(folder)[1]["step"] == 3  # written, complete, by the time fit raised
    monkeypatch.undo()
    result = fit_mlp(data, folder)
    assert result.resumed_from.endswith("ckpt-000000003.pt")
    assert_same_weights(load_model(result.last_checkpoint).state_dict(), ref_weights)


def test_a_checkpoint_that_cannot_be_written_fails_the_run_naming_it(data, tmp_path):
    folder = tmp_path / "ckpt"

    def block_the_folder(step, metrics):
        if step == 4:  # a folder where the checkpoint of step 6 goes: it cannot be written
            (folder / "ckpt-000000006.pt").mkdir()

    with pytest.raises(OSError) as failed:
        fit_mlp(data, str(folder), block_the_folder)
    assert "ckpt-000000006.pt" in str(failed.value)
    assert latest_checkpoint(str(folder))[1]["step"] == 3  # the one before it stays, complete


def test_cuda_graphs_on_the_cpu_say_so_and_train_exactly_as_eager_steps(data, tmp_path, straight):
    reference, ref_weights = straight["mlp"]
    said = []
    result = fit(
        data["classification"],
        data["classification-val"],
        spec_for("mlp"),
        train_cfg(cuda_graphs=True),
        "classification",
        str(tmp_path / "ckpt"),
        callbacks=Callbacks(log=said.append),
    )
    assert any(
        m.startswith("note: training.cuda_graphs is set, but every step runs eagerly: it trains on cpu") for m in said
    ), said
    assert_same_weights(load_model(result.last_checkpoint).state_dict(), ref_weights)
    assert no_timing(result.history) == no_timing(reference.history)


def test_a_probed_step_names_the_models_line_that_reads_back_and_leaves_torchs_own_to_the_capture(tmp_path):
    """The second warm-up step on a GPU reports torch's synchronising calls (as warnings, whose place is the Python
    line that made the call): one in a model's own file keeps the step eager, with that line in the note; torch's
    own and the trainer's (an autograd backward's, said at `backward()`) are left to the capture."""
    import warnings

    import shardline.trainer.graphed as graphed

    user = tmp_path / "masked.py"
    user.write_text("diff = (outputs - cont)[mask]\n")
    probe = graphed.GraphedStep(lambda bs: None, (4,), None, [], torch.device("cpu"), lambda m: None)
    sync = "called a synchronizing CUDA operation"
    said = [
        warnings.WarningMessage(UserWarning(sync), UserWarning, str(user), 1),
        warnings.WarningMessage(UserWarning(sync), UserWarning, torch.nn.functional.__file__, 5),
        warnings.WarningMessage(UserWarning(sync), UserWarning, graphed.__file__.replace("graphed", "step"), 9),
        warnings.WarningMessage(UserWarning("an unrelated warning"), UserWarning, str(user), 1),
        warnings.WarningMessage(
            UserWarning(sync), UserWarning, str(tmp_path / ".." / user.parent.name / "masked.py"), 1
        ),
    ]
    assert probe._syncs_of_users_code(said) == ["masked.py:1"]
    assert probe._syncs_of_users_code(said[1:4]) == []


def test_a_checkpoint_of_a_captured_run_resumes_with_eager_steps(data, tmp_path, straight):
    """A run on a GPU with training.cuda_graphs saves AdamW capturable, its learning rate a tensor: resumed on
    a machine without graphs (here the CPU) it steps as an ordinary AdamW, exactly as the uninterrupted run."""
    reference, ref_weights = straight["mlp"]
    folder = str(tmp_path / "ckpt")
    stopped = preempt_at_step_4(data, folder, train_cfg())
    pt, side = latest_checkpoint(folder)
    assert pt == stopped.value.checkpoint
    state = load_checkpoint(pt)
    for group in state["optimizer"]["param_groups"]:  # as match_optimizer leaves them for a captured step
        group["capturable"], group["lr"] = True, torch.tensor(group["lr"], dtype=torch.float32)
    meta = {k: v for k, v in side.items() if k not in ("format", "step", "file", "sha256", "bytes", "saved_at")}
    save_checkpoint(folder, side["step"], state, meta, is_best=False, keep=10)
    result = fit(
        data["classification"],
        data["classification-val"],
        spec_for("mlp"),
        train_cfg(cuda_graphs=True),
        "classification",
        folder,
        callbacks=Callbacks(log=quiet),
    )
    assert result.resumed_from == pt
    assert_same_weights(load_model(result.last_checkpoint).state_dict(), ref_weights)


def test_training_deterministic_switches_torchs_kernels_for_the_fit_alone_and_switching_it_resumes_the_run(
    data, tmp_path, straight
):
    """training.deterministic: false leaves torch's deterministic algorithms off during the fit, true turns
    them on (null: on the CPU only); after the fit the process has its own setting back. It is a setting a
    resume may change: a run preempted without it resumes with it, to the uninterrupted run's weights."""
    reference, ref_weights = straight["mlp"]
    folder = str(tmp_path / "ckpt")
    assert not torch.are_deterministic_algorithms_enabled()
    seen = {}

    def run(setting):
        def on_step(step, metrics):
            seen.setdefault(setting, set()).add(torch.are_deterministic_algorithms_enabled())
            if setting is False and step == 4:
                os.kill(os.getpid(), signal.SIGTERM)

        return fit(
            data["classification"],
            data["classification-val"],
            spec_for("mlp"),
            train_cfg(deterministic=setting),
            "classification",
            folder,
            callbacks=Callbacks(on_step=on_step, log=quiet),
            options=FitOptions(step_every=1),
        )

    with pytest.raises(Preempted):
        run(False)
    assert seen[False] == {False}
    assert not torch.are_deterministic_algorithms_enabled()
    result = run(True)
    assert seen[True] == {True}
    assert result.resumed_from and result.resumed_from.endswith("ckpt-000000004.pt")
    assert not torch.are_deterministic_algorithms_enabled()  # the process's own setting is back
    assert_same_weights(load_model(result.last_checkpoint).state_dict(), ref_weights)  # the CPU's kernels are exact


def test_training_deterministic_on_cuda_fixes_cublas_workspace_unless_the_environment_sets_one(monkeypatch):
    """On a GPU, training.deterministic: true needs cuBLAS's fixed workspace too: set for the process when the
    environment has none, a user's own left alone; null leaves the GPU's kernels as they are (fast)."""
    from shardline.trainer.stops import deterministic as _deterministic

    cuda = torch.device("cuda")  # only the setting is read: no GPU is touched
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    with _deterministic(cuda, None):
        assert not torch.are_deterministic_algorithms_enabled()
        assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    with _deterministic(cuda, True):
        assert torch.are_deterministic_algorithms_enabled()
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    assert not torch.are_deterministic_algorithms_enabled()
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    with _deterministic(cuda, True):
        assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"
    with _deterministic(torch.device("cpu"), None):
        assert torch.are_deterministic_algorithms_enabled()


def test_finished_run_is_not_trained_again(data, tmp_path, straight):
    reference, _ = straight["mlp"]
    folder = Path(reference.last_checkpoint).parent
    calls = []
    again = fit(
        data["classification"],
        data["classification-val"],
        spec_for("mlp"),
        train_cfg(),
        "classification",
        str(folder),
        callbacks=Callbacks(on_step=lambda s, m: calls.append(s), log=quiet),
        options=FitOptions(step_every=1),
    )
    assert calls == [] and again.steps == 30 and again.history == reference.history
    assert again.best_checkpoint == reference.best_checkpoint and again.last_checkpoint == reference.last_checkpoint


def test_resume_refuses_another_config(data, tmp_path, straight):
    folder = str(Path(straight["mlp"][0].last_checkpoint).parent)
    with pytest.raises(ValueError, match="another model config"):
        fit(
            data["classification"],
            data["classification-val"],
            spec_for("mlp", embedding_dim=3),
            train_cfg(),
            "classification",
            folder,
            callbacks=Callbacks(log=quiet),
        )
    with pytest.raises(ValueError, match=r"training\.lr"):
        fit(
            data["classification"],
            data["classification-val"],
            spec_for("mlp"),
            train_cfg(lr=0.5),
            "classification",
            folder,
            callbacks=Callbacks(log=quiet),
        )


def test_checkpoint_layout_is_tensors_plus_readable_sidecar(data, straight):
    result, _ = straight["mlp"]
    folder = Path(result.last_checkpoint).parent
    side = json.loads((folder / "ckpt-000000030.json").read_text())
    assert side["step"] == 30 and side["epoch"] == 1 and side["epoch_complete"] is True
    assert side["loader"] == {
        "version": LOADER_STATE_VERSION,
        "epoch": 1,
        "offset": data["classification"].n_windows,
        "seed": 1,
        "n_windows": data["classification"].n_windows,
    }
    assert side["sha256"] == hashlib.sha256((folder / "ckpt-000000030.pt").read_bytes()).hexdigest()
    assert side["model_spec"] == spec_for("mlp") and side["training"]["lr"] == 1e-2 and len(side["history"]) == 2
    best = json.loads((folder / "best.json").read_text())
    assert best["file"] == Path(result.best_checkpoint).name
    ckpt = load_checkpoint(result.last_checkpoint)  # weights_only=True
    assert set(ckpt) >= {"model", "optimizer", "scaler", "rng", "loader", "loop", "history", "run_meta", "model_spec"}
    assert isinstance(ckpt["rng"]["torch"], torch.Tensor) and isinstance(ckpt["rng"]["numpy"][1], list)


def test_resume_false_starts_over_in_a_used_folder(data, tmp_path):
    folder = tmp_path / "ckpt"
    quick = train_cfg(epochs=1, max_steps_per_epoch=2, checkpoint_every_steps=1)
    fit(
        data["classification"],
        data["classification-val"],
        spec_for("mlp"),
        quick,
        "classification",
        str(folder),
        callbacks=Callbacks(log=quiet),
    )
    other = spec_for("mlp", embedding_dim=3)
    result = fit(
        data["classification"],
        data["classification-val"],
        other,
        train_cfg(epochs=1, max_steps_per_epoch=1),
        "classification",
        str(folder),
        callbacks=Callbacks(log=quiet),
        options=FitOptions(resume=False),
    )
    assert result.resumed_from is None and result.steps == 1
    assert sorted(os.listdir(folder)) == ["best.json", "ckpt-000000001.json", "ckpt-000000001.pt"]
    assert load_checkpoint(result.last_checkpoint)["model_spec"] == other


def test_settings_sized_for_another_data_set_are_said_at_the_start(data, tmp_path):
    lines: list[str] = []
    cfg = train_cfg(epochs=1, warmup_steps=500, checkpoint_every_steps=1000)
    fit(
        data["classification"],
        data["classification-val"],
        spec_for(),
        cfg,
        "classification",
        str(tmp_path / "ckpt"),
        callbacks=Callbacks(log=lines.append),
    )
    steps = -(-data["classification"].n_windows // 64)  # batches of 32, grad_accum 2
    assert f"note: training.warmup_steps=500 is not below this run's {steps} optimizer steps" in "\n".join(lines)
    assert f"checkpoint_every_steps=1000 is not below this run's {steps} optimizer steps" in "\n".join(lines)
    # above an epoch's 2 steps but below the run's 4: no note, and a checkpoint at step 3, in the second epoch
    quiet_lines: list[str] = []
    fit(
        data["classification"],
        data["classification-val"],
        spec_for(),
        train_cfg(epochs=2, max_steps_per_epoch=2, checkpoint_every_steps=3, keep_checkpoints=10),
        "classification",
        str(tmp_path / "ckpt2"),
        callbacks=Callbacks(log=quiet_lines.append),
    )
    assert not any(line.startswith("note:") for line in quiet_lines)
    assert (tmp_path / "ckpt2" / "ckpt-000000003.pt").exists()


@pytest.mark.parametrize("stop", ["sigterm mid-epoch", "crash after the report"])
def test_a_trial_stopped_and_resumed_reports_its_pruner_the_same_values(data, tmp_path, stop):
    """A sweep's trial reports each epoch's selection metric to its Optuna study. Preempted mid-epoch (SIGTERM),
    or killed after an epoch's report and before its checkpoint, then resumed: the study holds the same values at
    the same epochs as a trial that never stopped, to the bit, so the pruner decides the same."""
    from shardline.core.study import Pruning, open_study

    journal = str(tmp_path / "optuna")
    cfg = train_cfg(epochs=3, checkpoint_every_steps=0)

    def trial_of(name: str) -> Pruning:
        number = open_study(journal, name, "minimize").ask().number
        return Pruning(journal=journal, study=name, trial=number, pruner="median", epochs=3, select_by="val_loss")

    def run(folder: str, pruning: Pruning, **callbacks):
        return fit(
            data["classification"],
            data["classification-val"],
            spec_for("mlp"),
            cfg,
            "classification",
            folder,
            callbacks=Callbacks(log=quiet, **{"prune": pruning.callback(quiet), **callbacks}),
            options=FitOptions(step_every=1),
        )

    straight = run(str(tmp_path / "straight"), trial_of("straight"))
    assert straight.pruned_epoch is None  # alone in its study: the median pruner has nothing to compare with
    trial, folder = trial_of("stopped"), str(tmp_path / "stopped")
    if stop == "sigterm mid-epoch":

        def terminate(step, metrics):
            if step == 20:  # the second epoch's 5th step (15 a epoch)
                os.kill(os.getpid(), signal.SIGTERM)

        with pytest.raises(Preempted):
            run(folder, trial, on_step=terminate)
    else:
        report = trial.callback(quiet)

        def report_then_die(epoch, entry):
            report(epoch, entry)
            if epoch == 1:
                raise Crash  # reported epoch 2, its checkpoint never written: the resume runs epoch 2 again

        with pytest.raises(Crash):
            run(folder, trial, prune=report_then_die)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resumed = run(folder, trial)
    assert resumed.resumed_from is not None and resumed.steps == straight.steps
    # an epoch reported before the stop is not reported again (Optuna warned "already reported" to the console)
    assert not [w for w in caught if "already reported" in str(w.message)], [str(w.message) for w in caught]

    def values(name: str) -> dict:
        return open_study(journal, name, None).trials[0].intermediate_values

    assert values("stopped") == values("straight") and sorted(values("straight")) == [1, 2]


def test_a_joined_splits_window_index_takes_memory_per_sequence_not_per_window_and_gathers_the_same_windows():
    """Each window's start row is worked out from its sequence's (a binary search over the sequences), never
    listed per window: joining 20 shards of 50,000 rows adds bytes per sequence, not per window (before: a start
    row per window, per shard and joined, 8 bytes a window; 555 MB at 22,000 games). The starts are those
    `window_starts` lists, and a batch gathers the same rows."""
    import tracemalloc

    from shardline.core.shards import window_starts

    rng = np.random.default_rng(5)
    shards = []
    for i in range(20):
        n = 50_000
        offsets = np.concatenate([[0], np.sort(rng.choice(np.arange(1, n), 40, replace=False)), [n]])
        if i == 3:  # sequences shorter than a window: they have none
            offsets = np.concatenate([[0, 2, 5], offsets[1:] + 5])[:-1]
            offsets[-1] = n
        shards.append(
            {
                "cont": rng.standard_normal((n, 2)).astype(np.float16),
                "cat": rng.integers(0, 9, (n, 1)).astype(np.int8),
                "offsets": offsets.astype(np.int64),
                "target": rng.integers(0, 5, n).astype(np.int16),
            }
        )
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        d = SplitData(shards, 8, 1)
        now, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    joined = sum(a.nbytes for a in d._joined.arrays.values())  # the shards' rows end to end
    # a start per window was 8 bytes a window; below 1, whatever another thread of this process (a test before's
    # Prefect or MLflow worker) allocates meanwhile: tracemalloc counts every thread's (0.34 seen once, on CI's load)
    assert (peak - before - joined) / d.n_windows < 1.0, (peak - before - joined) / d.n_windows
    listed = [window_starts(a["offsets"], 8, 1) for a in shards]
    bases = np.cumsum([0] + [len(a["cont"]) for a in shards[:-1]])
    assert np.array_equal(np.asarray(d._joined.starts), np.concatenate([x + b for x, b in zip(listed, bases)]))
    assert (
        np.array_equal(np.asarray(d.view(3).starts), listed[3])
        and d.view(3).starts[5:9].tolist() == listed[3][5:9].tolist()
    )
    idx = rng.choice(d.n_windows, 300, replace=False)
    s, start = d.locate(idx)
    b = d.batch(idx)
    for j in (0, 150, 299):  # window idx[j] is rows start..start+7 of its shard
        assert torch.equal(b.cont[j], torch.from_numpy(shards[s[j]]["cont"][start[j] : start[j] + 8]))


def test_the_pages_a_gather_reads_are_at_byte_offsets_past_2_gib_from_int32_start_rows():
    """Start rows are int32; a gather's byte offsets in a memory-mapped pack (start x row bytes) go past 2**31 in a
    split of 22,000 games, and must not overflow (the full-size run stopped there with an OverflowError)."""
    from shardline.trainer.data.split import ShardView

    n = 1_000
    view = ShardView(
        {"cont": np.zeros((n, 25), np.float32), "cat": np.zeros((n, 2), np.int8), "offsets": np.array([0, n])}, 8, 0
    )
    read = []

    class Pages:  # where the arrays lie in a mapping, and what a gather reads of it
        def offset_of(self, a):
            return 0

        def read(self, spans):
            read.extend(spans)

    view.bound(Pages())
    view._note(np.array([30_000_000], dtype=np.int32))  # a start row of a large pack, 100 bytes a row
    assert read[0][0].tolist() == [3_000_000_000]
