"""The host allocator of a CPU run: freed memory kept in the process for the next step (`run.keep_host_memory`).

glibc's malloc serves every block of 32 MiB or more (and, until its adaptive threshold has grown, smaller
ones) with a fresh `mmap` and returns it to the kernel at `free`; it also trims the top of its heap when more
than a few dozen MiB there are free. A training step allocates and frees the same large tensors every step
(a [chunk, vocabulary] block of logits, the MLP's [tokens, ffn] activations, their gradients), so each of them
page-faults its memory in again, zeroed by the kernel, on every step. `keep_freed_host_memory` turns both off
(`mallopt(M_MMAP_MAX, 0)`, `mallopt(M_TRIM_THRESHOLD, -1)`): every block comes from the heap and stays there,
freed, for the next allocation, as the jemalloc / TCMalloc settings that CPU-training guides preload do.

What it costs: the process's resident memory stays at its peak until it ends (what a training process reaches
every step anyway), and the setting holds for the whole process, other code in it included. It is a glibc
setting: elsewhere (musl, macOS, Windows) nothing changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
from typing import Any, Optional

log = logging.getLogger(__name__)

# mallopt's parameter numbers (glibc's malloc.h)
M_TRIM_THRESHOLD = -1
M_MMAP_MAX = -4
NO_TRIM = -1  # M_TRIM_THRESHOLD -1: never give the heap's free top back to the kernel


def _glibc() -> Optional[Any]:
    """The C library when it is glibc (it has `gnu_get_libc_version` and `mallopt`), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None
    return libc


def keep_freed_host_memory() -> bool:
    """Make this process's malloc keep freed memory for reuse: no mmap'd blocks, no heap trimming. True when
    it did (glibc accepted both settings), False where the C library is not glibc."""
    libc = _glibc()
    if libc is None:
        log.debug("run.keep_host_memory: the C library is not glibc; malloc left as it is")
        return False
    return bool(libc.mallopt(M_MMAP_MAX, 0)) and bool(libc.mallopt(M_TRIM_THRESHOLD, NO_TRIM))


def keeps_host_memory(setting: bool | str, device_type: str) -> bool:
    """`run.keep_host_memory` for a run on `device_type`: auto means on a CPU (where every tensor is host
    memory), not on an accelerator (whose tensors the host allocator does not hold)."""
    if setting == "auto":
        return device_type == "cpu"
    return bool(setting)
