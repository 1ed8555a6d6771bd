"""Token estimation: how many tokens a dataset's records yield, measured on a small sample.

Records are stored as raw strings, but a mixture is a ratio of *tokens*. Before planning, each
dataset is sampled deterministically (the same records for the same seed) and run through the
pipeline's own stateless stages up to tokenization; the measured tokens per record (and per stored
byte) turn token weights into chunk weights.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from .._errors import check_count, check_seed
from .._random import SeededStream
from .._records import Chunk, ChunkRecords

if TYPE_CHECKING:
    from ..io import Dataset

__all__ = ["TokenEstimation", "TokenStats", "TokenCounter"]

TokenCounter = Callable[[ChunkRecords], int]
"""Runs the pipeline's pre-packing stages on a chunk's records and returns the tokens they yield.
A counter may carry a string `key` (what it computes, e.g. its operators' fingerprints); work
sources then measure each dataset once per key and process while the key is among the last few used
(`work._plan.MEASURED_RECIPES_KEPT`), and keep the counter as long as its measurement, so a key may
name objects by id that the counter holds."""


@dataclass(frozen=True)
class TokenStats:
    """What the sample showed for one dataset."""

    dataset: str
    sampled_records: int
    tokens: int
    tokens_per_record: float
    tokens_per_byte: float


@dataclass(frozen=True)
class TokenEstimation:
    """Measure tokens per raw byte on about `sample_records` records spread over `sample_chunks` places.

    The sample is `windows = min(sample_chunks, sample_records)` runs of `sample_records //
    windows` records each, so it holds up to `windows - 1` records fewer than `sample_records`
    (96 of 100 in 16 runs of 6); a dataset of at most `sample_records` records is measured whole.
    The sample positions depend only on (seed, dataset name, dataset size), so every rank and every
    resume computes the same plan without communicating. A dataset with a positive weight whose
    sample yields no token has no token rate to plan its share by: binding refuses it with a
    ConfigurationError (raise `sample_records` for a dataset whose surviving records are rare).
    """

    sample_records: int = 512
    sample_chunks: int = 16
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("sample_records", "sample_chunks"):
            object.__setattr__(self, name, check_count(getattr(self, name), f"TokenEstimation: {name}"))
        object.__setattr__(self, "seed", check_seed(self.seed, "TokenEstimation: seed"))

    def measure(self, dataset: Dataset, count_tokens: TokenCounter) -> TokenStats:
        """Tokens per raw (decompressed) byte on the sample, scaled by the dataset's raw bytes.

        A ratio estimator: tokens per byte barely varies between records, while tokens per record
        can vary a hundredfold, so a few hundred records pin the mixture down to well under 1 %.
        """
        dataset.check_plannable()
        tokens = records = sample_bytes = 0
        for chunk in self._sample_chunks(dataset):
            tokens += count_tokens(dataset.read_chunk(chunk, on_error="skip"))
            sample_bytes += dataset.raw_bytes(chunk)
            records += chunk.num_records
        per_byte = tokens / sample_bytes if sample_bytes else 0.0
        total_bytes = sum(shard.raw_bytes for shard in dataset.shards)
        per_record = per_byte * total_bytes / dataset.num_records if dataset.num_records else 0.0
        return TokenStats(
            dataset=dataset.name,
            sampled_records=records,
            tokens=tokens,
            tokens_per_record=per_record,
            tokens_per_byte=per_byte,
        )

    def _sample_chunks(self, dataset: Dataset) -> list[Chunk]:
        """Evenly spread windows of records, jittered by a seeded generator."""
        shards = [(i, s.num_records) for i, s in enumerate(dataset.shards) if s.num_records > 0]
        total = sum(n for _, n in shards)
        if total == 0:
            return []
        if total <= self.sample_records:
            return [Chunk(dataset.name, i, 0, n) for i, n in shards]
        windows = max(1, min(self.sample_chunks, self.sample_records))
        window = max(1, self.sample_records // windows)
        rng = SeededStream.from_key(f"{self.seed}/estimate/{total}/{dataset.name}")
        stride = total / windows
        chunks = []
        for w in range(windows):
            start = int(w * stride + rng.below(max(1, int(stride) - window + 1)))
            chunks.extend(_global_range_to_chunks(dataset.name, shards, start, min(total, start + window)))
        return chunks


def _global_range_to_chunks(name: str, shards: list[tuple[int, int]], start: int, stop: int) -> list[Chunk]:
    """Split a range over the concatenation of all shards into per-shard chunks."""
    chunks = []
    offset = 0
    for shard, size in shards:
        lo, hi = max(start, offset), min(stop, offset + size)
        if lo < hi:
            chunks.append(Chunk(name, shard, lo - offset, hi - offset))
        offset += size
    return chunks
