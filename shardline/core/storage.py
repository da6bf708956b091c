"""The storage root: local paths or any fsspec URL (s3:// through s3fs), written atomically.

Local writes go to a temporary name beside the target and are renamed into place; object-store
puts are atomic per object, and a reader trusts only what a manifest (written last) lists.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import posixpath
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import fsspec
from fsspec.core import url_to_fs

from shardline.core.config import settings

CONNECT_SECONDS = 10  # botocore's default: 60; its read timeout (60) is SHARDLINE_STORE_READ_SECONDS (20)
S3FS_TRIES = 2  # s3fs's own tries of a request (5 by default), each of botocore's attempts (AWS_MAX_ATTEMPTS)


def bounded_waits() -> None:
    """An object store that takes the connection and never answers (a stalled server, a black-holed route) is an
    error in a few minutes, said and retried by the step: with botocore's 60 s timeouts under s3fs's 5 tries of
    botocore's 5 attempts, one request waited about 30 minutes in silence. Where the user's fsspec config
    (FSSPEC_CONFIG_DIR) sets the S3 filesystem's `config_kwargs`, those stand."""
    import fsspec.config

    read = settings.number("SHARDLINE_STORE_READ_SECONDS")
    options = fsspec.config.conf.setdefault("s3", {})
    options.setdefault("config_kwargs", {"connect_timeout": CONNECT_SECONDS, "read_timeout": read})


bounded_waits()  # a store that never answers is an error in minutes, not half an hour of silence

TMP_MARK = ".tmp-"


def is_remote(uri: str) -> bool:
    return "://" in uri and not uri.startswith("file://")


def local_path(uri: str) -> str:
    return uri[len("file://") :] if uri.startswith("file://") else uri


def join(root: str, *parts: str) -> str:
    root = root.rstrip("/")
    return "/".join([root, *[p.strip("/") for p in parts if p]])


def _split_scheme(uri: str) -> tuple[str, str]:
    scheme, sep, rest = uri.partition("://")
    return (scheme + sep, rest) if sep else ("", uri)


def names(dir_uri: str) -> list[str]:
    """The names in a folder, temp files left out, sorted; [] when it does not exist. Listed afresh on an
    object store (another process may have written since the last listing)."""
    if is_remote(dir_uri):
        fs, path = filesystem(dir_uri)
        fs.invalidate_cache(path)
        try:  # one listing: asking first whether the folder exists cost two more requests (a HEAD, a LIST)
            found = [p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(path, detail=False)]
        except FileNotFoundError:
            return []
    else:
        folder = Path(local_path(dir_uri))
        found = os.listdir(folder) if folder.is_dir() else []
    return sorted(n for n in found if not n.startswith(TMP_MARK))


def delete(uri: str) -> None:
    """Remove one file or object; nothing when it is not there."""
    if is_remote(uri):
        fs, path = filesystem(uri)
        try:
            fs.rm(path)
        except FileNotFoundError:
            pass
    else:
        Path(local_path(uri)).unlink(missing_ok=True)


def resolve(folder: str, relative: str) -> str:
    """`relative` (a manifest's shard path: `g00000-train.bin.lz4`, or `../groups/<key>/train.bin.lz4` for a shard
    in the group store) under `folder`, `..` resolved in the text: a store takes `a/../b` as a key of its own."""
    scheme, path = _split_scheme(join(folder, relative))
    root = "/" if path.startswith("/") else ""
    path = posixpath.normpath(path.lstrip("/") or ".")
    if root and path.partition("/")[0] == "..":
        raise ValueError(f"{relative!r} goes above the root of {folder!r}")
    return scheme + root + ("" if path == "." else path)


def relative_to(uri: str, folder: str) -> str:
    """The path of `uri` seen from `folder` (both on one store): what `resolve(folder, ...)` turns back into `uri`."""
    (s1, a), (s2, b) = _split_scheme(uri), _split_scheme(folder)
    if s1 != s2:
        raise ValueError(f"{uri!r} and {folder!r} are not on one store")
    rel = posixpath.relpath("/" + a, "/" + b)  # both from one root: no working folder comes in
    return "" if rel == "." else rel


