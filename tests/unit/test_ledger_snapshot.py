"""A ledger snapshot (what `stats()` returns) taken on another thread shows whole counting steps.

A monitor reads `stats()` while the trainer's thread counts chunks, skips and settles. The ledger
counted each step in place, key by key: a snapshot landing inside one showed a chunk's records
read but not yet skipped, or a skip taken from `emitted` but not yet added to `skipped`, and the
counts of a dataset no longer balanced. Each test pauses one side at a chosen point, through a
hook in the data it reads (a reason's `__format__`, a dataset name's `__hash__`), and runs the
other side on a thread of its own meanwhile: the interleaving is the same on every run.
"""

from __future__ import annotations

import threading

from zephon._ledger import Ledger
from zephon._records import Chunk, ChunkRecords, RecordAddress


def _on_another_thread(call):
    """`call()` run to its end on a thread of its own, while this one waits: what it returns."""
    out = []
    thread = threading.Thread(target=lambda: out.append(call()))
    thread.start()
    thread.join()
    return out[0]


class _ReasonSnapshotWhenCounted(str):
    """A skip reason that, when the ledger formats it to count the skip, has another thread take a
    snapshot of `ledger` first (into `taken`)."""

    def __new__(cls, reason: str, ledger: Ledger, taken: list):
        self = super().__new__(cls, reason)
        self.ledger, self.taken = ledger, taken
        return self

    def __format__(self, spec: str) -> str:
        self.taken.append(_on_another_thread(self.ledger.snapshot))
        return format(str(self), spec)


def _chunk(dataset: str, records: int, skipped: list) -> ChunkRecords:
    chunk = Chunk(dataset, 0, 0, records + len(skipped))
    addresses = [RecordAddress(dataset, "s", i) for i in range(chunk.num_records)]
    return ChunkRecords(
        chunk,
        records=[{}] * records,
        addresses=addresses[:records],
        skipped=list(zip(addresses[records:], skipped)),
    )


def _balances(counts: dict) -> bool:
    return counts["read"] == counts["emitted"] + counts["filtered"] + sum(counts["skipped"].values())


def test_a_snapshot_taken_while_a_chunk_is_counted_shows_the_chunk_whole_or_not_at_all():
    ledger, taken = Ledger(), []
    ledger.count_chunk(0, 0, _chunk("d", 4, []))
    ledger.count_chunk(0, 0, _chunk("d", 2, [_ReasonSnapshotWhenCounted("malformed_json", ledger, taken)]))
    assert taken and all(_balances(snapshot["datasets"]["d"]["total"]) for snapshot in taken)
    assert taken[0]["datasets"]["d"]["total"]["read"] in (4, 7)
    assert ledger.snapshot()["datasets"]["d"]["total"] == {
        "read": 7, "emitted": 6, "filtered": 0, "skipped": {"malformed_json": 1}
    }


def test_a_snapshot_taken_while_an_accumulator_s_skips_are_counted_shows_them_whole_or_not_at_all():
    ledger, taken = Ledger(), []
    ledger.count_chunk(0, 0, _chunk("a", 3, []))
    ledger.count_chunk(0, 0, _chunk("b", 3, []))
    skips = [
        (RecordAddress("a", "s", 0), "too_long"),
        (RecordAddress("b", "s", 1), _ReasonSnapshotWhenCounted("too_long", ledger, taken)),
    ]
    ledger.count_skips(0, 0, skips)
    assert taken
    for snapshot in taken:
        totals = snapshot["datasets"]
        assert _balances(totals["a"]["total"]) and _balances(totals["b"]["total"])
        assert totals["a"]["total"]["emitted"] == totals["b"]["total"]["emitted"]  # both skips, or neither
    after = ledger.snapshot()["datasets"]
    assert after["a"]["total"]["skipped"] == after["b"]["total"]["skipped"] == {"too_long": 1}


class _DatasetSettledWhenHashed(str):
    """A dataset name that, hashed while `armed`, has another thread settle lane 0 of `ledger` up
    to `segment` first, once: the loader's thread moving on while a snapshot walks the counts."""

    armed = False

    def __new__(cls, name: str, ledger: Ledger, segment: int):
        self = super().__new__(cls, name)
        self.ledger, self.segment = ledger, segment
        return self

    def __hash__(self) -> int:
        if _DatasetSettledWhenHashed.armed:
            _DatasetSettledWhenHashed.armed = False
            _on_another_thread(lambda: self.ledger.settle(0, self.segment))
        return str.__hash__(self)

    __eq__ = str.__eq__


def test_a_segment_settled_while_a_snapshot_is_taken_is_in_it_once():
    """The snapshot read the settled counts, then the open ones: a settle in between moved a
    segment from the open counts to the settled ones after the snapshot had read the settled, and
    the snapshot showed that segment's records nowhere."""
    ledger = Ledger()
    dataset = _DatasetSettledWhenHashed("d", ledger, segment=2)
    for segment in range(3):
        ledger.count_chunk(0, segment, _chunk(dataset, 5, []))
    ledger.settle(0, 1)
    _DatasetSettledWhenHashed.armed = True
    try:
        snapshot = ledger.snapshot()
    finally:
        armed, _DatasetSettledWhenHashed.armed = _DatasetSettledWhenHashed.armed, False
    assert not armed  # the settle came while the snapshot was taken
    assert snapshot["datasets"]["d"]["total"]["read"] == 15
    assert ledger.snapshot()["datasets"]["d"]["total"]["read"] == 15
