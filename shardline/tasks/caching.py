"""Content-addressed caching of the pipeline's steps, on Prefect's own task cache.

A step's cache key hashes exactly what decides its output: a content fingerprint of its inputs
(raw files by path, size and etag/mtime; shards by checksum; checkpoints by checksum), the config
section it reads, and the version of its code (its module and every project module it imports).
Results are persisted as JSON (never pickle) under `<storage.root>/prefect-results/`, so every
machine sharing the root shares the cache; a record is decoded only from the very bytes that were checked
to be plain JSON holding Shardline's own result types (`checked_record`, in the results store's read).
Before a cached result is reused, its rule's `still_valid` checks that what it points to still exists
and matches its checksum; if not, the record is dropped and the step recomputes.

This module is the mechanism. What decides each step's output is declared in the step's own module,
beside its code, as a `CacheRule`: `INGEST_CACHE` (tasks/ingest.py), `ENCODE_GROUP_CACHE` and
`MANIFEST_CACHE` (tasks/encode.py), `TRAIN_CACHE` (tasks/train.py), `EVALUATE_CACHE`
(tasks/evaluate.py), `REGISTER_CACHE` (tasks/register.py).
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect._internal.compatibility.async_dispatch import async_dispatch
from prefect.cache_policies import CachePolicy
from prefect.exceptions import ObjectAlreadyExists
from prefect.filesystems import LocalFileSystem, RemoteFileSystem
from prefect.utilities.hashing import hash_objects
from pydantic import BaseModel

from shardline.core import layout, storage
from shardline.core.unreachable import unreachable
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


def _loaded_type(name: str) -> type | None:
    """The class a record names, when it is already loaded (nothing is imported for a record)."""
    module, _, attr = str(name).rpartition(".")
    found = getattr(sys.modules.get(module), attr, None)
    return found if isinstance(found, type) else None


def _only_ours(obj: dict) -> dict:
    """A JSON object hook that lets through only what Shardline's steps return: its own pydantic results (and
    a loaded exception type); a record naming any other type is refused before Prefect's decoder sees it."""
    if "__class__" in obj:
        cls = _loaded_type(obj["__class__"])
        if cls is None or not (cls.__module__.startswith("shardline.") and issubclass(cls, BaseModel)):
            raise ValueError(f"names type {obj['__class__']!r}, not one of Shardline's results")
    if "__exc_type__" in obj:
        cls = _loaded_type(obj["__exc_type__"])
        if cls is None or not issubclass(cls, BaseException):
            raise ValueError(f"names exception type {obj['__exc_type__']!r}")
    return obj


class RefusedRecord(ValueError):
    """A record `checked_record` would not hand to Prefect."""


def checked_record(content: bytes, path: str) -> bytes:
    """`content`, a record read from the results store, returned only when it decodes as plain JSON naming the JSON
    serializer and nothing but Shardline's own result types: these very bytes are what Prefect then decodes (no
    check-then-use: a record flipped to a pickle between two reads is never decoded). Raises ValueError otherwise;
    Prefect reads that as "no record", and the step recomputes and writes its own."""
    try:
        record = json.loads(content)
        if isinstance(record, dict) and "metadata" in record:  # a whole record: its serializer, then its payload
            serializer = (record["metadata"] or {}).get("serializer") or {}
            if {k: serializer.get(k) for k in JSON_SERIALIZER} != JSON_SERIALIZER:
                raise ValueError(f"names serializer {serializer.get('type')!r}, not plain JSON")
            json.loads(record["result"], object_hook=_only_ours)
        else:  # a result alone (its metadata, naming JSON, is kept by Prefect's API)
            json.loads(content, object_hook=_only_ours)
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise RefusedRecord(f"cache record {path} refused: {e}") from None
    return content


# the last bytes of each record that passed `checked_record` in this process, by (results folder, key), newest last
_PASSED: OrderedDict[tuple[str, str], bytes] = OrderedDict()
_PASSED_LOCK = threading.Lock()
_PASSED_KEPT = 512


def _passed(folder: str, path: str, content: bytes) -> bytes:
    """`content` when it passes `checked_record`; when it is refused, the bytes of this record that last passed here.

    Prefect reads a record twice: once to see whether it exists, once to use it. A record another writer replaces
    between those reads (on shared storage) could pass the first and be refused at the second, failing the step
    instead of recomputing it. The second read is then answered with the bytes the first one checked: what Prefect
    decodes is always bytes that passed, and a refused record with none kept reads as no record."""
    where = (str(folder), str(path))
    try:
        checked_record(content, path)
    except RefusedRecord as e:
        with _PASSED_LOCK:
            kept = _PASSED.get(where)
        if kept is None:
            log.warning("cache: %s, unread; the step recomputes", e)
            raise
        log.warning("cache: %s; the copy checked at its previous read is used", e)
        return kept
    with _PASSED_LOCK:
        _PASSED[where] = content
        _PASSED.move_to_end(where)
        while len(_PASSED) > _PASSED_KEPT:
            _PASSED.popitem(last=False)
    return content


def forget(folder: str, key: str) -> None:
    """Drops the kept copy of a record (it was dropped as stale): a refused read of it is no record again."""
    with _PASSED_LOCK:
        _PASSED.pop((str(folder), str(key)), None)


