"""A synthetic click log for the two-tower example: users with a latent taste are shown lists of items in
sessions, and click the items their taste agrees with, plus the popular ones.

Every user has a taste (a vector of `--dims` numbers) and every item a latent profile of the same size;
what the log shows of them is noisy: each user's `u_0..` columns and region, each item's `i_0..` columns,
category and price. An item's popularity decides both how often it is shown (popular items fill more
lists) and how often it is clicked when shown, so the items with the most clicks in the past are a real
competitor (the popularity baseline). A session shows `--shown` items; the chance of a click is

    sigmoid(affinity * taste . profile / sqrt(dims) + popularity_weight * popularity + offset)

Seeded: the same arguments write the same files.

    python make_data.py data/raw --users 2000 --items 400 --sessions 6000
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import polars as pl


def click_log(users: int, items: int, sessions: int, shown: int, dims: int, seed: int) -> pl.DataFrame:
    rng = np.random.default_rng(seed)
    taste = rng.normal(size=(users, dims))
    profile = rng.normal(size=(items, dims))
    popularity = rng.normal(scale=1.0, size=items)

    # what the log shows: noisy views of the latent vectors, a region per user, a category per item
    user_view = taste + rng.normal(scale=0.6, size=taste.shape)
    item_view = profile + rng.normal(scale=0.6, size=profile.shape)
    region = np.argmax(taste[:, :4] + rng.normal(scale=0.5, size=(users, 4)), axis=1)
    category = np.argmax(profile[:, :6] + rng.normal(scale=0.5, size=(items, 6)), axis=1)
    price = np.exp(rng.normal(3.0, 0.5, size=items) + 0.2 * profile[:, -1])

    # each session: a user, and `shown` distinct items drawn by exposure (exp(popularity)); Gumbel top-k
    who = rng.integers(0, users, size=sessions)
    keys = popularity[None, :] + rng.gumbel(size=(sessions, items))
    listed = np.argpartition(-keys, shown - 1, axis=1)[:, :shown]
    rng.permuted(listed, axis=1, out=listed)  # the order a list is shown in says nothing

    u = np.repeat(who, shown)
    i = listed.reshape(-1)
    affinity = np.einsum("nd,nd->n", taste[u], profile[i]) / np.sqrt(dims)
    logit = 2.0 * affinity + 0.8 * popularity[i] - 3.0
    click = rng.random(u.size) < 1.0 / (1.0 + np.exp(-logit))

    columns = {
        "session_id": np.char.add("s", np.char.zfill(np.repeat(np.arange(sessions), shown).astype(str), 6)),
        "user_id": u.astype(np.int64),
        "item_id": i.astype(np.int64),
        "position": np.tile(np.arange(shown, dtype=np.int64), sessions),
        **{f"u_{d}": user_view[u, d].astype(np.float32) for d in range(dims)},
        "user_region": np.char.add("r", region[u].astype(str)),
        **{f"i_{d}": item_view[i, d].astype(np.float32) for d in range(dims)},
        "item_category": np.char.add("c", category[i].astype(str)),
        "item_price": price[i].astype(np.float32),
        "click": click.astype(np.int64),
    }
    return pl.DataFrame(columns)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", type=Path, help="folder the parquet files are written to")
    parser.add_argument("--users", type=int, default=2000)
    parser.add_argument("--items", type=int, default=400)
    parser.add_argument("--sessions", type=int, default=6000)
    parser.add_argument("--shown", type=int, default=20, help="items shown per session")
    parser.add_argument("--dims", type=int, default=8, help="size of the latent taste and profile")
    parser.add_argument("--files", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    log = click_log(args.users, args.items, args.sessions, args.shown, args.dims, args.seed)
    args.out.mkdir(parents=True, exist_ok=True)
    per_file = -(-args.sessions // args.files) * args.shown  # whole sessions per file
    for n, start in enumerate(range(0, log.height, per_file)):
        log.slice(start, per_file).write_parquet(args.out / f"clicks-{n:03d}.parquet")
    print(
        f"{args.out}: {log.height:,} impressions in {args.sessions:,} sessions of {args.shown}, "
        f"{args.users:,} users, {args.items:,} items, click rate {log['click'].mean():.3f}"
    )


if __name__ == "__main__":
    main()
