"""The storage root: local paths or any fsspec URL (s3:// through s3fs), written atomically.

Local writes go to a temporary name beside the target and are renamed into place; object-store
puts are atomic per object, and a reader trusts only what a manifest (written last) lists.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
import uuid
from pathlib import Path

import fsspec
from fsspec.core import url_to_fs

TMP_MARK = ".tmp-"


def is_remote(uri: str) -> bool:
    return "://" in uri and not uri.startswith("file://")


def local_path(uri: str) -> str:
    return uri[len("file://"):] if uri.startswith("file://") else uri


def join(root: str, *parts: str) -> str:
    root = root.rstrip("/")
    return "/".join([root, *[p.strip("/") for p in parts if p]])


def filesystem(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    return url_to_fs(uri)


def exists(uri: str) -> bool:
    if not is_remote(uri):
        return os.path.exists(local_path(uri))
    fs, path = filesystem(uri)
    return fs.exists(path)


def read_bytes(uri: str) -> bytes:
    if not is_remote(uri):
        return Path(local_path(uri)).read_bytes()
    fs, path = filesystem(uri)
    return fs.cat_file(path)


def read_text(uri: str) -> str:
    return read_bytes(uri).decode()


def write_bytes(uri: str, data: bytes) -> None:
    """Write `data` to `uri` so that a reader sees either the old object or the complete new one."""
    if is_remote(uri):
        fs, path = filesystem(uri)
        fs.pipe_file(path, data)
        return
    target = Path(local_path(uri))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{TMP_MARK}{uuid.uuid4().hex}-{target.name}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def write_text(uri: str, text: str) -> None:
    write_bytes(uri, text.encode())


def publish_file(local_src: str | Path, uri: str) -> None:
    """Move a finished local file to `uri` atomically (rename locally, upload then done remotely)."""
    local_src = Path(local_src)
    if is_remote(uri):
        fs, path = filesystem(uri)
        fs.put_file(str(local_src), path)
        local_src.unlink(missing_ok=True)
        return
    target = Path(local_path(uri))
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(local_src, target)
    except OSError:  # another device: copy aside, then rename
        tmp = target.with_name(f"{TMP_MARK}{uuid.uuid4().hex}-{target.name}")
        shutil.copyfile(local_src, tmp)
        os.replace(tmp, target)
        local_src.unlink(missing_ok=True)


def staging_path(uri: str, suffix: str = "") -> Path:
    """A private local file to build an output in before `publish_file`: beside the target when local."""
    if not is_remote(uri):
        target = Path(local_path(uri))
        target.parent.mkdir(parents=True, exist_ok=True)
        return target.with_name(f"{TMP_MARK}{uuid.uuid4().hex}-{target.name}{suffix}")
    fd, name = tempfile.mkstemp(prefix="shardline-", suffix=suffix)
    os.close(fd)
    return Path(name)


def sha256_file(path: str | Path, chunk: int = 8 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_uri(uri: str) -> str:
    if not is_remote(uri):
        return sha256_file(local_path(uri))
    fs, path = filesystem(uri)
    h = hashlib.sha256()
    with fs.open(path, "rb") as f:
        while block := f.read(8 << 20):
            h.update(block)
    return h.hexdigest()


def cache_dir() -> Path:
    return Path(os.environ.get("SHARDLINE_CACHE", Path.home() / ".cache" / "shardline"))


def fetch_verified(uri: str, sha256: str) -> Path:
    """A local path holding the exact bytes of `uri` (checked against `sha256`).

    Local files are used in place; remote ones are copied into the local cache (by checksum, so a
    verified copy is reused by every later run on this machine).
    """
    if not is_remote(uri):
        return Path(local_path(uri))
    dest = cache_dir() / "objects" / sha256[:2] / sha256
    if dest.exists():
        return dest
    fs, path = filesystem(uri)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f"{TMP_MARK}{uuid.uuid4().hex}")
    try:
        fs.get_file(path, str(tmp))
        got = sha256_file(tmp)
        if got != sha256:
            raise IOError(f"{uri}: checksum mismatch (manifest says {sha256[:12]}, object has {got[:12]}); re-run the encode step")
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
    return dest
