"""Pickle protocol 5 with the large buffers moved through files in shared memory.

The sender pickles an object with `buffer_callback`: buffers below a threshold stay in the pickle
stream, larger ones (NumPy arrays, anything exporting a contiguous buffer through `PickleBuffer`) are
written one after another into a single file in a shared-memory directory. Only the small stream
and the file's layout cross the pipe. The receiver maps the file copy-on-write, unlinks it at once,
and unpickles with `buffers=` slices of the mapping, so the arrays it gets are views of the shared
pages: no copy on receipt, writable (writes stay private to the receiver), and the memory returns
to the system when the last view is released. Because the file is unlinked before anything else
happens, a slow or crashing consumer can never leave it behind.

Only C- or Fortran-contiguous buffers take the shared-memory path; NumPy pickles a non-contiguous
array in-band as a copy.

Thread-safety: the functions are stateless and may be called from any thread; a file name must be
unique per call, which the callers guarantee.
"""

from __future__ import annotations

import mmap
import os
import pickle
import tempfile
from typing import Any, NamedTuple

__all__ = ["Envelope", "encode", "decode", "discard", "make_shm_directory"]

_ALIGNMENT = 64  # every buffer starts on a cache line, which also satisfies any NumPy dtype


class Envelope(NamedTuple):
    """One encoded object: the pickle stream and, when it has large buffers, where they wait."""

    stream: bytes
    path: str | None
    spans: tuple[tuple[int, int], ...]

    @property
    def shm_bytes(self) -> int:
        return sum(length for _, length in self.spans)


def make_shm_directory(root: str | None = None) -> str:
    """A fresh private directory for one runner's buffer files: /dev/shm when it exists."""
    if root is None:
        root = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return tempfile.mkdtemp(prefix=f"zephon-{os.getpid()}-", dir=root)


def encode(obj: Any, path: str, threshold: int) -> Envelope:
    """Pickle `obj`, writing buffers of at least `threshold` bytes into a new file at `path`."""
    large: list[memoryview] = []

    def route(buffer: pickle.PickleBuffer) -> bool:
        raw = buffer.raw()
        if raw.nbytes < threshold:
            return True  # serialised in-band
        large.append(raw)
        return False

    stream = pickle.dumps(obj, protocol=5, buffer_callback=route)
    if not large:
        return Envelope(stream, None, ())
    return Envelope(stream, path, _write(path, large))


def decode(envelope: Envelope) -> Any:
    """The object back; its large buffers are views of the (already unlinked) file's pages."""
    stream, path, spans = envelope
    if path is None:
        return pickle.loads(stream)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.unlink(path)
        mapping = mmap.mmap(fd, spans[-1][0] + spans[-1][1], access=mmap.ACCESS_COPY)
    finally:
        os.close(fd)
    view = memoryview(mapping)
    return pickle.loads(stream, buffers=[view[offset : offset + length] for offset, length in spans])


def discard(envelope: Envelope | None) -> None:
    """Remove the buffer file of an envelope that will never be decoded, if it is still there."""
    if envelope is not None and envelope.path is not None:
        try:
            os.unlink(envelope.path)
        except FileNotFoundError:
            pass


def _write(path: str, buffers: list[memoryview]) -> tuple[tuple[int, int], ...]:
    spans = []
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        offset = 0
        for buffer in buffers:
            offset = -(-offset // _ALIGNMENT) * _ALIGNMENT
            _pwrite_all(fd, buffer, offset)
            spans.append((offset, buffer.nbytes))
            offset += buffer.nbytes
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return tuple(spans)


def _pwrite_all(fd: int, buffer: memoryview, offset: int) -> None:
    written = 0
    while written < buffer.nbytes:
        written += os.pwrite(fd, buffer[written:], offset + written)
