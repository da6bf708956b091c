"""A lease in the storage root: one writer at a time for a run folder or a registry decision, across
machines, with no server but the store itself.

A lease is a folder of numbered objects, `gen-000000001.json`, ...: the highest number is the current
lease, `{owner, host, pid, expires_at, released}`. Taking it is an exclusive create of the next number
(local files: a hard link of a complete file, which fails if the name exists; S3: a put with
`If-None-Match: *`): of two takers exactly one wins, so a lease is never held twice. Its holder
renews it (rewrites its own object with a later expiry) while it works; a holder that died stops
renewing, the lease expires, and the next taker creates the next number. A holder that finds a higher
number than its own has lost the lease (it stalled past its expiry, as a "Crashed" run that was not
really dead can) and must stop writing: `check()` raises `LeaseLost`.

A holder on this very machine that is gone (killed with SIGKILL, by the out-of-memory killer, a crash)
need not be waited out: the lease names its process by the machine's boot id, its pid namespace, its pid
and that process's start time (Linux), and a taker in the same boot and pid namespace that finds no such
process (or a zombie) takes the lease at once. Anywhere else (another machine or container, no /proc),
only the expiry frees it.
"""

from __future__ import annotations

import getpass
import json
import os
import re
import socket
import threading
import time
import uuid
from pathlib import Path

from shardline.core import storage
from shardline.core.config import settings

_GEN = re.compile(r"^gen-(\d{9})\.json$")
DEFAULT_TTL = settings.SETTINGS["SHARDLINE_LEASE_TTL"].default  # seconds, for a record that does not say


class LeaseLost(RuntimeError):
    """Another process took this lease after it expired: this one must stop writing."""


def create_exclusive(uri: str, data: bytes) -> bool:
    """Write `uri` only if it does not exist (atomically, with its whole content); False when it does."""
    if storage.is_remote(uri):
        fs, path = storage.filesystem(uri)
        try:
            fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            return False
        except OSError as e:  # a store that answers 412 without naming the condition: s3fs wraps botocore's error
            code = (getattr(e.__cause__, "response", None) or {}).get("Error", {}).get("Code")
            if code in ("PreconditionFailed", "412"):
                return False
            raise
        return True
    path = Path(storage.local_path(uri))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{storage.TMP_MARK}{uuid.uuid4().hex}-{path.name}")
    tmp.write_bytes(data)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        tmp.unlink(missing_ok=True)
    return True


def _generations(folder: str) -> list[int]:
    return sorted(int(m.group(1)) for n in storage.names(folder) if (m := _GEN.match(n)))


def _name(gen: int) -> str:
    return f"gen-{gen:09d}.json"


def read_current(folder: str) -> tuple[int, dict | None]:
    """(generation, its record) of the lease in `folder`; (0, None) when it was never taken."""
    gens = _generations(folder)
    if not gens:
        return 0, None
    gen = gens[-1]
    try:
        return gen, json.loads(storage.read_text(storage.join(folder, _name(gen))))
    except (FileNotFoundError, ValueError):
        return gen, None


def describe(record: dict | None) -> str:
    if not record:
        return "an unknown holder"
    left = record.get("expires_at", 0) - time.time()
    return (
        f"{record.get('owner')} (host {record.get('host')}, pid {record.get('pid')}; "
        f"{'expires' if left > 0 else 'expired'} {abs(left):.0f} s {'from now' if left > 0 else 'ago'})"
    )


def _this_machine() -> dict | None:
    """This boot of this machine and this process's pid namespace (Linux; None elsewhere): with a pid and its
    start time, they name one process that no other machine, container or later boot has."""
    try:
        return {
            "boot": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
            "pidns": os.stat("/proc/self/ns/pid").st_ino,
        }
    except OSError:
        return None


