"""The reply arena on its own: the allocator (blocks never overlap, first fit, nothing lost) and
the parent's record of released blocks."""

from __future__ import annotations

import gc
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runners._arena import ALIGNMENT, Arena, ArenaBlocks

SIZE = 64 * ALIGNMENT

# Each step either asks for a block of some length or gives back the i-th block still held.
steps = st.lists(
    st.one_of(
        st.tuples(st.just("take"), st.integers(min_value=0, max_value=20 * ALIGNMENT)),
        st.tuples(st.just("give"), st.integers(min_value=0, max_value=1000)),
    ),
    max_size=80,
)


def lowest_fit(held: dict[int, int], length: int) -> int | None:
    """The model: the lowest aligned offset where `length` bytes overlap no held block."""
    need = -(-max(length, 1) // ALIGNMENT) * ALIGNMENT
    for offset in range(0, SIZE - need + 1, ALIGNMENT):
        if all(offset + need <= start or start + size <= offset for start, size in held.items()):
            return offset
    return None


@settings(max_examples=300, deadline=None)
@given(steps)
def test_blocks_are_the_lowest_fit_never_overlap_and_all_come_back(script):
    blocks = ArenaBlocks(SIZE)
    held: dict[int, int] = {}  # offset -> aligned length
    for action, value in script:
        if action == "take":
            expected = lowest_fit(held, value)
            offset = blocks.take(value)
            assert offset == expected
            if offset is not None:
                held[offset] = -(-max(value, 1) // ALIGNMENT) * ALIGNMENT
        elif held:
            offset = sorted(held)[value % len(held)]
            blocks.give_back(offset)
            del held[offset]
        assert blocks.taken_bytes == sum(held.values())
    for offset in list(held):
        blocks.give_back(offset)
    assert blocks.take(SIZE) == 0  # every gap merged back into one


def test_giving_back_a_block_that_was_never_taken_is_refused():
    blocks = ArenaBlocks(SIZE)
    blocks.take(ALIGNMENT)
    with pytest.raises(KeyError):
        blocks.give_back(ALIGNMENT)


def test_released_blocks_are_reported_once_and_requeued_ones_go_first():
    """The receiver's end: a block is reported when its last view goes, and offsets that could not
    be sent (`requeue`) come out again ahead of later ones."""
    arena = Arena(4 * ALIGNMENT)
    first, second = arena.receive(0, ALIGNMENT), arena.receive(ALIGNMENT, ALIGNMENT)
    part = first[8:16]  # a slice keeps the block alive
    del first
    assert arena.released() == ()
    del part
    assert arena.released() == (0,)
    arena.requeue((0,))
    del second
    assert arena.released() == (0, ALIGNMENT)
    assert arena.released() == ()


def test_a_write_that_fails_mid_copy_gives_its_block_back():
    """An exception while copying (a Ctrl-C, here a buffer of another layout) must not leave the
    block taken: no message names it, so no receiver would ever release it."""
    from array import array

    arena = Arena(4 * ALIGNMENT)
    with pytest.raises(ValueError):
        arena.write([memoryview(bytes(ALIGNMENT)), memoryview(array("i", [1, 2]))])
    placed = arena.write([memoryview(bytes(4 * ALIGNMENT))])  # the whole arena is free again
    assert placed is not None and placed[0] == (0, 4 * ALIGNMENT)


def _rss_kib() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") // 1024


def test_receiving_blocks_of_many_lengths_costs_no_memory_per_length():
    """Each block was viewed through a ctypes array type made for its length, and CPython 3.14
    keeps every such type: replies each of their own length (a chunk's decoded images) grew the
    parent, and requests each worker, by about 0.7 KiB per length for the whole job (soak: 20,000
    lengths, +13.5 MiB on 3.14t; 3.11 frees them). The block is viewed through NumPy instead."""
    arena = Arena(1 << 24)

    def receive(lengths):
        for length in lengths:
            view = arena.receive(0, length)
            view[-1] = 1  # the receiver may write into what it received
            del view
            assert arena.released() == (0,)

    receive(range(ALIGNMENT, 2_000 * ALIGNMENT, ALIGNMENT))
    gc.collect()
    before = _rss_kib()
    receive(range(2_000 * ALIGNMENT, 22_000 * ALIGNMENT, ALIGNMENT))
    gc.collect()
    assert _rss_kib() - before < 4096, "receiving 20,000 lengths kept memory for each"
