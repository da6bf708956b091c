"""Checkpoints: tensors in `ckpt-{step:09d}.pt`, a readable JSON sidecar beside each, a `best.json` pointer.

Write order makes every reader safe without locks:
  1. `ckpt-N.pt`   (atomic: temp file + rename locally, one PUT on object stores)
  2. `ckpt-N.json` (records the .pt's sha256 and size; a checkpoint exists only once this exists and matches)
  3. `best.json`   (when this one is the best so far)
  4. pruning: older checkpoints beyond the newest `keep` (the best is always kept), sidecar first.
A process killed anywhere in that sequence leaves at worst a .pt without a sidecar (ignored, pruned
later), a stale `best.json` (`point_best` repairs it on resume) or a temp file (`remove_temp_files`).
Works on local paths and fsspec URLs. Loading is `torch.load(..., weights_only=True)`: no pickles.
"""

from __future__ import annotations

import copy
import datetime as dt
import hashlib
import io
import json
import os
import re
from pathlib import Path

import torch

from shardline.core import storage

FORMAT_VERSION = 1
BEST = "best.json"
_SIDECAR = re.compile(r"^ckpt-(\d{9})\.json$")
_TENSORS = re.compile(r"^ckpt-(\d{9})\.pt$")


def checkpoint_name(step: int) -> str:
    return f"ckpt-{step:09d}.pt"


def checkpoint_step(uri: str) -> int:
    """The optimizer step of a checkpoint, from its name (`.../ckpt-000000040.pt` -> 40)."""
    found = _TENSORS.match(uri.rstrip("/").rsplit("/", 1)[-1])
    if found is None:
        raise ValueError(f"{uri} is not a checkpoint's name (ckpt-<step>.pt)")
    return int(found.group(1))


def sidecar_uri(pt_uri: str) -> str:
    return pt_uri[: -len(".pt")] + ".json"


def _read_json(uri: str) -> dict | None:
    try:
        return json.loads(storage.read_text(uri))
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return None


def _steps(dir_uri: str, names: list[str] | None = None) -> list[int]:
    """Steps that have a sidecar, newest first (complete or not: see `_verified`), from the folder's listing
    `names` when the caller has it."""
    names = storage.names(dir_uri) if names is None else names
    return sorted((int(m.group(1)) for n in names if (m := _SIDECAR.match(n))), reverse=True)


def _verified(dir_uri: str, name: str) -> tuple[str, dict] | None:
    """(pt uri, sidecar) when `name`'s sidecar exists and its .pt is present with the recorded size and checksum."""
    pt_uri = storage.join(dir_uri, name)
    side = _read_json(sidecar_uri(pt_uri))
    if not side or side.get("file") != name or not storage.exists(pt_uri):
        return None
    if storage.sha256_uri(pt_uri) != side.get("sha256"):
        return None
    return pt_uri, side


def snapshot(tree):
    """A copy of `tree` on the CPU that training can no longer change, for a checkpoint written while training goes
    on: every tensor's storage copied once (tensors that share one, tied weights or views, still share it, so
    `torch.save` writes the same bytes as from the live state), containers rebuilt (a state dict's `_metadata`
    kept), other values deep-copied."""
    copies: dict = {}

    def copy_of(x):
        if isinstance(x, torch.Tensor):
            if type(x) is not torch.Tensor or x.layout != torch.strided:
                return x.detach().to("cpu", copy=True)
            src = x.untyped_storage()
            key = (src.device, src.data_ptr())
            if key not in copies:
                copies[key] = src.clone() if src.device.type == "cpu" else src.cpu()
            out = torch.empty(0, dtype=x.dtype).set_(copies[key], x.storage_offset(), x.size(), x.stride())
            return out.requires_grad_(x.requires_grad)
        if isinstance(x, dict):
            out = type(x)((k, copy_of(v)) for k, v in x.items())
            if hasattr(x, "_metadata"):
                out._metadata = copy.deepcopy(x._metadata)
            return out
        if isinstance(x, list | tuple):
            return type(x)(copy_of(v) for v in x)
        return copy.deepcopy(x)

    return copy_of(tree)


def state_bytes(tree) -> int:
    """The bytes of the tensors in `tree`, each storage counted once."""
    held = {}
    stack = [tree]
    while stack:
        x = stack.pop()
        if isinstance(x, torch.Tensor):
            held[(x.untyped_storage().device, x.untyped_storage().data_ptr())] = x.untyped_storage().nbytes()
        elif isinstance(x, dict):
            stack.extend(x.values())
        elif isinstance(x, list | tuple):
            stack.extend(x)
    return sum(held.values())


def save_checkpoint(dir_uri: str, step: int, state: dict, meta: dict, is_best: bool, keep: int) -> str:
    """Write checkpoint `step` (tensors `state`, sidecar from `meta`), point best.json at it when `is_best`,
    prune to the newest `keep` plus the best. Returns the .pt URI."""
    buf = io.BytesIO()
    torch.save(state, buf)
    data = buf.getbuffer()  # no second copy of the bytes (a 100M-parameter model's checkpoint is ~1 GB)
    name = checkpoint_name(step)
    pt_uri = storage.join(dir_uri, name)
    storage.write_bytes(pt_uri, data)
    sidecar = {
        **meta,
        "format": FORMAT_VERSION,
        "step": step,
        "file": name,
        "sha256": hashlib.sha256(data).hexdigest(),
        "bytes": len(data),
        "saved_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
    }
    storage.write_text(sidecar_uri(pt_uri), json.dumps(sidecar, indent=2, sort_keys=True))
    if is_best:
        _write_best(dir_uri, sidecar)
    prune_checkpoints(dir_uri, keep)
    return pt_uri