def filesystem(uri: str) -> tuple[fsspec.AbstractFileSystem, str]:
    fs, path = url_to_fs(uri)
    if getattr(fs, "retries", 0) > S3FS_TRIES and "s3" in fs.protocol:  # s3fs's own tries: see `bounded_waits`
        fs.retries = S3FS_TRIES
    return fs, path


def extension(path: str) -> str:
    """A file name's extension, lower case, without its dot ('' for a name without one)."""
    name = os.path.basename(path)
    return name.rsplit(".", 1)[1].lower() if "." in name else ""


def exists(uri: str) -> bool:
    """Whether `uri` is there. On an object store a "no" from a listing this process cached is asked again: another
    machine (a teammate's run encoding the same groups) may have written it since (it read a group's files as gone)."""
    if not is_remote(uri):
        return os.path.exists(local_path(uri))
    fs, path = filesystem(uri)
    if fs.exists(path):
        return True
    fs.invalidate_cache(path)
    return fs.exists(path)


def size_of(uri: str) -> int | None:
    """The object's size in bytes (a listing, no read), or None when it is not there (asked again, as `exists`)."""
    if not is_remote(uri):
        return os.path.getsize(local_path(uri)) if os.path.exists(local_path(uri)) else None
    fs, path = filesystem(uri)
    for _ in range(2):
        try:
            return int(fs.info(path)["size"])
        except (FileNotFoundError, KeyError):
            fs.invalidate_cache(path)
    return None


def read_bytes(uri: str) -> bytes:
    if not is_remote(uri):
        return Path(local_path(uri)).read_bytes()
    fs, path = filesystem(uri)
    return fs.cat_file(path)


def fetch_many(uris: list[str]) -> dict[str, bytes]:
    """The bytes of several files of one object store, in one concurrent batch (a file at a time waited a round
    trip each): uri -> bytes. Each file in one GET: s3fs's default (max_concurrency 10) asks each file's size first
    (a HEAD), to split a large file into parallel ranges; a raw file is small, and the HEAD doubled the requests."""
    if len(uris) == 1:
        return {uris[0]: read_bytes(uris[0])}
    fs = filesystem(uris[0])[0]
    paths = {filesystem(u)[1]: u for u in uris}
    one_get = {"max_concurrency": 1} if hasattr(fs, "max_concurrency") else {}
    return {paths[p]: raw for p, raw in fs.cat(list(paths), **one_get).items()}


def fetched(files: list[tuple[str, int]], limit: int = 64 << 20) -> Iterator[tuple[str, object]]:
    """Each of `files` ((uri, size), in order) with what to read it from: a local file's path; an object store's
    bytes (a file-like object), fetched in concurrent batches of up to `limit` bytes (the memory held); a file over
    `limit`, opened where it is (read as its reader asks: a large file is not held whole)."""
    import io

    pending: list[str] = []

    def flush() -> list[tuple[str, object]]:
        got = fetch_many(pending) if pending else {}
        out = [(u, io.BytesIO(got.pop(u))) for u in pending]
        pending.clear()
        return out

    held = 0
    for uri, size in files:
        if is_remote(uri) and size <= limit:
            if held + size > limit:
                yield from flush()
                held = 0
            pending.append(uri)
            held += size
            continue
        yield from flush()
        held = 0
        if not is_remote(uri):
            yield uri, local_path(uri)
            continue
        fs, path = filesystem(uri)
        with fs.open(path, "rb") as handle:
            yield uri, handle
    yield from flush()


def read_text(uri: str) -> str:
    return read_bytes(uri).decode()


def write_bytes(uri: str, data: bytes) -> None:
    """Write `data` to `uri` so that a reader sees either the old object or the complete new one."""
    if is_remote(uri):
        fs, path = filesystem(uri)
        fs.pipe_file(path, bytes(data) if isinstance(data, memoryview) else data)
        return
    _replace(Path(local_path(uri)), lambda f: f.write(data))


