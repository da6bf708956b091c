"""Training on a split four times the local shard cache: it streams, ends with the very weights of the
same training on an uncapped cache, and resumes exactly after a SIGKILL mid-epoch.

The data set is encoded by the encode step's own functions (LZ4 shards, one file group a shard), 16 train
shards of 1.6-3.1 MB unpacked (36 MB); the cache cap is a quarter of the train split's unpacked size, so the
validation split streams too. Every run computes on one thread, so the runs in this process and the
child processes (tests/_train_child.py) do the same arithmetic.
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
import polars as pl
import pytest
import torch

from shardline.core import storage
from shardline.core.codes import Globaliser
from shardline.core.config import ModelConfig, TrainingConfig, validate_config
from shardline.core.failures import is_infrastructure_failure
from shardline.core.shards import FAULT_BLOCK, RESIDENT_ENV, SEQUENTIAL_KEEP, MappedPages
from shardline.core.storage import CacheFull, ShardCache
from shardline.trainer.checkpoint import latest_checkpoint, load_checkpoint
from shardline.trainer.data import WindowLoader, check_cache_room, open_split
from shardline.trainer.loop import Callbacks, FitOptions, fit
from shardline.trainer.models import model_spec_for
from shardline.trainer.serving import data_spec
from tests.conftest import tiny_config
from tests.test_ingest_encode import encode_all

CHILD = Path(__file__).with_name("_train_child.py")
N_CONT = 12
SHUFFLE_SHARDS = 2  # the two largest train shards take about 70% of the cap: a block, and room to read ahead
TRAINING = dict(
    epochs=2,
    batch_size=4096,
    lr=3e-3,
    warmup_steps=5,
    device="cpu",
    precision="fp32",
    seed=7,
    checkpoint_every_steps=40,
    keep_checkpoints=2,
    shuffle_shards=SHUFFLE_SHARDS,
)
WAIT = 120  # seconds for a line from a child


def write_raw(folder: Path, files: int = 16, seqs: int = 16, rows: int = 4000) -> None:
    """Sequences whose `label` is the previous row's `kind`; 16 sequences a file, split by sequence."""
    rng = np.random.default_rng(0)
    folder.mkdir(parents=True)
    for f in range(files):
        n = seqs * rows
        kind = rng.choice(np.array(["a", "b", "c"]), size=n)
        cols = {
            "seq": np.repeat([f"f{f:02d}s{i:02d}" for i in range(seqs)], rows),
            "t": np.tile(np.arange(rows, dtype=np.int32), seqs),
            **{f"x{j}": rng.standard_normal(n).astype(np.float32) for j in range(N_CONT)},
            "flag": rng.random(n) > 0.5,
            "kind": kind,
            "label": np.roll(kind, 1),
        }
        pl.DataFrame(cols).write_parquet(folder / f"r-{f:03d}.parquet")


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> dict:
    """The encoded data set: its manifest (written beside its shards), the train split's unpacked size
    and a cap of a quarter of it, and the model spec."""
    tmp = tmp_path_factory.mktemp("streaming-cap")
    write_raw(tmp / "raw")
    cfg = validate_config(
        tiny_config(
            str(tmp / "raw" / "*.parquet"),
            str(tmp / "store"),
            **{
                "data.files_per_group": 1,
                "data.features": {
                    "continuous": [f"x{j}" for j in range(N_CONT)],
                    "boolean": ["flag"],
                    "categorical": ["kind"],
                },
                "data.split": {
                    "method": "hash",
                    "seed": 1,
                    "fractions": {"train": 0.7, "validation": 0.15, "test": 0.15},
                },
            },
        )
    )
    _, _, out_dir, manifest = encode_all(cfg)
    uri = storage.join(out_dir, "manifest.json")
    storage.write_text(uri, manifest.model_dump_json())
    glob = Globaliser(manifest.encoding)
    sizes = [glob.nbytes(s) for s in manifest.shards_of("train")]
    assert len(sizes) >= 8 and min(sizes) > 1e6 and all(s.compression == "lz4" for s in manifest.shards_of("train"))
    split = sum(sizes)
    spec = model_spec_for(ModelConfig(hidden=16, layers=1, dropout=0.0), data_spec(manifest.encoding))
    return {"uri": uri, "manifest": manifest, "split": split, "cap": split // 4, "spec": spec, "tmp": tmp}


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def train_here(dataset: dict, cache: ShardCache, ckpt: Path, on_step=None, **training):
    manifest, uri = dataset["manifest"], dataset["uri"]
    train, val = open_split(manifest, uri, "train", cache=cache), open_split(manifest, uri, "validation", cache=cache)
    result = fit(
        train,
        val,
        dataset["spec"],
        TrainingConfig(**{**TRAINING, **training}),
        "classification",
        str(ckpt),
        callbacks=Callbacks(on_step=on_step, log=lambda _m: None),
        options=FitOptions(step_every=1),
    )
    return train, val, result


def weights(result_or_uri) -> dict[str, torch.Tensor]:
    uri = result_or_uri if isinstance(result_or_uri, str) else result_or_uri.last_checkpoint
    return load_checkpoint(uri)["model"]


def assert_same_weights(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.fixture(scope="module")
def reference(dataset, tmp_path_factory) -> dict:
    """The same training with an uncapped cache: the split is one pack in the cache, nothing streams. The
    pack's pages it keeps mapped are bounded by a small budget (SHARDLINE_RESIDENT_MB=8, the pack is 36 MB):
    two loader threads gather while pages are dropped under them; a streamed split has no pack to bound,
    so the streamed runs below, which end with the same weights, show that the bound changes none."""
    tmp = tmp_path_factory.mktemp("uncapped")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    drops = MappedPages.drops
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv(RESIDENT_ENV, "8")
            cache = ShardCache(tmp / "cache", cap_bytes=20 * dataset["split"])
            train, val, result = train_here(dataset, cache, tmp / "ck", num_workers=2)
    finally:
        torch.set_num_threads(threads)
    assert not train.streaming and not val.streaming
    return {
        "weights": weights(result),
        "history": result.history,
        "steps": result.steps,
        "drops": MappedPages.drops - drops,
    }


def test_a_quarter_cap_streams_and_trains_the_same_weights_as_an_uncapped_cache(
    dataset, reference, tmp_path, one_thread
):
    cap = dataset["cap"]
    cache = ShardCache(tmp_path / "cache", cap_bytes=cap)
    peak = {"pinned": 0, "held": 0}

    def on_step(step: int, metrics: dict) -> None:
        peak["pinned"] = max(peak["pinned"], cache.pinned_bytes())
        peak["held"] = max(peak["held"], cache.held_bytes())

    # a loader thread gathers ahead (num_workers changes when batches are made, never which)
    train, val, result = train_here(dataset, cache, tmp_path / "ck", on_step, num_workers=2)
    assert train.streaming and val.streaming
    assert result.steps == reference["steps"]
    assert_same_weights(weights(result), reference["weights"])
    assert [h["val_loss"] for h in result.history] == [h["val_loss"] for h in reference["history"]]
    assert reference["drops"] > 0  # the reference's pack pages were dropped while it trained: the same weights
    # only the shards in flight and the read-ahead were held, and shards left the cache and came back
    assert 0 < peak["pinned"] <= cap and peak["held"] <= cap
    assert cache.evictions > 0 and cache.downloads > train.n_shards + val.n_shards
    assert cache.pinned_bytes() == 0 and not train.open_shards and not val.open_shards


class MappedRss:
    """The most RSS, in MB, of the mapping of this process that holds `array` (/proc/self/smaps), sampled
    every few ms while in the `with` block: the pages of a split pack that a reader holds mapped."""

    def __init__(self, array: np.ndarray):
        self.addr = int(np.asarray(array).__array_interface__["data"][0])
        self.peak = 0.0
        self._stop = threading.Event()

    def now(self) -> float:
        inside = False
        with open("/proc/self/smaps") as f:
            for line in f:
                head = line.split(maxsplit=1)[0]
                if not head.endswith(":"):  # a mapping's first line: its address range
                    if inside:
                        break
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    inside = lo <= self.addr < hi
                elif inside and head == "Rss:":
                    return int(line.split()[1]) / 1024
        return 0.0

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.now())

    def __enter__(self):
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.now())


