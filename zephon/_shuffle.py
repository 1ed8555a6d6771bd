"""A seeded shuffle buffer, one per lane segment.

Its generator comes from (seed, lane, segment), so the order it emits depends on nothing a rank
or a worker could change. At a flush it emits whatever it holds, in a seeded random order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ._accumulator import SegmentContext
from ._errors import check_count, check_seed
from ._random import SeededStream

__all__ = ["ShuffleBuffer", "ShuffleOp"]


class ShuffleBuffer:
    """Emits one random held item per pushed item once `buffer_size` items are held. Thread-unsafe."""

    def __init__(self, buffer_size: int, rng: SeededStream) -> None:
        self.buffer_size = buffer_size
        self._rng = rng
        self._items: list[Any] = []

    def push(self, item: Any) -> list[Any]:
        if len(self._items) < self.buffer_size:
            self._items.append(item)
            return []
        i = self._rng.below(len(self._items))
        out, self._items[i] = self._items[i], item
        return [out]

    def flush(self) -> list[Any]:
        order = self._rng.permutation(len(self._items))
        out = [self._items[i] for i in order]
        self._items = []
        return out


@dataclass(frozen=True)
class ShuffleOp:
    """Configuration of the shuffle: each lane segment gets a `ShuffleBuffer` of `buffer_size` rows
    drawing from a stream of (`seed`, lane, segment)."""

    buffer_size: int
    seed: int = 0
    name: str = "shuffle"
    kind = "accumulator"

    def __post_init__(self) -> None:
        object.__setattr__(self, "buffer_size", check_count(self.buffer_size, "shuffle: buffer_size"))
        object.__setattr__(self, "seed", check_seed(self.seed, "shuffle: seed"))

    def factory(self, default_pad_id: int):
        def make(ctx: SegmentContext) -> ShuffleBuffer:
            return ShuffleBuffer(self.buffer_size, ctx.rng(self.seed, "shuffle"))

        return make

    def fingerprint(self, default_pad_id: int) -> dict:
        return {"op": self.name, "buffer_size": self.buffer_size, "seed": self.seed}