class _Checked:
    """The read of `CheckedLocalResults` and `CheckedRemoteResults`: only bytes that passed `checked_record`."""

    async def aread_path(self, path: str) -> bytes:
        return _passed(self.basepath, path, await super().aread_path(path))

    @async_dispatch(aread_path)
    def read_path(self, path: str) -> bytes:
        return _passed(self.basepath, path, super().read_path(path, _sync=True))


class CheckedLocalResults(_Checked, LocalFileSystem):
    """The results store on a local root: a record is handed to Prefect only as `checked_record` passed it."""

    _block_type_name = "Shardline results (local)"
    _block_type_slug = "shardline-local-results"


class CheckedRemoteResults(_Checked, RemoteFileSystem):
    """The results store on a remote root (S3, ...): as `CheckedLocalResults`."""

    _block_type_name = "Shardline results (remote)"
    _block_type_slug = "shardline-remote-results"


@dataclass
class StepCache(CachePolicy):
    rule: CacheRule | None = None
    results_root: str = ""

    def compute_key(
        self, task_ctx, inputs: dict[str, Any], flow_parameters: dict[str, Any], **kwargs: Any
    ) -> str | None:
        rule = self.rule
        try:
            decided_by = rule.key(inputs)
        except Exception as e:
            if (said := unreachable(e)) is not None:  # Prefect logs it (a traceback): as the step will say it
                raise said from e
            raise
        key = f"{rule.step}-" + hash_objects(rule.step, code_version_of(*rule.code), decided_by)
        if not getattr(task_ctx.task, "refresh_cache", False):
            self._drop_if_stale(task_ctx, key, inputs)
        return key

    def _drop_if_stale(self, task_ctx, key: str, inputs: dict[str, Any]) -> None:
        """Reads the record once, checked (kept in the store's memory: the step uses that copy), and drops it when
        what it points to is gone or changed."""
        store = task_ctx.result_store
        try:
            if not store.exists(key):  # a record refused by `checked_record` is none
                return
            value = store.read(key).result
        except Exception as e:  # noqa: BLE001 - an unreadable record is as good as none
            log.warning("cache: record %s unreadable (%s); recomputing %s", key, e, self.rule.step)
            self._drop(key)
            return
        try:
            ok = self.rule.still_valid is None or self.rule.still_valid(value, inputs)
        except Exception as e:  # noqa: BLE001 - a check that fails counts as stale
            ok = False
            log.warning("cache: checking %s failed (%s)", key, e)
        if not ok:
            log.warning("cache: what the cached %s result points to is gone or changed; recomputing", self.rule.step)
            self._drop(key)
            store.cache.clear()

    def _drop(self, key: str) -> None:
        forget(self.results_root, key)
        storage.delete(storage.join(self.results_root, key))


# the results block each (Prefect API, results folder) was saved as in this process: saved once, then handed to
# every step as the block itself (a slug would be looked up again, and a save rewritten, for every task run)
_SAVED: dict[tuple[str, str], CheckedLocalResults | CheckedRemoteResults] = {}
_SAVED_LOCK = threading.Lock()


def results_storage(root: str) -> tuple[CheckedLocalResults | CheckedRemoteResults, str]:
    """Where the task results live: a folder under the storage root, as a saved block of ours that checks every
    record it hands Prefect (`checked_record`). The block, and the folder's URI."""
    from prefect.settings import PREFECT_API_URL

    uri = layout.results(root)
    if storage.is_remote(uri):
        block = CheckedRemoteResults(basepath=uri)
    else:
        path = Path(storage.local_path(uri)).resolve()
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # the first write under the root: said as the setting, not as a traceback
            raise ValueError(
                f"storage.root {root}: cannot make the folder {path} ({e.strerror or e}); set storage.root to a "
                "folder this machine can write (`shardline doctor CONFIG` checks it)"
            ) from e
        uri, block = str(path), CheckedLocalResults(basepath=str(path))
    with _SAVED_LOCK:
        where = (str(PREFECT_API_URL.value()), uri)
        if where not in _SAVED:
            name = "shardline-results-" + hash_objects(uri)[:12]
            try:
                block.save(name, overwrite=True)
            except ObjectAlreadyExists:
                # Prefect registers the block type by a read, then a create: another command starting on the same
                # new database created it in between (a 409). It is there now, and the second save finds it
                block.save(name, overwrite=True)
            _SAVED[where] = block
        return _SAVED[where], uri


def cached(task, rule: CacheRule, root: str, refresh: bool = False):
    """`task` with the content-addressed, JSON-persisted cache its `rule` declares, under `root`."""
    block, results_root = results_storage(root)
    return task.with_options(
        cache_policy=StepCache(rule=rule, results_root=results_root),
        persist_result=True,
        result_storage=block,
        result_serializer="json",
        refresh_cache=refresh,
    )


def run_cached(task, rule: CacheRule, root: str, refresh: bool, *args) -> tuple[Any, bool]:
    """Run `task(*args)` through its cache: (its result, whether it ran rather than came from the cache)."""
    state = cached(task, rule, root, refresh)(*args, return_state=True)
    return state.result(), state.name != "Cached"


def raw_files_key(files) -> list:
    return [(f.uri, f.size, f.version) for f in files]
