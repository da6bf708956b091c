"""Where the encode's file-group tasks run (`compute.task_runner`): this process's threads (the flow's
own task runner), or the workers of a Dask cluster through prefect-dask's `DaskTaskRunner`, an
existing one (`compute.dask_address`) or a local one of `compute.dask_workers` processes started for
the encode and stopped after it. Each Dask worker runs one group at a time (one thread), so its memory
is bounded by the group size (`data.group_mb`) as the thread-pool encode's is; the workers write the
shards to the storage root themselves and return only the groups' small records."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

from prefect.logging import get_run_logger

from shardline.core.config import PipelineConfig
from shardline.core.version import spawning_this_shardline
from shardline.tasks.encode import encode_workers


def encode_runner(config: PipelineConfig) -> Callable[[], AbstractContextManager[tuple[Any, int]]] | None:
    """What the encode's groups run on (`encode`'s `runner`): None for the flow's thread pool, else a
    function opening the Dask runner the config asks for. Says up front when prefect-dask is missing."""
    import importlib.util

    if config.compute.task_runner != "dask":
        return None
    missing = [m for m in ("prefect_dask", "distributed") if importlib.util.find_spec(m) is None]
    if missing:
        raise RuntimeError(
            f"compute.task_runner: dask needs {' and '.join(missing)}, not installed here: "
            "pip install 'shardline[dask]' (prefect-dask and distributed), or set compute.task_runner: threads"
        )
    return lambda: _dask_runner(config)


@contextmanager
def _dask_runner(config: PipelineConfig) -> Iterator[tuple[Any, int]]:
    """prefect-dask's runner on the configured cluster, started (inside a flow run), and its worker threads."""
    compute = config.compute
    import dask
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect_dask import DaskTaskRunner

    if compute.dask_address:
        runner = DaskTaskRunner(address=compute.dask_address)
        where = f"the Dask cluster at {compute.dask_address}"
    else:
        n = compute.dask_workers or encode_workers(config.data)
        runner = DaskTaskRunner(
            cluster_class="distributed.LocalCluster",
            # no dashboard; the scheduler's HTTP server (health checks) starts all the same, at port 8787 unless told:
            # on a port of its own on this machine's loopback, as the scheduler and the workers are
            cluster_kwargs={
                "n_workers": n,
                "threads_per_worker": 1,
                "processes": True,
                "dashboard_address": None,
                "scheduler_kwargs": {"dashboard_address": "127.0.0.1:0"},
            },
        )
        where = f"a local Dask cluster of {n} worker process(es)"
    with get_client(sync_client=True) as client:
        api = str(client.api_url).rstrip("/")  # the ephemeral API's too: a worker must not start its own
    # the workers' task runs report to this API (the settings travel with each task's context)
    with temporary_settings(updates={PREFECT_API_URL: api}), spawning_this_shardline(), runner:
        # the runner's client, made on first use, starts the local cluster or connects to the user's: a local
        # cluster whose every worker is gone fails its groups after NO_WORKERS (Dask's own timeout, which its
        # scheduler reads as it starts), not never
        with dask.config.set({NO_WORKERS_SETTING: None if compute.dask_address else NO_WORKERS}):
            try:
                runner.client  # noqa: B018 - made here, on purpose
            except OSError as e:  # no scheduler answers: said naming the setting, without Dask's traceback
                if not compute.dask_address:
                    raise
                raise RuntimeError(
                    f"compute.dask_address {compute.dask_address}: no Dask scheduler answers there ({e}); start one "
                    "(`dask scheduler`) or correct the address"
                ) from None
        if compute.dask_address:  # a cluster whose workers are still starting: wait a little for one
            try:
                runner.client.wait_for_workers(1, timeout=60)
            except Exception:  # noqa: BLE001 - a timeout: said below, naming the address
                pass
        slots = sum(runner.client.nthreads().values())  # the workers' threads: groups that run at once
        if slots < 1:
            raise RuntimeError(f"{where} has no worker: start one (dask worker {compute.dask_address}) and run again")
        get_run_logger().info("encode: file groups run on %s (%d worker thread(s))", where, slots)
        if compute.dask_address and runner.client.run_on_scheduler(_no_workers_timeout) is None:
            get_run_logger().warning(
                "encode: the Dask scheduler at %s has no %s: should every worker be lost, the encode waits for one "
                "without end; start the scheduler with DASK_DISTRIBUTED__SCHEDULER__NO_WORKERS_TIMEOUT=%s (its groups "
                "then fail after that long without a worker, and the run with them)",
                compute.dask_address,
                NO_WORKERS_SETTING,
                NO_WORKERS.replace(" ", ""),
            )
        yield runner, slots


NO_WORKERS_SETTING = "distributed.scheduler.no-workers-timeout"
NO_WORKERS = (
    "5 minutes"  # a local cluster's nannies restart a lost worker in seconds: this long without any, none comes
)


def _no_workers_timeout(dask_scheduler=None):
    """On the scheduler (`Client.run_on_scheduler`): how long a task waits with no worker before it fails (None:
    without end)."""
    return dask_scheduler.no_workers_timeout
