"""The machine while a run trains, in MLflow's System metrics tab: CPU, memory (the machine's and the
training process's own), and each GPU's memory and utilisation, sampled by a daemon thread every
`SHARDLINE_SYSTEM_METRICS_SECONDS` (default 10; 0 turns it off) into the run's tracker.

Sent through the tracker's journal like every other metric (never straight to MLflow, so an outage
costs nothing), under MLflow's own names (`system/cpu_utilization_percentage`, ...), which is what
its System metrics tab charts; the step is the sample's number, continued by a resumed run.
"""

from __future__ import annotations

import logging
import sys
import threading

from shardline.core.config import settings

log = logging.getLogger("shardline.core.tracking.system")

EVERY_ENV = "SHARDLINE_SYSTEM_METRICS_SECONDS"
CPU_KEY = "system/cpu_utilization_percentage"


def sample() -> dict[str, float]:
    """One reading of the machine, by MLflow's system metric names."""
    import psutil

    mb = 1024.0 * 1024.0
    memory = psutil.virtual_memory()
    out = {
        CPU_KEY: psutil.cpu_percent(interval=None),  # since the previous call (the first: since import)
        "system/system_memory_usage_megabytes": (memory.total - memory.available) / mb,
        "system/system_memory_usage_percentage": memory.percent,
        "system/process_memory_rss_megabytes": psutil.Process().memory_info().rss / mb,
    }
    torch = sys.modules.get("torch")  # a GPU is only asked about by a process that already uses torch
    if torch is not None and torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            out[f"system/gpu_{i}_memory_usage_megabytes"] = (total - free) / mb
            out[f"system/gpu_{i}_memory_usage_percentage"] = 100.0 * (total - free) / max(total, 1)
            try:  # NVML through nvidia-ml-py (a dependency); where the driver's NVML is not reachable, memory only
                out[f"system/gpu_{i}_utilization_percentage"] = float(torch.cuda.utilization(i))
            except Exception:  # noqa: BLE001 - an optional reading
                pass
    return out


class SystemSampler:
    """Samples `sample()` into `tracker` (a shardline Tracker) every `every` seconds from a daemon thread,
    from step `first_step` on; `stop()` takes one last sample. Never raises into training: a failed reading
    is said once and sampling stops."""

    def __init__(self, tracker, every: float | None = None, first_step: int = 0):
        self.tracker = tracker
        self.every = settings.number(EVERY_ENV) if every is None else every
        self.step = first_step
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> SystemSampler:
        if self.every <= 0:
            return self
        import psutil

        psutil.cpu_percent(interval=None)  # the baseline the first reading is measured from
        self._thread = threading.Thread(target=self._loop, name="shardline-system-metrics", daemon=True)
        self._thread.start()
        return self

    def _take(self) -> bool:
        try:
            values = sample()
        except Exception as e:  # noqa: BLE001 - the machine's numbers never stop a run
            log.warning("system metrics stopped: %s: %s", type(e).__name__, e)
            return False
        self.tracker.log_metrics(values, self.step)
        self.step += 1
        return True

    def _loop(self) -> None:
        while not self._stop.wait(self.every):
            if not self._take():
                return

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._thread = None
        self._take()
