"""The encode's file groups on a real Dask cluster (`compute.task_runner: dask`): two worker processes
write the same shards, byte for byte, as the thread-pool encode, each holding one group at a time."""

import json
import os
from pathlib import Path

import pytest

from shardline.core.config import validate_config
from shardline.tasks.ingest import snapshot_source
from tests.conftest import make_raw, tiny_config

distributed = pytest.importorskip("distributed")
pytest.importorskip("prefect_dask")


def _rss() -> dict:
    import psutil

    return {"pid": os.getpid(), "rss": psutil.Process().memory_info().rss}


def _warm() -> None:  # what any task run imports (prefect's engine, polars, torch): before the baseline
    import prefect.task_engine  # noqa: F401
    import prefect_dask  # noqa: F401

    import shardline.tasks.encode  # noqa: F401


def test_dask_encode_writes_the_thread_pool_shards_on_two_worker_processes(tmp_path, prefect_api):
    from prefect import flow

    from shardline.flows.pipeline import encoded_data
    from shardline.tasks.encode import dataset_id, encode_dataset

    raw = tmp_path / "raw"
    make_raw(raw, n_seq=24, rows=80)  # 8 files, one group each
    configs = {
        runner: validate_config(
            tiny_config(
                str(raw / "*.parquet"), str(tmp_path / runner), **{"data.files_per_group": 1, "data.encode_workers": 2}
            )
        )
        for runner in ("threads", "dask")
    }

    @flow(name="encode-on-dask")
    def encode_on(address: str):
        dask = configs["dask"].model_copy(
            update={
                "compute": configs["dask"].compute.model_copy(update={"task_runner": "dask", "dask_address": address})
            }
        )
        return encoded_data(dask)[1]

    # the thread-pool encode (the same per-group functions the default runner's tasks call), same layout
    snap, data = snapshot_source(configs["threads"].data), configs["threads"].data
    datasets = tmp_path / "threads" / "datasets"
    threads_uri = encode_dataset(snap, data, str(datasets / dataset_id(snap, data)), 2, str(datasets / "groups"))

    with (
        distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster,
        distributed.Client(cluster) as client,
    ):
        client.run(_warm)
        before = client.run(_rss)
        with distributed.get_task_stream(client) as stream:
            uris = {"threads": threads_uri, "dask": encode_on(cluster.scheduler_address)}
        after = client.run(_rss)

    manifests = {k: json.loads(Path(u).read_text()) for k, u in uris.items()}
    # the same shards by checksum, in the same places (the group store is content-addressed), so the same manifest
    assert [s["sha256"] for s in manifests["dask"]["shards"]] == [s["sha256"] for s in manifests["threads"]["shards"]]
    assert manifests["dask"] == manifests["threads"]
    n_groups = len(snap.files)
    for s in manifests["dask"]["shards"]:  # written by the workers into the dask run's own storage root
        assert (Path(uris["dask"]).parent / s["path"]).resolve().is_relative_to(tmp_path / "dask")

    # every group ran on a worker process (not this one), both workers took groups, one at a time each
    groups = stream.data
    assert len(groups) == n_groups == 8
    assert {t["worker"] for t in groups} == set(before)
    for worker in before:
        ran = [t for t in groups if t["worker"] == worker]
        spans = sorted(
            (s["start"], s["stop"], t["key"]) for t in ran for s in t["startstops"] if s["action"] == "compute"
        )
        # 50 ms of slack: the stream's times are the worker's clock corrected by its measured offset to the
        # scheduler's, which moves between messages (a worker's first group "ended" 20-40 ms after its second began,
        # 1 run in 3); two groups run at once would overlap by most of a group (0.15 s or more here)
        assert all(b[0] >= a[1] - 0.05 for a, b in zip(spans, spans[1:])), f"{worker} ran two at once: {spans}"
    assert all(before[w]["pid"] != os.getpid() for w in before)

    # memory per worker stays bounded (loosely: the data here is tiny; the bound that matters is the one
    # group at a time above): a worker
    # that ran four groups holds under 1 GB (about 0.5 GB of it is prefect, polars and torch, imported)
    for w in before:
        assert after[w]["rss"] < 1e9, f"{w}: {after[w]['rss'] / 1e6:.0f} MB resident after encoding"


def test_a_cluster_without_workers_fails_the_encode_in_time_and_a_scheduler_address_is_checked(tmp_path, prefect_api):
    """Every worker lost: Dask's own `no-workers-timeout` fails the groups instead of a wait without end. A local
    cluster is started with it; a scheduler of the user's without it is warned of, naming the setting; an address
    where no scheduler answers is said naming compute.dask_address, not with Dask's traceback."""
    import dask
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogHandler

    from shardline.flows.runners import NO_WORKERS_SETTING, _dask_runner, _no_workers_timeout

    raw = tmp_path / "raw"
    make_raw(raw, n_seq=3, rows=20)

    def config(**compute):
        raw_config = tiny_config(str(raw / "*.parquet"), str(tmp_path / "store"))
        return validate_config({**raw_config, "compute": {"task_runner": "dask", **compute}})

    @flow(name="dask-no-workers")
    def timeout_of(cfg):
        with _dask_runner(cfg) as (runner, _):
            return runner.client.run_on_scheduler(_no_workers_timeout)

    def said(state) -> list[str]:
        APILogHandler().flush()
        with get_client(sync_client=True) as client:
            runs = LogFilterFlowRunId(any_=[state.state_details.flow_run_id])
            return [log.message for log in client.read_logs(log_filter=LogFilter(flow_run_id=runs))]

    assert timeout_of(config(dask_workers=1)) == 300  # the local cluster's: 5 minutes
    with distributed.LocalCluster(n_workers=1, threads_per_worker=1, processes=False, dashboard_address=None) as c:
        state = timeout_of(config(dask_address=c.scheduler_address), return_state=True)
        assert state.result() is None
        warned = [m for m in said(state) if NO_WORKERS_SETTING in m]
        assert warned and "DASK_DISTRIBUTED__SCHEDULER__NO_WORKERS_TIMEOUT=5minutes" in warned[0], said(state)
    with dask.config.set({"distributed.comm.timeouts.connect": "1s"}):
        with pytest.raises(RuntimeError, match=r"compute.dask_address tcp://127.0.0.1:9: no Dask scheduler answers"):
            timeout_of(config(dask_address="tcp://127.0.0.1:9"))
