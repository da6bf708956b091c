"""What `shardline gc` reads to tell what is in use: what each folder of the storage root records (a data set's
manifests, a run's sidecars and result), what a cached result points at, the registry's versions, and what
the live flow runs use. The plan and the deletes are `shardline.app.gc`'s."""

from __future__ import annotations

import json
import os
import posixpath
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from shardline.core import layout, storage
from shardline.core.config import PipelineConfig
from shardline.core.layout import DATASETS, GROUPS, RUNS

LIVE_STATES = ("SCHEDULED", "PENDING", "RUNNING", "PAUSED", "CANCELLING")
PIPELINE_FLOWS = ("pipeline", "train")
_SIDECAR = re.compile(r"(^|/)checkpoints/ckpt-\d{9}\.json$")


class GcError(RuntimeError):
    """gc cannot tell what is referenced, so it deletes nothing."""


@dataclass
class Item:
    """A data set or run folder, or one cached result file, with every file in it."""

    kind: str  # "data set", "file group", "run" or "cached result"
    uri: str
    files: list[tuple[str, int, float | None]]  # (uri, bytes, modification time) of each file
    newest: float  # the newest file's modification time (epoch seconds)
    why: str = ""  # why it is deleted, or why it is kept
    refs: set[str] = field(default_factory=set)  # cached result: the items (uris) it points at

    @property
    def name(self) -> str:
        return self.uri.rstrip("/").rsplit("/", 1)[-1]

    @property
    def bytes(self) -> int:
        return sum(f[1] for f in self.files)


def _read_json(uri: str) -> Any:
    try:
        return json.loads(storage.read_text(uri))
    except (OSError, ValueError):
        return None


# ---------------------------------------------------------------- what each folder records


@dataclass
class DataSet:
    item: Item
    data: set[tuple[str, str]]  # (data fingerprint, encoding hash) of each manifest in it
    shards: dict[str, tuple[int, str | None]]  # file name -> (bytes, sha256 when a manifest lists it)
    groups: set[str] = field(default_factory=set)  # the group store's folders its manifests list shards in


@dataclass
class Run:
    item: Item
    mlflow_run_id: str | None
    manifest: str | None  # the manifest its checkpoints were trained on
    parents: list[str]  # checkpoint paths or run folders it was fine-tuned from


_IN_GROUP = re.compile(rf"^\.\./{GROUPS}/([^/]+)/")


def _dataset(item: Item) -> DataSet:
    data, shards, groups = set(), {}, set()
    for uri, size, _ in item.files:
        rel = uri[len(item.uri) + 1 :]
        if "/" not in rel:
            shards[rel] = (size, None)
    for rel in [r for r in shards if r.startswith("manifest") and r.endswith(".json")]:
        m = _read_json(storage.join(item.uri, rel))
        if not isinstance(m, dict):
            continue
        data.add((str(m.get("data_fingerprint")), str(m.get("encoding_hash"))))
        for s in m.get("shards") or []:
            found = _IN_GROUP.match(str(s.get("path") or ""))
            if found:
                groups.add(found.group(1))
            for path, digest in ((s.get("path"), s.get("sha256")), (s.get("keys_path"), s.get("keys_sha256"))):
                if path in shards:
                    shards[path] = (shards[path][0], digest)
    return DataSet(item, data, shards, groups)


def _run(item: Item) -> Run:
    names = {uri[len(item.uri) + 1 :]: uri for uri, _, _ in item.files}
    run_file = _read_json(names["mlflow-run.json"]) if "mlflow-run.json" in names else None
    manifest = None
    for rel in sorted((r for r in names if _SIDECAR.search(r)), reverse=True):  # the newest sidecar first
        side = _read_json(names[rel])
        if isinstance(side, dict) and side.get("run_meta", {}).get("manifest"):
            manifest = side["run_meta"]["manifest"]
            break
    parents = []
    result = _read_json(names["result.json"]) if "result.json" in names else None
    if isinstance(result, dict) and isinstance(result.get("parent"), dict) and result["parent"].get("checkpoint"):
        parents.append(result["parent"]["checkpoint"])
    if "config.yaml" in names:
        import yaml

        try:
            init = ((yaml.safe_load(storage.read_text(names["config.yaml"])) or {}).get("training") or {}).get(
                "init_from"
            )
        except (OSError, yaml.YAMLError):
            init = None
        if init and not str(init).startswith("models:/"):
            parents.append(str(init))
    run_id = run_file.get("run_id") if isinstance(run_file, dict) else None
    return Run(item, run_id, manifest, parents)


