"""The sweep's fork server, out of the reach of the terminal's Ctrl-C.

A local sweep forks each trial's process from multiprocessing's fork server (`TRIAL_PRELOAD` in
`shardline.tasks.sweep`), which imports this module first. In the terminal's foreground process group, a
Ctrl-C killed that server while it imported the training's modules, and any trial process while its flow
loaded, each with a traceback; the trial's step retried the broken start, and the trials started anew trained
to their end before the sweep exited. Imported there, this module moves the fork server into a process group of
its own, and with it every trial process it forks: Ctrl-C reaches the sweep alone, which stops starting and
retrying trials and passes the SIGINT on to the trials running (`interrupt_trials`). A trial process is born with
SIGINT kept for its training (`KeptSignal`, the handler the fork server gives each child it forks), which then
stops at a checkpoint: never a KeyboardInterrupt while the process loads.

Only the fork server does this: the module does it while `multiprocessing.forkserver.main` imports it. Imported
anywhere else (the sweep's own process, which must stay in the terminal's group), it does nothing.
"""

from __future__ import annotations

import os
import signal
import sys


def _imported_by_the_fork_server() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "main" and frame.f_globals.get("__name__") == "multiprocessing.forkserver":
            return True
        frame = frame.f_back
    return False


if hasattr(os, "setpgid") and _imported_by_the_fork_server():
    from shardline.trainer.stops import KeptSignal

    os.setpgid(0, 0)
    signal.signal(signal.SIGINT, KeptSignal())
