"""Shardline's settings from the environment: every `SHARDLINE_*` variable the package reads, in one typed table,
read here and nowhere else. The pipeline's own settings are the config file's (shardline/core/config/); these
are a machine's or a process's: where its cache lives, how often it reports, what a test or a rehearsal injects.

Each is read when asked for (a worker's job variables or a test may set it between calls). A value that is not of
its kind is an error naming the variable, what it takes and its default. docs/config.md lists the table
(tests/test_settings.py checks that the list there is this one). The scripts' own variables
(SHARDLINE_TORCH_INDEX for ./scripts/setup, SHARDLINE_GPU_* for scripts/gpu-kit-run) are documented in them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Setting:
    name: str
    kind: str  # seconds, MB, GB (numbers); step, pid, rows (whole numbers); path, text
    default: float | str | None
    meaning: str
    zero: str = ""  # what 0 means, for a number that takes it
    least: float = 0.0  # the smallest number it takes
    positive: bool = False  # a number that must be more than 0


SETTINGS: dict[str, Setting] = {
    s.name: s
    for s in (
        Setting(
            "SHARDLINE_CACHE",
            "path",
            "~/.cache/shardline",
            "where this machine unpacks shards and keeps what it fetched (a local disk, not a network mount)",
        ),
        Setting(
            "SHARDLINE_CACHE_MAX_GB",
            "GB",
            None,
            "the most that cache holds (unset: half the free disk where it lives, plus what it holds)",
            positive=True,
        ),
        Setting(
            "SHARDLINE_STORE_READ_SECONDS",
            "seconds",
            20,
            "how long an object store's request waits for its answer (botocore's read timeout) before it is tried "
            "again; a store that takes the connection and never answers fails after AWS_MAX_ATTEMPTS x 2 of these",
            positive=True,
        ),
        Setting(
            "SHARDLINE_RESIDENT_MB",
            "MB",
            128,
            "pages of memory-mapped split packs a process keeps mapped, counted in its RSS",
            zero="no bound: every page read stays mapped",
        ),
        Setting(
            "SHARDLINE_PREDICT_ROWS",
            "rows",
            200_000,
            "rows `shardline predict` takes at once where each file is a sequence (whole files: at least this many) "
            "or each row is predicted alone (a large file cut too)",
            positive=True,
        ),
        Setting("SHARDLINE_PROGRESS_SECONDS", "seconds", 5, "how often a training's Prefect live view changes"),
        Setting(
            "SHARDLINE_COST_LEDGER_SECONDS",
            "seconds",
            60,
            "how often a training's cost ledger records its progress between checkpoints",
        ),
        Setting(
            "SHARDLINE_SYSTEM_METRICS_SECONDS",
            "seconds",
            10,
            "how often CPU, memory and GPU use are sampled into the MLflow run",
            zero="no sampling",
        ),
        Setting(
            "SHARDLINE_MLFLOW_FLUSH_SECONDS",
            "seconds",
            30,
            "how long a run's end waits for MLflow to take what is left (the rest waits in the journal for "
            "`shardline sync`)",
        ),
        Setting(
            "SHARDLINE_LEASE_TTL",
            "seconds",
            90,
            "how long a run folder's lease lasts unrenewed (its holder renews it every third of that)",
            least=3,
        ),
        Setting("SHARDLINE_PRICES", "path", None, "your prices file, laid over the shipped table of GPU prices"),
        Setting(
            "SHARDLINE_GPU_TYPE",
            "text",
            None,
            "this machine's GPU type for the cost ledger, declared (a pool's job variables) instead of detected",
        ),
        Setting(
            "SHARDLINE_PREEMPT_AT_STEP",
            "step",
            0,
            "a training sends itself SIGTERM at this optimizer step, as a spot reclaim would (`shardline rehearse`)",
            zero="never",
        ),
        Setting(
            "SHARDLINE_PARENT_PID",
            "pid",
            None,
            "set by a local sweep for a trial's process: the trial stops at a checkpoint once that process is gone",
        ),
        Setting(
            "SHARDLINE_QUIET_ERRORS",
            "text",
            None,
            "set to 1 by a local sweep for a trial's process (unless `--verbose`): the trial's console says a "
            "preemption, a budget stop or an error in the config or data without a traceback, as the sweep does",
        ),
    )
}


def _raw(name: str) -> str | None:
    value = os.environ.get(SETTINGS[name].name)  # KeyError: a name that is not in the table
    return value if value is not None and value.strip() else None


def number(name: str) -> float | None:
    """Setting `name`, a number of its unit (its default when unset or empty); a value that is not a number it
    takes is an error naming the variable."""
    s, value = SETTINGS[name], _raw(name)
    if value is None:
        return None if s.default is None else float(s.default)
    whole = s.kind in ("step", "pid", "rows")
    example = f"e.g. {s.default:g}" if isinstance(s.default, (int, float)) and s.default else "e.g. 10"
    zero = f"; 0: {s.zero}" if s.zero else ""
    try:
        n = int(value) if whole else float(value)
    except ValueError:
        what = "a whole number" if whole else f"a number of {s.kind}"
        raise ValueError(f"{name}={value!r} is not {what}; set it to {example}{zero}, or unset it") from None
    if not n >= s.least or (s.positive and not n > 0):
        least = "more than 0" if s.positive else f"{s.least:g} or more"
        raise ValueError(f"{name}={value!r} must be {least} ({s.kind}){zero}")
    return float(n)


def text(name: str) -> str | None:
    """Setting `name` as it is set (its default when unset or empty)."""
    value = _raw(name)
    return value if value is not None else SETTINGS[name].default


def path(name: str) -> Path | None:
    """Setting `name`, a path (`~` expanded; its default when unset or empty)."""
    value = text(name)
    return Path(value).expanduser() if value is not None else None


def table() -> str:
    """The table in markdown, as docs/config.md has it."""
    rows = ["| variable | takes | default | what it sets |", "|---|---|---|---|"]
    for s in SETTINGS.values():
        default = "unset" if s.default is None else f"{s.default:g}" if isinstance(s.default, float) else s.default
        zero = f" (0: {s.zero})" if s.zero else ""
        rows.append(f"| `{s.name}` | {s.kind} | {default} | {s.meaning}{zero} |")
    return "\n".join(rows)
