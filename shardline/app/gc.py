"""`shardline gc CONFIG`: delete the data sets, training runs and cached results that nothing refers to.

Only three folders of the storage root are ever touched: `datasets/`, `runs/` and `prefect-results/`.
The raw data, the MLflow store (its database and artifacts) and anything else under the root are not.

What refers to what is read from the files and the registry, never guessed from names:

- a registered model version (of any model in the config's MLflow store) records its MLflow run id,
  which the training run's folder records too (`mlflow-run.json`), and the data it was trained on as
  tags (`shardline.data_fingerprint`, `shardline.encoding_hash`), which that data set's manifest holds;
- a training run records the manifest it trained on (`run_meta.manifest` in its checkpoints'
  sidecars) and the model it was fine-tuned from (`parent` in `result.json`, `training.init_from`);
- a cached result under `prefect-results/` records manifest URIs, run folders and checkpoint paths,
  or, for an encoded file group, its shards by name, size and checksum;
- a live flow run (scheduled, pending, running, paused or cancelling) of `pipeline` or `train` names
  its config, and the training flow its manifest and run folder.

Kept: what a registered version refers to, the `keep` newest runs (by their newest file), anything
modified within `recent_minutes` (in use; 24 h when the Prefect API cannot be asked), what a live
flow run uses, and the data sets and parent runs of everything kept. Deleted: the other data sets and
runs and the cached results that point at one of them.

Deletes go pointers first, so a gc killed at any moment leaves nothing that reads as complete and is
not: the cached results that point at a doomed folder, then each run's `result.json`, `best.json` and
checkpoint sidecars (without them no checkpoint exists: a rerun would train afresh, never resume from
a half-deleted one), then each data set's manifests (without one the shards are not a data set), then
the rest of the files, then the empty folders. Each folder is listed again just before it goes: one
written to since it was planned is kept.
"""

from __future__ import annotations

import datetime as dt
import re
import time
from collections.abc import Callable
from dataclasses import dataclass

from shardline.app.gc_usage import (
    _SIDECAR,
    GcError,
    Item,
    Locator,
    _dataset,
    _group_shards,
    _holds,
    _listing,
    _real,
    _record_value,
    _run,
    _strings,
    in_use_by_flow_runs,
    registered_versions,
)
from shardline.core import layout, storage
from shardline.core.config import PipelineConfig
from shardline.core.layout import DATASETS, GROUPS, RESULTS, RUNS
from shardline.core.metrics.report import format_duration

AREAS = (DATASETS, RUNS, RESULTS)
DEFAULT_RECENT_MINUTES = 60
UNREACHABLE_RECENT_MINUTES = 24 * 60  # when the Prefect API cannot say which flow runs are live


@dataclass
class Plan:
    root: str
    delete: list[Item]
    keep: list[Item]
    unreadable: list[Item]  # cached results that could not be parsed: left alone
    notes: list[str]

    @property
    def bytes(self) -> int:
        return sum(i.bytes for i in self.delete)


# ---------------------------------------------------------------- listing the storage root


