"""Validation's pass over a split: every window once, in order, each target scored once (text: non-overlapping
windows, so that each token is scored once)."""

from __future__ import annotations

import numpy as np

from shardline.trainer.data.loader import WindowLoader
from shardline.trainer.data.split import ShardView, SplitData


def scored_windows(data: SplitData) -> tuple[np.ndarray, np.ndarray]:
    """Text evaluation's windows: in each sequence segment, non-overlapping ones (a start every K tokens)
    plus the segment's last window (its tail) when it is not one of them, so each target token is scored
    once, not at up to K positions. Returns (window numbers, in window order; per window, how many of its
    first positions an earlier window scored already: 0, or the tail's overlap, whose targets are masked)."""
    k = data.window

    def per_shard(v: ShardView, s: int) -> tuple[np.ndarray, np.ndarray]:
        starts = np.asarray(v.starts, dtype=np.int64)
        if not len(starts):
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        offsets = np.asarray(v.arrays["offsets"], dtype=np.int64)
        seg = np.searchsorted(offsets, starts, side="right") - 1
        rel = starts - offsets[seg]  # the start's place in its segment
        last = np.append(seg[1:] != seg[:-1], True)  # each segment's last window
        keep = (rel % k == 0) | last
        skip = np.where(rel % k == 0, 0, (rel // k + 1) * k - rel)  # the tail's positions scored before
        return np.flatnonzero(keep) + data._first[s], skip[keep]

    parts = data.each_shard(per_shard)
    if not parts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])


class ScoredLoader:
    """Evaluation's batches, in window order: every window (`WindowLoader(shuffle=False)`'s batches), or for
    text (`stride=True`: every-position targets with a <pad> id to ignore) the non-overlapping windows of
    `scored_windows`, the positions a tail window shares with the window before it given the `ignore` id as
    target, so each token counts once in a loss, perplexity or accuracy that skips that id."""

    def __init__(self, data: SplitData, batch_size: int, stride: bool = False, ignore: int = 0):
        self.data, self.batch_size, self.ignore = data, batch_size, ignore
        self.stride = bool(stride) and data.positions == "all"
        self.idx, self.skip = scored_windows(data) if self.stride else (None, None)

    @property
    def n_windows(self) -> int:
        return len(self.idx) if self.stride else self.data.n_windows

    def __iter__(self):
        if not self.stride:
            yield from WindowLoader(self.data, self.batch_size, seed=0, shuffle=False)
            return
        d, k = self.data, self.data.window
        shard = d.shard_of(self.idx)
        last_of = {int(s): int(np.flatnonzero(shard == s)[-1]) for s in np.unique(shard)}
        try:
            for lo in range(0, len(self.idx), self.batch_size):
                hi = min(lo + self.batch_size, len(self.idx))
                passed = [s for s in np.unique(shard[lo:hi]).tolist() if last_of[s] < hi]
                batch = d.batch(self.idx[lo:hi], release=passed)
                skip = self.skip[lo:hi]
                if skip.any():
                    mask = np.arange(k)[None, :] < skip[:, None]
                    for t in batch.targets:
                        t.numpy()[mask] = self.ignore
                yield batch
        finally:  # a pass stopped part-way (an error, a closed iterator): its shards leave the cache's hold
            d.release()