def _real(uri: str) -> str:
    """`uri` as one spelling: a local path resolved (file://, `..`, `//` and links), an object store's key
    normalised; so a root, a data source or a recorded path spelled two ways are compared as the places they are."""
    if storage.is_remote(uri):
        scheme, _, path = uri.partition("://")
        return f"{scheme}://{posixpath.normpath('/' + path).lstrip('/')}"
    return os.path.realpath(storage.local_path(uri))


class Locator:
    """Which data set or run folder of this root a URI or path points into, if any."""

    def __init__(self, root: str):
        self.remote = storage.is_remote(root)
        self.areas = {area: _real(storage.join(root, area)) for area in (DATASETS, RUNS)}

    def find(self, s: str) -> tuple[str, str] | None:
        """(area, folder name) that `s` lies in, or None."""
        if not isinstance(s, str) or (DATASETS not in s and RUNS not in s) or "\n" in s or "\0" in s:
            return None
        if not self.remote and storage.is_remote(s):
            return None
        path = _real(s)
        for area, prefix in self.areas.items():
            if path.startswith(prefix + "/"):
                return area, path[len(prefix) + 1 :].split("/", 1)[0]
        return None


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _strings(v)


def _record_value(uri: str) -> tuple[Any, str | None]:
    """A cached result's value as plain JSON (never decoded into objects), or why it cannot be read."""
    try:
        record = json.loads(storage.read_text(uri))
    except (OSError, ValueError) as e:
        return None, f"not JSON ({type(e).__name__})"
    if isinstance(record, dict) and "metadata" in record and "result" in record:
        serializer = (record.get("metadata") or {}).get("serializer") or {}
        if not isinstance(serializer, dict) or serializer.get("type") != "json":
            kind = serializer.get("type") if isinstance(serializer, dict) else serializer
            return None, f"serializer {kind!r}, not JSON: not decoded"
        value = record["result"]
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                pass  # a plain string result
        return value, None
    return record, None  # a flow's result, stored as bare JSON


def _group_shards(value: Any) -> list[dict] | None:
    """The shards an encoded file group's cached result lists (it names them relative to its data set)."""
    if isinstance(value, dict) and str(value.get("__class__", "")).endswith("EncodedGroup"):
        shards = (value.get("data") or {}).get("shards")
        return shards if isinstance(shards, list) else None
    return None


def _holds(ds: DataSet, shards: list[dict]) -> bool:
    for s in shards:
        for path, size, digest in ((s.get("path"), s.get("bytes"), s.get("sha256")), (s.get("keys_path"), None, None)):
            have = ds.shards.get(path)
            if have is None or (size is not None and have[0] != size) or (digest and have[1] and have[1] != digest):
                return False
    return True


def _listing(area_uri: str) -> list[dict]:
    """What lies directly under `area_uri` (none when it does not exist)."""
    fs, base = storage.filesystem(area_uri)
    try:
        return fs.ls(base, detail=True)
    except FileNotFoundError:
        return []


# ---------------------------------------------------------------- the registry and the live flow runs


def registered_versions(config: PipelineConfig) -> list[dict]:
    """Every version of every registered model in the config's MLflow store: its run id, tags and aliases."""
    from mlflow import MlflowClient
    from mlflow.utils import get_results_from_paginated_fn as every_page

    from shardline.core.tracking.tracker import mlflow_client_defaults, tracking_uri

    uri = tracking_uri(config.mlflow, config.storage.root)
    mlflow_client_defaults(uri)  # as the pipeline does: a server that is down is said in seconds (it was 4 minutes)
    try:
        client = MlflowClient(uri)
        aliases: dict[tuple[str, str], list[str]] = {}
        for m in every_page(lambda n, token: client.search_registered_models(max_results=n, page_token=token), 1000):
            for alias, version in (m.aliases or {}).items():
                aliases.setdefault((m.name, str(version)), []).append(alias)
        versions = [
            {
                "name": v.name,
                "version": str(v.version),
                "run_id": v.run_id,
                "tags": dict(v.tags or {}),
                "aliases": aliases.get((v.name, str(v.version)), []),
            }
            for v in every_page(lambda n, token: client.search_model_versions(max_results=n, page_token=token), 10000)
        ]
    except Exception as e:  # noqa: BLE001 - any registry error: what is registered is unknown
        raise GcError(
            f"cannot read the model registry at {uri} ({type(e).__name__}: {str(e).splitlines()[0][:200]}); "
            "gc deletes nothing without knowing what the registered versions refer to"
        ) from None
    # aliased versions first: a reason names the champion before the others
    return sorted(versions, key=lambda v: (not v["aliases"], v["name"], int(v["version"])))


