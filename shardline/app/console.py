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


def interrupt(signum, frame) -> None:
    """Ctrl-C during a command: KeyboardInterrupt, as Python's own handler raises it, but never inside the import
    machinery itself. There (CPython 3.11, between `_imp.acquire_lock()` and the `try` that releases it) it left
    the global import lock held, and the next import of any other thread waited forever: Prefect's event loop
    thread, which the flow's crash handling then waited on, so the command hung instead of exiting 130. Raised
    again a moment later, once that import is through."""
    import os
    import threading

    if frame is not None and frame.f_code.co_filename.startswith("<frozen importlib"):
        threading.Timer(INTERRUPT_AGAIN, os.kill, (os.getpid(), signum)).start()
        return
    raise KeyboardInterrupt


INTERRUPT_AGAIN = 0.05  # seconds before a Ctrl-C that came inside an import is raised again