def write_file(uri: str, source: str) -> None:
    """The local file `source` as `uri`, as `write_bytes` writes (whole or not at all), never read into memory."""
    if is_remote(uri):
        fs, path = filesystem(uri)
        fs.put_file(source, path)
        return
    with open(source, "rb") as src:
        _replace(Path(local_path(uri)), lambda f: shutil.copyfileobj(src, f, 1 << 20))


def _replace(target: Path, write: Callable) -> None:
    """`target` written by `write(file)` aside, synced, then renamed into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f"{TMP_MARK}{uuid.uuid4().hex}-{target.name}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except OSError as e:  # a full disk, said with the file it could not take (a write names none)
        if e.errno == errno.ENOSPC and not e.filename:
            raise OSError(e.errno, e.strerror, str(target)) from e
        if isinstance(e, PermissionError):  # it named the file written aside (.tmp-...), and nothing to do
            raise PermissionError(
                e.errno,
                f"{e.strerror}: this user may not write {target.parent} (its permissions, a read-only disk or an "
                "immutable folder); make it writable, or set storage.root to a folder it may write",
                str(target),
            ) from e
        raise
    finally:
        tmp.unlink(missing_ok=True)


def write_text(uri: str, text: str) -> None:
    write_bytes(uri, text.encode())


def sha256_file(path: str | Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def sha256_uri(uri: str) -> str:
    if not is_remote(uri):
        return sha256_file(local_path(uri))
    fs, path = filesystem(uri)
    with fs.open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


class ChecksumMismatch(OSError):
    """Stored bytes that are not the ones written (damaged, or changed by hand): the same on every try."""


def _check_sha256(uri: str, sha256: str, got: str) -> None:
    """A data set's shard that fails it is deleted (derived data: the next encode encodes its group anew)."""
    if got != sha256:
        if derived := "/datasets/" in uri:  # layout.DATASETS
            with contextlib.suppress(OSError):
                delete(uri)
        what = "deleted: run the same command again and its group is encoded anew" if derived else "refused"
        raise ChecksumMismatch(f"{uri}: checksum mismatch (manifest says {sha256[:12]}, object has {got[:12]}); {what}")


def cache_dir() -> Path:
    """Where this machine unpacks shards: `SHARDLINE_CACHE`, default ~/.cache/shardline."""
    return settings.path("SHARDLINE_CACHE")


CACHE_CAP_ENV = "SHARDLINE_CACHE_MAX_GB"


def gb_at_least(nbytes: int) -> str:
    """`nbytes` in GB for a `SHARDLINE_CACHE_MAX_GB` value, rounded up to three significant digits."""
    import math

    gb = max(nbytes, 1) / 1e9
    step = 10.0 ** (math.floor(math.log10(gb)) - 2)
    return f"{math.ceil(gb / step - 1e-9) * step:g}"


def _cached(objects: Path) -> list[tuple[float, str, int, Path]]:
    """(mtime, name, size, path) of each complete object in a cache's `objects` folder."""
    entries = []
    for p in objects.glob("??/*"):
        if p.name.startswith(TMP_MARK):
            continue
        try:
            st = p.stat()
        except FileNotFoundError:  # evicted by another thread or process meanwhile
            continue
        entries.append((st.st_mtime, p.name, st.st_size, p))
    return entries


def _touch(path: Path) -> bool:
    """Mark a cached object recently used; False when it is not there (or was just evicted)."""
    try:
        os.utime(path)
        return True
    except FileNotFoundError:
        return False


class CacheFull(IOError):
    """An object does not fit in the local cache even after evicting everything not in use.

    Only this process's pins keep an object from eviction, so the same run on the same cap fails the
    same way again: the cap is too small for what the run holds at once (a configuration problem,
    never a failure of the machine to retry)."""


