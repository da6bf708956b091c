"""A child process that must not outlive the process that started it.

A local sweep trains each trial in a child process. When the sweep is killed (SIGKILL, a lost terminal)
its children would train on unwatched, holding their run folders' leases, and a rerun would wait for
them. A child started with `SHARDLINE_PARENT_PID` in its environment watches that process instead (its parent,
or the process that started the fork server it was forked from): when it is gone, the child sends itself SIGTERM,
the spot notice training already answers (a checkpoint, the MLflow run marked KILLED, exit status 75), and the
rerun resumes it from that checkpoint.
"""

from __future__ import annotations

import ctypes  # here, not in the function: a `preexec_fn` runs it between a fork and an exec, where no import should
import logging
import os
import signal
import sys
import threading
import time

from shardline.core.config import settings

PARENT_ENV = "SHARDLINE_PARENT_PID"
POLL_SECONDS = 1.0
_gone = threading.Event()  # set once the watched process is gone

log = logging.getLogger("shardline.parent_watch")


def stop_when_parent_exits() -> bool:
    """Watch the process `SHARDLINE_PARENT_PID` names, when it started this one, directly or through
    multiprocessing's fork server (which lives on while the children it forked do); SIGTERM this process once
    that one has exited. False (nothing watched) without the variable or when another process started this (a
    process the child started in turn: a trial's torchrun ranks)."""
    value = settings.number(PARENT_ENV)
    if value is None or int(value) not in (os.getppid(), _parent_of(os.getppid())):
        return False
    import psutil

    try:
        parent = psutil.Process(int(value))  # once gone, or its pid taken by a new process: `is_running` is False
    except psutil.Error:
        return False

    def gone() -> bool:
        try:
            return not parent.is_running() or parent.status() == psutil.STATUS_ZOMBIE
        except psutil.Error:
            return True

    def watch() -> None:
        while not gone():
            time.sleep(POLL_SECONDS)
        log.warning("the process that started this one (pid %d) is gone: stopping at a checkpoint", parent.pid)
        _gone.set()
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="shardline-parent-watch", daemon=True).start()
    return True


def parent_gone() -> bool:
    """Whether the process this one watches (`stop_when_parent_exits`) is gone."""
    return _gone.is_set()


def exit_now(code: int) -> None:
    """End this process with `code` at once, its console's lines written out: where what it would do on its way
    out can no longer be done (a watched process's flow reporting to the Prefect API that went with its parent)."""
    for handler in logging.getLogger().handlers + logging.getLogger("shardline").handlers:
        handler.flush()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _parent_of(pid: int) -> int | None:
    import psutil

    try:
        return psutil.Process(pid).ppid()
    except psutil.Error:
        return None


def signal_on_parent_death(signum: int, parent: int | None = None) -> None:
    """On Linux: the kernel sends this process `signum` when its parent dies (PR_SET_PDEATHSIG); torchrun's agent
    gets SIGTERM when the training task dies, a rank SIGKILL when its agent does, Prefect's ephemeral API server
    SIGTERM when the command does. `parent`: the pid of the parent that started this one (a `preexec_fn`'s), which
    may have died before the call took effect: then this process exits at once. Elsewhere nothing is done."""
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signum)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if parent is not None and os.getppid() != parent:
        os._exit(1)