def _started(pid: int) -> int | None:
    """When process `pid` started (clock ticks after boot); None when there is no such process, or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] in ("Z", "X") else int(fields[19])


def holder_gone(record: dict | None) -> bool:
    """True when the lease's holder was a process of this machine's boot and pid namespace that no longer runs
    (its pid is free, a zombie, or another process's): its lease need not be waited out."""
    proc = (record or {}).get("process")
    here = _this_machine()
    if not proc or not here or proc.get("boot") != here["boot"] or proc.get("pidns") != here["pidns"]:
        return False
    try:
        return _started(int(record["pid"])) != proc.get("start")
    except (KeyError, TypeError, ValueError):
        return False


class Lease:
    """A lease on `folder`: `acquire()` takes it (renewed in the background until `release()`)."""

    def __init__(self, folder: str, purpose: str, ttl: float | None = None, holder: dict | None = None):
        """`holder`: more of who holds it, written into the record (the training run's Prefect flow run)."""
        self.folder = folder
        self.purpose = purpose
        self.ttl = ttl if ttl is not None else settings.number("SHARDLINE_LEASE_TTL")  # seconds unrenewed
        self.holder = holder or {}
        self.gen = 0
        self.owner = (
            f"{purpose} by {getpass.getuser()}@{socket.gethostname()} pid {os.getpid()} ({uuid.uuid4().hex[:8]})"
        )
        self._lost = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        here = _this_machine()
        self._process = {**here, "start": _started(os.getpid())} if here else None
        self.taken_from: dict | None = None  # the record of a gone holder whose lease this one took at once

    def _record(self, released: bool = False) -> bytes:
        return json.dumps(
            {
                **self.holder,
                "owner": self.owner,
                "host": socket.gethostname(),
                "pid": os.getpid(),
                "purpose": self.purpose,
                "expires_at": time.time() + (0 if released else self.ttl),
                "ttl": self.ttl,
                "released": released,
                "process": self._process,
            }
        ).encode()

    def try_acquire(self) -> tuple[bool, dict | None]:
        """Take the lease if it is free, released, expired or its holder is gone from this machine (`holder_gone`):
        (True, None); else (False, the holder's record)."""
        gen, record = read_current(self.folder)
        live = record is not None and not record.get("released") and record.get("expires_at", 0) > time.time()
        gone = live and holder_gone(record)
        if live and not gone:
            return False, record
        if create_exclusive(storage.join(self.folder, _name(gen + 1)), self._record()):
            self.gen = gen + 1
            self.taken_from = record if gone else None
            self._prune()
            return True, None
        return False, read_current(self.folder)[1]  # another taker won this number

    def acquire(self, on_wait=None) -> None:
        """Take the lease, waiting while another holder renews it (`on_wait(who)` each time the holder changes)."""
        said = None
        while True:
            ok, holder = self.try_acquire()
            if ok:
                self._start_renewing()
                return
            if on_wait is not None and (holder or {}).get("owner") != said:
                said = (holder or {}).get("owner")
                on_wait(describe(holder))
            time.sleep(2.0)

    def _start_renewing(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._renew_loop, name="shardline-lease", daemon=True)
        self._thread.start()

    def _renew_loop(self) -> None:
        while not self._stop.wait(self.ttl / 3):
            try:
                self.renew()
            except LeaseLost:
                self._lost.set()
                return
            except OSError:
                continue  # the store did not answer: try again; the lease lasts ttl

    def renew(self) -> None:
        gens = _generations(self.folder)
        if gens and gens[-1] != self.gen:
            raise LeaseLost(f"{self.folder}: the lease was taken by another process after it expired")
        storage.write_bytes(storage.join(self.folder, _name(self.gen)), self._record())

    def check(self) -> None:
        """Raise `LeaseLost` when another process has taken the lease (call before writing)."""
        if self._lost.is_set():
            raise LeaseLost(
                f"{self.folder}: this process lost its lease (it was not renewed in time and another process took "
                "it); it stops writing, the other one goes on"
            )

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        if self.gen and not self._lost.is_set():
            gens = _generations(self.folder)
            if gens and gens[-1] == self.gen:
                storage.write_bytes(storage.join(self.folder, _name(self.gen)), self._record(released=True))

    def _prune(self) -> None:
        for g in _generations(self.folder)[:-2]:
            try:
                storage.delete(storage.join(self.folder, _name(g)))
            except OSError:
                return


class Silence:
    """Whether the lease in `folder` that `flow_run` (a Prefect flow run id) took has gone silent: the same record,
    unreleased, for longer than its ttl by this process's clock (no clock of two machines is compared). Its
    holder renews it every third of its ttl, so a silent one lost its process or its machine, or stalled that
    long (its next write then finds the lease taken: `LeaseLost`). Call `check()` as often as convenient."""

    def __init__(self, folder: str, flow_run) -> None:
        self.folder = folder
        self.flow_run = str(flow_run)
        self._seen: tuple | None = None
        self._since = time.monotonic()

    def check(self) -> str | None:
        """None, or what was seen, in words, once the lease has been silent past its ttl."""
        try:
            gen, record = read_current(self.folder)
        except OSError:  # the store did not answer: no verdict this time
            return None
        if not record or record.get("flow_run") != self.flow_run or record.get("released"):
            self._seen = None
            return None
        if (gen, record.get("expires_at")) != self._seen:
            self._seen, self._since = (gen, record.get("expires_at")), time.monotonic()
            return None
        ttl = float(record.get("ttl") or DEFAULT_TTL)
        silent = time.monotonic() - self._since
        if silent <= ttl:
            return None
        return (
            f"its lease in {self.folder} was not renewed for {silent:.0f} s (ttl {ttl:.0f} s) while the run was "
            f"RUNNING: its process or machine is gone ({record.get('owner')})"
        )
