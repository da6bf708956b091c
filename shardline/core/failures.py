"""Failures and their classification, in one place: which are the infrastructure's (retried: the retry resumes
from the newest checkpoint) and which are errors in the code, the config or the data (not retried), by type,
never by the text of a message; the stops that are not failures (a preemption, a spent budget); and what a
Prefect state says of them (a retry condition, a dispatched run's end)."""

from __future__ import annotations

import logging

from shardline.core.storage import CacheFull, ChecksumMismatch

# errors of the machine or the network, worth a retry that resumes from the newest checkpoint, by type
# (never by the text of a message): I/O and network failures, a lost GPU or interconnect
INFRASTRUCTURE_ERRORS = (ConnectionError, TimeoutError, OSError)
# ...but not these: a missing or unreadable input is the same on the next try, as is running out of
# memory with the same batch on the same machine (deterministic), a local shard cache capped below what
# the run holds at once (CacheFull: only this process's pins keep shards in it, so it fails again the
# same way; its message names SHARDLINE_CACHE_MAX_GB and the size), or a code, config or data error
NOT_INFRASTRUCTURE = (
    CacheFull,
    ChecksumMismatch,
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    MemoryError,
    ValueError,
    TypeError,
    KeyError,
    IndexError,
    AssertionError,
    NotImplementedError,
)


# torch's own types for a GPU or interconnect failure (not its out-of-memory: deterministic), by name: classifying
# an error never imports torch. AcceleratorError is torch 2.8's: before it, a CUDA fault is a plain
# RuntimeError, which is not told from a code error (not retried there)
TORCH_INFRASTRUCTURE = ("AcceleratorError", "DistBackendError", "DistNetworkError", "DistStoreError")


def infrastructure_by_names(bases: list[str]) -> bool:
    """The rule, on an error's class's and bases' names (this process's, or another's, written down: a training
    rank's): an I/O, network, GPU or interconnect error (or an InfrastructureFailure) that is none of
    NOT_INFRASTRUCTURE nor an out-of-memory."""
    names = set(bases)
    infra = {t.__name__ for t in INFRASTRUCTURE_ERRORS} | {*TORCH_INFRASTRUCTURE, "InfrastructureFailure"}
    never = {t.__name__ for t in NOT_INFRASTRUCTURE} | {"OutOfMemoryError"}
    return bool(names & infra) and not names & never


PREEMPTED_EXIT_CODE = 75  # EX_TEMPFAIL: what a script exits with on `Preempted`; "run me again to resume"
BUDGET_EXIT_CODE = 76  # what a script exits with on `BudgetExceeded`: "raise the limit and run me again to resume"


class Preempted(Exception):
    """Training stopped on SIGTERM/SIGINT after saving `checkpoint`; call `fit` again to resume."""

    def __init__(self, checkpoint: str, signal_name: str):
        super().__init__(f"training stopped by {signal_name}; checkpoint saved at {checkpoint}: run again to resume")
        self.checkpoint = checkpoint
        self.signal_name = signal_name


class BudgetExceeded(Exception):
    """Training stopped at its budget (training.max_cost or max_hours) after saving `checkpoint`; raise the
    limit and call `fit` again to resume. Not a preemption: nothing is dispatched or retried again."""

    def __init__(self, message: str, checkpoint: str | None = None):
        super().__init__(message)
        self.checkpoint = checkpoint


class InfrastructureFailure(RuntimeError):
    """A training run stopped by a failure of its machine, its storage or network, or a lost peer (a node of a
    training on several): the error that did is its cause and in its message. Retried like that error
    (`training.max_restarts`); a dispatched run that failed so is dispatched again, and resumes from its
    newest checkpoint."""


def was_preempted(state) -> bool:
    """Crashed (infrastructure gone), or stopped by SIGTERM/SIGINT after its checkpoint
    (shardline.trainer.loop.Preempted)."""
    return state.is_crashed() or (state.is_failed() and "Preempted" in (state.message or ""))


def failed_on_infrastructure(state) -> bool:
    """Failed on an infrastructure error (the training flow says so by raising `InfrastructureFailure`)."""
    return state.is_failed() and "InfrastructureFailure" in (state.message or "")


def is_infrastructure_failure(exc: BaseException) -> bool:
    """True for failures of the infrastructure (retry and resume), False for a real error in the code,
    the config or the data (fail at once with its message). By exception type only: its class's and bases'
    names, as a training rank's error is classified (`infrastructure_by_names`)."""
    if isinstance(exc, Preempted | BudgetExceeded):  # asked to stop, or out of budget: stopping is the answer
        return False
    if out_of_space(exc):  # a full disk stays full: each retry trained again to the same write, and failed there
        return False
    return infrastructure_by_names([c.__name__ for c in type(exc).__mro__])


