"""What the terminal shows of Prefect's records: the errors a command says itself, once, without tracebacks."""

from __future__ import annotations

import contextlib
import logging

# a mistake in the config or the data, and a stop that is no fault (a preemption, the budget spent)
QUIET_ERRORS = ("DataError", "ConfigError", "ModelContractError", "EncodingMismatch", "ValueError", "Preempted")
QUIET_ERRORS += ("BudgetExceeded",)


class _QuietUserErrors(logging.Filter):
    """On the terminal, a mistake in the config or the data, or a preemption's or a budget's stop, is said once,
    by the command's `error:` line, without a traceback: Prefect's own records of it (the task's failed state,
    the flow's exception) are dropped from the console. The Prefect API still gets them, and `--verbose` keeps
    them here."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.INFO:
            return True
        if record.exc_info and record.exc_info[1] is not None:
            return type(record.exc_info[1]).__name__ not in QUIET_ERRORS
        text = record.getMessage()
        return not any(
            f"exception {name}" in text or f"exception: {name}" in text or f"{name}(" in text for name in QUIET_ERRORS
        )


@contextlib.contextmanager
def quiet_console(verbose: bool):
    """Prefect's console records of the errors a command says itself (`_QuietUserErrors`) dropped, unless
    `verbose`."""
    import prefect.main  # noqa: F401 - Prefect's logging set up (its console handler), as importing a flow does

    handlers = [
        h
        for name in ("", "prefect", "prefect.flow_runs", "prefect.task_runs")
        for h in logging.getLogger(name).handlers
        if type(h).__name__ == "PrefectConsoleHandler"
    ]
    quiet = _QuietUserErrors()
    try:
        for h in [] if verbose else handlers:
            h.addFilter(quiet)
        yield
    finally:
        for h in handlers:
            h.removeFilter(quiet)
