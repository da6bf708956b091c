"""How a training stops before its last step: a signal (SIGTERM/SIGINT, a spot reclaim's notice), its budget (a
`Deadline`), or another process of the same run stopping; each saves a checkpoint first. Also the run's
deterministic kernels, set for the duration of a fit."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from shardline.core.failures import BUDGET_EXIT_CODE, PREEMPTED_EXIT_CODE, BudgetExceeded  # noqa: F401 (theirs too)

# the signal a rank stops for when another process of a run in several was stopped (their step's all-reduce)
ANOTHER_PROCESS = "SIGTERM to another process"


@dataclass(frozen=True)
class Deadline:
    """When `fit` stops: at the first optimizer step boundary once `time.monotonic()` reaches `at`, it saves a
    checkpoint and raises `BudgetExceeded`, whose message starts with `reason()` (the limit and the spend)
    and names the limit to raise (`limit`: "max_cost" or "max_hours")."""

    at: float
    reason: Callable[[], str]
    limit: str = "max_cost"

    def exceeded(self, checkpoint: str | None, saved: bool = True) -> BudgetExceeded:
        """`saved`: this attempt saved `checkpoint`; else it stopped before its first step, at the one it resumed."""
        where = (
            (
                f"checkpoint saved at {checkpoint}"
                if saved
                else f"before its first step; its newest checkpoint is {checkpoint}"
            )
            if checkpoint
            else "no checkpoint yet"
        )
        return BudgetExceeded(
            f"training stopped at its budget: {self.reason()}; {where}: raise training.{self.limit} and run again "
            "to resume",
            checkpoint,
        )


class StopFlag:
    signal_name: str | None = None


class KeptSignal:
    """A SIGINT/SIGTERM handler for a process that is still starting (a sweep's trial loading its flow): the signal
    is kept, not raised (a KeyboardInterrupt there is a traceback of that loading), and given to the training's
    handler once it is set (`on_stop_signals`), which then stops at its first optimizer step, at a checkpoint."""

    signum: int | None = None

    def __call__(self, signum, frame) -> None:
        self.signum = signum


@contextlib.contextmanager
def kept_while_starting(signum: int = signal.SIGTERM):
    """`signum` (a spot machine's notice) kept while a training starts (its tracker, data and model) and given to
    the training's own handler once it is set (`on_stop_signals`): the training then stops at its first optimizer
    step, at a checkpoint. Unkept, it was Prefect's TerminationSignal raised wherever the process was: inside a
    weakref's callback Python drops it, and the run trained to its end. One the training never took (it failed or
    ended first) is raised again as it came when the block ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    kept = KeptSignal()
    previous = signal.signal(signum, kept)
    try:
        yield
    finally:
        signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        if kept.signum is not None:
            signal.raise_signal(kept.signum)


@contextlib.contextmanager
def on_stop_signals(handler: Callable | None):
    """`handler` for SIGTERM and SIGINT while the block runs (from the main thread only, where they can be set)."""
    if handler is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, handler) for s in (signal.SIGTERM, signal.SIGINT)}
    keeper = next((h for h in previous.values() if isinstance(h, KeptSignal) and h.signum is not None), None)
    if keeper is not None:  # taken: not raised again when the keeping ends (`kept_while_starting`)
        signum, keeper.signum = keeper.signum, None
        handler(signum, None)
    try:
        yield
    finally:
        for s, h in previous.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


@contextlib.contextmanager
def stop_on_signals(log: Callable[[str], None]):
    """SIGTERM/SIGINT set a flag the loop checks at each optimizer step; a second SIGINT interrupts at once."""
    flag = StopFlag()

    def handler(signum, frame):
        if flag.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        flag.signal_name = signal.Signals(signum).name
        log(f"{flag.signal_name} received: saving a checkpoint at the next optimizer step, then stopping")

    with on_stop_signals(handler):
        yield flag


@contextlib.contextmanager
def deterministic(device: torch.device, setting: bool | None = None):
    """Deterministic kernels for the duration of a fit (the setting is process-wide): training.deterministic,
    null meaning on the CPU only. On CUDA, cuBLAS needs a fixed workspace too: CUBLAS_WORKSPACE_CONFIG, set
    here when the environment sets none (torch reads it when a cuBLAS handle takes its workspace, so the
    process's first CUDA matmul must come after: in a pipeline, training's)."""
    enabled, warn_only = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    on = device.type == "cpu" if setting is None else setting
    if on and device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if on:
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def preempt_machine(log: Callable[[str], None], step: int) -> None:
    """SIGTERM to this machine's training, as a spot reclaim sends it: to this process (every rank stops at this
    step), and under torch's agent to the agent too (by its first process on the machine), which then stops
    rather than starting a restart round."""
    log(f"SHARDLINE_PREEMPT_AT_STEP={step}: sending myself SIGTERM, as a spot reclaim would")
    signal.raise_signal(signal.SIGTERM)
    if os.environ.get("TORCHELASTIC_RUN_ID") is not None and os.environ.get("LOCAL_RANK", "0") == "0":
        os.kill(os.getppid(), signal.SIGTERM)


def setting_hooks(log: Callable[[str], None] = print) -> dict:
    """`Callbacks` fields for what the environment asks of a run started by a command, a worker or torchrun, where
    no caller can pass a function: `SHARDLINE_PREEMPT_AT_STEP` (`shardline rehearse`: a run that did not resume
    preempts itself at that step, the real path). Unset: none."""
    from shardline.core.config import settings

    preempt_at = int(settings.number("SHARDLINE_PREEMPT_AT_STEP"))
    if not preempt_at:
        return {}

    def after_step(step: int, resumed: bool) -> None:
        if step == preempt_at and not resumed:
            preempt_machine(log, preempt_at)

    return {"after_step": after_step}
