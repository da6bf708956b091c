"""A seeded generator of raw game-replay parquet files: the demo dataset.

Each file is one two-player platform-fighter game (Melee-like: 60 frames a second), one row per
frame, with the per-frame state of both players (position, velocities, damage percent, stocks,
shield, action state, ...), their controller inputs, and a few game-level columns (`game_id`,
`stage`, `season`).

The game is simulated, not sampled column by column, so values move plausibly over time:
positions integrate velocities, percent only increases (and resets when a stock is lost), stocks
count down from 4, `state_age` counts frames since the action changed, the shield wears down
while held and regenerates otherwise.

The target, `p1_action` at the next frame, is learnable from a short window of past frames:
actions run for a fixed duration per action (so "same as now" is a strong cue, and `state_age`
says when it ends), and transitions are a deterministic function of the state and the inputs at
the current frame (button presses and the stick direction, on-ground or airborne, the current
action, the opponent's attack and distance), plus about 5% random transitions drawn from a skewed
distribution over the whole 400-value action space.

Determinism: game `i` is drawn from `numpy.random.default_rng([seed, i])`, so it does not depend on
how many games are generated, and files are written with fixed pyarrow settings (zstd, no
timestamps), so the same seed gives byte-identical files.
"""

from __future__ import annotations

import argparse
import math
import os
import time
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

__all__ = [
    "DEMO_BOOLEAN",
    "DEMO_CARDINALITY",
    "DEMO_CATEGORICAL",
    "DEMO_CONTINUOUS",
    "DEMO_TARGET",
    "STAGES",
    "generate_demo",
    "simulate_game",
]

# --------------------------------------------------------------------------------------------
# Columns
# --------------------------------------------------------------------------------------------

