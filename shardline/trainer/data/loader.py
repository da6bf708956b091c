"""The training loader: shuffled, resumable to the window (`state_dict`), each rank its share of each global batch,
batches gathered a chunk of windows at a time, optionally in background threads."""

from __future__ import annotations

import threading
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from shardline.core.storage import CACHE_CAP_ENV, gb_at_least
from shardline.trainer.data.batch import CHUNK_BYTES, LOADER_STATE_VERSION, MAX_BATCHES_PER_GATHER, Batch
from shardline.trainer.data.split import SplitData
from shardline.trainer.distributed import rank_positions

ORDER_PART = 1 << 20  # positions of an epoch's order a streamed split's first/last-use pass takes at a time


class EpochOrder:
    """An epoch's order over shuffle blocks (shards taken together, their windows permuted together), worked out a
    block at a time as the loader reaches it: the order of a 70M-window split is 280 MB whole, a block of two of its
    shards ~3 MB. `order[lo:hi]` and `order[positions]` are the window numbers there; `np.asarray(order)`, all."""

    def __init__(self, seed: int, epoch: int, blocks: list, first: np.ndarray, dtype, shuffled: bool = True):
        self.seed, self.epoch, self.blocks, self.first, self.dtype = seed, epoch, blocks, first, np.dtype(dtype)
        self.shuffled = shuffled
        sizes = [int(sum(first[s + 1] - first[s] for s in b)) for b in blocks]
        self.at = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)  # each block's first position
        self._held: dict[int, np.ndarray] = {}  # the blocks worked out last (two: a span may straddle them)
        self._lock = threading.Lock()  # the loader's gather threads share it

    def __len__(self) -> int:
        return int(self.at[-1])

    def block(self, b: int) -> np.ndarray:
        with self._lock:
            got = self._held.get(b)
            if got is None:
                ids = np.concatenate(
                    [np.arange(self.first[s], self.first[s + 1], dtype=self.dtype) for s in self.blocks[b]]
                )
                if self.shuffled:
                    np.random.default_rng([self.seed, self.epoch, 2, b]).shuffle(ids)  # = ids[permutation(len(ids))]
                got = self._held[b] = ids
                while len(self._held) > 2:
                    del self._held[next(iter(self._held))]
            return got

    def __getitem__(self, key) -> np.ndarray:
        if isinstance(key, slice):
            lo, hi, _ = key.indices(len(self))
            if hi <= lo:
                return np.zeros(0, self.dtype)
            b0, b1 = (int(np.searchsorted(self.at, x, side="right")) - 1 for x in (lo, hi - 1))
            parts = [
                self.block(b)[max(lo, self.at[b]) - self.at[b] : min(hi, self.at[b + 1]) - self.at[b]]
                for b in range(b0, b1 + 1)
            ]
            return parts[0].copy() if len(parts) == 1 else np.concatenate(parts)
        pos = np.asarray(key, dtype=np.int64)
        which = np.searchsorted(self.at, pos, side="right") - 1
        out = np.empty(pos.shape, self.dtype)
        for b in np.unique(which).tolist():
            sel = which == b
            out[sel] = self.block(b)[pos[sel] - self.at[b]]
        return out

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        every = (
            np.concatenate([self.block(b) for b in range(len(self.blocks))]) if self.blocks else np.zeros(0, self.dtype)
        )
        return every if dtype is None else every.astype(dtype, copy=False)


