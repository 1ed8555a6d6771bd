"""Seeded random streams that Zephon owns: SplitMix64 over a counter, keyed by SHA-256 of a text key.

Every random decision of a recipe (the plan's permutations, the estimator's sample windows, a
shuffle buffer's picks) is drawn here. Why not `numpy.random`: NumPy keeps its bit generators'
streams stable across versions, but not the `Generator` methods built on them (NEP 19 lets
`integers` and `permutation` change algorithm), and a recipe's batches must not change when NumPy
is upgraded under a checkpointed run. The two draws Zephon needs, a bounded integer and a
permutation, are a few lines on top of a fixed, published mixer, pinned by a known-answer test.
It also keeps `numpy.random` (24 modules; +3.2 MiB of PSS when imported after NumPy on 3.14t) out
of every loader and worker process.

A change to any output of this module changes batches: bump `STATE_VERSION` in `_checkpoint`.
"""

from __future__ import annotations

import numpy as np

from ._sha256 import sha256

__all__ = ["SeededStream"]

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment (the golden ratio in 64 bits)
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB


def _mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * _MUL1) & _MASK64
    z = ((z ^ (z >> 27)) * _MUL2) & _MASK64
    return z ^ (z >> 31)


def _mix_array(z: np.ndarray) -> np.ndarray:
    """`_mix` on a uint64 array; NumPy's uint64 arithmetic wraps modulo 2**64 like the masks above."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MUL1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MUL2)
    return z ^ (z >> np.uint64(31))


class SeededStream:
    """A deterministic stream of 64-bit draws. Thread-unsafe: one owner draws from it.

    The i-th draw is a pure function of (state, i), so a permutation of n takes n draws at once,
    vectorised, and leaves the stream where n scalar draws would.
    """

    def __init__(self, state: int) -> None:
        self._state = state & _MASK64

    @classmethod
    def from_key(cls, key: str) -> SeededStream:
        """A stream named by text (seed, purpose, lane, ...): equal keys, equal streams, on every machine.

        Encoded with "surrogatepass": a key holds dataset names, which hold lone surrogates where
        they come from a file name that is not UTF-8 (os.fsdecode); other keys' bytes are UTF-8's."""
        return cls(int.from_bytes(sha256(key.encode("utf-8", "surrogatepass")).digest()[:8], "little"))

    def next_u64(self) -> int:
        self._state = (self._state + _GAMMA) & _MASK64
        return _mix(self._state)

    def below(self, n: int) -> int:
        """An integer in [0, n): the top 53 bits of a draw scaled by n (bias at most n / 2**53)."""
        if not 0 < n <= 1 << 53:
            raise ValueError(f"below(n) needs 0 < n <= 2**53, got {n}")
        return ((self.next_u64() >> 11) * n) >> 53

    def permutation(self, n: int) -> np.ndarray:
        """A permutation of range(n) as int64: indices sorted by one draw each.

        The low bits of each sort key hold the index itself, so keys are distinct and the order is
        fully determined by the draws even where their high bits tie.
        """
        if n < 0:
            raise ValueError(f"permutation(n) needs n >= 0, got {n}")
        counters = np.arange(1, n + 1, dtype=np.uint64) * np.uint64(_GAMMA) + np.uint64(self._state)
        self._state = (self._state + n * _GAMMA) & _MASK64
        index_bits = max(1, (n - 1).bit_length())
        low = np.uint64((1 << index_bits) - 1)
        keys = (_mix_array(counters) & ~low) | np.arange(n, dtype=np.uint64)
        return (np.sort(keys) & low).astype(np.int64)
