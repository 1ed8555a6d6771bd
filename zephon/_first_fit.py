"""First-fit placement of items into fixed-capacity rows: the decision half of every packer that
never splits what fits (`pack_flat(algorithm="first_fit")`, `pack_multimodal`).

An item goes into the first open row with room for it, else into a new row. A row closes when it
is exactly full, or — oldest first — when one more row must stay open and `max_open` rows are
open (an item that fills a row alone closes nothing else: its row never stays open).
Which rows close, and in which order, depends only on the sequence of lengths pushed.
"""

from __future__ import annotations

from typing import Generic, TypeVar

__all__ = ["FirstFitRows"]

T = TypeVar("T")


class FirstFitRows(Generic[T]):
    """Thread-unsafe: owned by one packer, which is owned by one lane segment."""

    def __init__(self, capacity: int, max_open: int) -> None:
        self.capacity = capacity
        self.max_open = max_open
        self._rows: list[list[T]] = []
        self._free: list[int] = []

    def place(self, item: T, length: int) -> list[list[T]]:
        """Put an item of `length` (≤ capacity) in a row; return the rows this closed, in order."""
        for i, free in enumerate(self._free):
            if free >= length:
                self._rows[i].append(item)
                self._free[i] -= length
                return [self._close(i)] if self._free[i] == 0 else []
        if length == self.capacity:
            return [[item]]
        closed = []
        if len(self._rows) == self.max_open:
            closed.append(self._close(0))
        self._rows.append([item])
        self._free.append(self.capacity - length)
        return closed

    def drain(self) -> list[list[T]]:
        """Every open row, oldest first; no row stays open."""
        rows, self._rows, self._free = self._rows, [], []
        return rows

    def _close(self, i: int) -> list[T]:
        self._free.pop(i)
        return self._rows.pop(i)
