"""Memory that goes back to the system when a step lets it go.

The encode and the split pack's build decompress shards of tens of MB into buffers that live for a
moment. glibc's malloc serves a freed block of that size from its heap the next time (its mmap
threshold rises to the largest block freed, up to 32 MB), and a heap seldom shrinks: a 10x data set
left ~300 MB of such free heap behind the pack's build, held for the rest of the run (measured in
benchmarks/scale_bench.py: the process's anonymous memory grew with the data, not with what it
held). A fixed threshold of 4 MB keeps the blocks above it in their own mappings, returned on free;
the many small ones (a batch of the demo at 1,024 windows is 2.4 MB) stay on the heap as before.

Setting the mmap threshold also stops glibc from moving its trim threshold (2x the mmap threshold when glibc sets
both), which then stays at 128 KB: every free at the heap's top gave its pages back and the next gather faulted
them in again, and the loader ran at half its speed (0.5x with 0 threads, 0.6x with 2; benchmarks/data_bench.py).
The trim threshold is set too, at glibc's own ratio: 8 MB.

A heap shrinks only at its top, so many small blocks freed below a live one stay in the process: the ingest's
parsed footers (~140 KB each, a batch of 256 at a time) and an encoded group's frames. `trim` hands every whole
free page of every arena back (glibc's `malloc_trim`), called after each batch and each group: without it the
ingest of 10,000 files left ~430 MB of free heap behind. pyarrow's allocator keeps what it frees the same way, and
`trim` releases that too.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters
THRESHOLD = 4 << 20

_done = False


@functools.cache
def _glibc():
    """The C library, when it is glibc's (Linux); else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def return_freed_memory() -> bool:
    """Make malloc give blocks of 4 MB and more back to the system when freed (glibc on Linux; elsewhere
    nothing). Process-wide and idempotent: called where a step starts. True when it is in effect."""
    global _done
    libc = _glibc()
    if not _done and hasattr(libc, "mallopt"):  # not glibc (musl has no mallopt): its own allocator's ways
        _done = bool(libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD)) and bool(libc.mallopt(M_TRIM_THRESHOLD, 2 * THRESHOLD))
    return _done


def trim() -> None:
    """Give the free pages inside malloc's heaps back to the system (glibc; elsewhere nothing), and those pyarrow's
    own allocator (mimalloc or jemalloc) keeps for reuse, when pyarrow is loaded: the encode of 22,000 files
    left 84 MB there, for the rest of the run."""
    libc = _glibc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)
    arrow = sys.modules.get("pyarrow")
    if arrow is not None and hasattr(arrow, "default_memory_pool"):
        arrow.default_memory_pool().release_unused()
