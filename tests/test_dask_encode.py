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