class WindowLoader:
    """Batches of one epoch, in an order that is a pure function of (seed, epoch, shuffle_shards) and the
    split's shards, never of the local cache; resumable mid-epoch.

    Its position is a few integers (`state_dict`): the epoch and how many windows of it were already
    yielded, so a restored loader yields exactly the batches the interrupted one had not.
    `set_epoch(e)` starts epoch e from its beginning; iterating continues from the current position.

    Order: with `shuffle_shards` null, a global permutation of all windows (the split's shards are
    joined, so a batch is one gather wherever its windows live; a split too large for the cache is
    refused, as a global shuffle needs all of it). With `shuffle_shards=m`, shuffle blocks: the shards
    in a permuted order, taken m at a time, the windows of each block permuted together. A split in
    the cache and the same split streamed give the same batches; streamed, a block's shards are
    opened when the order reaches them, released when it has passed their last window, and up to
    `read_ahead` shards after them are fetched in the background while there is room in the cache.
    Batches are gathered a few at a time (about CHUNK_BYTES per fancy index) and handed out as
    views. `num_workers` threads gather the next ones while the current batch trains: they share
    the arrays (no pickling), and the gathers run outside the GIL. A streamed split is gathered by
    one thread, in order (so the shards held stay one block's), up to 2 x `num_workers` chunks ahead.
    """

    def __init__(
        self,
        data: SplitData,
        batch_size: int,
        seed: int,
        shuffle: bool = True,
        pin_memory: bool = False,
        num_workers: int = 0,
        shuffle_shards: int | None = None,
        rank: int = 0,
        world_size: int = 1,
    ):
        if shuffle and data.streaming and (shuffle_shards is None or shuffle_shards >= data.n_shards):
            raise ValueError(_global_shuffle_refused(data, "streamed"))
        self.data = data
        self.batch_size = batch_size
        self.seed = int(seed)
        self.shuffle = shuffle
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.num_workers = int(num_workers)
        self.read_ahead = 2  # streamed shards fetched in the background ahead of the order, room permitting
        self.shuffle_shards = shuffle_shards
        self.epoch = 0
        self.offset = 0
        # several processes (DDP): each yields its share of each global batch (trainer/distributed.py); the
        # position (`offset`, `state_dict`) stays the global one, the same on every rank and for one process
        self.rank, self.world_size = int(rank), int(world_size)

    @property
    def n_windows(self) -> int:
        return self.data.n_windows

    def order(self, epoch: int) -> np.ndarray:
        """Window numbers in the order epoch `epoch` yields them, all of them (int32 while they fit)."""
        return np.asarray(self._order(epoch))

    def _order(self, epoch: int) -> np.ndarray | EpochOrder:
        """The epoch's order as the loader reads it: a shuffle block at a time (`EpochOrder`) with
        `shuffle_shards`, else the whole permutation (a global shuffle: every window's place at once)."""
        n, d, m = self.n_windows, self.data, self.shuffle_shards
        dtype = np.int32 if n < 2**31 else np.int64
        if not self.shuffle:
            return EpochOrder(self.seed, epoch, [[s] for s in range(d.n_shards)], d._first, dtype, shuffled=False)
        if m is None or m >= d.n_shards:  # one block of every shard: the global permutation
            # shuffled in place: the order permutation(n) gives, in the narrower type
            return np.random.default_rng([self.seed, epoch]).permutation(np.arange(n, dtype=dtype))
        seq = np.random.default_rng([self.seed, epoch, 1]).permutation(d.n_shards)  # the shards, m at a time
        return EpochOrder(self.seed, epoch, [seq[b : b + m] for b in range(0, len(seq), m)], d._first, dtype)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        self.offset = 0

    def _per_gather(self) -> int:
        """Batches gathered by one fancy index: about CHUNK_BYTES of windows (amortises the per-call
        cost and, with workers, the hand-off between threads); each batch is then a view of it."""
        d = self.data
        per_position = d.window if d.positions == "all" else 1
        per_window = d.window * (d.n_cont * d.cont_dtype.itemsize + d.n_cat * d.cat_dtype.itemsize) + sum(
            per_position * t.itemsize for t in d.target_dtypes
        )
        return int(min(MAX_BATCHES_PER_GATHER, max(1, -(-CHUNK_BYTES // max(1, per_window * self.batch_size)))))

    def __iter__(self):
        order = self._order(self.epoch)
        data, bs = self.data, self.batch_size
        step = bs * self._per_gather()
        spans = [(lo, min(lo + step, self.n_windows)) for lo in range(self.offset, self.n_windows, step)]
        # one thread gathers a streamed split's spans, in order, so that the shards it holds stay those of one
        # block; `num_workers` sets how far ahead it may go
        stream = self._stream_gather(order, spans) if data.streaming else None

        def gather(lo: int, hi: int) -> list[tuple[Batch, int]]:
            """The span's batches (this rank's share of each of its global batches), each a view of one gathered
            chunk, with the windows of the global batch it is a share of. Sliced here, in the loader's thread:
            handing a batch out is then all the training's thread does (on a GPU, its time is the step's)."""
            parts = rank_positions(lo, hi, bs, self.n_windows, self.rank, self.world_size)
            pos = None
            if self.world_size > 1:
                pos = np.concatenate([np.arange(p, p + n, dtype=np.int64) for p, n, _ in parts])
            if stream is not None:
                big = stream(lo, hi, pos)
            else:
                big = data.batch(order[lo:hi] if pos is None else order[pos], pin_memory=self.pin_memory)
                if not self.shuffle and data._pages is not None:
                    data._pages.passed()  # in order: what this pass has read of the pack is behind it
            out, at = [], 0
            for _, n, k in parts:
                out.append((big.slice(at, at + n), k))
                at += n
            return out

        try:
            if self.num_workers == 0:
                for lo, hi in spans:
                    yield from self._hand_out(gather(lo, hi))
                return
            pool = ThreadPoolExecutor(1 if stream else self.num_workers, thread_name_prefix="shardline-loader")
            pending: deque = deque()
            todo = iter(spans)
            try:
                while True:
                    while len(pending) < 2 * self.num_workers and (span := next(todo, None)) is not None:
                        pending.append(pool.submit(gather, *span))  # gathered and pinned in the worker
                    if not pending:
                        break
                    yield from self._hand_out(pending.popleft().result())
            finally:
                for fut in pending:
                    fut.cancel()
                pool.shutdown(wait=True)
        finally:
            data.release()  # streamed shards still held when the epoch ends or the loop leaves it (closed)

    def _hand_out(self, batches: list[tuple[Batch, int]]):
        """A gathered chunk's batches. Several processes (DDP): each this rank's share of a global batch, the offset
        counting whole global batches."""
        for b, k in batches:
            self.offset += k  # counted when handed out: a checkpoint after this batch resumes past it
            yield b

    def _stream_gather(self, order: np.ndarray | EpochOrder, spans: list[tuple[int, int]]):
        """gather(lo, hi): the windows order[lo:hi] of a streamed split, for spans taken in order. A shard
        is opened when the order reaches its first window and released with the gather of its last
        (`SplitData.batch`), so the cache holds the current shuffle block; after each gather the next
        shards by first window are read ahead, in that order and only while the cache has room (a
        prefix: the shard needed next never waits behind a later one)."""
        d = self.data
        start, end = (spans[0][0], spans[-1][1]) if spans else (0, 0)
        # each shard's first and last position in what is left to yield (a resumed epoch: from `start`), a part
        # of the order at a time (per-window shard numbers for a whole epoch would be 8 bytes a window)
        first = np.full(d.n_shards, end, dtype=np.int64)
        last = np.full(d.n_shards, -1, dtype=np.int64)
        for lo in range(start, end, ORDER_PART):
            hi = min(lo + ORDER_PART, end)
            pos, shard = np.arange(lo, hi, dtype=np.int64), d.shard_of(order[lo:hi])
            np.minimum.at(first, shard, pos)
            np.maximum.at(last, shard, pos)
        by_first = np.argsort(first, kind="stable")
        firsts = first[by_first]

        def gather(lo: int, hi: int, pos: np.ndarray | None = None) -> Batch:
            here = np.unique(d.shard_of(order[lo:hi]))
            idx = order[lo:hi] if pos is None else order[pos]  # pos: a rank's share of the span (DDP)
            passed = here[last[here] < hi]
            if pos is not None:  # passed shards this rank's share does not touch: released before it opens others
                for s in np.setdiff1d(passed, d.shard_of(idx)):
                    d.release_shard(int(s))
            big = d.batch(idx, pin_memory=self.pin_memory, release=passed)
            at = int(np.searchsorted(firsts, hi))
            for s in by_first[at : at + self.read_ahead]:
                if first[s] >= end or not d.prefetch(int(s)):
                    break
            return big

        return gather

    def state_dict(self) -> dict:
        return {
            "version": LOADER_STATE_VERSION,
            "epoch": self.epoch,
            "offset": self.offset,
            "seed": self.seed,
            "n_windows": self.n_windows,
            **({"shuffle_shards": self.shuffle_shards} if self.shuffle_shards is not None else {}),
        }

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != LOADER_STATE_VERSION:
            raise ValueError(
                f"loader state version {state.get('version')!r} is not supported (expected {LOADER_STATE_VERSION})"
            )
        if state["n_windows"] != self.n_windows:
            raise ValueError(
                f"loader state was saved over {state['n_windows']} windows but this split has {self.n_windows}: "
                "the data changed since the checkpoint; resume only on the same shards"
            )
        if state["seed"] != self.seed:
            raise ValueError(
                f"loader state was saved with seed {state['seed']} but this loader has seed {self.seed} "
                "(training.seed changed): the batch order would differ"
            )
        if state.get("shuffle_shards") != self.shuffle_shards:
            raise ValueError(
                f"loader state was saved with shuffle_shards={state.get('shuffle_shards')} but this loader has "
                f"shuffle_shards={self.shuffle_shards} (training.shuffle_shards changed): the batch order would differ"
            )
        if not 0 <= state["offset"] <= self.n_windows:
            raise ValueError(f"loader state offset {state['offset']} is outside [0, {self.n_windows}]")
        self.epoch = int(state["epoch"])
        self.offset = int(state["offset"])


def _global_shuffle_refused(data: SplitData, name: str) -> str:
    """Why a streamed split cannot be shuffled whole, and the two ways out, with this split's numbers."""
    cache = data.cache
    sizes = sorted((r.footprint for r in data._refs), reverse=True)
    fit = max(1, int(np.searchsorted(np.cumsum(sizes), cache.cap // 2, side="right")))
    return (
        f"the {name} split is {sum(sizes) / 1e6:,.1f} MB unpacked, more than half the local shard cache's "
        f"{cache.describe_cap()}, so it streams shard by shard, but training.shuffle_shards is null: one shuffle "
        "of the whole split, which needs all of it in the cache. Set training.shuffle_shards to shuffle that "
        f"many shards at a time (here at most {fit}, for a block to fit in half the cache; the order is then "
        f"the same whatever the cache), or raise {CACHE_CAP_ENV} to at least {gb_at_least(2 * sum(sizes))} "
        "(twice the split) to keep the global shuffle"
    )


def check_cache_room(train: SplitData, val: SplitData, shuffle_shards: int | None) -> None:
    """Before training: the local cache can hold what training holds of it at once, besides the split
    packs it holds already: the train split's largest shuffle block while it streams, or the validation
    split's largest shard while it is read (never both: a loader releases its shards when its epoch
    ends). A ValueError names the setting to change and the number, so a too-small cache fails before
    the first step, never when a block of larger shards comes up mid-epoch."""
    if train.streaming and (shuffle_shards is None or shuffle_shards >= train.n_shards):
        raise ValueError(_global_shuffle_refused(train, "train"))
    needs: dict[int, list] = {}
    for name, data, what in (
        ("train", train, f"its {shuffle_shards} largest shards (training.shuffle_shards={shuffle_shards})"),
        ("validation", val, "its largest shard"),
    ):
        if data.streaming:
            need = data.cache_need(shuffle_shards) if name == "train" else data.cache_need(shuffle=False)
            needs.setdefault(id(data.cache), [data.cache, []])[1].append((need, f"the {name} split's {what}"))
    for cache, parts in needs.values():
        need, what = max(parts)
        held = cache.pinned_bytes()
        if held + need <= cache.cap:
            continue
        lower = ""
        if train.streaming and train.cache is cache:
            sizes = np.cumsum(sorted((r.footprint for r in train._refs), reverse=True))
            fit = int(np.searchsorted(sizes, cache.cap - held, side="right"))
            if 1 <= fit < shuffle_shards:
                lower = f", or lower training.shuffle_shards to {fit}"
        raise ValueError(
            f"training holds up to {need / 1e6:,.1f} MB of the local shard cache at once ({what}) besides the "
            f"{held / 1e6:,.1f} MB it holds already (split packs), but the cache is capped at "
            f"{cache.describe_cap()}: raise {CACHE_CAP_ENV} to at least {gb_at_least(held + need)}{lower}"
        )
