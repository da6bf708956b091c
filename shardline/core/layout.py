"""Every folder of a storage root, named once: where each step writes and where `shardline gc` looks.

<root>/datasets/<data set id>/manifest.json    a data set: its manifest(s), listing shards in the group store
<root>/datasets/groups/<group key>/            a file group's shards, keys files and record (group.json, last)
<root>/runs/<run key>/                         a training run: checkpoints, evaluation, result.json, cost.json
<root>/prefect-results/                        the steps' cached results (JSON)
<root>/snapshots/<key>.json                    a source's last snapshot under a data config: files checked
<root>/mlflow-artifacts/                       MLflow's artifacts, when its store is the root's
<root>/sweeps/<sweep id>/                      a sweep's record
<root>/tokenizers/<sha256>.json                text: a tokenizer, by its content
<root>/locks/registry/<model name>/            the lease of a registered model's decisions
<root>/rehearsals/<stamp>/                     `shardline rehearse`'s own root
<root>/.doctor/                                `shardline doctor`'s write probe
"""

from __future__ import annotations

import re

from shardline.core import storage

DATASETS = "datasets"
GROUPS = "groups"  # the group store, beside the data sets' folders
RUNS = "runs"
RESULTS = "prefect-results"
SNAPSHOTS = "snapshots"
MLFLOW_ARTIFACTS = "mlflow-artifacts"
SWEEPS = "sweeps"
TOKENIZERS = "tokenizers"
LOCKS = "locks"
REHEARSALS = "rehearsals"
DOCTOR = ".doctor"


def datasets(root: str) -> str:
    return storage.join(root, DATASETS)


def dataset(root: str, dataset_id: str) -> str:
    return storage.join(root, DATASETS, dataset_id)


def group_store(root: str) -> str:
    return storage.join(root, DATASETS, GROUPS)


def runs(root: str) -> str:
    return storage.join(root, RUNS)


def run(root: str, key: str) -> str:
    return storage.join(root, RUNS, key)


def results(root: str) -> str:
    return storage.join(root, RESULTS)


def snapshot(root: str, key: str) -> str:
    return storage.join(root, SNAPSHOTS, f"{key}.json")


def mlflow_artifacts(root: str) -> str:
    return storage.join(root, MLFLOW_ARTIFACTS)


def sweep(root: str, sweep_id: str) -> str:
    return storage.join(root, SWEEPS, sweep_id)


def tokenizer(root: str, sha256: str) -> str:
    return storage.join(root, TOKENIZERS, f"{sha256}.json")


def registry_lock(root: str, model_name: str) -> str:
    return storage.join(root, LOCKS, "registry", re.sub(r"[^A-Za-z0-9._-]", "_", model_name))


def rehearsal(root: str, stamp: str) -> str:
    return storage.join(root, REHEARSALS, stamp)


def doctor_probe(root: str, name: str) -> str:
    return storage.join(root, DOCTOR, name)