def _write_best(dir_uri: str, sidecar: dict) -> None:
    pointer = {k: sidecar.get(k) for k in ("file", "step", "sha256", "best_score")}
    storage.write_text(storage.join(dir_uri, BEST), json.dumps(pointer, indent=2, sort_keys=True))


def point_best(dir_uri: str, name: str) -> bool:
    """Make best.json name checkpoint `name` unless it already does (a save killed between its sidecar and
    best.json leaves the pointer one best behind). False when `name` is not a complete checkpoint."""
    pointer = _read_json(storage.join(dir_uri, BEST)) or {}
    found = _verified(dir_uri, name)
    if found is None:
        return False
    if pointer.get("file") != name or pointer.get("sha256") != found[1].get("sha256"):
        _write_best(dir_uri, found[1])
    return True


def remove_temp_files(dir_uri: str) -> list[str]:
    """Delete the temp files of local writes that a killed process left in a checkpoint folder (its only
    writer must be the caller). Object stores have none: their puts are atomic."""
    folder = Path(storage.local_path(dir_uri))
    if storage.is_remote(dir_uri) or not folder.is_dir():
        return []
    stale = sorted(n for n in os.listdir(folder) if n.startswith(storage.TMP_MARK))
    for n in stale:
        (folder / n).unlink(missing_ok=True)
    return stale


def prune_checkpoints(dir_uri: str, keep: int) -> None:
    """Delete all but the newest `keep` checkpoints and the best (sidecar first, so none looks complete
    while half-deleted), plus stray .pt files older than the newest kept."""
    best = (_read_json(storage.join(dir_uri, BEST)) or {}).get("file")
    names = storage.names(dir_uri)  # one listing (a request on an object store) for both passes
    sidecar_steps = _steps(dir_uri, names)
    kept = {checkpoint_name(s) for s in sidecar_steps[:keep]} | ({best} if best else set())
    newest = sidecar_steps[0] if sidecar_steps else -1
    for step in sidecar_steps[keep:]:
        name = checkpoint_name(step)
        if name in kept:
            continue
        pt_uri = storage.join(dir_uri, name)
        storage.delete(sidecar_uri(pt_uri))
        storage.delete(pt_uri)
    for n in names:  # .pt without a sidecar: a save that died between the two writes
        m = _TENSORS.match(n)
        if m and n not in kept and int(m.group(1)) < newest and int(m.group(1)) not in sidecar_steps:
            storage.delete(storage.join(dir_uri, n))


def latest_checkpoint(dir_uri: str) -> tuple[str, dict] | None:
    """The newest complete checkpoint as (pt uri, sidecar); ones with a missing or damaged .pt are skipped."""
    for step in _steps(dir_uri):
        found = _verified(dir_uri, checkpoint_name(step))
        if found:
            return found
    return None


def best_checkpoint(dir_uri: str) -> tuple[str, dict] | None:
    """The checkpoint best.json names, as (pt uri, sidecar), when it is complete."""
    pointer = _read_json(storage.join(dir_uri, BEST))
    if not pointer or not _TENSORS.match(str(pointer.get("file", ""))):
        return None
    return _verified(dir_uri, pointer["file"])


def load_checkpoint(uri: str) -> dict:
    """The tensors and plain data of a checkpoint, on the CPU; checked against its sidecar when it has one."""
    data = storage.read_bytes(uri)
    side = _read_json(sidecar_uri(uri)) if uri.endswith(".pt") else None
    if side and side.get("sha256") and hashlib.sha256(data).hexdigest() != side["sha256"]:
        # its sidecar goes: no cache check or resume takes the damaged file for a checkpoint again
        storage.delete(sidecar_uri(uri))
        raise OSError(
            f"{uri}: checksum does not match its sidecar ({side['sha256'][:12]}): the file is damaged or "
            "half-written; its sidecar is removed, so running the pipeline again recomputes what it held "
            "(training resumes from the newest intact checkpoint)"
        )
    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)


def weights_checksum(uri: str) -> str:
    """The sha256 of a checkpoint's model weights alone (each tensor's name, type, shape and values): the same for
    the same weights, whatever else the file holds (its MLflow run, timings, the optimizer's and RNGs' state)."""
    digest = hashlib.sha256()
    for name, value in sorted(load_checkpoint(uri)["model"].items()):
        if isinstance(value, torch.Tensor):
            digest.update(f"{name}:{value.dtype}:{tuple(value.shape)};".encode())
            digest.update(value.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        else:  # a module's extra state
            digest.update(f"{name}={value!r};".encode())
    return digest.hexdigest()


def clear_checkpoints(dir_uri: str) -> list[str]:
    """Delete every checkpoint file and best.json in `dir_uri` (a fresh run in a used folder)."""
    deleted = []
    names = storage.names(dir_uri)
    for n in [BEST, *[n for n in names if _SIDECAR.match(n)], *[n for n in names if _TENSORS.match(n)]]:
        if n in names:
            storage.delete(storage.join(dir_uri, n))
            deleted.append(n)
    return deleted
