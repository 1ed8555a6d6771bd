"""Arenas: shared-memory regions that large buffers cross in, instead of a file each.

Without them, every message with large buffers is a new file in shared memory: the sender writes
it (the kernel allocates and fills fresh pages), the receiver maps it, faults its pages in and
unmaps it, and the kernel frees the pages. Through an arena the sender copies into pages that both
processes have mapped since the first messages. A decoded image of the race's VLM recipe (448 × 336
RGB, 441 KiB) that the parent copies into a batch costs, parent and worker together, 0.46 ms of
CPU through files and 0.155 ms through the arena (3.11, `benchmarks/test_transport_bench.py`); in
the race's VLM recipe on the process runner (3.11, p=2) the system time of the whole process tree
fell from 0.14-0.18 to 0.05-0.06 ms per image, of about 2 ms. A row of six 30 KB encoded images
sent to a worker costs both 446 µs through a file and 186 µs through the arena.

An arena is anonymous shared memory (no file, no descriptor, nothing to leave behind) mapped by
the parent before it forks the workers that use it, so they inherit the mapping. The process
runner has two kinds:

- each worker's *reply arena*: the worker writes its replies' buffers, the parent receives them;
- one *request arena* for all workers: the parent writes the items' buffers (the encoded images
  that `vlm` decodes after packing), the worker that runs an item receives them.

The writer allocates blocks (first fit, so the pages in use stay at the low end and the touched
size follows the peak of buffers alive at once) and copies one message's buffers into one block.
The receiver hands out views of the block; when the last of them is released, the block's offset
is queued and sent back to the writer with the next message the other way, and only then does the
writer reuse the block. A message the writer cannot fit (the receiver holds many, or one is larger
than the arena) goes through a file of its own, so a full arena costs speed, never a stall.

Pages touched once stay allocated until no process maps the arena any more, so an arena costs up
to its size in shared memory (`ProcessRunner(reply_arena_bytes=..., request_arena_bytes=...)`).
A fork copies every mapping, so a worker forked after an arena would map it for its whole life
without ever touching it: the arena of a worker that crashed lived as long as its siblings and
its replacement, to the end of the runner, one more with every crash. A forked worker therefore
gives up every arena but the two it uses (`withhold_all_but`), and a reply arena lives exactly as
long as its worker and the arrays the parent received through it: the parent drops its `Arena`
with the worker, and the last view of its mapping unmaps it. The inherited mapping is replaced by
a reservation of its addresses rather than unmapped (or withheld from the fork with
`MADV_DONTFORK`) because the worker holds Python objects for it, copied from the parent, and one
of them freed there would unmap whatever the worker had mapped at those addresses since.
"""

from __future__ import annotations

import bisect
import ctypes
import mmap
import threading
import weakref
from collections import deque
from collections.abc import Iterable

import numpy as np

from ._libc import libc

__all__ = ["ALIGNMENT", "Arena", "ArenaBlocks", "layout", "withhold_all_but"]

ALIGNMENT = 64  # every block and buffer starts on a cache line, which also satisfies any NumPy dtype


# How a worker replaces an inherited arena it does not use: no access, no pages, same addresses.
_PROT_NONE = 0
_MAP_FIXED = 0x10  # Linux, and the BSDs
_RESERVATION = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED | getattr(mmap, "MAP_NORESERVE", 0)

# Every arena's mapping made in this process, as {weak reference to the mmap: (address, size)}, so
# that a worker forked from it can find the ones it inherited. An entry goes once its mmap has
# (checked when the next arena is made). Each entry is added and removed by its own key, so no lock
# is needed (two runners may make arenas at once), and a forked child reads the table without one.
_MAPPINGS: dict[weakref.ref, tuple[int, int]] = {}


def _register(mapping: mmap.mmap) -> None:
    for ref in _MAPPINGS.copy():
        if ref() is None:
            _MAPPINGS.pop(ref, None)
    address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
    _MAPPINGS[weakref.ref(mapping)] = (address, len(mapping))


def withhold_all_but(kept: Iterable[Arena | None]) -> None:
    """In a freshly forked worker: give up its inherited mapping of every arena but `kept`.

    Each such mapping is replaced by an inaccessible private reservation of the same addresses,
    which holds no page, so the arena's pages are freed once the processes that use it let go. A
    mapping whose mmap the parent was freeing at the fork is not touched: a weak reference is dead
    from the moment its object's deallocation (which unmaps it) begins, so the addresses of a live
    entry hold that very mapping. The call needs no room: it replaces one whole mapping by one of
    the same size.
    """
    keep = {id(arena._map) for arena in kept if arena is not None}
    for ref, (address, size) in _MAPPINGS.copy().items():
        mapping = ref()
        if mapping is not None and id(mapping) not in keep:
            libc.mmap(address, size, _PROT_NONE, _RESERVATION, -1, 0)


