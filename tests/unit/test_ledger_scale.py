"""The ledger's work per lane does not grow with the rank's other lanes.

A rank may own hundreds of lanes (1,024 lanes on one rank, or on each of a few): `state_dict`
settles every lane, and the loader settles a lane each time it enters a new segment. Keyed by
(lane, segment), every settle walked the open counts of all the rank's lanes to find its own,
so a save took time in the square of the lanes (1,024 lanes: 0.28 of 0.35 s of `state_dict`).
"""

from __future__ import annotations

from zephon._ledger import Ledger
from zephon._records import Chunk, ChunkRecords


class _CountedLane(int):
    """A lane number that counts how often it is compared for equality."""

    comparisons = 0

    def __eq__(self, other):
        _CountedLane.comparisons += 1
        return int.__eq__(self, other)

    __hash__ = int.__hash__


def _ledger_with_open_segments(lanes: list[int], segments: int) -> Ledger:
    ledger = Ledger()
    for lane in lanes:
        for segment in range(segments):
            ledger.count_chunk(lane, segment, ChunkRecords(Chunk("d", 0, 0, 2), records=[{}, {}]))
    return ledger


def test_saving_every_lane_compares_each_lane_with_no_other_lane():
    lanes = [_CountedLane(lane) for lane in range(64)]
    ledger = _ledger_with_open_segments(lanes, segments=3)
    _CountedLane.comparisons = 0
    states = [ledger.lane_state(lane, 2) for lane in lanes]
    assert _CountedLane.comparisons <= len(lanes)
    assert all(state["records"] == {"d": {"emitted": 4, "filtered": 0, "read": 4}} for state in states)


def test_replaying_and_restoring_a_lane_compares_it_with_no_other_lane():
    lanes = [_CountedLane(lane) for lane in range(64)]
    ledger = _ledger_with_open_segments(lanes, segments=3)
    _CountedLane.comparisons = 0
    ledger.replay(lanes[5], 1)
    ledger.restore(lanes[6], {"records": {"d": {"read": 9}}, "rows": {}})
    assert _CountedLane.comparisons <= 2
    totals = ledger.snapshot()["datasets"]["d"]["lanes"]
    assert totals[5]["read"] == 2 and totals[6]["read"] == 9 and totals[7]["read"] == 6
