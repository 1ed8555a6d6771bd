"""What flows between a reader and the operators: records with their address, and counted skips.

A chunk of records is the unit of work that is numbered, dispatched to workers and put back in
order. Skips travel with the chunk that produced them so that the ledger never loses one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["RecordAddress", "Chunk", "ChunkRecords"]


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
    """

    chunk: Chunk
    records: list[dict[str, Any]] = field(default_factory=list)
    addresses: list[RecordAddress] = field(default_factory=list)
    skipped: list[tuple[RecordAddress, str]] = field(default_factory=list)
    filtered: list[RecordAddress] = field(default_factory=list)

    def keep(self, keep_mask: list[bool]) -> None:
        """Drop the records whose mask entry is False, counting them as filtered."""
        self._drop([None if keep else "filtered" for keep in keep_mask], filtered=True)

    def skip(self, reasons: list[str | None]) -> None:
        """Drop the records that have a reason, counting each as skipped for it, in record order."""
        self._drop(reasons, filtered=False)

    def _drop(self, reasons: list[str | None], *, filtered: bool) -> None:
        records, addresses = [], []
        for reason, record, address in zip(reasons, self.records, self.addresses):
            if reason is None:
                records.append(record)
                addresses.append(address)
            elif filtered:
                self.filtered.append(address)
            else:
                self.skipped.append((address, reason))
        self.records, self.addresses = records, addresses
