"""The two libc calls Python's `mmap` module does not offer, through ctypes: `mmap` at an address
of our choosing or without keeping a file descriptor, and `munmap` of what it mapped."""

from __future__ import annotations

import ctypes

__all__ = ["MAP_FAILED", "libc"]


def _load() -> ctypes.CDLL:
    loaded = ctypes.CDLL(None, use_errno=True)
    loaded.mmap.restype = ctypes.c_void_p
    loaded.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    loaded.munmap.restype = ctypes.c_int
    loaded.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return loaded


libc = _load()  # at import, in the parent: a forked worker never has to load anything
MAP_FAILED = ctypes.c_void_p(-1).value
