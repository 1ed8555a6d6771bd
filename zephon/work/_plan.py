"""Work plans: which chunk each lane reads at each of its slots, and where flushes fall.

The global plan is an endless (or epoch-bounded) sequence of *slots*; slot g belongs to lane
g % num_lanes. A slot holds one chunk, or nothing once a finite dataset is exhausted. Any slot can
be computed directly from its index, so a resumed lane starts at its cursor without replaying the
plan from the beginning.

A mixture is realised in *rounds*: every round holds a fixed integer quota of chunks per dataset,
laid out by a smooth interleave (each dataset's chunks evenly spread), so every prefix of the
plan is within about one chunk per dataset of the target. The order *within* a dataset is a
seeded permutation per epoch.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Iterator, Mapping, Protocol, Sequence, runtime_checkable

import numpy as np

from .._errors import ConfigurationError
from .._records import Chunk
from ._estimation import TokenCounter, TokenEstimation, TokenStats

if TYPE_CHECKING:
    from ..io import Dataset

__all__ = ["WorkSource", "WorkPlan", "StaticMixtureWorkSource", "MixturePlan", "Flush", "lane_plan"]


@dataclass(frozen=True)
class Flush:
    """Sentinel between two segments of a lane: every accumulator empties itself and starts over.

    `segment` is the index of the segment that *starts* after this flush.
    """

    segment: int


@runtime_checkable
class WorkPlan(Protocol):
    """A bound, deterministic plan of chunks."""

    datasets: Mapping[str, Dataset]

    def slot(self, g: int) -> Chunk | None:
        """The chunk of global slot g, or None for an empty slot."""

    def num_slots(self) -> int | None:
        """Total number of slots of a finite plan; None when the plan is endless."""

    def fingerprint(self) -> dict: ...

    def describe(self) -> dict: ...


@runtime_checkable
class WorkSource(Protocol):
    """Turns datasets, a mixture and a seed into a WorkPlan once the pipeline can count tokens."""

    def bind(self, count_tokens: TokenCounter | None) -> WorkPlan: ...


def lane_plan(
    plan: WorkPlan, lane: int, num_lanes: int, flush_every: int, start_segment: int = 0
) -> Iterator[Chunk | Flush]:
    """The input of one lane from the start of `start_segment`: chunks with a Flush every
    `flush_every` slots (empty slots count as slots, so segment boundaries never move), and a
    final Flush when a finite plan ends."""
    total = plan.num_slots()
    first = slot = start_segment * flush_every
    while True:
        if slot % flush_every == 0 and slot > first:
            yield Flush(slot // flush_every)
        g = slot * num_lanes + lane
        if total is not None and g >= total:
            yield Flush(slot // flush_every + 1)
            return
        chunk = plan.slot(g)
        if chunk is not None:
            yield chunk
        slot += 1


class StaticMixtureWorkSource:
    """Mixes datasets by a fixed *token* ratio.

    `mixture` maps dataset names to weights (normalised). With a `token_estimation`, weights are
    token shares; without one, they are record shares. `num_epochs=None` plans forever (each
    dataset restarts with a fresh permutation); an integer bounds each dataset to that many passes,
    after which its slots are empty and the plan ends once every dataset is done.
    """

    def __init__(
        self,
        datasets: Sequence[Dataset],
        mixture: Mapping[str, float] | None = None,
        token_estimation: TokenEstimation | None = None,
        seed: int = 0,
        *,
        records_per_chunk: int = 128,
        num_epochs: int | None = None,
        round_size: int = 1024,
    ) -> None:
        names = [d.name for d in datasets]
        if len(set(names)) != len(names):
            raise ConfigurationError(f"dataset names must be unique, got {names}")
        if not datasets:
            raise ConfigurationError("a work source needs at least one dataset")
        mixture = dict(mixture) if mixture is not None else {n: 1.0 for n in names}
        if set(mixture) != set(names):
            raise ConfigurationError(
                f"mixture names {sorted(mixture)} do not match dataset names {sorted(names)}"
            )
        if any(w < 0 or not math.isfinite(w) for w in mixture.values()) or sum(mixture.values()) <= 0:
            raise ConfigurationError(f"mixture weights must be finite, non-negative and not all zero: {mixture}")
        if records_per_chunk < 1 or round_size < 1:
            raise ConfigurationError("records_per_chunk and round_size must be positive")
        if num_epochs is not None and num_epochs < 1:
            raise ConfigurationError(f"num_epochs must be a positive integer or None, got {num_epochs}")
        total = sum(mixture.values())
        self.datasets = tuple(datasets)
        self.mixture = {n: mixture[n] / total for n in names}
        self.token_estimation = token_estimation
        self.seed = seed
        self.records_per_chunk = records_per_chunk
        self.num_epochs = num_epochs
        self.round_size = round_size

    def bind(self, count_tokens: TokenCounter | None) -> MixturePlan:
        stats: dict[str, TokenStats] = {}
        if self.token_estimation is not None and count_tokens is not None:
            for ds in self.datasets:
                if self.mixture[ds.name] > 0:
                    stats[ds.name] = self.token_estimation.measure(ds, count_tokens)
        return MixturePlan(self, stats)


class MixturePlan:
    """A StaticMixtureWorkSource bound to measured token statistics. Immutable and thread-safe."""

    def __init__(self, source: StaticMixtureWorkSource, stats: Mapping[str, TokenStats]) -> None:
        self.source = source
        self.stats = dict(stats)
        live = [ds for ds in source.datasets if source.mixture[ds.name] > 0]
        self.datasets = {ds.name: ds for ds in source.datasets}
        self._names = [ds.name for ds in live]
        self._chunks = {ds.name: ds.chunks(source.records_per_chunk) for ds in live}
        for name, chunks in self._chunks.items():
            if not chunks:
                raise ConfigurationError(f"dataset {name!r} has no records; drop it from the mixture")
        self.quotas = self._quotas()
        self._pattern, self._occurrence = self._interleave()
        self._round = len(self._pattern)

    def _quotas(self) -> dict[str, int]:
        """Chunks per round for each dataset, so that the *tokens* per round follow the mixture."""
        weights = {}
        for name in self._names:
            records = sum(c.num_records for c in self._chunks[name])
            records_per_chunk = records / len(self._chunks[name])
            per_chunk = records_per_chunk
            if name in self.stats and self.stats[name].tokens_per_record > 0:
                per_chunk = records_per_chunk * self.stats[name].tokens_per_record
            weights[name] = self.source.mixture[name] / per_chunk
        norm = sum(weights.values())
        return {n: max(1, round(self.source.round_size * w / norm)) for n, w in weights.items()}

    def _interleave(self) -> tuple[list[int], list[int]]:
        """One round's layout: dataset index per position, and that chunk's rank within its dataset."""
        keyed = []
        for d, name in enumerate(self._names):
            q = self.quotas[name]
            keyed.extend(((2 * k + 1) / (2 * q), d, k) for k in range(q))
        keyed.sort()
        return [d for _, d, _ in keyed], [k for _, _, k in keyed]

    @lru_cache(maxsize=64)
    def _permutation(self, name: str, epoch: int) -> np.ndarray:
        key = f"{self.source.seed}/epoch/{name}/{epoch}".encode()
        seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little")
        return np.random.default_rng(seed).permutation(len(self._chunks[name]))

    def slot(self, g: int) -> Chunk | None:
        r, j = divmod(g, self._round)
        name = self._names[self._pattern[j]]
        n = r * self.quotas[name] + self._occurrence[j]
        chunks = self._chunks[name]
        epoch, i = divmod(n, len(chunks))
        if self.source.num_epochs is not None and epoch >= self.source.num_epochs:
            return None
        return chunks[int(self._permutation(name, epoch)[i])]

    def num_slots(self) -> int | None:
        if self.source.num_epochs is None:
            return None
        rounds = max(
            math.ceil(self.source.num_epochs * len(self._chunks[n]) / self.quotas[n]) for n in self._names
        )
        return rounds * self._round

    def fingerprint(self) -> dict:
        return {
            "kind": "static_mixture",
            "datasets": [ds.fingerprint() for ds in self.source.datasets],
            "mixture": self.source.mixture,
            "seed": self.source.seed,
            "records_per_chunk": self.source.records_per_chunk,
            "num_epochs": self.source.num_epochs,
            "quotas": self.quotas,
        }

    def describe(self) -> dict:
        return {
            "mixture": self.source.mixture,
            "chunks_per_round": self.quotas,
            "tokens_per_record": {n: s.tokens_per_record for n, s in self.stats.items()},
            "tokens_per_byte": {n: s.tokens_per_byte for n, s in self.stats.items()},
        }