def test_a_resident_bound_keeps_a_packs_mapped_pages_under_it_and_reads_the_same_windows(
    dataset, tmp_path, monkeypatch
):
    manifest, uri = dataset["manifest"], dataset["uri"]
    cache = ShardCache(tmp_path / "cache", cap_bytes=20 * dataset["split"])
    passes = {}
    for mb in ("0", "12", "128"):  # no bound; a pack 3 times the bound; the default, more than the pack
        monkeypatch.setenv(RESIDENT_ENV, mb)
        train = open_split(manifest, uri, "train", cache=cache)
        digest = hashlib.sha256()
        # read in order, as validation and evaluation read, by two loader threads
        with MappedRss(train._joined.cont.array) as mapped:
            for b in WindowLoader(train, 4096, seed=0, shuffle=False, num_workers=2):
                for t in (b.cont, b.cat, *b.targets):
                    digest.update(t.numpy().tobytes())
        passes[mb] = (digest.hexdigest(), mapped.peak, train)
    pack_mb = passes["12"][2]._pages.size / 1e6
    assert passes["0"][2]._pages is None and passes["0"][1] > 0.8 * pack_mb  # unbounded: the whole pack stays
    pages = passes["12"][2]._pages
    assert passes["12"][0] == passes["0"][0] and not pages.scattered
    # the peak within the bound and what one read maps (`footprint`: the blocks one batch's gather touches, 3 or 4
    # of 2 MB as the mapping's address falls: not a fixed figure), and well under the whole pack
    assert passes["12"][1] <= 12 + pages.footprint / 1e6, (passes["12"][1], pages.footprint)
    assert passes["12"][1] < 0.6 * pack_mb, (passes["12"][1], pack_mb)
    # a pass in order never reads back: it keeps SEQUENTIAL_KEEP of what it passed mapped, not the whole budget
    pages = passes["128"][2]._pages
    assert passes["128"][0] == passes["0"][0] and pages.budget > pages.size
    assert passes["128"][1] <= (SEQUENTIAL_KEEP + pages.footprint + FAULT_BLOCK) / 1e6, (
        passes["128"][1],
        pages.footprint,
    )
    assert passes["128"][1] < 0.7 * pack_mb, (passes["128"][1], pack_mb)


