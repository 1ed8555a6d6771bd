"""Pickle protocol 5 with the large buffers moved through files in shared memory.

The sender pickles an object with `buffer_callback`: buffers below a threshold stay in the pickle
stream, larger ones (NumPy arrays, anything exporting a contiguous buffer through `PickleBuffer`) are
written one after another into a single file in a shared-memory directory. Only the small stream
and the file's layout cross the pipe. The receiver opens the file, unlinks it at once, maps it copy-on-write,
and unpickles with `buffers=` slices of the mapping, so the arrays it gets are views of the shared
pages: no copy on receipt, writable (writes stay private to the receiver), and the memory returns
to the system when the last view is released. Because the file is unlinked before anything else
happens, a slow or crashing consumer can never leave it behind. Where the sender has an arena
with room (`_arena`: one region mapped in both processes, blocks reused once the receiver releases
them), the buffers go into it instead, which spares both sides the file's creation, mapping and
page faults.

Only C- or Fortran-contiguous buffers take the shared-memory path; NumPy pickles a non-contiguous
array in-band as a copy.

A buffer file that the directory's filesystem has no room for (a container's /dev/shm, 64 MiB by
Docker's default, filled by replies that did not fit their arena) is not an error of the item: its
buffers go in-band instead, through the pipe, whole (a large array slower), and the envelope says
how many bytes went so (`shm_full_bytes`) for the runner to count and warn of. Before, the write's ENOSPC
failed the item, and with it the loader, of a job whose data was fine.

One-dimensional arrays of plain numbers (token ids, lengths: most of what crosses) are pickled as a
single `numpy.frombuffer` call on their buffer instead of NumPy's own reduction, which goes through
a Python helper and a reshape on receipt. Sixteen token arrays (a text chunk) unpickle in 7 instead
of 21 µs and pickle in 18 instead of 32 (3.11), time the parent otherwise takes from workers that
share its cores (`benchmarks/test_transport_bench.py` measures the parent's cost per item). The
arrays arrive the same: same dtype and shape, writable unless they were read-only, a view of
shared memory when they are large.

Thread-safety: the functions keep no state of their own and may be called from any thread; every
file gets a random name, so concurrent senders into one directory never collide; an arena
allocates its blocks under its own lock.
"""

from __future__ import annotations

import ctypes
import errno
import io
import mmap
import os
import pickle
import sys
import uuid
import weakref
from typing import Any, NamedTuple

import numpy as np

from ._arena import Arena, layout
from ._libc import MAP_FAILED, libc

__all__ = ["Envelope", "decode", "discard", "encode", "shm_full_warning"]

_FULL = frozenset({errno.ENOSPC, errno.EDQUOT})
"""A buffer file's write errors that say its filesystem has no room for it."""


class Envelope(NamedTuple):
    """One encoded object: the pickle stream and, when it has large buffers, where they wait.

    The buffers wait in the file at `path`, or in the block of the sender's arena that `block`
    gives as (offset, length); `spans` are each buffer's (offset, length) in the file or
    the block. `shm_full_bytes` are those of buffers that went in the stream because the
    directory's filesystem was full (module docstring).
    """

    stream: bytes
    path: str | None
    spans: tuple[tuple[int, int], ...]
    block: tuple[int, int] | None = None
    shm_full_bytes: int = 0

    @property
    def shm_bytes(self) -> int:
        return sum(length for _, length in self.spans)


def encode(obj: Any, directory: str, threshold: int, arena: Arena | None = None) -> Envelope:
    """Pickle `obj`, writing buffers of at least `threshold` bytes into a block of `arena` when
    one is given and has room, else into a new file in `directory`, else, where its filesystem is
    full, into the stream."""
    large: list[memoryview] = []

    def route(buffer: pickle.PickleBuffer) -> bool:
        raw = buffer.raw()
        if raw.nbytes < threshold:
            return True  # serialised in-band
        large.append(raw)
        return False

    out = io.BytesIO()
    _Pickler(out, protocol=5, buffer_callback=route).dump(obj)
    stream = out.getvalue()
    if not large:
        return Envelope(stream, None, ())
    if arena is not None and (placed := arena.write(large)) is not None:
        block, spans = placed
        return Envelope(stream, None, spans, block)
    path = os.path.join(directory, uuid.uuid4().hex)
    try:
        return Envelope(stream, path, _write(path, large))
    except OSError as error:
        if error.errno not in _FULL:
            raise
    in_band = io.BytesIO()
    _Pickler(in_band, protocol=5).dump(obj)
    return Envelope(in_band.getvalue(), None, (), None, sum(buffer.nbytes for buffer in large))


