"""Content-addressed caching of the pipeline's steps, on Prefect's own task cache.

A step's cache key hashes exactly what decides its output: a content fingerprint of its inputs
(raw files by path, size and etag/mtime; shards by checksum; checkpoints by checksum), the config
section it reads, and the version of its code (its module and every project module it imports).
Results are persisted as JSON (never pickle) under `<storage.root>/prefect-results/`, so every
machine sharing the root shares the cache. Before a cached result is reused, its rule's
`still_valid` checks that what it points to still exists and matches its checksum; if not, the
record is dropped and the step recomputes.

This module is the mechanism. What decides each step's output is declared in the step's own module,
beside its code, as a `CacheRule`: `INGEST_CACHE` (tasks/ingest.py), `ENCODE_GROUP_CACHE` and
`MANIFEST_CACHE` (tasks/encode.py), `TRAIN_CACHE` (tasks/train.py), `EVALUATE_CACHE`
(tasks/evaluate.py), `REGISTER_CACHE` (tasks/register.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect.cache_policies import CachePolicy
from prefect.utilities.hashing import hash_objects

from shardline.core import layout, storage
from shardline.core.version import code_version_of

log = logging.getLogger("shardline.cache")

STEPS = ("ingest", "encode", "train", "evaluate", "register")


@dataclass(frozen=True)
class CacheRule:
    """What decides a step's output, declared in the step's own module beside its code.

    `key` maps the task's inputs to what decides its output (never the whole config: only what the
    step reads); the version of `code` (those modules and every project module they import) is part
    of the key too. `still_valid(result, inputs)` says whether a cached result still points at
    something intact; when it does not, the record is dropped and the step recomputes."""

    step: str
    key: Callable[[dict[str, Any]], Any]
    code: tuple[str, ...]
    still_valid: Callable[[Any, dict[str, Any]], bool] | None = None


# the only serializer a cached record may name (what `cached` writes): anything else is never decoded
JSON_SERIALIZER = {
    "type": "json",
    "jsonlib": "json",
    "object_encoder": "prefect.serializers.prefect_json_object_encoder",
    "object_decoder": "prefect.serializers.prefect_json_object_decoder",
}


@dataclass
class StepCache(CachePolicy):
    rule: CacheRule | None = None
    results_root: str = ""

    def compute_key(
        self, task_ctx, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs: Any
    ) -> str | None:
        rule = self.rule
        key = f"{rule.step}-" + hash_objects(rule.step, code_version_of(*rule.code), rule.key(inputs))
        if not getattr(task_ctx.task, "refresh_cache", False):
            if not self._plain_json(key):  # before anything decodes it
                task_ctx.result_store.cache.clear()
            elif rule.still_valid is not None:
                self._drop_if_stale(task_ctx, key, inputs)
        return key

    def _plain_json(self, key: str) -> bool:
        """A record is read only when it names the JSON serializer with Prefect's own object codec: a
        record naming any other (a pickle planted in a shared store) is deleted unread, and the step
        recomputes. False when one was deleted."""
        uri = storage.join(self.results_root, key)
        try:
            if not storage.exists(uri):
                return True
            serializer = json.loads(storage.read_text(uri)).get("metadata", {}).get("serializer", {})
        except Exception:  # noqa: BLE001 - not even JSON: no record we wrote
            serializer = None
        if serializer is not None and {k: serializer.get(k) for k in JSON_SERIALIZER} == JSON_SERIALIZER:
            return True
        kind = serializer.get("type") if isinstance(serializer, dict) else "unreadable"
        log.warning(
            "cache: record %s names serializer %r, not plain JSON; deleted unread, recomputing %s",
            key,
            kind,
            self.rule.step,
        )
        self._delete(key)
        return False

    def _drop_if_stale(self, task_ctx, key: str, inputs: dict[str, Any]) -> None:
        store = task_ctx.result_store
        try:
            if not store.exists(key):
                return
            value = store.read(key).result
        except Exception as e:  # noqa: BLE001 - an unreadable record is as good as none
            log.warning("cache: record %s unreadable (%s); recomputing %s", key, e, self.rule.step)
            self._delete(key)
            return
        try:
            ok = self.rule.still_valid(value, inputs)
        except Exception as e:  # noqa: BLE001 - a check that fails counts as stale
            ok = False
            log.warning("cache: checking %s failed (%s)", key, e)
        if not ok:
            log.warning("cache: what the cached %s result points to is gone or changed; recomputing", self.rule.step)
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
    uri = layout.results(root)
    if not storage.is_remote(uri):
        path = Path(storage.local_path(uri)).resolve()
        path.mkdir(parents=True, exist_ok=True)
        return path, str(path)
    from prefect.filesystems import RemoteFileSystem

    name = "shardline-results-" + hash_objects(uri)[:12]
    RemoteFileSystem(basepath=uri).save(name, overwrite=True)
    return f"remote-file-system/{name}", uri


def cached(task, rule: CacheRule, root: str, refresh: bool = False):
    """`task` with the content-addressed, JSON-persisted cache its `rule` declares, under `root`."""
    storage_ref, results_root = results_storage(root)
    return task.with_options(
        cache_policy=StepCache(rule=rule, results_root=results_root),
        persist_result=True,
        result_storage=storage_ref,
        result_serializer="json",
        refresh_cache=refresh,
    )


def run_cached(task, rule: CacheRule, root: str, refresh: bool, *args) -> tuple[Any, bool]:
    """Run `task(*args)` through its cache: (its result, whether it ran rather than came from the cache)."""
    state = cached(task, rule, root, refresh)(*args, return_state=True)
    return state.result(), state.name != "Cached"


def raw_files_key(files) -> list:
    return [(f.uri, f.size, f.version) for f in files]
