"""How many chunks each lane keeps in flight when the pipeline does not say (`prefetch=None`).

A rank consumes its lanes one after another (G/L rows from one, then the next), so the lane being
consumed must keep every worker busy on its own: the other lanes' windows are mostly finished
work waiting for their turn. Four chunks per worker rather than two absorb chunks of unequal cost
(text race recipe, p=2: workers busy 1.85-1.90 -> 1.92-1.97 of 2 cores, +2-5 % tokens/s; VLM
unchanged, +~15 MB).

Small chunks get eight per worker. A chunk of the race's text (16 documents, ~26 KB) is ~7 ms of
tokenizing, so four per worker cover only a few tens of milliseconds of the loader falling behind
(a segment flush, a scheduler hiccup with three busy threads on two cores), after which the
workers find nothing queued (text race recipe, 3.14t, p=2: each worker idle 1-3 % of the run).
Eight per worker there: +3.9 % tokens/s on the median of 8 alternating pairs of runs (6 higher),
+3.4 % with the process runner on 3.11, and the race's peak memory unchanged (76 MiB). Large
chunks keep four: a VLM chunk of the race holds ~450 KB of encoded images, and eight per worker
added 28 MiB to the peak of the recipe that decodes before packing.
"""

from __future__ import annotations

__all__ = ["DEEP_WINDOW_EXTRA_BYTES", "default_prefetch", "records_per_chunk"]

DEEP_WINDOW_EXTRA_BYTES = 1 << 20
"""The raw bytes per lane the four extra chunks per worker of a deep window may hold, on average."""


def default_prefetch(plan, parallelism: int) -> int:
    """Chunks in flight per lane: 8 per worker when 4 more per worker of the plan's average chunk
    hold at most DEEP_WINDOW_EXTRA_BYTES, else 4 per worker (and 4 when the plan cannot say)."""
    mean = mean_chunk_raw_bytes(plan)
    if mean is not None and 4 * parallelism * mean <= DEEP_WINDOW_EXTRA_BYTES:
        return 8 * parallelism
    return 4 * parallelism


def mean_chunk_raw_bytes(plan) -> float | None:
    """The plan's raw bytes per chunk over all its datasets, from shard sizes alone (no chunk is
    listed); None for a work source that does not chunk by record count."""
    per_chunk = records_per_chunk(plan)
    if not per_chunk:
        return None
    raw_bytes = chunks = 0
    for dataset in plan.datasets.values():
        for shard in dataset.shards:
            raw_bytes += shard.raw_bytes
            chunks += -(-shard.num_records // per_chunk)
    return raw_bytes / chunks if chunks else None


def records_per_chunk(plan) -> int | None:
    """The records in each chunk (a shard's last one may hold fewer), or None for a work source
    that does not chunk by record count."""
    return getattr(getattr(plan, "source", None), "records_per_chunk", None)
