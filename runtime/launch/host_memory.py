"""Host memory a process keeps once it has used it: ``keep_freed_memory`` (glibc malloc settings).

PyTorch takes CPU tensors from the C library's ``malloc``, and glibc's defaults hand freed memory back
to the kernel: a block above the (dynamic) mmap threshold is unmapped when freed, and the top of the
heap is trimmed once more than twice that threshold lies free there. A training step frees most of
what it allocated (activations, gradients of activations, the optimizer's temporaries), so the next
step gets fresh pages, and the first touch of every 4 KiB page is a page fault (the kernel zeroes it,
about 2 us). How much is handed back depends on the order of allocations, not only on their sizes: on
a 2-core machine, a rank of the ``small`` preset took 1,000 to 20,000 faults per step, and the op
profiler's timing loops anywhere from none to about 2,000 per layer, so the operator table and the
runtime differed by an amount neither could know (stages up to ~18% slower than their table).

With the heap never trimmed and blocks up to ``MMAP_THRESHOLD_BYTES`` served from it, a step reuses the
memory the previous step freed: after the first step a rank of that plan takes about 100 faults per
step, and the profiler's layer and the training step run in the same state. Blocks above the
threshold are still mapped and unmapped each time (as they would be under glibc's own policy, whose
dynamic threshold stops there), so what they cost is the same in the profiler and in training. The
price is that a process keeps its peak heap for its lifetime (nothing the cost model counts changes:
it prices the peak).

Where the C library is not glibc (macOS, Windows, musl) nothing is changed.
"""
from __future__ import annotations

import ctypes
import sys

M_TRIM_THRESHOLD = -1  # <malloc.h>
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 << 20
"""Blocks up to this size come from the heap: the largest value glibc accepts on 64-bit systems (the
cap of its own dynamic threshold)."""
TRIM_THRESHOLD_BYTES = (1 << 31) - 1
"""Free bytes at the top of the heap before it is trimmed: the largest value mallopt takes (an int)."""

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Make glibc keep freed memory for reuse (see the module docstring). Idempotent and process-wide;
    returns whether the settings are in force (False where the C library is not glibc)."""
    global _applied
    if _applied is None:
        _applied = _mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and _mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)
    return _applied


def _mallopt(param: int, value: int) -> bool:
    if not sys.platform.startswith("linux"):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # no C library symbols to find, or a libc without mallopt (musl)
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt(param, value) == 1