PLAYERS = ("p1", "p2")
_CONT_FIELDS = (
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
_BOOL_FIELDS = ("facing", "invulnerable", "on_ground")
# name -> (vocabulary size, arrow type); values are integer codes in [0, size)
_CAT_FIELDS: dict[str, tuple[int, pa.DataType]] = {
    "action": (400, pa.int16()),
    "jumps_left": (8, pa.int8()),
    "character": (33, pa.int8()),
    "l_cancel": (3, pa.int8()),
    "hurtbox_state": (3, pa.int8()),
    "ground": (32, pa.int8()),
    "last_attack_landed": (64, pa.int8()),
}
_ANALOG = ("main_x", "main_y", "c_x", "c_y", "trigger")
_BUTTONS = ("a", "b", "x", "y", "z", "l", "r", "start")

DEMO_CONTINUOUS: list[str] = [f"{p}_{f}" for p in PLAYERS for f in (*_CONT_FIELDS, *_ANALOG)]
DEMO_BOOLEAN: list[str] = [f"{p}_{f}" for p in PLAYERS for f in (*_BOOL_FIELDS, *(f"btn_{b}" for b in _BUTTONS))]
DEMO_CATEGORICAL: list[str] = [f"{p}_{f}" for p in PLAYERS for f in _CAT_FIELDS] + ["stage"]
DEMO_TARGET = "p1_action"

# stage name -> half-width of the main platform (game units)
STAGES: dict[str, float] = {
    "battlefield": 68.4,
    "final_destination": 85.6,
    "dreamland": 77.3,
    "yoshis_story": 56.0,
    "fountain_of_dreams": 63.4,
    "pokemon_stadium": 87.8,
}
_STAGE_NAMES = list(STAGES)
_STAGE_P = np.array([0.30, 0.20, 0.15, 0.13, 0.12, 0.10])

# vocabulary sizes of the categorical columns (stage: number of stage names)
DEMO_CARDINALITY: dict[str, int] = {f"{p}_{f}": n for p in PLAYERS for f, (n, _) in _CAT_FIELDS.items()}
DEMO_CARDINALITY["stage"] = len(STAGES)

# --------------------------------------------------------------------------------------------
# Action states (Melee action-state numbering where one exists; 341..399 are character specials)
# --------------------------------------------------------------------------------------------

N_ACTIONS = 400
DEAD_DOWN, DEAD_LEFT, DEAD_RIGHT, DEAD_UP = 0, 1, 2, 3
REBIRTH, REBIRTH_WAIT = 12, 13
WAIT, WALK_SLOW, WALK_MIDDLE, WALK_FAST, TURN, TURN_RUN, DASH, RUN, RUN_BRAKE = 14, 15, 16, 17, 18, 19, 20, 21, 23
KNEE_BEND, JUMP_F, JUMP_B, JUMP_AERIAL_F, JUMP_AERIAL_B, FALL, FALL_AERIAL = 24, 25, 26, 27, 28, 29, 32
FALL_SPECIAL, DAMAGE_FALL = 35, 38
SQUAT, SQUAT_WAIT, SQUAT_RV, LANDING, LANDING_SPECIAL = 39, 40, 41, 42, 43
ATTACK_11, ATTACK_12, ATTACK_13, ATTACK_DASH = 44, 45, 46, 50
ATTACK_S3_HI, ATTACK_S3_HI_S, ATTACK_S3_S, ATTACK_S3_LW_S, ATTACK_S3_LW = 51, 52, 53, 54, 55
ATTACK_HI3, ATTACK_LW3 = 56, 57
ATTACK_S4_HI, ATTACK_S4_S, ATTACK_S4_LW, ATTACK_HI4, ATTACK_LW4 = 58, 60, 62, 63, 64
AIR_N, AIR_F, AIR_B, AIR_HI, AIR_LW = 65, 66, 67, 68, 69
LANDING_AIR_N = 70  # .. 74, same order as the aerials
DAMAGE_HI_1, DAMAGE_N_1, DAMAGE_LW_1, DAMAGE_AIR_1 = 75, 78, 81, 84  # each _1, _2, _3
DAMAGE_FLY_HI, DAMAGE_FLY_N, DAMAGE_FLY_LW, DAMAGE_FLY_TOP, DAMAGE_FLY_ROLL = 87, 88, 89, 90, 91
GUARD_ON, GUARD, GUARD_OFF, GUARD_SET_OFF = 178, 179, 180, 181
DOWN_BOUND_U, DOWN_WAIT_U, DOWN_STAND_U, DOWN_ATTACK_U, DOWN_FOWARD_U, DOWN_BACK_U = 183, 184, 186, 187, 188, 189
PASSIVE, PASSIVE_STAND_F, PASSIVE_STAND_B = 199, 200, 201
SHIELD_BREAK_FLY, SHIELD_BREAK_DOWN_U, SHIELD_BREAK_STAND_U, FURA_FURA = 205, 207, 209, 211
CATCH, CATCH_PULL, CATCH_DASH, CATCH_DASH_PULL, CATCH_WAIT, CATCH_ATTACK, CATCH_CUT = 212, 213, 214, 215, 216, 217, 218
THROW_F, THROW_B, THROW_HI, THROW_LW = 219, 220, 221, 222
CAPTURE_PULLED_HI, CAPTURE_WAIT_HI, CAPTURE_DAMAGE_HI, CAPTURE_CUT = 223, 224, 225, 229
ESCAPE_F, ESCAPE_B, ESCAPE, ESCAPE_AIR = 233, 234, 235, 236
THROWN_F, THROWN_B, THROWN_HI, THROWN_LW = 239, 240, 241, 242
SPECIAL_BASE, N_SPECIAL_IDS = 341, 59

# fixed tables: built from a constant seed so they never depend on the generator's seed
_TAB = np.random.default_rng(0x5EED_DA7A)

DUR = [int(v) for v in _TAB.integers(4, 17, N_ACTIONS)]  # locked duration; 0 = free state
HITF = [-1] * N_ACTIONS  # first active frame (-1: no hitbox)
ACTIVE = [0] * N_ACTIONS  # active frames
DMG = [0.0] * N_ACTIONS
BASE_KB = [0.0] * N_ACTIONS
GROWTH = [0.0] * N_ACTIONS
ANGLE = [0.0] * N_ACTIONS  # launch angle in degrees, relative to the attacker's facing
REACH_X = [0.0] * N_ACTIONS
REACH_Y = [0.0] * N_ACTIONS
ATK_ID = [0] * N_ACTIONS  # last_attack_landed code
HIT_DIR = [0] * N_ACTIONS  # 1: hits in front only, -1: behind only, 0: anywhere
INTANGIBLE = [None] * N_ACTIONS  # (first, last) intangible frame, or None

for _a in (
    WAIT,
    WALK_SLOW,
    WALK_MIDDLE,
    WALK_FAST,
    RUN,
    JUMP_F,
    JUMP_B,
    JUMP_AERIAL_F,
    JUMP_AERIAL_B,
    FALL,
    FALL_AERIAL,
    FALL_SPECIAL,
    DAMAGE_FALL,
    SQUAT_WAIT,
    GUARD,
    DOWN_WAIT_U,
    REBIRTH_WAIT,
    CATCH_WAIT,
    CAPTURE_WAIT_HI,
):
    DUR[_a] = 0
for _a, _d in {
    TURN: 6,
    TURN_RUN: 12,
    DASH: 12,
    RUN_BRAKE: 14,
    KNEE_BEND: 5,
    SQUAT: 4,
    SQUAT_RV: 6,
    LANDING: 4,
    LANDING_SPECIAL: 12,
    GUARD_ON: 2,
    GUARD_OFF: 15,
    GUARD_SET_OFF: 6,
    DOWN_BOUND_U: 26,
    DOWN_STAND_U: 30,
    DOWN_FOWARD_U: 35,
    DOWN_BACK_U: 35,
    PASSIVE: 26,
    PASSIVE_STAND_F: 40,
    PASSIVE_STAND_B: 40,
    SHIELD_BREAK_FLY: 40,
    SHIELD_BREAK_DOWN_U: 30,
    SHIELD_BREAK_STAND_U: 20,
    FURA_FURA: 100,
    CATCH_PULL: 8,
    CATCH_DASH_PULL: 8,
    CATCH_CUT: 25,
    CAPTURE_PULLED_HI: 8,
    CAPTURE_DAMAGE_HI: 10,
    CAPTURE_CUT: 30,
    **dict.fromkeys((THROWN_F, THROWN_B, THROWN_HI, THROWN_LW), 40),
    ESCAPE_F: 31,
    ESCAPE_B: 31,
    ESCAPE: 27,
    ESCAPE_AIR: 30,
    **dict.fromkeys((DEAD_DOWN, DEAD_LEFT, DEAD_RIGHT, DEAD_UP), 60),
    REBIRTH: 40,
}.items():
    DUR[_a] = _d
for _a, _span in {
    ESCAPE_F: (4, 19),
    ESCAPE_B: (4, 19),
    ESCAPE: (2, 17),
    ESCAPE_AIR: (4, 29),
    **dict.fromkeys((PASSIVE, PASSIVE_STAND_F, PASSIVE_STAND_B, DOWN_FOWARD_U, DOWN_BACK_U), (0, 19)),
    DOWN_STAND_U: (0, 22),
    DOWN_ATTACK_U: (0, 20),
}.items():
    INTANGIBLE[_a] = _span


REACH_SCALE = 1.4  # hitboxes a little larger than the real game's: more contact per minute


def _attack(a, dur, hitf, active, dmg, base, growth, angle, rx, ry, atk, hdir=1):
    DUR[a], HITF[a], ACTIVE[a], DMG[a], BASE_KB[a], GROWTH[a] = dur, hitf, active, dmg, base, growth
    ANGLE[a], REACH_X[a], REACH_Y[a], ATK_ID[a], HIT_DIR[a] = angle, rx * REACH_SCALE, ry * REACH_SCALE, atk, hdir


#       action          dur hit act dmg  base grow angle rx  ry  atk dir
_attack(ATTACK_11, 17, 2, 2, 3, 8, 0.10, 80, 12, 10, 2)
_attack(ATTACK_12, 18, 3, 2, 3, 10, 0.10, 70, 12, 10, 3)
_attack(ATTACK_13, 30, 5, 3, 5, 30, 0.60, 40, 14, 10, 4)
_attack(ATTACK_DASH, 38, 6, 10, 9, 30, 0.50, 70, 16, 12, 6)
for _a, _ang in ((ATTACK_S3_HI, 35), (ATTACK_S3_HI_S, 30), (ATTACK_S3_S, 25), (ATTACK_S3_LW_S, 18), (ATTACK_S3_LW, 12)):
    _attack(_a, 28, 5, 4, 9, 20, 0.80, _ang, 17, 12, 7)
_attack(ATTACK_HI3, 27, 5, 6, 10, 25, 0.90, 90, 13, 18, 8, 0)
_attack(ATTACK_LW3, 25, 6, 3, 9, 20, 0.70, 80, 16, 6, 9)
for _a, _ang in ((ATTACK_S4_HI, 45), (59, 40), (ATTACK_S4_S, 35), (61, 30), (ATTACK_S4_LW, 25)):
    _attack(_a, 45, 12, 3, 16, 40, 1.30, _ang, 20, 12, 10)
_attack(ATTACK_HI4, 45, 10, 6, 15, 35, 1.25, 88, 14, 22, 11, 0)
_attack(ATTACK_LW4, 48, 8, 8, 14, 35, 1.20, 20, 20, 8, 12, 0)
_attack(AIR_N, 40, 4, 20, 10, 15, 0.80, 45, 13, 13, 13, 0)
_attack(AIR_F, 45, 6, 6, 13, 20, 1.00, 45, 17, 12, 14)
_attack(AIR_B, 38, 5, 8, 13, 20, 1.00, 140, 16, 12, 15, -1)
_attack(AIR_HI, 36, 5, 8, 12, 15, 1.00, 85, 13, 18, 16, 0)
_attack(AIR_LW, 48, 8, 12, 14, 20, 1.10, -80, 13, 16, 17, 0)
_attack(DOWN_ATTACK_U, 49, 15, 4, 6, 40, 0.40, 30, 20, 10, 50, 0)
_attack(CATCH, 30, 7, 2, 0, 0, 0.0, 0, 14, 10, 0)
_attack(CATCH_DASH, 40, 10, 2, 0, 0, 0.0, 0, 18, 10, 0)
_attack(CATCH_ATTACK, 16, 4, 1, 3, 0, 0.0, 0, 30, 30, 52, 0)
_attack(THROW_F, 32, 10, 1, 8, 50, 0.60, 40, 30, 30, 53, 0)
_attack(THROW_B, 36, 10, 1, 9, 50, 0.65, 135, 30, 30, 54, 0)
_attack(THROW_HI, 34, 10, 1, 6, 60, 0.50, 90, 30, 30, 55, 0)
_attack(THROW_LW, 36, 10, 1, 7, 40, 0.40, 70, 30, 30, 56, 0)
for _i in range(N_SPECIAL_IDS):  # character specials: parameters per id
    _dur = int(_TAB.integers(30, 61))
    _attack(
        SPECIAL_BASE + _i,
        _dur,
        int(_TAB.integers(6, 19)),
        int(_TAB.integers(2, 9)),
        float(_TAB.integers(4, 19)),
        float(_TAB.integers(10, 45)),
        float(_TAB.uniform(0.3, 1.1)),
        float(_TAB.integers(20, 80)),
        float(_TAB.integers(12, 30)),
        float(_TAB.integers(8, 20)),
        18,
        1,
    )

_GRABS = frozenset((CATCH, CATCH_DASH))
_HOLDING = frozenset((CATCH_PULL, CATCH_DASH_PULL, CATCH_WAIT, CATCH_ATTACK, THROW_F, THROW_B, THROW_HI, THROW_LW))
_THROWS = (THROW_F, THROW_B, THROW_HI, THROW_LW)
_THROWN = frozenset((THROWN_F, THROWN_B, THROWN_HI, THROWN_LW))
_CAPTIVE = frozenset((CAPTURE_PULLED_HI, CAPTURE_WAIT_HI, CAPTURE_DAMAGE_HI))
_GUARDING = frozenset((GUARD_ON, GUARD, GUARD_SET_OFF))
_DEAD = frozenset((DEAD_DOWN, DEAD_LEFT, DEAD_RIGHT, DEAD_UP, REBIRTH, REBIRTH_WAIT))
_AERIALS = frozenset((AIR_N, AIR_F, AIR_B, AIR_HI, AIR_LW))
_FLY = frozenset(range(DAMAGE_FLY_HI, DAMAGE_FLY_ROLL + 1))
_DAMAGE = frozenset(range(DAMAGE_HI_1, DAMAGE_FLY_ROLL + 1))
_FREE_AIR = frozenset((JUMP_F, JUMP_B, JUMP_AERIAL_F, JUMP_AERIAL_B, FALL, FALL_AERIAL, DAMAGE_FALL))
_DRIFT = _FREE_AIR | _AERIALS | {FALL_SPECIAL, KNEE_BEND} | set(range(SPECIAL_BASE, N_ACTIONS))
_WALKS = (WALK_SLOW, WALK_MIDDLE, WALK_FAST)
# states in which the opponent is still "in a combo" (combo_count is not reset)
_STUNNED = (
    _DAMAGE
    | _THROWN
    | _CAPTIVE
    | {DOWN_BOUND_U, DOWN_WAIT_U, SHIELD_BREAK_FLY, SHIELD_BREAK_DOWN_U, SHIELD_BREAK_STAND_U, FURA_FURA, DAMAGE_FALL}
)
# states a random transition may not start from (the two players' states are coupled there)
_NO_NOISE = _DEAD | _CAPTIVE | _THROWN | _HOLDING | _DAMAGE | {DAMAGE_FALL}
# fixed follow-up when a locked action ends (otherwise the player is actionable again)
FOLLOW = {
    KNEE_BEND: -2,
    DASH: -3,
    SQUAT: SQUAT_WAIT,
    SQUAT_RV: WAIT,
    GUARD_ON: -4,
    GUARD_SET_OFF: -4,
    GUARD_OFF: WAIT,
    RUN_BRAKE: WAIT,
    TURN_RUN: RUN,
    DOWN_BOUND_U: DOWN_WAIT_U,
    SHIELD_BREAK_DOWN_U: SHIELD_BREAK_STAND_U,
    SHIELD_BREAK_STAND_U: FURA_FURA,
    FURA_FURA: WAIT,
    **dict.fromkeys((CATCH_PULL, CATCH_DASH_PULL, CATCH_ATTACK), CATCH_WAIT),
    CATCH_CUT: WAIT,
    CAPTURE_PULLED_HI: CAPTURE_WAIT_HI,
    CAPTURE_DAMAGE_HI: CAPTURE_WAIT_HI,
    CAPTURE_CUT: WAIT,
    ESCAPE_AIR: FALL_SPECIAL,
    **dict.fromkeys((DEAD_DOWN, DEAD_LEFT, DEAD_RIGHT, DEAD_UP), REBIRTH),
    REBIRTH: REBIRTH_WAIT,
}

# random transitions: a fixed, Zipf-like preference over the whole action space
_NOISE_POOL = np.array(
    [
        a
        for a in range(N_ACTIONS)
        if a not in _NO_NOISE
        and a not in FOLLOW
        and a not in _GUARDING
        and a not in (GUARD_OFF, DOWN_WAIT_U, FALL_SPECIAL, SHIELD_BREAK_FLY)
    ]
)
_NOISE_POOL = _NOISE_POOL[_TAB.permutation(len(_NOISE_POOL))]
_NOISE_P = 1.0 / np.arange(1, len(_NOISE_POOL) + 1) ** 1.2
_NOISE_P /= _NOISE_P.sum()
NOISE_RATE = 0.05

# characters: popularity (33 codes, the last few unplayable) and physics
_CHAR_P = np.full(33, 0.002)
for _c, _w in {
    1: 0.20,
    22: 0.15,
    18: 0.12,
    7: 0.10,
    15: 0.08,
    2: 0.07,
    9: 0.05,
    10: 0.04,
    12: 0.03,
    13: 0.03,
    25: 0.03,
    14: 0.02,
    17: 0.02,
    21: 0.015,
    0: 0.01,
    3: 0.01,
    6: 0.01,
    20: 0.01,
    16: 0.008,
    19: 0.008,
    26: 0.008,
    8: 0.006,
    5: 0.006,
    24: 0.006,
    23: 0.004,
    4: 0.004,
}.items():
    _CHAR_P[_c] = _w
_CHAR_P[27:] = 0.0
_CHAR_P /= _CHAR_P.sum()
_CHAR = {
    "walk": _TAB.uniform(0.8, 1.6, 33),
    "run": _TAB.uniform(1.3, 2.3, 33),
    "air": _TAB.uniform(0.8, 1.3, 33),
    "grav": _TAB.uniform(0.06, 0.23, 33),
    "fall": _TAB.uniform(1.3, 2.8, 33),
    "jump": _TAB.uniform(2.1, 3.7, 33),
    "squat": _TAB.integers(3, 9, 33),
    "weight": _TAB.uniform(0.85, 1.2, 33),
    "land": _TAB.integers(14, 32, (33, 5)),
    "special": _TAB.integers(0, N_SPECIAL_IDS, (33, 8)),
}
_CHAR_JUMPS = [6 if c in (4, 15) else 2 for c in range(33)]

# buttons (bit masks, in _BUTTONS order) and how players press them
BTN_A, BTN_B, BTN_X, BTN_Y, BTN_Z, BTN_L, BTN_R, BTN_START = (1 << i for i in range(8))
# which button a press is: far from the opponent (movement) and near it (fighting)
_BTN_P = np.array([0.26, 0.13, 0.24, 0.11, 0.03, 0.05, 0.1795, 0.0005])
_BTN_P_NEAR = np.array([0.48, 0.10, 0.08, 0.04, 0.06, 0.04, 0.1995, 0.0005])
_HOLD_MIN = np.array([2, 2, 2, 2, 2, 3, 3, 5])
_HOLD_MAX = np.array([6, 6, 12, 12, 5, 25, 25, 10])
_JUMP = BTN_X | BTN_Y
_SHIELD = BTN_L | BTN_R
PRESS_RATE = 0.05  # new button presses per frame, far from the opponent
PRESS_RATE_NEAR = 0.20  # ... and within reach of it
STICK_RATE = 0.06  # new stick targets per frame
KILL_KB = 140.0  # knockback from which a hit takes a stock


class _Player:
    __slots__ = (
        "act",
        "age",
        "dur",
        "x",
        "y",
        "vax",
        "vy",
        "vgx",
        "kbx",
        "kby",
        "percent",
        "stocks",
        "shield",
        "hitlag",
        "combo",
        "facing",
        "ground",
        "jumps",
        "jumps_max",
        "inv",
        "l_cancel",
        "last_atk",
        "hit_done",
        "lc",
        "special_kind",
        "char",
        "walk",
        "run",
        "air",
        "grav",
        "fall",
        "jump",
        "squat",
        "weight",
        "land",
        "specials",
        "sx",
        "sy",
        "tsx",
        "tsy",
        "cx",
        "cy",
        "ctime",
        "trig",
        "held",
        "prev",
        "edge",
        "until",
        "r_stick",
        "r_cat",
        "r_mag",
        "r_jit",
        "r_c",
        "r_cdir",
        "r_press",
        "r_btn",
        "r_btn_near",
        "r_hold",
        "r_trig",
        "r_noise",
        "r_noise_act",
        "next",
        "hit_by",
        "rows",
    )


def _new_player(rng: np.random.Generator, char: int, x: float, facing: int, frames: int) -> _Player:
    p = _Player()
    p.act, p.age, p.dur = WAIT, 0, 0
    p.x, p.y, p.vax, p.vy, p.vgx, p.kbx, p.kby = x, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0
    p.percent, p.stocks, p.shield, p.hitlag, p.combo = 0.0, 4, 60.0, 0, 0
    p.facing, p.ground = facing, True
    p.char = char
    p.jumps_max = p.jumps = _CHAR_JUMPS[char]
    p.inv, p.l_cancel, p.last_atk, p.hit_done, p.lc, p.special_kind = 0, 0, 0, False, 99, -1
    p.walk, p.run, p.air = float(_CHAR["walk"][char]), float(_CHAR["run"][char]), float(_CHAR["air"][char])
    p.grav, p.fall, p.jump = float(_CHAR["grav"][char]), float(_CHAR["fall"][char]), float(_CHAR["jump"][char])
    p.squat, p.weight = int(_CHAR["squat"][char]), float(_CHAR["weight"][char])
    p.land = [int(v) for v in _CHAR["land"][char]]
    p.specials = [SPECIAL_BASE + int(v) for v in _CHAR["special"][char]]
    p.sx = p.sy = p.tsx = p.tsy = p.cx = p.cy = p.trig = 0.0
    p.ctime, p.held, p.prev, p.edge = 0, 0, 0, 0
    p.until = [0] * 8
    # every random number the player needs, drawn up front (vectorised), then read per frame
    p.r_stick = rng.random(frames).tolist()
    p.r_cat = rng.random(frames).tolist()
    p.r_mag = rng.uniform(0.3, 1.0, frames).tolist()
    p.r_jit = rng.normal(0.0, 0.012, (frames, 2)).tolist()
    p.r_c = rng.random(frames).tolist()
    p.r_cdir = rng.integers(0, 4, frames).tolist()
    p.r_press = rng.random(frames).tolist()
    p.r_btn = rng.choice(8, frames, p=_BTN_P).tolist()
    p.r_btn_near = rng.choice(8, frames, p=_BTN_P_NEAR).tolist()
    p.r_hold = rng.integers(_HOLD_MIN, _HOLD_MAX + 1, (frames, 8)).tolist()
    p.r_trig = (rng.random(frames) * (rng.random(frames) < 0.05) * 0.3).tolist()
    p.r_noise = rng.random(frames).tolist()
    p.r_noise_act = rng.choice(_NOISE_POOL, frames, p=_NOISE_P).tolist()
    p.next, p.hit_by, p.rows = -1, -1, []
    return p


def _inputs(p: _Player, o: _Player, t: int) -> None:
    """The controller state at frame t: a stick that flicks between targets, buttons held a few frames."""
    if p.r_stick[t] < STICK_RATE:
        c = p.r_cat[t]
        m = p.r_mag[t]
        toward = 1.0 if o.x >= p.x else -1.0
        if c < 0.30:
            p.tsx, p.tsy = 0.0, 0.0
        elif c < 0.68:
            p.tsx, p.tsy = toward * m, 0.0
        elif c < 0.76:
            p.tsx, p.tsy = -toward * m, 0.0
        elif c < 0.82:
            p.tsx, p.tsy = 0.0, m
        elif c < 0.92:
            p.tsx, p.tsy = 0.0, -m
        else:
            p.tsx, p.tsy = toward * m * 0.7, (m if c < 0.96 else -m) * 0.7
    j = p.r_jit[t]
    sx = p.sx + (p.tsx - p.sx) * 0.6 + j[0]
    sy = p.sy + (p.tsy - p.sy) * 0.6 + j[1]
    p.sx = -1.0 if sx < -1.0 else (1.0 if sx > 1.0 else sx)
    p.sy = -1.0 if sy < -1.0 else (1.0 if sy > 1.0 else sy)
    if p.ctime > 0:
        p.ctime -= 1
        if p.ctime == 0:
            p.cx = p.cy = 0.0
    elif p.r_c[t] < 0.01:
        d = p.r_cdir[t]
        p.cx, p.cy = ((1.0, 0.0), (-1.0, 0.0), (0.0, 1.0), (0.0, -1.0))[d]
        p.ctime = 3
    until = p.until
    held = p.held
    near = -22.0 < o.x - p.x < 22.0 and -20.0 < o.y - p.y < 20.0
    if p.r_press[t] < (PRESS_RATE_NEAR if near else PRESS_RATE):
        b = p.r_btn_near[t] if near else p.r_btn[t]
        if until[b] <= t:
            until[b] = t + p.r_hold[t][b]
            held |= 1 << b
    if held:
        for b in range(8):
            if held >> b & 1 and until[b] <= t:
                held &= ~(1 << b)
    p.prev, p.held = p.held, held
    p.edge = held & ~p.prev
    p.trig = 1.0 if held & _SHIELD else p.r_trig[t]
    if p.edge & (BTN_L | BTN_R | BTN_Z):
        p.lc = 0
    elif p.lc < 99:
        p.lc += 1


def _connects(a: _Player, d: _Player) -> bool:
    """Does a's current attack hit d at this frame (from the state at this frame)?"""
    act = a.act
    hf = HITF[act]
    if hf < 0 or a.hit_done or a.age < hf or a.age >= hf + ACTIVE[act]:
        return False
    dact = d.act
    if dact in _DEAD or d.inv > 0:
        return False
    span = INTANGIBLE[dact]
    if span is not None and span[0] <= d.age <= span[1]:
        return False
    if act == CATCH_ATTACK:
        return dact == CAPTURE_WAIT_HI
    if act in _THROWS:
        return dact in _THROWN
    if dact in _CAPTIVE or dact in _THROWN:
        return False
    if act in _GRABS and not d.ground:
        return False
    dx = d.x - a.x
    hdir = HIT_DIR[act]
    if hdir == 1 and dx * a.facing < -4.0:
        return False
    if hdir == -1 and dx * a.facing > 4.0:
        return False
    return abs(dx) <= REACH_X[act] and abs(d.y - a.y) <= REACH_Y[act]


def _stick_dir(sx: float, sy: float) -> int:
    """0 neutral, 1 side, 2 up, 3 down."""
    ax, ay = abs(sx), abs(sy)
    if ax < 0.3 and ay < 0.3:
        return 0
    if ay > ax:
        return 2 if sy > 0 else 3
    return 1


def _ground_choice(p: _Player, buttons: int) -> int:
    """What an actionable player on the ground does next, from the inputs at this frame."""
    a, sx, sy = p.act, p.sx, p.sy
    if buttons & BTN_A:
        if a == CATCH_WAIT:
            return CATCH_ATTACK
        if a in _GUARDING:
            return CATCH
        if a in (DASH, RUN):
            return ATTACK_DASH
        if a == ATTACK_11:
            return ATTACK_12
        if a == ATTACK_12:
            return ATTACK_13
        d = _stick_dir(sx, sy)
        if d == 2:
            return ATTACK_HI3
        if d == 3:
            return ATTACK_LW3
        if d == 1:
            if abs(sx) >= 0.9:
                return ATTACK_S4_HI if sy > 0.3 else (ATTACK_S4_LW if sy < -0.3 else ATTACK_S4_S)
            if sy > 0.35:
                return ATTACK_S3_HI
            if sy > 0.15:
                return ATTACK_S3_HI_S
            if sy < -0.35:
                return ATTACK_S3_LW
            if sy < -0.15:
                return ATTACK_S3_LW_S
            return ATTACK_S3_S
        return ATTACK_11
    if a == CATCH_WAIT:  # holding the opponent: throw by stick direction, or let go
        if abs(sx) > 0.7:
            return THROW_F if sx * p.facing > 0 else THROW_B
        if sy > 0.7:
            return THROW_HI
        if sy < -0.7:
            return THROW_LW
        return CATCH_CUT if p.age >= 90 else -1
    if buttons & BTN_B:
        return p.specials[_stick_dir(sx, sy)]
    if buttons & _JUMP:
        return KNEE_BEND
    if buttons & BTN_Z:
        return CATCH_DASH if a in (DASH, RUN) else CATCH
    if buttons & _SHIELD or (a in _GUARDING and p.held & _SHIELD):
        if abs(sx) > 0.7:
            return ESCAPE_F if sx * p.facing > 0 else ESCAPE_B
        if sy < -0.7:
            return ESCAPE
        return GUARD if a in _GUARDING else GUARD_ON
    if a in _GUARDING:
        return GUARD_OFF
    if p.cx != 0.0 or p.cy != 0.0:  # c-stick: smash attacks
        if p.cy > 0.5:
            return ATTACK_HI4
        if p.cy < -0.5:
            return ATTACK_LW4
        if p.cx * p.facing < 0:
            return TURN
        return ATTACK_S4_S
    ax = abs(sx)
    if a in (SQUAT_WAIT, SQUAT):
        return SQUAT_WAIT if sy < -0.6 else SQUAT_RV
    if sy < -0.6 and ax < 0.5:
        return SQUAT
    if a == RUN:
        if ax >= 0.8:
            return RUN if sx * p.facing > 0 else TURN_RUN
        return RUN_BRAKE
    if ax >= 0.8:
        return DASH
    if ax >= 0.3:
        if sx * p.facing < 0:
            return TURN
        return WALK_SLOW if ax < 0.5 else (WALK_MIDDLE if ax < 0.7 else WALK_FAST)
    return WAIT


def _air_choice(p: _Player, buttons: int) -> int:
    """What an actionable airborne player does next, from the inputs at this frame."""
    a, sx, sy = p.act, p.sx, p.sy
    if a == FALL_SPECIAL:
        return -1
    if buttons & BTN_A or p.cx != 0.0 or p.cy != 0.0:
        if buttons & BTN_A:
            d, fx = _stick_dir(sx, sy), sx
        else:
            d, fx = (1 if p.cx != 0.0 else (2 if p.cy > 0 else 3)), p.cx
        if d == 0:
            return AIR_N
        if d == 2:
            return AIR_HI
        if d == 3:
            return AIR_LW
        return AIR_F if fx * p.facing > 0 else AIR_B
    if buttons & BTN_B:
        return p.specials[4 + _stick_dir(sx, sy)]
    if buttons & _JUMP and p.jumps > 0:
        return JUMP_AERIAL_B if sx * p.facing < -0.3 else JUMP_AERIAL_F
    if buttons & _SHIELD:
        return ESCAPE_AIR
    if a in (JUMP_F, JUMP_B) and p.vy <= 0.0:
        return FALL
    if a in (JUMP_AERIAL_F, JUMP_AERIAL_B) and p.vy <= 0.0:
        return FALL_AERIAL
    if a in _FREE_AIR:
        return -1
    return FALL


def _decide(p: _Player, o: _Player, hit: bool) -> int:
    """p's action at the next frame, from both players' state and inputs at this frame (-1: unchanged).

    A hit by the opponent is marked in p.hit_by and resolved when applied."""
    p.hit_by = -1
    a, age = p.act, p.age
    if hit:
        p.hit_by = o.act
        return -5
    # held by the opponent
    if a in _CAPTIVE:
        oa = o.act
        if oa in _THROWS and o.age == 0:
            return THROWN_F + (oa - THROW_F)
        if oa not in _HOLDING:
            return CAPTURE_CUT
        if a != CAPTURE_WAIT_HI and age >= p.dur - 1:
            return CAPTURE_WAIT_HI
        return -1
    if a in _THROWN:
        if age >= p.dur - 1:
            return DAMAGE_FALL
        return -1
    if a in _HOLDING and a not in _THROWS and o.act not in _CAPTIVE and o.act not in _THROWN and age >= 1:
        return CATCH_CUT  # the opponent is no longer held
    # landing (lands at the next frame: y + speed_y + speed_attack_y <= 0)
    if not p.ground and p.hitlag == 0 and p.y + p.vy + p.kby <= 0.0 and a not in _DEAD:
        if a in _AERIALS:
            return LANDING_AIR_N + (a - AIR_N)
        if a in _FLY or a == DAMAGE_FALL:
            return (PASSIVE_STAND_F if p.sx * p.facing > 0.5 else PASSIVE) if p.lc <= 7 else DOWN_BOUND_U
        if a == SHIELD_BREAK_FLY:
            return SHIELD_BREAK_DOWN_U
        if a in (FALL_SPECIAL, ESCAPE_AIR) or a >= SPECIAL_BASE:
            return LANDING_SPECIAL
        return LANDING
    dur = p.dur
    ended = dur > 0 and age >= dur - 1
    if dur > 0 and not ended:
        return -1
    if ended:
        f = FOLLOW.get(a)
        if f is not None:
            if f >= 0:
                return f
            if f == -2:  # end of jump squat: full hop if the jump button is still held
                return JUMP_B if p.sx * p.facing < -0.3 else JUMP_F
            if f == -3:  # end of the initial dash
                if abs(p.sx) >= 0.8:
                    return RUN if p.sx * p.facing > 0 else DASH
                return WAIT
            if f == -4:  # shield: stays up while held
                return GUARD if p.held & _SHIELD else GUARD_OFF
        if a in _DAMAGE:
            return WAIT if p.ground else DAMAGE_FALL
        if a in _THROWS:
            return WAIT
        if a >= SPECIAL_BASE and p.special_kind in (2, 6) and not p.ground:
            return FALL_SPECIAL
    # actionable: the inputs decide; at the end of a locked action held buttons count (buffering)
    buttons = p.held if ended else p.edge
    if a == DOWN_WAIT_U:
        if buttons & BTN_A:
            return DOWN_ATTACK_U
        if abs(p.sx) > 0.5:
            return DOWN_FOWARD_U if p.sx * p.facing > 0 else DOWN_BACK_U
        if buttons or abs(p.sy) > 0.5 or age >= 60:
            return DOWN_STAND_U
        return -1
    if a == REBIRTH_WAIT:
        if buttons or abs(p.sx) > 0.5 or abs(p.sy) > 0.5 or age >= 150:
            return FALL
        return -1
    nxt = _ground_choice(p, buttons) if p.ground else _air_choice(p, buttons)
    if nxt == a and dur == 0:
        return -1
    return nxt


def _enter(p: _Player, o: _Player, new: int) -> None:
    """Start action `new` at this frame: entry effects on velocities, facing, counters."""
    prev = p.act
    p.act, p.age, p.hit_done = new, 0, False
    p.dur = DUR[new]
    if prev in _AERIALS or prev in (
        LANDING_AIR_N,
        LANDING_AIR_N + 1,
        LANDING_AIR_N + 2,
        LANDING_AIR_N + 3,
        LANDING_AIR_N + 4,
    ):
        if not (LANDING_AIR_N <= new <= LANDING_AIR_N + 4):
            p.l_cancel = 0
    if new == DASH or new == TURN or new == TURN_RUN:
        if new == DASH:
            p.facing = 1 if p.sx >= 0 else -1
        else:
            p.facing = -p.facing
    elif new == KNEE_BEND:
        p.dur = p.squat  # jump squat length is per character
    elif new in (JUMP_F, JUMP_B):
        full = p.held & _JUMP
        p.vy = p.jump if full else p.jump * 0.62
        p.vax = p.vgx
        p.vgx = 0.0
        p.ground = False
        p.jumps = p.jumps_max - 1
    elif new in (JUMP_AERIAL_F, JUMP_AERIAL_B):
        p.vy = p.jump * 0.95
        p.vax = p.sx * p.air
        p.jumps -= 1
        if new == JUMP_AERIAL_B:
            p.facing = -p.facing
    elif LANDING_AIR_N <= new <= LANDING_AIR_N + 4:
        ok = p.lc <= 7
        p.l_cancel = 1 if ok else 2
        lag = p.land[new - LANDING_AIR_N]
        p.dur = lag // 2 if ok else lag
    elif new == ESCAPE_AIR:
        p.vax, p.vy = p.sx * 2.6, p.sy * 2.6
    elif new >= SPECIAL_BASE:
        try:
            p.special_kind = p.specials.index(new)
        except ValueError:  # a random transition into another character's special
            p.special_kind = -1
        if p.special_kind in (2, 6):  # up special: a rising recovery move
            p.vy = p.jump * 1.1
            p.ground = False
    elif new == REBIRTH:
        p.x, p.y = (-20.0 if o.x > 0 else 20.0), 60.0
        p.vax = p.vy = p.vgx = p.kbx = p.kby = 0.0
        p.percent, p.ground, p.shield = 0.0, False, 60.0
        p.inv = 1
    elif new == FALL and prev == REBIRTH_WAIT:
        p.inv = 120
    if new in _HOLDING or new in _CAPTIVE:
        p.vgx = p.vax = 0.0


def _hit(d: _Player, a: _Player, atk: int) -> None:
    """d is hit by a's attack `atk` at this frame (a's state is still this frame's)."""
    dmg = DMG[atk]
    a.hit_done = True
    if atk in _GRABS:
        _enter(d, a, CAPTURE_PULLED_HI)
        if a.next != -5:  # a grab that trades with a hit fails (the victim is let go next frame)
            a.next = CATCH_DASH_PULL if atk == CATCH_DASH else CATCH_PULL
        d.facing = -a.facing
        return
    if atk == CATCH_ATTACK:
        d.percent = min(d.percent + dmg, 999.0)
        _enter(d, a, CAPTURE_DAMAGE_HI)
        a.combo += 1
        a.last_atk = ATK_ID[atk]
        return
    lag = min(3 + int(dmg / 3), 20)
    a.hitlag = lag
    # specials are coded 18..21 (neutral, side, up, down) like the other attacks' fixed codes
    a.last_atk = ATK_ID[atk] if atk < SPECIAL_BASE else 18 + max(a.special_kind, 0) % 4
    if d.act in _GUARDING:  # shield hit
        d.shield -= dmg * 0.8
        d.hitlag = lag
        d.kbx = 0.05 * dmg * (1.0 if d.x >= a.x else -1.0)
        if d.shield <= 0.0:
            _enter(d, a, SHIELD_BREAK_FLY)
            d.shield, d.kby, d.ground = 30.0, 2.0, False
        else:
            _enter(d, a, GUARD_SET_OFF)
            d.dur = int(dmg / 2) + 3
        return
    a.combo += 1
    d.percent = min(d.percent + dmg, 999.0)
    kb = (BASE_KB[atk] + GROWTH[atk] * d.percent) * d.weight
    ang = math.radians(ANGLE[atk])
    # directional attacks and throws launch along the attacker's facing (the angle says forward or
    # back), the others away from the attacker
    side = a.facing if HIT_DIR[atk] != 0 or atk in _THROWS else (1 if d.x >= a.x else -1)
    if kb >= KILL_KB and d.stocks > 1:
        d.stocks -= 1
        up = ANGLE[atk] > 60
        _enter(d, a, DEAD_UP if up else (DEAD_RIGHT if side * math.cos(ang) > 0 else DEAD_LEFT))
        d.vax = d.vy = d.vgx = d.kbx = d.kby = 0.0
        d.hitlag = lag
        return
    kb = min(kb, KILL_KB - 1.0)
    speed = kb * 0.03
    d.kbx = speed * math.cos(ang) * side
    d.kby = speed * math.sin(ang)
    d.vax = d.vy = d.vgx = 0.0
    d.hitlag = lag
    deg = ANGLE[atk]
    if kb >= 80.0:
        if kb >= 120.0:
            new = DAMAGE_FLY_ROLL
        elif deg > 80:
            new = DAMAGE_FLY_TOP
        elif deg > 55:
            new = DAMAGE_FLY_HI
        elif deg < 20:
            new = DAMAGE_FLY_LW
        else:
            new = DAMAGE_FLY_N
        if d.kby <= 0.0:
            d.kby = 0.5
    else:
        level = 0 if kb < 25 else (1 if kb < 50 else 2)
        if not d.ground or d.kby > 1.0:
            new = DAMAGE_AIR_1 + level
        elif deg > 60:
            new = DAMAGE_HI_1 + level
        elif deg < 25:
            new = DAMAGE_LW_1 + level
        else:
            new = DAMAGE_N_1 + level
    _enter(d, a, new)
    d.dur = max(6, int(kb * 0.4))
    if d.ground:  # launched, or (weak hits) pushed along the ground
        if d.kby > (0.0 if new in _FLY else 1.0):
            d.ground = False
        else:
            d.kby = 0.0


def _move(p: _Player, edge: float) -> None:
    """Advance the position by this frame's velocities (before the next action's entry effects)."""
    if p.hitlag > 0:
        return
    if p.ground:
        p.x += p.vgx + p.kbx
    else:
        p.x += p.vax + p.kbx
        p.y += p.vy + p.kby
        if p.y <= 0.0:
            p.y, p.vy, p.kby, p.ground = 0.0, 0.0, 0.0, True
            p.vgx, p.vax = p.vax * 0.5, 0.0
            p.jumps = p.jumps_max
    if p.x > edge:
        p.x, p.vgx, p.vax, p.kbx = edge, 0.0, 0.0, 0.0
    elif p.x < -edge:
        p.x, p.vgx, p.vax, p.kbx = -edge, 0.0, 0.0, 0.0
    if p.y > 250.0:
        p.y, p.kby = 250.0, 0.0


def _velocities(p: _Player) -> None:
    """This frame's velocities, from the action and the stick (used to move to the next frame)."""
    if p.hitlag > 0:
        p.hitlag -= 1
        return
    a = p.act
    if a in _DEAD or a in _CAPTIVE or a in _THROWN:
        p.vax = p.vy = p.vgx = p.kbx = p.kby = 0.0
        return
    if p.ground:
        if a in _WALKS:
            p.vgx = p.sx * p.walk
        elif a == DASH:
            p.vgx = p.facing * p.run * 1.1
        elif a == RUN:
            p.vgx = p.facing * p.run
        elif a in (ESCAPE_F, PASSIVE_STAND_F, DOWN_FOWARD_U):
            p.vgx = p.facing * 1.6 if p.age < 22 else 0.0
        elif a in (ESCAPE_B, PASSIVE_STAND_B, DOWN_BACK_U):
            p.vgx = -p.facing * 1.6 if p.age < 22 else 0.0
        else:
            v = p.vgx * 0.8
            p.vgx = v if abs(v) > 0.02 else 0.0
        p.vax = p.vy = 0.0
    else:
        if a in _DRIFT:
            p.vax += (p.sx * p.air - p.vax) * 0.12
        vy = p.vy - p.grav
        if vy < -p.fall:
            vy = -p.fall
        if vy < 0.0 and p.sy < -0.8 and (a in _FREE_AIR or a in _AERIALS):
            vy = -p.fall * 1.4
        p.vy = vy
    kbx, kby = p.kbx * 0.94, p.kby * 0.94
    p.kbx = kbx if abs(kbx) > 0.02 else 0.0
    p.kby = kby if abs(kby) > 0.02 else 0.0
    if p.ground:
        p.kby = 0.0
        if p.shield < 60.0 and a not in _GUARDING:
            p.shield = min(60.0, p.shield + 0.07)
    if a == GUARD:
        p.shield -= 0.14
        if p.shield <= 0.0:
            p.shield = 0.0


def _record(p: _Player) -> None:
    a, age = p.act, p.age
    if a in _DEAD or p.inv > 0:
        hurt = 1
    else:
        span = INTANGIBLE[a]
        hurt = 2 if span is not None and span[0] <= age <= span[1] else 0
    p.rows.append(
        (
            p.x,
            p.y,
            p.percent,
            p.shield,
            p.vax,
            p.vy,
            p.vgx,
            p.kbx,
            p.kby,
            age,
            p.hitlag,
            p.stocks,
            p.combo,
            p.facing > 0,
            hurt != 0,
            p.ground,
            a,
            p.jumps,
            p.char,
            p.l_cancel,
            hurt,
            p.last_atk,
            p.sx,
            p.sy,
            p.cx,
            p.cy,
            p.trig,
            p.held,
        )
    )


def simulate_game(seed: int, index: int, frames: int) -> pa.Table:
    """Simulate game `index` of the demo dataset drawn with `seed`: one row per frame."""
    if frames < 1:
        raise ValueError(f"frames must be at least 1, got {frames}")
    rng = np.random.default_rng([int(seed), int(index)])
    stage_i = int(rng.choice(len(_STAGE_NAMES), p=_STAGE_P))
    edge = STAGES[_STAGE_NAMES[stage_i]]
    season = int(rng.integers(2021, 2025))
    chars = rng.choice(33, 2, p=_CHAR_P)
    p1 = _new_player(rng, int(chars[0]), -edge * 0.5, 1, frames)
    p2 = _new_player(rng, int(chars[1]), edge * 0.5, -1, frames)
    players = (p1, p2)
    for t in range(frames):
        _inputs(p1, p2, t)
        _inputs(p2, p1, t)
        _record(p1)
        _record(p2)
        if t == frames - 1:
            break
        # both decisions read the state at t only
        h21 = _connects(p2, p1)
        h12 = _connects(p1, p2)
        p1.next = _decide(p1, p2, h21)
        p2.next = _decide(p2, p1, h12)
        _move(p1, edge)
        _move(p2, edge)
        hits = [(p, o) for p, o in ((p1, p2), (p2, p1)) if p.next == -5]
        for p, o in hits:
            _hit(p, o, p.hit_by)
        for p, o in ((p1, p2), (p2, p1)):
            n = p.next
            if n == -5:
                continue
            if n >= 0 and p.act not in _NO_NOISE and n not in _NO_NOISE and p.r_noise[t] < NOISE_RATE:
                n = p.r_noise_act[t]
            if n >= 0:
                _enter(p, o, n)
            else:
                p.age += 1
            if p.act not in _STUNNED and o.combo:
                o.combo = 0
            if p.inv > 1:
                p.inv -= 1
            elif p.inv == 1 and p.act not in _DEAD:
                p.inv = 0
        for p in players:
            _velocities(p)
        for p, o in ((p1, p2), (p2, p1)):  # a held player moves with the one holding it
            if p.act in _CAPTIVE or p.act in _THROWN:
                p.x, p.y, p.ground = min(edge, max(-edge, o.x + o.facing * 8.0)), o.y, o.ground
                p.facing = -o.facing
    return _to_table(p1, p2, index, stage_i, season, frames, edge)


def _to_table(p1: _Player, p2: _Player, index: int, stage_i: int, season: int, frames: int, edge: float) -> pa.Table:
    cols: dict[str, pa.Array] = {
        "game_id": pa.array([f"g{index:05d}"] * frames, pa.string()),
        "frame": pa.array(np.arange(frames, dtype=np.int32)),
        "stage": pa.array([_STAGE_NAMES[stage_i]] * frames, pa.string()),
        "season": pa.array(np.full(frames, season, dtype=np.int16)),
    }
    for name, p in zip(PLAYERS, (p1, p2)):
        m = np.array(p.rows, dtype=np.float64)
        fields = iter(m.T)  # the columns of _record's rows, in order
        for f in _CONT_FIELDS:
            cols[f"{name}_{f}"] = pa.array(next(fields).astype(np.float32))
        for f in _BOOL_FIELDS:
            cols[f"{name}_{f}"] = pa.array(next(fields) != 0)
        # ground (not recorded): 0 in the air, else which stretch of the stage the player stands on
        on_ground = m[:, len(_CONT_FIELDS) + 2] != 0
        stretch = np.clip(((m[:, 0] + edge) / (2 * edge) * 5).astype(np.int64), 0, 4)
        ground = np.where(on_ground, 1 + (stage_i * 5 + stretch) % 31, 0)
        for f, (_, typ) in _CAT_FIELDS.items():
            cols[f"{name}_{f}"] = pa.array((ground if f == "ground" else next(fields)).astype(typ.to_pandas_dtype()))
        for f in _ANALOG:
            cols[f"{name}_{f}"] = pa.array(np.round(next(fields), 4).astype(np.float32))
        held = next(fields).astype(np.int64)
        for b, f in enumerate(_BUTTONS):
            cols[f"{name}_btn_{f}"] = pa.array((held >> b) & 1 != 0)
    return pa.table(cols)


def write_game(table: pa.Table, path: Path) -> None:
    """Write a game's table to `path` whole: aside, then renamed (nothing half-written is ever there)."""
    tmp = path.with_name(f".tmp-{uuid.uuid4().hex}-{path.name}")
    try:
        pq.write_table(
            table,
            tmp,
            compression="zstd",
            compression_level=3,
            row_group_size=max(1, table.num_rows),
            use_dictionary=True,
            write_statistics=True,
            store_schema=True,
        )
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def generate_demo(out_dir: str | Path, n_games: int = 40, frames: int = 2000, seed: int = 0) -> list[Path]:
    """Write one parquet file per game (game-00000.parquet, ...) into out_dir; return their paths (sorted).

    Game i depends only on (seed, i): generating more games adds files without changing the others.
    Each file is written to a temporary name in out_dir and renamed into place."""
    if n_games < 0:
        raise ValueError(f"n_games must be >= 0, got {n_games}")
    if frames < 1:
        raise ValueError(f"frames must be >= 1, got {frames}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n_games):
        path = out / f"game-{i:05d}.parquet"
        write_game(simulate_game(seed, i, frames), path)
        paths.append(path)
    return sorted(paths)


def _main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Write the seeded demo replay dataset (one parquet file per game).")
    ap.add_argument("out_dir")
    ap.add_argument("--games", type=int, default=40)
    ap.add_argument("--frames", type=int, default=2000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    paths = generate_demo(args.out_dir, args.games, args.frames, args.seed)
    print(f"wrote {len(paths)} files to {args.out_dir} in {time.perf_counter() - t0:.1f}s")


if __name__ == "__main__":
    _main()