def _mtime(info: dict) -> float | None:
    t = info.get("mtime") or info.get("LastModified") or info.get("last_modified") or info.get("updated")
    if isinstance(t, dt.datetime):
        return t.timestamp()
    if isinstance(t, str):
        try:
            return dt.datetime.fromisoformat(t.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
    return float(t) if t is not None else None


def _folders(area_uri: str, kind: str, now: float) -> list[Item]:
    """Every folder directly under `area_uri` with its files (one recursive listing)."""
    items: dict[str, Item] = {}
    for e in _listing(area_uri):
        if e.get("type") == "directory":
            name = e["name"].rstrip("/").rsplit("/", 1)[-1]
            items[name] = Item(kind, storage.join(area_uri, name), [], _mtime(e) or now)
    if not items:
        return []
    fs, base = storage.filesystem(area_uri)
    for path, info in fs.find(base, detail=True, withdirs=False).items():
        rel = path[len(base.rstrip("/")) :].strip("/")
        top, _, rest = rel.partition("/")
        if not rest or top not in items:
            continue  # a file directly under the area is no data set or run: left alone
        when = _mtime(info)
        items[top].files.append((storage.join(area_uri, rel), int(info.get("size") or 0), when))
    for item in items.values():
        times = [f[2] if f[2] is not None else now for f in item.files]  # no time said: counts as now
        if times:
            item.newest = max(times)
    return sorted(items.values(), key=lambda i: i.name)


def _scan(root: str, now: float, kinds=("data set", "file group", "run")) -> list[Item]:
    """Every folder of these kinds in the root (the group store is no data set)."""
    areas = {"data set": layout.datasets(root), "file group": layout.group_store(root), "run": layout.runs(root)}
    found = [i for k in kinds for i in _folders(areas[k], k, now)]
    return [i for i in found if not (i.kind == "data set" and i.name == GROUPS)]


def _records(area_uri: str, now: float) -> list[Item]:
    out = []
    for e in _listing(area_uri):
        name = e["name"].rstrip("/").rsplit("/", 1)[-1]
        if e.get("type") != "file" or name.startswith(storage.TMP_MARK):  # a write in progress
            continue
        uri = storage.join(area_uri, name)
        when = _mtime(e)
        out.append(Item("cached result", uri, [(uri, int(e.get("size") or 0), when)], when or now))
    return sorted(out, key=lambda i: i.name)


# ---------------------------------------------------------------- the plan


def _source_base(source: str) -> str:
    """The folder part of `data.source` before any glob character."""
    cut = min([source.index(c) for c in "*?[" if c in source] or [len(source)])
    base = source[:cut]
    return base.rsplit("/", 1)[0] if cut < len(source) else base


def plan_gc(
    config: PipelineConfig,
    keep: int,
    recent_minutes: float = DEFAULT_RECENT_MINUTES,
    now: float | None = None,
    log: Callable[[str], None] = lambda m: None,
) -> Plan:
    """What gc would delete and keep, with the reason for each; deletes nothing."""
    root = config.storage.root.rstrip("/")
    now = time.time() if now is None else now
    notes: list[str] = []
    locate = Locator(root)
    found = _scan(root, now)
    foreign = [i for i in found if not _is_ours(i)]  # a folder of someone else's under datasets/ or runs/
    for item in foreign:
        item.why = "not Shardline's (no manifest, group record, shards, checkpoint or result in it): left alone"
    ours = [i for i in found if i not in foreign]
    datasets = {i.name: _dataset(i) for i in ours if i.kind == "data set"}
    groups = {i.name: i for i in ours if i.kind == "file group"}
    runs = {i.name: _run(i) for i in ours if i.kind == "run"}
    records = _records(layout.results(root), now)

    log("reading the model registry ...")
    versions = registered_versions(config)

    log("asking the Prefect API for live flow runs ...")
    try:
        in_use, keep_all, said = in_use_by_flow_runs(root, locate, list(runs))
        notes += said
    except ConnectionError as e:
        in_use, keep_all = {}, None
        recent_minutes = max(recent_minutes, UNREACHABLE_RECENT_MINUTES)
        notes.append(
            f"the Prefect API could not be asked which flow runs are live ({e}): kept everything modified in "
            f"the last {format_duration(recent_minutes * 60)}"
        )

    kept_runs: dict[str, str] = {}
    kept_data: dict[str, str] = {}
    by_run_id = {r.mlflow_run_id: name for name, r in runs.items() if r.mlflow_run_id}
    for v in versions:
        what = f"registered: {v['name']} v{v['version']}" + "".join(f" @{a}" for a in sorted(v["aliases"]))
        if v["run_id"] in by_run_id:
            kept_runs.setdefault(by_run_id[v["run_id"]], what)
        tags = v["tags"]
        data = (tags.get("shardline.data_fingerprint"), tags.get("shardline.encoding_hash"))
        for name, ds in datasets.items():
            if data in ds.data:
                kept_data.setdefault(name, f"{what} was trained on it")
        parent = locate.find(tags.get("shardline.parent_checkpoint") or "")
        if parent and parent[0] == RUNS:
            kept_runs.setdefault(parent[1], f"{what} was fine-tuned from it")
    cutoff = now - recent_minutes * 60

    def recent(item: Item) -> str | None:
        return f"in use: modified {format_duration(now - item.newest)} ago" if item.newest >= cutoff else None

    newest_first = sorted(runs, key=lambda n: runs[n].item.newest, reverse=True)
    for i, name in enumerate(newest_first):
        newest = f"one of the {keep} newest runs" if i < keep else keep_all
        why = in_use.get((RUNS, name)) or recent(runs[name].item) or newest
        if why:
            kept_runs.setdefault(name, why)
    for name, ds in datasets.items():
        why = in_use.get((DATASETS, name)) or recent(ds.item) or keep_all
        if why:
            kept_data.setdefault(name, why)
    todo = list(kept_runs)
    while todo:  # what kept runs read: their data sets and the runs they were fine-tuned from
        name = todo.pop()
        run = runs[name]
        where = locate.find(run.manifest or "")
        if where and where[0] == DATASETS:
            kept_data.setdefault(where[1], f"kept run {name} trained on it")
        elif run.manifest is None and run.item.newest >= cutoff:
            for other in datasets:  # in use and not yet saying which data it reads: keep them all
                kept_data.setdefault(other, f"run {name} is in use and does not yet record its data set")
        for parent in run.parents:
            where = locate.find(parent)
            if where and where[0] == RUNS and where[1] in runs and where[1] not in kept_runs:
                kept_runs[where[1]] = f"kept run {name} was fine-tuned from it"
                todo.append(where[1])

    keep_items, delete_items = list(foreign), []
    for folders, kept, unkept in (
        (runs, kept_runs, f"no registered version's run; not one of the {keep} newest runs (--keep)"),
        (datasets, kept_data, "no kept run trained on it and no registered version's data is it"),
    ):
        for name, folder in folders.items():
            if name in kept:
                folder.item.why = kept[name]
                keep_items.append(folder.item)
            else:
                age = format_duration(now - folder.item.newest)
                folder.item.why = f"{unkept}; last modified {age} ago; no live flow run uses it"
                delete_items.append(folder.item)

    # the group store: a file group's shards stay while any kept data set's manifest lists them
    kept_groups: dict[str, str] = {}
    for name in kept_data:
        for key in datasets[name].groups:
            kept_groups.setdefault(key, f"kept data set {name} lists its shards")
    for key, item in groups.items():
        item.why = kept_groups.get(key) or recent(item) or keep_all or ""
        if item.why:
            keep_items.append(item)
        else:
            item.why = f"no kept data set lists its shards; last modified {format_duration(now - item.newest)} ago"
            delete_items.append(item)

    doomed = {i.uri: i for i in delete_items}
    unreadable, stale = [], []
    for rec in records:
        value, problem = _record_value(rec.uri)
        if problem:
            rec.why = problem
            unreadable.append(rec)
            continue
        shards = _group_shards(value)
        key = (value.get("data") or {}).get("key") if shards is not None else None
        if key:  # an encoded group in the group store
            rec.refs = {groups[key].uri} if key in groups else set()
        elif shards is not None:
            rec.refs = {ds.item.uri for ds in datasets.values() if _holds(ds, shards)}
        else:
            for s in _strings(value):
                where = locate.find(s)
                if where and where[1] in (datasets if where[0] == DATASETS else runs):
                    rec.refs.add(storage.join(root, *where))
        gone = sorted(u for u in rec.refs if u in doomed)
        if gone:
            rec.why = "points at " + ", ".join(u[len(root) + 1 :] for u in gone) + ", which goes too"
            stale.append(rec)
    delete_items = stale + delete_items  # in the order they go: the pointers first
    _check_inside(root, config.data.source, delete_items)
    return Plan(root, delete_items, keep_items, unreadable, notes)


def _check_inside(root: str, source: str, items: list[Item]) -> None:
    """Our own invariant, checked before anything goes, on the real places (whatever spelling of the root or the
    data source): only files under datasets/, runs/ and prefect-results/ of the root, none of the raw data."""
    prefixes = [_real(storage.join(root, area)).rstrip("/") + "/" for area in AREAS]
    base = _source_base(source).rstrip("/")
    raw = _real(base).rstrip("/") if base else ""
    for item in items:
        for uri, _, _ in item.files:
            real = _real(uri)
            if not any(real.startswith(p) for p in prefixes):
                raise GcError(f"refusing to delete {uri}: it is not under {', '.join(prefixes)}")
            if raw and (real.startswith(raw + "/") or real == raw):
                raise GcError(f"refusing to delete {uri}: it is raw data (data.source {source})")


# what only Shardline writes in each kind of folder: a folder without one is someone else's, left alone
_OURS = {
    "run": re.compile(
        r"^(result\.json|cost\.json|mlflow-run\.json|lease/gen-\d+\.json|checkpoints/ckpt-\d+\.(pt|json))$"
    ),
    "data set": re.compile(r"^manifest(-[0-9a-f]+)?\.json$"),
    "file group": re.compile(r"^(group\.json|[\w-]+\.(bin(\.\w+)?|keys\.parquet))$"),
}


def _is_ours(item: Item) -> bool:
    """Whether Shardline wrote the folder: it holds a manifest, a group record or shards, a checkpoint, a result."""
    return any(_OURS[item.kind].match(uri[len(item.uri) + 1 :]) for uri, _, _ in item.files)


# ---------------------------------------------------------------- deleting


def deletion_order(item: Item) -> list[str]:
    """The files of a data set, run or file group, pointers first (why: the module's docstring)."""

    def rank(uri: str) -> int:
        rel = uri[len(item.uri) + 1 :]
        if rel == "result.json":
            return 0
        if rel == "checkpoints/best.json":
            return 1
        manifest = "/" not in rel and rel.startswith("manifest") and rel.endswith(".json")
        if _SIDECAR.search(rel) or manifest or rel == "group.json":  # group.json: written last by the encode
            return 2
        return 3

    return sorted((f[0] for f in item.files), key=lambda u: (rank(u), u))


def _remove_empty_folders(item: Item) -> None:
    """Local folders left empty, deepest first (object stores have none). One that is not empty (written
    meanwhile) stays."""
    if storage.is_remote(item.uri):
        return
    fs, top = storage.filesystem(item.uri)
    folders = {top}
    for uri, _, _ in item.files:
        rel = uri[len(item.uri) + 1 :].split("/")[:-1]
        folders.update("/".join([top, *rel[:i]]) for i in range(1, len(rel) + 1))
    for folder in sorted(folders, key=lambda f: -f.count("/")):
        try:
            fs.rmdir(folder)
        except OSError:
            pass


def _kept_after_all(item: Item, listed: dict, in_use: dict, keep_all: str | None, lists: dict[str, str]) -> bool:
    """Whether a folder the plan deletes stays after all (item.why then says why)."""
    again = listed.get((item.kind, item.name))
    area = {"data set": DATASETS, "run": RUNS}.get(item.kind)
    if again is not None and (again.newest > item.newest or len(again.files) != len(item.files)):
        item.why = "written to while gc ran: kept"
    elif (area, item.name) in in_use or keep_all:
        item.why = f"{in_use.get((area, item.name)) or keep_all} (since gc looked): kept"
    elif item.name in lists:
        item.why = f"data set {lists[item.name]} lists its shards (since gc looked): kept"
    else:
        return False
    return True


def _groups_listed(listed: dict, folders: list[Item], changed: list[Item]) -> dict[str, str]:
    """{file group: a data set that lists it} over the data sets that stay: not planned to go, kept after all,
    or written since gc looked (an encode that took a stored group)."""
    going = {i.name for i in folders if i.kind == "data set" and i not in changed}
    lists: dict[str, str] = {}
    for (kind, name), item in sorted(listed.items()):
        if kind == "data set" and name not in going:
            for key in _dataset(item).groups:
                lists.setdefault(key, name)
    return lists


def apply_plan(plan: Plan, now: float | None = None, log: Callable[[str], None] = lambda m: None) -> Plan:
    """Delete what the plan says, pointers first; returns the plan of what was really deleted. Just
    before, each folder is listed again and the live flow runs asked again: a folder written to or taken
    into use since it was planned is kept, with the cached results that point at it, and so is a file group
    a data set that stays lists."""
    now = time.time() if now is None else now
    folders = [i for i in plan.delete if i.kind != "cached result"]
    kinds = {f.kind for f in folders} | ({"data set"} if any(f.kind == "file group" for f in folders) else set())
    listed = {(i.kind, i.name): i for i in _scan(plan.root, now, kinds)}
    try:
        runs = [i.name for i in folders if i.kind == "run"]
        in_use, keep_all, _ = in_use_by_flow_runs(plan.root, Locator(plan.root), runs)
    except ConnectionError:
        in_use, keep_all = {}, None  # as when planned: the recent-modification window stood in for it
    changed = [i for i in folders if i.kind != "file group" and _kept_after_all(i, listed, in_use, keep_all, {})]
    groups = [i for i in folders if i.kind == "file group"]
    lists = _groups_listed(listed, folders, changed) if groups else {}  # once the data sets are known
    changed += [i for i in groups if _kept_after_all(i, listed, in_use, keep_all, lists)]
    kept_uris = {i.uri for i in changed}
    records = [r for r in plan.delete if r.kind == "cached result" and not (r.refs & kept_uris)]
    folders = [i for i in folders if i.uri not in kept_uris]
    for rec in plan.delete:
        if rec.kind == "cached result" and rec not in records:
            rec.why = "points at a folder kept after all: kept"
    for rec in records:
        storage.delete(rec.uri)
    for kind in ("run", "data set", "file group"):  # a group's shards after the manifests that list them
        for item in (i for i in folders if i.kind == kind):
            log(f"deleting {item.uri} ...")
            for uri in deletion_order(item):
                storage.delete(uri)
            _remove_empty_folders(item)
    done = records + folders
    skipped = [i for i in plan.delete if i not in done]
    return Plan(plan.root, done, plan.keep + skipped, plan.unreadable, plan.notes)


# ---------------------------------------------------------------- the report


def human(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _table(items: list[Item], why: str, root: str) -> list[str]:
    rows = [("kind", "path", "size", why)] + [(i.kind, i.uri[len(root) + 1 :], human(i.bytes), i.why) for i in items]
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return ["  " + "  ".join([*(c.ljust(w) for c, w in zip(r, widths)), r[-1]]).rstrip() for r in rows]


def report(plan: Plan, dry_run: bool) -> str:
    """What was (or, dry run, would be) deleted, with kind, path, size and why; the totals; what was kept
    and why; the cached results left alone; the notes on what could not be checked."""
    rel = lambda uri: uri[len(plan.root) + 1 :]
    lines = [f"storage root {plan.root}", ""]
    verb = "would delete (dry run: nothing is deleted)" if dry_run else "deleted"
    if plan.delete:
        lines += [f"{verb}:", *_table(plan.delete, "why unreferenced", plan.root)]
    else:
        lines.append("nothing to delete: everything is referenced, recent or in use")
    lines.append(
        f"total: {len(plan.delete)} item(s), {plan.bytes:,} bytes ({human(plan.bytes)}) "
        + ("would be freed" if dry_run else "freed")
    )
    if plan.keep:
        lines += ["", "kept:", *_table(plan.keep, "why", plan.root)]
    if plan.unreadable:
        lines += ["", "left alone (cached results that could not be parsed):"]
        lines += [f"  {rel(i.uri)}  {human(i.bytes)}  {i.why}" for i in plan.unreadable]
    lines += [f"\nnote: {n}" for n in plan.notes]
    return "\n".join(lines)