def _aligned(length: int) -> int:
    return -(-length // ALIGNMENT) * ALIGNMENT


def layout(buffers: list[memoryview]) -> tuple[tuple[tuple[int, int], ...], int]:
    """The buffers laid one after another, each starting on an aligned offset: ((offset, length) of
    each, the total length). An arena block and a buffer file hold them the same way."""
    spans, end = [], 0
    for buffer in buffers:
        start = _aligned(end)
        spans.append((start, buffer.nbytes))
        end = start + buffer.nbytes
    return tuple(spans), end


class ArenaBlocks:
    """First-fit allocation of aligned blocks in a region of `size` bytes (the writer's side).

    Free space is a sorted list of disjoint (offset, length) gaps, merged with its neighbours
    whenever a block comes back. A receiver holds at most a few hundred blocks at once, so the
    linear scan costs microseconds against the block's copy.
    """

    def __init__(self, size: int) -> None:
        self._gaps: list[tuple[int, int]] = [(0, size)] if size > 0 else []
        self._taken: dict[int, int] = {}  # offset -> length of every block handed out

    def take(self, length: int) -> int | None:
        """The offset of a new block of at least `length` bytes, or None when no gap is large enough."""
        length = _aligned(max(length, 1))
        for index, (offset, size) in enumerate(self._gaps):
            if size >= length:
                if size == length:
                    del self._gaps[index]
                else:
                    self._gaps[index] = (offset + length, size - length)
                self._taken[offset] = length
                return offset
        return None

    def give_back(self, offset: int) -> None:
        """Free the block at `offset`; a KeyError if no block starts there (a protocol bug)."""
        length = self._taken.pop(offset)
        index = bisect.bisect_left(self._gaps, (offset, 0))
        end = offset + length
        if index < len(self._gaps) and self._gaps[index][0] == end:
            end += self._gaps.pop(index)[1]
        if index > 0 and sum(self._gaps[index - 1]) == offset:
            offset = self._gaps[index - 1][0]
            index -= 1
            del self._gaps[index]
        self._gaps.insert(index, (offset, end - offset))

    @property
    def taken_bytes(self) -> int:
        return sum(self._taken.values())


class Arena:
    """One shared region, with both ends of its protocol.

    Writer: `write(buffers)` places one message's buffers in a new block; `give_back(offsets)` frees
    the blocks the receiver has released. Receiver: `receive(offset, length)` is the view the
    message's arrays are unpickled from; `released()` the offsets to send back to the writer.
    Both ends are safe from any thread: the parent writes requests from whichever thread submits.
    """

    def __init__(self, size: int) -> None:
        self._map = mmap.mmap(-1, size)  # anonymous and shared: a worker forked next sees the same pages
        _register(self._map)
        self._blocks = ArenaBlocks(size)
        self._lock = threading.Lock()  # guards _blocks
        self._released: deque[int] = deque()

    # -- the writer's end -------------------------------------------------------------------------

    def write(self, buffers: list[memoryview]) -> tuple[tuple[int, int], tuple[tuple[int, int], ...]] | None:
        """((block offset, block length), (offset, length) of each buffer in the block), or None when
        the block does not fit."""
        spans, length = layout(buffers)
        with self._lock:
            start = self._blocks.take(length)
        if start is None:
            return None
        try:
            view = memoryview(self._map)
            for buffer, (offset, size) in zip(buffers, spans):
                view[start + offset : start + offset + size] = buffer
        except BaseException:  # Ctrl-C mid-copy included: no message will name the block
            self.give_back((start,))
            raise
        return (start, length), spans

    def give_back(self, offsets: Iterable[int]) -> None:
        with self._lock:
            for offset in offsets:
                self._blocks.give_back(offset)

    # -- the receiver's end -----------------------------------------------------------------------

    def receive(self, offset: int, length: int) -> memoryview:
        """A writable view of the block; once it and every slice of it are gone, the block is released.

        The receiver may write into the arrays it received: the writer does not touch the block
        until the receiver has released it.

        The view's owner is a NumPy array, not a ctypes array: a ctypes array type is made per
        length, and CPython 3.14 keeps every one it made (about 0.7 KiB each), so a long job's
        replies, nearly each of its own length, grew the process without bound.
        """
        region = np.frombuffer(self._map, np.uint8, length, offset)
        weakref.finalize(region, self._released.append, offset)
        return memoryview(region)

    def requeue(self, offsets: tuple[int, ...]) -> None:
        """Offsets taken from `released()` that could not be sent: they go out with the next call."""
        self._released.extendleft(reversed(offsets))

    def released(self) -> tuple[int, ...]:
        """The offsets released since the last call, each returned once; safe from any thread."""
        offsets = []
        try:
            while True:
                offsets.append(self._released.popleft())
        except IndexError:
            return tuple(offsets)
