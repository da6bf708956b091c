"""What the terminal shows of Prefect's records: the errors a command says itself, once, without tracebacks."""

from __future__ import annotations

import contextlib


@contextlib.contextmanager
def quiet_console(verbose: bool):
    """Prefect's console records of the errors a command says itself (`QuietUserErrors`) dropped, unless
    `verbose`."""
    import prefect.main  # noqa: F401 - Prefect's logging set up (its console handler), as importing a flow does

    from shardline.core.failures import QuietUserErrors, console_handlers

    handlers = console_handlers()
    quiet = QuietUserErrors()
    try:
        for h in [] if verbose else handlers:
            h.addFilter(quiet)
        yield
    finally:
        for h in handlers:
            h.removeFilter(quiet)


def unwrapped_help(app) -> None:
    """Each command's `--help` from its docstring with the lines of each paragraph joined: Typer keeps a docstring's
    line breaks after its first paragraph, and the terminal's wrapping then broke every source line a second time."""
    import inspect

    for command in app.registered_commands:
        if command.help is None:
            doc = inspect.getdoc(command.callback) or ""
            command.help = "\n\n".join(" ".join(p.split("\n")) for p in doc.split("\n\n"))
