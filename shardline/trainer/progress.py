"""What the person at the terminal sees of a run trained in this process, and the one warning a run gives
when it is starved of data. Plain Python (rich for the bar), no Prefect: `fit`'s `on_progress` and
`on_epoch` entries drive them.

- `TerminalProgress`: a progress bar on the terminal (epochs, optimizer steps, windows/s, time left),
  drawn on stderr only when stderr is a terminal: nothing at all in a log file, a pipe, CI or a worker.
- `DataWaitWatch`: says once, with the likely fixes, when the fraction of step time spent waiting for
  the next batch stays above `DATA_WAIT_WARN` (two epochs in a row).
"""

from __future__ import annotations

import sys
from typing import IO

BAR_SECONDS = 0.5  # how often the terminal's bar is redrawn (at most)
DATA_WAIT_WARN = 0.10  # a fraction of step time spent waiting for data that is worth a warning
DATA_WAIT_EPOCHS = 2  # ... when it lasts this many epochs in a row


def on_terminal(stream: IO | None) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):  # a closed or stand-in stream
        return False


def _eta(seconds: float | None) -> str:
    if seconds is None:
        return "–"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


class TerminalProgress:
    """A bar for the run: `train epoch 2/5 ━━━━━━╺━━━ 120/300 steps · 3,400 windows/s · ETA 0:42`.
    `on` is False (and `show`/`close` do nothing) when `stream` (default stderr) is not a terminal."""

    def __init__(self, stream: IO | None = None):
        stream = sys.stderr if stream is None else stream
        self.on = on_terminal(stream)
        self._progress = self._task = None
        if not self.on:
            return
        from rich.console import Console
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

        self._progress = Progress(
            TextColumn("train epoch {task.fields[epoch]}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("steps · {task.fields[speed]} windows/s · ETA {task.fields[eta]}"),
            console=Console(file=stream, force_terminal=True),
            redirect_stdout=False,  # the run's own log lines go where they went
            redirect_stderr=False,
        )

    def show(self, progress: dict) -> None:
        """Take a `fit` on_progress entry (step, total_steps, epoch, epochs, windows_per_s, seconds_left)."""
        if not self.on:
            return
        fields = {"epoch": f"{progress['epoch']}/{progress['epochs']}"}
        if progress.get("windows_per_s") is not None:
            fields["speed"] = f"{progress['windows_per_s']:,.0f}"
        fields["eta"] = "0:00" if progress["step"] >= progress["total_steps"] else _eta(progress.get("seconds_left"))
        if self._task is None:
            self._progress.start()
            self._task = self._progress.add_task("train", total=progress["total_steps"], speed="–", **fields)
        self._progress.update(self._task, completed=progress["step"], total=progress["total_steps"], **fields)
        self._progress.refresh()

    def close(self) -> None:
        if self._task is not None:
            self._progress.stop()
            self._task = None


class DataWaitWatch:
    """Feed it each epoch's `data_wait_fraction`; it returns the warning, once per run, the first time the
    fraction has been above `DATA_WAIT_WARN` for `DATA_WAIT_EPOCHS` epochs in a row (else None)."""

    def __init__(self, batch_size: int, num_workers: int | None):
        self.batch_size, self.num_workers = batch_size, num_workers
        self.above: list[float] = []
        self.said = False

    def epoch(self, fraction: float | None) -> str | None:
        if self.said:
            return None
        self.above = [*self.above, fraction] if fraction is not None and fraction > DATA_WAIT_WARN else []
        if len(self.above) < DATA_WAIT_EPOCHS:
            return None
        self.said = True
        waited = ", ".join(f"{f:.0%}" for f in self.above)
        workers = "null: 2 on a GPU, 0 elsewhere" if self.num_workers is None else self.num_workers
        return (
            f"train: the last {len(self.above)} epochs spent {waited} of their step time waiting for the next batch "
            f"(above {DATA_WAIT_WARN:.0%}): the model waits for data. Likely fixes: more loader threads "
            f"(training.num_workers, now {workers}); a larger batch (training.batch_size, now "
            f"{self.batch_size}), fewer steps for the same windows; and, when the storage root is remote, the "
            "local cache of shards on a local disk (SHARDLINE_CACHE, not a network mount)"
        )