class ShardCache:
    """A size-capped local cache of remote objects, addressed by checksum and verified on the way in.

    Objects live at `<dir>/objects/<sha[:2]>/<sha>`; they are written aside and renamed, so a reader
    never sees a partial object. When adding one would pass the cap, the least recently used objects
    that no open split holds (`pin`) are deleted first. Several processes may share the folder: an
    object another process has memory-mapped stays readable after it is unlinked here.
    """

    def __init__(self, root: str | Path, cap_bytes: int | None = None):
        import threading
        from concurrent.futures import ThreadPoolExecutor

        self.root = Path(root)
        self.objects = self.root / "objects"
        self.cap = int(cap_bytes) if cap_bytes is not None else self.default_cap()
        env = settings.text(CACHE_CAP_ENV)
        self.cap_source = (
            "set by the caller"
            if cap_bytes is not None
            else (f"{CACHE_CAP_ENV}={env.strip()}" if env else f"half the free disk: {CACHE_CAP_ENV} is unset")
        )
        self._lock = threading.Lock()
        self._pins: dict[str, int] = {}
        self._pin_bytes: dict[str, int] = {}  # the size each pinned object takes (or will take) in the cache
        self._reserved: dict[str, int] = {}
        self._inflight: dict[str, object] = {}
        # read-ahead fetches, one at a time: each holds a shard's unpacked and code-mapped bytes while
        # it runs (~200 MB at 83 MB shards), and a read-ahead is a shuffle block ahead of need; two at once took
        # 157 MB more of a streamed training at 22,000 games, and were no faster on 2 cores (docs/performance.md)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="shardline-fetch")
        self.downloads = 0
        self.evictions = 0

    def default_cap(self) -> int:
        """`SHARDLINE_CACHE_MAX_GB` if set, else half of the free disk where the cache lives plus what it holds."""
        gb = settings.number(CACHE_CAP_ENV)
        if gb is not None:
            return int(gb * 1e9)
        probe = self.root
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        return int(shutil.disk_usage(probe).free * 0.5) + self.held_bytes()

    def path(self, sha256: str) -> Path:
        return self.objects / sha256[:2] / sha256

    def held_bytes(self) -> int:
        return sum(e[2] for e in _cached(self.objects))

    def describe_cap(self) -> str:
        """The cap and where it comes from, for messages: '300 MB (SHARDLINE_CACHE_MAX_GB=0.3)'."""
        return f"{self.cap / 1e6:,.0f} MB ({self.cap_source})"

    def pin(self, sha256: str, nbytes: int) -> None:
        """Keep `sha256` from eviction until `unpin`; `nbytes` is what it takes in the cache (counted by
        `pinned_bytes`, so a read-ahead knows the room left)."""
        with self._lock:
            self._pin(sha256, nbytes)

    def _pin(self, sha256: str, nbytes: int) -> None:
        self._pins[sha256] = self._pins.get(sha256, 0) + 1
        self._pin_bytes[sha256] = max(int(nbytes), self._pin_bytes.get(sha256, 0))

    def pin_if_room(self, sha256: str, nbytes: int) -> bool:
        """Pin `sha256` only if the pinned objects, it included, stay within the cap (a read-ahead: it
        must never take the room of an object in use); True when pinned."""
        with self._lock:
            if sha256 not in self._pins and self._pinned_bytes() + int(nbytes) > self.cap:
                return False
            self._pin(sha256, nbytes)
            return True

    def unpin(self, sha256: str) -> None:
        with self._lock:
            n = self._pins.get(sha256, 0) - 1
            if n > 0:
                self._pins[sha256] = n
            else:
                self._pins.pop(sha256, None)
                self._pin_bytes.pop(sha256, None)

    def pinned_bytes(self) -> int:
        """Bytes of the cache this process holds: pinned objects and downloads under way."""
        with self._lock:
            return self._pinned_bytes()

    def _pinned_bytes(self) -> int:
        held = sum(self._pin_bytes.get(k, 0) for k in self._pins)
        return held + sum(v for k, v in self._reserved.items() if k not in self._pins)

    def _reserve(self, sha256: str, size: int, uri: str) -> None:
        """Make room for `size` bytes of `sha256` and hold it. A read-ahead still downloading an object no
        split holds any more (released before it landed) takes room it gives back once it lands: wait for
        those, then try again, rather than call the cache full."""
        from concurrent.futures import wait

        while True:
            with self._lock:
                try:
                    self._make_room(sha256, size, uri)
                    return
                except CacheFull:
                    landing = [
                        f for n, f in self._inflight.items() if n != sha256 and n not in self._pins and not f.done()
                    ]
                    if not landing:
                        raise
            wait(landing)

    def _make_room(self, sha256: str, size: int, uri: str) -> None:
        """Evict least recently used, unpinned objects until `size` more bytes fit (caller holds the lock)."""
        if size > self.cap:
            raise CacheFull(
                f"{uri} is {size / 1e6:.0f} MB but the local shard cache ({self.root}) is capped at "
                f"{self.describe_cap()}: raise {CACHE_CAP_ENV} to at least {gb_at_least(size)}, or encode "
                "smaller shards (a smaller data.group_mb or data.files_per_group: a shard is one file group's "
                "rows of one split)"
            )
        entries = _cached(self.objects)
        used = sum(e[2] for e in entries) + sum(v for k, v in self._reserved.items() if k != sha256)
        for _, name, nbytes, p in sorted(entries):
            if used + size <= self.cap:
                break
            if name in self._pins or name in self._reserved:
                continue
            p.unlink(missing_ok=True)
            used -= nbytes
            self.evictions += 1
        if used + size > self.cap:
            raise CacheFull(
                f"the local shard cache ({self.root}) cannot hold {uri} ({size / 1e6:.0f} MB): "
                f"{used / 1e6:.0f} MB of its {self.describe_cap()} are shards in use; raise {CACHE_CAP_ENV} "
                f"to at least {gb_at_least(used + size)}, or encode smaller shards (a smaller data.group_mb or "
                "data.files_per_group)"
            )
        self._reserved[sha256] = size

    def get(
        self,
        uri: str,
        sha256: str,
        size: int,
        compression: str | None = None,
        raw_bytes: int | None = None,
        derived: Derived | None = None,
    ) -> Path:
        """A local path with the exact bytes of `uri` (checked against `sha256`), downloaded if needed;
        a compressed object is unpacked (to `raw_bytes`) into the cache, ready to memory-map. With
        `derived`, the cached object is what `derived.write` makes of the unpacked bytes, kept under `derived.key`."""
        if not is_remote(uri) and compression is None and derived is None:
            return Path(local_path(uri))
        with self._lock:
            fut = self._inflight.get(derived.key if derived else sha256)
        if fut is not None:
            try:
                fut.result()
            except Exception:  # noqa: BLE001 - the read-ahead's error is raised again by the download below
                pass  # the read-ahead failed: try again here, where the error reaches the caller
        return self._download(uri, sha256, size, compression, raw_bytes, derived)

    def _download(
        self,
        uri: str,
        sha256: str,
        size: int | None,  # None only with `derived`
        compression: str | None = None,
        raw_bytes: int | None = None,
        derived: Derived | None = None,
    ) -> Path:
        if derived is not None:

            def make(tmp: Path) -> None:
                with unpacked(uri, sha256, compression, raw_bytes, tmp) as raw, open(tmp, "wb") as f:
                    f.truncate(derived.nbytes)
                    derived.write(raw, f.fileno())

            return self.build(derived.key, derived.nbytes, make, uri)
        if _touch(self.path(sha256)):  # there: recently used
            return self.path(sha256)

        def fetch(tmp: Path) -> None:
            with _checked_local(uri, sha256, tmp) as src:
                if compression is not None:
                    from shardline.core.shards import unpack_file

                    unpack_file(src, tmp, int(raw_bytes), str(src), compression)
                elif is_remote(uri):
                    os.replace(src, tmp)
                else:
                    shutil.copyfile(src, tmp)

        return self.build(sha256, raw_bytes if compression else size, fetch, uri)

    def build(self, key: str, size: int, builder, what: str) -> Path:
        """A derived object (a split pack): `builder(tmp_path)` writes it once, aside, then it is renamed
        in; later calls (and later runs) reuse it. Counts against the cap like a downloaded object."""
        dest = self.path(key)
        if _touch(dest):
            return dest
        self._reserve(key, int(size), what)
        try:
            dest.parent.mkdir(parents=True, exist_ok=True)
            tmp = dest.with_name(f"{TMP_MARK}{uuid.uuid4().hex}")
            try:
                builder(tmp)
                os.replace(tmp, dest)
                self.downloads += 1
            finally:
                tmp.unlink(missing_ok=True)
        finally:
            with self._lock:
                self._reserved.pop(key, None)
        return dest

    def prefetch(
        self,
        uri: str,
        sha256: str,
        size: int | None = None,
        compression: str | None = None,
        raw_bytes: int | None = None,
        derived: Derived | None = None,
    ) -> None:
        """Start fetching `uri` in the background (read-ahead); `get` waits for it."""
        name = derived.key if derived else sha256
        with self._lock:
            if (
                name in self._inflight
                or (not is_remote(uri) and compression is None and derived is None)
                or self.path(name).exists()
            ):
                return
            fut = self._pool.submit(self._download, uri, sha256, size, compression, raw_bytes, derived)
            self._inflight[name] = fut
        fut.add_done_callback(lambda _f: self._done(name))

    def _done(self, sha256: str) -> None:
        with self._lock:
            self._inflight.pop(sha256, None)


