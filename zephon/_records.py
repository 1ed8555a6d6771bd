"""What flows between a reader and the operators: records with their address, and counted skips.

A chunk of records is the unit of work that is numbered, dispatched to workers and put back in
order. Skips travel with the chunk that produced them so that the ledger never loses one, and so do
the details (what was wrong) of the first few of each reason, which `stats()` shows as examples.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = ["RecordAddress", "Chunk", "ChunkRecords", "DETAILS_PER_REASON"]

DETAILS_PER_REASON = 3
"""How many skips of each reason a chunk keeps the detail of: as many as `stats()` shows examples
of per dataset and reason (`_skip_examples`), so the loader finds the details of its first examples
in the chunk that skipped them. A bound, so that a chunk of thousands of bad records carries a few
strings back from a worker, and a detail made on demand (the fields a record has) is made for few."""


@dataclass(frozen=True, order=True)
class RecordAddress:
    """Where a record lives: dataset name, shard URL and the record's index inside that shard."""

    dataset: str
    shard: str
    index: int

    def __str__(self) -> str:
        return f"{self.dataset}:{self.shard}#{self.index}"


@dataclass(frozen=True, order=True)
class Chunk:
    """A contiguous record range [start, stop) of one shard (by position in `Dataset.shards`)."""

    dataset: str
    shard: int
    start: int
    stop: int

    @property
    def num_records(self) -> int:
        return self.stop - self.start


@dataclass
class ChunkRecords:
    """The records of one chunk after some stateless stages, in shard order.

    `records[i]` lives at `addresses[i]`. `skipped` lists (address, reason) for every record a stage
    dropped; `filtered` counts records a user filter removed. Both are carried to the ledger.
    `skip_details` holds, per reason, {address: detail} of the first `DETAILS_PER_REASON` records
    skipped for it (`skip_one`, `skip`; "" where the stage gave no detail), for `stats()`'s examples.
    """

    chunk: Chunk
    records: list[dict[str, Any]] = field(default_factory=list)
    addresses: list[RecordAddress] = field(default_factory=list)
    skipped: list[tuple[RecordAddress, str]] = field(default_factory=list)
    filtered: list[RecordAddress] = field(default_factory=list)
    skip_details: dict[str, dict[RecordAddress, str]] = field(default_factory=dict)

    def skip_one(self, address: RecordAddress, reason: str, detail: str | Callable[[], str]) -> None:
        """Count the record at `address` as skipped for `reason`, keeping its `detail` (a string, or
        a function making it, called only if it is kept) if fewer of that reason have one here."""
        self.skipped.append((address, reason))
        details = self.skip_details.setdefault(reason, {})
        if len(details) < DETAILS_PER_REASON:
            details[address] = detail if isinstance(detail, str) else detail()

    def keep(self, keep_mask: list[bool]) -> None:
        """Drop the records whose mask entry is False, counting them as filtered."""
        self._drop([None if keep else "filtered" for keep in keep_mask], filtered=True)

    def skip(self, reasons: list[str | None], detail: Callable[[str, dict], str] | None = None) -> None:
        """Drop the records that have a reason, counting each as skipped for it, in record order;
        `detail(reason, record)` says what was wrong, asked only for the details kept (`skip_one`)."""
        self._drop(reasons, filtered=False, detail=detail)

    def _drop(self, reasons: list[str | None], *, filtered: bool, detail=None) -> None:
        records, addresses = [], []
        skipped, details = self.skipped, self.skip_details
        for reason, record, address in zip(reasons, self.records, self.addresses):
            if reason is None:
                records.append(record)
                addresses.append(address)
            elif filtered:
                self.filtered.append(address)
            else:  # `skip_one` written out: this runs per skipped record, a call and a closure each cost
                skipped.append((address, reason))
                kept = details.get(reason)
                if kept is None:
                    kept = details[reason] = {}
                if len(kept) < DETAILS_PER_REASON:
                    kept[address] = "" if detail is None else detail(reason, record)
        self.records, self.addresses = records, addresses
