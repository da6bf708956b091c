"""What the terminal shows of Prefect's records: the errors a command says itself, once, without tracebacks."""

from __future__ import annotations

import contextlib

from shardline.core.failures import QuietUserErrors, console_handlers


@contextlib.contextmanager
def quiet_console(verbose: bool):
    """Prefect's console records of the errors a command says itself (`QuietUserErrors`) dropped, unless
    `verbose`."""
    import prefect.main  # noqa: F401 - Prefect's logging set up (its console handler), as importing a flow does

    handlers = console_handlers()
    quiet = QuietUserErrors()
    try:
        for h in [] if verbose else handlers:
            h.addFilter(quiet)
        yield
    finally:
        for h in handlers:
            h.removeFilter(quiet)