@dataclass(frozen=True)
class Derived:
    """A cached object made from a fetched one, `nbytes` long, named `key`: `write(unpacked bytes, fd)` writes
    it into a file of that size (zeros where it writes nothing)."""

    key: str
    nbytes: int
    write: Callable[[bytes, int], None]


_CACHES: dict[str, ShardCache] = {}


def shared_cache() -> ShardCache:
    """The process-wide cache for this machine's cache folder."""
    key = str(cache_dir())
    if key not in _CACHES:
        _CACHES[key] = ShardCache(cache_dir())
    return _CACHES[key]


@contextmanager
def _checked_local(uri: str, sha256: str, scratch: Path):
    """A local path with the bytes of `uri`, checked against `sha256`: a remote object fetched into a file beside
    `scratch` (removed on leaving), a local one where it lies."""
    fetched = scratch.with_name(f"{scratch.name}.in")
    try:
        src = Path(local_path(uri))
        if is_remote(uri):
            fs, path = filesystem(uri)
            fs.get_file(path, str(fetched))
            src = fetched
        _check_sha256(uri, sha256, sha256_file(src))
        yield src
    finally:
        fetched.unlink(missing_ok=True)


@contextmanager
def unpacked(uri: str, sha256: str, compression: str | None, raw_bytes: int | None, scratch: Path):
    """The bytes of a stored object, checked against `sha256` and unpacked, memory-mapped from files beside
    `scratch` (the fetched and the unpacked one, removed on leaving): never whole in memory. A local object
    that is not compressed is mapped where it lies."""
    from shardline.core.shards import map_file, unpack_file

    raw = scratch.with_name(f"{scratch.name}.raw")
    try:
        with _checked_local(uri, sha256, scratch) as src:
            if compression is not None:
                unpack_file(src, raw, int(raw_bytes), uri, compression)
                src = raw
            yield map_file(src)
    finally:
        raw.unlink(missing_ok=True)


def read_verified(uri: str, sha256: str, compression: str | None = None, raw_bytes: int | None = None) -> bytes:
    """The bytes of a stored object, checked against `sha256`, unpacked when compressed."""
    data = read_bytes(uri)
    _check_sha256(uri, sha256, hashlib.sha256(data).hexdigest())
    if compression is not None:
        from shardline.core.shards import unpack_bytes

        return unpack_bytes(data, int(raw_bytes), uri, compression)
    return data