class Child:
    """tests/_train_child.py on the data set's manifest, through a cache capped by SHARDLINE_CACHE_MAX_GB."""

    def __init__(self, dataset: dict, tmp: Path, label: str, **job):
        self.result = tmp / f"{label}-result.json"
        job = {
            "manifest": dataset["uri"],
            "model_spec": dataset["spec"],
            "training": TRAINING,
            "ckpt": str(tmp / "ck"),
            "result": str(self.result),
            **job,
        }
        (tmp / f"{label}-job.json").write_text(json.dumps(job))
        env = {
            **__import__("os").environ,
            "SHARDLINE_CACHE": str(tmp / "child-cache"),
            "SHARDLINE_CACHE_MAX_GB": repr(dataset["cap"] / 1e9),
        }
        self.proc = subprocess.Popen(
            [sys.executable, str(CHILD), str(tmp / f"{label}-job.json")],
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
        )
        self.lines: list[str] = []
        self._queue: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)

    def wait_for(self, line: str) -> None:
        while (got := self._queue.get(timeout=WAIT)) != line:
            if got is None:
                self.proc.wait()
                pytest.fail(
                    f"the child exited ({self.proc.returncode}) before '{line}':\n" + "\n".join(self.lines[-30:])
                )
            self.lines.append(got)

    def finish(self) -> dict:
        code = self.proc.wait(WAIT)
        while (got := self._queue.get(timeout=WAIT)) is not None:
            self.lines.append(got)
        assert code == 0, f"exit status {code}:\n" + "\n".join(self.lines[-30:])
        return json.loads(self.result.read_text())


