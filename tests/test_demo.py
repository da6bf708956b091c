"""The demo replay generator: schema, determinism, plausibility and a learnable next action."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardline.app import demo_data as demo
from shardline.app.demo_data import (
    DEMO_BOOLEAN,
    DEMO_CARDINALITY,
    DEMO_CATEGORICAL,
    DEMO_CONTINUOUS,
    DEMO_TARGET,
    STAGES,
    generate_demo,
)
from shardline.app.demo_home import demo_raw_data

N_GAMES, FRAMES = 3, 300

CONT = (
    "x",
    "y",
    "percent",
    "shield_strength",
    "speed_air_x",
    "speed_y",
    "speed_ground_x",
    "speed_attack_x",
    "speed_attack_y",
    "state_age",
    "hitlag",
    "stocks",
    "combo_count",
)
ANALOG = ("main_x", "main_y", "c_x", "c_y", "trigger")
BOOL = ("facing", "invulnerable", "on_ground")
BUTTONS = ("a", "b", "x", "y", "z", "l", "r", "start")
CAT = {
    "action": (400, pa.int16()),
    "jumps_left": (8, pa.int8()),
    "character": (33, pa.int8()),
    "l_cancel": (3, pa.int8()),
    "hurtbox_state": (3, pa.int8()),
    "ground": (32, pa.int8()),
    "last_attack_landed": (64, pa.int8()),
}


@pytest.fixture(scope="module")
def games(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    paths = generate_demo(out, n_games=N_GAMES, frames=FRAMES, seed=0)
    return out, paths, [pq.read_table(p) for p in paths]


def _frame(tables):
    return {name: np.concatenate([t.column(name).to_numpy() for t in tables]) for name in tables[0].column_names}


def test_files_names_and_no_leftovers(games):
    out, paths, tables = games
    assert [p.name for p in paths] == [f"game-{i:05d}.parquet" for i in range(N_GAMES)]
    assert paths == sorted(paths)
    assert sorted(p.name for p in out.iterdir()) == [p.name for p in paths]  # no temp files left behind
    assert all(t.num_rows == FRAMES for t in tables)


def test_feature_lists():
    assert len(DEMO_CONTINUOUS) == 2 * (13 + 5)
    assert len(DEMO_BOOLEAN) == 2 * (3 + 8)
    assert len(DEMO_CATEGORICAL) == 2 * 7 + 1 and "stage" in DEMO_CATEGORICAL
    everything = DEMO_CONTINUOUS + DEMO_BOOLEAN + DEMO_CATEGORICAL
    assert len(set(everything)) == len(everything)
    assert DEMO_TARGET == "p1_action" and DEMO_TARGET in DEMO_CATEGORICAL
    for p in ("p1", "p2"):
        assert {f"{p}_{f}" for f in CONT + ANALOG} <= set(DEMO_CONTINUOUS)
        assert {f"{p}_{f}" for f in BOOL} | {f"{p}_btn_{b}" for b in BUTTONS} <= set(DEMO_BOOLEAN)
        assert {f"{p}_{f}" for f in CAT} <= set(DEMO_CATEGORICAL)
    assert set(DEMO_CARDINALITY) == set(DEMO_CATEGORICAL)


def test_schema_and_dtypes(games):
    _, _, tables = games
    expected = {"game_id": pa.string(), "frame": pa.int32(), "stage": pa.string(), "season": pa.int16()}
    for p in ("p1", "p2"):
        expected |= {f"{p}_{f}": pa.float32() for f in CONT + ANALOG}
        expected |= {f"{p}_{f}": pa.bool_() for f in BOOL}
        expected |= {f"{p}_btn_{b}": pa.bool_() for b in BUTTONS}
        expected |= {f"{p}_{f}": typ for f, (_, typ) in CAT.items()}
    for t in tables:
        assert dict(zip(t.schema.names, t.schema.types)) == expected
        assert set(DEMO_CONTINUOUS + DEMO_BOOLEAN + DEMO_CATEGORICAL) <= set(t.column_names)


def test_value_ranges(games):
    _, _, tables = games
    for i, t in enumerate(tables):
        col = {n: t.column(n).to_numpy() for n in t.column_names}
        assert set(col["game_id"]) == {f"g{i:05d}"}
        assert np.array_equal(col["frame"], np.arange(FRAMES))
        assert len(set(col["stage"])) == 1 and col["stage"][0] in STAGES
        assert len(set(col["season"])) == 1 and 2021 <= col["season"][0] <= 2024
        for p in ("p1", "p2"):
            for f, (n, _) in CAT.items():
                v = col[f"{p}_{f}"]
                assert v.min() >= 0 and v.max() < n, f
            for f in ("main_x", "main_y", "c_x", "c_y"):
                assert np.all(np.abs(col[f"{p}_{f}"]) <= 1.0)
            trig = col[f"{p}_trigger"]
            assert trig.min() >= 0.0 and trig.max() <= 1.0
            for f in CONT + ANALOG:
                assert np.all(np.isfinite(col[f"{p}_{f}"])), f


def test_same_seed_same_bytes_different_seed_different(tmp_path):
    a = generate_demo(tmp_path / "a", n_games=2, frames=200, seed=3)
    b = generate_demo(tmp_path / "b", n_games=2, frames=200, seed=3)
    c = generate_demo(tmp_path / "c", n_games=2, frames=200, seed=4)
    for pa_, pb, pc in zip(a, b, c):
        assert pa_.read_bytes() == pb.read_bytes()
        assert pa_.read_bytes() != pc.read_bytes()
    # different games of one seed differ too
    assert pq.read_table(a[0]).drop(["game_id"]) != pq.read_table(a[1]).drop(["game_id"])


def test_game_does_not_depend_on_n_games(tmp_path):
    few = generate_demo(tmp_path / "few", n_games=2, frames=150, seed=11)
    many = generate_demo(tmp_path / "many", n_games=4, frames=150, seed=11)
    assert len(many) == 4
    for p, q in zip(few, many):
        assert p.name == q.name and p.read_bytes() == q.read_bytes()


def test_the_demo_grown_writes_only_the_new_games_and_keeps_the_others_as_they_were(tmp_path):
    """`shardline demo --games N` on a home that holds fewer games: the files there are left alone (their
    mtimes are in the ingest's listing and the encode's group keys: rewritten, every group was encoded again)."""
    raw, said = tmp_path / "raw", []
    demo_raw_data(raw, 3, 120, 5, say=said.append)
    first = {p.name: p.stat().st_mtime_ns for p in raw.glob("*.parquet")}
    assert len(first) == 3 and said == [f"generating 3 demo games x 120 frames into {raw} ..."]

    demo_raw_data(raw, 5, 120, 5, say=said.append)
    grown = sorted(raw.glob("*.parquet"))
    assert [p.name for p in grown] == [f"game-{i:05d}.parquet" for i in range(5)]
    assert {n: t for n, t in ((p.name, p.stat().st_mtime_ns) for p in grown) if n in first} == first
    fresh = generate_demo(tmp_path / "fresh", n_games=5, frames=120, seed=5)
    assert [p.read_bytes() for p in grown] == [p.read_bytes() for p in fresh]  # as if made at 5 at once
    assert said[-1] == f"demo games in {raw}: 3 kept as they were, 0 removed, 2 to generate"

    demo_raw_data(raw, 5, 120, 5, say=said.append)  # the same again: nothing said, nothing written
    assert len(said) == 2 and {p.name: p.stat().st_mtime_ns for p in grown} == {
        p.name: p.stat().st_mtime_ns for p in raw.glob("*.parquet")
    }
    demo_raw_data(raw, 4, 120, 5, say=said.append)
    assert len(list(raw.glob("*.parquet"))) == 4 and "1 removed" in said[-1]

    # another seed (or other frames): another data set, every game written again
    demo_raw_data(raw, 4, 120, 6, say=said.append)
    assert (raw / "game-00000.parquet").read_bytes() != fresh[0].read_bytes()
    assert [m.name for m in raw.glob(".generated-*")] == [".generated-120x-seed6"]

    # a home made before the marker named frames and seed alone: its games are kept too
    (raw / ".generated-120x-seed6").rename(raw / ".generated-4x120-seed6")
    before = (raw / "game-00000.parquet").stat().st_mtime_ns
    demo_raw_data(raw, 4, 120, 6, say=said.append)
    assert (raw / "game-00000.parquet").stat().st_mtime_ns == before
    assert [m.name for m in raw.glob(".generated-*")] == [".generated-120x-seed6"]


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    def boom(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(demo.pq, "write_table", boom)
    with pytest.raises(OSError):
        generate_demo(tmp_path, n_games=1, frames=50, seed=0)
    assert list(tmp_path.iterdir()) == []


def test_rejects_bad_sizes(tmp_path):
    with pytest.raises(ValueError):
        generate_demo(tmp_path, n_games=1, frames=0)
    with pytest.raises(ValueError):
        generate_demo(tmp_path, n_games=-1, frames=10)


def test_plausible_dynamics(games):
    _, _, tables = games
    for t in tables:
        col = {n: t.column(n).to_numpy() for n in t.column_names}
        assert np.all(np.diff(col["frame"]) == 1)
        for p in ("p1", "p2"):
            stocks = col[f"{p}_stocks"]
            assert stocks[0] == 4 and np.all(np.diff(stocks) <= 0) and stocks.min() >= 1
            pct = col[f"{p}_percent"]
            assert pct.min() >= 0.0 and pct.max() <= 999.0
            act = col[f"{p}_action"]
            # percent only goes up, except back to 0 when the player respawns after losing a stock
            down = np.flatnonzero(np.diff(pct) < 0) + 1
            assert np.all(pct[down] == 0) and np.all(act[down] == demo.REBIRTH)
            assert len(set(col[f"{p}_character"])) == 1
            # state_age counts frames since the action changed
            age = col[f"{p}_state_age"]
            changed = act[1:] != act[:-1]
            assert np.all(age[1:][changed] == 0)
            assert np.all((age[1:] == age[:-1] + 1) | (age[1:] == 0))
            # on the ground means standing at height 0; nobody falls through the stage
            assert np.all(col[f"{p}_y"][col[f"{p}_on_ground"]] == 0.0) and col[f"{p}_y"].min() >= 0.0
            shield = col[f"{p}_shield_strength"]
            assert shield.min() >= 0.0 and shield.max() <= 60.0
            # positions move smoothly (integrated velocities), not white noise
            x = col[f"{p}_x"].astype(np.float64)
            assert np.abs(np.diff(x)).max() < 15.0
            assert np.corrcoef(x[1:], x[:-1])[0, 1] > 0.9
            assert len(np.unique(act)) > 5  # and the players actually do things


def test_next_action_is_learnable(tmp_path):
    paths = generate_demo(tmp_path, n_games=4, frames=600, seed=1)
    tables = [pq.read_table(p) for p in paths]
    cur = np.concatenate([t.column(DEMO_TARGET).to_numpy()[:-1] for t in tables])
    nxt = np.concatenate([t.column(DEMO_TARGET).to_numpy()[1:] for t in tables])
    majority_share = np.bincount(nxt).max() / len(nxt)
    persist = float(np.mean(cur == nxt))
    assert majority_share <= 0.30
    assert persist >= 2 * majority_share
    assert persist >= 0.8


def test_transitions_follow_the_inputs(tmp_path):
    """Actionable on the ground, a fresh A press with the stick at rest starts a jab on the next frame;
    a fresh jump press starts the jump squat. Only rare random transitions break the rule."""
    paths = generate_demo(tmp_path, n_games=10, frames=2000, seed=2)
    hits = total = 0
    for t in (pq.read_table(p) for p in paths):
        col = {n: t.column(n).to_numpy() for n in t.column_names}
        act, nxt = col["p1_action"][:-1], col["p1_action"][1:]
        a, jx, jy = col["p1_btn_a"], col["p1_btn_x"], col["p1_btn_y"]
        fresh = lambda b: b[:-1] & ~np.r_[False, b[:-2]]
        still = (np.abs(col["p1_main_x"]) < 0.3)[:-1] & (np.abs(col["p1_main_y"]) < 0.3)[:-1]
        not_hit = col["p1_percent"][1:] == col["p1_percent"][:-1]  # p1 was not hit meanwhile
        jab = (act == demo.WAIT) & fresh(a) & still & ~fresh(jx) & ~fresh(jy) & not_hit
        jump = (act == demo.WAIT) & (fresh(jx) | fresh(jy)) & ~fresh(a) & ~fresh(col["p1_btn_b"]) & not_hit
        hits += int(np.sum(nxt[jab] == demo.ATTACK_11)) + int(np.sum(nxt[jump] == demo.KNEE_BEND))
        total += int(jab.sum() + jump.sum())
    assert total >= 30, total
    assert hits / total >= 0.85, (hits, total)
