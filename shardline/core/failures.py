"""Which failures are the infrastructure's (retried: the retry resumes from the newest checkpoint) and which are
errors in the code, the config or the data (not retried), by type, never by the text of a message."""

from __future__ import annotations

from shardline.core.storage import CacheFull

# errors of the machine or the network, worth a retry that resumes from the newest checkpoint, by type
# (never by the text of a message): I/O and network failures, a lost GPU or interconnect
INFRASTRUCTURE_ERRORS = (ConnectionError, TimeoutError, OSError)
# ...but not these: a missing or unreadable input is the same on the next try, as is running out of
# memory with the same batch on the same machine (deterministic), a local shard cache capped below what
# the run holds at once (CacheFull: only this process's pins keep shards in it, so it fails again the
# same way; its message names SHARDLINE_CACHE_MAX_GB and the size), or a code, config or data error
NOT_INFRASTRUCTURE = (
    CacheFull,
    FileNotFoundError,
    PermissionError,
    IsADirectoryError,
    NotADirectoryError,
    MemoryError,
    ValueError,
    TypeError,
    KeyError,
    IndexError,
    AssertionError,
    NotImplementedError,
)


# torch's own types for a GPU or interconnect failure (not its out-of-memory: deterministic), by name: torch is
# imported only where an error is classified. AcceleratorError is torch 2.8's: before it, a CUDA fault is a plain
# RuntimeError, which is not told from a code error (not retried there)
TORCH_INFRASTRUCTURE = ("AcceleratorError", "DistBackendError", "DistNetworkError", "DistStoreError")


def infrastructure_by_names(bases: list[str]) -> bool:
    """The same rule for an error known by its class's and its bases' names (another process's, written down:
    a training rank's): an I/O, network, GPU or interconnect error that is none of NOT_INFRASTRUCTURE nor an
    out-of-memory."""
    names = set(bases)
    infra = {t.__name__ for t in INFRASTRUCTURE_ERRORS} | set(TORCH_INFRASTRUCTURE)
    never = {t.__name__ for t in NOT_INFRASTRUCTURE} | {"OutOfMemoryError"}
    return bool(names & infra) and not names & never
