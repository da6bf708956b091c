"""Prefect's ephemeral API, out of the reach of the terminal's Ctrl-C.

Without `PREFECT_API_URL`, Prefect starts a temporary API server (uvicorn) as a child process the first
time a flow runs. That child is in the terminal's foreground process group, so Ctrl-C sends it SIGINT
too: it stops at once, and the training that was checkpointing on the same SIGINT then reports its
flow runs' final states to a dead address, each report retried with back-off (seen: `shardline run`
still waiting more than a minute after the SIGINT, its server a zombie). With a Prefect server the
same Ctrl-C stops in about five seconds.

`start_ephemeral_api` starts that server before any flow, with Prefect's own class, in a session of its
own (Ctrl-C reaches only the command's processes) and tied to this process's life on Linux
(PR_SET_PDEATHSIG: if the command dies without a word, the server gets SIGTERM). Prefect's code finds
this instance (its ephemeral server is one per port; port None is the one it asks for), and stops it
at exit as it would its own.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

DATABASE_SETTINGS = ("PREFECT_HOME", "PREFECT_API_DATABASE_CONNECTION_URL", "PREFECT_SERVER_DATABASE_CONNECTION_URL")


def own_database() -> None:
    """Where no Prefect home or database is chosen, the ephemeral API keeps its runs in a database of Shardline's
    for this Prefect version (`<SHARDLINE_CACHE>/prefect/<version>/prefect.db`), not in ~/.prefect/prefect.db: a
    newer Prefect of another environment on this machine migrates that one, after which every local run of an
    older one failed after two minutes on the ephemeral server's timeout."""
    if any(os.environ.get(name) for name in DATABASE_SETTINGS):
        return
    from importlib.metadata import version  # not `import prefect`: a second of start-up for every command

    from shardline.core.storage import cache_dir

    database = cache_dir() / "prefect" / version("prefect") / "prefect.db"
    database.parent.mkdir(parents=True, exist_ok=True)
    # the server's process reads it when it starts
    os.environ["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = f"sqlite+aiosqlite:///{database}"


def start_ephemeral_api() -> None:
    """Start Prefect's ephemeral API server now, in its own session, when no `PREFECT_API_URL` is set. Call it
    from the main thread: the server's life is tied to the thread that starts it."""
    from prefect.settings import PREFECT_API_URL

    if PREFECT_API_URL.value():
        return
    own_database()
    from prefect.server.api.server import SubprocessASGIServer

    from shardline.core.parent_watch import signal_on_parent_death

    class DetachedServer(SubprocessASGIServer):
        def _run_uvicorn_command(self) -> subprocess.Popen:
            popen = subprocess.Popen
            extra = {"start_new_session": True}
            if sys.platform.startswith("linux"):  # SIGTERM when the thread that starts it exits
                parent = os.getpid()
                extra["preexec_fn"] = lambda: signal_on_parent_death(signal.SIGTERM, parent)

            def detached(*args, **kwargs):
                return popen(*args, **{**kwargs, **extra})

            subprocess.Popen = detached  # for Prefect's own command line, in this one call
            try:
                return super()._run_uvicorn_command()
            finally:
                subprocess.Popen = popen

    server = SubprocessASGIServer._instances.get(None)
    if server is None:
        server = DetachedServer()  # registered as the instance Prefect's client asks for
    server.start()
