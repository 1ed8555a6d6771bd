"""`DroppedDatasets` warns of a mixture dataset only once every lane of the rank has read its whole
share of it with every record dropped: lanes read at their own pace, and one lane reading its all-bad
share twice over is not a pass of the rank's share while another lane has not yet reached its own."""

from __future__ import annotations

import logging

from zephon._dropped_datasets import DroppedDatasets
from zephon._records import Chunk, ChunkRecords, RecordAddress

SHARE = 16  # records of dataset "d" dealt to each of the two lanes


def all_dropped(start: int) -> ChunkRecords:
    """A chunk of "d" whose every record was skipped as missing_field."""
    batch = ChunkRecords(Chunk("d", 0, start, start + SHARE))
    batch.skipped = [(RecordAddress("d", "shard-0", i), "missing_field") for i in range(start, start + SHARE)]
    return batch


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "was dropped" in r.getMessage()]


def watch() -> DroppedDatasets:
    return DroppedDatasets({"d": {0: SHARE, 1: SHARE}}, {"d": "0.4"}, logging.getLogger("zephon"))


def test_one_lane_reading_its_share_again_is_not_a_pass_of_the_ranks_share(caplog):
    watched = watch()
    with caplog.at_level(logging.WARNING, logger="zephon"):
        for _ in range(3):  # lane 0 reads its all-dropped share three times; lane 1 has read none of "d"
            watched.note_chunk(0, all_dropped(0))
        assert not warnings(caplog), "lane 1's share, unread, may hold every good record"
        watched.note_chunk(1, all_dropped(SHARE))
    (line,) = warnings(caplog)
    assert "every one of the 64 records" in line and "(missing_field: 64)" in line, line


def test_the_ledgers_counts_taken_up_are_counted_per_lane_too(caplog):
    watched = watch()
    lanes = {0: {"read": 3 * SHARE, "emitted": 0, "skipped": {"missing_field": 3 * SHARE}}}
    with caplog.at_level(logging.WARNING, logger="zephon"):
        watched.recount({"d": {"lanes": lanes, "total": lanes[0]}})
        assert not warnings(caplog)
        lanes[1] = {"read": SHARE, "emitted": 0, "skipped": {"missing_field": SHARE}}
        watched.recount({"d": {"lanes": lanes, "total": {"read": 4 * SHARE, "emitted": 0,
                                                         "skipped": {"missing_field": 4 * SHARE}}}})
    assert len(warnings(caplog)) == 1