def retry_on_infrastructure(task, task_run, state) -> bool:
    try:
        state.result()
    except BaseException as e:  # noqa: BLE001 - classifying, not swallowing
        return is_infrastructure_failure(e)
    return False


def raised_in_your_code(e: BaseException) -> str:
    """' (ValueError raised at FILE:LINE, ...)' where the innermost frame of the error's traceback outside the
    installed packages (torch's, say) is the user's own code (a model's constructor or loss), not Shardline's;
    else ''. Shardline's messages say what to do; one from the user's code says nothing of where it came from."""
    import sysconfig
    from pathlib import Path

    ours = str(Path(__file__).resolve().parents[1])
    installed = tuple({sysconfig.get_paths()[k] for k in ("purelib", "platlib", "stdlib")})
    frames, tb = [], e.__traceback__
    while tb is not None:
        frames.append((str(Path(tb.tb_frame.f_code.co_filename).resolve()), tb.tb_lineno))
        tb = tb.tb_next
    name, line = next(((n, i) for n, i in reversed(frames) if not n.startswith(installed)), (ours, 0))
    if name.startswith(ours) or name.startswith("<"):
        return ""
    return f" ({type(e).__name__} raised at {name}:{line}; --verbose shows the traceback)"


def out_of_space(e: BaseException) -> str:
    """What to do when `e`, or an error it was raised from, is a full disk (ENOSPC): the file it could not write
    (a copy's or a rename's destination first) and the free space of its disk; else ''."""
    import errno
    import shutil
    from pathlib import Path

    full, path, seen = None, None, set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            full, path = full or e, path or e.filename2 or e.filename
        e = e.__cause__ or e.__context__
    if full is None:
        return ""
    disk = next((p for p in Path(str(path)).parents if p.exists()), None) if path else None
    free = f" ({shutil.disk_usage(disk).free / 1e6:,.1f} MB free)" if disk else ""
    where = f" of {path}" if path else ""
    return (
        f"no space left on the disk{where}{free}: free some (`shardline gc CONFIG` deletes the data sets, runs and "
        "cached results nothing refers to) or give it more room; every write is put aside, then renamed, so what was "
        "written before is whole: run the same command again to go on"
    )


# a mistake in the config or the data, and a stop that is no fault (a preemption, the budget spent)
QUIET_ERRORS = ("DataError", "ConfigError", "ModelContractError", "EncodingMismatch", "ValueError", "Preempted")
# ...and a store or a tracking server that answers no connection, said naming it and its setting
QUIET_ERRORS += ("BudgetExceeded", "StorageUnreachable", "StorageRefused", "TrackingUnreachable", "SweepFailed")


class QuietUserErrors(logging.Filter):
    """On the terminal, a mistake in the config or the data (or an error raised in the user's own model code,
    `raised_in_your_code`), or a preemption's or a budget's stop, is said once,
    by the command's `error:` line, without a traceback: Prefect's own records of it (the task's failed state,
    the flow's exception) are dropped from the console. The Prefect API still gets them, and `--verbose` keeps
    them here."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.INFO:
            return True
        if record.exc_info and record.exc_info[1] is not None:
            error = record.exc_info[1]
            return type(error).__name__ not in QUIET_ERRORS and not raised_in_your_code(error)
        text = record.getMessage()
        if " - Retry " in text:  # an infrastructure error retried (a store away): the wait is said, one line
            return True
        return not any(
            f"exception {name}" in text or f"exception: {name}" in text or f"{name}(" in text for name in QUIET_ERRORS
        )


def console_handlers() -> list[logging.Handler]:
    """Prefect's console handlers in this process (none before Prefect's logging is set up)."""
    return [
        h
        for name in ("", "prefect", "prefect.flow_runs", "prefect.task_runs")
        for h in logging.getLogger(name).handlers
        if type(h).__name__ == "PrefectConsoleHandler"
    ]


QUIET_ENV = "SHARDLINE_QUIET_ERRORS"  # "1": this process's console is quiet as its parent's (a sweep's trial)


def console_is_quiet() -> bool:
    return any(isinstance(f, QuietUserErrors) for h in console_handlers() for f in h.filters)


def quiet_as_parent() -> None:
    """A sweep's trial, started by a sweep whose console is quiet (`QUIET_ENV`): this process's console too."""
    from shardline.core.config import settings

    if settings.text(QUIET_ENV) == "1" and not console_is_quiet():
        for h in console_handlers():
            h.addFilter(QuietUserErrors())
