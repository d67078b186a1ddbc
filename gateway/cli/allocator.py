"""glibc's malloc, told to keep freed memory for the next request body.

By default glibc maps each block of 128 KiB or more (its threshold grows to at most
32 MiB as such blocks are freed) and hands freed memory at the top of the heap back
to the kernel once 128 KiB (then twice the threshold) lies free. A gateway handling
large appends allocates and frees buffers of that size per request (the body as it
arrives, the body whole, the Redis command it becomes): each new one comes back from
the kernel page by page, zeroed. That cost more than everything else a large append
costs the gateway: measured, 1 MiB appends took 4.2-4.4 ms of gateway CPU per MiB
(2.6-3.0 of it in the kernel) and 2.0-2.3 ms with the thresholds below, for about
30 MB more RSS held after a burst (docs/operations.md, "Memory").

Not done when the operator set glibc's own variables (MALLOC_MMAP_THRESHOLD_,
MALLOC_TRIM_THRESHOLD_, or those tunables in GLIBC_TUNABLES: they win), nor on another C
library (nothing to tune; a preloaded jemalloc or tcmalloc takes no notice either).
"""

from __future__ import annotations

import os

M_TRIM_THRESHOLD = -1  # glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20  # blocks below this come from the heap, and are reused
TRIM_THRESHOLD_BYTES = 64 << 20  # free memory kept at the top of the heap
_THRESHOLDS = ((M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES), (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


def operator_set(environ: os._Environ[str] | dict[str, str] = os.environ) -> bool:
    """Whether the operator tuned these thresholds: glibc's variables, or its tunables."""
    tunables = environ.get("GLIBC_TUNABLES", "")
    return (
        "MALLOC_MMAP_THRESHOLD_" in environ
        or "MALLOC_TRIM_THRESHOLD_" in environ
        or "malloc.mmap_threshold" in tunables
        or "malloc.trim_threshold" in tunables
    )


def keep_freed_memory() -> bool:
    """Set the thresholds above; whether they were set."""
    if operator_set():
        return False
    try:
        import ctypes  # (a Python built without it: nothing to tune)

        libc = ctypes.CDLL(None)
    except (ImportError, OSError, TypeError):  # TypeError: Windows takes no None
        return False
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return False  # not glibc (musl's mallopt does nothing)
    mallopt = libc.mallopt
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return all(mallopt(option, value) == 1 for option, value in _THRESHOLDS)