def decode(envelope: Envelope, arena: Arena | None = None) -> Any:
    """The object back; its large buffers are views of the (already unlinked) file's pages, or of
    the block the envelope names in `arena`, the one the sender wrote into."""
    stream, path, spans, block, _ = envelope
    if block is not None:
        view = arena.receive(*block)
    elif path is not None:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.unlink(path)
            view = _map_private(fd, spans[-1][0] + spans[-1][1])
        finally:
            os.close(fd)
    else:
        return pickle.loads(stream)
    return pickle.loads(stream, buffers=[view[offset : offset + length] for offset, length in spans])


class _Pickler(pickle.Pickler):
    """Pickle protocol 5 with one-dimensional numeric arrays rebuilt by `numpy.frombuffer` alone."""

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is np.ndarray and obj.ndim == 1 and obj.dtype.kind in "biufc" and obj.flags.c_contiguous:
            return np.frombuffer, (pickle.PickleBuffer(obj), obj.dtype)
        return NotImplemented


def discard(envelope: Envelope | None) -> None:
    """Remove the buffer file of an envelope that will never be decoded, if it is still there."""
    if envelope is not None and envelope.path is not None:
        try:
            os.unlink(envelope.path)
        except FileNotFoundError:
            pass


def shm_full_warning(directory: str | None) -> str:
    """What a runner tells the operator the first time a buffer file found no room in `directory`."""
    try:
        room = os.statvfs(directory)
        free, size = (blocks * room.f_frsize / 2**20 for blocks in (room.f_bavail, room.f_blocks))
        sizes = f" ({free:,.0f} of {size:,.0f} MiB free)"
    except (OSError, TypeError):  # gone with a runner closing meanwhile
        sizes = ""
    return (
        f"process runner: the filesystem of its buffer directory {directory} is full{sizes}, so arrays that do not "
        "fit an arena cross in the pipe instead, slower for large ones, nothing lost (runner.stats().shm_full_bytes "
        "counts them); give the job more shared memory (docker run --shm-size=8g or --ipc=host; on Kubernetes an "
        "emptyDir with medium: Memory at /dev/shm), or ProcessRunner(shm_root=...) a directory with room"
    )


def _map_private(fd: int, size: int) -> memoryview:
    """A writable copy-on-write view of the file that holds no file descriptor once mapped.

    `mmap.mmap` keeps a duplicate descriptor open for the mapping's lifetime unless told not to
    (`trackfd=False`, Python 3.13+); received arrays can live long (shuffle buffers hold thousands),
    and a descriptor each would exhaust the process limit. Before 3.13 the mapping is made through
    libc directly and unmapped when the last view of it is released.
    """
    if sys.version_info >= (3, 13):
        return memoryview(mmap.mmap(fd, size, access=mmap.ACCESS_COPY, trackfd=False))
    address = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE, fd, 0)
    if address in (None, MAP_FAILED):
        errno = ctypes.get_errno()
        raise OSError(errno, f"mmap of a shared-memory buffer file failed: {os.strerror(errno)}")
    region = (ctypes.c_ubyte * size).from_address(address)
    # Not at interpreter exit (finalize's default): the array may still be alive and read there,
    # by an exit hook or a daemon thread, and would crash the process; exit unmaps everything.
    weakref.finalize(region, libc.munmap, address, size).atexit = False
    return memoryview(region).cast("B")


def _write(path: str, buffers: list[memoryview]) -> tuple[tuple[int, int], ...]:
    spans, _ = layout(buffers)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        for buffer, (offset, _) in zip(buffers, spans):
            _pwrite_all(fd, buffer, offset)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return spans


def _pwrite_all(fd: int, buffer: memoryview, offset: int) -> None:
    written = 0
    while written < buffer.nbytes:
        written += os.pwrite(fd, buffer[written:], offset + written)