def test_sigkill_mid_epoch_under_the_cap_resumes_to_the_same_weights(dataset, reference, tmp_path):
    steps_per_epoch, every = reference["steps"] // 2, TRAINING["checkpoint_every_steps"]
    saved_at = (steps_per_epoch // every + 1) * every  # the second epoch's first checkpoint
    hold = saved_at + 10  # killed 10 steps after it, mid-epoch
    assert hold < 2 * steps_per_epoch
    child = Child(dataset, tmp_path, "killed", hold_at_step=hold)
    try:
        child.wait_for(f"held {hold}")
        child.proc.send_signal(signal.SIGKILL)
        assert child.proc.wait(WAIT) == -signal.SIGKILL
    finally:
        child.proc.kill()
    saved = latest_checkpoint(str(tmp_path / "ck"))[1]
    assert saved["step"] == saved_at and not saved["epoch_complete"] and saved["loader"]["offset"] > 0

    result = Child(dataset, tmp_path, "resumed").finish()
    assert Path(result["resumed_from"]).name == f"ckpt-{saved['step']:09d}.pt"
    assert result["steps"] == reference["steps"]
    assert_same_weights(weights(result["last_checkpoint"]), reference["weights"])


def test_a_cap_too_small_fails_before_training_naming_the_setting_and_is_not_retried(dataset, tmp_path):
    manifest, uri = dataset["manifest"], dataset["uri"]
    cache = ShardCache(tmp_path / "cache", cap_bytes=dataset["cap"])
    train, val = open_split(manifest, uri, "train", cache=cache), open_split(manifest, uri, "validation", cache=cache)
    # a global shuffle needs the whole split in the cache: refused with the way out, never a CacheFull mid-run
    with pytest.raises(ValueError, match=r"training.shuffle_shards .*at most \d+.*SHARDLINE_CACHE_MAX_GB to at least"):
        check_cache_room(train, val, None)
    with pytest.raises(ValueError, match="training.shuffle_shards"):
        WindowLoader(train, 64, seed=0)
    # a block larger than the cap: the size to raise the cap to, or the block size that fits
    with pytest.raises(
        ValueError, match=r"SHARDLINE_CACHE_MAX_GB to at least [\d.]+, or lower training.shuffle_shards to \d"
    ):
        check_cache_room(train, val, 6)
    assert cache.pinned_bytes() == 0
    # a CacheFull is the cap, not the machine: the train step's retry policy does not retry it
    small = ShardCache(tmp_path / "tiny", cap_bytes=train.cache_need(shuffle=False) // 4)
    with pytest.raises(CacheFull, match=r"SHARDLINE_CACHE_MAX_GB to at least [\d.]+") as e:
        open_split(manifest, uri, "train", cache=small).view(0)
    assert not is_infrastructure_failure(e.value)
    assert is_infrastructure_failure(ConnectionResetError("the network"))


def test_evaluation_streams_a_test_split_larger_than_the_cache(dataset, tmp_path, monkeypatch, one_thread):
    """Evaluation's one pass over a test split that streams (a cache of a quarter of the train split)
    holds only the shards in flight, and scores and predicts exactly what it does with the split in
    the cache (it filled the cache before: the keys of each batch's windows opened shards again)."""
    from shardline.core.storage import _CACHES
    from shardline.tasks.evaluate import evaluate_model

    manifest = dataset["manifest"]
    test_bytes = sum(Globaliser(manifest.encoding).nbytes(s) for s in manifest.shards_of("test"))
    # the model the data set's spec trained: evaluation builds the config's, and refuses a checkpoint of another
    model = {"family": "mlp", "hidden": 16, "layers": 1, "dropout": 0.0}
    config = validate_config(tiny_config("unused/*.parquet", str(tmp_path / "store"), model=model))
    uncapped = ShardCache(tmp_path / "train-cache", cap_bytes=20 * dataset["split"])
    result = train_here(dataset, uncapped, tmp_path / "ck", epochs=1)[2]
    trained = result  # fit's result: what evaluation reads of it
    scores = {}
    for label, cap in (("in cache", 20 * test_bytes), ("streamed", test_bytes * 3 // 4)):
        monkeypatch.setenv("SHARDLINE_CACHE", str(tmp_path / f"cache-{label}"))
        monkeypatch.setenv("SHARDLINE_CACHE_MAX_GB", repr(cap / 1e9))
        _CACHES.clear()
        out = evaluate_model(dataset["uri"], trained, config, tmp_path / f"eval-{label}")
        preds = pl.read_parquet(tmp_path / f"eval-{label}" / "test_predictions.parquet")
        scores[label] = (out["metrics"], out["baseline"], preds)
    _CACHES.clear()
    assert scores["streamed"][0] == scores["in cache"][0] and scores["streamed"][1] == scores["in cache"][1]
    assert scores["streamed"][2].equals(scores["in cache"][2])


def test_a_streamed_split_is_checked_as_its_shards_open_not_in_a_pass_of_its_own(dataset, tmp_path, one_thread):
    """The input checks (ids within the model's cardinalities and classes) cost a streamed split no pass
    before the first step (on S3: one more download of the data set): each shard is checked as it is
    opened. A model spec that does not fit the data is still refused, naming the shard."""
    cache = ShardCache(tmp_path / "cache", cap_bytes=dataset["cap"])
    at_first_step = {}

    def on_step(step: int, metrics: dict) -> None:
        at_first_step.setdefault("downloads", cache.downloads)

    train, val, _ = train_here(dataset, cache, tmp_path / "ck", on_step, epochs=1)
    assert train.streaming and val.streaming
    # the first block's shards and the read-ahead, not every train and validation shard
    assert at_first_step["downloads"] <= SHUFFLE_SHARDS + 2 < train.n_shards + val.n_shards

    spec = json.loads(json.dumps(dataset["spec"]))
    spec["data"]["cardinalities"] = [1 for _ in spec["data"]["cardinalities"]]  # every id but 0 is beyond
    narrow = {**dataset, "spec": spec}
    with pytest.raises(ValueError, match=r"categorical ids beyond the spec's cardinalities .*shard "):
        train_here(narrow, ShardCache(tmp_path / "cache2", cap_bytes=dataset["cap"]), tmp_path / "ck2", epochs=1)


def test_a_streamed_split_gives_each_rank_its_share_within_the_cap(dataset, tmp_path):
    """Several processes (DDP), each with its own capped cache: rank r's batches of a streamed split are its
    share of the one-process batches, and its cache holds no more than the cap (shards its share does not
    touch are released as the order passes them too)."""
    manifest, uri, cap = dataset["manifest"], dataset["uri"], dataset["cap"]
    whole = open_split(manifest, uri, "train", cache=ShardCache(tmp_path / "c", cap_bytes=20 * dataset["split"]))
    one = WindowLoader(whole, 4096, seed=7, shuffle_shards=SHUFFLE_SHARDS)
    caches = [ShardCache(tmp_path / f"c{r}", cap_bytes=cap) for r in range(2)]
    splits = [open_split(manifest, uri, "train", cache=c) for c in caches]
    ranks = [
        WindowLoader(s, 4096, seed=7, shuffle_shards=SHUFFLE_SHARDS, rank=r, world_size=2) for r, s in enumerate(splits)
    ]
    assert all(s.streaming for s in splits) and not whole.streaming
    held = 0
    for batch, share_0, share_1 in zip(one, *ranks, strict=True):
        assert torch.equal(torch.cat([share_0.cat, share_1.cat]), batch.cat)
        held = max(held, *(c.held_bytes() for c in caches))
    assert 0 < held <= cap
    assert all(c.pinned_bytes() == 0 for c in caches) and not any(s.open_shards for s in splits)


def test_a_read_ahead_released_before_it_lands_gives_its_room_back_instead_of_filling_the_cache(tmp_path):
    """A rank reads a shard ahead, then releases it unopened (its windows went to the other rank) while it is
    still downloading: the shard needed now waits for that download to land and evicts it, rather than
    finding the cache full (a slow disk or a busy machine made this a CacheFull mid-epoch)."""
    src = tmp_path / "obj"
    src.write_bytes(b"x" * 600)
    sha = hashlib.sha256(src.read_bytes()).hexdigest()
    cache = ShardCache(tmp_path / "cache", cap_bytes=1000)
    started, land = threading.Event(), threading.Event()

    def slow(data: bytes, fd: int) -> None:
        started.set()
        assert land.wait(30)
        os.pwrite(fd, data, 0)

    assert cache.pin_if_room("ahead", 600)
    cache.prefetch(str(src), sha, derived=storage.Derived("ahead", 600, slow))
    assert started.wait(30)
    cache.unpin("ahead")  # released while its download is under way
    threading.Timer(0.3, land.set).start()
    cache.pin("now", 600)
    got = cache.build("now", 600, lambda tmp: tmp.write_bytes(b"y" * 600), "the shard needed now")
    assert got.read_bytes() == b"y" * 600
    assert not cache.path("ahead").exists() and cache.held_bytes() == 600 and cache.evictions == 1
    # a cache too small for what is in use still says so at once
    with pytest.raises(CacheFull, match="cannot hold"):
        cache.build("more", 600, lambda tmp: tmp.write_bytes(b"z" * 600), "one more")


class _Boundaries:
    """A streamed split's shard boundaries only: what an epoch's order and its first/last-use pass read."""

    streaming = True

    def __init__(self, shards: int, per: int):
        self.n_shards = shards
        self._first = np.arange(0, (shards + 1) * per, per, dtype=np.int64)
        self.n_windows = int(self._first[-1])

    def shard_of(self, idx):
        return np.searchsorted(self._first, idx, side="right") - 1


def test_an_epochs_order_over_a_streamed_split_is_held_a_shuffle_block_at_a_time(monkeypatch):
    """At the first user's size (69.4M train windows) the epoch's order and the pass that finds each shard's first
    and last use held 1.7 GB at once: per-window int64 numbers, a concatenated copy, shard numbers, positions; then
    4 bytes a window (the whole order, int32: 280 MB). Now the loader works the order out a shuffle block at a time,
    and the pass takes it a part at a time: bytes per block, not per window of the epoch."""
    import tracemalloc

    from shardline.trainer.data import loader as loader_module

    monkeypatch.setattr(loader_module, "ORDER_PART", 1 << 16)  # the pass's part, scaled as the split is to 69.4M

    def pass_over(shards: int) -> tuple[WindowLoader, int]:
        loader = WindowLoader.__new__(WindowLoader)  # the order and the pass need no shards opened
        d = _Boundaries(shards, 5_000)
        loader.data, loader.seed, loader.shuffle, loader.shuffle_shards, loader.read_ahead = d, 7, True, 16, 2
        tracemalloc.start()
        try:
            loader._stream_gather(loader._order(3), [(0, d.n_windows)])
            return loader, tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    loader, peak = pass_over(400)  # 2M windows
    _, peak_4x = pass_over(1_600)  # 8M windows, the same blocks and parts
    d, order = loader.data, loader._order(3)
    # set by the block and the part, not by the split: 4 bytes a window before, ~24 before that
    assert peak < 3 * d.n_windows and peak_4x < 1.3 * peak, (peak / d.n_windows, peak_4x / peak)
    assert order.dtype == np.int32
    # the same order as before the change: each block of 16 shards, its windows permuted together
    seq = np.random.default_rng([7, 3, 1]).permutation(400)
    for b in (0, 7, 24):
        ids = np.concatenate([np.arange(s * 5_000, (s + 1) * 5_000) for s in seq[16 * b : 16 * b + 16]])
        block = ids[np.random.default_rng([7, 3, 2, b]).permutation(len(ids))]
        assert (order[b * 80_000 : (b + 1) * 80_000] == block).all()
    # a span across two blocks, and positions picked anywhere (a rank's share of a span), as the whole order has them
    whole = loader.order(3)
    assert np.array_equal(order[79_000:161_000], whole[79_000:161_000])
    picked = np.random.default_rng(0).choice(d.n_windows, 1_000, replace=False)
    assert np.array_equal(order[picked], whole[picked])
