"""The demo's raw files in its home (`shardline demo --home`): made once, and grown or shrunk by `--games` without
touching the games already there, so the pipeline encodes only the new file groups."""

from __future__ import annotations

import re
from pathlib import Path

from shardline.app.demo_data import simulate_game, write_game


def demo_raw_data(raw: Path, games: int, frames: int, seed: int, say=print) -> None:
    """The demo's raw files in `raw`: `games` games of `frames` frames from `seed`, writing only what is missing
    (games added to a demo already made: those alone; fewer: the ones after removed), so the files there stay as
    they were and the pipeline encodes only the new file groups. Other frames or another seed: every game again.
    A marker, written before any game of it, names the frames and seed; `say` tells what is done."""
    marker, markers = f".generated-{frames}x-seed{seed}", list(raw.glob(".generated-*"))
    if {_made_as(m.name) for m in markers} != {(frames, seed)}:  # none yet, or another data set: every game again
        for old in [*markers, *raw.glob("*.parquet")]:
            old.unlink()
    raw.mkdir(parents=True, exist_ok=True)
    (raw / marker).touch()  # before any game: each game file is written whole (aside, then renamed)
    for old in (m for m in markers if m.name != marker):
        old.unlink(missing_ok=True)
    beyond = [p for p in raw.glob("game-*.parquet") if (i := p.stem[5:]).isdigit() and int(i) >= games]
    for p in beyond:
        p.unlink()
    missing = [i for i in range(games) if not (raw / f"game-{i:05d}.parquet").exists()]
    if len(missing) == games:
        say(f"generating {games} demo games x {frames} frames into {raw} ...")
    elif missing or beyond:
        kept = games - len(missing)
        say(f"demo games in {raw}: {kept} kept as they were, {len(beyond)} removed, {len(missing)} to generate")
    for i in missing:
        write_game(simulate_game(seed, i, frames), raw / f"game-{i:05d}.parquet")


def _made_as(marker: str) -> tuple[int, int] | None:
    """(frames, seed) of a demo data set's marker (`.generated-{frames}x-seed{seed}`, or an older
    `.generated-{games}x{frames}-seed{seed}`)."""
    found = re.fullmatch(r"\.generated-(?:\d+x)?(\d+)x?-seed(\d+)", marker)
    return (int(found[1]), int(found[2])) if found else None
