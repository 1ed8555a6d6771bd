"""The ledger: what happened to every record, per dataset and lane.

Counts are kept on the loader's thread as chunk results are consumed and rows are handed out, so
they need no locks.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from ._records import ChunkRecords

__all__ = ["Ledger"]


class Ledger:
    """Thread-unsafe; owned by one rank loader."""

    def __init__(self) -> None:
        self._records: dict[tuple[str, int], Counter] = defaultdict(Counter)
        self._tokens: dict[int, Counter] = defaultdict(Counter)

    def count_chunk(self, lane: int, batch: ChunkRecords) -> None:
        counts = self._records[(batch.chunk.dataset, lane)]
        counts["read"] += batch.chunk.num_records
        counts["emitted"] += len(batch.records)
        counts["filtered"] += len(batch.filtered)
        for _, reason in batch.skipped:
            counts[f"skipped:{reason}"] += 1

    def count_skips(self, lane: int, skips: list) -> None:
        """Items an accumulator refused, as (address, reason)."""
        for address, reason in skips:
            counts = self._records[(address.dataset, lane)]
            counts["emitted"] -= 1
            counts[f"skipped:{reason}"] += 1

    def count_rows(self, lane: int, real_tokens: int, total_tokens: int) -> None:
        counts = self._tokens[lane]
        counts["rows"] += 1
        counts["tokens"] += real_tokens
        counts["padding"] += total_tokens - real_tokens

    def snapshot(self) -> dict:
        """A fresh, JSON-able copy (never the live counters)."""
        datasets: dict[str, dict] = defaultdict(lambda: {"lanes": {}, "total": Counter()})
        for (dataset, lane), counts in sorted(self._records.items()):
            entry = datasets[dataset]
            entry["lanes"][lane] = _split(counts)
            entry["total"].update(counts)
        return {
            "datasets": {name: {"lanes": e["lanes"], "total": _split(e["total"])} for name, e in datasets.items()},
            "lanes": {lane: dict(c) for lane, c in sorted(self._tokens.items())},
        }


def _split(counts: Counter) -> dict:
    out = {k: v for k, v in counts.items() if not k.startswith("skipped:")}
    for key in ("read", "emitted", "filtered"):
        out.setdefault(key, 0)
    out["skipped"] = {k.split(":", 1)[1]: v for k, v in sorted(counts.items()) if k.startswith("skipped:")}
    return out
