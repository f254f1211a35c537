"""Give freed heap memory back to the OS (glibc ``malloc_trim``; a no-op elsewhere).

Every eviction round gathers the kept pairs into fresh buffers and frees the old ones. Mixed with
the activations of chunked forwards, that churn fragments glibc's heap: measured on the planted-fact
probe (SmolLM2-135M, batch 8, K=256, r=16), RSS grew by ~140 MB per forward to 7.9 GB, against
1.6 GB peak when the free pages are trimmed now and then (same speed).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_trim = None
if sys.platform.startswith("linux"):
    try:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        _trim = getattr(_libc, "malloc_trim", None)
    except OSError:  # musl or an unusual libc: nothing to trim
        _trim = None


def release_free_memory() -> None:
    """Return free heap pages to the OS; cheap (milliseconds), safe to call any time."""
    if _trim is not None:
        _trim(0)
