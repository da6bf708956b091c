"""Shardline: raw parquet to a registered PyTorch model, as one Prefect pipeline.

One package, one folder per layer, each importing only the ones below it (tests/test_layers.py):
`app` (the `shardline` command) > `flows` (Prefect flows that only wire) > `tasks` (one Prefect task
per step, with its cache key) > `trainer` (plain PyTorch) > `core` (config, manifest, shards,
encoding, storage, tracking, versions). This file imports nothing, so importing any layer stays cheap.
"""
