"""Content-addressed caching of the pipeline's steps, on Prefect's own task cache.

A step's cache key hashes exactly what decides its output: a content fingerprint of its inputs
(raw files by path, size and etag/mtime; shards by checksum; checkpoints by checksum), the config
section it reads, and the version of its code (its module and every project module it imports).
Results are persisted as JSON (never pickle) under `<storage.root>/prefect-results/`, so every
machine sharing the root shares the cache. Before a cached result is reused, `validate` checks
that what it points to still exists and matches its checksum; if not, the record is dropped and
the step recomputes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from prefect.cache_policies import CachePolicy
from prefect.utilities.hashing import hash_objects

from shardline import storage
from shardline.version import code_version_of

log = logging.getLogger("shardline.cache")

STEPS = ("ingest", "encode", "train", "evaluate", "register")


@dataclass
class StepCache(CachePolicy):
    step: str = ""
    modules: tuple[str, ...] = ()
    key_of: Callable[[dict[str, Any]], Any] = field(default=lambda inputs: inputs)
    validate: Callable[[Any], bool] | None = None
    results_root: str = ""

    def compute_key(self, task_ctx, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs: Any) -> str | None:
        key = f"{self.step}-" + hash_objects(self.step, code_version_of(*self.modules), self.key_of(inputs))
        if self.validate is not None and not getattr(task_ctx.task, "refresh_cache", False):
            self._drop_if_stale(task_ctx, key)
        return key

    def _drop_if_stale(self, task_ctx, key: str) -> None:
        store = task_ctx.result_store
        try:
            if not store.exists(key):
                return
            value = store.read(key).result
        except Exception as e:  # an unreadable record is as good as none
            log.warning("cache: record %s unreadable (%s); recomputing %s", key, e, self.step)
            self._delete(key)
            return
        try:
            ok = self.validate(value)
        except Exception as e:
            ok = False
            log.warning("cache: checking %s failed (%s)", key, e)
        if not ok:
            log.warning("cache: what the cached %s result points to is gone or changed; recomputing", self.step)
            self._delete(key)
            store.cache.clear()

    def _delete(self, key: str) -> None:
        uri = storage.join(self.results_root, key)
        if storage.is_remote(uri):
            fs, path = storage.filesystem(uri)
            fs.rm(path)
        else:
            Path(storage.local_path(uri)).unlink(missing_ok=True)


def results_storage(root: str):
    """Where the task results live: a folder under the storage root (a saved block when remote)."""
    uri = storage.join(root, "prefect-results")
    if not storage.is_remote(uri):
        path = Path(storage.local_path(uri)).resolve()
        path.mkdir(parents=True, exist_ok=True)
        return path, str(path)
    from prefect.filesystems import RemoteFileSystem

    name = "shardline-results-" + hash_objects(uri)[:12]
    RemoteFileSystem(basepath=uri).save(name, overwrite=True)
    return f"remote-file-system/{name}", uri


def cached(task, step: str, modules: tuple[str, ...], key_of, root: str, validate=None, refresh: bool = False):
    """`task` with a content-addressed, JSON-persisted cache under `root`."""
    storage_ref, results_root = results_storage(root)
    policy = StepCache(step=step, modules=modules, key_of=key_of, validate=validate, results_root=results_root)
    return task.with_options(
        cache_policy=policy,
        persist_result=True,
        result_storage=storage_ref,
        result_serializer="json",
        refresh_cache=refresh,
    )


def raw_files_key(files) -> list:
    return [(f.uri, f.size, f.version) for f in files]
