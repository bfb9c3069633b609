"""Large tensors without page faults: glibc's malloc serves every allocation above 32 MiB with
a fresh mmap and unmaps it on free, so each (vocab x hidden) gradient buffer or (rows x vocab)
logits chunk of a real model's update (SmolLM2: 28M elements) is zero-filled page by page by
the kernel, again at every micro-batch. Raising the mmap threshold serves them from the heap,
and raising the trim threshold keeps freed heap memory for the next one: the update then
reuses its buffers (docs/results/update-profile.md measures both settings). The process keeps
its peak memory instead of returning it to the system between steps.

Applied once per process when a node is built (`ftis.train.node.build_node`); a no-op off glibc
and with FTIS_MALLOC_KEEP=0 in the environment."""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
# glibc caps M_MMAP_THRESHOLD at HEAP_MAX (32 MiB on 64-bit) only for its own dynamic
# threshold; a value set with mallopt may be up to half the address space's limit
MMAP_THRESHOLD = 1 << 30
TRIM_THRESHOLD = 1 << 31

_applied: bool | None = None


def keep_large_blocks() -> bool:
    """Serve allocations up to 1 GiB from the heap and keep up to 2 GiB of freed heap
    memory for reuse. True when applied (now or earlier in this process)."""
    global _applied
    if _applied is not None:
        return _applied
    _applied = False
    if os.environ.get("FTIS_MALLOC_KEEP", "1") == "0":
        return False
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to tune
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
    return _applied