def live_flow_runs() -> list[dict]:
    """The `pipeline` and `train` flow runs that are scheduled, pending, running, paused or cancelling:
    name, state and parameters. Raises ConnectionError when the Prefect API cannot be asked."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType

    try:
        with get_client(sync_client=True) as client:
            ours = FlowFilter(name=FlowFilterName(any_=list(PIPELINE_FLOWS)))
            flows = {f.id: f.name for f in client.read_flows(flow_filter=ours)}
            live, offset = [], 0
            while True:
                page = client.read_flow_runs(
                    flow_filter=ours,
                    flow_run_filter=FlowRunFilter(
                        state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType[s] for s in LIVE_STATES]))
                    ),
                    limit=200,
                    offset=offset,
                )
                live += [
                    {
                        "name": r.name,
                        "id": str(r.id),
                        "flow": flows.get(r.flow_id, "?"),
                        "state": r.state.name if r.state else "?",
                        "state_type": r.state_type.name if r.state_type else "?",
                        "parameters": r.parameters or {},
                    }
                    for r in page
                ]
                if len(page) < 200:
                    return live
                offset += 200
    except Exception as e:  # noqa: BLE001 - any client or server error: the API cannot be asked
        raise ConnectionError(f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}") from None


def flow_run_uses(params: dict, root: str, locate: Locator) -> tuple[set[str], set[str], set[str]] | None:
    """(data set names, run names, run name prefixes) a live flow run uses in this root; None when it
    runs on another root. Raises when that cannot be worked out."""
    from shardline.flows.pipeline import resolve_config

    datasets: set[str] = set()
    runs: set[str] = set()
    prefixes: set[str] = set()
    config = resolve_config(params["config"]) if params.get("config") is not None else None
    if config is not None and _real(config.storage.root) != _real(root):
        return None
    for key in ("manifest_uri", "run_folder"):  # the training flow names both
        where = locate.find(params.get(key) or "")
        if where:
            (datasets if where[0] == DATASETS else runs).add(where[1])
    if config is None:
        return datasets, runs, prefixes
    named_runs = set(runs)
    parent = locate.find(config.training.init_from or "")  # a checkpoint it is fine-tuned from
    if parent and parent[0] == RUNS:
        runs.add(parent[1])
    if not datasets:  # a pipeline: the data set its config addresses (its raw files as they are now)
        from shardline.tasks.encode import dataset_id
        from shardline.tasks.ingest import snapshot_source

        data = config.data
        if config.training.init_from and data.features.text:  # tokenized with its parent's tokenizer
            from shardline.runs.parent import parent_encoding, parent_tokenized, resolve_parent

            encoding = parent_encoding(config, resolve_parent(config))
            data = parent_tokenized(config, encoding) if encoding.text is not None else data
        datasets.add(dataset_id(snapshot_source(config.data), data))
    if not named_runs:  # ... and the run folder each of its manifests addresses (and `--force train`'s beside it)
        from shardline.core.manifest import Manifest
        from shardline.runs.training_run import run_dir

        for name in datasets:
            folder = layout.dataset(root, name)
            for e in _listing(folder):
                file = e["name"].rstrip("/").rsplit("/", 1)[-1]
                if file.startswith("manifest") and file.endswith(".json"):
                    manifest = Manifest.model_validate_json(storage.read_text(storage.join(folder, file)))
                    prefixes.add(run_dir(config, manifest).rstrip("/").rsplit("/", 1)[-1])
    return datasets, runs, prefixes


def in_use_by_flow_runs(
    root: str, locate: Locator, run_names: list[str]
) -> tuple[dict[tuple[str, str], str], str | None, list[str]]:
    """What the live flow runs use in this root: {(area, name): why}, the reason to keep everything when a
    running one cannot be worked out (else None), and notes. Raises ConnectionError when the API cannot
    be asked."""
    in_use: dict[tuple[str, str], str] = {}
    keep_all, notes = None, []
    for fr in live_flow_runs():
        label = f"in use by flow run {fr['name']} ({fr['flow']}, {fr['state']})"
        try:
            uses = flow_run_uses(fr["parameters"], root, locate)
        except Exception as e:  # noqa: BLE001 - what it uses is unknown: keep everything it might
            if fr["state_type"] == "SCHEDULED":  # not started: what it would reuse is recomputed if gone
                notes.append(f"{label}: could not tell what it will use ({type(e).__name__}: {e}); not protected")
                continue
            keep_all = f"{label}, which could not be resolved ({type(e).__name__}: {str(e)[:200]})"
            notes.append(f"kept every data set and run: {keep_all}")
            continue
        if uses is None:
            continue
        for name in uses[0]:
            in_use.setdefault((DATASETS, name), label)
        for name in run_names:
            if name in uses[1] or any(name == p or name.startswith(p + "-") for p in uses[2]):
                in_use.setdefault((RUNS, name), label)
    return in_use, keep_all, notes
